#!/bin/sh
# Builds dsec-agent, the PID 1 of every dsec VM guest, as a static executable (the guest's
# initramfs has no libc): target/x86_64-unknown-linux-gnu/release/dsec-agent, where the
# server looks for it (or pass --guest-agent). Usage: scripts/build-agent.sh
set -eu
cd "$(dirname "$0")/.."
RUSTFLAGS="-C target-feature=+crt-static -C strip=symbols" \
    cargo build --quiet --release --target x86_64-unknown-linux-gnu -p dsec-agent
