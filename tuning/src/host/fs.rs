//! The host's `/proc`, `/sys` and `/etc/systemd` trees as seen by the tuners: [`RealFs`] on a
//! host, [`MemFs`] in tests.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// All file access of the tuners goes through this, so tests run against an in-memory tree.
/// Paths are absolute host paths (`/proc/sys/net/core/rmem_max`).
pub trait HostFs {
    /// The whole contents of a file.
    fn read(&self, path: &Path) -> io::Result<String>;
    /// Replaces the contents of an existing file (a sysfs or procfs attribute).
    fn write(&self, path: &Path, value: &str) -> io::Result<()>;
    /// The names of a directory's entries, sorted.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// The target of a symbolic link (`InvalidInput` when `path` is not a link).
    fn read_link(&self, path: &Path) -> io::Result<PathBuf>;
    /// Creates the symbolic link `link` pointing at `target`.
    fn symlink(&self, target: &Path, link: &Path) -> io::Result<()>;
}

/// The real host, through `std::fs`.
#[derive(Clone, Copy, Debug, Default)]
pub struct RealFs;

impl HostFs for RealFs {
    fn read(&self, path: &Path) -> io::Result<String> {
        fs::read_to_string(path)
    }

    fn write(&self, path: &Path, value: &str) -> io::Result<()> {
        // No create: a missing attribute stays missing instead of becoming a regular file.
        let mut file = fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(path)?;
        io::Write::write_all(&mut file, value.as_bytes())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs::read_dir(dir)? {
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }

    fn read_link(&self, path: &Path) -> io::Result<PathBuf> {
        fs::read_link(path)
    }

    #[cfg(unix)]
    fn symlink(&self, target: &Path, link: &Path) -> io::Result<()> {
        std::os::unix::fs::symlink(target, link)
    }

    #[cfg(not(unix))]
    fn symlink(&self, _target: &Path, _link: &Path) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "symbolic links need unix",
        ))
    }
}

/// A copy of the host's trees under a folder (`DIR/proc/sys/...`): what `FELIX_TUNE_ROOT`
/// gives the rendered script, for tests that compare the two and for image builds.
#[derive(Clone, Debug)]
pub struct RootFs {
    root: PathBuf,
}

impl RootFs {
    /// The tree under `root`.
    #[must_use]
    pub fn new(root: impl Into<PathBuf>) -> RootFs {
        RootFs { root: root.into() }
    }

    fn at(&self, path: &Path) -> PathBuf {
        self.root.join(path.strip_prefix("/").unwrap_or(path))
    }
}

impl HostFs for RootFs {
    fn read(&self, path: &Path) -> io::Result<String> {
        RealFs.read(&self.at(path))
    }

    fn write(&self, path: &Path, value: &str) -> io::Result<()> {
        RealFs.write(&self.at(path), value)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        RealFs.list(&self.at(dir))
    }

    fn read_link(&self, path: &Path) -> io::Result<PathBuf> {
        RealFs.read_link(&self.at(path))
    }

    fn symlink(&self, target: &Path, link: &Path) -> io::Result<()> {
        RealFs.symlink(target, &self.at(link))
    }
}

#[derive(Clone, Debug)]
enum Node {
    File(String),
    Link(PathBuf),
    Dir,
}

/// An in-memory tree for tests. Directories exist implicitly above every file (or explicitly
/// with [`MemFs::with_dir`]); links are followed in the middle of a path and `..` steps up,
/// as in sysfs (`/sys/class/net/ens3/device/../msi_irqs`). Reads of missing paths fail with
/// `NotFound`, writes never create files, and a path can be made to fail writes with a chosen
/// errno ([`MemFs::read_only`] is `EACCES`).
#[derive(Debug, Default)]
pub struct MemFs {
    nodes: Mutex<BTreeMap<PathBuf, Node>>,
    write_errors: BTreeMap<PathBuf, i32>,
}

impl MemFs {
    /// An empty tree.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a file.
    #[must_use]
    pub fn with_file(self, path: impl AsRef<Path>, text: &str) -> Self {
        self.insert(path.as_ref(), Node::File(text.to_owned()));
        self
    }

    /// Adds a symbolic link.
    #[must_use]
    pub fn with_link(self, path: impl AsRef<Path>, target: impl AsRef<Path>) -> Self {
        self.insert(path.as_ref(), Node::Link(target.as_ref().to_owned()));
        self
    }

    /// Adds an (empty) directory.
    #[must_use]
    pub fn with_dir(self, path: impl AsRef<Path>) -> Self {
        self.insert(path.as_ref(), Node::Dir);
        self
    }

    /// Makes writes (and link creation) at `path` fail with `EACCES`.
    #[must_use]
    pub fn read_only(self, path: impl AsRef<Path>) -> Self {
        self.with_write_error(path, libc::EACCES)
    }

    /// Makes writes (and link creation) at `path` fail with the OS error `errno`.
    #[must_use]
    pub fn with_write_error(mut self, path: impl AsRef<Path>, errno: i32) -> Self {
        self.write_errors.insert(path.as_ref().to_owned(), errno);
        self
    }

    fn nodes(&self) -> MutexGuard<'_, BTreeMap<PathBuf, Node>> {
        self.nodes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn insert(&self, path: &Path, node: Node) {
        self.nodes().insert(path.to_owned(), node);
    }

    /// `path` with every link before its last component followed and `..` applied; `follow`
    /// also follows a link in the last component. Gives up (returns the path as it got) after
    /// 40 links, as the kernel does.
    fn resolve(nodes: &BTreeMap<PathBuf, Node>, path: &Path, follow: bool) -> PathBuf {
        let mut pending: Vec<std::ffi::OsString> = path
            .components()
            .rev()
            .map(|c| c.as_os_str().to_owned())
            .collect();
        let mut at = PathBuf::from("/");
        let mut links = 0;
        while let Some(part) = pending.pop() {
            match part.to_str() {
                Some("/" | ".") => continue,
                Some("..") => {
                    at.pop();
                    continue;
                }
                _ => at.push(&part),
            }
            let last = pending.is_empty();
            if let Some(Node::Link(target)) = nodes.get(&at) {
                if (last && !follow) || links == 40 {
                    continue;
                }
                links += 1;
                at.pop();
                if target.is_absolute() {
                    at = PathBuf::from("/");
                }
                pending.extend(target.components().rev().map(|c| c.as_os_str().to_owned()));
            }
        }
        at
    }

    fn is_dir(nodes: &BTreeMap<PathBuf, Node>, dir: &Path) -> bool {
        matches!(nodes.get(dir), Some(Node::Dir))
            || nodes.keys().any(|p| p != dir && p.starts_with(dir))
    }

    fn write_error(&self, path: &Path) -> io::Result<()> {
        match self.write_errors.get(path) {
            Some(&errno) => Err(io::Error::from_raw_os_error(errno)),
            None => Ok(()),
        }
    }
}

fn not_found() -> io::Error {
    io::Error::from(io::ErrorKind::NotFound)
}

impl HostFs for MemFs {
    fn read(&self, path: &Path) -> io::Result<String> {
        let nodes = self.nodes();
        let path = Self::resolve(&nodes, path, true);
        match nodes.get(&path) {
            Some(Node::File(text)) => Ok(text.clone()),
            Some(Node::Link(_)) => Err(io::Error::from_raw_os_error(libc::ELOOP)),
            Some(Node::Dir) => Err(io::Error::from_raw_os_error(libc::EISDIR)),
            None if Self::is_dir(&nodes, &path) => Err(io::Error::from_raw_os_error(libc::EISDIR)),
            None => Err(not_found()),
        }
    }

    fn write(&self, path: &Path, value: &str) -> io::Result<()> {
        let mut nodes = self.nodes();
        let path = Self::resolve(&nodes, path, true);
        self.write_error(&path)?;
        match nodes.get_mut(&path) {
            Some(Node::File(text)) => {
                value.clone_into(text);
                Ok(())
            }
            Some(_) => Err(io::Error::from_raw_os_error(libc::EISDIR)),
            None => Err(not_found()),
        }
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let nodes = self.nodes();
        let dir = Self::resolve(&nodes, dir, true);
        if !Self::is_dir(&nodes, &dir) {
            return Err(not_found());
        }
        let names: BTreeSet<String> = nodes
            .keys()
            .filter_map(|p| p.strip_prefix(&dir).ok())
            .filter_map(|rest| rest.components().next())
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        Ok(names.into_iter().collect())
    }

    fn read_link(&self, path: &Path) -> io::Result<PathBuf> {
        let nodes = self.nodes();
        match nodes.get(&Self::resolve(&nodes, path, false)) {
            Some(Node::Link(target)) => Ok(target.clone()),
            Some(_) => Err(io::Error::from_raw_os_error(libc::EINVAL)),
            None => Err(not_found()),
        }
    }

    fn symlink(&self, target: &Path, link: &Path) -> io::Result<()> {
        let mut nodes = self.nodes();
        let link = &Self::resolve(&nodes, link, false);
        self.write_error(link)?;
        if nodes.contains_key(link) {
            return Err(io::Error::from(io::ErrorKind::AlreadyExists));
        }
        match link.parent() {
            Some(parent) if Self::is_dir(&nodes, parent) => {
                nodes.insert(link.to_owned(), Node::Link(target.to_owned()));
                Ok(())
            }
            _ => Err(not_found()),
        }
    }
}
