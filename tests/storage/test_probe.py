"""storage.probe and S3 error classification against what real servers answer.

What the servers really do (moto 5.2, SeaweedFS 4.48 ``weed mini``), and so what is asserted here:

* Neither checks credentials by default: any key pair is accepted.
* A missing bucket: moto answers ``NoSuchBucket``; SeaweedFS answers ``AccessDenied`` to an
  anonymous-mode PUT (and with admin credentials it creates the bucket on the first PUT).
* A bucket name S3 rejects (``Bad_Bucket``): SeaweedFS answers ``InvalidBucketName``; moto does not
  validate names and answers ``NoSuchBucket``. A name botocore itself rejects (``bad bucket!``)
  never leaves the client.
* With credentials checked (``moto_with_auth``: ``INITIAL_NO_AUTH_ACTION_COUNT=0``;
  ``seaweed_with_auth``: ``-s3.config`` identities) an unknown key is ``InvalidAccessKeyId`` and a
  wrong secret ``SignatureDoesNotMatch`` on both. moto's signature check fails on query values
  holding ``/`` (every prefix listing), so the valid-credentials probe runs against SeaweedFS only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from botocore.exceptions import BotoCoreError, ClientError
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from structlog.testing import capture_logs

from storage.blobs.blobstore import BlobStore, delete_generations
from storage.blobs.localstore import LocalStore
from storage.blobs.retry import RetryPolicy
from storage.blobs.s3client import make_s3_client
from storage.blobs.s3store import S3Store
from storage.errors import NotStored, StorageError, StoreMisconfigured, StoreUnavailable
from storage.ids import SlotRef
from storage.index.session_index import in_process_redis
from storage.probe import probe_redis, probe_store

FAST = RetryPolicy(attempts=2, base_s=0.01, max_s=0.01)


@pytest.fixture
async def stores() -> AsyncIterator[Any]:
    """``make(endpoint, bucket, access_key=, secret_key=)`` → an S3Store closed after the test."""
    made: list[tuple[Any, S3Store]] = []

    def make(
        endpoint: str, bucket: str = "slots", access_key: str = "test", secret_key: str = "test"
    ) -> S3Store:
        client = make_s3_client(endpoint_url=endpoint, access_key=access_key, secret_key=secret_key)
        store = S3Store(client, bucket, prefix="probe-test", retry=FAST)
        made.append((client, store))
        return store

    yield make
    for client, store in made:
        await store.aclose()
        client.close()


async def misconfigured(store: BlobStore) -> StoreMisconfigured:
    with capture_logs() as logs, pytest.raises(StoreMisconfigured) as caught:
        await probe_store(store)
    assert not [e for e in logs if e["event"] == "storage.retry"]  # never retried
    assert not isinstance(caught.value.__cause__, StoreMisconfigured)
    return caught.value


# -------------------------------------------------------------------------------------------- stores
async def test_a_working_store_passes_and_keeps_nothing(
    s3_endpoint: str, stores: Any, tmp_path: Path
) -> None:
    store = stores(s3_endpoint)
    with capture_logs() as logs:
        await probe_store(store)
    assert [e["native_conditional"] for e in logs if e["event"] == "storage.probed"] == [True]
    listed = await store.thread(store.client.list_objects_v2, Bucket="slots", Prefix="probe-test/")
    assert listed.get("KeyCount", 0) == 0
    local = LocalStore(tmp_path / "store", prefix="p", fsync=False)
    await probe_store(local)
    assert [p for p in (tmp_path / "store").rglob("*") if p.is_file()] == []
    assert [t async for t in local.list_tenants()] == []  # the probe's folder is no tenant
    await local.aclose()


async def test_a_local_store_that_cannot_be_written(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file where the store's directory should be")
    store = LocalStore(tmp_path / "taken", fsync=False)
    err = await misconfigured(store)
    assert err.service == "local" and err.error_code in ("ENOTDIR", "EEXIST") and "taken" in str(err)
    await store.aclose()


@pytest.mark.parametrize(
    ("server", "bucket", "codes"),
    [
        ("moto", "no-such-bucket", {"NoSuchBucket"}),
        ("seaweedfs", "no-such-bucket", {"AccessDenied"}),
        ("moto", "Bad_Bucket", {"NoSuchBucket"}),  # moto does not validate names
        ("seaweedfs", "Bad_Bucket", {"InvalidBucketName"}),
        ("moto", "bad bucket!", {"InvalidBucketName"}),  # refused by botocore before sending
        ("seaweedfs", "bad bucket!", {"InvalidBucketName"}),
    ],
)
async def test_a_bad_bucket_is_named_with_the_server_code(
    server: str, bucket: str, codes: set[str], s3_endpoint_for: Any, stores: Any
) -> None:
    endpoint = s3_endpoint_for(server)
    err = await misconfigured(stores(endpoint, bucket))
    assert err.error_code in codes and err.service == "s3"
    assert repr(bucket) in str(err) and endpoint in str(err) and err.error_code in str(err)


async def test_servers_without_credential_checks_accept_any_key(s3_endpoint: str, stores: Any) -> None:
    await probe_store(stores(s3_endpoint, access_key="nobody", secret_key="wrong"))


@pytest.mark.parametrize("server", ["moto_with_auth", "seaweed_with_auth"])
async def test_wrong_credentials_where_the_server_checks_them(
    server: str, request: pytest.FixtureRequest, stores: Any
) -> None:
    auth = request.getfixturevalue(server)
    unknown = await misconfigured(stores(auth.endpoint, access_key="AKIAUNKNOWNKEY000000", secret_key="x"))
    assert unknown.error_code == "InvalidAccessKeyId" and auth.endpoint in str(unknown)
    wrong = await misconfigured(
        stores(auth.endpoint, access_key=auth.access_key, secret_key="not-the-secret")
    )
    assert wrong.error_code == "SignatureDoesNotMatch"
    if server == "seaweed_with_auth":
        await probe_store(stores(auth.endpoint, access_key=auth.access_key, secret_key=auth.secret_key))


async def test_no_botocore_error_escapes_a_store_on_a_missing_bucket(
    moto_server: Any, stores: Any, tmp_path: Path, slot_writer: Any
) -> None:
    store = stores(moto_server.endpoint, "no-such-bucket")
    src = slot_writer.write(tmp_path / "a.slot", slot_writer.Spec())
    ref = SlotRef("acme", "s", 1)
    calls = [
        lambda: store.put_file(ref, src, model="m", n_tokens=1),
        lambda: store.delete(ref),  # used to pass silently: a 404 read as "already gone"
        lambda: store.latest("acme", "s"),
        lambda: delete_generations(store, "acme", "s"),
        lambda: store.native_conditional_writes(),
    ]
    for call in calls:
        with pytest.raises(StoreMisconfigured) as caught:
            await call()
        assert caught.value.error_code == "NoSuchBucket"
    with pytest.raises(StoreMisconfigured):
        [t async for t in store.list_tenants()]
    # A HEAD has no body: a missing bucket reads as a missing object there (the probe tells them apart).
    with pytest.raises(NotStored):
        await store.head(ref)
    with pytest.raises(NotStored):
        await store.get_to_file(ref, tmp_path / "x.slot")


async def test_an_unreachable_endpoint_is_unavailable_not_misconfigured(stores: Any) -> None:
    store = stores("http://127.0.0.1:1")
    with pytest.raises(StoreUnavailable) as caught:
        await probe_store(store)
    assert not isinstance(caught.value, StoreMisconfigured)
    assert not isinstance(caught.value, ClientError | BotoCoreError)


# --------------------------------------------------------------------------------------------- redis
async def test_probe_redis_passes_and_leaves_no_key(redis_client: Any) -> None:
    await probe_redis(redis_client, prefix="sk")
    assert [k async for k in redis_client.scan_iter(match="sk:*")] == []
    await probe_redis(in_process_redis())


async def test_probe_redis_unreachable() -> None:
    client = aioredis.Redis(port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    with pytest.raises(StoreUnavailable, match="127.0.0.1:1|localhost:1"):
        await probe_redis(client)
    await client.aclose()


async def test_probe_redis_refused_credentials_and_permissions(redis_port: int) -> None:
    admin = aioredis.Redis(port=redis_port)
    await admin.execute_command("ACL", "SETUSER", "probe-user", "on", ">right", "~other:*", "+@all")
    wrong = aioredis.Redis(
        port=redis_port, username="probe-user", password="wrong", retry=Retry(NoBackoff(), 0)
    )
    narrow = aioredis.Redis(port=redis_port, username="probe-user", password="right")
    try:
        with pytest.raises(StoreMisconfigured) as caught:
            await probe_redis(wrong, prefix="sk")
        assert caught.value.error_code == "AUTH" and f":{redis_port}/" in str(caught.value)
        with pytest.raises(StoreMisconfigured) as caught:
            await probe_redis(narrow, prefix="sk")  # may not touch sk:* keys
        assert caught.value.error_code == "NOPERM"
        await probe_redis(narrow, prefix="other")
    finally:
        for client in (wrong, narrow):
            await client.aclose()
        await admin.execute_command("ACL", "DELUSER", "probe-user")
        await admin.aclose()


async def test_probe_redis_refuses_a_server_too_old() -> None:
    class Old:
        """Answers like a Redis 6.2 server."""

        store: dict[str, str] = {}

        async def ping(self) -> bool:
            return True

        async def set(self, key: str, value: str, px: int) -> None:
            self.store[key] = value

        async def get(self, key: str) -> str | None:
            return self.store.get(key)

        async def delete(self, key: str) -> None:
            self.store.pop(key, None)

        async def info(self, section: str) -> dict[str, str]:
            return {"redis_version": "6.2.14"}

    with pytest.raises(StoreMisconfigured, match="6.2") as caught:
        await probe_redis(Old())
    assert caught.value.error_code == "RedisVersion" and isinstance(caught.value, StorageError)
