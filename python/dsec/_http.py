"""The SDK's HTTP/1.1 client: keep-alive connection pools (threads and asyncio), TLS, HTTP
proxies from the environment, chunked and streamed responses.

Why not httpx: measured against a dsec server on one machine (``bench/bench.py --only
sdk``; the README's "The Python SDK" has one run's figures), a request through httpx cost
the calling process 12-39 times this client's CPU (sync and asyncio), several times the
150 µs an RL trainer's request may cost; aiohttp and http.client 2-3 times. This client
does what the dsec API needs and no more (one origin, JSON and raw bodies,
``Content-Length`` or ``chunked`` responses), with one parser shared by both pools.

Connections: a pool per client, at most ``max_connections`` open at once (further requests
wait for one), idle ones kept for :data:`KEEPALIVE_S`. A pooled connection the server closed
is noticed before it is reused (it is readable while idle) and replaced. One the server
closes just as a request goes out on it (its idle timeout) fails that request before any
answer: an idempotent one (GET, PUT, DELETE) is then sent again on a new connection, a POST
never (the server may have run it). Connecting is retried a few times: a burst of
thousands of connections can overflow a listen backlog for a moment, and nothing was sent
yet.

Proxies: for a server off loopback, ``http_proxy``/``https_proxy``/``all_proxy`` and
``no_proxy`` are honoured as by ``urllib``: ``http://`` through an ``http://`` proxy
(absolute request targets), ``https://`` through a ``CONNECT`` tunnel. TLS certificates
are checked against the system's store (``SSL_CERT_FILE``, ``SSL_CERT_DIR`` honoured).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import select
import socket
import ssl
import struct
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncGenerator, Generator

#: How long an idle connection is kept for reuse.
KEEPALIVE_S = 30.0
#: Connection attempts before a connect error is raised.
CONNECT_ATTEMPTS = 4
#: Bodies larger than this are sent apart from the request head (no copy).
_JOIN_BODY_MAX = 64 << 10
#: Bytes asked of each receive: below malloc's mmap threshold, so a small answer costs no
#: mmap/munmap of a big buffer.
_RECV_BYTES = 64 << 10
#: A streamed response stops reading from the socket while this much is unconsumed.
_STREAM_HIGH_WATER = 1 << 20
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_NO_BODY_STATUS = {204, 304}
_IDEMPOTENT = {"GET", "HEAD", "PUT", "DELETE", "OPTIONS"}

__all__ = [
    "AsyncPool",
    "ConnectError",
    "ConnectTimeout",
    "Origin",
    "ProtocolError",
    "ReadTimeout",
    "Request",
    "Response",
    "SyncPool",
    "TransportError",
]


class TransportError(Exception):
    """No (complete) HTTP answer: the connection could not be made, or broke, or timed out."""


class ConnectError(TransportError):
    """The connection could not be made."""


class ConnectTimeout(ConnectError):
    """The connection was not made in time."""


class ReadTimeout(TransportError):
    """The server did not answer in time."""


class ProtocolError(TransportError):
    """The connection closed early, or the server's answer is not HTTP/1.1 as understood here."""


class ClosedBeforeAnswer(ProtocolError):
    """The connection closed before the first byte of an answer: on a kept connection, the
    server may have closed it just as the request went out (its idle timeout), unread."""


# ---------------------------------------------------------------------------- the origin


class Origin:
    """Where requests go: scheme, host and port of the base URL, its path prefix, the proxy
    to use (if any), and the header lines every request carries."""

    __slots__ = (
        "connect_host",
        "connect_port",
        "fixed_headers",
        "host",
        "persistent",
        "port",
        "prefix",
        "proxy_auth",
        "ssl_context",
        "target_prefix",
        "tls",
        "tunnel",
    )

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"dsec server URL must be http[s]://HOST[:PORT][/PATH], got {url!r}")
        self.tls = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self.ssl_context = ssl.create_default_context() if self.tls else None
        default_port = self.port == (443 if self.tls else 80)
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        host_header = netloc if default_port else f"{netloc}:{self.port}"
        self.connect_host, self.connect_port = self.host, self.port
        #: Prepended to every request target (absolute-form through an http proxy).
        self.target_prefix = self.prefix
        self.tunnel = False
        #: Connections are kept for further requests. Not through a forwarding proxy: many
        #: (tinyproxy among them) close a client's connection after each answer without
        #: saying so, and a request sent as it closes would be lost.
        self.persistent = True
        self.proxy_auth: str | None = None
        proxy = _proxy_for(u.scheme, self.host)
        if proxy is not None:
            p = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
            if p.scheme != "http" or not p.hostname:
                raise ValueError(f"only http:// proxies are supported, got {proxy!r}")
            self.connect_host, self.connect_port = p.hostname, p.port or 80
            if p.username is not None:
                user = urllib.parse.unquote(p.username)
                cred = f"{user}:{urllib.parse.unquote(p.password or '')}".encode()
                self.proxy_auth = "Basic " + base64.b64encode(cred).decode("ascii")
            if self.tls:
                self.tunnel = True
            else:
                self.target_prefix = f"http://{host_header}{self.prefix}"
                self.persistent = False
        lines = [f"Host: {host_header}"]
        if not self.persistent:
            lines.append("Connection: close")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if self.proxy_auth is not None and not self.tunnel:
            lines.append(f"Proxy-Authorization: {self.proxy_auth}")
        self.fixed_headers = "".join(f"{line}\r\n" for line in lines).encode("latin-1")

    def connect_request(self) -> bytes:
        """The CONNECT request that opens a tunnel to the server through the proxy."""
        target = f"{self.host}:{self.port}"
        head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
        if self.proxy_auth is not None:
            head += f"Proxy-Authorization: {self.proxy_auth}\r\n"
        return (head + "\r\n").encode("latin-1")


def _proxy_for(scheme: str, host: str) -> str | None:
    """The proxy URL the environment names for ``scheme://host``; None for loopback (a
    server on this host must never be reached through a proxy) and for ``no_proxy``."""
    if host in _LOOPBACK:
        return None
    proxies = urllib.request.getproxies_environment()
    if not proxies or urllib.request.proxy_bypass(host):
        return None
    return proxies.get(scheme) or proxies.get("all")


class Request:
    """One request, encoded once: its head (request line and headers) and body."""

    __slots__ = ("body", "head", "replayable", "timeout")

    def __init__(
        self,
        origin: Origin,
        method: str,
        target: str,
        *,
        headers: str = "",
        body: bytes | None = None,
        timeout: float,
        idempotent: bool = False,
    ) -> None:
        head = f"{method} {origin.target_prefix}{target} HTTP/1.1\r\n{headers}"
        if body is not None:
            head += f"Content-Length: {len(body)}\r\n"
        self.head = head.encode("latin-1") + origin.fixed_headers + b"\r\n"
        self.body = body
        #: Seconds the server may take to answer (and between two parts of a stream).
        self.timeout = timeout
        #: Idempotent: sent again on a new connection if a kept one closed before answering
        #: (RFC 9112 §9.3.1). A POST only with an idempotency key: the server may have run it.
        self.replayable = method in _IDEMPOTENT or idempotent

    def refused_upload(self, p: Parser) -> None:
        """An error answer to a big upload may come before the server read all of it: it
        then closes the connection, perhaps without saying so (``Connection: close``), and a
        request sent next on it would be lost. Such a connection is not kept."""
        if p.status >= 400 and self.body is not None and len(self.body) > _JOIN_BODY_MAX:
            p.keep_alive = False

    def wire(self) -> list[bytes]:
        """What to send: one buffer for small requests, head and body apart for big ones."""
        if self.body is None:
            return [self.head]
        if len(self.body) <= _JOIN_BODY_MAX:
            return [self.head + self.body]
        return [self.head, self.body]


class Response:
    """A complete response: status, head (status line and header lines) and body."""

    __slots__ = ("body", "head", "status")

    def __init__(self, status: int, head: bytes, body: bytes) -> None:
        self.status = status
        self.head = head
        self.body = body

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    @property
    def headers(self) -> dict[str, str]:
        """Header names in lower case (a repeated header: the last one)."""
        out = {}
        for line in self.head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            out[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        return out


def _header(low_head: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` (lower case) in a lower-cased response head."""
    i = low_head.find(b"\r\n" + name + b":")
    if i < 0:
        return None
    start = i + len(name) + 3
    end = low_head.find(b"\r\n", start)
    return low_head[start : end if end >= 0 else None].strip()


# ---------------------------------------------------------------------------- parsing

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class Parser:
    """Incremental parser of one HTTP/1.1 response, fed whatever the socket gives.

    After the head, ``status`` and ``head`` are set; body bytes collect in ``body``
    (taken by the reader as they come, for streams); ``done`` when the response ended.
    ``keep_alive`` says whether the connection can carry another request afterwards.
    """

    __slots__ = (
        "_buf",
        "_need",
        "_no_body",
        "_state",
        "body",
        "body_bytes",
        "head",
        "keep_alive",
        "status",
    )

    def __init__(self, no_body: bool = False) -> None:
        self._buf = bytearray()
        self._state = _HEAD
        self._need = 0
        #: The request expects no body whatever the head says (a CONNECT's 200).
        self._no_body = no_body
        self.status = 0
        self.head = b""
        self.body: list[bytes] = []
        #: Bytes in ``body``.
        self.body_bytes = 0
        self.keep_alive = True

    @property
    def done(self) -> bool:
        return self._state == _DONE

    @property
    def has_head(self) -> bool:
        return self._state != _HEAD

    @property
    def untouched(self) -> bool:
        """Not a byte of the answer has come."""
        return self._state == _HEAD and not self._buf

    def take_body(self) -> bytes:
        """The body bytes received so far and not yet taken."""
        chunks, self.body, self.body_bytes = self.body, [], 0
        return b"".join(chunks)

    def _emit(self, data: bytes) -> None:
        self.body.append(data)
        self.body_bytes += len(data)

    def feed(self, data: bytes) -> None:
        buf = self._buf
        if not buf and self._state == _HEAD:  # the usual answer: head and body in one piece
            end = data.find(b"\r\n\r\n")
            if end >= 0:
                self._head(data[:end])
                data = data[end + 4 :]
                if not data:
                    return
        if not buf and self._state == _LENGTH:  # body bytes as they come: no copy
            take = min(self._need, len(data))
            self._emit(data if take == len(data) else data[:take])
            self._need -= take
            if self._need == 0:
                self._state = _DONE
            data = data[take:]
            if not data:
                return
        buf += data
        while True:
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > 1 << 20:
                        raise ProtocolError("response head larger than 1 MiB")
                    return
                head = bytes(buf[:end])
                del buf[: end + 4]
                self._head(head)
            elif state == _LENGTH or state == _CHUNK_DATA:
                if not buf:
                    return
                take = min(self._need, len(buf))
                self._emit(bytes(buf[:take]))
                del buf[:take]
                self._need -= take
                if self._need == 0:
                    self._state = _DONE if state == _LENGTH else _CHUNK_END
            elif state == _CHUNK_SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                line = bytes(buf[:end]).split(b";", 1)[0].strip()
                del buf[: end + 2]
                try:
                    self._need = int(line, 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {line[:40]!r}") from None
                self._state = _CHUNK_DATA if self._need else _TRAILER
            elif state == _CHUNK_END:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                del buf[:2]
                self._state = _CHUNK_SIZE
            elif state == _TRAILER:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:  # the empty line that ends the trailer
                    self._state = _DONE
            elif state == _UNTIL_CLOSE:
                if buf:
                    self._emit(bytes(buf))
                    buf.clear()
                return
            else:  # _DONE: anything more is not ours (the server sent garbage)
                if buf:
                    self.keep_alive = False
                return

    def _head(self, head: bytes) -> None:
        eol = head.find(b"\r\n")
        status_line = head if eol < 0 else head[:eol]
        if not status_line.startswith(b"HTTP/1.") or len(status_line) < 12:
            raise ProtocolError(f"not an HTTP/1.x response: {status_line[:80]!r}")
        try:
            status = int(status_line[9:12])
        except ValueError:
            raise ProtocolError(f"bad status line {status_line[:80]!r}") from None
        if 100 <= status < 200:  # an interim response: the real one follows
            return
        self.status, self.head = status, head
        low = head.lower()
        connection = _header(low, b"connection")
        self.keep_alive = status_line[5:8] == b"1.1" and (
            connection is None or b"close" not in connection
        )
        encoding = _header(low, b"transfer-encoding")
        length = _header(low, b"content-length")
        if self._no_body or status in _NO_BODY_STATUS:
            self._state = _DONE
        elif encoding is not None and b"chunked" in encoding:
            self._state = _CHUNK_SIZE
        elif length is not None:
            try:
                self._need = int(length)
            except ValueError:
                raise ProtocolError(f"bad Content-Length {length[:40]!r}") from None
            self._state = _LENGTH if self._need else _DONE
        else:
            self._state = _UNTIL_CLOSE
            self.keep_alive = False

    def eof(self) -> None:
        """The connection closed: the end of a read-until-close body, else an error."""
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
        elif self.untouched:
            raise ClosedBeforeAnswer("the server closed the connection before the response")
        elif self._state != _DONE:
            where = "before" if self._state == _HEAD else "in the middle of"
            raise ProtocolError(f"the server closed the connection {where} the response")
        self.keep_alive = False

    def response(self) -> Response:
        return Response(self.status, self.head, b"".join(self.body))


def _check_tunnel(p: Parser) -> None:
    if p.status != 200:
        raise ConnectError(f"the proxy refused the CONNECT tunnel: HTTP {p.status}")


# ---------------------------------------------------------------------------- threads


def _quiet(sock: socket.socket | None) -> bool:
    """An idle connection's socket has nothing to read: a readable one was closed by the
    server (or holds bytes nobody asked for), and must not carry a request."""
    if sock is None:
        return True
    # poll, not select: a process with thousands of sandboxes has descriptors past
    # select's 1024.
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False


class _Conn:
    """One socket to the server (through its tunnel, if any), used by one thread at a time."""

    __slots__ = ("idle_since", "reused", "sock", "timeout")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.idle_since = time.monotonic()
        #: It carried a request before (so the server may close it as it is used again).
        self.reused = False
        self.timeout: float | None = None

    def set_timeout(self, timeout: float) -> None:
        """Bound each send and receive. A plain socket stays blocking with the kernel's
        ``SO_RCVTIMEO``/``SO_SNDTIMEO``: one syscall per receive, where Python's own
        timeouts add a ``poll`` to each."""
        if timeout == self.timeout:
            return
        self.timeout = timeout
        if isinstance(self.sock, ssl.SSLSocket):
            self.sock.settimeout(timeout)
            return
        sec = int(timeout)
        usec = max(int((timeout - sec) * 1e6), 0 if sec else 1)  # 0, 0 would mean "never"
        tv = struct.pack("ll", sec, usec)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def usable(self) -> bool:
        """Idle not too long, and still open."""
        return time.monotonic() - self.idle_since <= KEEPALIVE_S and _quiet(self.sock)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class SyncPool:
    """A thread-safe pool of keep-alive connections to one origin: at most
    ``max_connections`` open (busy or idle); a request finding none free waits for one."""

    def __init__(self, origin: Origin, max_connections: int, connect_timeout: float) -> None:
        self.origin = origin
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self._idle: collections.deque[_Conn] = collections.deque()
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._open = 0  # connections open or being opened
        self._waiting = 0

    def request(self, req: Request) -> Response:
        """Send ``req`` and read the whole response."""
        while True:
            conn = self._take()
            try:
                p = self._exchange(conn, req)
                while not p.done:
                    self._recv_into(conn, p)
            except ClosedBeforeAnswer:
                self._give_back(conn, keep=False)
                if conn.reused and req.replayable:
                    continue  # each try takes a kept connection away: this ends
                raise
            except BaseException:
                self._give_back(conn, keep=False)
                raise
            self._give_back(conn, keep=p.keep_alive)
            return p.response()

    def stream(self, req: Request) -> tuple[Parser, Generator[bytes, None, None]]:
        """Send ``req``; the parsed head, and the body as it comes. Close the iterator (or
        run it to the end) to free the connection."""
        conn = self._take()
        try:
            p = self._exchange(conn, req)
        except BaseException:
            self._give_back(conn, keep=False)
            raise
        return p, self._body(conn, p)

    def _body(self, conn: _Conn, p: Parser) -> Generator[bytes, None, None]:
        ok = False
        try:
            while True:
                if p.body:
                    yield p.take_body()
                if p.done:
                    ok = True
                    return
                self._recv_into(conn, p)
        finally:
            self._give_back(conn, keep=ok and p.keep_alive)

    def _exchange(self, conn: _Conn, req: Request) -> Parser:
        """Send the request and read until the response head is in."""
        sock = conn.sock
        conn.set_timeout(req.timeout)
        p = Parser()
        try:
            for part in req.wire():
                sock.sendall(part)
        except OSError as e:
            # The server may answer (413) and close before it has read the whole body.
            try:
                while not p.has_head:
                    self._recv_into(conn, p)
            except ClosedBeforeAnswer:
                raise ClosedBeforeAnswer(f"sending the request: {e}") from e
            except TransportError:
                raise ProtocolError(f"sending the request: {e}") from e
            req.refused_upload(p)
            return p
        while not p.has_head:
            self._recv_into(conn, p)
        req.refused_upload(p)
        return p

    @staticmethod
    def _recv_into(conn: _Conn, p: Parser) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (TimeoutError, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO expired
            raise ReadTimeout("no answer within the request's timeout") from None
        except OSError as e:
            closed = ClosedBeforeAnswer if p.untouched else ProtocolError
            raise closed(f"reading the response: {e}") from e
        if data:
            p.feed(data)
        else:
            p.eof()

    def _take(self) -> _Conn:
        """An idle connection still good, else a new one once fewer than the most are open."""
        with self._lock:
            while True:
                while self._idle:
                    conn = self._idle.pop()
                    if conn.usable():
                        return conn
                    conn.close()
                    self._open -= 1
                if self._open < self.max_connections:
                    self._open += 1
                    break
                self._waiting += 1
                self._freed.wait()
                self._waiting -= 1
        try:
            return self._connect()
        except BaseException:
            with self._lock:
                self._open -= 1
                if self._waiting:
                    self._freed.notify()
            raise

    def _give_back(self, conn: _Conn, keep: bool) -> None:
        """Back to the idle connections (``keep``), or closed; a waiting request is woken."""
        keep = keep and self.origin.persistent
        if keep:
            conn.idle_since = time.monotonic()
            conn.reused = True
        else:
            conn.close()
        with self._lock:
            if keep:
                self._idle.append(conn)
            else:
                self._open -= 1
            if self._waiting:
                self._freed.notify()

    def _connect(self) -> _Conn:
        o = self.origin
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                sock = socket.create_connection(
                    (o.connect_host, o.connect_port), timeout=self.connect_timeout
                )
                break
            except TimeoutError:
                raise ConnectTimeout(f"no connection within {self.connect_timeout}s") from None
            except OSError as e:
                if attempt == CONNECT_ATTEMPTS - 1:
                    raise ConnectError(str(e) or type(e).__name__) from e
                time.sleep(0.05 * 2**attempt)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if o.tunnel:
                sock.sendall(o.connect_request())
                p = Parser(no_body=True)
                conn = _Conn(sock)
                while not p.done:
                    self._recv_into(conn, p)
                _check_tunnel(p)
            if o.ssl_context is not None:
                sock = o.ssl_context.wrap_socket(sock, server_hostname=o.host)
            else:
                sock.settimeout(None)  # blocking: _Conn.set_timeout bounds it in the kernel
        except (OSError, TransportError) as e:
            sock.close()
            if isinstance(e, ssl.SSLError):
                raise ConnectError(f"TLS: {e}") from e
            if isinstance(e, TransportError):
                raise
            raise ConnectError(str(e)) from e
        return _Conn(sock)

    def close(self) -> None:
        """Close the idle connections; busy ones close when their request is done."""
        with self._lock:
            while self._idle:
                self._idle.pop().close()
                self._open -= 1


# ---------------------------------------------------------------------------- asyncio


class _Protocol(asyncio.Protocol):
    """One connection of an :class:`AsyncPool`: feeds what arrives to the current request's
    parser and wakes the request when its head, more body, or the end is in."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: Parser | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.error: TransportError | None = None
        #: Streams only: stop reading while this much of the body is not taken.
        self.high_water: int | None = None
        self.paused = False
        self.idle_since = 0.0
        #: It carried a request before (see :attr:`_Conn.reused`).
        self.reused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        p = self.parser
        if p is None:  # nothing asked for: the connection is not reusable
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            return
        try:
            p.feed(data)
        except ProtocolError as e:
            self._fail(e)
            return
        hw = self.high_water
        if hw is not None and p.body_bytes > hw and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        p = self.parser
        if p is not None and not p.done and self.error is None:  # keep the first error
            try:
                p.eof()
            except ProtocolError as e:
                self.error = e
        self._wake()

    def _fail(self, e: TransportError) -> None:
        self.error = e
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def timed_out(self) -> None:
        self._fail(ReadTimeout("no answer within the request's timeout"))

    async def wait(self, timeout: float) -> None:
        """Until something arrives (or the connection ends, or ``timeout`` passes)."""
        if self.error is not None:
            raise self.error
        if self.closed:
            return
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        timer = loop.call_later(timeout, self.timed_out)
        try:
            await self.waiter
        finally:
            timer.cancel()
            self.waiter = None
        if self.error is not None:
            raise self.error

    def usable(self) -> bool:
        """Open, not idle for longer than :data:`KEEPALIVE_S`, and quiet. The socket is
        looked at too: the loop may not have run since the server closed it."""
        return (
            self.reusable()
            and time.monotonic() - self.idle_since <= KEEPALIVE_S
            and (self.transport is None or _quiet(self.transport.get_extra_info("socket")))
        )

    def reusable(self) -> bool:
        """Open, without error: it may carry another request."""
        return not self.closed and self.error is None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class AsyncPool:
    """A pool of keep-alive connections to one origin for one event loop at a time (a
    client used from a new loop starts a new pool: connections cannot cross loops)."""

    def __init__(self, origin: Origin, max_connections: int, connect_timeout: float) -> None:
        self.origin = origin
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self._idle: collections.deque[_Protocol] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None

    def _slots_of_this_loop(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._slots is None:
            for proto in self._idle:
                if proto.transport is not None:
                    try:
                        proto.transport.abort()
                    except RuntimeError:  # its loop is closed: so is the socket, or will be
                        pass
            self._idle.clear()
            self._loop = loop
            self._slots = asyncio.Semaphore(self.max_connections)
        return self._slots

    async def request(self, req: Request) -> Response:
        """Send ``req`` and read the whole response."""
        slots = self._slots_of_this_loop()
        async with slots:
            while True:
                proto = await self._take()
                try:
                    p = await self._exchange(proto, req)
                    while not p.done:
                        await proto.wait(req.timeout)
                except ClosedBeforeAnswer:
                    proto.close()
                    if proto.reused and req.replayable:
                        continue  # each try takes a kept connection away: this ends
                    raise
                except BaseException:
                    proto.close()
                    raise
                self._put(proto, p)
                return p.response()

    async def stream(self, req: Request) -> tuple[Parser, AsyncGenerator[bytes, None]]:
        """Send ``req``; the parsed head, and the body as it comes (close the iterator, or
        run it to the end, to free the connection)."""
        slots = self._slots_of_this_loop()
        await slots.acquire()
        try:
            proto = await self._take()
            try:
                p = await self._exchange(proto, req, streaming=True)
            except BaseException:
                proto.close()
                raise
        except BaseException:
            slots.release()
            raise
        return p, self._body(proto, p, req.timeout, slots)

    async def _body(
        self, proto: _Protocol, p: Parser, timeout: float, slots: asyncio.Semaphore
    ) -> AsyncGenerator[bytes, None]:
        ok = False
        try:
            while True:
                if p.body:
                    yield p.take_body()
                if p.done:
                    ok = True
                    return
                await proto.wait(timeout)
        finally:
            if ok:
                self._put(proto, p)
            else:
                proto.close()
            slots.release()

    async def _exchange(self, proto: _Protocol, req: Request, streaming: bool = False) -> Parser:
        p = Parser()
        proto.parser = p
        proto.high_water = _STREAM_HIGH_WATER if streaming else None
        assert proto.transport is not None
        proto.transport.writelines(req.wire())
        while not p.has_head:
            if proto.closed and proto.error is None:
                raise ClosedBeforeAnswer("the server closed the connection before the response")
            await proto.wait(req.timeout)
        req.refused_upload(p)
        return p

    async def _take(self) -> _Protocol:
        while self._idle:
            proto = self._idle.pop()
            if proto.usable():
                return proto
            proto.close()
        return await self._connect()

    def _put(self, proto: _Protocol, p: Parser) -> None:
        proto.parser = None
        if not p.keep_alive or not proto.reusable() or not self.origin.persistent:
            proto.close()
            return
        proto.idle_since = time.monotonic()
        proto.reused = True
        self._idle.append(proto)

    async def _connect(self) -> _Protocol:
        o = self.origin
        loop = asyncio.get_running_loop()
        direct_tls = o.ssl_context if not o.tunnel else None
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                _, proto = await asyncio.wait_for(
                    loop.create_connection(
                        _Protocol,
                        o.connect_host,
                        o.connect_port,
                        ssl=direct_tls,
                        server_hostname=o.host if direct_tls is not None else None,
                    ),
                    self.connect_timeout,
                )
                break
            except TimeoutError:
                raise ConnectTimeout(f"no connection within {self.connect_timeout}s") from None
            except ssl.SSLError as e:
                raise ConnectError(f"TLS: {e}") from e
            except OSError as e:
                if attempt == CONNECT_ATTEMPTS - 1:
                    raise ConnectError(str(e) or type(e).__name__) from e
                await asyncio.sleep(0.05 * 2**attempt)
        if o.tunnel:
            try:
                proto = await self._tunnel(proto)
            except BaseException:
                proto.close()
                raise
        return proto

    async def _tunnel(self, proto: _Protocol) -> _Protocol:
        """CONNECT through the proxy, then TLS to the server over the tunnel."""
        o = self.origin
        assert proto.transport is not None and o.ssl_context is not None
        p = Parser(no_body=True)
        proto.parser = p
        proto.transport.write(o.connect_request())
        while not p.done:
            if proto.closed:
                raise ProtocolError("the proxy closed the connection")
            await proto.wait(self.connect_timeout)
        proto.parser = None
        _check_tunnel(p)
        loop = asyncio.get_running_loop()
        try:
            tls = await loop.start_tls(
                proto.transport, proto, o.ssl_context, server_hostname=o.host
            )
        except ssl.SSLError as e:
            raise ConnectError(f"TLS: {e}") from e
        assert isinstance(tls, asyncio.Transport)
        proto.transport = tls
        return proto

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
