//! A small real file system for disk-full tests: a tmpfs with a size limit, else an ext4
//! image on a loop device, mounted on a fresh temporary directory and unmounted when the
//! guard is dropped (also when a test panics). Needs root (mount); callers skip when
//! [`SmallFs::mount`] fails, printing the reason.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::CampaignError;

/// Which kind of file system was mounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmallFsKind {
    Tmpfs,
    LoopExt4,
}

/// A mounted small file system; unmounted (and its temporary directory removed) on drop.
#[derive(Debug)]
pub struct SmallFs {
    kind: SmallFsKind,
    /// Holds the mount point and image; removed after the unmount in `Drop`.
    _dir: tempfile::TempDir,
    mount_point: PathBuf,
}

/// Runs a command, returning its combined output as the error when it fails.
fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if output.status.success() {
        return Ok(());
    }
    Err(format!(
        "`{program} {}` failed ({}): {}{}",
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stdout).trim(),
        String::from_utf8_lossy(&output.stderr).trim()
    ))
}

impl SmallFs {
    /// Mounts a file system of `mib` MiB: tmpfs if the kernel lets this process mount one,
    /// else an ext4 image on a loop device. `Err` says why neither worked.
    pub fn mount(mib: u32) -> Result<SmallFs, CampaignError> {
        let tmpfs = match SmallFs::mount_as(SmallFsKind::Tmpfs, mib) {
            Ok(fs) => return Ok(fs),
            Err(why) => why,
        };
        SmallFs::mount_as(SmallFsKind::LoopExt4, mib).map_err(|why| {
            CampaignError::Mount(format!(
                "no tmpfs ({tmpfs}) and no loop-mounted ext4 ({why})"
            ))
        })
    }

    /// Mounts a file system of `mib` MiB of the given kind on a fresh temporary directory.
    pub fn mount_as(kind: SmallFsKind, mib: u32) -> Result<SmallFs, CampaignError> {
        let dir = tempfile::Builder::new()
            .prefix("felix-smallfs-")
            .tempdir()
            .map_err(|e| {
                CampaignError::io("cannot make a temporary directory", "felix-smallfs-", e)
            })?;
        let mount_point = dir.path().join("mnt");
        std::fs::create_dir(&mount_point)
            .map_err(|e| CampaignError::io("cannot create", &mount_point, e))?;
        let target = mount_point.to_string_lossy().into_owned();
        let mounted = match kind {
            SmallFsKind::Tmpfs => {
                let size = format!("size={mib}m");
                run("mount", &["-t", "tmpfs", "-o", &size, "tmpfs", &target])
            }
            SmallFsKind::LoopExt4 => {
                let image = dir.path().join("fs.img");
                let image = image.to_string_lossy().into_owned();
                let count = format!("count={mib}");
                let of = format!("of={image}");
                run("dd", &["if=/dev/zero", &of, "bs=1M", &count, "status=none"])
                    .and_then(|()| run("mkfs.ext4", &["-q", "-F", &image]))
                    .and_then(|()| run("mount", &["-o", "loop", &image, &target]))
            }
        };
        match mounted {
            Ok(()) => Ok(SmallFs {
                kind,
                _dir: dir,
                mount_point,
            }),
            Err(why) => Err(CampaignError::Mount(why)),
        }
    }

    /// Where it is mounted.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.mount_point
    }

    #[must_use]
    pub fn kind(&self) -> SmallFsKind {
        self.kind
    }

    /// Free bytes (statvfs), for messages.
    #[must_use]
    pub fn free_bytes(&self) -> Option<u64> {
        let stat = nix::sys::statvfs::statvfs(&self.mount_point).ok()?;
        Some(stat.blocks_available() * stat.fragment_size())
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let target = self.mount_point.to_string_lossy().into_owned();
        // A process still holding files there (a broker not yet reaped) makes a plain
        // unmount fail with EBUSY; detach it then, so nothing stays mounted.
        if let Err(why) = run("umount", &[&target]) {
            eprintln!("smallfs: {why}; detaching instead");
            if let Err(why) = run("umount", &["-l", &target]) {
                eprintln!("smallfs: {why}");
            }
        }
    }
}
