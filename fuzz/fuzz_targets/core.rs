//! Fuzz target `core`: see `felix_fuzz::machine` (fuzz/src/machine.rs) for the input format and the
//! invariants checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| felix_fuzz::machine::run(data));
