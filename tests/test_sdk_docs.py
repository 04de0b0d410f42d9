"""docs/SDK.md stays in step with the code: every public SDK method, exported name, CLI
command, `dsec serve`, `dsec edge` and `dsec apiserver` option and HTTP route is named
there, and what it documents as built exists. No server needed (the CLI's own --help is
read)."""

from __future__ import annotations

import re
import subprocess

import dsec
import pytest
from dsec_testlib import DSEC_BIN, REPO

DOC = (REPO / "docs" / "SDK.md").read_text()
#: The part of the page that documents what is built.
BUILT = DOC.split("\n## Not built yet", 1)[0]
ROUTER = REPO / "crates" / "dsec-server" / "src" / "api.rs"


def public(cls: type) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_") and callable(getattr(cls, n))}


@pytest.mark.parametrize(("cls", "prefix"), [(dsec.Client, "client"), (dsec.Sandbox, "sb")])
def test_every_public_method_is_documented(cls: type, prefix: str) -> None:
    missing = {n for n in public(cls) if f"{prefix}.{n}(" not in BUILT}
    assert not missing, f"{cls.__name__} methods missing from docs/SDK.md: {sorted(missing)}"


@pytest.mark.parametrize(("cls", "prefix"), [(dsec.Client, "client"), (dsec.Sandbox, "sb")])
def test_every_documented_method_exists(cls: type, prefix: str) -> None:
    documented = set(re.findall(rf"\b{prefix}\.(\w+)\(", BUILT))
    assert documented - public(cls) == set()


def test_every_exported_name_is_documented() -> None:
    missing = [n for n in dsec.__all__ if n not in BUILT]
    assert not missing, f"dsec.{missing} missing from docs/SDK.md"


def _help(*args: str) -> str:
    if not DSEC_BIN.exists():
        pytest.fail(f"{DSEC_BIN} not built (cargo build -p dsec)")
    return subprocess.run(
        [str(DSEC_BIN), *args, "--help"], capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.parametrize("command", ["serve", "edge", "apiserver"])
def test_every_server_option_is_documented(command: str) -> None:
    options = set(re.findall(r"^\s+(?:-\w, )?(--[\w-]+)", _help(command), re.M)) - {"--help"}
    assert options
    missing = sorted(o for o in options if o not in BUILT)
    assert not missing, f"dsec {command} options missing from docs/SDK.md: {missing}"


def test_every_command_is_documented() -> None:
    section = _help().split("Commands:", 1)[1].split("Options:", 1)[0]
    commands = set(re.findall(r"^\s+(\w+)\s", section, re.M)) - {"help"}
    assert commands
    missing = sorted(c for c in commands if f"dsec {c}" not in BUILT)
    assert not missing, f"dsec commands missing from docs/SDK.md: {missing}"


def test_every_route_is_documented() -> None:
    text = ROUTER.read_text()
    route = r'\.route\("(/[^"]*)"'
    v1 = text.split("let v1", 1)[1].split(";", 1)[0]
    top = text.split('.nest("/v1", v1)', 1)[1].split(".with_state", 1)[0]
    routes = {"/v1" + r for r in re.findall(route, v1)} | set(re.findall(route, top))
    assert {"/v1/sandboxes/{id}/exec", "/healthz"} <= routes, routes
    documented = {r.replace("{*name}", "{name}") for r in routes}
    missing = sorted(r for r in documented if r not in BUILT)
    assert not missing, f"HTTP routes missing from docs/SDK.md: {missing}"
