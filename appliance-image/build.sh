#!/bin/bash
# Builds the Felix appliance VM image (Debian 12) as root, without Docker and without
# loop-mounting partitions: mmdebstrap into a folder, the Felix package and the image's own
# files (rootfs/) on top, then mkfs.ext4 -d for the root file system, mkfs.fat + mcopy for the
# EFI system partition, sfdisk on the image file for a GPT, GRUB's boot.img/core.img written
# into the MBR and the BIOS boot partition by hand, BOOTX64.EFI into the ESP.
#
# Output ($OUT, default target/image/$PROFILE): felix-$PROFILE.raw, .qcow2, .vhd (fixed, a
# whole number of MiB), manifest.txt, and rootfs/ (the tree the image was made from, for
# appliance-image/check.sh). docs/appliance-image.md describes the image.
#
#   PROFILE=test|azure|baremetal   the host profile (default test)
#   DEB=path                       the Felix package (default: newest target/debian/felix_*.deb)
#   OUT=dir                        output folder (default target/image/$PROFILE)
#   CACHE=dir                      mmdebstrap tarballs, keyed by package list (target/image-cache)
#   SIZE_MIB=n                     image size (default 2048; cloud-init grows it on Azure)
#   MIRROR=url                     Debian mirror (default http://deb.debian.org/debian)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
target=${CARGO_TARGET_DIR:-$top/target}
PROFILE=${PROFILE:-test}
OUT=${OUT:-$target/image/$PROFILE}
CACHE=${CACHE:-$target/image-cache}
SIZE_MIB=${SIZE_MIB:-2048}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}
SUITE=bookworm

log() { echo "image-build: $*" >&2; }
die() { echo "image-build: FAIL: $*" >&2; exit 1; }

case $PROFILE in
test | azure | baremetal) ;;
*) die "PROFILE must be test, azure or baremetal (not '$PROFILE')" ;;
esac
[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap --mode=root, chroot, mkfs -d keep ownership)"
for tool in mmdebstrap mkfs.ext4 mkfs.fat mcopy mmd sfdisk qemu-img grub-mkimage dpkg-deb chroot; do
    command -v "$tool" >/dev/null || die "$tool is missing (apt-get install mmdebstrap e2fsprogs dosfstools mtools fdisk qemu-utils grub-pc-bin grub-efi-amd64-bin)"
done
for dir in /usr/lib/grub/i386-pc /usr/lib/grub/x86_64-efi; do
    [ -d "$dir" ] || die "$dir is missing (apt-get install grub-pc-bin grub-efi-amd64-bin)"
done

if [ -z "${DEB:-}" ]; then
    for file in "$target"/debian/felix_*.deb; do [ -e "$file" ] && DEB=$file; done
fi
if [ -z "${DEB:-}" ] || [ ! -f "$DEB" ]; then die "no Felix package (make deb, or DEB=path)"; fi
DEB=$(cd "$(dirname "$DEB")" && pwd)/$(basename "$DEB")

# ----------------------------------------------------------------------------------------
# The package list. The kernel: linux-image-cloud-amd64 (Hyper-V, KVM/QEMU, NVMe, virtio; a
# smaller initramfs, so a faster boot) for azure and test, the full kernel on bare metal.
packages=(systemd-sysv udev initramfs-tools zstd kmod iproute2 mdadm e2fsprogs
    util-linux procps ca-certificates netbase)
case $PROFILE in
test) packages+=(linux-image-cloud-amd64) ;;
azure) packages+=(linux-image-cloud-amd64 cloud-init cloud-guest-utils openssh-server sudo
    systemd-timesyncd) ;;
baremetal) packages+=(linux-image-amd64 openssh-server sudo systemd-timesyncd) ;;
esac
# The Felix package's own dependencies (dpkg -i installs it offline later).
depends=$(dpkg-deb -f "$DEB" Depends)
while read -r dep; do
    dep=${dep%% *}
    [ -n "$dep" ] && packages+=("$dep")
done < <(echo "$depends" | tr ',' '\n' | sed 's/^ *//; s/|.*//')
mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u)

# The base tarball is cached under a key of everything that goes into it.
key=$( {
    echo "$SUITE $MIRROR $SECURITY_MIRROR minbase"
    printf '%s\n' "${packages[@]}"
    (cd "$here/base" && find . -type f | sort | xargs sha256sum)
} | sha256sum | cut -c1-16)
base_tar=$CACHE/base-$SUITE-$key.tar
mkdir -p "$CACHE" "$OUT"

work=$(mktemp -d "$OUT/.work.XXXXXX")
root=$work/root
mounted=()
cleanup() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

start=$SECONDS
if [ -f "$base_tar" ]; then
    log "base: cached $base_tar"
else
    log "base: mmdebstrap $SUITE (${#packages[@]} packages) -> $base_tar"
    # The essential hook puts base/ (mdadm.conf, initramfs config) in place before mdadm and
    # the kernel are configured, so the initramfs is built once, with them.
    # shellcheck disable=SC2016 # the hooks' "$1" is mmdebstrap's (the root), not ours
    mmdebstrap --variant=minbase --mode=root --format=tar \
        --include="$(IFS=,; echo "${packages[*]}")" \
        --essential-hook="tar -C '$here/base' --owner=0 --group=0 -c . | tar -C \"\$1\" -x" \
        --customize-hook='rm -f "$1"/etc/hostname "$1"/etc/resolv.conf' \
        "$SUITE" "$base_tar.tmp" \
        "deb $MIRROR $SUITE main" \
        "deb $MIRROR $SUITE-updates main" \
        "deb $SECURITY_MIRROR $SUITE-security main"
    mv "$base_tar.tmp" "$base_tar"
fi
log "base: $((SECONDS - start)) s"

mkdir -p "$root"
tar -C "$root" --numeric-owner --xattrs --xattrs-include='*' -xpf "$base_tar"

# ----------------------------------------------------------------------------------------
# Customize: the Felix package, the image's files, configuration.
bind() {
    mount "$@"
    mounted+=("${*: -1}")
}
bind -t proc proc "$root/proc"
bind -t sysfs sysfs "$root/sys"
bind --bind /dev "$root/dev"
bind -t tmpfs tmpfs "$root/run"
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 "$@"; }

cp "$DEB" "$root/tmp/felix.deb"
# Keep the maintainer scripts from starting anything in the chroot.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
in_root dpkg -i /tmp/felix.deb >/dev/null
rm -f "$root/tmp/felix.deb" "$root/usr/sbin/policy-rc.d"

# The image's own files: common, then the profile's.
for layer in common "$PROFILE"; do
    [ -d "$here/rootfs/$layer" ] || continue
    tar -C "$here/rootfs/$layer" --owner=0 --group=0 -c . | tar -C "$root" -x --no-same-owner
done

# The host profile in the broker's configuration (the conffile's commented line, set).
conf=$root/etc/felix/felix.toml
grep -q '^# host_profile = ' "$conf" || die "felix.toml has no host_profile line to set"
sed -i "s/^# host_profile = .*/host_profile = \"$PROFILE\"/" "$conf"
if [ "$PROFILE" = test ]; then
    # The self-test talks to the broker on loopback; elsewhere clients come over the network.
    :
else
    sed -i 's/^# bind = "0.0.0.0:7400"/bind = "0.0.0.0:7400"/' "$conf"
fi

# The tuning, rendered by the image's own felix: the script (for reference and for
# operators; felix-tune.service applies the profile at every boot) and the sysctls as a
# sysctl.d file, so they hold from early boot (systemd-sysctl) even before felix-tune runs.
mkdir -p "$root/usr/lib/felix"
in_root env FELIX_CONFIG=/etc/felix/felix.toml /usr/bin/felix tune --script --profile "$PROFILE" \
    >"$root/usr/lib/felix/tune.sh"
chmod 755 "$root/usr/lib/felix/tune.sh"
{
    echo "# Felix host profile $PROFILE: the sysctls of \`felix tune --script --profile $PROFILE\`"
    echo "# (written by appliance-image/build.sh; felix-tune.service checks them at boot)."
    awk '$1 == "felix_sysctl" && NF == 4 { print $2 " = " $4 }' "$root/usr/lib/felix/tune.sh"
} >"$root/etc/sysctl.d/90-felix.conf"
grep -q '^net.core.rmem_max = ' "$root/etc/sysctl.d/90-felix.conf" \
    || die "could not render the sysctls from felix tune --script"
# The upgrade units masked, as the tuner does (felix tune --apply would do it at first boot).
for unit in apt-daily.timer apt-daily-upgrade.timer unattended-upgrades.service; do
    ln -sfn /dev/null "$root/etc/systemd/system/$unit"
done

echo felix >"$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tfelix\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
# An empty machine-id: systemd makes one at first boot (each VM its own).
: >"$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id"

# Units: the broker and its tuning (the package enables them), the data disks, networking.
in_root systemctl enable felix.service felix-tune.service felix-disks.service \
    systemd-networkd.service >/dev/null 2>&1
in_root systemctl enable systemd-networkd-wait-online.service >/dev/null 2>&1 || true
# Not needed on an appliance, and they slow the boot: mdadm's monitor (raid0 has no
# redundancy to watch) and its monthly check, the e2scrub timers.
for unit in mdmonitor.service mdmonitor-oneshot.timer mdcheck_start.timer mdcheck_continue.timer \
    e2scrub_all.timer e2scrub_reap.service; do
    [ -e "$root/lib/systemd/system/$unit" ] && ln -sfn /dev/null "$root/etc/systemd/system/$unit"
done
case $PROFILE in
test)
    in_root systemctl enable felix-selftest.service >/dev/null 2>&1
    # No login on the test image: the self-test is its only user.
    ;;
azure)
    # cloud-init provisions the VM (user, SSH key, hostname, network) from Azure's IMDS.
    in_root systemctl enable ssh.service >/dev/null 2>&1 || true
    ;;
baremetal)
    in_root systemctl enable ssh.service systemd-timesyncd.service >/dev/null 2>&1 || true
    ;;
esac
# SSH host keys are made per machine at first boot (cloud-init on azure, the sshd drop-in
# on bare metal), never shipped in the image.
rm -f "$root"/etc/ssh/ssh_host_*

# The root file system, its GRUB configuration and fstab (by file system UUID).
root_uuid=$(cat /proc/sys/kernel/random/uuid)
kernel=$(find "$root/boot" -maxdepth 1 -name "vmlinuz-*" -printf "%f\n" | sort -V | tail -n 1)
kernel_version=${kernel#vmlinuz-}
[ -f "$root/boot/initrd.img-$kernel_version" ] || die "no initramfs for $kernel_version"
printf 'UUID=%s / ext4 errors=remount-ro,noatime 0 1\n' "$root_uuid" >"$root/etc/fstab"
cmdline="root=UUID=$root_uuid ro console=tty0 console=ttyS0,115200n8 net.ifnames=1"
[ "$PROFILE" = azure ] && cmdline="$cmdline earlyprintk=ttyS0 rootdelay=10"
mkdir -p "$root/boot/grub"
cat >"$root/boot/grub/grub.cfg" <<EOF
# Felix appliance (appliance-image/build.sh). /vmlinuz and /initrd.img are the kernel
# package's links to the newest kernel, so a kernel upgrade by apt needs no change here.
serial --unit=0 --speed=115200
terminal_input serial console
terminal_output serial console
set timeout=1
menuentry 'Felix appliance ($PROFILE)' {
    search --no-floppy --fs-uuid --set=root $root_uuid
    if [ -f /vmlinuz ]; then
        linux /vmlinuz $cmdline
        initrd /initrd.img
    else
        linux /boot/vmlinuz-$kernel_version $cmdline
        initrd /boot/initrd.img-$kernel_version
    fi
}
EOF

# Clean what a running system does not need.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
    "$root"/var/log/*.log "$root"/var/log/apt/* "$root"/tmp/* "$root"/root/.bash_history
for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}"; done
mounted=()

# Package versions for the manifest.
# shellcheck disable=SC2016 # dpkg-query's format
versions=$(chroot "$root" dpkg-query -W -f '${Package} ${Version}\n' \
    felix linux-image-cloud-amd64 linux-image-amd64 systemd mdadm cloud-init 2>/dev/null || true)

# The tree stays in $OUT/rootfs for check.sh (systemd-analyze verify).
rm -rf "$OUT/rootfs"
mv "$root" "$OUT/rootfs"
root=$OUT/rootfs
log "root: $((SECONDS - start)) s, $(du -sm "$root" | cut -f1) MiB"

# ----------------------------------------------------------------------------------------
# The disk: GPT, 1 MiB BIOS boot (GRUB core.img), 64 MiB ESP, the root file system up to the
# last MiB (left free for the backup GPT header).
mib=2048 # sectors
bios_start=$((1 * mib)) bios_size=$((1 * mib))
esp_start=$((2 * mib)) esp_size=$((64 * mib))
root_start=$((66 * mib))
root_mib=$((SIZE_MIB - 66 - 1))
[ "$root_mib" -ge 512 ] || die "SIZE_MIB=$SIZE_MIB is too small"
used_mib=$(du -sm "$root" | cut -f1)
[ "$root_mib" -gt $((used_mib * 5 / 4 + 64)) ] || die "SIZE_MIB=$SIZE_MIB: the root needs $used_mib MiB plus room"

# Without metadata_csum_seed and orphan_file (newer e2fsprogs defaults GRUB 2.06 may not
# read); the inode tables initialized now, not by the first boot's ext4lazyinit.
root_mkfs() {
    mkfs.ext4 -q -F -L felix-root -U "$root_uuid" -d "$root" -O "$1" \
        -E lazy_itable_init=0,lazy_journal_init=0 "$work/root.ext4" "${root_mib}M" >/dev/null
}
root_mkfs ^metadata_csum_seed,^orphan_file 2>/dev/null || root_mkfs ^metadata_csum_seed

# GRUB: an early configuration that finds the root file system by UUID and reads its grub.cfg.
cat >"$work/early.cfg" <<EOF
search --no-floppy --fs-uuid --set=root $root_uuid
set prefix=(\$root)/boot/grub
configfile \$prefix/grub.cfg
EOF
grub_modules=(part_gpt part_msdos ext2 search search_fs_uuid configfile normal linux echo test
    serial terminal gzio ls cat)
grub-mkimage -O i386-pc -o "$work/core.img" -c "$work/early.cfg" -p /boot/grub \
    biosdisk "${grub_modules[@]}"
grub-mkimage -O x86_64-efi -o "$work/BOOTX64.EFI" -c "$work/early.cfg" -p /boot/grub \
    fat efi_gop efi_uga all_video "${grub_modules[@]}"
core_bytes=$(stat -c %s "$work/core.img")
core_sectors=$(((core_bytes + 511) / 512))
[ "$core_sectors" -le "$bios_size" ] || die "core.img ($core_bytes bytes) does not fit the BIOS boot partition"

truncate -s $((esp_size * 512)) "$work/esp.fat"
mkfs.fat -F 32 -s 1 -S 512 -n FELIX-ESP "$work/esp.fat" >/dev/null
mmd -i "$work/esp.fat" ::/EFI ::/EFI/BOOT
mcopy -i "$work/esp.fat" "$work/BOOTX64.EFI" ::/EFI/BOOT/BOOTX64.EFI

raw=$OUT/felix-$PROFILE.raw
rm -f "$raw"
truncate -s "${SIZE_MIB}M" "$raw"
root_part_uuid=$(cat /proc/sys/kernel/random/uuid)
sfdisk --quiet --no-reread --no-tell-kernel "$raw" <<EOF
label: gpt
unit: sectors
first-lba: 2048
last-lba: $((SIZE_MIB * mib - mib - 1))
start=$bios_start, size=$bios_size, type=21686148-6449-6E6F-744E-656564454649, name="bios-boot"
start=$esp_start, size=$esp_size, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, name="esp"
start=$root_start, size=$((root_mib * mib)), type=0FC63DAF-8483-4772-8E79-3D69D8477DE4, uuid=$root_part_uuid, name="felix-root"
EOF
dd if="$work/esp.fat" of="$raw" bs=1M seek=2 conv=notrunc,sparse status=none
dd if="$work/root.ext4" of="$raw" bs=1M seek=66 conv=notrunc,sparse status=none

# BIOS boot, as grub-bios-setup does it (it refuses image files): boot.img's code into the
# MBR (the protective partition table sfdisk wrote stays), with the LBA of core.img's first
# sector in its kernel-sector field and the boot-drive check replaced by NOPs (hard disk);
# core.img into the BIOS boot partition, its diskboot blocklist pointing at the rest of it.
le() { # le VALUE BYTES: VALUE little-endian
    local value=$1 i
    for ((i = 0; i < $2; i++)); do
        # shellcheck disable=SC2059 # the format is the octal escape of one byte
        printf "\\$(printf '%03o' $((value & 255)))"
        value=$((value >> 8))
    done
}
patch() { # patch FILE OFFSET (bytes on stdin)
    dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}
cp /usr/lib/grub/i386-pc/boot.img "$work/boot.img"
le "$bios_start" 8 | patch "$work/boot.img" $((0x5c))
printf '\x90\x90' | patch "$work/boot.img" $((0x66))
dd if="$work/boot.img" of="$raw" bs=440 count=1 conv=notrunc status=none
{
    le $((bios_start + 1)) 8
    le $((core_sectors - 1)) 2
    le $((0x820)) 2
} | patch "$work/core.img" $((512 - 12))
dd if="$work/core.img" of="$raw" bs=512 seek="$bios_start" conv=notrunc status=none

log "converting to qcow2 and fixed VHD"
qemu-img convert -f raw -O qcow2 "$raw" "$OUT/felix-$PROFILE.qcow2"
qemu-img convert -f raw -O vpc -o subformat=fixed,force_size "$raw" "$OUT/felix-$PROFILE.vhd"

{
    echo "profile: $PROFILE"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "package: $(basename "$DEB") $(sha256sum "$DEB" | cut -c1-64)"
    echo "base: $(basename "$base_tar")"
    echo "kernel: $kernel_version"
    echo "root file system uuid: $root_uuid"
    echo "size: $SIZE_MIB MiB"
    echo "$versions" | while read -r line; do echo "version: $line"; done
    (cd "$OUT" && sha256sum "felix-$PROFILE.raw" "felix-$PROFILE.qcow2" "felix-$PROFILE.vhd")
} >"$OUT/manifest.txt"
log "done in $((SECONDS - start)) s: $OUT/felix-$PROFILE.{raw,qcow2,vhd}"
