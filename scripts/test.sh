#!/usr/bin/env bash
# The whole dsec test suite, after scripts/setup.sh:
#
#   ./scripts/test.sh            # every stage; as root, or it re-runs itself through sudo
#   ./scripts/test.sh -k create  # extra arguments go to pytest
#
# Stages, stopping at the first failure: fmt, clippy, ruff, mypy, the static VM guest agent,
# cargo test, debug build, pytest.
#
# On a machine scripts/setup.sh set up (its stamp, .dsec-setup, is there) the features it
# lists are exported as $DSEC_SETUP_FEATURES: a test that finds one of them missing fails
# instead of skipping, and `cargo test` runs the ignored tests too (those needing the
# set-up's services). Without the stamp, tests of missing features skip.
# Before pytest it starts dockerd if no Docker daemon answers (stopping it again at the end)
# and adds "docker" to $DSEC_TEST_BACKENDS, and "microvm" and "vm" when the set-up has VMs
# (or QEMU, the guest kernel and the static agent are there), so the conformance suite runs
# on every backend.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/as-root.sh
. "$ROOT/scripts/as-root.sh"

for d in "${CARGO_HOME:-$HOME/.cargo}/bin" /root/.cargo/bin; do
    if [[ -x "$d/cargo" ]] && [[ ":$PATH:" != *":$d:"* ]]; then
        export PATH="$d:$PATH"
    fi
done

if [[ -t 1 ]]; then C_B=$'\033[1;34m' C_G=$'\033[1;32m' C_R=$'\033[1;31m' C_0=$'\033[0m'; else C_B="" C_G="" C_R="" C_0=""; fi
CURRENT_STAGE=""
START_ALL=$SECONDS
on_exit() {
    local rc=$?
    if declare -F stop_dockerd >/dev/null; then stop_dockerd; fi
    if ((rc != 0)) && [[ -n "$CURRENT_STAGE" ]]; then
        printf '\n%s[test] FAILED at stage: %s (exit %d)%s\n' "$C_R" "$CURRENT_STAGE" "$rc" "$C_0" >&2
    fi
}
trap on_exit EXIT

stage() {
    CURRENT_STAGE="$1"
    shift
    local t0=$SECONDS
    printf '\n%s[test] === %s: %s%s\n' "$C_B" "$CURRENT_STAGE" "$*" "$C_0"
    "$@"
    printf '%s[test] --- %s passed (%ds)%s\n' "$C_G" "$CURRENT_STAGE" $((SECONDS - t0)) "$C_0"
}

command -v cargo >/dev/null || { echo "[test] cargo not found: run scripts/setup.sh" >&2; exit 1; }
for m in ruff mypy; do
    python3 -m "$m" --version >/dev/null 2>&1 \
        || { echo "[test] python3 -m $m not found: run scripts/setup.sh" >&2; exit 1; }
done

# What scripts/setup.sh set up on this machine (an explicit $DSEC_SETUP_FEATURES wins).
SETUP_STAMP="$ROOT/.dsec-setup"
CARGO_TEST_ARGS=()
if [[ -f "$SETUP_STAMP" ]]; then
    export DSEC_SETUP_FEATURES="${DSEC_SETUP_FEATURES-$(grep -v '^#' "$SETUP_STAMP" | xargs)}"
    CARGO_TEST_ARGS=(-- --include-ignored)
    echo "[test] set up by scripts/setup.sh for: ${DSEC_SETUP_FEATURES:-nothing}; their tests fail, not skip, if missing"
else
    export DSEC_SETUP_FEATURES="${DSEC_SETUP_FEATURES-}"
    echo "[test] no $SETUP_STAMP (scripts/setup.sh not run here): tests of missing features skip"
fi
has_feature() { [[ " ${DSEC_SETUP_FEATURES//,/ } " == *" $1 "* ]]; }

# The Python files ruff formats: the SDK, the tools, bench, demo and the test helpers.
# (Test files are linted, not reformatted: their owners format them when they edit them.)
RUFF_FORMATTED=(python tools bench/bench.py bench/dsec_bench demo tests/conftest.py
    tests/dsec_testlib.py tests/test_sdk_parity.py tests/test_sdk_docs.py tests/test_calls.py
    tests/test_sdk_transport.py)
ruff_stage() {
    python3 -m ruff check .
    python3 -m ruff format --check "${RUFF_FORMATTED[@]}"
}
mypy_stage() {
    python3 -m mypy # strict, on the files mypy.ini names
    python3 -m mypy --allow-untyped-defs --allow-incomplete-defs --allow-untyped-calls \
        --no-warn-unused-ignores tests
}

stage "fmt" cargo fmt --all --check
stage "clippy" cargo clippy --workspace --all-targets -- -D warnings
stage "ruff" ruff_stage
stage "mypy" mypy_stage
stage "guest agent" ./scripts/build-agent.sh
stage "cargo test" cargo test --workspace "${CARGO_TEST_ARGS[@]}"
stage "debug build" cargo build --workspace

# The docker backend's tests need a Docker daemon: start one for this run when none answers,
# and stop it at the end only if this script started it. Without one they fail where the
# set-up installed Docker, and skip where it did not.
DOCKERD_PID=""
DOCKERD_LOG="${TMPDIR:-/tmp}/dsec-test-dockerd.log"
start_dockerd() {
    if ! command -v docker >/dev/null || ! command -v dockerd >/dev/null; then
        echo "[test] docker: not installed (scripts/setup.sh installs docker.io)"
        return 0
    fi
    docker info >/dev/null 2>&1 && return 0
    echo "[test] docker: starting dockerd (log: $DOCKERD_LOG)"
    # Sandboxes use --network none: no bridge, no iptables rules on the host.
    dockerd --host=unix:///var/run/docker.sock --bridge=none --iptables=false \
        >"$DOCKERD_LOG" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && return 0
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 0.5
    done
    echo "[test] warning: dockerd did not come up. Log tail:" >&2
    tail -n 20 "$DOCKERD_LOG" >&2 || true
}
stop_dockerd() {
    if [[ -n "$DOCKERD_PID" ]]; then
        echo "[test] docker: stopping the dockerd this run started"
        kill "$DOCKERD_PID" 2>/dev/null || true
        wait "$DOCKERD_PID" 2>/dev/null || true
        DOCKERD_PID=""
    fi
}
start_dockerd
add_backend() {
    if [[ ",${DSEC_TEST_BACKENDS:-container}," != *",$1,"* ]]; then
        export DSEC_TEST_BACKENDS="${DSEC_TEST_BACKENDS:-container},$1"
    fi
}
# With a daemon (or one the set-up installed), the conformance suite runs on docker too.
if has_feature docker || docker info >/dev/null 2>&1; then
    add_backend docker
fi
# With VMs set up (or QEMU, a guest kernel and the static agent there), on the VM backends.
if has_feature vm || { command -v qemu-system-x86_64 >/dev/null \
    && ls /boot/vmlinuz-*-cloud-amd64 >/dev/null 2>&1 \
    && [[ -x target/x86_64-unknown-linux-gnu/release/dsec-agent ]]; }; then
    add_backend microvm
    add_backend vm
else
    echo "[test] VM backends: QEMU, the cloud kernel or the agent missing (scripts/setup.sh); their tests skip"
fi
echo "[test] backends under test: ${DSEC_TEST_BACKENDS:-container}"

pytest_stage() {
    local rc=0
    python3 -m pytest -q tests/ "$@" || rc=$?
    if ((rc == 5)); then
        echo "[test] pytest collected no tests: that is a failure" >&2
        return 1
    fi
    return "$rc"
}
stage "pytest" pytest_stage "$@"

CURRENT_STAGE=""
printf '\n%s[test] all stages passed in %ds%s\n' "$C_G" $((SECONDS - START_ALL)) "$C_0"
