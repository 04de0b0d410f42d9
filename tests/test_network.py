"""Sandbox networking (issue 7): network=True, allow-lists, isolation, set_network, cleanup.

Traffic goes only to loopback, to test hosts in network namespaces this file creates
(`ip netns add dsec-test-...`, a veth with a /30 to the host), and, in the one test that
allows it on purpose, to PyPI. Nothing else is ever addressed: to check that a destination
is refused, it is stood up here first.

The servers here run with their own address pool (a /16 no host route overlaps), so they
never collide with another dsec server on the machine.
"""

from __future__ import annotations

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
from dsec_testlib import REPO, Server, free_port, make_tempdir, safe_rmtree, wait_until

pytestmark = pytest.mark.timeout(120)

DEBIAN_ROOTFS = Path(
    os.environ.get("DSEC_TEST_DEBIAN_ROOTFS", "/var/tmp/dsec-test-debian-rootfs")
)


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
            nets.append(ipaddress.ip_network(dst if "/" in dst else dst + "/32", strict=False))
        except ValueError:
            continue
    return nets


_TAKEN: list[ipaddress.IPv4Network] = []


def free_net16() -> ipaddress.IPv4Network:
    """A 10.x.0.0/16 that no host route and no earlier pick of this run overlaps."""
    routes = _routes() + _TAKEN
    for second in range(212, 250):
        net = ipaddress.ip_network(f"10.{second}.0.0/16")
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


class NsHost:
    """A web server in a network namespace of its own, routed from the host over a /30."""

    def __init__(self, net: ipaddress.IPv4Network, ports: tuple[int, ...] = (8080, 8081)):
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
            _sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
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
            for port in ports:
                wait_until(lambda p=port: self._up(p), timeout=10)
        except BaseException:
            self.close()
            raise

    def _up(self, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.ip}:{port}/hello.txt", timeout=1) as r:
                return r.status == 200
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


@pytest.fixture(scope="module")
def net_server(busybox_rootfs: Path) -> Iterator[tuple[Server, ipaddress.IPv4Network]]:
    """A server of this module's own, with its own address pool."""
    pool = free_net16()
    d = make_tempdir("dsec-test-net-")
    s = Server(d / "state", log_path=d / "server.log", extra_args=["--net-pool", str(pool)])
    s.start()
    try:
        with s.client() as c:
            c.import_image(str(busybox_rootfs), name="busybox")
        if "sandbox networking unavailable" in s.log_tail(200):
            pytest.skip("sandbox networking unavailable here:\n" + s.log_tail(20))
        yield s, pool
    finally:
        s.cleanup()
        tag = state_tag(s.state_dir)
        safe_rmtree(d)
        assert host_state(tag) == [], "networking left host state after a graceful stop"


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


@pytest.fixture
def make(net_client: dsec.Client) -> Iterator[Callable[..., dsec.Sandbox]]:
    made: list[dsec.Sandbox] = []

    def create(**kw: object) -> dsec.Sandbox:
        kw.setdefault("image", "busybox")
        sb = net_client.create(**kw)  # type: ignore[arg-type]
        made.append(sb)
        return sb

    yield create
    for sb in made:
        sb.stop()


def eth0_ip(sb: dsec.Sandbox) -> str:
    r = sb.run("ip -o -4 addr show eth0")
    assert r.exit_code == 0, r.stderr
    return r.stdout.split()[3].split("/")[0]


def test_network_true_reaches_a_test_host(make, hosts) -> None:
    a, b = hosts
    sb = make(network=True)
    assert reaches(sb, a) and reaches(sb, b, 8081)
    assert sb.read_file("/etc/resolv.conf").startswith(b"nameserver ")
    host_ca = Path("/etc/ssl/certs/ca-certificates.crt")
    if host_ca.exists():
        assert sb.read_file(str(host_ca)) == host_ca.read_bytes()


def test_network_false_is_loopback_only(make, hosts) -> None:
    sb = make(network=False)
    links = sb.run("ip -o link").stdout
    assert [l.split(":")[1].strip() for l in links.splitlines()] == ["lo"]
    assert not reaches(sb, hosts[0])


def test_ca_bundle_can_be_declined(net_client: dsec.Client) -> None:
    sb = net_client.create(image="busybox", network=True, ca_bundle=False)
    try:
        r = sb.run("test -e /etc/ssl/certs/ca-certificates.crt")
        assert r.exit_code != 0
    finally:
        sb.stop()


def test_sandboxes_cannot_reach_each_other(make) -> None:
    a, b = make(network=True), make(network=True)
    assert b.run("mkdir -p /tmp/www && echo hi-b > /tmp/www/x && httpd -p 8000 -h /tmp/www").exit_code == 0
    assert "hi-b" in fetch(b, "http://127.0.0.1:8000/x").stdout
    bip = eth0_ip(b)
    r = fetch(a, f"http://{bip}:8000/x")
    assert "hi-b" not in r.stdout
    r = a.run(f"ping -c 1 -W 1 {bip}")
    assert r.exit_code != 0


def test_host_services_and_the_api_are_unreachable(make, net_server) -> None:
    server, pool = net_server
    bridge_ip = str(pool.network_address + 1)
    # A service of the host's own, listening everywhere (stands in for anything on the host).
    httpd = http.server.ThreadingHTTPServer(("0.0.0.0", free_port()), http.server.SimpleHTTPRequestHandler)
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


def test_allow_list_of_ip_and_port(make, hosts, net_server) -> None:
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


def test_allow_list_of_a_cidr(make, hosts) -> None:
    a, b = hosts
    sb = make(network={"allow": [f"{a.ip}/32"]})
    assert reaches(sb, a, 8080) and reaches(sb, a, 8081)
    assert not reaches(sb, b)


def test_disallowed_names_do_not_resolve(make) -> None:
    sb = make(network={"allow": ["pypi.org"]})
    r = sb.run("nslookup example.com", timeout=15)
    assert "Address" not in r.stdout.split("Name:")[-1] if "Name:" in r.stdout else True
    assert r.exit_code != 0 or "NXDOMAIN" in r.stdout + r.stderr


def test_set_network_changes_a_running_sandbox(make, hosts) -> None:
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


def test_malformed_rules_are_invalid_arguments(net_client: dsec.Client) -> None:
    for rule in ["10.0.0.0/33", "1.2.3.4:99999", "bad host!", "[::1]:80"]:
        with pytest.raises(dsec.InvalidArgument, match=re.escape(repr(rule)[1:-1])):
            net_client.create(image="busybox", network={"allow": [rule]})


def test_nothing_left_after_stop(make, net_server) -> None:
    tag = state_tag(net_server[0].state_dir)
    before = {s for s in host_state(tag) if s.startswith("link dv")}
    sb = make(network=True)
    during = {s for s in host_state(tag) if s.startswith("link dv")}
    assert len(during - before) == 1
    sb.stop()
    wait_until(lambda: {s for s in host_state(tag) if s.startswith("link dv")} == before, timeout=5)
    chains = _sh("nft", "list", "table", "inet", f"dsec_{tag}").stdout
    assert not re.search(r"chain s[0-9a-f]{5}", chains), chains


def test_nothing_left_after_ttl(net_client: dsec.Client, net_server) -> None:
    tag = state_tag(net_server[0].state_dir)
    veths = lambda: {s for s in host_state(tag) if s.startswith("link dv")}  # noqa: E731
    before = veths()
    sb = net_client.create(image="busybox", network=True, ttl_s=1)
    wait_until(lambda: sb.id not in {x.id for x in net_client.list()}, timeout=10)
    wait_until(lambda: veths() == before, timeout=5)


@pytest.mark.slow
def test_nothing_left_after_sigkill_and_restart(busybox_rootfs: Path) -> None:
    pool = free_net16()
    d = make_tempdir("dsec-test-net-kill-")
    s = Server(d / "state", log_path=d / "server.log", extra_args=["--net-pool", str(pool)])
    tag = state_tag(d / "state")
    try:
        s.start()
        with s.client() as c:
            c.import_image(str(busybox_rootfs), name="busybox")
            sb = c.create(image="busybox", network=True)
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
            pytest.skip(f"no Debian rootfs with python3: {r.stderr[-400:]}")
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
def test_a_sandbox_cannot_borrow_another_ones_address(make, hosts, debian_image: str) -> None:
    a, b = hosts
    open_sb = make(network=True)
    narrow = make(image=debian_image, network={"allow": [a.ip]})
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
def test_allow_list_of_registry_names(make, hosts, debian_image: str) -> None:
    url = "https://pypi.org/simple/six/"
    try:
        with urllib.request.urlopen(url, timeout=15) as r:
            assert r.status == 200
    except OSError as e:
        pytest.skip(f"PyPI is not reachable from this host: {e}")
    sb = make(image=debian_image, network={"allow": ["pypi.org", "files.pythonhosted.org"]})
    r = sb.run(["python3", "-c", PYPI_FETCH, url], timeout=60)
    assert r.exit_code == 0 and r.stdout.strip() == "200 True", r.stdout + r.stderr
    r = sb.run(["python3", "-c", PYPI_FETCH, hosts[0].url()], timeout=30)
    assert r.exit_code != 0
    # The address answered for pypi.org may be shared with other sites (here: every
    # registry); a TLS connection to it that names another one is refused by the proxy.
    only = make(image=debian_image, network={"allow": ["pypi.org"]})
    r = only.run(
        ["python3", "-c", SNI_PROBE, "pypi.org", "pypi.org", "files.pythonhosted.org"],
        timeout=60,
    )
    assert r.stdout.strip() == "ok refused", r.stdout + r.stderr
    refused = [e for e in only.network_refused() if e["port"] == 443]
    assert refused, only.network_refused()
