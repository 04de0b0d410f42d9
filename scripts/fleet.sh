#!/usr/bin/env bash
# A local dsec fleet for tests and demos: etcd, PostgreSQL (the fleet's trajectory log), an
# OCI registry (the fleet's images), N edges each in a network namespace of its own (a
# simulated host with its own address), and two apiservers, all on this machine.
#
#   scripts/fleet.sh up N      # start; prints the apiservers' URLs
#   scripts/fleet.sh down      # stop exactly what `up` started (by pid) and remove its namespaces
#   scripts/fleet.sh status    # what is running
#
# $DSEC_FLEET_DIR: where the fleet keeps its state, logs and pids [/tmp/dsec-fleet].
# $DSEC_BIN: the dsec binary [target/debug/dsec of this checkout]; $DSEC_ETCD_BIN [etcd].
# Edge i lives in namespace dsec-fleet-e<i> at 10.231.<i>.2 (the host end of its veth is
# 10.231.<i>.1, where etcd also listens); the shared services listen on 10.231.0.1 (an
# address of the host's loopback device, routed from each edge's namespace): PostgreSQL
# on :15433, the registry on :15000; apiservers listen on 127.0.0.1:7701 and :7702, etcd on
# 127.0.0.1:12379 (ports off the packages' defaults, whose system services may be running).
# Edges listen off loopback, so they require a token: the apiservers send the one in
# $DSEC_FLEET_DIR/edge-token. Needs root (namespaces, veths, cgroups), Debian's
# etcd-server, postgresql and docker-registry (scripts/setup.sh installs them).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${DSEC_FLEET_DIR:-/tmp/dsec-fleet}
bin=${DSEC_BIN:-$repo/target/debug/dsec}
etcd_bin=${DSEC_ETCD_BIN:-etcd}
etcd_port=12379
etcd_peer=http://127.0.0.1:12380
api_ports=(7701 7702)
shared_ip=10.231.0.1
pg_port=15433
registry_port=15000

die() { echo "fleet.sh: $*" >&2; exit 1; }
log() { echo "[fleet] $*"; }

# Starts "$@" in a session of its own, logging to $dir/log/$1.log; records its pid.
start() {
    local name=$1
    shift
    setsid "$@" </dev/null >>"$dir/log/$name.log" 2>&1 &
    echo $! >"$dir/pids/$name"
}

wait_http() {
    local url=$1 what=$2
    for _ in $(seq 1 300); do
        curl -fsS -o /dev/null --max-time 1 "$url" 2>/dev/null && return 0
        sleep 0.1
    done
    die "$what did not answer at $url (see $dir/log/)"
}

up() {
    local n=$1
    [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 200)) || die "N must be 1 to 200, got $n"
    [[ $(id -u) == 0 ]] || die "needs root (network namespaces, cgroups)"
    [[ -x $bin ]] || die "no dsec binary at $bin (cargo build -p dsec, or set DSEC_BIN)"
    command -v "$etcd_bin" >/dev/null || die "no etcd ($etcd_bin): apt-get install etcd-server"
    local pg_bin
    pg_bin=$(find /usr/lib/postgresql -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -1)
    [[ -x $pg_bin/initdb ]] || die "no PostgreSQL (/usr/lib/postgresql/*/bin): apt-get install postgresql"
    command -v docker-registry >/dev/null || die "no docker-registry: apt-get install docker-registry"
    [[ -e $dir/pids ]] && die "$dir holds a fleet already: scripts/fleet.sh down first"
    if ip route show | grep -q '^10\.231\.'; then
        die "a host route in 10.231.0.0/16 exists: the fleet's addresses would collide"
    fi
    mkdir -p "$dir"/{log,pids,netns}
    head -c 24 /dev/urandom | base64 | tr -d '/+=' >"$dir/edge-token"
    head -c 24 /dev/urandom | base64 | tr -d '/+=' >"$dir/pg-password"
    chmod 600 "$dir/edge-token" "$dir/pg-password"
    ip addr add "$shared_ip/32" dev lo
    echo "$shared_ip" >"$dir/netns/shared-ip"
    local clients="http://127.0.0.1:$etcd_port"
    for i in $(seq 1 "$n"); do
        local ns=dsec-fleet-e$i host_if=dfl-e$i
        ip netns add "$ns"
        echo "$ns $host_if" >"$dir/netns/e$i"
        ip link add "$host_if" type veth peer name eth0 netns "$ns"
        ip addr add "10.231.$i.1/24" dev "$host_if"
        ip link set "$host_if" up
        ip -n "$ns" addr add "10.231.$i.2/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" route add "$shared_ip/32" via "10.231.$i.1"
        clients+=",http://10.231.$i.1:$etcd_port"
    done
    start etcd "$etcd_bin" --name dsec-fleet --data-dir "$dir/etcd" \
        --listen-client-urls "$clients" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "$etcd_peer" --initial-advertise-peer-urls "$etcd_peer" \
        --initial-cluster "dsec-fleet=$etcd_peer"
    wait_http "http://127.0.0.1:$etcd_port/health" etcd
    log "etcd: http://127.0.0.1:$etcd_port"
    # PostgreSQL runs as its own user (it refuses root), exec'd by setpriv: the pid is the
    # postmaster's, so `down` stops it like the others.
    local pw db
    pw=$(cat "$dir/pg-password")
    install -d -o postgres -m 700 "$dir/pg"
    setpriv --reuid=postgres --regid=postgres --init-groups -- test -w "$dir/pg" ||
        die "the postgres user cannot reach $dir/pg: choose a DSEC_FLEET_DIR whose parents others may enter"
    install -o postgres -m 600 "$dir/pg-password" "$dir/pg/pwfile"
    setpriv --reuid=postgres --regid=postgres --init-groups -- "$pg_bin/initdb" -D "$dir/pg/data" \
        -U dsec --pwfile="$dir/pg/pwfile" --auth=scram-sha-256 >>"$dir/log/postgres.log" 2>&1 ||
        die "initdb failed (see $dir/log/postgres.log)"
    echo "host all all 10.231.0.0/16 scram-sha-256" >>"$dir/pg/data/pg_hba.conf"
    start postgres setpriv --reuid=postgres --regid=postgres --init-groups -- "$pg_bin/postgres" \
        -D "$dir/pg/data" -p "$pg_port" -c "listen_addresses=127.0.0.1,$shared_ip" \
        -c "unix_socket_directories=$dir/pg"
    for _ in $(seq 1 300); do
        "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$pg_port" && break
        sleep 0.1
    done
    PGPASSWORD=$pw "$pg_bin/createdb" -h 127.0.0.1 -p "$pg_port" -U dsec fleet ||
        die "PostgreSQL did not start (see $dir/log/postgres.log)"
    db="postgres://dsec:$pw@$shared_ip:$pg_port/fleet"
    log "PostgreSQL: $shared_ip:$pg_port, database fleet (the trajectory log)"
    mkdir -p "$dir/registry"
    printf 'version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: %s\n' \
        "$dir/registry/data" "$shared_ip:$registry_port" >"$dir/registry/config.yml"
    start registry docker-registry serve "$dir/registry/config.yml"
    wait_http "http://$shared_ip:$registry_port/v2/" registry
    log "registry: $shared_ip:$registry_port (the fleet's images)"
    for i in $(seq 1 "$n"); do
        local addr=10.231.$i.2:7700
        start "e$i" env DSEC_INSECURE_REGISTRIES="$shared_ip:$registry_port" \
            nsenter --net="/run/netns/dsec-fleet-e$i" "$bin" edge --etcd "http://10.231.$i.1:$etcd_port" \
            --name "e$i" --listen "$addr" --advertise "http://$addr" \
            --state-dir "$dir/state/e$i" --token-file "$dir/edge-token" \
            --trajectory-db "$db" --registry "$shared_ip:$registry_port/fleet"
    done
    local edge_token
    edge_token=$(cat "$dir/edge-token")
    for i in $(seq 1 "$n"); do
        for _ in $(seq 1 300); do
            curl -fsS -o /dev/null --max-time 1 "http://10.231.$i.2:7700/healthz" 2>/dev/null && break
            sleep 0.1
        done
        curl -fsS -o /dev/null -H "Authorization: Bearer $edge_token" "http://10.231.$i.2:7700/v1/store" ||
            die "edge e$i did not start (see $dir/log/e$i.log)"
        log "edge e$i: http://10.231.$i.2:7700 (namespace dsec-fleet-e$i)"
    done
    for k in 0 1; do
        local port=${api_ports[$k]}
        start "api$((k + 1))" "$bin" apiserver --etcd "http://127.0.0.1:$etcd_port" \
            --listen "127.0.0.1:$port" --edge-token-file "$dir/edge-token" \
            --trajectory-db "postgres://dsec:$pw@127.0.0.1:$pg_port/fleet"
        wait_http "http://127.0.0.1:$port/healthz" "apiserver $((k + 1))"
        log "apiserver: http://127.0.0.1:$port"
    done
    log "up: DSEC_URL=http://127.0.0.1:${api_ports[0]} dsec edges"
}

# SIGTERM one recorded process, wait for it (SIGKILL after 30 s), forget it.
stop_pid() {
    local file=$1 pid
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 1 300); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "$(basename "$file") (pid $pid) ignored SIGTERM for 30 s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$file"
}

down() {
    [[ -d $dir/pids ]] || die "no fleet in $dir"
    # Apiservers first, then edges (they stop their sandboxes and leave), the shared
    # services last.
    local f
    for f in "$dir"/pids/api*; do [[ -e $f ]] && stop_pid "$f"; done
    for f in "$dir"/pids/e[0-9]*; do [[ -e $f ]] && stop_pid "$f" & done
    wait
    for f in registry postgres etcd; do [[ -e $dir/pids/$f ]] && stop_pid "$dir/pids/$f"; done
    if [[ -e $dir/netns/shared-ip ]]; then
        ip addr del "$(cat "$dir/netns/shared-ip")/32" dev lo 2>/dev/null || true
        rm -f "$dir/netns/shared-ip"
    fi
    for f in "$dir"/netns/e*; do
        [[ -e $f ]] || continue
        read -r ns host_if <"$f"
        ip link del "$host_if" 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
        rm -f "$f"
    done
    rm -rf "$dir"
    log "down"
}

status() {
    [[ -d $dir/pids ]] || { echo "no fleet in $dir"; return 0; }
    local f
    for f in "$dir"/pids/*; do
        local pid
        pid=$(cat "$f")
        if kill -0 "$pid" 2>/dev/null; then
            echo "$(basename "$f") pid $pid running"
        else
            echo "$(basename "$f") pid $pid gone"
        fi
    done
}

case ${1:-} in
up) [[ $# == 2 ]] || die "usage: $0 up N"; up "$2" ;;
down) down ;;
status) status ;;
*) echo "usage: $0 up N | down | status" >&2; exit 2 ;;
esac
