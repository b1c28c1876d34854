"""storage.index.topology: every --redis-url form read, the wrong ones refused with the forms, and
each one's client reaching its real servers (tests/conftest.py starts them)."""

from __future__ import annotations

from typing import Any

import pytest

from storage.index.session_index import SessionIndex
from storage.index.topology import (
    RedisUrlError,
    Topology,
    connect,
    is_cluster,
    parse_redis_url,
    redis_url_check,
)


@pytest.mark.parametrize(
    ("url", "topology", "nodes", "master", "db", "auth", "tls"),
    [
        ("redis://r:6379/2", Topology.STANDALONE, (), "", 0, (None, None), False),
        ("rediss://:pw@r:6380/0", Topology.STANDALONE, (), "", 0, (None, None), True),
        (
            "redis-cluster://a:7000,b:7001",
            Topology.CLUSTER,
            (("a", 7000), ("b", 7001)),
            "",
            0,
            (None, None),
            False,
        ),
        ("rediss-cluster://u:p%40ss@a:7000/", Topology.CLUSTER, (("a", 7000),), "", 0, ("u", "p@ss"), True),
        (
            "redis-sentinel://:pw@s1:26379,s2:26379/mymaster",
            Topology.SENTINEL,
            (("s1", 26379), ("s2", 26379)),
            "mymaster",
            0,
            (None, "pw"),
            False,
        ),
        (
            "rediss-sentinel://s1:26379/m/3?sentinel_password=x&ssl_ca_certs=/ca.pem",
            Topology.SENTINEL,
            (("s1", 26379),),
            "m",
            3,
            (None, None),
            True,
        ),
    ],
)
def test_every_form_is_read(
    url: str, topology: Topology, nodes: Any, master: str, db: int, auth: Any, tls: bool
):
    target = parse_redis_url(url)
    assert (target.topology, target.nodes, target.master, target.db, target.tls) == (
        topology,
        nodes,
        master,
        db,
        tls,
    )
    if topology is not Topology.STANDALONE:  # redis-py reads the standalone URL's auth itself
        assert (target.username, target.password) == auth
    assert redis_url_check()[0](url)


def test_tls_and_sentinel_options_reach_the_client() -> None:
    target = parse_redis_url(
        "rediss-sentinel://s:1/m?sentinel_password=x&ssl_ca_certs=/ca.pem&ssl_cert_reqs=none"
    )
    kwargs = target.client_kwargs()
    assert kwargs["ssl"] is True and kwargs["ssl_ca_certs"] == "/ca.pem" and kwargs["ssl_cert_reqs"] == "none"
    assert "sentinel_password" not in kwargs and target.options["sentinel_password"] == "x"


@pytest.mark.parametrize(
    "url",
    [
        "http://r:6379",
        "redis-cluster://",
        "redis-cluster://a",
        "redis-cluster://a:x",
        "redis-cluster://a:70000",
        "redis-cluster://a:7000/1",  # a cluster has database 0 only
        "redis-sentinel://s:26379",  # no master name
        "redis-sentinel://s:26379/m/x",
        "redis-cluster://a:7000?ssl_ca_certs=/ca.pem",  # TLS options without TLS
        "redis-sentinel://s:1/m?password=x",
        "rediss-cluster://a:1?ssl_cert_reqs=maybe",
    ],
)
def test_wrong_urls_are_refused_naming_every_form(url: str) -> None:
    with pytest.raises(RedisUrlError):
        parse_redis_url(url)
    ok, forms = redis_url_check()
    assert not ok(url) and "redis-cluster://" in forms and "redis-sentinel://" in forms


@pytest.mark.parametrize("name", ["cluster", "sentinel"])
async def test_each_client_reaches_its_servers(request: pytest.FixtureRequest, name: str) -> None:
    servers = request.getfixturevalue(f"redis_{name}")
    client = connect(servers.url, decode_responses=True)
    try:
        assert is_cluster(client) is (name == "cluster")
        index = SessionIndex(client, prefix=f"topology-{name}")
        assert index.split is (name == "cluster")
        for t in range(12):  # tenants spread over the shards, each one's keys in one slot
            await index.create(f"tenant{t}", "s1", model="m")
            assert (await index.get(f"tenant{t}", "s1")).model == "m"
    finally:
        await client.aclose()
