//! The harnesses of Felix's fuzz targets (docs/design/fuzzing.md). Each module's `run(data)`
//! is one fuzz iteration; `fuzz_targets/*.rs` are one-line libFuzzer entry points, and the
//! regression tests of the crates under test include these same files to replay
//! `fuzz/regressions/<target>/` and `fuzz/corpus/<target>/` under `cargo test`.
//!
//! Nothing here depends on more than the crates under test already do (the fuzzer's bytes are
//! read with [`input::Input`], not the `arbitrary` crate), so those includes need no new
//! dependency.

pub mod decode;
pub mod input;
pub mod machine;
pub mod recovery;
