"""``create_many``: many sandboxes alike in one request, each item made or refused on its own."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import dsec
import httpx
import pytest
from dsec_testlib import Server, metric, wait_until

MakeServer = Callable[..., Server]

#: The most sandboxes one batch may ask for (docs/API.md).
MAX_BATCH = 10_000


def test_create_many_makes_n_running_sandboxes(client: dsec.Client, busybox_image: str) -> None:
    tag = uuid.uuid4().hex[:12]
    sbs = client.create_many(5, image=busybox_image, labels={"t": tag}, env={"WHO": "batch"})
    try:
        assert len({sb.id for sb in sbs}) == 5
        for sb in sbs:
            info = sb.info()
            assert info.state == "running"
            assert info.labels == {"t": tag}
            # The id names its edge, and the info says which edge that is.
            assert info.edge and sb.id.startswith(info.edge + "-"), (info.edge, sb.id)
            assert sb.run("echo $WHO").stdout == "batch\n"
        assert sorted(s.id for s in client.list(labels={"t": tag})) == sorted(s.id for s in sbs)
    finally:
        for sb in sbs:
            sb.stop()


def test_create_many_async(server: Server, busybox_image: str) -> None:
    async def main() -> None:
        async with server.async_client() as ac:
            sbs = await ac.create_many(3, image=busybox_image)
            try:
                outs = await asyncio.gather(*(sb.run("echo hi") for sb in sbs))
                assert [r.stdout for r in outs] == ["hi\n"] * 3
            finally:
                await asyncio.gather(*(sb.stop() for sb in sbs))

    asyncio.run(main())


def test_create_many_bad_input(client: dsec.Client, busybox_image: str) -> None:
    for n in (0, MAX_BATCH + 1):
        with pytest.raises(dsec.InvalidArgument, match="count must be 1 to 10000"):
            client.create_many(n, image=busybox_image)
    with pytest.raises(TypeError, match="n must be an int"):
        client.create_many("3", image=busybox_image)  # type: ignore[arg-type]
    # An item error that every item shares is raised as itself, said once.
    with pytest.raises(dsec.NotFound, match="none of the 3 sandboxes could be made") as e:
        client.create_many(3, image="no-such-image-" + uuid.uuid4().hex[:6])
    assert "no-such-image" in e.value.message
    with pytest.raises(dsec.InvalidArgument):
        client.create_many(2, image=busybox_image, backend="nope")


def test_batch_http_form(server: Server, busybox_image: str) -> None:
    url = server.url + "/v1/sandboxes/batch"
    # Unknown and missing fields are 400s naming the field, before anything is made.
    r = httpx.post(url, json={"count": 1, "sandbox": {"image": busybox_image}, "x": 1})
    assert r.status_code == 400 and "unknown field `x`" in r.json()["error"]["message"]
    r = httpx.post(url, json={"count": 1})
    assert r.status_code == 400 and "sandbox" in r.json()["error"]["message"]
    # A keyed batch sent twice makes its sandboxes once.
    key = {"Idempotency-Key": uuid.uuid4().hex}
    body = {"count": 2, "sandbox": {"image": busybox_image}}
    first = httpx.post(url, json=body, headers=key, timeout=120)
    again = httpx.post(url, json=body, headers=key, timeout=120)
    assert first.status_code == again.status_code == 200, first.text
    ids = [item["sandbox"]["id"] for item in first.json()["items"]]
    assert [item["sandbox"]["id"] for item in again.json()["items"]] == ids
    assert len(set(ids)) == 2
    with server.client() as c:
        for sandbox_id in ids:
            c.get(sandbox_id).stop()


def test_a_partly_made_batch_hands_over_what_was_made(make_server: MakeServer) -> None:
    s = make_server(extra_args=["--memory-overcommit", "0.05", "--net-pool", "10.233.0.0/16"])
    budget = metric(s.url, "dsec_admission_budget", resource="memory_mb")
    each = int(budget / 2.5)
    with s.client() as c:
        with pytest.raises(dsec.BatchError) as e:
            c.create_many(4, image="busybox", memory_mb=each)
        err = e.value
        try:
            assert len(err.sandboxes) == 2, err.message
            # Items are made concurrently: which two were refused is not fixed.
            assert len(err.errors) == 2 and all(0 <= i < 4 for i in err.errors), err.errors
            for item_error in err.errors.values():
                assert isinstance(item_error, dsec.CapacityExceeded)
                assert "--memory-overcommit" in item_error.message
            assert "2 of 4 sandboxes could not be made" in err.message
            for sb in err.sandboxes:
                assert sb.run("echo ok").stdout == "ok\n"
        finally:
            for sb in err.sandboxes:
                sb.stop()
        # The refused items hold nothing, and the made ones gave their share back.
        assert wait_until(
            lambda: metric(s.url, "dsec_admission_promised", resource="memory_mb") == 0, 10
        )
