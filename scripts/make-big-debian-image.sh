#!/usr/bin/env bash
# Build a large Debian 12 (bookworm) root filesystem in DIR, like a software-engineering
# task image: compilers (build-essential), python3 with numpy, scipy and pandas, git, and a
# source tree (the Linux kernel's, unpacked in /src/linux). About 2 GiB; for the image
# benchmarks (bench/images.py). Needs root and the Debian mirror; takes minutes.
#
#   ./scripts/make-big-debian-image.sh DIR
#
# Idempotent: does nothing if DIR/src/linux/Makefile already exists.
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib/rootfs-build.sh"

(($# == 1)) || { echo "usage: $0 DIR" >&2; exit 2; }
DIR="$1"
[[ -n "$DIR" && "$DIR" != / ]] || { echo "usage: $0 DIR" >&2; exit 2; }
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES=build-essential,python3,python3-numpy,python3-scipy,python3-pandas,git,linux-source-6.1,xz-utils,ca-certificates

if [[ -f "$DIR/src/linux/Makefile" ]]; then
    echo "[big-debian] $DIR already has /src/linux: nothing to do"
    exit 0
fi
[[ "$(id -u)" -eq 0 ]] || { echo "[big-debian] must run as root (debootstrap)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "[big-debian] debootstrap not found (scripts/setup.sh installs it)" >&2; exit 1; }
if [[ -e "$DIR" ]] && [[ -n "$(ls -A "$DIR" 2>/dev/null)" ]]; then
    echo "[big-debian] $DIR exists, is not empty and has no /src/linux: remove it first" >&2
    exit 1
fi

rootfs_build_start "$DIR"
TMP=$ROOTFS_TMP

echo "[big-debian] debootstrap --variant=minbase --include=$PACKAGES bookworm -> $DIR"
t0=$SECONDS
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$TMP" "$MIRROR"
mkdir -p "$TMP/src"
tar -C "$TMP/src" -xf "$TMP"/usr/src/linux-source-6.1.tar.xz
mv "$TMP"/src/linux-source-6.1 "$TMP/src/linux"
rm -f "$TMP"/usr/src/linux-source-6.1.tar.xz
rootfs_shrink "$TMP"
rootfs_build_finish "$DIR"
echo "[big-debian] $DIR: $(du -sh "$DIR" | cut -f1) in $((SECONDS - t0)) s"
