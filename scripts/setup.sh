#!/usr/bin/env bash
# Set up a fresh Debian 12 (bookworm) machine to build, test and run dsec.
#
#   ./scripts/setup.sh      # as root; as another user it re-runs itself through sudo
#
# Idempotent: re-running it only installs what is missing and rebuilds incrementally.
# Steps: Debian packages (QEMU and the guest kernel included) -> Rust toolchain check ->
# Python SDK + test deps -> release build and the static guest agent -> the grader image's
# root filesystem -> the set-up stamp.
#
# The stamp, `.dsec-setup` at the top of the checkout, lists the features this run set up
# and verified (network, docker, vm, registry, debian-rootfs, http-peers, etcd, postgres,
# grader-image, vm-disk). scripts/test.sh exports it as $DSEC_SETUP_FEATURES: a test whose feature is
# listed fails when the feature is missing, where on a machine that was not set up for it the
# test skips.
#
# Environment:
#   DSEC_SETUP_SKIP_APT=1     do not touch Debian packages
#   DSEC_SETUP_SKIP_BUILD=1   do not run `cargo build --release --workspace` (the demo's and
#                             the benchmarks' build; the tests use a debug build and the
#                             static guest agent, which is built either way)
#   DSEC_SETUP_SKIP_GRADER=1  do not build the grader image's root filesystem (2.5 GB of
#                             Debian packages: ~5 min on an idle host, 25 on a busy one)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/as-root.sh
. "$ROOT/scripts/as-root.sh"

if [[ -t 1 ]]; then C_B=$'\033[1;34m' C_R=$'\033[1;31m' C_0=$'\033[0m'; else C_B="" C_R="" C_0=""; fi
log() { printf '%s[setup]%s %s\n' "$C_B" "$C_0" "$*"; }
die() {
    printf '%s[setup] ERROR:%s %s\n' "$C_R" "$C_0" "$*" >&2
    exit 1
}

export DEBIAN_FRONTEND=noninteractive

# ---------------------------------------------------------------------------------------
# 1. Debian packages
# ---------------------------------------------------------------------------------------
PACKAGES=(
    build-essential # gcc, make, libc headers: Rust linking, bench/floor.c
    pkg-config
    git
    ca-certificates
    curl
    tar
    gzip
    xz-utils
    zstd
    busybox-static  # test and bench rootfs (scripts/make-busybox-rootfs.sh)
    runc            # reference runtime for the benchmarks
    docker.io       # the docker backend's daemon (tests start dockerd; see scripts/test.sh)
    iproute2        # network namespaces, veth
    iptables        # an accept rule when Docker's FORWARD policy is DROP (crates/dsec-net)
    nftables        # sandbox egress policies (crates/dsec-net)
    erofs-utils     # EROFS image layers
    debootstrap     # scripts/make-debian-rootfs.sh, scripts/make-vm-disk.sh
    extlinux        # scripts/make-vm-disk.sh: the test disk's bootloader (with syslinux-common)
    syslinux-common
    docker-registry # a local OCI registry for image-import tests
    skopeo          # pushes test images to that registry
    postgresql      # the trajectory log on --trajectory-db postgres:// (tests start their own cluster)
    etcd-server     # fleet membership (dsec edge/apiserver --etcd; tests start their own etcd)
    protobuf-compiler # protoc: the etcd-client crate compiles etcd's gRPC protocol
    python3
    python3-pip
    python3-venv
    procps          # pgrep/ps used by tests
    psmisc
    kmod            # modprobe overlay
    linux-image-cloud-amd64 # the microvm/vm backends' guest kernel (booted by QEMU, not here)
    e2fsprogs       # mkfs.ext4: VM image and scratch disks
    socat           # tests/test_sdk_transport.py: TLS in front of the server
    tinyproxy-bin   # tests/test_sdk_transport.py: the SDK through an HTTP proxy (no service)
    openssl         # tests/test_sdk_transport.py: a throwaway certificate
)
# QEMU for the microvm/vm backends. Installed apart, with qemu-utils pinned to the same
# version: a newer qemu-utils (from backports) conflicts with bookworm's qemu-system.
QEMU_PACKAGES=(qemu-system-x86 qemu-utils)

if [[ "${DSEC_SETUP_SKIP_APT:-0}" == 1 ]]; then
    log "DSEC_SETUP_SKIP_APT=1: skipping Debian packages"
else
    command -v apt-get >/dev/null || die "apt-get not found: this script targets Debian 12"
    if [[ -r /etc/os-release ]]; then
        # shellcheck disable=SC1091
        . /etc/os-release
        if [[ "${ID:-}" != debian || "${VERSION_ID:-}" != 12 ]]; then
            log "warning: tested on Debian 12, this is ${PRETTY_NAME:-unknown}; continuing"
        fi
    fi
    missing=()
    for p in "${PACKAGES[@]}"; do
        if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
            missing+=("$p")
        fi
    done
    if ((${#missing[@]} == 0)); then
        log "Debian packages: all ${#PACKAGES[@]} already installed"
    else
        # Another apt (unattended-upgrades, a parallel set-up) may hold the lock: wait for it.
        for _ in $(seq 1 120); do
            pgrep -x apt-get >/dev/null || pgrep -x dpkg >/dev/null || break
            log "waiting for another apt-get/dpkg to finish..."
            sleep 5
        done
        log "apt-get update"
        apt-get update -q
        log "installing: ${missing[*]}"
        apt-get install -y -q -o Dpkg::Use-Pty=0 --no-install-recommends "${missing[@]}"
    fi
    qemu_version="$(apt-cache policy qemu-system-x86 | awk '/Candidate:/ {print $2}')"
    [[ -n "$qemu_version" && "$qemu_version" != "(none)" ]] || die "apt knows no qemu-system-x86"
    qemu_missing=()
    for p in "${QEMU_PACKAGES[@]}"; do
        if [[ "$(dpkg-query -W -f='${Status} ${Version}' "$p" 2>/dev/null)" != "install ok installed $qemu_version" ]]; then
            qemu_missing+=("$p=$qemu_version")
        fi
    done
    if ((${#qemu_missing[@]} > 0)); then
        log "installing: ${qemu_missing[*]}"
        apt-get install -y -q -o Dpkg::Use-Pty=0 --no-install-recommends --allow-downgrades \
            "${qemu_missing[@]}"
    fi
fi

# The container runtime stacks image layers with overlayfs.
if ! grep -qw overlay /proc/filesystems; then
    modprobe overlay 2>/dev/null || log "warning: overlayfs is not available (modprobe overlay failed)"
fi

# ---------------------------------------------------------------------------------------
# 2. Rust toolchain (not installed here: we use the one already on the machine)
# ---------------------------------------------------------------------------------------
for d in "${CARGO_HOME:-$HOME/.cargo}/bin" /root/.cargo/bin; do
    if [[ -x "$d/cargo" ]] && [[ ":$PATH:" != *":$d:"* ]]; then
        export PATH="$d:$PATH"
    fi
done
if ! command -v cargo >/dev/null; then
    cat >&2 <<'EOF'
[setup] ERROR: no Rust toolchain found (`cargo` is not on PATH, nor in ~/.cargo/bin).
Install one with rustup, then re-run this script:

    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal \
        --component rustfmt,clippy
    . "$HOME/.cargo/env"
    ./scripts/setup.sh

dsec needs Rust >= 1.85 (see rust-version in Cargo.toml).
EOF
    exit 1
fi
log "Rust: $(cargo --version) at $(command -v cargo)"
need_rust="$(sed -n 's/^rust-version *= *"\([0-9.]*\)".*/\1/p' Cargo.toml | head -1)"
have_rust="$(rustc --version | awk '{print $2}')"
if [[ -n "$need_rust" ]] && [[ "$(printf '%s\n%s\n' "$need_rust" "$have_rust" | sort -V | head -1)" != "$need_rust" ]]; then
    die "Rust $have_rust is older than $need_rust (rust-version in Cargo.toml): rustup update stable"
fi
# rustfmt and clippy are needed by scripts/test.sh; add them if rustup can.
if command -v rustup >/dev/null; then
    for comp in rustfmt clippy; do
        if ! cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1; then
            log "rustup component add $comp"
            rustup component add "$comp" || log "warning: could not add $comp"
        fi
    done
fi

# ---------------------------------------------------------------------------------------
# 3. Python SDK (editable) and test dependencies, into the current python3
# ---------------------------------------------------------------------------------------
command -v python3 >/dev/null || die "python3 not found"
log "Python: $(python3 --version 2>&1) at $(command -v python3)"
if ! python3 -m pip --version >/dev/null 2>&1; then
    log "pip missing for this python3; trying ensurepip"
    python3 -m ensurepip --upgrade >/dev/null 2>&1 || die "python3 has no pip; install python3-pip"
fi
PIP_ARGS=(--quiet --disable-pip-version-check --no-input --root-user-action=ignore)
# Debian's own python3 is "externally managed" (PEP 668); this machine is dedicated to dsec.
if python3 -c 'import sys, sysconfig, os; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)'; then
    PIP_ARGS+=(--break-system-packages)
fi
log "pip install -e python/ with its test, demo and lint dependencies"
python3 -m pip install "${PIP_ARGS[@]}" -e "python/[test,demo,dev]"
# veRL's SandboxFusion scorer, run against dsec by tests/test_sandboxfusion_verl.py: that
# module needs only requests, so none of veRL's (heavy) dependencies are installed.
python3 -m pip install "${PIP_ARGS[@]}" requests
python3 -m pip install "${PIP_ARGS[@]}" --no-deps verl==0.9.1
# The real e2b SDK, pinned to the version docs/protocols' E2B.md describes: tests/test_e2b.py
# drives dsec's E2B API with it.
log "pip install e2b==2.63.0 (the e2b SDK, for tests/test_e2b.py)"
python3 -m pip install "${PIP_ARGS[@]}" "e2b==2.63.0"

# ---------------------------------------------------------------------------------------
# 4. Build
# ---------------------------------------------------------------------------------------
if [[ "${DSEC_SETUP_SKIP_BUILD:-0}" == 1 ]]; then
    log "DSEC_SETUP_SKIP_BUILD=1: skipping the release build"
else
    log "cargo build --release --workspace"
    cargo build --release --workspace
    [[ -x target/release/dsec ]] || die "build finished but target/release/dsec is missing"
    log "built target/release/dsec"
fi
# The VM guests' PID 1, whatever else is built: the VM backends need it (one small crate).
log "building the static VM guest agent (scripts/build-agent.sh)"
./scripts/build-agent.sh

# ---------------------------------------------------------------------------------------
# 5. The grader image's root filesystem (tests/test_sandboxfusion.py imports it): built
#    here rather than in the test suite's time. Idempotent: a no-op once built.
# ---------------------------------------------------------------------------------------
GRADER_ROOTFS="${DSEC_TEST_GRADER_ROOTFS:-/var/tmp/dsec-test-grader-rootfs}"
if [[ "${DSEC_SETUP_SKIP_GRADER:-0}" == 1 ]]; then
    log "DSEC_SETUP_SKIP_GRADER=1: skipping the grader image"
else
    log "the grader image's root filesystem in $GRADER_ROOTFS (scripts/make-grader-image.sh)"
    ./scripts/make-grader-image.sh "$GRADER_ROOTFS" || log "the grader image could not be built"
fi

# ---------------------------------------------------------------------------------------
# 5b. A bootable Debian disk for the vm backend (tests/test_vm_disk.py imports it): about
#     three minutes the first time (packages cached in /var/tmp/dsec-vm-disk-cache), a few
#     seconds after (a new agent), a no-op when nothing changed.
# ---------------------------------------------------------------------------------------
VM_DISK="${DSEC_TEST_VM_DISK:-/var/tmp/dsec-test-vm-disk.qcow2}"
if [[ "${DSEC_SETUP_SKIP_VM_DISK:-0}" == 1 ]]; then
    log "DSEC_SETUP_SKIP_VM_DISK=1: skipping the bootable VM disk"
else
    log "a bootable Debian disk for the vm backend in $VM_DISK (scripts/make-vm-disk.sh)"
    ./scripts/make-vm-disk.sh "$VM_DISK" || log "the bootable VM disk could not be built"
fi

# ---------------------------------------------------------------------------------------
# 6. The set-up stamp: what this machine is now set up for, each feature checked
# ---------------------------------------------------------------------------------------
features=()
not_set_up=()
feature() { # feature NAME WHY-NOT CHECK...: NAME is set up when CHECK succeeds
    local name=$1 why=$2
    shift 2
    if "$@" >/dev/null 2>&1; then features+=("$name"); else not_set_up+=("$name ($why)"); fi
}
have() { for c in "$@"; do command -v "$c" || return 1; done; }
vm_ready() {
    have qemu-system-x86_64 qemu-img && compgen -G "/boot/vmlinuz-*-cloud-amd64" \
        && [[ -x target/x86_64-unknown-linux-gnu/release/dsec-agent ]]
}
feature network "nft, ip or the kernel's nf_tables missing" eval 'have nft ip && nft list tables'
feature docker "dockerd or docker missing" have dockerd docker
feature vm "QEMU, the cloud kernel or the static agent missing" vm_ready
feature registry "docker-registry or skopeo missing" have docker-registry skopeo
feature debian-rootfs "debootstrap missing" have debootstrap
feature http-peers "socat, tinyproxy or openssl missing" have socat tinyproxy openssl
feature etcd "etcd (etcd-server) missing" have etcd
feature postgres "PostgreSQL's initdb missing" eval 'compgen -G "/usr/lib/postgresql/*/bin/initdb"'
feature grader-image "scripts/make-grader-image.sh failed or was skipped" \
    test -f "$GRADER_ROOTFS/etc/dsec-grader"
feature vm-disk "scripts/make-vm-disk.sh failed or was skipped" test -f "$VM_DISK"
{
    echo "# Written by scripts/setup.sh on $(date -u +%FT%TZ): the features it set up and checked."
    echo "# scripts/test.sh exports them as DSEC_SETUP_FEATURES; a test of a listed feature"
    echo "# fails when the feature is missing (see tests/dsec_testlib.py, require)."
    printf '%s\n' "${features[@]}"
} >.dsec-setup
log "set up: ${features[*]:-nothing} (recorded in .dsec-setup)"
((${#not_set_up[@]} == 0)) || log "not set up: ${not_set_up[*]}"
log "done"
