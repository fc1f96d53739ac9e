//! The exclusive lock of a log directory: `<dir>/lock`, held with `flock(LOCK_EX)` by the one
//! process that may change the directory. [`crate::Log::open`] takes it (so a broker holds the
//! lock of every core's log for as long as it runs) and the offline commands (`check`, `repair`,
//! `compact` in `offline.rs`) take it too, so they refuse to run next to a broker, and a broker
//! refuses to start while one of them runs.
//!
//! `flock` locks belong to the open file description: the kernel drops the lock when the
//! process dies (SIGKILL included), so a crash never leaves a stale lock behind, and a second
//! `open` in the same process conflicts like another process would.
//!
//! Threads: taken and released on whichever thread opens or drops the log.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::StorageError;

/// File name of the lock in a log directory.
pub const LOCK_FILE: &str = "lock";

/// A held lock; dropping it releases the lock (closing the file).
#[derive(Debug)]
pub struct DirLock {
    dir: PathBuf,
    _file: File,
}

impl DirLock {
    /// Takes the lock of `dir` (created if missing) without waiting: another holder is
    /// [`StorageError::Locked`].
    pub fn acquire(dir: &Path) -> Result<DirLock, StorageError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StorageError::io(format!("create {}", dir.display()), e))?;
        let path = dir.join(LOCK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| StorageError::io(format!("open {}", path.display()), e))?;
        // SAFETY: flock on a valid fd borrowed from `file` for the call; no memory is passed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let error = std::io::Error::last_os_error();
            if error.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(StorageError::Locked {
                    dir: dir.to_owned(),
                    lock_file: path,
                });
            }
            return Err(StorageError::io(format!("lock {}", path.display()), error));
        }
        Ok(DirLock {
            dir: dir.to_owned(),
            _file: file,
        })
    }

    /// The locked directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_holder_is_refused_until_the_first_drops() {
        // A held lock refuses a second taker (even in the same process) and is free again once dropped.
        let dir = tempfile::tempdir().expect("tempdir");
        let first = DirLock::acquire(dir.path()).expect("first");
        let second = DirLock::acquire(dir.path()).expect_err("held");
        assert!(matches!(second, StorageError::Locked { .. }), "{second}");
        assert!(second.to_string().contains("lock"), "{second}");
        drop(first);
        let again = DirLock::acquire(dir.path()).expect("free again");
        assert_eq!(again.dir(), dir.path());
    }
}
