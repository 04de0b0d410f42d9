"""deploy/: the Kubernetes manifests render, are valid Kubernetes objects, and pass dsec
only flags it accepts (no cluster runs here: they are not applied; see their README); the
Grafana dashboard queries only metrics dsec exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import dsec
import httpx
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from dsec_testlib import DSEC_BIN, REPO, Server

KUSTOMIZE_DIR = REPO / "deploy" / "kubernetes"
DASHBOARD = REPO / "deploy" / "grafana" / "dsec.json"
#: The Kubernetes version the objects are validated against.
KUBERNETES_VERSION = "1.30.0"


def render() -> list[dict[str, Any]]:
    """The objects of the kustomization, rendered as kustomize would: its resources, in the
    namespace it names, with its image replaced (only the features the file uses)."""
    kustomization = yaml.safe_load((KUSTOMIZE_DIR / "kustomization.yaml").read_text())
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization["images"]}
    objects: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((KUSTOMIZE_DIR / resource).read_text()):
            if doc is None:
                continue
            if doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = kustomization["namespace"]
            for c in containers(doc):
                c["image"] = images.get(c["image"], c["image"])
            objects.append(doc)
    return objects


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return list(spec.get("containers", []))


def dsec_containers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The dsec containers by their role (``apiserver``, ``edge``)."""
    out = {}
    for obj in objects:
        for c in containers(obj):
            if c["image"].rsplit(":", 1)[0].endswith("/dsec"):
                out[c["args"][0]] = c
    return out


def accepted_flags(role: str) -> set[str]:
    """The long options ``dsec ROLE`` accepts, aliases included, from its --help."""
    text = subprocess.run(
        [str(DSEC_BIN), role, "--help"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    flags = set(re.findall(r"^\s+(?:-\w, )?(--[\w-]+)", text, re.MULTILINE))
    for aliases in re.findall(r"\[alias(?:es)?: ([^\]]+)\]", text):
        flags |= {a.strip() for a in aliases.split(",")}
    return flags


def test_every_object_is_valid_kubernetes() -> None:
    objects = render()
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
    assert {"DaemonSet/dsec-edge", "Deployment/dsec-apiserver"} <= set(kinds), kinds
    for obj in objects:
        # Strict: an unknown or misplaced field (a typo) fails too.
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_a_typo_is_caught_by_the_validation() -> None:
    edge = next(o for o in render() if o["kind"] == "DaemonSet")
    edge["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {"privileged": True}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(edge, KUBERNETES_VERSION, strict=True)


def test_the_manifests_pass_only_flags_dsec_accepts() -> None:
    roles = dsec_containers(render())
    assert set(roles) == {"apiserver", "edge"}, roles
    for role, container in roles.items():
        accepted = accepted_flags(role)
        assert "--etcd" in accepted, accepted
        passed = {a.split("=", 1)[0] for a in container["args"][1:]}
        assert passed, container["args"]
        assert passed <= accepted, f"dsec {role} does not accept {sorted(passed - accepted)}"
        env = {e["name"] for e in container.get("env", [])}
        for used in re.findall(r"\$\((\w+)\)", " ".join(container["args"])):
            assert used in env, f"dsec {role}: $({used}) is not set in env"
    edge = roles["edge"]
    assert edge["securityContext"] == {"privileged": True}
    assert "--advertise=http://$(POD_IP):7700" in edge["args"]
    # Both roles read their token files from the mounted secret.
    for role, container in roles.items():
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        for arg in container["args"]:
            if arg.startswith(("--token-file=", "--edge-token-file=")):
                path = Path(arg.split("=", 1)[1])
                assert str(path.parent) in mounts, (role, arg, mounts)


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    """The dsec metrics the dashboard's queries name (a histogram's series by its name)."""
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\b(dsec_[a-z_]+)\s*\{", target["expr"]):
                names.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return names


def test_the_grafana_dashboard_queries_only_metrics_dsec_exports(
    server: Server, client: dsec.Client, busybox_image: str
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    # Importable as is: the data source is asked for at import, every query uses it.
    assert [i["pluginId"] for i in dashboard["__inputs"]] == ["prometheus"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
    names = dashboard_metrics(dashboard)
    # Every metric it names is one dsec's code registers...
    source = "\n".join(p.read_text() for p in (REPO / "crates").rglob("*.rs"))
    registered = set(re.findall(r'(?:counter|gauge|histogram)!\(\s*"(dsec_[a-z_]+)"', source))
    assert names <= registered, f"not metrics of dsec: {sorted(names - registered)}"
    # ...and the core ones are on a live server's /metrics once it made a sandbox.
    with client.create(image=busybox_image) as sb:
        assert sb.run("true").exit_code == 0
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in (
        "dsec_sandboxes",
        "dsec_sandboxes_created_total",
        "dsec_create_seconds",
        "dsec_exec_seconds",
        "dsec_admission_promised",
        "dsec_admission_budget",
    ):
        assert name in names, f"the dashboard does not show {name}"
        assert re.search(rf"^{name}(_bucket)?\{{", text, re.MULTILINE), f"{name} not exported"
