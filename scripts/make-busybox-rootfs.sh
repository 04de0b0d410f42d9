#!/bin/sh
# Build a minimal busybox root filesystem in DEST, from a static busybox binary.
#
#   scripts/make-busybox-rootfs.sh DEST [BUSYBOX]
#
# BUSYBOX defaults to $BUSYBOX, else /bin/busybox (Debian: apt-get install busybox-static).
# Import the result with `dsec image import DEST --name busybox`, or pack it first:
#   tar -C DEST -czf busybox.tar.gz .
set -eu

usage() { echo "usage: $0 DEST [BUSYBOX]" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
dest=$1
bb=${2:-${BUSYBOX:-/bin/busybox}}

[ -x "$bb" ] || { echo "$0: no busybox at $bb (apt-get install busybox-static)" >&2; exit 1; }
# The binary runs inside the image, where there is no libc: it must be static.
if command -v ldd >/dev/null 2>&1 && ldd "$bb" >/dev/null 2>&1; then
    echo "$0: $bb is dynamically linked; use a static busybox (busybox-static)" >&2
    exit 1
fi
if [ -e "$dest" ] && [ -n "$(ls -A "$dest" 2>/dev/null)" ]; then
    echo "$0: $dest exists and is not empty" >&2
    exit 1
fi

mkdir -p "$dest"
cd "$dest"
mkdir -p bin sbin usr/bin usr/sbin etc root home proc sys dev tmp var/tmp run work
chmod 1777 tmp var/tmp
chmod 700 root
cp "$bb" bin/busybox
chmod 755 bin/busybox

# One relative symlink per applet, at the path busybox itself lists (bin/ls, usr/bin/awk...).
"$bb" --list-full | while read -r applet; do
    [ -n "$applet" ] || continue
    [ -e "$applet" ] || [ -L "$applet" ] && continue
    dir=$(dirname "$applet")
    mkdir -p "$dir"
    up=""
    rest=$dir
    while [ "$rest" != "." ] && [ -n "$rest" ]; do
        up="../$up"
        rest=$(dirname "$rest")
    done
    ln -s "${up}bin/busybox" "$applet"
done
[ -e bin/sh ] || ln -s busybox bin/sh

cat > etc/passwd <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat > etc/group <<'EOF'
root:x:0:
nogroup:x:65534:
EOF
cat > etc/hosts <<'EOF'
127.0.0.1 localhost
::1 localhost
EOF
echo "dsec-busybox" > etc/hostname
printf 'PATH=/usr/sbin:/usr/bin:/sbin:/bin\n' > etc/profile
chmod 644 etc/passwd etc/group etc/hosts etc/hostname etc/profile
echo "$0: busybox rootfs in $dest ($(ls bin | wc -l) entries in bin/)" >&2
