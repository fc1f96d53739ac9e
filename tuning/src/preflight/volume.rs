//! The data-volume check: which filesystem holds the data directory, how it is mounted, and
//! (for the Azure profile) whether it is an ext4 md RAID0 over all the local NVMe drives.

use std::path::{Path, PathBuf};

use super::{Check, Outcome};

/// One line of `/proc/self/mountinfo`, the fields this check uses.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    /// `major:minor` of the device.
    dev: String,
    mount_point: PathBuf,
    /// Per-mount options (`rw,noatime`).
    options: Vec<String>,
    fs_type: String,
    source: String,
}

/// The data-volume check, from the text of `/proc/self/mountinfo` and a reader of
/// `/sys/block`.
///
/// `sys_block(rel)` returns the contents of `/sys/block/<rel>` when it is a file, the names of
/// its entries (one a line) when it is a directory (`""` lists `/sys/block` itself), None when
/// it does not exist; [`read_sys_block`] is the real one. `data_dir` should be canonical (the
/// wrapper [`data_volume_check`] resolves it). The mount holding it is the one with the
/// longest mount point that is a prefix of it (the last such when several are stacked).
///
/// With `expect_raid0_nvme` (the Azure profile) the check fails unless the filesystem is ext4,
/// mounted noatime, on an md RAID0 whose members are exactly all the local NVMe namespaces in
/// `/sys/block` (`nvme*n*`); `nvme_model_prefix` restricts "local" to drives whose
/// `device/model` starts with it (`Some("Microsoft NVMe Direct Disk")` on Azure, where remote
/// disks may be NVMe too). Otherwise it passes with a plain report, e.g.
/// `ext4 on /dev/sda1, relatime; not RAID0`.
pub fn data_volume(
    mountinfo: &str,
    sys_block: impl Fn(&str) -> Option<String>,
    data_dir: &Path,
    expect_raid0_nvme: bool,
    nvme_model_prefix: Option<&str>,
) -> Check {
    let name = format!("data volume {}", data_dir.display());
    let Some(mount) = mountinfo
        .lines()
        .filter_map(parse_mountinfo_line)
        .filter(|mount| data_dir.starts_with(&mount.mount_point))
        .fold(None::<Mount>, |best, mount| match best {
            Some(best)
                if best.mount_point.components().count()
                    > mount.mount_point.components().count() =>
            {
                Some(best)
            }
            _ => Some(mount),
        })
    else {
        return Check::new(
            name,
            Outcome::Fail,
            format!(
                "no mount in /proc/self/mountinfo holds {}",
                data_dir.display()
            ),
        );
    };
    let atime = ["noatime", "relatime", "strictatime"]
        .into_iter()
        .find(|option| mount.options.iter().any(|o| o == option))
        .unwrap_or("atime");
    let listing: Vec<String> = lines(sys_block("").as_deref());
    // The whole-disk block device: the /sys/block entry with the mount's major:minor, else
    // the source's name (a partition, or a source that is not a device).
    let device = listing
        .iter()
        .find(|entry| sys_block(&format!("{entry}/dev")).is_some_and(|dev| dev.trim() == mount.dev))
        .cloned()
        .unwrap_or_else(|| {
            mount
                .source
                .rsplit('/')
                .next()
                .unwrap_or(&mount.source)
                .to_owned()
        });
    let level = sys_block(&format!("{device}/md/level")).map(|level| level.trim().to_owned());
    let mut report = format!("{} on {}", mount.fs_type, mount.source);
    if !mount.source.ends_with(&format!("/{device}")) && level.is_some() {
        report.push_str(&format!(" ({device})"));
    }
    report.push_str(&format!(", {atime}; "));
    let mut members = Vec::new();
    match &level {
        Some(level) => {
            members = lines(sys_block(&format!("{device}/slaves")).as_deref())
                .iter()
                .map(|member| whole_disk(member).to_owned())
                .collect();
            report.push_str(&format!("md {level} over {}", members.join(", ")));
            if let Some(chunk) = sys_block(&format!("{device}/md/chunk_size"))
                .and_then(|chunk| chunk.trim().parse::<u64>().ok())
                .filter(|chunk| *chunk > 0)
            {
                report.push_str(&format!(", chunk {} KiB", chunk / 1024));
            }
            if level != "raid0" {
                report.push_str("; not RAID0");
            }
        }
        None => report.push_str("not RAID0"),
    }
    if !expect_raid0_nvme {
        return Check::new(name, Outcome::Pass, report);
    }
    let mut problems = Vec::new();
    if mount.fs_type != "ext4" {
        problems.push(format!("filesystem is {}, expected ext4", mount.fs_type));
    }
    if atime != "noatime" {
        problems.push(format!("mounted {atime}, expected noatime"));
    }
    match level.as_deref() {
        None => problems.push(format!("{} is not an md RAID0", mount.source)),
        Some("raid0") => {}
        Some(other) => problems.push(format!("{device} is {other}, expected raid0")),
    }
    let local: Vec<&String> = listing
        .iter()
        .filter(|entry| is_nvme_namespace(entry))
        .filter(|entry| match nvme_model_prefix {
            None => true,
            Some(prefix) => sys_block(&format!("{entry}/device/model"))
                .is_some_and(|model| model.trim().starts_with(prefix)),
        })
        .collect();
    let model = nvme_model_prefix
        .map(|prefix| format!(" with model {prefix}*"))
        .unwrap_or_default();
    if local.is_empty() {
        problems.push(format!("no local NVMe drives{model} in /sys/block"));
    }
    if level.is_some() {
        let missing: Vec<&str> = local
            .iter()
            .filter(|drive| !members.contains(drive))
            .map(|drive| drive.as_str())
            .collect();
        if !missing.is_empty() {
            problems.push(format!("local NVMe {} not in {device}", missing.join(", ")));
        }
        let foreign: Vec<&str> = members
            .iter()
            .filter(|member| !local.contains(member))
            .map(|member| member.as_str())
            .collect();
        if !foreign.is_empty() {
            problems.push(format!(
                "{device} member {} is not a local NVMe drive{model}",
                foreign.join(", ")
            ));
        }
    }
    if problems.is_empty() {
        Check::new(name, Outcome::Pass, report)
    } else {
        Check::new(
            name,
            Outcome::Fail,
            format!("{report}: {}", problems.join("; ")),
        )
    }
}

/// [`data_volume`] on this host: reads `/proc/self/mountinfo` and `/sys/block`, with
/// `data_dir` resolved to its nearest existing ancestor (the directory may not exist yet).
pub fn data_volume_check(
    data_dir: &Path,
    expect_raid0_nvme: bool,
    nvme_model_prefix: Option<&str>,
) -> Check {
    let mountinfo = match std::fs::read_to_string("/proc/self/mountinfo") {
        Ok(text) => text,
        Err(error) => {
            return Check::new(
                format!("data volume {}", data_dir.display()),
                Outcome::Skip,
                format!("cannot read /proc/self/mountinfo: {error}"),
            );
        }
    };
    let absolute = std::path::absolute(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let resolved = absolute
        .ancestors()
        .find_map(|dir| std::fs::canonicalize(dir).ok())
        .unwrap_or(absolute);
    let mut check = data_volume(
        &mountinfo,
        read_sys_block,
        &resolved,
        expect_raid0_nvme,
        nvme_model_prefix,
    );
    check.name = format!("data volume {}", data_dir.display());
    check
}

/// `/sys/block/<rel>`: a file's contents, a directory's entry names sorted one a line, None
/// when missing. The reader [`data_volume_check`] gives [`data_volume`].
pub fn read_sys_block(rel: &str) -> Option<String> {
    let path = Path::new("/sys/block").join(rel);
    if path.is_dir() {
        let mut names: Vec<String> = std::fs::read_dir(&path)
            .ok()?
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .collect();
        names.sort();
        Some(names.join("\n"))
    } else {
        std::fs::read_to_string(path).ok()
    }
}

fn lines(text: Option<&str>) -> Vec<String> {
    text.unwrap_or("")
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `nvme<N>n<M>`: an NVMe namespace (a whole disk; partitions add `p<K>`).
fn is_nvme_namespace(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("nvme") else {
        return false;
    };
    let Some((controller, namespace)) = rest.split_once('n') else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    digits(controller) && digits(namespace)
}

/// The whole disk of an md member: `nvme0n1p1` is on `nvme0n1`; others are kept as named.
fn whole_disk(member: &str) -> &str {
    if let Some((disk, part)) = member.rsplit_once('p')
        && is_nvme_namespace(disk)
        && !part.is_empty()
        && part.bytes().all(|b| b.is_ascii_digit())
    {
        return disk;
    }
    member
}

/// Parses `36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue`.
fn parse_mountinfo_line(line: &str) -> Option<Mount> {
    let (before, after) = line.split_once(" - ")?;
    let mut fields = before.split(' ');
    let _id = fields.next()?;
    let _parent = fields.next()?;
    let dev = fields.next()?.to_owned();
    let _root = fields.next()?;
    let mount_point = PathBuf::from(unescape(fields.next()?));
    let options = fields.next()?.split(',').map(str::to_owned).collect();
    let mut after = after.split(' ');
    let fs_type = after.next()?.to_owned();
    let source = unescape(after.next()?);
    Some(Mount {
        dev,
        mount_point,
        options,
        fs_type,
        source,
    })
}

/// Undoes mountinfo's octal escapes (`\040` is a space).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|digits| {
            bytes[i] == b'\\' && digits.iter().all(|digit| (b'0'..=b'7').contains(digit))
        });
        if let Some(digits) = octal {
            let value = digits
                .iter()
                .fold(0u32, |value, digit| value * 8 + u32::from(digit - b'0'));
            out.push(value as u8);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    const MOUNTINFO: &str = "\
25 1 0:23 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
26 25 0:24 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
27 25 8:1 / /boot rw,relatime shared:5 - ext4 /dev/sda1 rw
28 25 9:0 / /mnt/felix rw,noatime shared:7 - ext4 /dev/md0 rw,stripe=256
29 25 259:5 / /srv/xfs\\040data rw,relatime shared:8 - xfs /dev/nvme0n1p1 rw,attr2,inode64
";

    /// /sys/block of a host with three local NVMe drives and a remote NVMe disk.
    fn sys(members: &[&str]) -> BTreeMap<String, String> {
        let mut map = BTreeMap::new();
        let mut put = |key: &str, value: &str| {
            map.insert(key.to_owned(), value.to_owned());
        };
        put("", "md0\nnvme0n1\nnvme1n1\nnvme2n1\nnvme3n1\nsda");
        put("md0/dev", "9:0\n");
        put("sda/dev", "8:0\n");
        put("nvme0n1/dev", "259:0\n");
        put("md0/md/level", "raid0\n");
        put("md0/md/chunk_size", "524288\n");
        put("md0/slaves", &members.join("\n"));
        for n in 0..3 {
            put(
                &format!("nvme{n}n1/device/model"),
                "Microsoft NVMe Direct Disk v2   \n",
            );
        }
        put("nvme3n1/device/model", "MSFT NVMe Accelerator v1.0\n");
        map
    }

    fn run(mountinfo: &str, map: &BTreeMap<String, String>, dir: &str, expect: bool) -> Check {
        data_volume(
            mountinfo,
            |rel| map.get(rel).cloned(),
            Path::new(dir),
            expect,
            Some("Microsoft NVMe Direct Disk"),
        )
    }

    #[test]
    fn parses_mountinfo() {
        let mounts: Vec<Mount> = MOUNTINFO.lines().filter_map(parse_mountinfo_line).collect();
        assert_eq!(mounts.len(), 5);
        assert_eq!(mounts[3].mount_point, PathBuf::from("/mnt/felix"));
        assert_eq!(mounts[3].options, vec!["rw", "noatime"]);
        assert_eq!(mounts[3].fs_type, "ext4");
        assert_eq!(mounts[3].source, "/dev/md0");
        assert_eq!(mounts[3].dev, "9:0");
        assert_eq!(mounts[4].mount_point, PathBuf::from("/srv/xfs data"));
        assert_eq!(mounts[0].fs_type, "overlay");
        assert_eq!(parse_mountinfo_line("garbage"), None);
    }

    #[test]
    fn raid0_over_all_local_nvme_passes() {
        let map = sys(&["nvme0n1", "nvme1n1", "nvme2n1"]);
        let check = run(MOUNTINFO, &map, "/mnt/felix/data", true);
        assert_eq!(
            check,
            Check::new(
                "data volume /mnt/felix/data",
                Outcome::Pass,
                "ext4 on /dev/md0, noatime; md raid0 over nvme0n1, nvme1n1, nvme2n1, \
                 chunk 512 KiB"
            )
        );
    }

    #[test]
    fn missing_nvme_fails_naming_it() {
        let map = sys(&["nvme0n1p1", "nvme2n1"]);
        let check = run(MOUNTINFO, &map, "/mnt/felix", true);
        assert_eq!(check.outcome, Outcome::Fail);
        assert!(
            check.detail.ends_with(": local NVMe nvme1n1 not in md0"),
            "{}",
            check.detail
        );
        // Without the Azure profile the same layout is only reported.
        assert_eq!(
            run(MOUNTINFO, &map, "/mnt/felix", false).outcome,
            Outcome::Pass
        );
    }

    #[test]
    fn foreign_member_fails() {
        let map = sys(&["nvme0n1", "nvme1n1", "nvme2n1", "nvme3n1"]);
        let check = run(MOUNTINFO, &map, "/mnt/felix", true);
        assert_eq!(check.outcome, Outcome::Fail);
        assert!(
            check.detail.ends_with(
                ": md0 member nvme3n1 is not a local NVMe drive with model \
                 Microsoft NVMe Direct Disk*"
            ),
            "{}",
            check.detail
        );
    }

    #[test]
    fn not_noatime_fails() {
        let map = sys(&["nvme0n1", "nvme1n1", "nvme2n1"]);
        let relatime = MOUNTINFO.replace("/mnt/felix rw,noatime", "/mnt/felix rw,relatime");
        let check = run(&relatime, &map, "/mnt/felix", true);
        assert_eq!(check.outcome, Outcome::Fail);
        assert!(
            check
                .detail
                .ends_with(": mounted relatime, expected noatime"),
            "{}",
            check.detail
        );
    }

    #[test]
    fn plain_disk_report() {
        let map = sys(&[]);
        assert_eq!(
            run(MOUNTINFO, &map, "/boot/efi", false),
            Check::new(
                "data volume /boot/efi",
                Outcome::Pass,
                "ext4 on /dev/sda1, relatime; not RAID0"
            )
        );
        let xfs = run(MOUNTINFO, &map, "/srv/xfs data/felix", true);
        assert_eq!(xfs.outcome, Outcome::Fail);
        assert!(
            xfs.detail.starts_with(
                "xfs on /dev/nvme0n1p1, relatime; not RAID0: filesystem is xfs, expected ext4; \
                 mounted relatime, expected noatime; /dev/nvme0n1p1 is not an md RAID0"
            ),
            "{}",
            xfs.detail
        );
        let root = run(MOUNTINFO, &map, "/var/lib/felix", false);
        assert_eq!(root.detail, "overlay on overlay, relatime; not RAID0");
        // /proc must not win over / for /procfoo: prefixes are by component.
        assert_eq!(run(MOUNTINFO, &map, "/procfoo", false).detail, root.detail);
        assert_eq!(run("", &map, "/x", false).outcome, Outcome::Fail);
    }

    #[test]
    fn md_found_by_device_number() {
        let map = sys(&["nvme0n1", "nvme1n1", "nvme2n1"]);
        let named = MOUNTINFO.replace("/dev/md0 rw,stripe", "/dev/md/felix rw,stripe");
        let check = run(&named, &map, "/mnt/felix", true);
        assert_eq!(check.outcome, Outcome::Pass, "{}", check.detail);
        assert!(
            check
                .detail
                .starts_with("ext4 on /dev/md/felix (md0), noatime"),
            "{}",
            check.detail
        );
    }

    #[test]
    fn names() {
        assert!(is_nvme_namespace("nvme10n1"));
        assert!(!is_nvme_namespace("nvme0n1p1"));
        assert!(!is_nvme_namespace("nvme0"));
        assert_eq!(whole_disk("nvme0n1p2"), "nvme0n1");
        assert_eq!(whole_disk("sdb1"), "sdb1");
        assert_eq!(unescape("a\\040b\\"), "a b\\");
    }

    #[test]
    fn this_host_runs() {
        let check = data_volume_check(&std::env::temp_dir(), false, None);
        assert_ne!(check.outcome, Outcome::Fail, "{check:?}");
    }
}
