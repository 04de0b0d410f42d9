#!/usr/bin/env bash
# Set the machine up (scripts/setup.sh), then run the demo: 300 agent sandboxes.
# demo/demo.py starts target/release/dsec itself. Extra arguments go to demo.py.
#
#   ./scripts/demo.sh          # as root; as another user it re-runs itself through sudo
#   ./scripts/demo.sh --n 50
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/as-root.sh
. "$ROOT/scripts/as-root.sh"

echo "[demo] setting up (scripts/setup.sh)"
bash "$ROOT/scripts/setup.sh"

for d in "${CARGO_HOME:-$HOME/.cargo}/bin" /root/.cargo/bin; do
    if [[ -x "$d/cargo" ]] && [[ ":$PATH:" != *":$d:"* ]]; then
        export PATH="$d:$PATH"
    fi
done

[[ -f demo/demo.py ]] || { echo "[demo] demo/demo.py not found" >&2; exit 1; }
args=(--n 300)
if (($# > 0)); then
    args=("$@")
fi
echo "[demo] python3 demo/demo.py ${args[*]}"
exec python3 demo/demo.py "${args[@]}"
