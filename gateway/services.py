"""What the gateway's handlers share: the clients and runners built once in the lifespan."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from gateway.cluster import Cluster
from gateway.engine_http import EngineHttp
from gateway.metrics import Metrics
from gateway.retention import Retention
from gateway.sealing import ReasoningSeal
from gateway.settings import GatewaySettings
from gateway.tenants import Tenants
from gateway.turn.runner import TurnRunner
from storage.blobs.blobstore import BlobStore
from storage.blobs.stored_responses import ResponseStore
from storage.index.engines import EngineRegistry
from storage.index.locks import SessionLocks
from storage.index.session_index import SessionIndex


@dataclass
class Services:
    settings: GatewaySettings
    tenants: Tenants
    index: SessionIndex
    locks: SessionLocks
    registry: EngineRegistry
    store: BlobStore
    http: httpx.AsyncClient  # node agents (probes, slot operations)
    engines: EngineHttp  # engine requests (gateway.turn.engine_call)
    cluster: Cluster
    runner: TurnRunner
    metrics: Metrics
    responses: ResponseStore
    sealing: ReasoningSeal  # reasoning sealed for Responses clients that store nothing
    retention: Retention | None = None  # None when the store is not chunked (tests with a bare store)
