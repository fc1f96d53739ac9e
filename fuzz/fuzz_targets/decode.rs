//! Fuzz target `decode`: see `felix_fuzz::decode` (fuzz/src/decode.rs) for the input format and the
//! invariants checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| felix_fuzz::decode::run(data));
