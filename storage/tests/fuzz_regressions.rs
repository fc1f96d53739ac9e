//! Replays the inputs of the `recovery` fuzz target under `cargo test`: every file of
//! `fuzz/regressions/recovery/` (inputs that once crashed it, kept so the bug stays fixed) and
//! of its seed corpus `fuzz/corpus/recovery/`, through the very harness the fuzzer runs
//! (`fuzz/src/recovery.rs` and `fuzz/src/input.rs`, included as they are). See
//! docs/design/fuzzing.md.

#[allow(dead_code)]
#[path = "../../fuzz/src/input.rs"]
mod input;
#[allow(dead_code)]
#[path = "../../fuzz/src/recovery.rs"]
mod recovery;

use std::path::{Path, PathBuf};

/// Runs `run` on every file of `fuzz/<dir>` (none if the folder does not exist and
/// `required` is false) and fails naming each input that panicked.
fn replay(dir: &str, required: bool, run: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz")
        .join(dir);
    let mut files: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries
            .map(|entry| entry.expect("a directory entry").path())
            .filter(|path| {
                path.is_file()
                    && !path
                        .file_name()
                        .is_some_and(|name| name.to_string_lossy().starts_with('.'))
            })
            .collect(),
        Err(_) if !required => return,
        Err(error) => panic!("{}: {error}", dir.display()),
    };
    files.sort();
    assert!(!required || !files.is_empty(), "{} is empty", dir.display());
    let failed: Vec<String> = files
        .iter()
        .filter(|path| {
            let data = std::fs::read(path).expect("read an input");
            std::panic::catch_unwind(|| run(&data)).is_err()
        })
        .map(|path| path.display().to_string())
        .collect();
    assert!(failed.is_empty(), "inputs that fail: {failed:#?}");
}

#[test]
fn recovery_regressions_stay_fixed() {
    replay("regressions/recovery", false, recovery::run);
}

#[test]
fn recovery_seed_corpus_passes() {
    replay("corpus/recovery", true, recovery::run);
}
