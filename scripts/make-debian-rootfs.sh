#!/usr/bin/env bash
# Build a minimal Debian 12 (bookworm) root filesystem with python3 in DIR, for tests and
# demos that need a real distribution. Takes about a minute; needs root and network.
#
#   ./scripts/make-debian-rootfs.sh DIR
#
# Idempotent: does nothing if DIR/usr/bin/python3 already exists.
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian); DEBIAN_EXTRA_PACKAGES,
# comma-separated packages to include besides python3 and ca-certificates.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib/rootfs-build.sh"

usage() {
    echo "usage: $0 DIR" >&2
    exit 2
}
(($# == 1)) || usage
DIR="$1"
[[ -n "$DIR" && "$DIR" != / ]] || usage
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if [[ -x "$DIR/usr/bin/python3" || -L "$DIR/usr/bin/python3" ]]; then
    echo "[debian-rootfs] $DIR already has usr/bin/python3: nothing to do"
    exit 0
fi
[[ "$(id -u)" -eq 0 ]] || { echo "[debian-rootfs] must run as root (debootstrap)" >&2; exit 1; }
if [[ -e "$DIR" ]] && [[ -n "$(ls -A "$DIR" 2>/dev/null)" ]]; then
    echo "[debian-rootfs] $DIR exists, is not empty and has no usr/bin/python3: remove it first" >&2
    exit 1
fi
command -v debootstrap >/dev/null || {
    echo "[debian-rootfs] debootstrap not found: apt-get install debootstrap (or run scripts/setup.sh)" >&2
    exit 1
}

rootfs_build_start "$DIR"
TMP=$ROOTFS_TMP

INCLUDE="python3,ca-certificates${DEBIAN_EXTRA_PACKAGES:+,$DEBIAN_EXTRA_PACKAGES}"
echo "[debian-rootfs] debootstrap --variant=minbase --include=$INCLUDE bookworm -> $DIR (mirror $MIRROR)"
t0=$SECONDS
debootstrap --variant=minbase --include="$INCLUDE" bookworm "$TMP" "$MIRROR"

if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
    mkdir -p "$TMP/etc/ssl/certs"
    cp /etc/ssl/certs/ca-certificates.crt "$TMP/etc/ssl/certs/ca-certificates.crt"
fi

# Shrink: no package caches, lists or logs in the image.
rootfs_shrink "$TMP"

rootfs_build_finish "$DIR"
echo "[debian-rootfs] done in $((SECONDS - t0))s: $(du -sh "$DIR" | cut -f1) in $DIR"
