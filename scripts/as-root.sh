# Sourced first by the scripts that need root (setup.sh, test.sh, demo.sh):
#
#   . "$(dirname "${BASH_SOURCE[0]}")/as-root.sh"
#
# As root it does nothing. As another user it re-runs the calling script, with the same
# arguments, through sudo; where there is no sudo (a fresh Debian 12 has none, and its
# user is root) it stops and says how to become root.
if [[ "$(id -u)" -ne 0 ]]; then
    if command -v sudo >/dev/null; then
        echo "[dsec] $(basename "$0") needs root: re-running it through sudo" >&2
        exec sudo -- bash "$0" "$@"
    fi
    echo "[dsec] $(basename "$0") needs root and there is no sudo here: run it in a root shell (su -)" >&2
    exit 1
fi
