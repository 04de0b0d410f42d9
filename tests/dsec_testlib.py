"""Helpers for the dsec test suite: start/stop real servers, inspect what a sandbox leaves
on the host. Nothing here mocks the server."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

try:
    import dsec
except ImportError:  # not pip-installed: use the package in the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
    import dsec

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
DSEC_BIN = Path(os.environ.get("DSEC_BIN") or REPO / "target" / "debug" / "dsec")
MAKE_ROOTFS = REPO / "scripts" / "make-busybox-rootfs.sh"
MAX_UPLOAD_MB = 8
BACKENDS = [
    b.strip()
    for b in os.environ.get("DSEC_TEST_BACKENDS", "container").split(",")
    if b.strip()
]
#: The Docker reference the docker backend's tests use: the busybox rootfs, `docker import`ed.
DOCKER_TEST_IMAGE = "dsec-test/busybox:latest"
#: Backends whose sandboxes keep state between commands (fncall runs each call fresh).
STATEFUL = {"container", "docker", "microvm", "vm"}
#: Backends whose sandboxes are QEMU guests.
VM_BACKENDS = {"microvm", "vm"}


def image_for(backend: str) -> str:
    """The image name a test sandbox of this backend uses."""
    if backend == "docker":
        return os.environ.get("DSEC_TEST_DOCKER_IMAGE", DOCKER_TEST_IMAGE)
    return "busybox"


def free_port() -> int:
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


# ------------------------------------------------------------------ temp dirs and mounts


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo
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
    rows = []
    try:
        text = Path(f"/proc/{pid}/mountinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) > 4:
            rows.append((_unescape(parts[4]), line))
    return rows


def mounts_under(path: Path | str, pid: int | str = "self") -> list[str]:
    p = os.path.realpath(path)
    return [m for m, _ in mountinfo(pid) if m == p or m.startswith(p + "/")]


def safe_rmtree(path: Path) -> None:
    """Remove a test temp dir, never through a mount a server left behind."""
    for m in sorted(mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True, check=False)
    left = mounts_under(path)
    if left:
        print(f"dsec tests: NOT removing {path}: still mounted: {left}")
        return
    shutil.rmtree(path, ignore_errors=True)


def make_tempdir(prefix: str) -> Path:
    base = os.environ.get("DSEC_TEST_TMPDIR") or None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


# ------------------------------------------------------------------ the server process


class Server:
    """One ``dsec serve`` process that this test suite started (and only ever signals by pid)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        log_path: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        token_file: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.state_dir = state_dir
        self.log_path = log_path
        self.host = host
        self.port = port or free_port()
        self.token_file = token_file
        self.extra_args = list(extra_args)
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
        argv = [
            str(DSEC_BIN),
            "serve",
            "--listen",
            f"{self.host}:{self.port}",
            "--state-dir",
            str(self.state_dir),
            "--max-upload-mb",
            str(MAX_UPLOAD_MB),
        ]
        if self.token_file is not None:
            argv += ["--token-file", str(self.token_file)]
        return argv + self.extra_args

    def spawn(self) -> subprocess.Popen[bytes]:
        if not DSEC_BIN.exists():
            pytest.fail(
                f"dsec server binary not found at {DSEC_BIN} (build it, or set DSEC_BIN)"
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
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
        log.close()
        return self.proc

    def start(self, timeout: float = 30.0) -> Server:
        self.spawn()
        self.wait_ready(timeout)
        self.cgroups = proc_cgroups(self.pid)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(
                    f"dsec serve exited with {self.proc.returncode} before it was ready:\n"
                    + self.log_tail()
                )
            try:
                r = httpx.get(self.url + "/healthz", timeout=1.0, trust_env=False)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.kill9()
        pytest.fail(f"dsec serve not ready after {timeout}s:\n" + self.log_tail())

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
            except BaseException as e:  # noqa: BLE001 - teardown: report, go on
                self.kill9()
                print(f"dsec tests: cleanup restart of {self.state_dir} failed: {e}")

    def restart(self, timeout: float = 30.0) -> Server:
        """Start again on the same port and state dir (after stop() or kill9())."""
        assert self.proc is None or self.proc.poll() is not None
        return self.start(timeout)

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

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


# ------------------------------------------------------------------ host inspection


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


def _find_dirs(root: str, needle: str, depth: int) -> Iterator[str]:
    try:
        it = list(os.scandir(root))
    except OSError:
        return
    for e in it:
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        if needle in e.name:
            yield e.path
        elif depth > 1:
            yield from _find_dirs(e.path, needle, depth - 1)


def cgroup_dirs(
    sandbox_id: str, server_cgroups: dict[str, str] | None = None
) -> list[str]:
    """Cgroup directories whose name contains the sandbox id: beneath the server's own cgroup
    in each hierarchy, and a few levels under each hierarchy's root."""
    found: set[str] = set()
    for mnt, key in cgroup_mounts():
        roots = {mnt}
        if server_cgroups is not None:
            for k, path in server_cgroups.items():
                if k == key or set(k.split(",")) == set(key.split(",")):
                    roots.add(os.path.join(mnt, path.lstrip("/")))
        for root in roots:
            found.update(_find_dirs(root, sandbox_id, 5))
    return sorted(found)


def procs_in(sandbox_id: str) -> list[tuple[int, str]]:
    """Processes whose /proc/PID/cgroup names the sandbox id: (pid, cmdline)."""
    out = []
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            cg = Path(e.path, "cgroup").read_text()
        except OSError:
            continue
        if sandbox_id in cg:
            out.append((int(e.name), _cmdline(e.path) or "?"))
    return out


def _cmdline(proc_dir: str) -> str | None:
    """A process's command line, arguments joined by spaces; None once it is gone."""
    try:
        raw = Path(proc_dir, "cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


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
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            st = _stat(int(e.name))
            if st is not None:
                children.setdefault(st[0], []).append(int(e.name))
                starts[int(e.name)] = st[1]
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
    return [
        p
        for p, start in procs.items()
        if (st := _stat(p)) is not None and st[1] == start
    ]


def leftovers(server: Server, sandbox_id: str) -> list[str]:
    """Everything on the host that still belongs to the sandbox."""
    out = []
    for m, line in mountinfo():
        if sandbox_id in line:
            out.append(f"mount {m}")
    if server.alive():
        for m, line in mountinfo(server.pid):
            if sandbox_id in line and f"mount {m}" not in out:
                out.append(f"mount (server namespace) {m}")
    d = server.state_dir / "sandboxes" / sandbox_id
    if os.path.lexists(d):
        out.append(f"directory {d}")
    out += [f"cgroup {c}" for c in cgroup_dirs(sandbox_id, server.cgroups or None)]
    out += [f"process {pid}: {cmd}" for pid, cmd in procs_in(sandbox_id)]
    vm_dir = server.state_dir / "vm" / "sandboxes" / sandbox_id
    if os.path.lexists(vm_dir):
        out.append(f"directory {vm_dir}")
    out += [f"qemu {pid}: {cmd[:120]}" for pid, cmd in qemu_procs(sandbox_id)]
    return out


def qemu_procs(sandbox_id: str) -> list[tuple[int, str]]:
    """QEMU processes of a VM sandbox (their command line names its directory)."""
    out = []
    needle = f"/vm/sandboxes/{sandbox_id}/"
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        cmd = _cmdline(e.path)
        if cmd is not None and cmd.startswith("qemu-system") and needle in cmd:
            out.append((int(e.name), cmd))
    return out


def assert_no_leftovers(server: Server, sandbox_id: str, timeout: float = 10.0) -> None:
    left = wait_until(lambda: not leftovers(server, sandbox_id), timeout)
    if not left:
        pytest.fail(
            f"sandbox {sandbox_id} left on the host: {leftovers(server, sandbox_id)}"
        )


# ------------------------------------------------------------------ features not there yet


@contextlib.contextmanager
def unless_unimplemented(feature: str) -> Iterator[None]:
    """Skip (not fail) when the server has no such route or says it cannot do it yet."""
    try:
        yield
    except dsec.Unavailable as e:
        pytest.skip(f"{feature}: server says unavailable: {e}")
    except dsec.NotFound as e:
        if e.kind is None or "route" in e.message:  # the router's 404: no such route
            pytest.skip(f"{feature}: no such route on the server yet")
        raise
    except dsec.DsecError as e:
        if e.status in (404, 405, 501):
            pytest.skip(f"{feature}: not implemented by the server ({e.status})")
        raise


def sh_lines(r: Any) -> list[str]:
    return [x for x in r.stdout.splitlines() if x.strip()]


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


def docker_import_rootfs(rootfs: Path, ref: str) -> None:
    """`docker import` a rootfs directory as image ``ref`` (no registry needed), replacing
    the image an earlier run imported under that name."""
    subprocess.run(["docker", "rmi", "-f", ref], capture_output=True)
    tar = subprocess.Popen(
        ["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE
    )
    r = subprocess.run(
        ["docker", "import", "-", ref], stdin=tar.stdout, capture_output=True, text=True
    )
    assert tar.stdout is not None
    tar.stdout.close()
    tar.wait()
    if r.returncode != 0:
        pytest.fail(f"docker import of {rootfs} as {ref} failed: {r.stderr}")


def docker_containers(*filters: str) -> list[str]:
    """Ids of all containers (running or not) matching every ``--filter``."""
    argv = ["docker", "ps", "-aq", "--no-trunc"]
    for f in filters:
        argv += ["--filter", f]
    r = subprocess.run(argv, capture_output=True, text=True, check=True)
    return r.stdout.split()
