"""dsec on this host: start and stop real ``dsec serve`` processes, build the busybox test
image, and find what a sandbox leaves on the host (mounts, cgroups, processes, QEMUs).

Shared by the test suite (``tests/dsec_testlib.py`` adds the pytest glue), the benchmarks
(``bench/``) and the demo (``demo/``). It depends on the SDK, httpx and the standard
library only, so that bench and demo run without pytest. Each of them puts this checkout's
``python/`` (the SDK) and ``tools/`` first on ``sys.path``, so what runs is the checkout's
SDK. Nothing here mocks anything: every helper starts or reads the real thing, and every
process it signals is one it started, by pid.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import dsec
import httpx

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
#: The server binary tests start: $DSEC_BIN, else the debug build of this checkout.
DSEC_BIN = Path(os.environ.get("DSEC_BIN") or REPO / "target" / "debug" / "dsec")
RELEASE_BIN = REPO / "target" / "release" / "dsec"
MAKE_BUSYBOX_ROOTFS = REPO / "scripts" / "make-busybox-rootfs.sh"

__all__ = [
    "DSEC_BIN",
    "MAKE_BUSYBOX_ROOTFS",
    "RELEASE_BIN",
    "REPO",
    "Server",
    "ServerError",
    "answers",
    "cgroup_dirs",
    "cgroup_mounts",
    "cmdline",
    "descendants",
    "docker_containers",
    "docker_import_rootfs",
    "docker_rmi",
    "docker_unavailable_reason",
    "free_port",
    "leftovers",
    "leftovers_of",
    "make_busybox_rootfs",
    "make_tempdir",
    "mountinfo",
    "mounts_under",
    "percentile",
    "pids_whose_cmdline",
    "proc_cgroups",
    "proc_status_kib",
    "procs_in",
    "qemu_procs",
    "raise_open_file_limit",
    "safe_rmtree",
    "still_running",
    "wait_until",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Callable[[], T], timeout: float, interval: float = 0.1) -> T:
    """Poll ``pred`` until it returns something truthy; return its last value either way."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, interpolated between ranks; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric ``name`` at ``{url}/metrics`` whose labels include
    ``labels`` (no labels: every sample)."""
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def raise_open_file_limit() -> None:
    """Soft open-file limit up to the hard one: a client holds a connection per request
    in flight, thousands of them at once in the benchmarks and the demo."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


# ------------------------------------------------------------------ mounts and temp dirs


def _unescape(field: str) -> str:
    """Undo /proc/<pid>/mountinfo's octal escapes (``\\040`` for space, tab, newline, ``\\``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mountinfo(pid: int | str = "self") -> list[tuple[str, str]]:
    """(mount point, whole line) for every mount in the mount namespace of ``pid``."""
    try:
        text = Path(f"/proc/{pid}/mountinfo").read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) > 4:
            rows.append((_unescape(parts[4]), line))
    return rows


def mounts_under(path: Path | str, pid: int | str = "self") -> list[str]:
    """Mount points at or below ``path``, deepest first."""
    p = os.path.realpath(path)
    found = [m for m, _ in mountinfo(pid) if m == p or m.startswith(p + "/")]
    return sorted(found, key=len, reverse=True)


def safe_rmtree(path: Path) -> None:
    """Remove a temporary directory, never through a mount a server left behind."""
    if not os.path.lexists(path):
        return
    for m in mounts_under(path):
        subprocess.run(["umount", "-l", m], capture_output=True, check=False)
    left = mounts_under(path)
    if left:
        print(f"dsec_local: NOT removing {path}: still mounted: {left}", file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)


def make_tempdir(prefix: str, base: str | None = None) -> Path:
    """A new directory under ``base`` (default: the system's temporary directory)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base or None))


# ------------------------------------------------------------------ images


def make_busybox_rootfs(dest: Path) -> Path:
    """Build the busybox root filesystem the tests and benchmarks use, at ``dest``."""
    r = subprocess.run(
        [str(MAKE_BUSYBOX_ROOTFS), str(dest)], check=False, capture_output=True, text=True
    )
    if r.returncode != 0:
        raise RuntimeError(f"{MAKE_BUSYBOX_ROOTFS.name} {dest} failed: {r.stderr.strip()}")
    return dest


# ------------------------------------------------------------------ the server process


class ServerError(RuntimeError):
    """A ``dsec serve`` could not be started, or exited before it was ready."""


def answers(url: str, timeout: float = 1.0) -> bool:
    """True when ``GET {url}/healthz`` answers 200."""
    try:
        r = httpx.get(url + "/healthz", timeout=timeout, trust_env=False)
    except httpx.TransportError:
        return False
    return r.status_code == 200


class Server:
    """One ``dsec serve`` process started here (and only ever signalled by its pid).

    Started in a session of its own, so that a Ctrl-C of the caller does not reach it
    before the caller stopped it (and it removed its sandboxes).
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        log_path: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        token_file: Path | None = None,
        extra_args: Sequence[str] = (),
        binary: Path | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.log_path = log_path
        self.host = host
        self.port = port or free_port()
        self.token_file = token_file
        self.extra_args = list(extra_args)
        self.binary = binary or DSEC_BIN
        self.proc: subprocess.Popen[bytes] | None = None
        self.cgroups: dict[str, str] = {}
        #: Killed without a chance to clean up: `cleanup()` restarts it once to do so.
        self.dirty = False

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host == "0.0.0.0" else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def argv(self) -> list[str]:
        argv = [str(self.binary), "serve", "--listen", f"{self.host}:{self.port}"]
        argv += ["--state-dir", str(self.state_dir)]
        if self.token_file is not None:
            argv += ["--token-file", str(self.token_file)]
        return argv + self.extra_args

    def spawn(self) -> subprocess.Popen[bytes]:
        if not self.binary.exists():
            raise ServerError(
                f"dsec server binary not found at {self.binary} (build it, or set DSEC_BIN)"
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            log.write(f"\n==== {' '.join(self.argv())}\n".encode())
            log.flush()
            env = dict(os.environ)
            env.setdefault("RUST_BACKTRACE", "1")
            self.proc = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return self.proc

    def start(self, timeout: float = 30.0) -> Server:
        self.spawn()
        self.wait_ready(timeout)
        self.cgroups = proc_cgroups(self.pid)
        return self

    def wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"dsec serve exited with {self.proc.returncode} before it was ready:\n"
                    + self.log_tail()
                )
            if answers(self.url):
                return
            time.sleep(0.05)
        self.kill9()
        raise ServerError(f"dsec serve not ready after {timeout}s:\n" + self.log_tail())

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait; asserts the process exited (SIGKILLs it first if it did not)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                self.dirty = True
                raise AssertionError(
                    f"dsec serve (pid {self.proc.pid}) ignored SIGTERM for {timeout}s"
                ) from None
        assert self.proc.poll() is not None, "dsec serve did not exit"
        return self.proc.returncode

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.dirty = True

    def cleanup(self) -> None:
        """Stop the server; if it was ever killed, start it once more on the same state dir
        so that it removes what the killed one left, then stop it again."""
        if self.alive():
            try:
                self.stop()
            except AssertionError:
                pass
        if self.dirty and self.state_dir.exists():
            self.dirty = False
            try:
                self.spawn()
                self.wait_ready(30)
                self.stop()
            except BaseException as e:  # teardown: report, go on
                self.kill9()
                print(f"dsec_local: cleanup restart of {self.state_dir} failed: {e}")

    def restart(self, timeout: float = 30.0) -> Server:
        """Start again on the same port and state dir (after stop() or kill9())."""
        assert self.proc is None or self.proc.poll() is not None
        return self.start(timeout)

    def kill_leftover_qemus(self) -> list[int]:
        """SIGKILL QEMUs that outlived this (stopped) server: their command lines name its
        state directory, so they are its VM sandboxes. Returns their pids."""
        assert not self.alive()
        pids = pids_whose_cmdline(lambda c: f"{self.state_dir}/vm/" in c)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return pids

    def rss_kib(self) -> int:
        rss = proc_status_kib(self.pid, "VmRSS")
        if rss is None:
            raise AssertionError(f"no VmRSS for dsec serve (pid {self.pid})")
        return rss

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def client(self, token: str | None = None) -> dsec.Client:
        return dsec.Client(self.url, token=token or "")

    def async_client(self, token: str | None = None) -> dsec.AsyncClient:
        return dsec.AsyncClient(self.url, token=token or "")


# ------------------------------------------------------------------ processes


def cmdline(pid: int | str) -> str | None:
    """A process's command line, arguments joined by spaces; None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _pids() -> Iterator[int]:
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            yield int(e.name)


def pids_whose_cmdline(match: Callable[[str], bool]) -> list[int]:
    """Processes (this one excepted) whose command line ``match`` accepts."""
    me = os.getpid()
    return [pid for pid in _pids() if pid != me and (c := cmdline(pid)) is not None and match(c)]


def proc_status_kib(pid: int, field: str) -> int | None:
    """A ``kB`` field of /proc/<pid>/status (VmRSS, RssAnon, ...); None if not there."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return None


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """pid -> start time of every process below ``pid``."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for p in _pids():
        st = _stat(p)
        if st is not None:
            children.setdefault(st[0], []).append(p)
            starts[p] = st[1]
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out[c] = starts[c]
                todo.append(c)
    return out


def still_running(procs: dict[int, int]) -> list[int]:
    """The processes of ``procs`` (pid -> start time) that still exist."""
    return [p for p, start in procs.items() if (st := _stat(p)) is not None and st[1] == start]


def qemu_procs(sandbox_id: str) -> list[tuple[int, str]]:
    """QEMU processes of a VM sandbox (their command line names its directory)."""
    needle = f"/vm/sandboxes/{sandbox_id}/"
    out = []
    for pid in _pids():
        c = cmdline(pid)
        if c is not None and c.startswith("qemu-system") and needle in c:
            out.append((pid, c))
    return out


# ------------------------------------------------------------------ cgroups


def proc_cgroups(pid: int | str) -> dict[str, str]:
    """controller list -> cgroup path, from /proc/PID/cgroup."""
    out: dict[str, str] = {}
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out[parts[1]] = parts[2]
    return out


_CONTROLLERS = {
    "cpu",
    "cpuacct",
    "cpuset",
    "memory",
    "devices",
    "freezer",
    "net_cls",
    "blkio",
    "perf_event",
    "net_prio",
    "hugetlb",
    "pids",
    "rdma",
    "misc",
}


def cgroup_mounts() -> list[tuple[str, str]]:
    """(mount point, controllers key as in /proc/PID/cgroup) for each cgroup hierarchy."""
    out = []
    for m, line in mountinfo():
        post = line.split(" - ", 1)[1].split() if " - " in line else []
        if not post:
            continue
        if post[0] == "cgroup2":
            out.append((m, ""))
        elif post[0] == "cgroup":
            opts = post[2].split(",") if len(post) > 2 else []
            ctrls = [o for o in opts if o in _CONTROLLERS or o.startswith("name=")]
            out.append((m, ",".join(ctrls)))
    return out


def _find_dirs(root: str, match: Callable[[str], bool], depth: int) -> Iterator[str]:
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for e in entries:
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        if match(e.name):
            yield e.path
        elif depth > 1:
            yield from _find_dirs(e.path, match, depth - 1)


def _cgroup_dirs_matching(
    match: Callable[[str], bool], server_cgroups: dict[str, str] | None
) -> list[str]:
    found: set[str] = set()
    for mnt, key in cgroup_mounts():
        roots = {mnt}
        if server_cgroups is not None:
            for k, path in server_cgroups.items():
                if k == key or set(k.split(",")) == set(key.split(",")):
                    roots.add(os.path.join(mnt, path.lstrip("/")))
        for root in roots:
            found.update(_find_dirs(root, match, 5))
    return sorted(found)


def cgroup_dirs(sandbox_id: str, server_cgroups: dict[str, str] | None = None) -> list[str]:
    """Cgroup directories whose name contains the sandbox id: beneath the server's own cgroup
    in each hierarchy, and a few levels under each hierarchy's root."""
    return _cgroup_dirs_matching(lambda name: sandbox_id in name, server_cgroups)


def procs_in(sandbox_id: str) -> list[tuple[int, str]]:
    """Processes whose /proc/PID/cgroup names the sandbox id: (pid, cmdline)."""
    out = []
    for pid in _pids():
        try:
            cg = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            continue
        if sandbox_id in cg:
            out.append((pid, cmdline(pid) or "?"))
    return out


def leftovers(server: Server, sandbox_id: str) -> list[str]:
    """Everything on the host that still belongs to the sandbox."""
    return leftovers_of(server, [sandbox_id]).get(sandbox_id, [])


def leftovers_of(server: Server, sandbox_ids: Iterable[str]) -> dict[str, list[str]]:
    """What each of the sandboxes still has on the host (those with nothing are left out),
    in one pass over the mounts, cgroups and processes however many they are."""
    ids = set(sandbox_ids)
    out: dict[str, list[str]] = {}

    def note(text: str, what: str) -> None:
        for sid in ids:
            if sid in text and what not in out.get(sid, []):
                out.setdefault(sid, []).append(what)

    for m, line in mountinfo():
        note(line, f"mount {m}")
    if server.alive():
        for m, line in mountinfo(server.pid):
            if not any(f"mount {m}" in found for found in out.values()):
                note(line, f"mount (server namespace) {m}")
    for sid in ids:
        for d in (
            server.state_dir / "sandboxes" / sid,
            server.state_dir / "vm" / "sandboxes" / sid,
        ):
            if os.path.lexists(d):
                note(sid, f"directory {d}")

    def named(name: str) -> bool:
        return any(sid in name for sid in ids)

    for c in _cgroup_dirs_matching(named, server.cgroups or None):
        note(os.path.basename(c), f"cgroup {c}")
    for pid in _pids():
        try:
            cg = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            continue
        if any(sid in cg for sid in ids):
            note(cg, f"process {pid}: {cmdline(pid) or '?'}")
        cmd = cmdline(pid)
        if cmd is not None and cmd.startswith("qemu-system"):
            for sid in ids:
                if f"/vm/sandboxes/{sid}/" in cmd:
                    note(sid, f"qemu {pid}: {cmd[:120]}")
    return out


# ------------------------------------------------------------------ docker


def docker_unavailable_reason() -> str | None:
    """None when a Docker daemon answers `docker info`, else why not."""
    if shutil.which("docker") is None:
        return "no docker CLI on this host"
    try:
        r = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    if r.returncode != 0:
        return f"no Docker daemon: {r.stderr.strip()[:200]}"
    return None


def docker_rmi(ref: str) -> None:
    """Remove Docker image ``ref`` if there is one."""
    subprocess.run(["docker", "rmi", "-f", ref], capture_output=True, check=False)


def docker_import_rootfs(rootfs: Path, ref: str) -> None:
    """`docker import` a rootfs directory as image ``ref`` (no registry needed), replacing
    the image an earlier run imported under that name."""
    docker_rmi(ref)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    r = subprocess.run(
        ["docker", "import", "-", ref],
        stdin=tar.stdout,
        capture_output=True,
        text=True,
        check=False,
    )
    assert tar.stdout is not None
    tar.stdout.close()
    tar.wait()
    if r.returncode != 0:
        raise RuntimeError(f"docker import of {rootfs} as {ref} failed: {r.stderr}")


def docker_containers(*filters: str) -> list[str]:
    """Ids of all containers (running or not) matching every ``--filter``."""
    argv = ["docker", "ps", "-aq", "--no-trunc"]
    for f in filters:
        argv += ["--filter", f]
    r = subprocess.run(argv, capture_output=True, text=True, check=True)
    return r.stdout.split()
