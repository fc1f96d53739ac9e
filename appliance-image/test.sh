#!/bin/bash
# make image-test: boots the test image under QEMU (software emulation: TCG, 2 vCPUs) with
# two emulated NVMe data disks and a virtio NIC, under BIOS (SeaBIOS) and under UEFI (OVMF).
# Per firmware: fresh blank data disks and a fresh copy-on-write overlay of the image; boot 1
# (felix-disks creates the RAID0, the self-test publishes), then boot 2 on the same disks
# (re-assembly, the boot-1 records read back). Each boot must print
# "FELIX-SELFTEST PASS boot=N" on the serial console before BOOT_TIMEOUT seconds.
#
#   FIRMWARE="bios uefi"   which firmware to boot (default both)
#   BOOT_TIMEOUT=420       seconds per boot before qemu is killed
#   IMAGE=path             the raw test image (default target/image/test/felix-test.raw,
#                          built with build.sh when missing, or older than appliance-image/,
#                          or made from another package than the newest target/debian/*.deb)
#   SKIP_CHECKS=1          skip check.sh (the static checks) before booting
#   TCG_THREAD=single      QEMU's TCG threading: single (default: one host thread runs both
#                          vCPUs in turn) or multi (a host thread per vCPU; see below)
#
# Why single-threaded TCG: one CI run (stop 38, 2026-12-07) saw a bios boot 2 go silent at
# 1.09 s of guest time, between "pnp: PnP ACPI: found 7 devices" and the acpi_pm clocksource,
# and stay silent for 420 s, with no soft-lockup or RCU-stall report: the guest kernel's own
# watchdogs never ran, so its timer interrupts had stopped; not a slow boot, and before any
# of the image's own code (disks, systemd, Felix) runs. 70-odd boots before it passed in
# ~60 s each. Our reading (not proven): a timer kick lost between multi-threaded TCG's vCPU
# threads on a loaded 2-vCPU host; single-threaded TCG runs both vCPUs on one host thread
# and has no such kick. When a boot still times out, the test asks QEMU's monitor where each
# vCPU was (info status, cpus, registers) and prints it above the serial tail.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
target=${CARGO_TARGET_DIR:-$top/target}
IMAGE_GIVEN=${IMAGE:-}
IMAGE=${IMAGE:-$target/image/test/felix-test.raw}
FIRMWARE=${FIRMWARE:-bios uefi}
BOOT_TIMEOUT=${BOOT_TIMEOUT:-420}
OVMF_CODE=${OVMF_CODE:-/usr/share/OVMF/OVMF_CODE_4M.fd}
OVMF_VARS=${OVMF_VARS:-/usr/share/OVMF/OVMF_VARS_4M.fd}
LOGS=${LOGS:-$target/image/test/logs}
TCG_THREAD=${TCG_THREAD:-single}
case $TCG_THREAD in single | multi) ;; *) echo "image-test: TCG_THREAD: single or multi, not $TCG_THREAD" >&2; exit 1 ;; esac

die() { echo "image-test: FAIL: $*" >&2; exit 1; }
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 is missing (apt-get install qemu-system-x86)"
command -v qemu-img >/dev/null || die "qemu-img is missing (apt-get install qemu-utils)"

# (Re)build the test image when it is missing or older than the package or its sources.
deb=""
for file in "$target"/debian/felix_*.deb; do [ -e "$file" ] && deb=$file; done
if [ ! -f "$IMAGE" ]; then
    echo "image-test: no $IMAGE: building it"
    env PROFILE=test "$here/build.sh"
elif [ -z "${IMAGE_GIVEN:-}" ]; then
    manifest=$(dirname "$IMAGE")/manifest.txt
    if [ -n "$deb" ] && ! grep -q "$(sha256sum "$deb" | cut -c1-64)" "$manifest" 2>/dev/null; then
        echo "image-test: $IMAGE was built from another package: rebuilding it"
        env PROFILE=test "$here/build.sh"
    elif [ -n "$(find "$here/build.sh" "$here/base" "$here/rootfs" -newer "$IMAGE" -print -quit)" ]; then
        echo "image-test: appliance-image/ changed since $IMAGE was built: rebuilding it"
        env PROFILE=test "$here/build.sh"
    fi
fi
[ -f "$IMAGE" ] || die "no test image at $IMAGE"
if [ "${SKIP_CHECKS:-0}" != 1 ]; then
    IMAGE_DIR=$(dirname "$IMAGE") "$here/check.sh"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/felix-image-test.XXXXXX")
qemu_pid=""
cleanup() {
    if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then
        kill "$qemu_pid" 2>/dev/null || true
        wait "$qemu_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$LOGS"

# monitor COMMAND...: runs each HMP command on the booting QEMU (through QMP), prints replies.
monitor() {
    python3 - "$work/qmp.sock" "$@" <<'PY'
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
replies = s.makefile("r")
def call(command, **arguments):
    s.sendall(json.dumps({"execute": command, "arguments": arguments}).encode() + b"\n")
    while True:
        reply = json.loads(replies.readline())
        if "return" in reply or "error" in reply:
            return reply
json.loads(replies.readline())  # the greeting
call("qmp_capabilities")
for line in sys.argv[2:]:
    reply = call("human-monitor-command", **{"command-line": line})
    text = reply.get("return", reply.get("error"))
    # The vector and x87 registers say nothing about a stalled boot.
    print(f"({line})")
    print("\n".join(l for l in str(text).splitlines() if not l.startswith(("YMM", "FPR", "XMM"))))
PY
}

# boot FIRMWARE N: one boot; returns when the guest printed its line and powered off.
boot() {
    local firmware=$1 n=$2 log=$LOGS/serial-$1-boot$2.log started line
    local -a fw=()
    if [ "$firmware" = uefi ]; then
        [ -f "$OVMF_CODE" ] || die "no $OVMF_CODE (apt-get install ovmf)"
        fw=(-drive "if=pflash,format=raw,unit=0,readonly=on,file=$OVMF_CODE"
            -drive "if=pflash,format=raw,unit=1,file=$work/$firmware-vars.fd")
    fi
    : >"$log"
    : >"${log%.log}.journal.log"
    started=$SECONDS
    qemu-system-x86_64 -machine q35 -accel "tcg,thread=$TCG_THREAD" -cpu max -smp 2 -m 2048 \
        "${fw[@]}" \
        -drive "if=virtio,format=qcow2,file=$work/$firmware-root.qcow2" \
        -drive "if=none,id=n0,format=raw,file=$work/$firmware-nvme0.raw" \
        -device nvme,serial=felix-data-0,drive=n0 \
        -drive "if=none,id=n1,format=raw,file=$work/$firmware-nvme1.raw" \
        -device nvme,serial=felix-data-1,drive=n1 \
        -netdev user,id=net0,restrict=on -device virtio-net-pci,netdev=net0 \
        -smbios "type=11,value=felix.selftest=boot$n" \
        -display none -monitor none -qmp "unix:$work/qmp.sock,server=on,wait=off" -serial "file:$log" -serial "file:${log%.log}.journal.log" \
        -no-reboot &
    qemu_pid=$!
    while kill -0 "$qemu_pid" 2>/dev/null; do
        if [ $((SECONDS - started)) -ge "$BOOT_TIMEOUT" ]; then
            echo "---- the serial log last grew $(($(date +%s) - $(stat -c %Y "$log"))) s ago; QEMU's monitor says: ----" >&2
            monitor "info status" "info cpus" "info registers -a" >&2 || true
            kill "$qemu_pid" 2>/dev/null || true
            wait "$qemu_pid" 2>/dev/null || true
            qemu_pid=""
            echo "---- tail of $log ----" >&2
            tail -n 60 "$log" | tr -d '\r' >&2
            die "$firmware boot $n: no FELIX-SELFTEST line within $BOOT_TIMEOUT s"
        fi
        sleep 1
    done
    wait "$qemu_pid" || true
    qemu_pid=""
    line=$(tr -d '\r' <"$log" | grep -a -o "FELIX-SELFTEST [A-Z]* boot=$n.*" | head -n 1 || true)
    if [ -z "$line" ]; then
        echo "---- tail of $log ----" >&2
        tail -n 60 "$log" | tr -d '\r' >&2
        die "$firmware boot $n: qemu exited after $((SECONDS - started)) s without a FELIX-SELFTEST line"
    fi
    echo "image-test: $firmware boot $n ($((SECONDS - started)) s): $line"
    case $line in
    "FELIX-SELFTEST PASS boot=$n"*) ;;
    *)
        echo "---- tail of $log ----" >&2
        tail -n 80 "$log" | tr -d '\r' >&2
        die "$firmware boot $n failed"
        ;;
    esac
}

total=$SECONDS
for firmware in $FIRMWARE; do
    case $firmware in bios | uefi) ;; *) die "FIRMWARE: bios or uefi, not $firmware" ;; esac
    # Fresh per firmware: the root as an overlay (the image stays pristine), blank disks.
    qemu-img create -q -f qcow2 -F raw -b "$IMAGE" "$work/$firmware-root.qcow2"
    # Sparse: 8 GiB each (room for 1 GiB log segments on the durable stream's core;
    # preflight wants 4 GiB free); only what the guest writes takes host space.
    truncate -s 8G "$work/$firmware-nvme0.raw" "$work/$firmware-nvme1.raw"
    [ "$firmware" = uefi ] && cp "$OVMF_VARS" "$work/$firmware-vars.fd"
    boot "$firmware" 1
    boot "$firmware" 2
    rm -f "$work/$firmware"-*
done
echo "image-test: PASS ($FIRMWARE; two boots each) in $((SECONDS - total)) s; serial logs in $LOGS"
