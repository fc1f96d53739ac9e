#!/bin/bash
# The appliance image's static checks (make image-test runs them before booting):
#   1. shellcheck of every script (appliance-image/, the image's own scripts, and the
#      tuning script the image's felix rendered into it);
#   2. felix-disks, the single-disk path, against a loop device on this host: create
#      (ext4 labelled felix-data, mounted noatime), an idempotent second run, a later-boot
#      run (mount without formatting, the data still there), and refusals of a foreign file
#      system and of a partition table (left untouched); skipped, with a message, when not
#      root or without loop devices;
#   3. systemd-analyze verify of the image's units inside the built root;
#   4. the disk image: GPT layout (last MiB free), the GRUB boot sector patched, the ESP's
#      BOOTX64.EFI, the qcow2's size, and the VHD footer (conectix, fixed, whole MiB,
#      checksum).
#   IMAGE_DIR=dir   the built test image (default target/image/test)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
target=${CARGO_TARGET_DIR:-$top/target}
IMAGE_DIR=${IMAGE_DIR:-$target/image/test}

fail() { echo "image-check: FAIL: $*" >&2; exit 1; }
ok() { echo "image-check: ok: $*"; }
skip() { echo "image-check: SKIP: $*"; }

# ---- 1. shellcheck ------------------------------------------------------------------------
command -v shellcheck >/dev/null || fail "shellcheck is missing (apt-get install shellcheck)"
mapfile -t scripts < <(cd "$here" && find . -type f -perm -u+x ! -name '*.fd' | sort)
(cd "$here" && shellcheck "${scripts[@]}") || fail "shellcheck of appliance-image/"
ok "shellcheck of ${scripts[*]#./}"
root=$IMAGE_DIR/rootfs
if [ -f "$root/usr/lib/felix/tune.sh" ]; then
    shellcheck --shell=sh "$root/usr/lib/felix/tune.sh" || fail "shellcheck of the image's tune.sh"
    ok "shellcheck of the image's /usr/lib/felix/tune.sh"
fi

# ---- 2. felix-disks on a loop device -----------------------------------------------------
disks_test() {
    local work loop1 loop2 out mnt script=$here/rootfs/common/usr/lib/felix/felix-disks
    work=$(mktemp -d)
    mnt=$work/data
    loop1="" loop2=""
    # shellcheck disable=SC2317 # called by the trap
    cleanup_disks() {
        umount "$mnt" 2>/dev/null || true
        [ -n "$loop1" ] && losetup -d "$loop1" 2>/dev/null
        [ -n "$loop2" ] && losetup -d "$loop2" 2>/dev/null
        rm -rf "$work"
    }
    trap cleanup_disks RETURN
    truncate -s 256M "$work/disk1" "$work/disk2"
    loop1=$(losetup -f --show "$work/disk1") || { skip "felix-disks: no loop device"; return 0; }
    loop2=$(losetup -f --show "$work/disk2") || { skip "felix-disks: no second loop device"; return 0; }
    run() { # run DISK: felix-disks on DISK alone, the data directory under $work
        env -u FELIX_DISK_MODEL -u FELIX_DISK_SERIAL FELIX_DISKS_CONF=/nonexistent FELIX_DISKS="$1" \
            FELIX_DATA_DIR="$mnt" FELIX_DISK_WAIT=2 "$script" 2>&1
    }
    # Create: blank disk -> ext4 felix-data, mounted noatime.
    out=$(run "$loop1") || fail "felix-disks on a blank $loop1: $out"
    echo "$out" | grep -q 'creating ext4' || fail "felix-disks did not create ext4: $out"
    [ "$(findmnt -n -o FSTYPE --mountpoint "$mnt")" = ext4 ] || fail "not an ext4 mount at $mnt"
    case ",$(findmnt -n -o OPTIONS --mountpoint "$mnt")," in
    *,noatime,*) ;;
    *) fail "mounted without noatime: $(findmnt -n -o OPTIONS --mountpoint "$mnt")" ;;
    esac
    [ "$(blkid -p -o value -s LABEL "$loop1")" = felix-data ] || fail "the file system is not labelled felix-data"
    uuid=$(blkid -p -o value -s UUID "$loop1")
    echo keep >"$mnt/record"
    ok "felix-disks: blank $loop1 -> ext4 felix-data mounted noatime"
    # Idempotent: a second run while mounted changes nothing.
    out=$(run "$loop1") || fail "second felix-disks run: $out"
    echo "$out" | grep -q creating && fail "the second run formatted again: $out"
    echo "$out" | grep -q 'is mounted at' || fail "the second run did not see the mount: $out"
    ok "felix-disks: second run is a no-op"
    # A later boot: unmounted, our file system -> mounted again, not formatted.
    umount "$mnt"
    out=$(run "$loop1") || fail "felix-disks after umount: $out"
    echo "$out" | grep -q creating && fail "the later-boot run formatted: $out"
    [ "$(cat "$mnt/record" 2>/dev/null)" = keep ] || fail "the data did not survive a re-mount"
    [ "$(blkid -p -o value -s UUID "$loop1")" = "$uuid" ] || fail "the file system changed"
    umount "$mnt"
    ok "felix-disks: later boot mounts the existing file system, data intact"
    # Refuse a foreign file system, and leave it as it was.
    mkfs.ext4 -q -F -L somebody-else "$loop2"
    foreign=$(blkid -p -o value -s UUID "$loop2")
    if out=$(run "$loop2"); then fail "felix-disks accepted a foreign file system: $out"; fi
    echo "$out" | grep -q 'REFUSED' || fail "no REFUSED message: $out"
    [ "$(blkid -p -o value -s UUID "$loop2")" = "$foreign" ] || fail "the foreign file system was changed"
    findmnt --mountpoint "$mnt" >/dev/null && fail "felix-disks mounted a foreign file system"
    ok "felix-disks: refuses a foreign ext4 ($(echo "$out" | grep REFUSED | head -n 1))"
    # Refuse a partition table.
    wipefs -q -a "$loop2"
    echo 'label: gpt' | sfdisk -q --no-reread --no-tell-kernel "$loop2" >/dev/null 2>&1 \
        || printf 'label: gpt\n' | sfdisk -q "$work/disk2" >/dev/null
    if out=$(run "$loop2"); then fail "felix-disks accepted a disk with a partition table: $out"; fi
    echo "$out" | grep -q 'partition table' || fail "no partition-table refusal: $out"
    [ "$(blkid -p -o value -s PTTYPE "$loop2")" = gpt ] || fail "the partition table was changed"
    ok "felix-disks: refuses a disk with a partition table"
    # Nothing configured: refuse (the broker stays down rather than writing the root disk).
    if out=$(env -u FELIX_DISKS -u FELIX_DISK_MODEL -u FELIX_DISK_SERIAL FELIX_DISKS_CONF=/nonexistent \
        FELIX_DATA_DIR="$mnt" "$script" 2>&1); then
        fail "felix-disks with no disks configured succeeded: $out"
    fi
    ok "felix-disks: refuses to run with no disks configured"
}
if [ "$(id -u)" != 0 ]; then
    skip "felix-disks loop-device test: not root"
elif ! command -v losetup >/dev/null || [ ! -e /dev/loop-control ]; then
    skip "felix-disks loop-device test: no loop devices"
else
    disks_test
fi

# ---- 3. systemd-analyze verify inside the built root --------------------------------------
[ -d "$root" ] || fail "no built root at $root (appliance-image/build.sh)"
if command -v systemd-analyze >/dev/null; then
    units=(felix.service felix-tune.service felix-disks.service)
    [ -f "$root/usr/lib/systemd/system/felix-selftest.service" ] && units+=(felix-selftest.service)
    out=$(systemd-analyze verify --man=no --root="$root" "${units[@]/#//usr/lib/systemd/system/}" 2>&1) \
        || fail "systemd-analyze verify: $out"
    # verify exits 0 on some warnings; any line about our units is a failure.
    if echo "$out" | grep -E 'felix' | grep -v -E '^$'; then fail "systemd-analyze verify warnings: $out"; fi
    ok "systemd-analyze verify --root of ${units[*]}"
else
    skip "systemd-analyze is not installed"
fi

# ---- 4. the disk images ------------------------------------------------------------------
raw=$(find "$IMAGE_DIR" -maxdepth 1 -name 'felix-*.raw' | head -n 1)
[ -n "$raw" ] || fail "no felix-*.raw in $IMAGE_DIR"
base=${raw%.raw}
size=$(stat -c %s "$raw")
[ $((size % 1048576)) = 0 ] || fail "$raw is not a whole number of MiB ($size bytes)"
table=$(sfdisk -d "$raw")
echo "$table" | grep -q '^label: gpt' || fail "$raw has no GPT"
[ "$(echo "$table" | grep -c 'start=')" = 3 ] || fail "$raw: expected 3 partitions: $table"
echo "$table" | grep -q 'type=21686148-6449-6E6F-744E-656564454649' || fail "no BIOS boot partition"
echo "$table" | grep -q 'type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B' || fail "no EFI system partition"
last=$(echo "$table" | sed -n 's/.*start= *\([0-9]*\), size= *\([0-9]*\),.*/\1 \2/p' | awk '{ e = $1 + $2 } e > m { m = e } END { print m }')
[ $((size / 512 - last)) -ge 2048 ] || fail "the last MiB is not free (partitions end at sector $last)"
bytes() { od -An -v -tx1 -j "$2" -N "$3" "$1" | tr -d ' \n'; }
[ "$(bytes "$raw" 510 2)" = 55aa ] || fail "no boot signature in the MBR"
[ "$(bytes "$raw" $((0x5c)) 8)" = 0008000000000000 ] || fail "boot.img's kernel sector is not LBA 2048"
[ "$(bytes "$raw" $((2048 * 512 + 500)) 8)" = 0108000000000000 ] || fail "core.img's blocklist does not start at LBA 2049"
esp_offset=$((4096 * 512))
mdir -i "$raw@@$esp_offset" ::/EFI/BOOT 2>/dev/null | grep -q BOOTX64 || fail "no /EFI/BOOT/BOOTX64.EFI in the ESP"
ok "$(basename "$raw"): GPT (BIOS boot, ESP, root; last MiB free), GRUB boot sector, BOOTX64.EFI"

qsize=$(qemu-img info --output=json "$base.qcow2" | sed -n 's/.*"virtual-size": *\([0-9]*\).*/\1/p')
[ "$qsize" = "$size" ] || fail "$base.qcow2 virtual size $qsize, raw $size"
ok "$(basename "$base").qcow2: virtual size $qsize"

vhd=$base.vhd
vsize=$(stat -c %s "$vhd")
[ "$vsize" = $((size + 512)) ] || fail "$vhd is $vsize bytes, not the raw size plus a 512-byte footer"
footer=$((vsize - 512))
[ "$(dd if="$vhd" bs=1 skip="$footer" count=8 status=none)" = conectix ] || fail "no conectix cookie in the VHD footer"
disk_type=$((16#$(bytes "$vhd" $((footer + 60)) 4)))
[ "$disk_type" = 2 ] || fail "VHD disk type $disk_type, not 2 (fixed)"
current=$((16#$(bytes "$vhd" $((footer + 48)) 8)))
original=$((16#$(bytes "$vhd" $((footer + 40)) 8)))
[ "$current" = "$size" ] || fail "VHD current size $current, not $size"
[ "$original" = "$size" ] || fail "VHD original size $original, not $size"
[ $((current % 1048576)) = 0 ] || fail "VHD size $current is not a whole number of MiB"
# The checksum: the ones' complement of the byte sum of the footer without its checksum field.
sum=0
for byte in $(od -An -v -tu1 -j "$footer" -N 512 "$vhd"); do sum=$((sum + byte)); done
stored=$((16#$(bytes "$vhd" $((footer + 64)) 4)))
for byte in $(od -An -v -tu1 -j $((footer + 64)) -N 4 "$vhd"); do sum=$((sum - byte)); done
[ $((~sum & 0xffffffff)) = "$stored" ] || fail "VHD footer checksum mismatch"
ok "$(basename "$vhd"): fixed VHD footer (conectix, type 2, $((current / 1048576)) MiB, checksum)"
echo "image-check: PASS"
