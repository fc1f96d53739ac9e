//! Fuzz target `recovery`: see `felix_fuzz::recovery` (fuzz/src/recovery.rs) for the input format and the
//! invariants checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| felix_fuzz::recovery::run(data));
