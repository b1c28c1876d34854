"""S3-specific behaviour of storage.blobs.s3store against real servers started by the tests."""

from __future__ import annotations

import asyncio
import filecmp
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from storage.blobs.retry import RetryPolicy
from storage.blobs.s3client import make_s3_client
from storage.blobs.s3store import S3Store
from storage.errors import StoreUnavailable, WriteConflict
from storage.ids import SlotRef
from storage.slotfile.reader import verify_slot_file, whole_file_crc32

MiB = 1 << 20


@pytest.fixture
async def client(s3_endpoint: str) -> AsyncIterator[Any]:
    c = make_s3_client(endpoint_url=s3_endpoint, access_key="test", secret_key="test")
    yield c
    c.close()


class InFlight:
    """Counts concurrent calls of one S3 operation through botocore's event hooks."""

    def __init__(self, client: Any, op: str) -> None:
        self.now = self.peak = self.calls = 0
        self._lock = threading.Lock()
        client.meta.events.register(f"before-call.s3.{op}", self._before)
        client.meta.events.register(f"after-call.s3.{op}", self._after)

    def _before(self, **_: Any) -> None:
        with self._lock:
            self.now += 1
            self.calls += 1
            self.peak = max(self.peak, self.now)

    def _after(self, **_: Any) -> None:
        with self._lock:
            self.now -= 1


@pytest.mark.slow
async def test_64mib_round_trip_parallel_parts(
    client: Any, tmp_path: Path, slot_writer: Any, key_prefix: str
) -> None:
    src = slot_writer.write(tmp_path / "big.slot", slot_writer.Spec(state_size=64 * MiB))
    uploads, downloads = InFlight(client, "UploadPart"), InFlight(client, "GetObject")
    ref = SlotRef("acme", "big", 1)
    async with S3Store(client, "slots", prefix=key_prefix, part_size=8 * MiB, concurrency=4) as store:
        with capture_logs() as logs:
            meta = await store.put_file(ref, src, model="ab" * 32, n_tokens=6, crc32=whole_file_crc32(src))
            await store.get_to_file(ref, tmp_path / "back.slot")
    assert meta.size == src.stat().st_size > 64 * MiB
    assert filecmp.cmp(src, tmp_path / "back.slot", shallow=False)
    verify_slot_file(tmp_path / "back.slot")
    upload = next(e for e in logs if e["event"] == "storage.upload")
    assert upload["parts"] == 9 and upload["native_conditional"] is True
    assert uploads.calls == 9 + 1 and downloads.calls == 9  # + the conditional-write probe's part
    assert uploads.peak > 1 and downloads.peak > 1  # parts really moved in parallel


async def test_conditional_write_probe(client: Any, key_prefix: str) -> None:
    store = S3Store(client, "slots", prefix=key_prefix)
    with capture_logs() as logs:
        assert await store.native_conditional_writes() is True
    assert [e["native"] for e in logs if e["event"] == "storage.conditional_writes"] == [True]
    assert [o async for o in store._list_pages(f"{key_prefix}/")] == []  # the probe cleaned up
    await store.aclose()


async def test_emulated_conditional_writes(
    client: Any, tmp_path: Path, slot_writer: Any, key_prefix: str
) -> None:
    src = slot_writer.write(tmp_path / "a.slot", slot_writer.Spec(state_size=6 * MiB))
    async with S3Store(client, "slots", prefix=key_prefix, conditional_writes="emulated") as store:
        ref = SlotRef("acme", "s", 1)
        meta = await store.put_file(ref, src, model="m", n_tokens=1)
        with pytest.raises(WriteConflict):
            await store.put_file(ref, src, model="m", n_tokens=1)
        assert (await store.head(ref)).writer == meta.writer


async def test_endpoint_killed_mid_upload(restartable_moto: Any, tmp_path: Path, slot_writer: Any) -> None:
    """The server dies after two parts and comes back (empty) a second later: nothing is lost."""
    src = slot_writer.write(tmp_path / "a.slot", slot_writer.Spec(state_size=24 * MiB))
    before = src.read_bytes()
    client = make_s3_client(
        endpoint_url=restartable_moto.endpoint,
        access_key="t",
        secret_key="t",
        read_timeout_s=5,
        connect_timeout_s=1,
    )
    parts = []

    def revive() -> None:
        time.sleep(1.0)
        restartable_moto.start()

    def after_part(**_: Any) -> None:
        parts.append(1)
        if len(parts) == 2:
            restartable_moto.kill()
            threading.Thread(target=revive, daemon=True).start()

    client.meta.events.register("after-call.s3.UploadPart", after_part)
    retry = RetryPolicy(attempts=12, base_s=0.1, max_s=1.0)
    ref = SlotRef("acme", "s", 1)
    async with S3Store(client, "slots", prefix="p", part_size=5 * MiB, concurrency=2, retry=retry) as store:
        with capture_logs() as logs:
            meta = await store.put_file(ref, src, model="m", n_tokens=6, crc32=whole_file_crc32(src))
        events = [e["event"] for e in logs]
        assert "storage.retry" in events and "storage.upload_restarted" in events
        assert src.read_bytes() == before  # the local file is untouched
        await store.get_to_file(ref, tmp_path / "back.slot")
    assert (tmp_path / "back.slot").read_bytes() == before and meta.size == len(before)
    client.close()


async def test_outage_longer_than_retries(restartable_moto: Any, tmp_path: Path, slot_writer: Any) -> None:
    src = slot_writer.write(tmp_path / "a.slot", slot_writer.Spec())
    client = make_s3_client(
        endpoint_url=restartable_moto.endpoint, access_key="t", secret_key="t", connect_timeout_s=1
    )
    restartable_moto.kill()
    retry = RetryPolicy(attempts=3, base_s=0.05, max_s=0.1)
    async with S3Store(client, "slots", prefix="p", retry=retry, conditional_writes="native") as store:
        with capture_logs() as logs, pytest.raises(StoreUnavailable):
            await store.put_file(SlotRef("acme", "s", 1), src, model="m", n_tokens=1)
        assert [e["attempt"] for e in logs if e["event"] == "storage.retry"] == [1, 2]
        assert src.exists()
        restartable_moto.start()
        await store.put_file(SlotRef("acme", "s", 1), src, model="m", n_tokens=1)
    client.close()


async def test_many_small_parts_cancel_cleanly(
    client: Any, tmp_path: Path, slot_writer: Any, key_prefix: str
) -> None:
    """A failing part cancels the others and the upload is aborted; no object becomes visible."""
    src = slot_writer.write(tmp_path / "a.slot", slot_writer.Spec(state_size=16 * MiB))
    calls = []

    def fail_third(**kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise PermissionError("simulated local read failure")

    client.meta.events.register("before-call.s3.UploadPart", fail_third)
    async with S3Store(client, "slots", prefix=key_prefix, part_size=5 * MiB, concurrency=2) as store:
        with pytest.raises(PermissionError):
            await store.put_file(SlotRef("acme", "s", 1), src, model="m", n_tokens=1)
        assert [i async for i in store.list("acme")] == []
        await asyncio.sleep(0)


class _BodyBreaksOnce:
    """A client whose first get_object answer breaks off while its body is read."""

    def __init__(self, client: Any) -> None:
        self._client, self.broken = client, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_object(self, **kw: Any) -> Any:
        from botocore.exceptions import IncompleteReadError

        resp = self._client.get_object(**kw)
        if not self.broken:
            self.broken += 1
            resp["Body"].close()

            class Broken:
                def read(self) -> bytes:
                    raise IncompleteReadError(actual_bytes=1, expected_bytes=2)

                def close(self) -> None:
                    pass

            resp["Body"] = Broken()
        return resp


async def test_a_body_that_breaks_off_is_fetched_again(client: Any, key_prefix: str) -> None:
    """A raw object's request and body are one retried step: a read that breaks off mid-body is
    retried like a failed request, and the bytes come back whole."""
    flaky = _BodyBreaksOnce(client)
    async with S3Store(flaky, "slots", prefix=key_prefix, retry=RetryPolicy(attempts=3, base_s=0.01)) as st:
        await st.put_object(f"{key_prefix}/x", b"abc" * 1000)
        assert await st.get_object(f"{key_prefix}/x") == b"abc" * 1000
    assert flaky.broken == 1
