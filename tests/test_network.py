"""Sandbox networking (issue 7): network=True, allow-lists, isolation, set_network, cleanup;
its hardening (issue 20): per-sandbox caps of the resolver and the proxy, timeouts, floods,
conntrack, leftovers of dead servers, two servers at once; and IP forwarding (issue 12).

Traffic goes only to loopback, to test hosts in network namespaces this file creates
(`ip netns add dsec-test-...`, a veth with a /30 to the host), and, in the one test that
allows it on purpose, to PyPI. Nothing else is ever addressed: to check that a destination
is refused, it is stood up here first. Names sandboxes resolve in the hardening tests are
answered by a DNS server on a test host (the server under test sees it as the host's
resolver through a mount namespace of its own with its own /etc/resolv.conf).

The servers here run with their own address pool (a /16 no host route overlaps), so they
never collide with another dsec server on the machine; the tests of the default pool leave
`--net-pool` out on purpose.
"""

from __future__ import annotations

import functools
import http.server
import ipaddress
import json
import os
import re
import secrets
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import dsec
import pytest
from dsec_testlib import (
    BACKENDS,
    REPO,
    VM_BACKENDS,
    Server,
    free_port,
    make_tempdir,
    procs_in,
    require,
    safe_rmtree,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

DEBIAN_ROOTFS = Path(
    os.environ.get("DSEC_TEST_DEBIAN_ROOTFS", "/var/tmp/dsec-test-debian-rootfs")
)

Make = Callable[..., dsec.Sandbox]
Hosts = tuple["NsHost", "NsHost"]
#: A running server and its address pool.
Running = tuple[Server, ipaddress.IPv4Network]

#: Where each dsec server with networking keeps its record (crates/dsec-net/src/record.rs).
RECORDS = Path("/run/dsec/net")

#: The backends the conformance tests here run on: the container backend always, and the
#: VM backends $DSEC_TEST_BACKENDS names (a guest's QEMU is plugged into the same bridge,
#: policies, resolver and proxy as a container). The hardening tests run on containers.
NET_BACKENDS = ["container", *(b for b in BACKENDS if b in VM_BACKENDS)]


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, capture_output=True, text=True)


def _routes() -> list[ipaddress.IPv4Network]:
    out = json.loads(_sh("ip", "-j", "-4", "route", "show", "table", "all").stdout or "[]")
    nets = []
    for r in out:
        dst = r.get("dst", "")
        if dst in ("default", "") or ":" in dst:
            continue
        try:
            nets.append(ipaddress.IPv4Network(dst if "/" in dst else dst + "/32", strict=False))
        except ValueError:
            continue
    return nets


_TAKEN: list[ipaddress.IPv4Network] = []


def free_net16() -> ipaddress.IPv4Network:
    """A 10.x.0.0/16 that no host route and no earlier pick of this run overlaps."""
    routes = _routes() + _TAKEN
    for second in range(212, 250):
        net = ipaddress.IPv4Network(f"10.{second}.0.0/16")
        if not any(net.overlaps(r) for r in routes):
            _TAKEN.append(net)
            return net
    pytest.skip("no free 10.x.0.0/16 for a test address pool")


def state_tag(state_dir: Path) -> str:
    """The server's tag (FNV-1a of the canonical state dir), as dsec computes it."""
    h = 0xCBF29CE484222325
    for b in os.fsencode(str(state_dir.resolve())):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h & 0xFFFFFFFF:08x}"


def host_state(tag: str) -> list[str]:
    """Everything on the host carrying server `tag`'s names."""
    found = []
    links = _sh("ip", "-o", "link", "show").stdout
    for m in re.finditer(r"^\d+: ([^:@]+)", links, re.M):
        name = m.group(1)
        if name == f"dsec{tag}" or name.startswith(f"dv{tag}"):
            found.append(f"link {name}")
    tables = _sh("nft", "list", "tables").stdout
    found += [f"nft {t.strip()}" for t in tables.splitlines() if f"dsec_{tag}" in t]
    for chain in ("DOCKER-USER", "FORWARD"):
        r = _sh("iptables", "-w", "-S", chain, check=False)
        found += [f"iptables {line}" for line in r.stdout.splitlines() if f"dsec_{tag}" in line]
    return found


#: A UDP sink on port 9999 (run in a test host's namespace): logs "payload source" lines.
UDP_SINK = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 9999))
f = open(sys.argv[2], "ab", 0)
while True:
    d, a = s.recvfrom(2048)
    f.write(d + b" " + a[0].encode() + b"\\n")
"""

#: Sends one UDP datagram with a source address of its choosing (raw socket; sandboxes
#: keep CAP_NET_RAW): argv = source, destination, port, payload.
RAW_UDP = """
import socket, struct, sys
src, dst, port, msg = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].encode()
udp = struct.pack("!HHHH", 40000, port, 8 + len(msg), 0) + msg
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
                 socket.inet_aton(src), socket.inet_aton(dst))
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
s.sendto(ip + udp, (dst, 0))
"""


#: A DNS server (run in a test host's namespace) on argv[1]:53/udp: A questions for names
#: under argv[2] are answered argv[1] (TTL 300), `a-b-c-d.<zone>` a.b.c.d; every other name
#: NXDOMAIN.
DNS_SERVER = """
import re, socket, struct, sys
ip, zone = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((ip, 53))
while True:
    q, peer = s.recvfrom(4096)
    try:
        i, labels = 12, []
        while q[i]:
            labels.append(q[i + 1 : i + 1 + q[i]].decode().lower())
            i += q[i] + 1
        name, qtype, end = ".".join(labels), struct.unpack("!H", q[i + 1 : i + 3])[0], i + 5
        ours = name == zone or name.endswith("." + zone)
        answer = ours and qtype == 1
        head = q[:2] + struct.pack("!HHHHH", 0x8180 if ours else 0x8183, 1, int(answer), 0, 0)
        body = q[12:end]
        if answer:
            named = re.fullmatch(r"(\\d+)-(\\d+)-(\\d+)-(\\d+)\\." + re.escape(zone), name)
            addr = ".".join(named.groups()) if named else ip
            body += b"\\xc0\\x0c" + struct.pack("!HHIH", 1, 1, 300, 4) + socket.inet_aton(addr)
        s.sendto(head + body, peer)
    except (IndexError, struct.error, UnicodeDecodeError):
        pass
"""


class NsHost:
    """A web server in a network namespace of its own, routed from the host over a /30;
    with `dns_zone`, also the DNS server of that zone, answering the host's address."""

    def __init__(
        self,
        net: ipaddress.IPv4Network,
        ports: tuple[int, ...] = (8080, 8081),
        dns_zone: str | None = None,
    ):
        suffix = secrets.token_hex(3)
        self.ns = f"dsec-test-{suffix}"
        self.veth = f"dsect{suffix}"
        hosts = list(net.hosts())
        self.gw, self.ip = str(hosts[0]), str(hosts[1])
        self.ports = ports
        self.dir = make_tempdir("dsec-test-www-")
        (self.dir / "hello.txt").write_text(f"hello from {self.ns}\n")
        self.procs: list[subprocess.Popen[bytes]] = []
        _sh("ip", "netns", "add", self.ns)
        try:
            _sh("ip", "link", "add", self.veth, "type", "veth",
                "peer", "name", "eth0", "netns", self.ns)
            _sh("ip", "addr", "add", f"{self.gw}/{net.prefixlen}", "dev", self.veth)
            _sh("ip", "link", "set", self.veth, "up")
            _sh("ip", "-n", self.ns, "addr", "add", f"{self.ip}/{net.prefixlen}", "dev", "eth0")
            _sh("ip", "-n", self.ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", self.ns, "link", "set", "lo", "up")
            _sh("ip", "-n", self.ns, "route", "add", "default", "via", self.gw)
            for port in ports:
                self.procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", self.ns, "python3", "-m", "http.server",
                         str(port), "--bind", self.ip, "--directory", str(self.dir)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )
                )
            self.udp_log = self.dir / "udp.log"
            self.udp_log.touch()
            self.procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", self.ns, "python3", "-c", UDP_SINK, self.ip,
                     str(self.udp_log)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )
            if dns_zone is not None:
                self.procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", self.ns, "python3", "-c", DNS_SERVER, self.ip,
                         dns_zone],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )
                )
            for port in ports:
                wait_until(functools.partial(self._up, port), timeout=10)
        except BaseException:
            self.close()
            raise

    def _up(self, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.ip}:{port}/hello.txt", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def url(self, port: int | None = None) -> str:
        return f"http://{self.ip}:{port or self.ports[0]}/hello.txt"

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(5)
        _sh("ip", "netns", "del", self.ns, check=False)
        _sh("ip", "link", "del", self.veth, check=False)
        safe_rmtree(self.dir)


def fetch(sb: dsec.Sandbox, url: str) -> dsec.CommandResult:
    """GET `url` (http://IP:PORT/PATH) from inside with busybox nc (its wget crashes here)."""
    m = re.fullmatch(r"http://([\d.]+):(\d+)(/.*)", url)
    assert m, url
    ip, port, path = m.groups()
    request = f"GET {path} HTTP/1.0\\r\\n\\r\\n"
    return sb.run(f"printf '{request}' | nc -w 3 {ip} {port}", timeout=15)


def reaches(sb: dsec.Sandbox, host: NsHost, port: int | None = None) -> bool:
    r = fetch(sb, host.url(port))
    return r.exit_code == 0 and f"hello from {host.ns}" in r.stdout


def own_server(
    kind: type[Server], busybox_rootfs: Path, extra_args: tuple[str, ...] = (), **kw: object
) -> Iterator[tuple[Server, ipaddress.IPv4Network]]:
    """A running server of class `kind` with an address pool of its own, and the busybox
    image; stopped after, leaving nothing of its networking on the host."""
    pool = free_net16()
    d = make_tempdir("dsec-test-net-")
    s = kind(d / "state", log_path=d / "server.log",
             extra_args=["--net-pool", str(pool), *extra_args], **kw)
    s.start()
    try:
        with s.client() as c:
            c.import_image(str(busybox_rootfs), name="busybox")
        if "sandbox networking unavailable" in s.log_tail(200):
            require("network", "sandbox networking unavailable here:\n" + s.log_tail(20))
        yield s, pool
    finally:
        s.cleanup()
        tag = state_tag(s.state_dir)
        safe_rmtree(d)
        assert host_state(tag) == [], "networking left host state after a graceful stop"


@pytest.fixture(scope="module")
def net_server(busybox_rootfs: Path) -> Iterator[tuple[Server, ipaddress.IPv4Network]]:
    """A server of this module's own."""
    yield from own_server(Server, busybox_rootfs)


@pytest.fixture(scope="module")
def net_client(net_server: tuple[Server, ipaddress.IPv4Network]) -> Iterator[dsec.Client]:
    with net_server[0].client() as c:
        yield c


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[NsHost, NsHost]]:
    """Two test hosts, each in its own namespace."""
    base = free_net16()
    subnets = list(base.subnets(new_prefix=30))
    a = NsHost(subnets[0])
    try:
        b = NsHost(subnets[1])
    except BaseException:
        a.close()
        raise
    yield a, b
    a.close()
    b.close()


def sandbox_maker(
    client: dsec.Client, backend: str = "container"
) -> Iterator[Callable[..., dsec.Sandbox]]:
    """`create(**kw)` on `client` (busybox on `backend` by default); every sandbox made
    stopped after."""
    made: list[dsec.Sandbox] = []

    def create(**kw: object) -> dsec.Sandbox:
        kw.setdefault("image", "busybox")
        kw.setdefault("backend", backend)
        sb = client.create(**kw)  # type: ignore[arg-type]
        made.append(sb)
        return sb

    yield create
    for sb in made:
        sb.stop()


@pytest.fixture(params=NET_BACKENDS)
def net_backend(request: pytest.FixtureRequest) -> str:
    """The backend a conformance test runs on (see NET_BACKENDS)."""
    return str(request.param)


@pytest.fixture
def make(net_client: dsec.Client, net_backend: str) -> Iterator[Callable[..., dsec.Sandbox]]:
    yield from sandbox_maker(net_client, net_backend)


@pytest.fixture
def cmake(net_client: dsec.Client) -> Iterator[Callable[..., dsec.Sandbox]]:
    """Containers only: for the tests of the Debian image with python3."""
    yield from sandbox_maker(net_client)


def eth0_ip(sb: dsec.Sandbox) -> str:
    r = sb.run("ip -o -4 addr show eth0")
    assert r.exit_code == 0, r.stderr
    return r.stdout.split()[3].split("/")[0]


def test_network_true_reaches_a_test_host(make: Make, hosts: Hosts) -> None:
    a, b = hosts
    sb = make(network=True)
    assert reaches(sb, a) and reaches(sb, b, 8081)
    assert sb.read_file("/etc/resolv.conf").startswith(b"nameserver ")
    host_ca = Path("/etc/ssl/certs/ca-certificates.crt")
    if host_ca.exists():
        assert sb.read_file(str(host_ca)) == host_ca.read_bytes()


def test_network_false_is_loopback_only(make: Make, hosts: Hosts) -> None:
    sb = make(network=False)
    links = sb.run("ip -o link").stdout
    assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"]
    assert not reaches(sb, hosts[0])


def test_usage_counts_the_bytes_over_the_network(make: Make, hosts: Hosts) -> None:
    a, _ = hosts
    sb = make(network=True)
    before = sb.info().usage
    assert before.network_rx_bytes is not None and before.network_tx_bytes is not None
    for _ in range(3):
        assert reaches(sb, a)
    after = sb.info().usage
    assert after.network_rx_bytes is not None and after.network_tx_bytes is not None
    # Three answers in, three requests out (their headers and TCP's own packets at least).
    assert after.network_rx_bytes - before.network_rx_bytes > 3 * 100, (before, after)
    assert after.network_tx_bytes - before.network_tx_bytes > 3 * 50, (before, after)
    off = make(network=False).info().usage
    assert off.network_rx_bytes is None and off.network_tx_bytes is None


def test_ca_bundle_can_be_declined(net_client: dsec.Client, net_backend: str) -> None:
    sb = net_client.create(image="busybox", backend=net_backend, network=True, ca_bundle=False)
    try:
        r = sb.run("test -e /etc/ssl/certs/ca-certificates.crt")
        assert r.exit_code != 0
    finally:
        sb.stop()


def test_sandboxes_cannot_reach_each_other(make: Make) -> None:
    a, b = make(network=True), make(network=True)
    serve = "mkdir -p /tmp/www && echo hi-b > /tmp/www/x && httpd -p 8000 -h /tmp/www"
    assert b.run(serve).exit_code == 0
    assert "hi-b" in fetch(b, "http://127.0.0.1:8000/x").stdout
    bip = eth0_ip(b)
    r = fetch(a, f"http://{bip}:8000/x")
    assert "hi-b" not in r.stdout
    r = a.run(f"ping -c 1 -W 1 {bip}")
    assert r.exit_code != 0


def test_host_services_and_the_api_are_unreachable(make: Make, net_server: Running) -> None:
    server, pool = net_server
    bridge_ip = str(pool.network_address + 1)
    # A service of the host's own, listening everywhere (stands in for anything on the host).
    httpd = http.server.ThreadingHTTPServer(
        ("0.0.0.0", free_port()), http.server.SimpleHTTPRequestHandler
    )
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        port = httpd.server_address[1]
        with urllib.request.urlopen(f"http://{bridge_ip}:{port}/", timeout=3) as r:
            assert r.status == 200  # the host itself reaches it
        sb = make(network=True)
        for url in (
            f"http://{bridge_ip}:{port}/",
            f"http://{bridge_ip}:{server.port}/healthz",
            f"http://127.0.0.1:{server.port}/healthz",
        ):
            r = fetch(sb, url)
            assert r.exit_code != 0 or "HTTP/" not in r.stdout, (url, r.stdout)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_servers_own_services_are_unreachable_whatever_the_policy(
    busybox_rootfs: Path, hosts: Hosts, net_backend: str
) -> None:
    a, b = hosts
    # Host b plays a service of the operator's (as the fleet's etcd, registry and database
    # are, without the flag): sandboxes must not reach it even when a policy names it.
    args = ("--protect", f"{b.ip}:8080")
    for s, _ in own_server(Server, busybox_rootfs, extra_args=args):
        with s.client() as c:
            with c.create(image="busybox", backend=net_backend, network=True) as sb:
                assert reaches(sb, a)
                assert not reaches(sb, b) and not reaches(sb, b, 8081)
            allow = {"allow": [b.ip, a.ip]}
            with c.create(image="busybox", backend=net_backend, network=allow) as sb:
                assert reaches(sb, a)
                assert not reaches(sb, b)


def test_allow_list_of_ip_and_port(make: Make, hosts: Hosts, net_server: Running) -> None:
    a, b = hosts
    sb = make(network={"allow": [f"{a.ip}:8080"]})
    before = refused_total(net_server[0])
    assert reaches(sb, a, 8080)
    assert not reaches(sb, a, 8081)
    assert not reaches(sb, b, 8080)
    assert refused_total(net_server[0]) > before
    # Each refusal is an event on the sandbox: destination, port, time.
    events = wait_until(
        lambda: [e for e in sb.network_refused() if e["dst"] == b.ip] or None, timeout=5
    )
    assert events, sb.network_refused()
    assert events[0]["port"] == 8080 and events[0]["protocol"] == "tcp"
    assert abs(events[0]["time"] - time.time()) < 60
    assert any(e["dst"] == a.ip and e["port"] == 8081 for e in sb.network_refused())


def test_allow_list_of_a_cidr(make: Make, hosts: Hosts) -> None:
    a, b = hosts
    sb = make(network={"allow": [f"{a.ip}/32"]})
    assert reaches(sb, a, 8080) and reaches(sb, a, 8081)
    assert not reaches(sb, b)


def test_disallowed_names_do_not_resolve(make: Make) -> None:
    sb = make(network={"allow": ["pypi.org"]})
    r = sb.run("nslookup example.com", timeout=15)
    assert "Address" not in r.stdout.split("Name:")[-1] if "Name:" in r.stdout else True
    assert r.exit_code != 0 or "NXDOMAIN" in r.stdout + r.stderr


def test_set_network_changes_a_running_sandbox(make: Make, hosts: Hosts) -> None:
    a, b = hosts
    sb = make()
    assert not reaches(sb, a)
    sb.set_network(True)
    assert reaches(sb, a) and reaches(sb, b)
    sb.set_network({"allow": [b.ip]})
    assert not reaches(sb, a)
    assert reaches(sb, b)
    sb.set_network(False)
    assert not reaches(sb, b)
    sb.set_network(True)
    assert reaches(sb, a)


#: The VM backends among NET_BACKENDS; a skipped case where $DSEC_TEST_BACKENDS names none.
VM_NET_BACKENDS: list[object] = [b for b in NET_BACKENDS if b in VM_BACKENDS] or [
    pytest.param("microvm", marks=pytest.mark.skip(reason="no VM backend in $DSEC_TEST_BACKENDS"))
]


@pytest.mark.parametrize("backend", VM_NET_BACKENDS)
def test_forked_and_restored_guests_take_their_own_network(
    net_client: dsec.Client, hosts: Hosts, backend: str
) -> None:
    a, _ = hosts
    with net_client.create(image="busybox", backend=backend, network=True) as parent:
        assert reaches(parent, a)
        children = parent.fork(2)
        try:
            addresses = {eth0_ip(sb) for sb in [parent, *children]}
            assert len(addresses) == 3, addresses
            assert all(reaches(sb, a) for sb in [*children, parent])
        finally:
            for child in children:
                child.stop()
        # A guest saved with a network, restored without one, has no way out.
        image = parent.snapshot()
        with net_client.create(image=image.name, backend=backend) as plain:
            assert not reaches(plain, a)
            assert plain.info().usage.network_rx_bytes is None
        net_client.delete_image(image.name)


@pytest.mark.parametrize("backend", VM_NET_BACKENDS)
def test_a_guest_paused_to_disk_keeps_its_network(
    busybox_rootfs: Path, hosts: Hosts, backend: str
) -> None:
    a, b = hosts
    for s, _ in own_server(Server, busybox_rootfs, extra_args=("--vm-pause", "save")):
        tag = state_tag(s.state_dir)

        def veths(tag: str = tag) -> list[str]:
            return [x for x in host_state(tag) if x.startswith("link dv")]

        with s.client() as c, c.create(
            image="busybox", backend=backend, network={"allow": [a.ip]}
        ) as sb:
            address = eth0_ip(sb)
            assert reaches(sb, a) and not reaches(sb, b)
            sb.pause()
            # Its QEMU, namespace and veth are gone; its address and policy are kept.
            assert wait_until(lambda: veths() == [], timeout=10), veths()
            sb.resume()
            assert len(veths()) == 1
            assert eth0_ip(sb) == address
            assert reaches(sb, a) and not reaches(sb, b)
            assert any(e["dst"] == b.ip for e in sb.network_refused())
            # Kept across a restart of the server: the same address and policy after.
            sb.pause()
            assert wait_until(lambda: veths() == [], timeout=10), veths()
            s.kill9()
            s.restart()
            assert sb.info().state == "paused"
            assert eth0_ip(sb) == address
            assert len(veths()) == 1
            assert reaches(sb, a) and not reaches(sb, b)
        assert wait_until(lambda: veths() == [], timeout=10), veths()


def test_malformed_rules_are_invalid_arguments(net_client: dsec.Client) -> None:
    for rule in ["10.0.0.0/33", "1.2.3.4:99999", "bad host!", "[::1]:80"]:
        with pytest.raises(dsec.InvalidArgument, match=re.escape(repr(rule)[1:-1])):
            net_client.create(image="busybox", network={"allow": [rule]})


def test_nothing_left_after_stop(make: Make, net_server: Running) -> None:
    tag = state_tag(net_server[0].state_dir)
    before = {s for s in host_state(tag) if s.startswith("link dv")}
    sb = make(network=True)
    during = {s for s in host_state(tag) if s.startswith("link dv")}
    assert len(during - before) == 1
    sb.stop()
    wait_until(lambda: {s for s in host_state(tag) if s.startswith("link dv")} == before, timeout=5)
    chains = _sh("nft", "list", "table", "inet", f"dsec_{tag}").stdout
    assert not re.search(r"chain s[0-9a-f]{5}", chains), chains


def test_nothing_left_after_ttl(
    net_client: dsec.Client, net_server: Running, net_backend: str
) -> None:
    tag = state_tag(net_server[0].state_dir)

    def veths() -> set[str]:
        return {s for s in host_state(tag) if s.startswith("link dv")}

    before = veths()
    sb = net_client.create(image="busybox", backend=net_backend, network=True, ttl_s=1)
    wait_until(lambda: sb.id not in {x.id for x in net_client.list()}, timeout=10)
    wait_until(lambda: veths() == before, timeout=5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", NET_BACKENDS)
def test_nothing_left_after_sigkill_and_restart(busybox_rootfs: Path, backend: str) -> None:
    pool = free_net16()
    d = make_tempdir("dsec-test-net-kill-")
    s = Server(d / "state", log_path=d / "server.log", extra_args=["--net-pool", str(pool)])
    tag = state_tag(d / "state")
    try:
        s.start()
        with s.client() as c:
            c.import_image(str(busybox_rootfs), name="busybox")
            sb = c.create(image="busybox", backend=backend, network=True)
            assert sb.run("ip -o -4 addr show eth0").exit_code == 0
        s.kill9()
        assert f"link dsec{tag}" in host_state(tag)
        s.restart()
        # The restarted server removed the old sandbox's veth, chain and rules.
        assert [x for x in host_state(tag) if x.startswith("link dv")] == []
        chains = _sh("nft", "list", "table", "inet", f"dsec_{tag}").stdout
        assert not re.search(r"chain s[0-9a-f]{5}", chains), chains
        s.stop()
        assert host_state(tag) == []
        assert not (RECORDS / tag).exists()
    finally:
        s.cleanup()
        safe_rmtree(d)
    assert host_state(tag) == []


def refused_total(server: Server) -> float:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=5).read().decode()
    m = re.search(r"^dsec_network_refused_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def debian_image(net_client: dsec.Client) -> str:
    """A Debian image with python3 (built once with scripts/make-debian-rootfs.sh)."""
    if not (DEBIAN_ROOTFS / "usr/bin/python3").exists():
        r = subprocess.run(
            [str(REPO / "scripts/make-debian-rootfs.sh"), str(DEBIAN_ROOTFS)],
            capture_output=True, text=True, timeout=600,
        )
        if r.returncode != 0:
            require("debian-rootfs", f"no Debian rootfs with python3: {r.stderr[-400:]}")
    return net_client.import_image(str(DEBIAN_ROOTFS), name="debian-net").name


#: TLS handshakes to the address of argv[1], naming each of argv[2:] (SNI): "ok" when it
#: completes, "refused" when the connection is closed or reset before.
SNI_PROBE = """
import socket, ssl, sys
ip = socket.gethostbyname(sys.argv[1])
ctx = ssl.create_default_context()
out = []
for name in dict.fromkeys(sys.argv[2:]):
    try:
        with socket.create_connection((ip, 443), timeout=15) as s:
            with ctx.wrap_socket(s, server_hostname=name):
                out.append("ok")
    except (ConnectionError, ssl.SSLError, socket.timeout, OSError) as e:
        out.append("refused")
print(" ".join(out))
"""

PYPI_FETCH = (
    "import sys, urllib.request\n"
    "with urllib.request.urlopen(sys.argv[1], timeout=20) as r:\n"
    "    body = r.read().decode()\n"
    "print(r.status, 'six' in body)\n"
)


@pytest.mark.slow
def test_a_sandbox_cannot_borrow_another_ones_address(
    cmake: Make,
    hosts: Hosts,
    debian_image: str,
) -> None:
    a, b = hosts
    open_sb = cmake(network=True)
    narrow = cmake(image=debian_image, network={"allow": [a.ip]})
    open_ip, narrow_ip = eth0_ip(open_sb), narrow.run(
        ["python3", "-c", "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM);"
         f" s.connect(('{a.ip}', 9)); print(s.getsockname()[0])"]
    ).stdout.strip()

    def send(src: str, host: NsHost, tag: str) -> None:
        r = narrow.run(["python3", "-c", RAW_UDP, src, host.ip, "9999", tag])
        assert r.exit_code == 0, r.stderr

    send(narrow_ip, a, "own-to-allowed")
    wait_until(lambda: b"own-to-allowed" in a.udp_log.read_bytes(), timeout=5)
    send(narrow_ip, b, "own-to-refused")
    send(open_ip, b, "spoofed-to-refused")
    time.sleep(1)
    assert b.udp_log.read_bytes() == b""


@pytest.mark.slow
def test_allow_list_of_registry_names(cmake: Make, hosts: Hosts, debian_image: str) -> None:
    url = "https://pypi.org/simple/six/"
    try:
        with urllib.request.urlopen(url, timeout=15) as r:
            assert r.status == 200
    except OSError as e:
        pytest.skip(f"PyPI is not reachable from this host: {e}")
    sb = cmake(image=debian_image, network={"allow": ["pypi.org", "files.pythonhosted.org"]})
    r = sb.run(["python3", "-c", PYPI_FETCH, url], timeout=60)
    assert r.exit_code == 0 and r.stdout.strip() == "200 True", r.stdout + r.stderr
    r = sb.run(["python3", "-c", PYPI_FETCH, hosts[0].url()], timeout=30)
    assert r.exit_code != 0
    # The address answered for pypi.org may be shared with other sites (here: every
    # registry); a TLS connection to it that names another one is refused by the proxy.
    only = cmake(image=debian_image, network={"allow": ["pypi.org"]})
    r = only.run(
        ["python3", "-c", SNI_PROBE, "pypi.org", "pypi.org", "files.pythonhosted.org"],
        timeout=60,
    )
    assert r.stdout.strip() == "ok refused", r.stdout + r.stderr
    refused = [e for e in only.network_refused() if e["port"] == 443]
    assert refused, only.network_refused()


# ------------------------------------------------------------ hardening (issue 20, item 6)
#
# Each test is the attack of one sandbox on what every sandbox shares (the resolver, the
# proxy, the conntrack table), asserting that it is contained, counted, and that another
# sandbox still resolves a name through dsec's resolver and gets out through the proxy.
# Floods that need more than busybox's tools run the host's python3 in the attacking
# sandbox's network namespace (`nsenter --net`): to dsec, which sees only the packets,
# that is the sandbox.

ZONE = "dsec.test"
WEB = f"web.{ZONE}"


class ResolvingServer(Server):
    """A server whose host resolver is `nameserver`: it runs in a mount namespace of its
    own whose /etc/resolv.conf says so, and dsec's resolver forwards allowed names there."""

    def __init__(self, state_dir: Path, *, nameserver: str, **kw: object) -> None:
        super().__init__(state_dir, **kw)  # type: ignore[arg-type]
        self.resolv = state_dir.parent / "resolv.conf"
        self.resolv.write_text(f"nameserver {nameserver}\n")

    def argv(self) -> list[str]:
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(self.resolv),
                *super().argv()]


def metric(server: Server, name: str, **labels: str) -> float:
    """The sum of metric `name` over the series whose labels include `labels`."""
    text = urllib.request.urlopen(server.url + "/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def limited(server: Server, limit: str) -> float:
    return metric(server, "dsec_network_limited_total", limit=limit)


def slots_in_use(server: Server, service: str) -> float:
    return metric(server, "dsec_network_slots_in_use", service=service)


def resolve(sb: dsec.Sandbox, name: str) -> str | None:
    """The address dsec's resolver answers `name` with, asked from inside (busybox)."""
    r = sb.run(f"nslookup {name}", timeout=15)
    answer = r.stdout.split("Name:", 1)[1] if "Name:" in r.stdout else ""
    found = re.findall(r"Address:\s*([\d.]+)\s*$", answer, re.M)
    return found[0] if found else None


def egress_works(sb: dsec.Sandbox, web: NsHost) -> bool:
    """Whether `sb` resolves WEB through dsec's resolver and GETs it through the
    name-checking proxy (port 80 of an address opened for a name goes there)."""
    ip = resolve(sb, WEB)
    if ip is None:
        return False
    request = f"GET /hello.txt HTTP/1.0\\r\\nHost: {WEB}\\r\\n\\r\\n"
    r = sb.run(f"printf '{request}' | nc -w 3 {ip} 80", timeout=15)
    return r.exit_code == 0 and f"hello from {web.ns}" in r.stdout


def netns_of(sb: dsec.Sandbox) -> list[str]:
    """A command prefix that runs in `sb`'s network namespace."""
    procs = procs_in(sb.id)
    assert procs, f"no process of {sb.id} found"
    return ["nsenter", f"--net=/proc/{procs[0][0]}/ns/net", "--"]


#: The query for A of argv[2], as the first bytes of every script below.
QUERY = """
import socket, struct, sys, time
def query(name):
    labels = b"".join(bytes([len(l)]) + l.encode() for l in name.split("."))
    header = b"\\x12\\x34\\x01\\x00\\x00\\x01" + bytes(6)
    return header + labels + b"\\x00\\x00\\x01\\x00\\x01"
server, name = sys.argv[1], sys.argv[2]
"""

#: Asks over TCP; prints the answered address, or "none".
TCP_DNS_QUERY = QUERY + """
q = query(name)
s = socket.create_connection((server, 53), timeout=5)
s.sendall(struct.pack("!H", len(q)) + q)
f = s.makefile("rb")
r = f.read(struct.unpack("!H", f.read(2))[0])
print(socket.inet_ntoa(r[-4:]) if struct.unpack("!H", r[6:8])[0] else "none")
"""

#: Slowloris: connects to argv[1]:argv[2], sends the first two bytes of the hex argv[3],
#: then the rest one byte a second; prints how long the server kept the connection open.
SLOWLORIS = """
import socket, sys, time
data = bytes.fromhex(sys.argv[3])
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
start = time.monotonic()
s.sendall(data[:2])
try:
    for b in data[2:]:
        time.sleep(1)
        s.sendall(bytes([b]))
    s.settimeout(30)
    s.recv(1)
except OSError:
    pass
print(round(time.monotonic() - start, 1))
"""


def slowloris(attacker: dsec.Sandbox, dst: str, port: int, data: bytes) -> float:
    """Seconds the server at dst:port kept a connection from `attacker` open while `data`
    trickled in a byte a second (see SLOWLORIS)."""
    out = subprocess.run([*netns_of(attacker), "python3", "-c", SLOWLORIS, dst, str(port),
                          data.hex()], capture_output=True, text=True, timeout=90, check=False)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


def dns_query(name: str) -> bytes:
    """An A question for `name`, length-prefixed as DNS over TCP sends it."""
    labels = b"".join(bytes([len(part)]) + part.encode() for part in name.split("."))
    q = b"\x12\x34\x01\x00\x00\x01" + bytes(6) + labels + b"\x00\x00\x01\x00\x01"
    return len(q).to_bytes(2, "big") + q


#: Sends argv[3] seconds' worth of queries from one socket as fast as it can; prints how
#: many.
UDP_DNS_FLOOD = QUERY + """
q, sent = query(name), 0
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    try:
        s.sendto(q, (server, 53))
        sent += 1
    except OSError:
        time.sleep(0.001)
print(sent)
"""

#: Asks for argv[3] names under argv[2] that each answer another address (a-b-c-d.zone,
#: in the /16 of argv[4]), 100 a second whatever the answers take; prints how many were
#: answered, how many got SERVFAIL, and the seconds from the first question to the last
#: answer.
FRESH_ADDRESSES = QUERY + """
import threading
base = sys.argv[4].split(".")[:2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
def ask():
    for k in range(int(sys.argv[3])):
        labels = "-".join(base + [str(k // 250 + 1), str(k % 250 + 1)])
        s.sendto(query(labels + "." + name), (server, 53))
        time.sleep(0.01)
sender = threading.Thread(target=ask)
sender.start()
answered = servfail = 0
start = last = time.monotonic()
s.settimeout(5)
try:
    while True:
        rcode = s.recv(4096)[3] & 0x0F
        answered += rcode == 0
        servfail += rcode == 2
        last = time.monotonic()
except TimeoutError:
    pass
print(answered, servfail, last - start)
"""

#: Opens argv[3] TCP connections to argv[1]:argv[2] at once and holds them, silent, for
#: argv[4] seconds.
TCP_HOLD = """
import socket, sys, time
host, port, n, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
held = []
for _ in range(n):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex((host, port))
    held.append(s)
time.sleep(hold)
"""

#: One UDP datagram to each of argv[2] ports of argv[1]: a conntrack entry each.
UDP_SPRAY = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[2])):
    for _ in range(100):
        try:
            s.sendto(b"x", (sys.argv[1], 10000 + i))
            break
        except OSError:  # a full send queue: try again
            time.sleep(0.001)
"""


@pytest.fixture(scope="module")
def web() -> Iterator[NsHost]:
    """A test host serving hello.txt on port 80 and the zone ZONE (every name: itself)."""
    host = NsHost(next(free_net16().subnets(new_prefix=30)), ports=(80,), dns_zone=ZONE)
    yield host
    host.close()


@pytest.fixture(scope="module")
def zone_server(
    busybox_rootfs: Path, web: NsHost
) -> Iterator[tuple[Server, ipaddress.IPv4Network]]:
    """A server whose upstream resolver is `web`'s DNS server."""
    yield from own_server(ResolvingServer, busybox_rootfs, nameserver=web.ip)


@pytest.fixture
def zmake(
    zone_server: tuple[Server, ipaddress.IPv4Network],
) -> Iterator[Callable[..., dsec.Sandbox]]:
    with zone_server[0].client() as c:
        yield from sandbox_maker(c)


@pytest.fixture
def victim(zmake: Make) -> dsec.Sandbox:
    """A sandbox allowed WEB, whose egress must survive another sandbox's attack."""
    return zmake(network={"allow": [WEB]})


def gateway(running: Running) -> str:
    """The bridge's address: dsec's resolver and proxy, as sandboxes see them."""
    return str(running[1].network_address + 1)


def test_names_resolve_through_the_test_zone(
    zmake: Make, web: NsHost, net_backend: str, request: pytest.FixtureRequest
) -> None:
    if net_backend in VM_BACKENDS:
        # A known defect, not understood yet: now and then (most often late in a long run
        # of this file) a guest's busybox nslookup gets the AAAA answer but not the A one
        # through QEMU's user-mode network, even asked twice. Run alone it passes.
        request.applymarker(pytest.mark.xfail(
            reason="VM guests: an A answer of dsec's resolver is sometimes lost (see the "
                   "comment)", strict=False))
    sb = zmake(backend=net_backend, network={"allow": [WEB]})
    assert resolve(sb, WEB) == web.ip
    assert egress_works(sb, web)
    # The proxy still checks the name the connection carries.
    other = "GET /hello.txt HTTP/1.0\\r\\nHost: other.example\\r\\n\\r\\n"
    r = sb.run(f"printf '{other}' | nc -w 3 {web.ip} 80", timeout=15)
    assert "hello from" not in r.stdout


def hold_many(
    server: Server, attacker: dsec.Sandbox, service: str, dst: str, port: int, n: int,
    cap: int, other_still_works: Callable[[], bool],
) -> None:
    """`attacker` opens `n` connections to dst:port at once and holds them, silent: it gets
    `cap` slots of `service`, the rest are refused and counted, and another sandbox's
    egress still works meanwhile."""
    before = limited(server, f"{service}_per_sandbox")
    hold = subprocess.Popen([*netns_of(attacker), "python3", "-c", TCP_HOLD, dst, str(port),
                             str(n), "8"])
    try:
        time.sleep(2)  # the connections land
        assert other_still_works()
        assert slots_in_use(server, service) == cap
        assert limited(server, f"{service}_per_sandbox") > before
        assert hold.wait(30) == 0
    finally:
        hold.kill()
        hold.wait()
    assert wait_until(lambda: slots_in_use(server, service) == 0, timeout=10)


def hold_silently(
    server: Server, attacker: dsec.Sandbox, service: str, timeout_limit: str, dst: str,
    port: int, cap: int, other_still_works: Callable[[], bool],
) -> None:
    """`attacker` opens `cap` + 20 connections with busybox's nc that never send a byte:
    `cap` are served, the rest refused; all are closed after the server's 10 s timeout,
    counted under `timeout_limit`, while another sandbox's egress still works."""
    refused_before = limited(server, f"{service}_per_sandbox")
    silent_before = limited(server, timeout_limit)
    r = attacker.run(
        f"for i in $(seq {cap + 20}); do (sleep 60 | nc {dst} {port} >/dev/null 2>&1 &); done",
        timeout=60,
    )
    assert r.exit_code == 0, r.stderr
    assert wait_until(lambda: slots_in_use(server, service) >= cap, timeout=20)
    assert wait_until(
        lambda: limited(server, f"{service}_per_sandbox") >= refused_before + 10, timeout=20
    )
    assert slots_in_use(server, service) == cap
    held_at = time.monotonic()
    assert other_still_works()
    assert wait_until(lambda: slots_in_use(server, service) == 0, timeout=30)
    assert time.monotonic() - held_at < 25
    assert limited(server, timeout_limit) >= silent_before + cap


def test_one_sandbox_cannot_hold_every_proxy_slot(
    zone_server: Running,
    zmake: Make,
    web: NsHost,
    victim: dsec.Sandbox,
) -> None:
    server = zone_server[0]
    attacker = zmake(network={"allow": [WEB]}, pids=2048)
    ip = resolve(attacker, WEB)
    assert ip == web.ip
    # More connections than the proxy has slots (2048): the sandbox gets its 128.
    hold_many(server, attacker, "proxy_connections", ip, 80, 2100, 128,
              lambda: egress_works(victim, web))
    hold_silently(server, attacker, "proxy_connections", "proxy_head_timeout", ip, 80, 128,
                  lambda: egress_works(victim, web))
    assert "named no destination" in server.log_tail(400)
    # A request head trickling in a byte a second (slowloris) is closed after 10 s too.
    head = f"GET /hello.txt HTTP/1.1\r\nHost: {WEB}\r\n\r\n".encode()
    assert 8 <= slowloris(attacker, ip, 80, head) <= 15
    assert egress_works(attacker, web)


def test_one_sandbox_cannot_hold_every_dns_tcp_slot(
    zone_server: Running,
    zmake: Make,
    web: NsHost,
    victim: dsec.Sandbox,
) -> None:
    server, gw = zone_server[0], gateway(zone_server)
    attacker = zmake(network={"allow": [WEB]})

    def victim_asks_over_tcp() -> bool:
        out = subprocess.run([*netns_of(victim), "python3", "-c", TCP_DNS_QUERY, gw, WEB],
                             capture_output=True, text=True, timeout=30, check=False)
        return out.stdout.strip() == web.ip and egress_works(victim, web)

    # More connections than the resolver has TCP slots (128): the sandbox gets its 8.
    hold_many(server, attacker, "dns_tcp_connections", gw, 53, 300, 8, victim_asks_over_tcp)
    hold_silently(server, attacker, "dns_tcp_connections", "dns_tcp_timeout", gw, 53, 8,
                  victim_asks_over_tcp)
    # A query trickling in a byte a second (slowloris) is closed after the timeout too.
    assert 8 <= slowloris(attacker, gw, 53, dns_query(WEB)) <= 15


def test_a_dns_flood_is_dropped_and_others_still_resolve(
    zone_server: Running,
    zmake: Make,
    web: NsHost,
    victim: dsec.Sandbox,
) -> None:
    server, gw = zone_server[0], gateway(zone_server)
    attacker = zmake(network={"allow": [WEB]})
    before = limited(server, "dns_udp_rate")
    flood = subprocess.Popen([*netns_of(attacker), "python3", "-c", UDP_DNS_FLOOD, gw, WEB, "6"],
                             stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1)
        for _ in range(3):
            assert resolve(victim, WEB) == web.ip
        assert egress_works(victim, web)
        sent = int(flood.communicate(timeout=30)[0])
    finally:
        flood.kill()
        flood.wait()
    # At most 100 a second (bursts of 200) pass: the rest is dropped in the kernel.
    assert sent > 3000, sent
    dropped = limited(server, "dns_udp_rate") - before
    assert dropped >= sent - (200 + 100 * 8), (sent, dropped)
    assert resolve(attacker, WEB) == web.ip, "the attacker is answered again after the flood"


def test_answers_that_open_fresh_addresses_are_rate_limited(
    zone_server: Running,
    zmake: Make,
    web: NsHost,
    victim: dsec.Sandbox,
) -> None:
    """Each answer with new addresses costs the host an nftables transaction: a name under
    an allowed wildcard whose nameserver answers a fresh address every time is held to 20
    such answers a second (bursts of 40); the rest get SERVFAIL."""
    server, gw = zone_server[0], gateway(zone_server)
    attacker = zmake(network={"allow": [f"*.{ZONE}"]})
    over_rate = limited(server, "opened_addresses_rate")
    in_flight = limited(server, "dns_queries_per_sandbox")
    out = subprocess.run(
        [*netns_of(attacker), "python3", "-c", FRESH_ADDRESSES, gw, ZONE, "200", web.ip],
        capture_output=True, text=True, timeout=120, check=False,
    )
    answered, servfail, seconds = (float(x) for x in out.stdout.split())
    assert 0 < answered <= 40 + 20 * seconds, out.stdout + out.stderr
    # The rest got SERVFAIL, or, on a host slow to run nft (where each answer holds its
    # slot longer), was dropped by the cap on questions in flight: counted either way.
    over_rate = limited(server, "opened_addresses_rate") - over_rate
    in_flight = limited(server, "dns_queries_per_sandbox") - in_flight
    assert over_rate <= servfail and over_rate + in_flight > 0, (out.stdout, in_flight)
    assert egress_works(victim, web)


def test_one_sandbox_cannot_fill_the_conntrack_table(
    zone_server: Running,
    zmake: Make,
    web: NsHost,
    victim: dsec.Sandbox,
) -> None:
    server = zone_server[0]
    attacker = zmake(network=True)
    direct = zmake(network=True)
    before = limited(server, "conntrack_per_sandbox")
    # One datagram to each of 3000 ports: a conntrack entry each; the cap is 2048.
    out = subprocess.run([*netns_of(attacker), "python3", "-c", UDP_SPRAY, web.ip, "3000"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    refused = wait_until(lambda: limited(server, "conntrack_per_sandbox") - before >= 900,
                         timeout=30)
    assert refused, limited(server, "conntrack_per_sandbox") - before
    # The refusals are events of the attacker, bounded.
    events = attacker.network_refused()
    assert 0 < len(events) <= 256, len(events)
    assert all(e["dst"] == web.ip and e["protocol"] == "udp" for e in events), events[:5]
    # Other sandboxes still get out, through the proxy and directly.
    assert egress_works(victim, web)
    r = fetch(direct, f"http://{web.ip}:80/hello.txt")
    assert f"hello from {web.ns}" in r.stdout, r


# ------------------------------------------------ leftovers of dead servers, two servers


def networked_sandbox(c: dsec.Client, rootfs: Path, host: NsHost) -> dsec.Sandbox:
    """A busybox sandbox with network=True on `c`'s server (the image imported first),
    checked to reach `host`."""
    c.import_image(str(rootfs), name="busybox")
    sb = c.create(image="busybox", network=True)
    assert reaches(sb, host)
    return sb


#: Two servers, each with a state directory of its own, both given the same pool with
#: --net-pool; the first running, with a sandbox on the network.
SamePool = tuple[Server, Server, dsec.Sandbox]


@pytest.fixture
def same_pool(busybox_rootfs: Path, hosts: Hosts) -> Iterator[SamePool]:
    pool = free_net16()
    d = make_tempdir("dsec-test-net-pair-")
    first, second = (
        Server(d / n, log_path=d / f"{n}.log", extra_args=["--net-pool", str(pool)])
        for n in ("first", "second")
    )
    try:
        first.start()
        with first.client() as c:
            yield first, second, networked_sandbox(c, busybox_rootfs, hosts[0])
    finally:
        first.cleanup()
        second.cleanup()
        safe_rmtree(d)


@pytest.mark.slow
def test_a_dead_servers_networking_is_removed_by_the_next_server(
    busybox_rootfs: Path,
    hosts: Hosts,
    same_pool: SamePool,
) -> None:
    first, second, _ = same_pool
    tag1, tag2 = state_tag(first.state_dir), state_tag(second.state_dir)
    first.kill9()
    assert f"link dsec{tag1}" in host_state(tag1) and (RECORDS / tag1).exists()
    # Another server, with another state directory and the same pool, removes what the
    # dead one left (found by its record, whose lock nobody holds) and gets the pool.
    second.start()
    log = second.log_tail(200)
    assert "sandbox networking unavailable" not in log, log
    assert "removed the networking a dead dsec server left" in log, log
    assert host_state(tag1) == [] and not (RECORDS / tag1).exists()
    with second.client() as c:
        networked_sandbox(c, busybox_rootfs, hosts[0]).stop()
    second.stop()
    assert host_state(tag2) == [] and not (RECORDS / tag2).exists()
    # The first server, restarted, removes the rest of what it left and works.
    first.restart()
    with first.client() as c:
        assert c.list() == []
        networked_sandbox(c, busybox_rootfs, hosts[0])
    first.stop()
    assert host_state(tag1) == [] and not (RECORDS / tag1).exists()


def test_a_live_servers_networking_is_never_taken(
    busybox_rootfs: Path,
    hosts: Hosts,
    same_pool: SamePool,
) -> None:
    first, second, sb = same_pool
    tag1, tag2 = state_tag(first.state_dir), state_tag(second.state_dir)
    # An explicit pool is strict: the second server does without networking, and
    # says whose the pool is.
    second.start()
    log = second.log_tail(200)
    assert "sandbox networking unavailable" in log, log
    assert f"live dsec server: pid {first.pid}" in log, log
    with second.client() as c2:
        c2.import_image(str(busybox_rootfs), name="busybox")
        with pytest.raises(dsec.Unavailable, match="live dsec server"):
            c2.create(image="busybox", network=True)
    assert f"link dsec{tag1}" in host_state(tag1)
    assert reaches(sb, hosts[0])
    second.stop()
    assert host_state(tag2) == []
    assert reaches(sb, hosts[0])
    first.stop()
    assert host_state(tag1) == []


def same_first_log_group(d: Path) -> tuple[Path, Path]:
    """Two state directories under `d` whose servers try the same nflog group first (their
    tags end in the same byte)."""
    seen: dict[str, Path] = {}
    for i in range(257):  # 256 possible last bytes: two of 257 names share one
        state = d / f"s{i}"
        low = state_tag(state)[-2:]
        if low in seen:
            return seen[low], state
        seen[low] = state
    raise AssertionError("257 tags with 256 last bytes, and no two share one")


def refused_to(sb: dsec.Sandbox, ip: str) -> bool:
    """Whether `sb` has a refused connection to `ip` among its events."""
    return any(e["dst"] == ip for e in sb.network_refused())


def test_two_servers_with_the_default_pool_both_have_networking(
    busybox_rootfs: Path,
    hosts: Hosts,
) -> None:
    """...and both report refused connections, though each tries the same nflog group
    first (the second to bind it is refused by the kernel, and takes the next)."""
    d = make_tempdir("dsec-test-net-two-")
    servers = [Server(s, log_path=s.with_suffix(".log")) for s in same_first_log_group(d)]
    default_range = ipaddress.ip_network("10.208.0.0/12")
    a, b = hosts
    try:
        pools = []
        for s in servers:
            s.start()
        for s in servers:
            log = s.log_tail(200)
            assert "sandbox networking unavailable" not in log, log
            assert "no refused-connection events" not in log, log
            with s.client() as c:
                sb = networked_sandbox(c, busybox_rootfs, a)
                ip = ipaddress.ip_address(eth0_ip(sb))
                assert ip in default_range
                pools.append(ipaddress.ip_network(f"{ip}/16", strict=False))
                sb.set_network({"allow": [a.ip]})
                assert not reaches(sb, b)
                assert wait_until(functools.partial(refused_to, sb, b.ip), timeout=5), (
                    s.state_dir,
                    sb.network_refused(),
                )
                sb.stop()
        assert pools[0] != pools[1]
        assert "the default address pool is taken" in servers[1].log_tail(200)
    finally:
        for s in servers:
            s.cleanup()
            assert host_state(state_tag(s.state_dir)) == []
        safe_rmtree(d)


# ---------------------------------------------------------- IP forwarding (issue 12)


class NetnsServer(Server):
    """A server in the network namespace `ns` (`nsenter --net`: the mount namespace, and
    so /sys, stay the host's, as for a fleet edge started that way)."""

    def __init__(self, ns: str, state_dir: Path, **kw: object) -> None:
        super().__init__(state_dir, **kw)  # type: ignore[arg-type]
        self.ns = ns

    def argv(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.ns}", "--", *super().argv()]


@pytest.mark.slow
def test_forwarding_is_switched_on_when_networking_starts(busybox_rootfs: Path) -> None:
    """From `net.ipv4.ip_forward=0` — set in a network namespace of the test's own, so
    that nothing else on this machine sees it change — the server switches forwarding on,
    after setting the iptables FORWARD policy to DROP, logs it, and sandboxes get out."""
    outside, inside = (str(h) for h in next(free_net16().subnets(new_prefix=30)).hosts())
    suffix = secrets.token_hex(3)
    ns, veth = f"dsec-test-fwd-{suffix}", f"dsectf{suffix}"
    d = make_tempdir("dsec-test-net-fwd-")
    (d / "www").mkdir()
    (d / "www" / "hello.txt").write_text("hello from outside\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(d / "www"))
    httpd: http.server.ThreadingHTTPServer | None = None
    s: Server | None = None
    in_ns = ("ip", "netns", "exec", ns)
    _sh("ip", "netns", "add", ns)
    try:
        _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "addr", "add", f"{outside}/30", "dev", veth)
        _sh("ip", "link", "set", veth, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{inside}/30", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh(*in_ns, "sysctl", "-qw", "net.ipv4.ip_forward=0")

        def forwarding() -> str:
            return _sh(*in_ns, "cat", "/proc/sys/net/ipv4/ip_forward").stdout.strip()

        assert forwarding() == "0"
        httpd = http.server.ThreadingHTTPServer((outside, 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        token = d / "token"
        token.write_text(secrets.token_hex(16))
        s = NetnsServer(ns, d / "state", host=inside, token_file=token, log_path=d / "server.log")
        s.start()
        log = s.log_tail(200)
        assert "switched IP forwarding on" in log and "FORWARD policy to DROP" in log, log
        assert forwarding() == "1"
        assert "-P FORWARD DROP" in _sh(*in_ns, "iptables", "-w", "-S", "FORWARD").stdout
        with s.client(token.read_text()) as c:
            c.import_image(str(busybox_rootfs), name="busybox")
            sb = c.create(image="busybox", network=True)
            r = fetch(sb, f"http://{outside}:{httpd.server_address[1]}/hello.txt")
            assert "hello from outside" in r.stdout, r.stdout + r.stderr
            sb.stop()
        s.stop()
        # dsec's accept rules leave with it; forwarding stays on, as dockerd leaves it.
        assert "dsec_" not in _sh(*in_ns, "iptables", "-w", "-S", "FORWARD").stdout
        assert forwarding() == "1"
        assert host_state(state_tag(d / "state")) == []
    finally:
        if s is not None:
            s.cleanup()
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        _sh("ip", "netns", "del", ns, check=False)
        _sh("ip", "link", "del", veth, check=False)
        safe_rmtree(d)
