#!/usr/bin/env bash
# The whole dsec test suite. Run as root (the container runtime needs it), after
# scripts/setup.sh:
#
#   ./scripts/test.sh            # every stage
#   ./scripts/test.sh -k create  # extra arguments go to pytest
#
# Stages, stopping at the first failure: fmt, clippy, the static VM guest agent, cargo test,
# debug build, pytest.
# Before pytest it starts dockerd if no Docker daemon answers (stopping it again at the end)
# and adds "docker" to $DSEC_TEST_BACKENDS, and "microvm" and "vm" when QEMU, the guest
# kernel and the static agent are there, so the conformance suite runs on every backend.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

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

if [[ "$(id -u)" -ne 0 ]]; then
    echo "[test] warning: not root; the runtime tests need root and will fail or skip" >&2
fi
command -v cargo >/dev/null || { echo "[test] cargo not found: run scripts/setup.sh" >&2; exit 1; }

stage "fmt" cargo fmt --all --check
stage "clippy" cargo clippy --workspace --all-targets -- -D warnings
stage "guest agent" ./scripts/build-agent.sh
stage "cargo test" cargo test --workspace
stage "debug build" cargo build --workspace

# The docker backend's tests need a Docker daemon: start one for this run when none answers,
# and stop it at the end only if this script started it. Without one they skip.
DOCKERD_PID=""
DOCKERD_LOG="${TMPDIR:-/tmp}/dsec-test-dockerd.log"
start_dockerd() {
    if ! command -v docker >/dev/null || ! command -v dockerd >/dev/null; then
        echo "[test] docker: not installed (scripts/setup.sh installs docker.io); docker tests will skip"
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
    echo "[test] warning: dockerd did not come up; docker tests will skip. Log tail:" >&2
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
# With a daemon, the conformance suite runs on the docker backend too.
if docker info >/dev/null 2>&1 && [[ ",${DSEC_TEST_BACKENDS:-container}," != *",docker,"* ]]; then
    export DSEC_TEST_BACKENDS="${DSEC_TEST_BACKENDS:-container},docker"
fi
# With QEMU, a guest kernel and the static agent, it runs on the VM backends as well.
if command -v qemu-system-x86_64 >/dev/null && ls /boot/vmlinuz-*-cloud-amd64 >/dev/null 2>&1 \
    && [[ -x target/x86_64-unknown-linux-gnu/release/dsec-agent ]]; then
    for b in microvm vm; do
        if [[ ",${DSEC_TEST_BACKENDS:-container}," != *",$b,"* ]]; then
            export DSEC_TEST_BACKENDS="${DSEC_TEST_BACKENDS:-container},$b"
        fi
    done
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
