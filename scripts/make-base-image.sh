#!/usr/bin/env bash
# Build the root filesystem of E2B's "base" template in DIR: Debian 12 (bookworm) minbase
# with python3, sudo, procps, attr (setfattr) and curl, and the user `user` (home
# /home/user, password-less sudo) that the e2b SDK's tests expect. Import it with
# `dsec images import DIR --name base`. Needs root and network (a Debian mirror).
#
#   ./scripts/make-base-image.sh DIR
#
# Idempotent: does nothing if DIR was made by this script already.
# Environment: DEBIAN_MIRROR, as scripts/make-debian-rootfs.sh.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib/rootfs-build.sh"

usage() {
    echo "usage: $0 DIR" >&2
    exit 2
}
(($# == 1)) || usage
DIR="${1%/}"
[[ -n "$DIR" && "$DIR" != / ]] || usage
MARKER=etc/dsec-base-image

if [[ -f "$DIR/$MARKER" ]]; then
    echo "[base-image] $DIR is a base image already: nothing to do"
    exit 0
fi
[[ "$(id -u)" -eq 0 ]] || { echo "[base-image] must run as root (debootstrap, chroot)" >&2; exit 1; }
if [[ -e "$DIR" ]] && [[ -n "$(ls -A "$DIR" 2>/dev/null)" ]]; then
    echo "[base-image] $DIR exists, is not empty and is no base image: remove it first" >&2
    exit 1
fi

t0=$SECONDS
rootfs_build_start "$DIR"
ROOT="$ROOTFS_TMP"
DEBIAN_EXTRA_PACKAGES=sudo,procps,attr,curl \
    "$(dirname "$0")/make-debian-rootfs.sh" "$ROOT"

chroot "$ROOT" /usr/sbin/useradd --create-home --home-dir /home/user --shell /bin/bash \
    --groups sudo user
echo "user ALL=(ALL:ALL) NOPASSWD: ALL" >"$ROOT/etc/sudoers.d/user"
chmod 0440 "$ROOT/etc/sudoers.d/user"
rm -f "$ROOT"/var/log/*.log
echo "E2B base template for dsec, made by scripts/make-base-image.sh" >"$ROOT/$MARKER"

rootfs_build_finish "$DIR"
echo "[base-image] done in $((SECONDS - t0))s: $(du -sh "$DIR" | cut -f1) in $DIR"
