"""The limits the gateway's edge and the engine both enforce have one default and one check each."""

from __future__ import annotations

import pytest

from engine_pool.http.body import BodyLimits
from engine_pool.process.flags import Flag, SettingsError
from engine_pool.process.limit_flags import BODY_TIMEOUT_S, MAX_BODY_BYTES, MAX_JSON_DEPTH, MAX_MESSAGES
from engine_pool.server import settings as engine
from gateway import settings as gateway

SHARED = (MAX_BODY_BYTES, MAX_JSON_DEPTH, BODY_TIMEOUT_S, MAX_MESSAGES)


@pytest.mark.parametrize("shared", SHARED, ids=lambda f: f.field)
def test_gateway_and_engine_read_the_same_row(shared: Flag) -> None:
    for flags in (engine.FLAGS, gateway.FLAGS):
        (row,) = [f for f in flags if f.field == shared.field]
        assert (row.flags, row.env, row.default, row.check) == (
            shared.flags,
            shared.env,
            shared.default,
            shared.check,
        )
    assert getattr(engine.EngineSettings, shared.field) == getattr(gateway.GatewaySettings, shared.field)


def test_body_limits_default_to_the_rows() -> None:
    assert BodyLimits() == BodyLimits(MAX_BODY_BYTES.default, MAX_JSON_DEPTH.default, BODY_TIMEOUT_S.default)


def test_both_refuse_the_same_bad_value() -> None:
    with pytest.raises(SettingsError, match="--max-json-depth must be within 4..512"):
        gateway.parse_settings(["--max-json-depth", "2"], {})
    with pytest.raises(SettingsError, match="--max-json-depth must be within 4..512"):
        engine.parse_settings(["-m", "x", "--max-json-depth", "2"], {})
