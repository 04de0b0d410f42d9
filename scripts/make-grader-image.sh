#!/usr/bin/env bash
# Build the root filesystem of dsec's "grader" image in DIR: Debian 12 (bookworm) with the
# language runtimes SandboxFusion's /run_code runs, all from Debian packages (debootstrap
# and apt from the Debian mirror; no other network source). Needs root and network.
#
#   ./scripts/make-grader-image.sh DIR [LANGUAGE...]
#   dsec image import DIR --name grader
#
# With no LANGUAGE, every language below; otherwise only those (the image records which,
# and dsec's /run_code answers SandboxError naming the runtime for the others).
#
# Idempotent: does nothing if DIR was built by this version of the script with the same
# languages. Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian),
# DEBIAN_SECURITY_MIRROR (default http://deb.debian.org/debian-security).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib/rootfs-build.sh"

# Packages per SandboxFusion language, installed with --no-install-recommends. bash and
# perl come with the base system; a language with no packages of its own is listed so
# that it can be named.
declare -A PACKAGES=(
    [python]="python3 python-is-python3 python3-numpy python3-pytest"
    [pytest]="python3 python-is-python3 python3-numpy python3-pytest"
    [cpp]="g++ libssl-dev"
    [go]="golang-go"
    [go_test]="golang-go"
    [java]="openjdk-17-jdk-headless libjavatuples-java"
    [junit]="openjdk-17-jdk-headless junit5"
    [nodejs]="nodejs"
    [typescript]="nodejs node-typescript"
    [rust]="rustc"
    [bash]=""
    [php]="php-cli"
    [ruby]="ruby"
    [perl]="perl"
    [lua]="lua5.4"
    [R]="r-base-core"
    [scala]="scala openjdk-17-jdk-headless"
    [racket]="racket"
    [verilog]="iverilog"
    [D_ut]="ldc"
    [csharp]="mono-mcs mono-runtime"
)
ALL_LANGUAGES=(python pytest cpp go go_test java junit nodejs typescript rust bash php ruby perl
    lua R scala racket verilog D_ut csharp)
# Bump when the image's content changes for the same languages.
FORMAT=1

usage() {
    echo "usage: $0 DIR [LANGUAGE...]   (languages: ${ALL_LANGUAGES[*]})" >&2
    exit 2
}
log() { printf '[grader-image] %s\n' "$*"; }

(($# >= 1)) || usage
DIR="$1"
shift
[[ -n "$DIR" && "$DIR" != / ]] || usage
LANGUAGES=("$@")
((${#LANGUAGES[@]} > 0)) || LANGUAGES=("${ALL_LANGUAGES[@]}")
for lang in "${LANGUAGES[@]}"; do
    [[ -v "PACKAGES[$lang]" ]] || { echo "unknown language: $lang" >&2; usage; }
done
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
STAMP_PATH=etc/dsec-grader
STAMP="format=$FORMAT languages=${LANGUAGES[*]}"

if [[ -f "$DIR/$STAMP_PATH" ]] && [[ "$(cat "$DIR/$STAMP_PATH")" == "$STAMP" ]]; then
    log "$DIR is already a grader image with these languages: nothing to do"
    exit 0
fi
[[ "$(id -u)" -eq 0 ]] || { echo "[grader-image] must run as root (debootstrap, chroot)" >&2; exit 1; }
if [[ -e "$DIR" ]] && [[ -n "$(ls -A "$DIR" 2>/dev/null)" ]]; then
    echo "[grader-image] $DIR exists and is not this grader image: remove it first" >&2
    exit 1
fi
for tool in debootstrap unshare chroot; do
    command -v "$tool" >/dev/null || {
        echo "[grader-image] $tool not found (apt-get install debootstrap util-linux)" >&2
        exit 1
    }
done

packages=()
for lang in "${LANGUAGES[@]}"; do
    read -ra words <<<"${PACKAGES[$lang]}"
    packages+=("${words[@]}")
done
mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u | sed '/^$/d')

rootfs_build_start "$DIR"
TMP=$ROOTFS_TMP
t0=$SECONDS

# Documentation, manuals and translations are never read by a grader: dpkg skips them.
mkdir -p "$TMP/etc/dpkg/dpkg.cfg.d"
cat >"$TMP/etc/dpkg/dpkg.cfg.d/dsec-grader-slim" <<'EOF'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
path-exclude=/usr/share/lintian/*
EOF

log "debootstrap --variant=minbase bookworm (mirror $MIRROR)"
debootstrap --variant=minbase --include=ca-certificates bookworm "$TMP" "$MIRROR"
t_base=$SECONDS

cat >"$TMP/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $SECURITY_MIRROR bookworm-security main
EOF
# No daemon may start inside the chroot while packages install.
printf '#!/bin/sh\nexit 101\n' >"$TMP/usr/sbin/policy-rc.d"
chmod 755 "$TMP/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$TMP/etc/resolv.conf"

log "installing ${#packages[@]} packages for: ${LANGUAGES[*]}"
# A private mount namespace: /proc mounted for the maintainer scripts goes away with it.
unshare --mount --fork /bin/sh -euc '
    mount --make-rprivate /
    mount -t proc proc "$1/proc"
    shift
    root="$1"
    shift
    chroot "$root" /usr/bin/env DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 \
        apt-get update -q
    chroot "$root" /usr/bin/env DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 \
        apt-get install -y -q -o Dpkg::Use-Pty=0 --no-install-recommends "$@"
' sh "$TMP" "$TMP" "${packages[@]}"
t_packages=$SECONDS

has() { [[ " ${LANGUAGES[*]} " == *" $1 "* ]]; }

# The working directories of /run_code: /tmp/sandbox/<language>, with the files that
# SandboxFusion copies into its temporary directory for that language.
mkdir -p "$TMP/tmp/sandbox"
chmod 1777 "$TMP/tmp"
for lang in "${LANGUAGES[@]}"; do mkdir -p "$TMP/tmp/sandbox/$lang"; done
if has go || has go_test; then
    for lang in go go_test; do
        has "$lang" && printf 'module SeedSandbox\n\ngo 1.19\n' >"$TMP/tmp/sandbox/$lang/go.mod"
    done
fi
if has java; then
    ln -s /usr/share/java/javatuples.jar "$TMP/tmp/sandbox/java/javatuples-1.2.jar"
fi
if has junit; then
    ln -s /usr/share/java/junit-platform-console-standalone.jar \
        "$TMP/tmp/sandbox/junit/junit-platform-console-standalone-1.8.2.jar"
    ln -s /usr/share/java/junit-jupiter-api.jar \
        "$TMP/tmp/sandbox/junit/junit-jupiter-api-5.11.0-javadoc.jar"
fi
# SandboxFusion's D compiler is dmd; Debian packages LDC, whose ldmd2 takes dmd's flags.
if has D_ut; then ln -s /usr/bin/ldmd2 "$TMP/usr/local/bin/dmd"; fi
# SandboxFusion runs TypeScript with tsx (esbuild: types stripped, not checked), which
# Debian does not package; this does the same with Debian's TypeScript compiler.
if has typescript; then
    cat >"$TMP/usr/local/bin/tsx" <<'EOF'
#!/usr/bin/node
// tsx FILE [ARGS...]: run a TypeScript file as tsx does, types stripped and not checked.
'use strict';
const fs = require('fs');
const path = require('path');
const Module = require('module');
const ts = require('typescript');

if (process.argv.length < 3) {
  process.stderr.write('usage: tsx FILE [ARGS...]\n');
  process.exit(2);
}
const compile = (module, filename) => {
  const out = ts.transpileModule(fs.readFileSync(filename, 'utf8'), {
    fileName: filename,
    reportDiagnostics: true,
    compilerOptions: {
      module: ts.ModuleKind.CommonJS,
      target: ts.ScriptTarget.ES2022,
      esModuleInterop: true,
    },
  });
  if (out.diagnostics.length > 0) {
    const host = {
      getCanonicalFileName: (f) => f,
      getCurrentDirectory: () => process.cwd(),
      getNewLine: () => '\n',
    };
    process.stderr.write(ts.formatDiagnostics(out.diagnostics, host));
    process.exit(1);
  }
  module._compile(out.outputText, filename);
};
for (const ext of ['.ts', '.tsx', '.mts', '.cts']) Module._extensions[ext] = compile;
process.argv.splice(1, 1);
process.argv[1] = path.resolve(process.argv[1]);
Module.runMain();
EOF
    chmod 755 "$TMP/usr/local/bin/tsx"
fi

# Warm what every first call would otherwise build: Go's build cache of the standard
# library's runtime pieces, so that `go build` of a small program links in well under a
# second.
if has go || has go_test; then
    mkdir -p "$TMP/tmp/warm"
    printf 'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println(1) }\n' >"$TMP/tmp/warm/warm.go"
    unshare --mount --fork /bin/sh -euc '
        mount --make-rprivate /
        mount -t proc proc "$1/proc"
        chroot "$1" /usr/bin/env HOME=/root /bin/sh -c "cd /tmp/warm && go build -o warm warm.go"
    ' sh "$TMP"
    rm -rf "$TMP/tmp/warm"
fi

# Shrink: no package caches, lists or logs in the image.
rm -f "$TMP/usr/sbin/policy-rc.d" "$TMP/etc/resolv.conf"
rootfs_shrink "$TMP"
echo "$STAMP" >"$TMP/$STAMP_PATH"

rootfs_build_finish "$DIR"
log "done in $((SECONDS - t0))s (base $((t_base - t0))s, packages $((t_packages - t_base))s):" \
    "$(du -sh "$DIR" | cut -f1) in $DIR"
