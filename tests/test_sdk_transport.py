"""The SDK's own HTTP client (`dsec._http`) against real peers: keep-alive reuse, threads
sharing a pool, a server restarted under pooled connections, refusals, timeouts and broken
answers, big chunked bodies, TLS (socat in front of the server) and HTTP proxies
(tinyproxy, plain and CONNECT)."""

from __future__ import annotations

import asyncio
import http.client
import os
import resource
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dsec
import pytest
from dsec import _protocol as p
from dsec_testlib import Server, free_port, make_tempdir, require, safe_rmtree, wait_until


def health_in(client: dsec.Client, read_timeout: float) -> Any:
    """`GET /healthz` with a read timeout of our choosing (the public calls' are long)."""
    return client._do(p.Call("GET", "/healthz", p.parse_any, read_timeout=read_timeout))


def test_sequential_requests_share_one_connection(server: Server) -> None:
    with server.client() as c:
        c.health()
        sock = c._pool._idle[0].sock
        for _ in range(20):
            c.health()
        assert len(c._pool._idle) == 1 and c._pool._idle[0].sock is sock


def test_connections_past_descriptor_1024_are_reused(server: Server) -> None:
    """A trainer with a thousand sandboxes open has sockets past select()'s limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip(f"the descriptor limit ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fillers = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        with server.client() as c:
            c.health()
            sock = c._pool._idle[0].sock
            assert sock.fileno() > 1024
            c.health()
            assert c._pool._idle[0].sock is sock

            async def main() -> None:
                async with server.async_client() as ac:
                    await ac.health()
                    proto = ac._pool._idle[0]
                    await ac.health()
                    assert ac._pool._idle[0] is proto

            asyncio.run(main())
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_threads_share_a_bounded_pool(server: Server, busybox_image: str) -> None:
    with server.client() as c, c.create(image=busybox_image) as sb:
        c._pool = type(c._pool)(c._origin, 4, 30.0)
        errors: list[BaseException] = []

        def work() -> None:
            try:
                for i in range(10):
                    assert sb.run(["echo", str(i)]).stdout == f"{i}\n"
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert 1 <= len(c._pool._idle) <= 4


def test_a_restarted_server_is_reached_again(
    make_server: Callable[..., Server], busybox_image: str
) -> None:
    s = make_server(import_busybox=False)
    c = s.client()
    ac = s.async_client()

    async def async_health() -> Any:
        return await ac.health()

    loop = asyncio.new_event_loop()
    try:
        assert c.health() and loop.run_until_complete(async_health())
        s.stop()
        s.restart()
        # Both pools hold a connection the old server closed: it is replaced, not failed on.
        assert c.health() == {"status": "ok"}
        assert loop.run_until_complete(async_health()) == {"status": "ok"}
    finally:
        loop.run_until_complete(ac.close())
        loop.close()
        c.close()


def test_refused_connection_is_connection_failed() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with dsec.Client(url) as c, pytest.raises(dsec.ConnectionFailed, match="cannot reach"):
        c.health()

    async def main() -> None:
        async with dsec.AsyncClient(url) as ac:
            await ac.health()

    with pytest.raises(dsec.ConnectionFailed, match="cannot reach"):
        asyncio.run(main())


class Peer:
    """A TCP listener on loopback that reads a request and answers with ``reply`` (None:
    never answers), then closes: a broken server, to see how the client takes it."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            conn.recv(65536)
            if self.reply is not None:
                conn.sendall(self.reply)
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def peer() -> Iterator[Callable[[bytes | None], Peer]]:
    made: list[Peer] = []

    def make(reply: bytes | None) -> Peer:
        made.append(Peer(reply))
        return made[-1]

    yield make
    for pr in made:
        pr.close()


def test_a_silent_server_is_request_timeout(peer: Callable[[bytes | None], Peer]) -> None:
    pr = peer(None)
    with dsec.Client(pr.url) as c:
        t0 = time.monotonic()
        with pytest.raises(dsec.RequestTimeout, match="did not answer in time"):
            health_in(c, 0.5)
        assert time.monotonic() - t0 < 5

    async def main() -> None:
        async with dsec.AsyncClient(pr.url) as ac:
            await ac._do(p.Call("GET", "/healthz", p.parse_any, read_timeout=0.5))

    with pytest.raises(dsec.RequestTimeout):
        asyncio.run(main())


@pytest.mark.parametrize(
    "reply",
    [
        b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"status"',  # cut short
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",  # chunk cut short
        b"",  # closed without a word
        b"SSH-2.0-OpenSSH_9.2\r\n\r\n",  # not HTTP
    ],
    ids=["short-body", "short-chunk", "closed", "not-http"],
)
def test_a_broken_answer_is_connection_failed(
    peer: Callable[[bytes | None], Peer], reply: bytes
) -> None:
    pr = peer(reply)
    with dsec.Client(pr.url) as c, pytest.raises(dsec.ConnectionFailed, match="lost connection"):
        c.health()

    async def main() -> None:
        async with dsec.AsyncClient(pr.url) as ac:
            await ac.health()

    with pytest.raises(dsec.ConnectionFailed, match="lost connection"):
        asyncio.run(main())


class DropsKeptConnection:
    """A listener that answers the first request of each connection and keeps it open,
    then closes it unanswered when the next request on it comes: a server whose idle
    timeout fires just as a kept connection is used again."""

    OK = b'HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\n{"status": "ok"}'

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        #: (connection number, request line) of each request received.
        self.requests: list[tuple[int, bytes]] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            n += 1
            threading.Thread(target=self._one, args=(conn, n), daemon=True).start()

    def _one(self, conn: socket.socket, n: int) -> None:
        with conn:
            for answered in (True, False):
                data = conn.recv(65536)
                if not data:
                    return
                self.requests.append((n, data.split(b"\r\n", 1)[0]))
                if answered:
                    conn.sendall(self.OK)


def test_a_kept_connection_closed_under_a_request() -> None:
    """An idempotent request is sent again on a new connection; a POST is not (the server
    may have run it) and fails as ConnectionFailed."""
    post = p.Call("POST", "/v1/calls", p.parse_any, json={})
    peer = DropsKeptConnection()
    try:
        with dsec.Client(peer.url) as c:
            assert c.health() == {"status": "ok"}
            assert c.health() == {"status": "ok"}  # dropped on connection 1, sent on 2
            with pytest.raises(dsec.ConnectionFailed, match="before the response"):
                c._do(post)  # dropped on connection 2
        got = [(n, line.split()[0]) for n, line in peer.requests]
        assert got == [(1, b"GET"), (1, b"GET"), (2, b"GET"), (2, b"POST")]

        async def main() -> None:
            async with dsec.AsyncClient(peer.url) as ac:
                assert await ac.health() == {"status": "ok"}
                assert await ac.health() == {"status": "ok"}
                with pytest.raises(dsec.ConnectionFailed, match="before the response"):
                    await ac._do(post)

        del peer.requests[:]
        asyncio.run(main())
        got = [(n, line.split()[0]) for n, line in peer.requests]
        assert got == [(3, b"GET"), (3, b"GET"), (4, b"GET"), (4, b"POST")]
    finally:
        peer.sock.close()


class RefusesUploadsThenCloses:
    """A listener that answers a big upload with an error as soon as its head arrives,
    without ``Connection: close``, and closes the connection a moment later unread: what
    a server does when a write fails part-way (a full disk)."""

    REFUSED = b"HTTP/1.1 507 Insufficient Storage\r\nContent-Length: 60\r\n\r\n" + (
        b'{"error": {"kind": "disk_full", "message": "no space left"}}'
    )

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        #: (connection number, method) of each request received.
        self.requests: list[tuple[int, bytes]] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            n += 1
            threading.Thread(target=self._one, args=(conn, n), daemon=True).start()

    def _one(self, conn: socket.socket, n: int) -> None:
        with conn:
            while data := conn.recv(65536):
                method = data.split(b" ", 1)[0]
                self.requests.append((n, method))
                if method == b"PUT":
                    conn.sendall(self.REFUSED)
                    time.sleep(0.3)
                    return
                conn.sendall(DropsKeptConnection.OK)


def test_a_connection_whose_upload_was_refused_is_not_kept() -> None:
    """The request after a refused upload goes on a new connection, not on the one the
    server is about to close (where it would fail, unsent, as ConnectionFailed)."""
    post = p.Call("POST", "/v1/calls", p.parse_any, json={})
    upload = p.Call("PUT", "/v1/sandboxes/x/files?path=/f", p.parse_any, content=b"x" * (1 << 20))
    peer = RefusesUploadsThenCloses()
    try:
        with dsec.Client(peer.url) as c:
            with pytest.raises(dsec.DsecError, match="no space left"):
                c._do(upload)
            time.sleep(0.05)  # the answer is in; the close is not
            assert c._do(post) == {"status": "ok"}

        async def main() -> None:
            async with dsec.AsyncClient(peer.url) as ac:
                with pytest.raises(dsec.DsecError, match="no space left"):
                    await ac._do(upload)
                await asyncio.sleep(0.05)
                assert await ac._do(post) == {"status": "ok"}

        asyncio.run(main())
        assert peer.requests == [(1, b"PUT"), (2, b"POST"), (3, b"PUT"), (4, b"POST")]
    finally:
        peer.sock.close()


def test_the_server_closes_after_a_refused_upload(server: Server) -> None:
    """An upload the server refuses is answered with `Connection: close`: the rest of its
    body is never read, and the server closes the connection after the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("PUT", "/v1/sandboxes/sb-none/files?path=/f", b"x" * (256 << 10))
        answer = conn.getresponse()
        answer.read()
        assert answer.status == 404
        assert answer.getheader("Connection") == "close"
    finally:
        conn.close()


def _chunked(status: str, body: bytes) -> bytes:
    """An answer whose body comes in chunks of 7 bytes."""
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7])
                      for i in range(0, len(body), 7))  # fmt: skip
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
    return head.encode() + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"


@pytest.mark.parametrize(
    ("status", "kind", "exc"),
    [
        ("503 Service Unavailable", "capacity", dsec.CapacityExceeded),
        ("409 Conflict", "sandbox_failed", dsec.SandboxFailed),
        ("404 Not Found", "not_found", dsec.NotFound),
        ("413 Payload Too Large", "payload_too_large", dsec.PayloadTooLarge),
    ],
)
def test_error_answers_are_dsec_exceptions(
    peer: Callable[[bytes | None], Peer], status: str, kind: str, exc: type[dsec.DsecError]
) -> None:
    body = b'{"error": {"kind": "%s", "message": "told why"}}' % kind.encode()
    pr = peer(_chunked(status, body))
    with dsec.Client(pr.url) as c, pytest.raises(exc, match="told why") as got:
        c.health()
    assert got.value.status == int(status[:3]) and got.value.kind == kind

    async def main() -> None:
        async with dsec.AsyncClient(pr.url) as ac:
            await ac.health()

    with pytest.raises(exc, match="told why"):
        asyncio.run(main())


def test_a_chunked_answer_is_read_whole(peer: Callable[[bytes | None], Peer]) -> None:
    pr = peer(_chunked("200 OK", b'{"status": "ok", "pad": "' + b"x" * 100_000 + b'"}'))
    with dsec.Client(pr.url) as c:
        assert c.health()["pad"] == "x" * 100_000


def test_an_answer_until_close_is_read_whole(peer: Callable[[bytes | None], Peer]) -> None:
    pr = peer(b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"status": "ok"}')
    with dsec.Client(pr.url) as c:
        assert c.health() == {"status": "ok"}
        assert not c._pool._idle  # not kept: the server closed it


def test_big_bodies_both_ways(server: Server, busybox_image: str) -> None:
    data = os.urandom(6 << 20) * 2  # 12 MiB: sent with a Content-Length, read back chunked
    with server.client() as c, c.create(image=busybox_image, disk_mb=64) as sb:
        sb.write_file("/tmp/big", data[: 7 << 20])
        assert sb.read_file("/tmp/big") == data[: 7 << 20]
        sb.run("cat /tmp/big /tmp/big > /tmp/bigger")
        assert sb.read_file("/tmp/bigger") == data[: 7 << 20] * 2

        async def main() -> bytes:
            async with server.async_client() as ac:
                return await (await ac.get(sb.id)).read_file("/tmp/bigger")

        assert asyncio.run(main()) == data[: 7 << 20] * 2


def test_stream_of_many_events(server: Server, busybox_image: str) -> None:
    with server.client() as c, c.create(image=busybox_image) as sb:
        out = "".join(e.data for e in sb.stream("seq 1 20000") if e.kind == "stdout")
        assert out.split() == [str(i) for i in range(1, 20001)]

        async def main() -> str:
            async with server.async_client() as ac:
                asb = await ac.get(sb.id)
                return "".join([e.data async for e in asb.stream("seq 1 20000")])

        assert asyncio.run(main()).split() == [str(i) for i in range(1, 20001)]


def test_a_stream_left_early_frees_its_connection(server: Server, busybox_image: str) -> None:
    with server.client() as c, c.create(image=busybox_image) as sb:
        c._pool = type(c._pool)(c._origin, 1, 30.0)  # one connection: a leak would hang
        for _ in range(3):
            events = sb.stream("echo first; sleep 1; echo second")
            assert next(events).data == "first\n"
            events.close()  # type: ignore[attr-defined]
            assert sb.run("echo next").stdout == "next\n"


# ------------------------------------------------------------------ TLS and proxies


@pytest.fixture(scope="module")
def peers_bin() -> dict[str, str]:
    found = {n: shutil.which(n) for n in ("socat", "tinyproxy", "openssl")}
    missing = [n for n, path in found.items() if path is None]
    require("http-peers", f"{', '.join(missing)} not installed" if missing else None)
    return {n: path for n, path in found.items() if path is not None}


class Daemon:
    """A process this test started, stopped by its pid."""

    def __init__(self, argv: list[str], log: Path) -> None:
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def wait_listening(port: int, host: str = "127.0.0.1") -> None:
    def up() -> bool:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return True
        except OSError:
            return False

    assert wait_until(up, 10), f"nothing listens on {host}:{port}"


@pytest.fixture(scope="module")
def front(
    peers_bin: dict[str, str], server: Server, busybox_image: str
) -> Iterator[dict[str, Any]]:
    """In front of the suite's server, on 127.0.0.2 (loopback, but not the address the SDK
    exempts from proxies): socat terminating TLS with a certificate made here, socat
    forwarding plain TCP, and tinyproxy."""
    d = make_tempdir("dsec-test-front-")
    daemons: list[Daemon] = []
    try:
        cert, key = d / "cert.pem", d / "key.pem"
        subprocess.run(
            [peers_bin["openssl"], "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=127.0.0.2", "-addext", "subjectAltName=IP:127.0.0.2",
             "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True,
        )  # fmt: skip
        tls_port, plain_port, proxy_port = free_port(), free_port(), free_port()
        target = f"TCP:127.0.0.1:{server.port}"
        daemons.append(Daemon(
            [peers_bin["socat"], f"OPENSSL-LISTEN:{tls_port},bind=127.0.0.2,reuseaddr,fork,"
             f"cert={cert},key={key},verify=0", target], d / "socat-tls.log"))  # fmt: skip
        daemons.append(Daemon(
            [peers_bin["socat"], f"TCP-LISTEN:{plain_port},bind=127.0.0.2,reuseaddr,fork",
             target], d / "socat-plain.log"))  # fmt: skip
        conf = d / "tinyproxy.conf"
        conf.write_text(
            f"Port {proxy_port}\nListen 127.0.0.1\nTimeout 60\nLogLevel Info\n"
            f'LogFile "{d / "tinyproxy.log"}"\nMaxClients 50\nAllow 127.0.0.1\n'
        )
        daemons.append(Daemon([peers_bin["tinyproxy"], "-d", "-c", str(conf)], d / "tp.out"))
        wait_listening(tls_port, "127.0.0.2")
        wait_listening(plain_port, "127.0.0.2")
        wait_listening(proxy_port)
        yield {
            "cert": str(cert),
            "tls_url": f"https://127.0.0.2:{tls_port}",
            "plain_url": f"http://127.0.0.2:{plain_port}",
            "proxy": f"http://127.0.0.1:{proxy_port}",
            "proxy_log": d / "tinyproxy.log",
            "image": busybox_image,
        }
    finally:
        for dm in daemons:
            dm.stop()
        safe_rmtree(d)


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


def roundtrip(url: str, image: str) -> None:
    """A sandbox created, used and stopped through ``url``, with both clients."""
    with dsec.Client(url) as c, c.create(image=image) as sb:
        assert sb.run("echo over tls-or-proxy").stdout == "over tls-or-proxy\n"
        assert [e.kind for e in sb.stream("echo s")] == ["stdout", "exit"]

    async def main() -> None:
        async with dsec.AsyncClient(url) as ac, ac.create(image=image) as asb:
            rs = await asyncio.gather(*(asb.run(["echo", str(i)]) for i in range(10)))
            assert [r.stdout for r in rs] == [f"{i}\n" for i in range(10)]

    asyncio.run(main())


def proxied(front: dict[str, Any]) -> int:
    """Requests tinyproxy logged so far."""
    log: Path = front["proxy_log"]
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return 0
    return text.count("Request (file descriptor")


def test_tls(front: dict[str, Any], environ: pytest.MonkeyPatch) -> None:
    environ.setenv("SSL_CERT_FILE", front["cert"])
    roundtrip(front["tls_url"], front["image"])


def test_tls_with_an_unknown_certificate_fails(
    front: dict[str, Any], environ: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    environ.setenv("SSL_CERT_FILE", str(tmp_path / "none.pem"))
    with dsec.Client(front["tls_url"]) as c, pytest.raises(dsec.ConnectionFailed, match="TLS"):
        c.health()


def test_http_through_a_proxy(front: dict[str, Any], environ: pytest.MonkeyPatch) -> None:
    environ.setenv("http_proxy", front["proxy"])
    before = proxied(front)
    roundtrip(front["plain_url"], front["image"])
    assert wait_until(lambda: proxied(front) > before, 5)
    # tinyproxy closes each client connection after its answer: none is kept for reuse.
    with dsec.Client(front["plain_url"]) as c:
        for _ in range(5):
            assert c.health() == {"status": "ok"}
        assert not c._pool._idle


def test_https_through_a_proxy_tunnel(front: dict[str, Any], environ: pytest.MonkeyPatch) -> None:
    environ.setenv("SSL_CERT_FILE", front["cert"])
    environ.setenv("https_proxy", front["proxy"])
    before = proxied(front)
    roundtrip(front["tls_url"], front["image"])
    assert wait_until(lambda: proxied(front) > before, 5)


def test_no_proxy_and_loopback_go_direct(
    front: dict[str, Any], environ: pytest.MonkeyPatch, server: Server
) -> None:
    environ.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    environ.setenv("no_proxy", "127.0.0.2")
    with dsec.Client(front["plain_url"]) as c:
        assert c.health() == {"status": "ok"}
    environ.delenv("no_proxy")
    with dsec.Client(server.url) as c:  # 127.0.0.1: never through a proxy
        assert c.health() == {"status": "ok"}
    with dsec.Client(front["plain_url"]) as c, pytest.raises(dsec.ConnectionFailed):
        c.health()


def test_bad_urls_are_invalid_argument(environ: pytest.MonkeyPatch) -> None:
    for url in ("ftp://127.0.0.1:7700", "127.0.0.1:7700", "http://"):
        with pytest.raises(dsec.InvalidArgument, match="URL"):
            dsec.Client(url)
    environ.setenv("http_proxy", "socks5://127.0.0.1:1080")
    with pytest.raises(dsec.InvalidArgument, match="proxies"):
        dsec.Client("http://192.0.2.1:7700")
