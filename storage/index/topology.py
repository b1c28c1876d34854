"""Which Redis the index lives on, read from one URL, and the client that reaches it.

Four forms (the docs' operations page gives them with examples):

| scheme | topology | hosts | path |
|---|---|---|---|
| ``redis://``, ``rediss://``, ``unix://`` | one primary (redis-py's own URL) | one | ``/db`` |
| ``redis-cluster://``, ``rediss-cluster://`` | Redis Cluster / Valkey cluster | seed nodes | none |
| ``redis-sentinel://``, ``rediss-sentinel://`` | Sentinel's master, followed | sentinels | ``/MASTER[/db]`` |

``user:password@`` before the hosts is the data nodes' auth (ACL user optional); a Sentinel that
checks its own takes ``?sentinel_username=&sentinel_password=``. The ``ss`` schemes speak TLS to
every node (sentinels too), with ``?ssl_ca_certs=&ssl_certfile=&ssl_keyfile=&ssl_cert_reqs=`` as
redis-py names them. :func:`parse_redis_url` decides (pure); :func:`connect` builds the client.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

FORMS = (
    "redis://[[user]:password@]host[:port][/db], rediss://... (TLS), unix:///path/redis.sock, "
    "redis-cluster://[[user]:password@]host:port[,host:port...] (Redis Cluster or Valkey, TLS: "
    "rediss-cluster://) or redis-sentinel://[[user]:password@]host:port[,host:port...]/MASTER[/db] "
    "(TLS: rediss-sentinel://)"
)


class Topology(enum.Enum):
    STANDALONE = "standalone"
    CLUSTER = "cluster"
    SENTINEL = "sentinel"


# scheme -> (topology, TLS); the standalone schemes are redis-py's own
_SCHEMES: Mapping[str, tuple[Topology, bool]] = {
    "redis": (Topology.STANDALONE, False),
    "rediss": (Topology.STANDALONE, True),
    "unix": (Topology.STANDALONE, False),
    "redis-cluster": (Topology.CLUSTER, False),
    "rediss-cluster": (Topology.CLUSTER, True),
    "redis-sentinel": (Topology.SENTINEL, False),
    "rediss-sentinel": (Topology.SENTINEL, True),
}
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
_CERT_REQS = ("none", "optional", "required")


class RedisUrlError(ValueError):
    """A ``--redis-url`` that names no Redis this module can reach; the message says why."""


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``--redis-url``: what to connect to and how."""

    topology: Topology
    url: str  # as given (the standalone client is redis-py's from_url of it)
    nodes: tuple[tuple[str, int], ...] = ()  # cluster seeds or sentinels
    master: str = ""  # the Sentinel master's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    options: Mapping[str, str] = field(default_factory=dict)  # TLS and sentinel auth options

    def client_kwargs(self) -> dict[str, Any]:
        """The data nodes' connection options: auth and TLS."""
        out: dict[str, Any] = {"username": self.username, "password": self.password}
        if self.tls:
            out["ssl"] = True
            out.update({k: v for k, v in self.options.items() if k in _TLS_OPTIONS})
        return out


def _hosts(netloc: str, url: str) -> tuple[tuple[str, int], ...]:
    nodes = []
    for part in netloc.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RedisUrlError(f"{url!r}: {part!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    return tuple(nodes)


def parse_redis_url(url: str) -> RedisTarget:
    """The target ``url`` names, or :class:`RedisUrlError` saying what is wrong with it."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise RedisUrlError(f"{url!r} is none of {FORMS}")
    topology, tls = _SCHEMES[scheme]
    if topology is Topology.STANDALONE:
        return RedisTarget(topology, url, tls=tls)
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        hosts, userinfo = netloc, ""
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = _hosts(hosts, url)
    options = dict(parse_qsl(query, keep_blank_values=True))
    allowed = (_TLS_OPTIONS if tls else ()) + (_SENTINEL_OPTIONS if topology is Topology.SENTINEL else ())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise RedisUrlError(f"{url!r}: unknown option(s) {', '.join(unknown)}; known: {', '.join(allowed)}")
    if options.get("ssl_cert_reqs", "required") not in _CERT_REQS:
        raise RedisUrlError(f"{url!r}: ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
    segments = [s for s in path.split("/") if s]
    master, db = "", 0
    if topology is Topology.CLUSTER:
        if segments not in ([], ["0"]):
            raise RedisUrlError(f"{url!r}: a cluster has only database 0 (no path)")
    else:
        if not 1 <= len(segments) <= 2 or (len(segments) == 2 and not segments[1].isdigit()):
            raise RedisUrlError(f"{url!r}: a Sentinel URL ends in /MASTER_NAME or /MASTER_NAME/db")
        master, db = unquote(segments[0]), int(segments[1]) if len(segments) == 2 else 0
    return RedisTarget(topology, url, nodes, master, db, username, password, tls, options)


def redis_url_check() -> tuple[Callable[[Any], bool], str]:
    """The settings' check of ``--redis-url`` (engine_pool.process.flags' ``Check``): None, or a URL
    :func:`parse_redis_url` reads; its error names every form."""

    def ok(value: Any) -> bool:
        if value is None:
            return True
        try:
            target = parse_redis_url(str(value))
        except RedisUrlError:
            return False
        if target.topology is not Topology.STANDALONE:
            return True
        parts = urlsplit(str(value))
        return bool(parts.path if parts.scheme == "unix" else parts.hostname)

    return (ok, FORMS)


def is_cluster(redis: Any) -> bool:
    """Whether ``redis`` is a Redis Cluster client: its scripts and transactions must stay in one
    hash slot, and what spans slots is written in several steps (storage.index.session_index)."""
    from redis.asyncio.cluster import RedisCluster

    return isinstance(redis, RedisCluster)


def connect(url: str, *, decode_responses: bool = False) -> Any:
    """The redis-py asyncio client of ``url`` (:func:`parse_redis_url`). Nothing is connected
    yet: the first command connects (and finds the cluster's slots or the Sentinel's master)."""
    target = parse_redis_url(url)
    if target.topology is Topology.STANDALONE:
        import redis.asyncio as aioredis

        return aioredis.from_url(url, decode_responses=decode_responses)
    if target.topology is Topology.CLUSTER:
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
            decode_responses=decode_responses,
            **target.client_kwargs(),
        )
    return _sentinel_master(target, decode_responses=decode_responses)


def _sentinel_master(target: RedisTarget, *, decode_responses: bool) -> Any:
    """A client of the master the sentinels name, that follows their failovers: a connection asks
    the sentinels for the master's address when it connects, and a master demoted under it
    (``READONLY``) drops it as a connection error, retried like any (redis-py's SentinelConnectionPool).
    Closing it closes its sentinel clients too."""
    from redis.asyncio import Redis
    from redis.asyncio.sentinel import Sentinel

    sentinel_kwargs: dict[str, Any] = {
        "username": target.options.get("sentinel_username") or None,
        "password": target.options.get("sentinel_password") or None,
    }
    if target.tls:
        sentinel_kwargs["ssl"] = True
        sentinel_kwargs.update({k: v for k, v in target.options.items() if k in _TLS_OPTIONS})
    sentinel = Sentinel(
        list(target.nodes),
        sentinel_kwargs=sentinel_kwargs,
        decode_responses=decode_responses,
        db=target.db,
        **target.client_kwargs(),
    )

    class SentinelMaster(Redis):
        async def aclose(self, close_connection_pool: bool | None = None) -> None:
            try:
                await super().aclose(close_connection_pool)
            finally:
                await sentinel.aclose()

    return sentinel.master_for(target.master, redis_class=SentinelMaster)
