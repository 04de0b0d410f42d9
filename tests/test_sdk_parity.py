"""`dsec.AsyncClient` is `dsec.Client` as coroutines, and `dsec.AsyncSandbox` is
`dsec.Sandbox`: every public method of one exists on the other, with the same parameters
(names, kinds, defaults, annotations). No server needed."""

from __future__ import annotations

import inspect
from typing import Any

import dsec
import pytest

PAIRS = [
    (dsec.Client, dsec.AsyncClient),
    (dsec.Sandbox, dsec.AsyncSandbox),
    (dsec.Process, dsec.AsyncProcess),
]
#: Methods that are not coroutines on the async side, and what they are instead.
NOT_COROUTINES = {
    # Returns a PendingSandbox: awaitable, and an async context manager.
    (dsec.AsyncClient, "create"),
}


def public_methods(cls: type) -> dict[str, Any]:
    return {
        name: fn
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def params(fn: Any) -> list[tuple[str, Any, Any, Any]]:
    return [
        (p.name, p.kind, p.default, p.annotation) for p in inspect.signature(fn).parameters.values()
    ]


@pytest.mark.parametrize(("sync", "aio"), PAIRS, ids=lambda c: c.__name__)
def test_same_public_methods(sync: type, aio: type) -> None:
    assert sorted(public_methods(sync)) == sorted(public_methods(aio))


@pytest.mark.parametrize(("sync", "aio"), PAIRS, ids=lambda c: c.__name__)
def test_same_parameters(sync: type, aio: type) -> None:
    a = public_methods(aio)
    differ = {
        name: (params(fn), params(a[name]))
        for name, fn in public_methods(sync).items()
        if name in a and params(fn) != params(a[name])
    }
    assert not differ, differ


@pytest.mark.parametrize(("sync", "aio"), PAIRS, ids=lambda c: c.__name__)
def test_async_methods_are_coroutines(sync: type, aio: type) -> None:
    for name, fn in public_methods(aio).items():
        if (aio, name) in NOT_COROUTINES:
            continue
        if inspect.isgeneratorfunction(getattr(sync, name)):  # stream(): an async iterator
            assert inspect.isasyncgenfunction(fn), name
        else:
            assert inspect.iscoroutinefunction(fn), name


def test_both_are_context_managers() -> None:
    for sync, aio in PAIRS[:2]:  # clients and sandboxes; a process is not closed
        assert hasattr(sync, "__enter__") and hasattr(sync, "__exit__")
        assert hasattr(aio, "__aenter__") and hasattr(aio, "__aexit__")
    assert hasattr(dsec.PendingSandbox, "__aenter__") and hasattr(dsec.PendingSandbox, "__await__")


def test_constructors_match() -> None:
    assert params(dsec.Client.__init__)[:3] == params(dsec.AsyncClient.__init__)[:3]
    sync_kw = {p[0] for p in params(dsec.Client.__init__)}
    aio_kw = {p[0] for p in params(dsec.AsyncClient.__init__)}
    assert sync_kw == aio_kw
