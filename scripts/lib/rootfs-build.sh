# Shared by the scripts that build a root filesystem with debootstrap (sourced, not run):
# the tree is built beside its destination and renamed into place at the end, so that an
# interrupted run never leaves a half-made DIR that a later run would take for a finished
# one; and what only the build needed (package caches, lists, logs) is left out.
#
#   . "$(dirname "${BASH_SOURCE[0]}")/lib/rootfs-build.sh"
#   rootfs_build_start DIR     # sets $ROOTFS_TMP, removed again if the script fails
#   ...debootstrap into "$ROOTFS_TMP"...
#   rootfs_shrink "$ROOTFS_TMP"
#   rootfs_build_finish DIR

ROOTFS_TMP=""

# Makes $ROOTFS_TMP beside DIR, with a trap that removes it on exit, unmounting first what
# a failed debootstrap may have left mounted inside it.
rootfs_build_start() {
    local dir=$1
    mkdir -p "$(dirname "$dir")"
    ROOTFS_TMP="$(mktemp -d "${dir%/}.tmp.XXXXXX")"
    trap rootfs_build_abort EXIT
}

rootfs_build_abort() {
    [[ -n "$ROOTFS_TMP" && -d "$ROOTFS_TMP" ]] || return 0
    local m
    for m in proc sys dev/pts dev; do
        if mountpoint -q "$ROOTFS_TMP/$m" 2>/dev/null; then umount -l "$ROOTFS_TMP/$m" || true; fi
    done
    rm -rf --one-file-system "$ROOTFS_TMP"
}

# Removes package caches, lists and logs from the tree at ROOT (apt can refetch the lists).
rootfs_shrink() {
    local root=${1:?}
    rm -rf "$root"/var/cache/apt/archives/*.deb \
        "$root"/var/cache/apt/*.bin \
        "$root"/var/lib/apt/lists/* \
        "$root"/var/log/*.log \
        "$root"/var/log/apt/* \
        "$root"/var/cache/debconf/*-old \
        "$root"/debootstrap
    mkdir -p "$root/var/lib/apt/lists/partial"
}

# Renames the finished $ROOTFS_TMP to DIR (an empty DIR is replaced).
rootfs_build_finish() {
    local dir=$1
    if [[ -d "$dir" ]]; then rmdir "$dir"; fi
    mv "$ROOTFS_TMP" "$dir"
    ROOTFS_TMP=""
    trap - EXIT
}
