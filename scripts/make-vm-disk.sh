#!/usr/bin/env bash
# Build a bootable Debian 12 (bookworm) disk for the `vm` backend, from Debian packages:
# debootstrap minbase, linux-image-cloud-amd64 with its initramfs, systemd, an MBR with
# extlinux (the host's `extlinux` package) and dsec's static guest agent started by a
# systemd unit (`dsec-agent --service`). Serial console on ttyS0. Needs root (a loop
# device and a mount), debootstrap, extlinux, qemu-img, mkfs.ext4 and network.
#
#   ./scripts/make-vm-disk.sh OUT.qcow2
#
# Then: client.import_image("OUT.qcow2", name="debian-disk");
#       client.create(backend="vm", image="debian-disk").
#
# Cached: the root tree is kept in $DSEC_VM_DISK_CACHE (default /var/tmp/dsec-vm-disk-cache)
# with the downloaded packages, so a rebuild (a new agent) only assembles the disk (~15 s).
# Idempotent: OUT is left alone when it was built by this script with the same agent
# (OUT.stamp).
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), DSEC_AGENT (default
# target/x86_64-unknown-linux-gnu/release/dsec-agent).
set -euo pipefail

usage() {
    echo "usage: $0 OUT.qcow2" >&2
    exit 2
}
(($# == 1)) || usage
[[ -n "$1" ]] || usage
OUT="$(realpath -m "$1")"
[[ -z "${DSEC_AGENT:-}" ]] || DSEC_AGENT="$(realpath -m "$DSEC_AGENT")"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
AGENT="${DSEC_AGENT:-target/x86_64-unknown-linux-gnu/release/dsec-agent}"
CACHE="${DSEC_VM_DISK_CACHE:-/var/tmp/dsec-vm-disk-cache}"
TREE="$CACHE/tree"
log() { echo "[vm-disk] $*" >&2; }
die() { log "$*"; exit 1; }

[[ "$(id -u)" -eq 0 ]] || die "must run as root (debootstrap, losetup, mount)"
[[ -x "$AGENT" ]] || die "no static agent at $AGENT: run scripts/build-agent.sh"
for tool in debootstrap extlinux qemu-img mkfs.ext4 losetup python3; do
    command -v "$tool" >/dev/null || die "$tool not found: run scripts/setup.sh (apt-get install debootstrap extlinux qemu-utils e2fsprogs)"
done
MBR_BIN=/usr/lib/EXTLINUX/mbr.bin
[[ -f "$MBR_BIN" ]] || MBR_BIN=/usr/lib/syslinux/mbr/mbr.bin
[[ -f "$MBR_BIN" ]] || die "syslinux's mbr.bin not found: apt-get install syslinux-common"

# What OUT is made of besides the cached tree: this script and the agent.
STAMP="$(cat scripts/make-vm-disk.sh "$AGENT" | sha256sum | cut -d' ' -f1)"
if [[ -f "$OUT" && "$(cat "$OUT.stamp" 2>/dev/null)" == "$STAMP" ]]; then
    log "$OUT is built with this agent and script: nothing to do"
    exit 0
fi
t0=$SECONDS

# 1. The root tree, cached: built beside its place and renamed in when whole.
if [[ ! -f "$TREE/etc/dsec-vm-disk" ]]; then
    mkdir -p "$CACHE/debs"
    tmp="$(mktemp -d "$CACHE/tree.tmp.XXXXXX")"
    cleanup_tree() {
        local m
        for m in proc sys dev; do
            if mountpoint -q "$tmp/$m" 2>/dev/null; then umount -l "$tmp/$m" || true; fi
        done
        rm -rf --one-file-system "$tmp"
    }
    trap cleanup_tree EXIT
    # The initramfs the kernel's postinst makes: only the virtio and ext4 modules a q35
    # guest needs to mount its root (small, quick to load), gzip (no zstd in minbase).
    mkdir -p "$tmp/etc/initramfs-tools/conf.d"
    printf 'MODULES=list\nCOMPRESS=gzip\n' >"$tmp/etc/initramfs-tools/conf.d/dsec"
    printf 'virtio_pci\nvirtio_blk\next4\n' >"$tmp/etc/initramfs-tools/modules"
    log "debootstrap minbase + kernel + systemd (packages cached in $CACHE/debs)"
    debootstrap --variant=minbase --cache-dir="$CACHE/debs" \
        --include=systemd-sysv,udev,kmod,initramfs-tools,linux-image-cloud-amd64 \
        bookworm "$tmp" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 ||
        { tail -20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
    echo "dsec-disk" >"$tmp/etc/hostname"
    echo "/dev/vda1 / ext4 rw,noatime 0 0" >"$tmp/etc/fstab"
    echo "virtio_console" >"$tmp/etc/modules-load.d/dsec.conf"
    rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/* "$tmp"/var/log/*.log
    echo "bookworm, built by scripts/make-vm-disk.sh" >"$tmp/etc/dsec-vm-disk"
    rm -rf "$TREE"
    mv "$tmp" "$TREE"
    trap - EXIT
    log "root tree built in $((SECONDS - t0)) s"
fi

# 2. The disk: one bootable ext4 partition at 1 MiB, extlinux in its boot record.
work="$(mktemp -d "${OUT%/*}/.vm-disk.XXXXXX" 2>/dev/null || mktemp -d)"
raw="$work/disk.raw"
mnt="$work/mnt"
loop=""
cleanup_disk() {
    if mountpoint -q "$mnt" 2>/dev/null; then umount "$mnt" || true; fi
    if [[ -n "$loop" ]]; then losetup -d "$loop" || true; fi
    rm -rf "$work"
}
trap cleanup_disk EXIT
tree_mib="$(du -sm "$TREE" | cut -f1)"
fs_mib=$((tree_mib + tree_mib / 4 + 512))
mkfs.ext4 -q -F -L dsec-root -E offset=$((1 << 20)) -d "$TREE" "$raw" "${fs_mib}M" >/dev/null
python3 - "$raw" "$MBR_BIN" "$fs_mib" <<'EOF'
import struct, sys
raw, mbr_bin, fs_mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
code = open(mbr_bin, "rb").read()[:440]
start, sectors = 2048, fs_mib * 2048
# One active Linux partition; CHS fields saturated (LBA is what counts).
entry = struct.pack("<B3sB3sII", 0x80, b"\xfe\xff\xff", 0x83, b"\xfe\xff\xff", start, sectors)
with open(raw, "r+b") as f:
    f.write(code)
    f.seek(440)
    f.write(struct.pack("<I", 0x64736563) + b"\0\0")  # disk signature
    f.write(entry + b"\0" * 48 + b"\x55\xaa")
EOF
loop="$(losetup -f --show -o $((1 << 20)) --sizelimit $((fs_mib << 20)) "$raw")"
mkdir -p "$mnt"
mount "$loop" "$mnt"
kernel="$(cd "$mnt/boot" && ls vmlinuz-*-cloud-amd64 | sort -V | tail -1)"
initrd="initrd.img-${kernel#vmlinuz-}"
[[ -f "$mnt/boot/$initrd" ]] || die "no $initrd in the tree"
mkdir -p "$mnt/boot/extlinux"
cat >"$mnt/boot/extlinux/extlinux.conf" <<EOF
DEFAULT debian
TIMEOUT 0
PROMPT 0
SERIAL 0 115200
LABEL debian
    LINUX /boot/$kernel
    INITRD /boot/$initrd
    APPEND root=/dev/vda1 rw console=ttyS0 quiet systemd.show_status=1 modprobe.blacklist=kvm,kvm_amd,kvm_intel net.ifnames=0 panic=-1
EOF
# A quick boot: no jobs or consoles a sandbox never needs.
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service \
    fstrim.timer dpkg-db-backup.timer systemd-timesyncd.service getty-static.service \
    getty@tty1.service; do
    ln -sf /dev/null "$mnt/etc/systemd/system/$unit"
done
extlinux --install "$mnt/boot/extlinux" >/dev/null 2>&1
install -m 0755 "$AGENT" "$mnt/usr/local/sbin/dsec-agent"
cat >"$mnt/etc/systemd/system/dsec-agent.service" <<'EOF'
[Unit]
Description=dsec guest agent (serves the dsec host over the virtio-serial port dsec.agent)
# As early as its port's driver is loaded: the host's first command need not wait for the
# rest of the boot.
DefaultDependencies=no
After=systemd-modules-load.service systemd-remount-fs.service
Wants=systemd-modules-load.service
Conflicts=shutdown.target
Before=shutdown.target

[Service]
ExecStart=/usr/local/sbin/dsec-agent --service
# The agent makes the cgroup its commands run in under its own.
Delegate=yes
Restart=no

[Install]
WantedBy=sysinit.target
EOF
mkdir -p "$mnt/etc/systemd/system/sysinit.target.wants"
ln -sf /etc/systemd/system/dsec-agent.service \
    "$mnt/etc/systemd/system/sysinit.target.wants/dsec-agent.service"
umount "$mnt"
losetup -d "$loop"
loop=""
qemu-img convert -f raw -O qcow2 "$raw" "$work/out.qcow2"
mv "$work/out.qcow2" "$OUT"
echo "$STAMP" >"$OUT.stamp"
log "done in $((SECONDS - t0)) s: $OUT ($(du -h "$OUT" | cut -f1), kernel $kernel)"
