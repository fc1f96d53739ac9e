//! The durable catalogue: which durable streams exist (name, shard count, catalogue stream
//! id), persisted in `<data_dir>/catalog.json`.
//!
//! Loaded by the shell at start-up (every core restores its entries) and written by core 0's
//! shell when core 0's state machine asks for a change ([`crate::CatalogWrite`]), *before*
//! the change is applied or acknowledged. A change is written atomically: the new catalogue
//! goes to a temporary file, which is fsynced, renamed over `catalog.json`, and the directory
//! is fsynced, so after a crash (SIGKILL or power loss) the file holds either the old or the
//! new catalogue, never a mix.
//!
//! Stream ids are never reused: `next_stream_id` is persisted and only grows, so a log shard
//! id (`stream_id << 12 | shard`) of a deleted stream can never name a new stream's records
//! that retention has not yet removed.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use felix_engine::DURABLE_STREAM_ID_MAX;
use serde::{Deserialize, Serialize};

/// File name of the catalogue in the data directory.
pub const CATALOG_FILE: &str = "catalog.json";
/// Temporary file a new catalogue is written to before the rename.
const CATALOG_TEMP_FILE: &str = "catalog.json.tmp";
/// Version of the file format; a file of another version stops start-up.
const CATALOG_VERSION: u32 = 1;
/// Largest catalogue file read at start-up: 64 MiB is ~500,000 streams at ~100 bytes each,
/// far beyond the 2^20 stream ids' practical use; bigger means the file is not ours.
const CATALOG_BYTES_MAX: u64 = 64 << 20;

/// Why the catalogue cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("durable catalogue {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

/// A change core 0 asks its shell to persist ([`crate::CatalogWrite`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CatalogChange {
    /// A new durable stream; its id is the catalogue's next stream id.
    Add(CatalogEntry),
    Remove {
        name: String,
    },
}

/// One durable stream of the catalogue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogEntry {
    pub name: String,
    pub shards: u32,
    /// Never reused; the stream's log shard ids derive from it.
    pub stream_id: u32,
}

/// The file's content.
#[derive(Debug, Serialize, Deserialize)]
struct CatalogFile {
    version: u32,
    /// The id the next created stream gets; only grows.
    next_stream_id: u32,
    /// Data-plane cores the logs were written with (0: not yet bound). Shard `s` lives in
    /// the log of core `s % cores`, so the count must not change while streams exist.
    #[serde(default)]
    cores: u16,
    streams: Vec<CatalogEntry>,
}

/// The catalogue of durable streams, loaded from and written to one data directory.
#[derive(Debug)]
pub struct Catalog {
    dir: PathBuf,
    next_stream_id: u32,
    cores: u16,
    /// By name: at most one stream of a name.
    streams: BTreeMap<String, CatalogEntry>,
}

impl Catalog {
    /// Loads `<data_dir>/catalog.json` (an absent file is an empty catalogue), removing a
    /// temporary file a crash left behind (its rename never happened, so its change was never
    /// acknowledged). A malformed file stops start-up: guessing would risk reusing stream ids.
    pub fn load(data_dir: &Path) -> Result<Catalog, CatalogError> {
        fs::create_dir_all(data_dir).map_err(|source| CatalogError::Write {
            path: data_dir.to_owned(),
            source,
        })?;
        let temp = data_dir.join(CATALOG_TEMP_FILE);
        match fs::remove_file(&temp) {
            Ok(()) => {
                tracing::info!(path = %temp.display(), "removed an unfinished catalogue write")
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(CatalogError::Write { path: temp, source }),
        }
        let path = data_dir.join(CATALOG_FILE);
        let text = match read_bounded(&path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Catalog {
                    dir: data_dir.to_owned(),
                    next_stream_id: 0,
                    cores: 0,
                    streams: BTreeMap::new(),
                });
            }
            Err(source) => return Err(CatalogError::Read { path, source }),
        };
        let bad = |reason: String| CatalogError::Invalid {
            path: data_dir.join(CATALOG_FILE),
            reason,
        };
        let file: CatalogFile = serde_json::from_str(&text)
            .map_err(|error| bad(format!("not a catalogue: {error}")))?;
        if file.version != CATALOG_VERSION {
            return Err(bad(format!(
                "version {} is not the supported version {CATALOG_VERSION}",
                file.version
            )));
        }
        let mut streams = BTreeMap::new();
        for entry in file.streams {
            if entry.stream_id >= file.next_stream_id {
                return Err(bad(format!(
                    "stream {:?} has id {} at or past next_stream_id {}",
                    entry.name, entry.stream_id, file.next_stream_id
                )));
            }
            if entry.shards == 0 {
                return Err(bad(format!("stream {:?} has no shards", entry.name)));
            }
            if streams
                .values()
                .any(|other: &CatalogEntry| other.stream_id == entry.stream_id)
            {
                return Err(bad(format!(
                    "stream id {} is listed twice",
                    entry.stream_id
                )));
            }
            if let Some(other) = streams.insert(entry.name.clone(), entry) {
                return Err(bad(format!("stream {:?} is listed twice", other.name)));
            }
        }
        Ok(Catalog {
            dir: data_dir.to_owned(),
            next_stream_id: file.next_stream_id,
            cores: file.cores,
            streams,
        })
    }

    /// Checks that the logs were written with `cores` data-plane cores and records the count
    /// for later starts. A different count while durable streams exist stops start-up: their
    /// shards' records are in the logs of the cores that owned them (`shard % cores`).
    pub fn bind_cores(&mut self, cores: u16) -> Result<(), CatalogError> {
        assert!(cores > 0, "a broker has at least one data-plane core");
        if self.cores == cores {
            return Ok(());
        }
        if self.cores != 0 && !self.streams.is_empty() {
            return Err(CatalogError::Invalid {
                path: self.dir.join(CATALOG_FILE),
                reason: format!(
                    "the durable streams were written by {} data-plane cores, this start has {cores}; \
                     set FELIX_DATAPLANE_CORES to {} (shards are stored by their owner core)",
                    self.cores, self.cores
                ),
            });
        }
        let previous = self.cores;
        self.cores = cores;
        if let Err(error) = self.persist() {
            self.cores = previous;
            return Err(error);
        }
        Ok(())
    }

    /// Every durable stream, by name.
    pub fn entries(&self) -> impl Iterator<Item = &CatalogEntry> {
        self.streams.values()
    }

    /// The entry of `name`, if it is a durable stream.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&CatalogEntry> {
        self.streams.get(name)
    }

    /// The id the next created stream will get.
    #[must_use]
    pub fn next_stream_id(&self) -> u32 {
        self.next_stream_id
    }

    /// Adds a stream with a fresh id and persists the catalogue before returning (the caller
    /// acknowledges the create only after this). On any error nothing changed, in memory or
    /// on disk. The caller checked the name and shard count (the engine's rules).
    pub fn add(&mut self, name: &str, shards: u32) -> Result<CatalogEntry, CatalogError> {
        assert!(shards > 0, "the engine refuses streams without shards");
        if self.streams.contains_key(name) {
            return Err(CatalogError::Invalid {
                path: self.dir.join(CATALOG_FILE),
                reason: format!("stream {name:?} is already in the catalogue"),
            });
        }
        let stream_id = self.next_stream_id;
        if stream_id > DURABLE_STREAM_ID_MAX {
            return Err(CatalogError::Invalid {
                path: self.dir.join(CATALOG_FILE),
                reason: format!(
                    "every durable stream id up to {DURABLE_STREAM_ID_MAX} has been used"
                ),
            });
        }
        let entry = CatalogEntry {
            name: name.to_owned(),
            shards,
            stream_id,
        };
        self.streams.insert(name.to_owned(), entry.clone());
        self.next_stream_id = stream_id + 1;
        if let Err(error) = self.persist() {
            self.streams.remove(name);
            self.next_stream_id = stream_id;
            return Err(error);
        }
        Ok(entry)
    }

    /// Persists a change core 0 asked for. An `Add` must carry the catalogue's next stream id
    /// (core 0 assigns ids in the same order); on any error nothing changed.
    pub fn apply(&mut self, change: &CatalogChange) -> Result<(), CatalogError> {
        match change {
            CatalogChange::Add(entry) => {
                if entry.stream_id != self.next_stream_id {
                    return Err(CatalogError::Invalid {
                        path: self.dir.join(CATALOG_FILE),
                        reason: format!(
                            "stream {:?} was given id {}, the catalogue's next id is {}",
                            entry.name, entry.stream_id, self.next_stream_id
                        ),
                    });
                }
                self.add(&entry.name, entry.shards).map(|_| ())
            }
            CatalogChange::Remove { name } => self.remove(name).map(|_| ()),
        }
    }

    /// Removes a stream and persists the catalogue; `Ok(None)` when it was not listed. Its id
    /// stays used. On any error nothing changed.
    pub fn remove(&mut self, name: &str) -> Result<Option<CatalogEntry>, CatalogError> {
        let Some(entry) = self.streams.remove(name) else {
            return Ok(None);
        };
        if let Err(error) = self.persist() {
            self.streams.insert(name.to_owned(), entry);
            return Err(error);
        }
        Ok(Some(entry))
    }

    /// Writes the catalogue atomically: temp file, fsync, rename, fsync of the directory.
    fn persist(&self) -> Result<(), CatalogError> {
        let file = CatalogFile {
            version: CATALOG_VERSION,
            next_stream_id: self.next_stream_id,
            cores: self.cores,
            streams: self.streams.values().cloned().collect(),
        };
        // Serializing plain strings and integers cannot fail.
        let mut text = serde_json::to_vec_pretty(&file).map_err(|error| CatalogError::Invalid {
            path: self.dir.join(CATALOG_FILE),
            reason: format!("cannot encode: {error}"),
        })?;
        text.push(b'\n');
        let temp = self.dir.join(CATALOG_TEMP_FILE);
        let write_error = |path: &Path, source: std::io::Error| CatalogError::Write {
            path: path.to_owned(),
            source,
        };
        let mut out = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temp)
            .map_err(|source| write_error(&temp, source))?;
        out.write_all(&text)
            .map_err(|source| write_error(&temp, source))?;
        out.sync_all()
            .map_err(|source| write_error(&temp, source))?;
        drop(out);
        let path = self.dir.join(CATALOG_FILE);
        fs::rename(&temp, &path).map_err(|source| write_error(&path, source))?;
        File::open(&self.dir)
            .and_then(|dir| dir.sync_all())
            .map_err(|source| write_error(&self.dir, source))?;
        Ok(())
    }
}

/// Reads a file of at most [`CATALOG_BYTES_MAX`].
fn read_bounded(path: &Path) -> std::io::Result<String> {
    let size = fs::metadata(path)?.len();
    if size > CATALOG_BYTES_MAX {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{size} bytes, over the limit of {CATALOG_BYTES_MAX}"),
        ));
    }
    fs::read_to_string(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_remove_and_reload() {
        // Entries survive a reload, ids grow, and a deleted stream's id is not reused.
        let dir = tempfile::tempdir().expect("temp dir");
        let mut catalog = Catalog::load(dir.path()).expect("empty catalogue loads");
        assert_eq!(catalog.entries().count(), 0);
        let a = catalog.add("a", 4).expect("added");
        let b = catalog.add("b", 1).expect("added");
        assert_eq!((a.stream_id, b.stream_id), (0, 1));
        assert_eq!(catalog.remove("a").expect("removed"), Some(a));
        assert_eq!(catalog.remove("a").expect("no-op"), None);
        let c = catalog.add("a", 2).expect("re-added");
        assert_eq!(c.stream_id, 2, "the deleted stream's id is not reused");

        let reloaded = Catalog::load(dir.path()).expect("reloads");
        assert_eq!(reloaded.next_stream_id(), 3);
        let entries: Vec<_> = reloaded.entries().cloned().collect();
        assert_eq!(entries, vec![c, b]);
        assert!(!dir.path().join(CATALOG_TEMP_FILE).exists());
    }

    #[test]
    fn core_count_is_bound_while_streams_exist() {
        // The core count is recorded; another count is refused once a stream exists.
        let dir = tempfile::tempdir().expect("temp dir");
        let mut catalog = Catalog::load(dir.path()).expect("loads");
        catalog.bind_cores(2).expect("first binding");
        catalog
            .bind_cores(3)
            .expect("no streams yet: rebinding is fine");
        catalog.add("a", 4).expect("added");
        let mut reloaded = Catalog::load(dir.path()).expect("reloads");
        reloaded.bind_cores(3).expect("same count");
        let error = reloaded.bind_cores(2).expect_err("changed count");
        assert!(
            error.to_string().contains("FELIX_DATAPLANE_CORES"),
            "{error}"
        );
    }

    #[test]
    fn leftover_temp_file_is_ignored_and_removed() {
        // A crash between the temp write and the rename leaves the old catalogue in force.
        let dir = tempfile::tempdir().expect("temp dir");
        let mut catalog = Catalog::load(dir.path()).expect("loads");
        catalog.add("kept", 3).expect("added");
        fs::write(
            dir.path().join(CATALOG_TEMP_FILE),
            b"{\"version\":1,\"next_stre",
        )
        .expect("torn temp written");
        let reloaded = Catalog::load(dir.path()).expect("loads despite the temp file");
        assert_eq!(reloaded.get("kept").map(|e| e.shards), Some(3));
        assert!(!dir.path().join(CATALOG_TEMP_FILE).exists());
    }

    #[test]
    fn malformed_catalogue_stops_start_up() {
        // A corrupt or inconsistent file is an error naming the file, never an empty catalogue.
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join(CATALOG_FILE);
        for text in [
            "not json",
            r#"{"version":2,"next_stream_id":0,"streams":[]}"#,
            r#"{"version":1,"next_stream_id":1,"streams":[{"name":"a","shards":1,"stream_id":1}]}"#,
            r#"{"version":1,"next_stream_id":5,"streams":[{"name":"a","shards":1,"stream_id":1},{"name":"b","shards":1,"stream_id":1}]}"#,
            r#"{"version":1,"next_stream_id":5,"streams":[{"name":"a","shards":0,"stream_id":1}]}"#,
        ] {
            fs::write(&path, text).expect("written");
            let error = Catalog::load(dir.path()).expect_err(text);
            assert!(error.to_string().contains("catalog.json"), "{error}");
        }
    }

    #[test]
    fn failed_persist_changes_nothing() {
        // When the write fails the in-memory catalogue is unchanged (the create is refused).
        let dir = tempfile::tempdir().expect("temp dir");
        let mut catalog = Catalog::load(dir.path()).expect("loads");
        catalog.add("a", 1).expect("added");
        // A directory where the temp file goes makes the write fail.
        fs::create_dir(dir.path().join(CATALOG_TEMP_FILE)).expect("blocker created");
        catalog.add("b", 1).expect_err("write fails");
        assert!(catalog.get("b").is_none());
        assert_eq!(catalog.next_stream_id(), 1);
        catalog.remove("a").expect_err("write fails");
        assert!(catalog.get("a").is_some());
        fs::remove_dir(dir.path().join(CATALOG_TEMP_FILE)).expect("blocker removed");
        assert_eq!(catalog.add("b", 1).expect("added").stream_id, 1);
    }
}
