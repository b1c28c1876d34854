"""`slotkeeper sessions` through a running serve and from its data directory once it stopped, and
`slotkeeper inspect` on the manifests that data directory holds."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gateway.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def stored(url: str, session: str) -> None:
    for _ in range(400):
        if int(httpx.get(f"{url}/v1/sessions/{session}").json().get("generation", 0)) > 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{session} was never stored")


def test_sessions_through_the_gateway_then_from_the_data_dir(serve: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    s = serve(data, slots=2)
    for sid in ("alpha", "beta"):
        body = {"model": "m", "messages": [{"role": "user", "content": f"hi {sid}"}], "max_tokens": 3}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": sid}, timeout=60)
        assert r.status_code == 200, r.text
        stored(s.url, sid)

    listed = cli("sessions", "--url", s.url, "--json")
    assert listed.returncode == 0, listed.stderr
    assert sorted(x["id"] for x in json.loads(listed.stdout)) == ["alpha", "beta"]
    table = cli("sessions", "list", "--url", s.url)
    assert "alpha" in table.stdout and "(2 sessions)" in table.stdout
    shown = json.loads(cli("sessions", "show", "beta", "--url", s.url, "--json").stdout)
    assert shown["id"] == "beta" and shown["generation"] >= 1
    assert cli("sessions", "delete", "beta", "--url", s.url).returncode == 0
    gone = cli("sessions", "show", "beta", "--url", s.url)
    assert gone.returncode == 1 and "404" in gone.stderr
    nobody = cli("sessions", "show", "x", "--url", "http://127.0.0.1:9")  # serve stopped: say what to pass
    assert nobody.returncode == 2 and "--data-dir DIR" in nobody.stderr and "--url" in nobody.stderr

    s.stop()  # SIGTERM: a drain saves what is live
    offline = json.loads(cli("sessions", "--data-dir", str(data), "--json").stdout)
    assert [x["id"] for x in offline] == ["alpha"]
    assert offline[0]["state"] == "stored" and offline[0]["tokens"] > 0 and offline[0]["route"]
    one = json.loads(cli("sessions", "show", "alpha", "--data-dir", str(data), "--json").stdout)
    assert one["generation"] == max(one["generations"])

    manifests = sorted((data / "blobs").rglob("*.manifest"))
    assert manifests
    verdict = cli("inspect", str(manifests[-1]), "--json")
    assert verdict.returncode == 0, verdict.stderr
    info = json.loads(verdict.stdout)
    assert info["valid"] and info["session"] == "alpha" and info["missing"] == []
    assert set(info["pieces"]) >= {"kv", "tl"} and info["n_tokens"] == one["tokens"]
    assert "verdict      ok" in cli("inspect", str(manifests[-1])).stdout
    by_id = cli("inspect", "alpha", "--tenant", "default", "--data-dir", str(data), "--json")
    assert by_id.returncode == 0, by_id.stderr  # a session id: its newest generation's manifest
    assert json.loads(by_id.stdout)["path"] == str(manifests[-1])
    unknown = cli("inspect", "gamma", "--data-dir", str(data))
    assert unknown.returncode == 2 and "no stored session 'gamma'" in unknown.stderr
    assert "alpha" in unknown.stderr  # what it could have asked for
    elsewhere = cli("inspect", "alpha", "--data-dir", str(tmp_path / "nowhere"))
    assert elsewhere.returncode == 2 and "--data-dir" in elsewhere.stderr
    for chunk in (data / "blobs").rglob("*.kv"):  # a store that lost pieces
        chunk.unlink()
    damaged = cli("inspect", str(manifests[-1]), "--json")
    assert damaged.returncode == 1 and json.loads(damaged.stdout)["missing"]

    assert cli("sessions", "delete", "alpha", "--data-dir", str(data)).returncode == 0
    assert json.loads(cli("sessions", "--data-dir", str(data), "--json").stdout) == []
    missing = cli("sessions", "show", "alpha", "--data-dir", str(data))
    assert missing.returncode == 1 and "not found" in missing.stderr
    assert cli("sessions", "--data-dir", str(tmp_path / "nowhere")).returncode == 2
