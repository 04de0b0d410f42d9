"""Images shared through an OCI registry (``--registry``): an import on one server is
pushed as its EROFS blobs; another server sharing the registry pulls on first use, once
for a whole batch, and stores byte-identical layers; through an apiserver an import goes
to one edge and the others pull. A real registry (Debian's docker-registry) on loopback."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import json
import re
import shutil
import subprocess
import tarfile
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dsec
import dsec_local
import httpx
import pytest
from dsec_fleet import REGISTRY_BIN, Apiserver, Edge, Etcd, OciRegistry, etcd_unavailable_reason
from dsec_testlib import DSEC_BIN, Server, make_tempdir, require, safe_rmtree
from test_project_images import admin_token
from test_projects import ADMIN, new_project

MakeServer = Callable[..., Server]


@pytest.fixture(scope="module")
def registry() -> Iterator[OciRegistry]:
    require("registry", None if shutil.which(REGISTRY_BIN) else f"no {REGISTRY_BIN}")
    d = make_tempdir("dsec-registry-")
    r = OciRegistry(d / "registry", log_path=d / "registry.log").start()
    yield r
    r.stop()
    safe_rmtree(d)


def blobs_of(server: dsec_local.Server) -> dict[str, str]:
    """The layer blobs in a server's store: file name to the sha256 of its bytes."""
    layers = server.state_dir / "images" / "layers" / "sha256"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in layers.glob("*.erofs")}


def push_manifest(
    registry: OciRegistry, repository: str, manifest: dict[str, Any], blobs: list[bytes]
) -> None:
    """Pushes `blobs` and then `manifest` (as `latest`) to `repository`."""
    base = f"http://{registry.host}/v2/{repository}"
    for blob in blobs:
        up = httpx.post(f"{base}/blobs/uploads/", trust_env=False)
        assert up.status_code == 202, up.text
        location = up.headers["location"]
        separator = "&" if "?" in location else "?"
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        put = httpx.put(f"{location}{separator}digest={digest}", content=blob, trust_env=False)
        assert put.status_code == 201, put.text
    r = httpx.put(
        f"{base}/manifests/latest",
        json=manifest,
        headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
        trust_env=False,
    )
    assert r.status_code == 201, r.text


def push_rootfs(registry: OciRegistry, repository: str, rootfs: Path) -> str:
    """Pushes `rootfs` as a plain one-layer OCI image; returns its reference."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        tar.add(rootfs, arcname=".")
    diff_id = "sha256:" + hashlib.sha256(layer.getvalue()).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
    ).encode()

    def descriptor(media_type: str, blob: bytes) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        return {"mediaType": media_type, "digest": digest, "size": len(blob)}

    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": descriptor("application/vnd.oci.image.config.v1+json", config),
        "layers": [descriptor("application/vnd.oci.image.layer.v1.tar", layer.getvalue())],
    }
    push_manifest(registry, repository, manifest, [config, layer.getvalue()])
    return f"{registry.host}/{repository}:latest"


class Recorder(http.server.BaseHTTPRequestHandler):
    """A loopback HTTP server's handler that answers by `self.server.answer(path)` and
    keeps every path asked in `self.server.asked`."""

    def do_GET(self) -> None:
        self.server.asked.append(self.path)  # type: ignore[attr-defined]
        status, headers = self.server.answer(self.path)  # type: ignore[attr-defined]
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def http_server(
    answer: Callable[[str], tuple[int, dict[str, str]]],
) -> Iterator[tuple[str, list[str]]]:
    """A loopback HTTP server answering by `answer`: its `host:port` and the paths asked."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    httpd.answer = answer  # type: ignore[attr-defined]
    httpd.asked = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}", httpd.asked  # type: ignore[attr-defined]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_project_imports_only_from_registries_it_may_reach(
    make_server: MakeServer, registry: OciRegistry, busybox_rootfs: Path, tmp_path: Path
) -> None:
    """A project names the registry and the server connects: without a check, an import
    would reach the server's loopback services, its private network and the cloud's
    metadata service. A project's pull connects only to public addresses (redirects and
    token services included) and to the registries the admin trusts (--import-registry);
    the admin's imports reach any registry. (Private and link-local addresses are refused
    alike, by the same check; crates/dsec-image/src/egress.rs tests their kinds, here no
    packet may leave loopback.)"""
    reference = push_rootfs(registry, f"t-{uuid.uuid4().hex[:8]}/tools", busybox_rootfs)
    with http_server(lambda _: (200, {})) as (target, stolen):
        # Registries that send their client on to `target`: by a redirect, or as their
        # token service.
        to_target = f"http://{target}/metadata"

        def redirects(path: str) -> tuple[int, dict[str, str]]:
            return (200, {}) if path == "/v2/" else (307, {"Location": to_target})

        def asks_a_token(_: str) -> tuple[int, dict[str, str]]:
            return 401, {"WWW-Authenticate": f'Bearer realm="{to_target}"'}

        with http_server(redirects) as (redirecting, _), http_server(asks_a_token) as (realm, _):
            trusting = [f"--import-registry={r}" for r in (redirecting, realm, "127.0.0.1:9")]
            s = make_server(token_file=admin_token(tmp_path), extra_args=trusting)
            with s.client(token=new_project(s, "reach")) as c:
                refused = {
                    reference: f"{registry.host} is 127.0.0.1, a loopback address",
                    f"localhost:{registry.port}/x:latest": "a loopback address",
                    f"{redirecting}/x:latest": f"{target} is 127.0.0.1, a loopback address",
                    f"{realm}/x:latest": f"{target} is 127.0.0.1, a loopback address",
                }
                for source, why in refused.items():
                    with pytest.raises(dsec.PermissionDenied, match=re.escape(why)) as e:
                        c.import_image(source, name="stolen")
                    assert "--import-registry" in str(e.value)
                assert not any(i.name == "reach/stolen" for i in c.images())
                # A trusted registry that does not answer is the registry's failure.
                with pytest.raises(
                    dsec.Unavailable, match=re.escape("cannot connect to 127.0.0.1:9")
                ):
                    c.import_image("127.0.0.1:9/x:latest", name="dead")
            with s.client(token=ADMIN) as admin:
                assert admin.import_image(reference, name="admins").name == "admins"
        assert stolen == []
    trusted = make_server(
        token_file=admin_token(tmp_path / "trusted"),
        extra_args=["--import-registry", registry.host],
    )
    with trusted.client(token=new_project(trusted, "trusted")) as c:
        assert c.import_image(reference, name="tools").name == "trusted/tools"
        with c.create(image="tools") as sb:
            assert sb.run("echo pulled").stdout == "pulled\n"


def pulls_logged(server: dsec_local.Server) -> int:
    return server.log_path.read_text().count("pulling image from the fleet's registry")


def test_an_import_is_pushed_and_another_server_pulls_it_once_on_first_use(
    make_server: MakeServer, registry: OciRegistry, busybox_rootfs: Path
) -> None:
    shared = ["--registry", f"{registry.host}/t-{uuid.uuid4().hex[:8]}"]
    a = make_server(import_busybox=False, extra_args=shared)
    b = make_server(import_busybox=False, extra_args=shared)
    with a.client() as ca, b.client() as cb:
        ca.import_image(str(busybox_rootfs), name="shared-img:v1")
        with pytest.raises(dsec.NotFound):
            cb.get_image("shared-img:v1")
        # A batch on the server that lacks it pulls it once, then makes every sandbox.
        sbs = cb.create_many(6, image="shared-img:v1")
        try:
            assert pulls_logged(b) == 1
            for sb in sbs:
                assert sb.run("echo pulled").stdout == "pulled\n"
        finally:
            for sb in sbs:
                sb.stop()
        assert cb.get_image("shared-img:v1").layers == ca.get_image("shared-img:v1").layers
        # The layers were stored as they came: the same blobs, byte for byte.
        assert blobs_of(b) == blobs_of(a) and blobs_of(a)
        # An image in neither the store nor the registry is a plain NotFound.
        with pytest.raises(dsec.NotFound, match="not-there"):
            cb.create(image="not-there")


def test_a_foreign_image_and_a_dead_registry_are_clear_errors(
    make_server: MakeServer, registry: OciRegistry
) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    # A plain OCI image (not pushed by dsec) under the name the server would pull.
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": "sha256:" + hashlib.sha256(b"{}").hexdigest(),
            "size": 2,
        },
        "layers": [],
    }
    push_manifest(registry, f"{prefix}/foreign", manifest, [b"{}"])
    s = make_server(import_busybox=False, extra_args=["--registry", f"{registry.host}/{prefix}"])
    with s.client() as c:
        with pytest.raises(dsec.Unavailable, match="not a dsec image"):
            c.create(image="foreign")
    dead = make_server(import_busybox=False, extra_args=["--registry", "127.0.0.1:9/x"])
    with dead.client() as c:
        with pytest.raises(dsec.Unavailable, match=re.escape("127.0.0.1:9")):
            c.create(image="anything")
    bad = subprocess.run(
        [str(DSEC_BIN), "serve", "--registry", "http://127.0.0.1:5000"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode != 0 and "without a scheme" in bad.stderr, bad.stderr


@pytest.mark.timeout(300)
def test_through_an_apiserver_one_edge_imports_and_the_others_pull(
    registry: OciRegistry, busybox_rootfs: Path
) -> None:
    require("etcd", etcd_unavailable_reason())
    d = make_tempdir("dsec-fleet-registry-")
    etcd = Etcd(d / "etcd", log_path=d / "etcd.log").start()
    shared = ["--registry", f"{registry.host}/fleet-{uuid.uuid4().hex[:8]}"]
    started: list[dsec_local.Server] = []
    try:
        edges = {}
        for name in ("r1", "r2"):
            e = Edge(
                d / name, etcd=etcd.url, name=name, extra_args=shared, log_path=d / f"{name}.log"
            )
            started.append(e)
            e.start()
            edges[name] = e
        api = Apiserver(d / "api", etcd=etcd.url, log_path=d / "api.log")
        started.append(api)
        api.start()
        api.wait_for_edges(list(edges))
        assert all(e["load"].get("registry") for e in api.edges())
        with api.client() as c:
            c.import_image(str(busybox_rootfs), name="fleet-img")
            # Only the first edge imported; the other has none of its layers yet.
            assert blobs_of(edges["r1"]) and not blobs_of(edges["r2"])
            sbs = c.create_many(10, image="fleet-img", memory_mb=64)
            try:
                spread = Counter(sb.info().edge for sb in sbs)
                assert set(spread) == {"r1", "r2"}, spread
                for sb in sbs:
                    assert sb.run("echo ok").stdout == "ok\n"
            finally:
                for sb in sbs:
                    sb.stop()
        assert blobs_of(edges["r2"]) == blobs_of(edges["r1"])
        assert pulls_logged(edges["r2"]) == 1 and pulls_logged(edges["r1"]) == 0
    finally:
        for s in reversed(started):
            s.cleanup()
        etcd.stop()
        safe_rmtree(d)
