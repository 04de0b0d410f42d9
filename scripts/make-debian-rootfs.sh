#!/usr/bin/env bash
# Build a minimal Debian 12 (bookworm) root filesystem with python3 in DIR, for tests and
# demos that need a real distribution. Takes about a minute; needs root and network.
#
#   ./scripts/make-debian-rootfs.sh DIR
#
# Idempotent: does nothing if DIR/usr/bin/python3 already exists.
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

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

# Build into a sibling temporary directory and rename at the end, so that an interrupted
# run never leaves a half-made DIR that later runs would take for a finished one.
mkdir -p "$(dirname "$DIR")"
TMP="$(mktemp -d "${DIR%/}.tmp.XXXXXX")"
cleanup() {
    # debootstrap may leave /proc or /sys mounted inside the target on failure.
    local m
    for m in proc sys dev/pts dev; do
        if mountpoint -q "$TMP/$m" 2>/dev/null; then umount -l "$TMP/$m" || true; fi
    done
    rm -rf --one-file-system "$TMP"
}
trap cleanup EXIT

echo "[debian-rootfs] debootstrap --variant=minbase --include=python3 bookworm -> $DIR (mirror $MIRROR)"
t0=$SECONDS
debootstrap --variant=minbase --include=python3,ca-certificates bookworm "$TMP" "$MIRROR"

if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
    mkdir -p "$TMP/etc/ssl/certs"
    cp /etc/ssl/certs/ca-certificates.crt "$TMP/etc/ssl/certs/ca-certificates.crt"
fi

# Shrink: no package caches, lists or logs in the image.
rm -rf "${TMP:?}"/var/cache/apt/archives/*.deb \
    "${TMP:?}"/var/cache/apt/*.bin \
    "${TMP:?}"/var/lib/apt/lists/* \
    "${TMP:?}"/var/log/*.log \
    "${TMP:?}"/var/log/apt/* \
    "${TMP:?}"/var/cache/debconf/*-old \
    "${TMP:?}"/debootstrap
mkdir -p "$TMP/var/lib/apt/lists/partial"

if [[ -d "$DIR" ]]; then rmdir "$DIR"; fi
mv "$TMP" "$DIR"
trap - EXIT
echo "[debian-rootfs] done in $((SECONDS - t0))s: $(du -sh "$DIR" | cut -f1) in $DIR"
