"""helm/slotkeeper: the chart sets exactly the SLOTKEEPER_* variables the processes read.

The chart is linted and rendered by Helm's own engine through `helm-python-sdk` (Helm's Go SDK
behind a C ABI: no `helm` binary, no cluster), the rendered environments are handed to the real
settings parsers (`gateway.settings`, `engine_pool.pool.settings`), so a value the code would refuse
fails here, not in a cluster, and one test starts `slotkeeper node` and `slotkeeper gateway` with
exactly that environment.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import helm_python
import httpx
import kubernetes_validate
import pytest
import yaml

from engine_pool.pool.settings import FLAGS as NODE_FLAGS
from engine_pool.pool.settings import parse_node_settings
from engine_pool.pool.supervisor import engine_argv
from engine_pool.server.settings import parse_settings as parse_engine_settings
from gateway.bench.harness.servers import free_port, wait_until
from gateway.metrics import Metrics
from gateway.settings import FLAGS as GATEWAY_FLAGS
from gateway.settings import parse_settings

CHART = Path(__file__).resolve().parents[2] / "helm" / "slotkeeper"
ENV_TEMPLATE = CHART / "templates" / "env.yaml"


def env_names(flags: Iterable[Any]) -> set[str]:
    """The variable of each FLAGS row: a `Flag` (`.env`) or a `(flag, field, env, ...)` tuple."""
    return {row.env if hasattr(row, "env") else row[2] for row in flags}


GATEWAY_ENV = env_names(GATEWAY_FLAGS)
NODE_ENV = env_names(NODE_FLAGS)
NAME = re.compile(r"SLOTKEEPER_[A-Z0-9_]+")
# Settings the chart deliberately leaves to the process's default, with the reason: a flag added to
# either FLAGS table must be wired into env.yaml (or listed here).
NOT_SET: dict[str, str] = {
    "SLOTKEEPER_SEALING_KEY": "derived from the internal key, which the chart keeps in its Secret across "
    "upgrades: every gateway replica derives the same one",
    "SLOTKEEPER_ROUTES_PER_SESSION": "a bound on each session's routing keys, whose default suits agents "
    "(storage.index.prefix_digests); a chart value for it is not built yet",
}
# Variables the gateway gets that are not its own settings: boto3's credential chain.
BOTO_ENV = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


# -- without helm: the template text against the FLAGS tables --------------------------------------
def test_chart_and_values_load() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "slotkeeper"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert {"redis", "s3", "tenants", "gateway", "node", "image"} <= values.keys()
    assert values["node"]["drainGraceS"] > 0 and values["node"]["models"]
    for name in ("demo-values.yaml", "external-values.yaml"):
        assert isinstance(yaml.safe_load((CHART / "ci" / name).read_text()), dict)


def test_every_variable_in_the_env_template_is_read_by_a_process() -> None:
    used = set(NAME.findall(ENV_TEMPLATE.read_text()))
    assert used, "env.yaml names no SLOTKEEPER_* variable"
    unknown = used - GATEWAY_ENV - NODE_ENV
    assert not unknown, f"env.yaml sets variables no FLAGS table reads: {sorted(unknown)}"


def test_every_setting_reaches_the_env_template() -> None:
    used = set(NAME.findall(ENV_TEMPLATE.read_text()))
    missing = (GATEWAY_ENV | NODE_ENV) - used - NOT_SET.keys()
    assert not missing, f"settings without a chart value (wire them into env.yaml): {sorted(missing)}"


def test_only_the_env_template_names_variables() -> None:
    """STYLE.md habit 5: values become SLOTKEEPER_* variables in one template."""
    others = {
        p.name: sorted(set(NAME.findall(p.read_text())))
        for p in (CHART / "templates").iterdir()
        if p.is_file() and p != ENV_TEMPLATE
    }
    assert not {k: v for k, v in others.items() if v}


# -- rendered by Helm's engine: lint, render, parse with the real settings ---------------------------
def _merge(into: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """`-f`/`--set` layering: maps merge key by key, anything else is replaced."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def user_values(
    values: tuple[str, ...], sets: tuple[str, ...] = (), set_json: tuple[str, ...] = ()
) -> dict[str, Any]:
    """What `-f ci/VALUES --set S --set-json J` give, in that order."""
    merged: dict[str, Any] = {}
    for v in values:
        _merge(merged, helm_python.values_from_yaml((CHART / "ci" / v).read_text()))
    for s in sets:
        _merge(merged, helm_python.parse_set_string(s))
    for s in set_json:
        _merge(merged, helm_python.parse_set_json(s))
    return merged


def template(
    values: dict[str, Any], ns: str = "default", api_versions: tuple[str, ...] = ()
) -> dict[str, str]:
    """`helm template sk CHART --namespace NS [--api-versions V ...]`: the values checked against the
    chart's schema, then every template rendered (template path → manifest text). The schema sees
    the defaults merged with `values`, as an install would. `api_versions`: what the cluster serves
    beyond Kubernetes' own (`.Capabilities.APIVersions`), e.g. a CRD's group/version."""
    chart = helm_python.Chart.load(CHART)
    try:
        chart.validate_schema(chart.merge_values(values))
        if not api_versions:
            return chart.render(values, name="sk", namespace=ns)
        # Chart.render has no parameter for them; the library's render call takes `api_versions`.
        opts = {"name": "sk", "namespace": ns, "api_versions": list(api_versions)}
        out: dict[str, str] = json.loads(
            helm_python._native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts))
        )
        return out
    finally:
        chart.close()


def render(
    *values: str,
    sets: tuple[str, ...] = (),
    set_json: tuple[str, ...] = (),
    ns: str = "ai",
    api_versions: tuple[str, ...] = (),
) -> dict[tuple[str, str], Any]:
    """`helm template` → {(kind, name): manifest}."""
    out = template(user_values(values, sets, set_json), ns, api_versions)
    docs = [
        d for path, text in out.items() if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d
    ]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


KEY = "internalKey.value=test-internal-key-0123456789"  # so that the check under test is the one that fails
# A model source, for renders without a values file: the check under test is the one that fails.
MODELS = 'node.modelVolume.source={"persistentVolumeClaim": {"claimName": "models", "readOnly": true}}'
MONITORING = ("monitoring.coreos.com/v1",)  # a cluster with the Prometheus Operator's CRDs


def render_error(*sets: str) -> str:
    with pytest.raises(helm_python.HelmError) as err:
        template(user_values((), sets, (MODELS,)))
    return str(err.value)


def pod_spec(docs: dict[tuple[str, str], Any], kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = docs[(kind, name)]["spec"]["template"]["spec"]
    return spec


def container_env(
    docs: dict[tuple[str, str], Any], kind: str, name: str, fake: dict[str, str]
) -> tuple[dict[str, str], set[str]]:
    """The environment a container would see (ConfigMap data + `env` entries, faked where they come
    from Secrets or the pod), and the names of its `env` entries."""
    c = pod_spec(docs, kind, name)["containers"][0]
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(docs[("ConfigMap", src["configMapRef"]["name"])]["data"])
    names = {e["name"] for e in c.get("env", [])}
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", fake.get(e["name"], "x"))
    return env, names


FAKE = {
    "SLOTKEEPER_REDIS_URL": "redis://:secret@redis:6379/0",
    "SLOTKEEPER_NODE_ID": "sk-slotkeeper-node-0",
    "SLOTKEEPER_ENGINE_HOST": "10.1.2.3",
}
VALUE_SETS = [("demo-values.yaml",), ("external-values.yaml",)]


@pytest.mark.parametrize("values", ["demo-values.yaml", "external-values.yaml"])
def test_helm_lint_strict(values: str) -> None:
    report = helm_python.lint(CHART, user_values((values,)), strict=True)
    # `helm lint --strict` fails on warnings (severity 2) and errors (3); info (1) passes.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("values", VALUE_SETS)
def test_rendered_environment_parses_with_the_real_settings(values: tuple[str, ...]) -> None:
    docs = render(*values)
    chosen: dict[str, Any] = {}
    for v in values:
        chosen.update(yaml.safe_load((CHART / "ci" / v).read_text()))

    gw_env, gw_names = container_env(docs, "Deployment", "sk-slotkeeper-gateway", FAKE)
    assert {k for k in gw_env if k.startswith("SLOTKEEPER_")} <= GATEWAY_ENV
    assert gw_names <= GATEWAY_ENV | BOTO_ENV
    gw = parse_settings([], gw_env)
    assert gw.host == "0.0.0.0" and gw.redis_url == FAKE["SLOTKEEPER_REDIS_URL"]
    assert gw.s3_bucket == chosen["s3"]["bucket"] and gw.tenants

    node_env, node_names = container_env(docs, "StatefulSet", "sk-slotkeeper-node", FAKE)
    assert {k for k in node_env if k.startswith("SLOTKEEPER_")} <= NODE_ENV
    assert node_names <= NODE_ENV
    node = parse_node_settings([], node_env)
    assert node.host == "0.0.0.0" and node.node_id == FAKE["SLOTKEEPER_NODE_ID"]
    assert node.engine_host == FAKE["SLOTKEEPER_ENGINE_HOST"]  # engines reachable from the gateway
    assert node.redis_prefix == gw.redis_prefix and node.s3_prefix == gw.s3_prefix
    assert node.s3_bucket == gw.s3_bucket and node.s3_endpoint == gw.s3_endpoint
    assert len(node.models) == len(chosen["node"]["models"])
    assert all(m.startswith("/") for m in node.models)
    # the default: states stored as they are, even in S3 (a bare YAML `off` would render "false")
    assert node.store_compression == "off" and not node.compresses_states


def test_gpus_reach_the_engines_and_the_node_pods_limits() -> None:
    plain = render("demo-values.yaml")
    node_pod = pod_spec(plain, "StatefulSet", "sk-slotkeeper-node")
    assert "nvidia.com/gpu" not in node_pod["containers"][0]["resources"].get("limits", {})
    node = parse_node_settings([], container_env(plain, "StatefulSet", "sk-slotkeeper-node", FAKE)[0])
    assert node.n_gpu_layers == 0 and node.flash_attn == "auto"
    assert "-ngl" not in engine_argv(node.engine_specs()[0], 9000, "i")

    gpus = render(
        "demo-values.yaml",
        sets=("node.gpus=2", "node.gpuLayers=99", "node.flashAttn=on", "node.nodeSelector.gpu=h200"),
    )
    node_pod = pod_spec(gpus, "StatefulSet", "sk-slotkeeper-node")
    limits = node_pod["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 2 and limits["memory"] == "16Gi"  # added to, not replacing
    assert node_pod["nodeSelector"] == {"gpu": "h200"}
    kubernetes_validate.validate(gpus[("StatefulSet", "sk-slotkeeper-node")], "1.30.0", strict=True)
    node = parse_node_settings([], container_env(gpus, "StatefulSet", "sk-slotkeeper-node", FAKE)[0])
    argv = engine_argv(node.engine_specs()[0], 9000, "i")
    assert argv[argv.index("-ngl") + 1] == "99" and argv[argv.index("-fa") + 1] == "on"
    assert "nvidia.com/gpu" not in str(pod_spec(gpus, "Deployment", "sk-slotkeeper-gateway"))


def test_the_stored_checkpoint_ladder_reaches_the_engines() -> None:
    """`node.storedCheckpoints` / `node.storedCheckpointBytes` become every engine's
    `--stored-checkpoints` / `--stored-checkpoint-bytes`, ahead of `node.engineArgs`."""

    def engine_settings(*sets: str) -> Any:
        docs = render("demo-values.yaml", sets=sets)
        node = parse_node_settings([], container_env(docs, "StatefulSet", "sk-slotkeeper-node", FAKE)[0])
        argv = engine_argv(node.engine_specs()[0], 9000, "i")
        return parse_engine_settings(argv[argv.index("engine") + 1 :], {})

    plain = engine_settings()
    assert (plain.max_stored_checkpoints, plain.max_stored_checkpoint_bytes) == (8, 512 << 20)
    custom = engine_settings(
        "node.storedCheckpoints=3", "node.storedCheckpointBytes=128M", "node.engineArgs={--no-warmup}"
    )
    assert (custom.max_stored_checkpoints, custom.max_stored_checkpoint_bytes) == (3, 128 << 20)
    assert custom.no_warmup


@pytest.mark.parametrize("values", VALUE_SETS)
def test_gateway_addresses_every_node_pod(values: tuple[str, ...]) -> None:
    docs = render(*values)
    sts = docs[("StatefulSet", "sk-slotkeeper-node")]
    svc = docs[("Service", sts["spec"]["serviceName"])]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    gw_env, _ = container_env(docs, "Deployment", "sk-slotkeeper-gateway", FAKE)
    urls = parse_settings([], gw_env).nodes
    port = sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert len(urls) == sts["spec"]["replicas"]
    for i, url in enumerate(urls):
        parts = urlsplit(url)
        assert parts.port == port
        assert (parts.hostname or "").startswith(f"sk-slotkeeper-node-{i}.{svc['metadata']['name']}.ai.svc.")


@pytest.mark.parametrize("values", VALUE_SETS)
def test_node_is_given_time_to_drain(values: tuple[str, ...]) -> None:
    docs = render(*values)
    node_env, _ = container_env(docs, "StatefulSet", "sk-slotkeeper-node", FAKE)
    node = parse_node_settings([], node_env)
    spec = pod_spec(docs, "StatefulSet", "sk-slotkeeper-node")
    # the drain, then SIGTERM → grace → SIGKILL of the engines, then the server's own shutdown
    assert spec["terminationGracePeriodSeconds"] >= node.drain_grace_s + node.engine_stop_grace_s + 15
    probes = spec["containers"][0]
    assert "httpGet" not in probes["livenessProbe"], "/health is 503 while draining: liveness would kill"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/health"


def test_a_grace_period_shorter_than_the_drain_is_refused() -> None:
    err = render_error(
        KEY,
        "redis.enabled=true",
        "s3.bucket=b",
        "node.drainGraceS=100",
        "node.terminationGracePeriodSeconds=60",
    )
    assert "terminationGracePeriodSeconds" in err


def test_pods_probe_and_drop_service_links() -> None:
    docs = render("demo-values.yaml")
    gw = pod_spec(docs, "Deployment", "sk-slotkeeper-gateway")["containers"][0]
    assert gw["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gw["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gw["command"] + gw["args"] == ["slotkeeper", "gateway"]
    for kind, name in docs:
        if kind in ("Deployment", "StatefulSet"):
            # <SERVICE>_PORT=tcp://... would land in the SLOTKEEPER_ namespace for a release "slotkeeper"
            assert pod_spec(docs, kind, name)["enableServiceLinks"] is False, name
    assert ("PodDisruptionBudget", "sk-slotkeeper-node") in docs


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ((KEY, "s3.bucket=b"), "shared Redis"),
        ((KEY, "redis.enabled=true"), "s3.bucket"),
        ((KEY, "redis.enabled=true", "s3.bucket=b", "s3.accessKey=a"), "go together"),
        ((KEY, "redis.enabled=true", "s3.bucket=b", "node.engineArgs={--override-kv,a=1\\,b=2}"), "comma"),
    ],
)
def test_incomplete_values_are_refused(sets: tuple[str, ...], message: str) -> None:
    assert message in render_error(*sets)


def test_a_setting_rolls_only_the_pods_that_read_it() -> None:
    """Rolling the nodes drains every live session: a gateway-only change must not do it."""

    def checksums(*sets: str) -> tuple[str, str]:
        docs = render("demo-values.yaml", sets=sets)
        gw = docs[("Deployment", "sk-slotkeeper-gateway")]["spec"]["template"]["metadata"]["annotations"]
        node = docs[("StatefulSet", "sk-slotkeeper-node")]["spec"]["template"]["metadata"]["annotations"]
        return gw["checksum/env"], node["checksum/env"]

    base = checksums()
    tenants = checksums("tenants.toml=changed")
    assert tenants[0] != base[0] and tenants[1] == base[1]
    slots = checksums("node.slots=8")
    assert slots[0] == base[0] and slots[1] != base[1]
    more_nodes = checksums("node.replicas=3")  # a new --node URL for the gateway; nodes unchanged
    assert more_nodes[0] != base[0] and more_nodes[1] == base[1]


@pytest.mark.slow
def test_the_rendered_environment_runs_a_node_and_a_gateway(
    tiny_model: Callable[..., str], redis_port: int, moto_server: Any, tmp_path: Path
) -> None:
    """The processes, started with exactly what the chart gives the pods (cluster names and the pod
    IP replaced by loopback), serve a tenant's turn and drain the session to S3 on SIGTERM."""
    gport, nport, model = free_port(), free_port(), Path(tiny_model("qwen35"))
    sets = (
        f"redis.url=redis://127.0.0.1:{redis_port}/0",
        f"redis.prefix=helm-{gport}",
        "s3.inCluster.enabled=false",
        f"s3.endpoint={moto_server.endpoint}",
        "s3.bucket=slots",
        f"s3.prefix=helm/{gport}",
        "s3.accessKey=test",
        "s3.secretKey=test",
        "node.replicas=1",
        f"node.port={nport}",
        f"gateway.port={gport}",
        f"node.dataDir={tmp_path / 'node'}",
        f"gateway.dataDir={tmp_path / 'gateway'}",
        f"node.modelVolume.mountPath={model.parent}",
        "node.drainGraceS=30",
        "node.engineStopGraceS=5",
        "helmTest.apiKey=sk-demo-1",
        "helmTest.model=gpt-4o-mini",
    )
    models = f'node.models=[{{"path": "{model.name}", "alias": "qwen35"}}]'
    docs = render("demo-values.yaml", sets=sets, set_json=(models,))
    secret = docs[("Secret", "sk-slotkeeper-secrets")]["data"]
    secret = {k: base64.b64decode(v).decode() for k, v in secret.items()}
    (tmp_path / "tenants.toml").write_text(secret["tenants.toml"])

    def process(kind: str, name: str) -> tuple[list[str], dict[str, str]]:
        c = pod_spec(docs, kind, name)["containers"][0]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLOTKEEPER_", "AWS_"))}
        pod = {"metadata.name": "sk-slotkeeper-node-0", "status.podIP": "127.0.0.1"}
        for src in c["envFrom"]:
            env.update(docs[("ConfigMap", src["configMapRef"]["name"])]["data"])
        for e in c["env"]:
            ref = e["valueFrom"]
            if "secretKeyRef" in ref:
                env[e["name"]] = secret[ref["secretKeyRef"]["key"]]
            else:
                env[e["name"]] = pod[ref["fieldRef"]["fieldPath"]]
        return c["command"] + c["args"], env

    node_cmd, node_env = process("StatefulSet", "sk-slotkeeper-node")
    gw_cmd, gw_env = process("Deployment", "sk-slotkeeper-gateway")
    gw_env["SLOTKEEPER_NODES"] = f"http://127.0.0.1:{nport}"  # the pod's DNS name
    gw_env["SLOTKEEPER_TENANTS"] = str(tmp_path / "tenants.toml")  # the Secret's mount
    procs: list[subprocess.Popen[bytes]] = []
    for cmd, env, log in ((node_cmd, node_env, "node.log"), (gw_cmd, gw_env, "gateway.log")):
        with open(tmp_path / log, "wb") as out:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True))
    node, gw = procs
    base, auth = f"http://127.0.0.1:{gport}", {"Authorization": "Bearer sk-demo-1"}

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/ready").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, gw, "gateway ready", timeout=120)
        body = {"model": "gpt-4o-mini", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=auth, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "qwen35"  # the tenant's alias from the chart's tenants file
        sid = r.headers["x-session-id"]
        assert httpx.get(f"{base}/v1/sessions/{sid}", headers=auth).json()["state"] == "live"

        # `helm test`: the hook pod's command and environment, the Service's DNS name replaced.
        hook = docs[("Pod", "sk-slotkeeper-test-chat")]
        assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
        (c,) = hook["spec"]["containers"]
        test_env = {e["name"]: e["value"] for e in c["env"]}
        service_port = docs[("Service", "sk-slotkeeper-gateway")]["spec"]["ports"][0]["port"]
        assert (
            test_env["SLOTKEEPER_TEST_URL"]
            == f"http://sk-slotkeeper-gateway.ai.svc.cluster.local:{service_port}"
        )
        test_env["SLOTKEEPER_TEST_URL"] = base
        ran = subprocess.run(
            [sys.executable, *c["command"][1:]],
            env={**os.environ, **test_env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert ran.returncode == 0 and "answered" in ran.stdout, ran.stdout + ran.stderr

        os.killpg(node.pid, signal.SIGTERM)  # what the kubelet sends
        assert node.wait(60) == 0  # every live session saved and uploaded
        record = httpx.get(f"{base}/v1/sessions/{sid}", headers=auth).json()
        assert record["state"] == "spilled" and record["blob_key"].startswith(f"helm/{gport}/demo/")
        assert moto_server.exists(record["blob_key"])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in ("node.log", "gateway.log"):  # shown by pytest when the test failed
            print(f"--- {log}\n{(tmp_path / log).read_text(errors='replace')[-4000:]}")


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_rendered_manifest_validates_strictly_against_the_kubernetes_schemas(
    values: tuple[str, ...],
) -> None:
    """`kubernetes-validate --strict` offline (unknown fields are errors), Kubernetes 1.30; custom
    resources (the ServiceMonitor) have no schema there and are checked for their kind only."""
    docs = render(
        *values,
        sets=("gateway.serviceMonitor.enabled=true", "gateway.podDisruptionBudget.enabled=true"),
        api_versions=MONITORING,
    )
    assert ("ServiceMonitor", "sk-slotkeeper-gateway") in docs
    checked = 0
    for (kind, name), doc in docs.items():
        if kind == "ServiceMonitor":
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        try:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{kind}/{name}: {exc.message} at {list(exc.path)}") from None
        checked += 1
    assert checked >= 6


@pytest.mark.parametrize(
    ("sets", "where"),
    [
        (("gatway.replicas=2",), "additional properties 'gatway' not allowed"),
        (("gateway.replicas=-1",), "/gateway/replicas"),
        (("node.slots=0",), "/node/slots"),
        (("gateway.logLevel=verbose",), "/gateway/logLevel"),
        (("node.port=70000",), "/node/port"),
        (("gateway.maxBodyBytes=lots",), "/gateway/maxBodyBytes"),
        (("node.models[0].alias=x",), "/node/models/0"),
        (("image.pullPolicy=Sometimes",), "/image/pullPolicy"),
        (("node.gpus=-1",), "/node/gpus"),
        (("node.flashAttn=true",), "/node/flashAttn"),  # a bare YAML `on` is a boolean
    ],
)
def test_the_values_schema_refuses_bad_values(sets: tuple[str, ...], where: str) -> None:
    """values.schema.json: a typo, a negative count, an unknown level or a malformed size is refused
    before anything renders, naming the value."""
    assert where in render_error(KEY, "redis.enabled=true", "s3.bucket=b", *sets)


def _matches(selector: dict[str, str], pod_labels: dict[str, str]) -> bool:
    return all(pod_labels.get(k) == v for k, v in selector.items())


def _selects(policy: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    return _matches(policy["spec"]["podSelector"]["matchLabels"], pod_labels)


def _peer_labels(rule: dict[str, Any]) -> list[dict[str, str]]:
    return [
        p["podSelector"]["matchLabels"] for p in rule.get("from", rule.get("to", [])) if "podSelector" in p
    ]


@pytest.mark.parametrize("egress", [False, True])
def test_network_policies_let_gateway_pods_reach_nodes_and_nodes_each_others_agents(egress: bool) -> None:
    sets = ("networkPolicy.enabled=true", f"networkPolicy.restrictEgress={str(egress).lower()}")
    s3 = 'networkPolicy.egressTo=[{"to":[{"ipBlock":{"cidr":"10.0.0.0/16"}}],"ports":[{"port":443}]}]'
    docs = render("demo-values.yaml", sets=sets, set_json=(s3,))
    policies = {name: d for (kind, name), d in docs.items() if kind == "NetworkPolicy"}
    assert set(policies) == {
        "sk-slotkeeper-node",
        "sk-slotkeeper-gateway",
        "sk-slotkeeper-redis",
        "sk-slotkeeper-s3",
    }
    for doc in policies.values():
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    labels = {
        kind_name[1]: d["spec"]["template"]["metadata"]["labels"]
        for kind_name, d in docs.items()
        if kind_name[0] in ("Deployment", "StatefulSet")
    }
    gateway, node, redis = (
        labels["sk-slotkeeper-gateway"],
        labels["sk-slotkeeper-node"],
        labels["sk-slotkeeper-redis"],
    )
    node_policy, redis_policy = policies["sk-slotkeeper-node"], policies["sk-slotkeeper-redis"]
    # Each policy selects its own pods, and no one else's.
    assert _selects(node_policy, node) and not _selects(node_policy, gateway)
    assert _selects(policies["sk-slotkeeper-gateway"], gateway) and _selects(redis_policy, redis)
    # Nodes (agent and engines, every TCP port): from gateway pods; from other nodes (a handoff's
    # prefill on another node), the agent's port only. Redis: gateway and nodes.
    rule, peers = node_policy["spec"]["ingress"]
    (peer,) = _peer_labels(rule)
    assert _matches(peer, gateway) and not _matches(peer, node)
    assert rule["ports"] == [{"protocol": "TCP", "port": 1, "endPort": 65535}]
    (peer,) = _peer_labels(peers)
    assert _matches(peer, node) and not _matches(peer, gateway)
    assert peers["ports"] == [{"protocol": "TCP", "port": 8070}]
    froms = _peer_labels(redis_policy["spec"]["ingress"][0])
    assert any(_matches(f, gateway) for f in froms) and any(_matches(f, node) for f in froms)
    assert ("Egress" in node_policy["spec"]["policyTypes"]) is egress
    if egress:
        rules = node_policy["spec"]["egress"]
        assert {"ipBlock": {"cidr": "10.0.0.0/16"}} in [p for r in rules for p in r.get("to", [])]
        to_nodes = [r for r in rules if any(_matches(p, node) for p in _peer_labels(r))]
        assert [r["ports"] for r in to_nodes] == [[{"protocol": "TCP", "port": 8070}]]
        assert any({"protocol": "UDP", "port": 53} in r.get("ports", []) for r in rules)  # DNS


def test_gateway_replicas_spread_and_autoscale() -> None:
    fixed = render("demo-values.yaml")
    spec = fixed[("Deployment", "sk-slotkeeper-gateway")]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    spread = spec["template"]["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    assert all(_matches(c["labelSelector"]["matchLabels"], labels) for c in spread)
    assert spec["replicas"] >= 1 and ("HorizontalPodAutoscaler", "sk-slotkeeper-gateway") not in fixed
    scaled = render(
        "demo-values.yaml", sets=("gateway.autoscaling.enabled=true", "gateway.autoscaling.maxReplicas=6")
    )
    hpa = scaled[("HorizontalPodAutoscaler", "sk-slotkeeper-gateway")]
    kubernetes_validate.validate(hpa, "1.30.0", strict=True)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "sk-slotkeeper-gateway",
    }
    assert hpa["spec"]["maxReplicas"] == 6
    assert "replicas" not in scaled[("Deployment", "sk-slotkeeper-gateway")]["spec"]  # the HPA owns it
    assert "/gateway/autoscaling/targetCPUUtilizationPercentage" in render_error(
        KEY, "redis.enabled=true", "s3.bucket=b", "gateway.autoscaling.targetCPUUtilizationPercentage=0"
    )


@pytest.mark.parametrize(
    ("sets", "kinds"),
    [
        ((), ["Resource"]),
        (("gateway.autoscaling.inFlightTarget=16",), ["Resource", "Pods"]),
        (
            (
                "gateway.autoscaling.targetCPUUtilizationPercentage=null",
                "gateway.autoscaling.inFlightTarget=8",
            ),
            ["Pods"],
        ),
    ],
)
def test_the_gateway_autoscales_on_cpu_on_requests_in_flight_or_both(
    sets: tuple[str, ...], kinds: list[str]
) -> None:
    docs = render("demo-values.yaml", sets=("gateway.autoscaling.enabled=true", *sets))
    hpa = docs[("HorizontalPodAutoscaler", "sk-slotkeeper-gateway")]
    kubernetes_validate.validate(hpa, "1.30.0", strict=True)
    metrics = hpa["spec"]["metrics"]
    assert [m["type"] for m in metrics] == kinds
    for m in metrics:
        if m["type"] == "Pods":
            name = m["pods"]["metric"]["name"]
            # the series the gateway exports (what the adapter rule in the chart's README serves)
            assert Metrics().registry.get_sample_value(name) == 0
            assert m["pods"]["target"] == {"type": "AverageValue", "averageValue": sets[-1].split("=")[1]}
        else:
            assert m["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}


def test_an_autoscaler_without_a_metric_is_refused() -> None:
    err = render_error(
        KEY,
        "redis.enabled=true",
        "s3.bucket=b",
        "gateway.autoscaling.enabled=true",
        "gateway.autoscaling.targetCPUUtilizationPercentage=null",
    )
    assert "gateway.autoscaling needs a metric" in err
    assert "/gateway/autoscaling/inFlightTarget" in render_error(
        KEY, "redis.enabled=true", "s3.bucket=b", "gateway.autoscaling.inFlightTarget=0"
    )


# -- security contexts: non-root, read-only root filesystem, every write on a volume ----------------
DOCKERFILE = (CHART.parents[1] / "Dockerfile").read_text()
IMAGE_USER = tuple(int(i) for i in re.findall(r"^USER (\d+):(\d+)$", DOCKERFILE, re.M)[-1])
IMAGE_ENV = dict(re.findall(r"\b(HOME|SLOTKEEPER_DATA_DIR)=(\S+)", DOCKERFILE))
IMAGE_WORKDIR = re.findall(r"^WORKDIR (\S+)$", DOCKERFILE, re.M)[-1]
REDIS_WORKDIR = "/data"  # the official redis image's WORKDIR, where a dump would be written


def workloads(docs: dict[tuple[str, str], Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """Every pod spec the chart renders: Deployments, the StatefulSet, the `helm test` pod."""
    return {
        (kind, name): (d["spec"] if kind == "Pod" else d["spec"]["template"]["spec"])
        for (kind, name), d in docs.items()
        if kind in ("Deployment", "StatefulSet", "Pod")
    }


def effective(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
    """What a container runs with: the pod's securityContext, overridden field by field by its own."""
    return {**pod.get("securityContext", {}), **container.get("securityContext", {})}


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_container_runs_non_root_with_a_read_only_root_and_no_capabilities(
    values: tuple[str, ...],
) -> None:
    docs = render(*values, sets=("gateway.autoscaling.enabled=true",))
    pods = workloads(docs)
    chart_pods = {"sk-slotkeeper-gateway", "sk-slotkeeper-node", "sk-slotkeeper-test-chat"}
    assert chart_pods <= {name for _, name in pods}
    for (kind, name), pod in pods.items():
        for c in pod.get("initContainers", []) + pod["containers"]:
            ctx = effective(pod, c)
            where = f"{kind}/{name}/{c['name']}"
            assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] > 0, where  # numeric: checkable
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert ctx["allowPrivilegeEscalation"] is False, where
            assert ctx["readOnlyRootFilesystem"] is True, where
            assert ctx["capabilities"] == {"drop": ["ALL"]}, where
        if pod["containers"][0]["image"].startswith("slotkeeper:"):
            # the chart's image: its user, and that user's group owns the volumes
            sc = pod["securityContext"]
            assert (sc["runAsUser"], sc["runAsGroup"]) == IMAGE_USER, name
            assert sc.get("fsGroup", IMAGE_USER[1]) == IMAGE_USER[1], name
    if ("Deployment", "sk-slotkeeper-redis") in pods:
        redis = pods[("Deployment", "sk-slotkeeper-redis")]["securityContext"]
        assert (redis["runAsUser"], redis["runAsGroup"]) == (999, 1000)  # redis:*-alpine's user


def writable(pod: dict[str, Any], container: dict[str, Any], claims: set[str], path: str) -> bool:
    """`path` lies on a volume the container mounts read-write (a pod volume or a claim template)."""
    volumes = {v["name"] for v in pod.get("volumes", [])} | claims
    return any(
        m["name"] in volumes
        and not m.get("readOnly", False)
        and (path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"))
        for m in container.get("volumeMounts", [])
    )


@pytest.mark.parametrize("values", VALUE_SETS)
def test_everything_the_processes_write_lands_on_a_mounted_volume(values: tuple[str, ...]) -> None:
    """With the root filesystem read-only, every path a process writes must be a volume: the data
    dir as the real settings parse it from the rendered environment, the engines' slot dirs and logs
    as the node derives them, /tmp (no TMPDIR is set), and the image's HOME and working directory."""
    docs = render(*values)
    pods = workloads(docs)
    tmp = "/tmp"
    image_paths = [tmp, IMAGE_ENV["HOME"], IMAGE_WORKDIR]

    gw_env, _ = container_env(docs, "Deployment", "sk-slotkeeper-gateway", FAKE)
    assert not {"TMPDIR", "TEMP", "TMP", "HOME"} & gw_env.keys()
    gw_pod = pods[("Deployment", "sk-slotkeeper-gateway")]
    for path in [parse_settings([], gw_env).data_dir, *image_paths]:
        assert writable(gw_pod, gw_pod["containers"][0], set(), path), f"gateway writes {path}"

    node_env, _ = container_env(docs, "StatefulSet", "sk-slotkeeper-node", FAKE)
    assert not {"TMPDIR", "TEMP", "TMP", "HOME"} & node_env.keys()
    node = parse_node_settings([], node_env)
    sts = docs[("StatefulSet", "sk-slotkeeper-node")]["spec"]
    claims = {t["metadata"]["name"] for t in sts.get("volumeClaimTemplates", [])}
    engine_paths = [str(p) for e in node.engine_specs() for p in (e.slot_dir, e.log_path)]
    node_pod = pods[("StatefulSet", "sk-slotkeeper-node")]
    for path in [str(node.data_path), str(node.data_path / "spill"), *engine_paths, *image_paths]:
        assert writable(node_pod, node_pod["containers"][0], claims, path), f"node writes {path}"

    test_pod = pods[("Pod", "sk-slotkeeper-test-chat")]
    assert writable(test_pod, test_pod["containers"][0], set(), tmp)
    if ("Deployment", "sk-slotkeeper-redis") in pods:
        redis = pods[("Deployment", "sk-slotkeeper-redis")]
        assert writable(redis, redis["containers"][0], set(), REDIS_WORKDIR)


def test_security_contexts_are_the_operators_to_change() -> None:
    """Single keys override (a platform that assigns uids, a Debian redis tag, a writable root); null
    drops a whole context; `{}` keeps the defaults, as Helm merges maps (what values.yaml says)."""
    docs = render(
        "demo-values.yaml",
        sets=(
            "gateway.securityContext.readOnlyRootFilesystem=false",
            "redis.podSecurityContext.runAsGroup=999",
            "node.podSecurityContext=null",
        ),
        set_json=(
            'gateway.podSecurityContext={"runAsUser": null, "runAsGroup": null, "fsGroup": null}',
            "node.securityContext=null",
            "redis.securityContext={}",
        ),
    )
    gw = pod_spec(docs, "Deployment", "sk-slotkeeper-gateway")
    assert gw["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert gw["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False
    assert gw["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    node = pod_spec(docs, "StatefulSet", "sk-slotkeeper-node")
    assert "securityContext" not in node and "securityContext" not in node["containers"][0]
    redis = pod_spec(docs, "Deployment", "sk-slotkeeper-redis")
    assert redis["securityContext"]["runAsGroup"] == 999
    assert redis["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    for doc in docs.values():
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, "1.30.0", strict=True)


@pytest.mark.parametrize("persist", [False, True])
def test_the_in_chart_redis_keeps_its_index_on_a_volume_only_when_asked(persist: bool) -> None:
    sets = ("redis.enabled=true", KEY, "s3.bucket=b", f"redis.persistence.enabled={str(persist).lower()}")
    docs = render(
        sets=(*sets, "redis.persistence.appendfsync=always", "redis.persistence.size=2Gi"), set_json=(MODELS,)
    )
    spec = pod_spec(docs, "Deployment", "sk-slotkeeper-redis")
    args = spec["containers"][0]["args"]
    (data,) = [v for v in spec["volumes"] if v["name"] == "data"]
    if persist:
        assert args == ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        claim = docs[("PersistentVolumeClaim", "sk-slotkeeper-redis-data")]
        assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
        assert data == {"name": "data", "persistentVolumeClaim": {"claimName": "sk-slotkeeper-redis-data"}}
    else:
        assert args == ["--save", "", "--appendonly", "no"]
        assert data == {"name": "data", "emptyDir": {}} and not any(
            k == "PersistentVolumeClaim" for k, _ in docs
        )
    assert "/redis/persistence/appendfsync" in render_error(*sets, "redis.persistence.appendfsync=sometimes")


# -- a chart that comes up on a plain cluster --------------------------------------------------------
CI_VALUES = sorted(p.name for p in (CHART / "ci").glob("*.yaml"))
HOST = re.compile(r"\b([a-z0-9]([-a-z0-9.]*[a-z0-9])?)\.svc(?:\.[a-z0-9.-]+)?(?=[:/\"\s]|$)")


def _walk(value: Any) -> Iterable[Any]:
    yield value
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v)


def _service_of(host: str) -> tuple[str, str]:
    """`pod.service.ns` or `service.ns` (the labels before `.svc`) → (service, namespace)."""
    labels = host.split(".")
    return labels[-2], labels[-1]


def named_objects(doc: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(kind, name, namespace) of every Service, Secret, ConfigMap and PersistentVolumeClaim that a
    rendered object names: env and envFrom references, volumes, image pull secrets, a StatefulSet's
    Service, and the Services in the cluster URLs it carries (ConfigMap values, Secret values, env)."""
    ns = "ai"
    found: set[tuple[str, str, str]] = set()
    if doc["kind"] == "StatefulSet":
        found.add(("Service", doc["spec"]["serviceName"], ns))
    texts = [v for v in _walk(doc) if isinstance(v, str)]
    if doc["kind"] == "Secret":
        texts += [base64.b64decode(v).decode() for v in (doc.get("data") or {}).values()]
    for node in _walk(doc):
        if not isinstance(node, dict):
            continue
        for key, kind, field in (
            ("secretKeyRef", "Secret", "name"),
            ("secretRef", "Secret", "name"),
            ("configMapKeyRef", "ConfigMap", "name"),
            ("configMapRef", "ConfigMap", "name"),
            ("configMap", "ConfigMap", "name"),
            ("secret", "Secret", "secretName"),
            ("persistentVolumeClaim", "PersistentVolumeClaim", "claimName"),
        ):
            if isinstance(node.get(key), dict) and field in node[key]:
                found.add((kind, node[key][field], ns))
        for pull in node.get("imagePullSecrets") or []:
            found.add(("Secret", pull["name"], ns))
    for text in texts:
        for match in HOST.finditer(text):
            found.add(("Service", *_service_of(match.group(1))))
    return found


def declared_external(values: dict[str, Any]) -> set[tuple[str, str, str]]:
    """What the values name as the operator's own: Secrets (`existingSecret`, `imagePullSecrets`),
    claims (`claimName`), and Services in the URLs given (`s3.endpoint`, `redis.url`)."""
    ns = "ai"
    out: set[tuple[str, str, str]] = set()
    for node in _walk(values):
        if not isinstance(node, dict):
            continue
        if node.get("existingSecret"):
            out.add(("Secret", node["existingSecret"], ns))
        if node.get("claimName"):
            out.add(("PersistentVolumeClaim", node["claimName"], ns))
    out |= {("Secret", s["name"], ns) for s in values.get("imagePullSecrets") or []}
    for url in (values.get("s3", {}).get("endpoint"), values.get("redis", {}).get("url")):
        for match in HOST.finditer(url or ""):
            out.add(("Service", *_service_of(match.group(1))))
    return out


@pytest.mark.parametrize("values", CI_VALUES)
def test_every_object_a_manifest_names_is_rendered_or_declared_external(values: str) -> None:
    """A Service, Secret, ConfigMap or claim that nothing renders and the values do not name as the
    operator's own would leave a pod Pending or a client resolving nothing."""
    docs = render(values, api_versions=MONITORING)
    rendered = {(kind, name, "ai") for kind, name in docs}
    named = set().union(*(named_objects(doc) for doc in docs.values()))
    assert {kind for kind, _, _ in named} >= {"Service", "Secret", "ConfigMap"}  # the walk finds them
    external = declared_external(user_values((values,)))
    assert named - rendered - external == set()


def test_the_demo_values_come_up_with_nothing_outside_the_release() -> None:
    """The README's demo install: its own Redis, S3 (with the bucket made before a pod starts) and
    models; no ServiceMonitor where the Prometheus Operator is not installed."""
    values = user_values(("demo-values.yaml",))
    assert declared_external(values) == set()
    docs = render("demo-values.yaml")
    assert not [k for k in docs if k[0] == "ServiceMonitor"]  # a plain cluster has no such kind
    assert {("Deployment", "sk-slotkeeper-redis"), ("Deployment", "sk-slotkeeper-s3")} <= docs.keys()
    s3 = pod_spec(docs, "Deployment", "sk-slotkeeper-s3")["containers"][0]
    assert s3["image"] == "chrislusf/seaweedfs:4.48"  # pinned: the release the suite's S3 runs
    for kind, name in (("Deployment", "sk-slotkeeper-gateway"), ("StatefulSet", "sk-slotkeeper-node")):
        inits = [c["name"] for c in pod_spec(docs, kind, name).get("initContainers", [])]
        assert "s3-bucket" in inits, name
    node = pod_spec(docs, "StatefulSet", "sk-slotkeeper-node")
    made = {c["env"][0]["value"] for c in node["initContainers"] if c["name"].startswith("make-model-")}
    node_env, _ = container_env(docs, "StatefulSet", "sk-slotkeeper-node", FAKE)
    assert set(parse_node_settings([], node_env).models) == made  # every model the node loads is made
    assert "emptyDir" in next(v for v in node["volumes"] if v["name"] == "models")


def test_the_service_monitor_needs_its_crd() -> None:
    plain = render("demo-values.yaml")
    assert ("ServiceMonitor", "sk-slotkeeper-gateway") not in plain
    with_crd = render("demo-values.yaml", api_versions=MONITORING)
    assert with_crd[("ServiceMonitor", "sk-slotkeeper-gateway")]["apiVersion"] == "monitoring.coreos.com/v1"


def test_the_internal_key_is_generated_once_and_shared_when_not_given() -> None:
    docs = render("external-values.yaml")  # gives no internalKey
    secret = docs[("Secret", "sk-slotkeeper-secrets")]["data"]
    key = base64.b64decode(secret["internal-key"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", key)
    for kind, name in (("Deployment", "sk-slotkeeper-gateway"), ("StatefulSet", "sk-slotkeeper-node")):
        (ref,) = [
            e["valueFrom"]["secretKeyRef"]
            for e in pod_spec(docs, kind, name)["containers"][0]["env"]
            if e["name"] == "SLOTKEEPER_INTERNAL_KEY"
        ]
        assert ref == {"name": "sk-slotkeeper-secrets", "key": "internal-key"}, name
    given = render("external-values.yaml", sets=(KEY,))[("Secret", "sk-slotkeeper-secrets")]["data"]
    assert base64.b64decode(given["internal-key"]).decode() == KEY.split("=", 1)[1]


@pytest.mark.parametrize(
    ("sets", "set_json", "message"),
    [
        ((), (), "node.models need a source"),
        (("node.models[0].path=/opt/models/lfm2.gguf",), (MODELS,), "is outside node.modelVolume.mountPath"),
        (("s3.inCluster.enabled=true",), (MODELS,), "s3.inCluster needs s3.accessKey and s3.secretKey"),
    ],
)
def test_models_and_the_in_chart_store_say_what_they_need(
    sets: tuple[str, ...], set_json: tuple[str, ...], message: str
) -> None:
    with pytest.raises(helm_python.HelmError) as err:
        template(user_values((), (KEY, "redis.enabled=true", "s3.bucket=b", *sets), set_json))
    assert message in str(err.value)


def test_a_download_without_its_sha256_is_refused_by_the_schema() -> None:
    files = 'node.modelDownload.files=[{"url": "https://m.example/m.gguf", "path": "model.gguf"}]'
    with pytest.raises(helm_python.HelmError) as err:
        template(user_values((), (KEY, "redis.enabled=true", "s3.bucket=b"), (files,)))
    assert "sha256" in str(err.value)


def _init_script(docs: dict[tuple[str, str], Any], name: str) -> tuple[str, dict[str, str]]:
    node = pod_spec(docs, "StatefulSet", "sk-slotkeeper-node")
    (c,) = [c for c in node["initContainers"] if c["name"] == name]
    return c["command"][-1], {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def test_the_model_download_checks_each_files_sha256(tmp_path: Path) -> None:
    """The init container's script as rendered, run here with `file://` URLs: a file whose sum
    matches lands in the models volume, one that does not is deleted and stops the pod."""
    source = tmp_path / "source.gguf"
    source.write_bytes(b"GGUF model bytes")
    good = hashlib.sha256(source.read_bytes()).hexdigest()
    files = [{"url": source.as_uri(), "sha256": good, "path": "sub/model.gguf"}]
    docs = render("external-values.yaml", set_json=(f"node.modelDownload.files={json.dumps(files)}",))
    script, env = _init_script(docs, "fetch-models")
    models = tmp_path / "models"
    run_env = {"PATH": os.environ["PATH"], "MODELS": env["MODELS"], "MODELS_DIR": str(models)}
    ran = subprocess.run(["sh", "-c", script], env=run_env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert (models / "sub" / "model.gguf").read_bytes() == source.read_bytes()
    again = subprocess.run(["sh", "-c", script], env=run_env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "present, sha256 ok" in again.stdout  # a restarted pod keeps it

    bad = [{**files[0], "sha256": "0" * 64, "path": "other.gguf"}]
    docs = render("external-values.yaml", set_json=(f"node.modelDownload.files={json.dumps(bad)}",))
    script, env = _init_script(docs, "fetch-models")
    run_env["MODELS"] = env["MODELS"]
    refused = subprocess.run(["sh", "-c", script], env=run_env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and f"sha256 {good}, expected {'0' * 64}" in refused.stderr
    assert not list(models.glob("other.gguf*"))


def test_the_bucket_init_container_creates_the_bucket_once(moto_server: Any) -> None:
    """The `s3-bucket` init container's script as rendered, against a real S3 server: the first pod
    creates the bucket, every later one finds it."""
    docs = render("demo-values.yaml", sets=(f"s3.bucket=init-{os.getpid()}",))
    node = pod_spec(docs, "StatefulSet", "sk-slotkeeper-node")
    (c,) = [c for c in node["initContainers"] if c["name"] == "s3-bucket"]
    env, _ = container_env(docs, "StatefulSet", "sk-slotkeeper-node", FAKE)
    assert env["SLOTKEEPER_S3_ENDPOINT"] == "http://sk-slotkeeper-s3.ai.svc.cluster.local:8333"
    assert {e["name"] for e in c["env"]} == {"SLOTKEEPER_S3_ACCESS_KEY", "SLOTKEEPER_S3_SECRET_KEY"}
    run_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLOTKEEPER_", "AWS_"))},
        "SLOTKEEPER_S3_ENDPOINT": moto_server.endpoint,
        "SLOTKEEPER_S3_BUCKET": env["SLOTKEEPER_S3_BUCKET"],
        "SLOTKEEPER_S3_ACCESS_KEY": "test",
        "SLOTKEEPER_S3_SECRET_KEY": "test",
    }
    cmd = [sys.executable, *c["command"][1:]]
    first = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and "created" in first.stdout, first.stdout + first.stderr
    second = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and "already" in second.stdout, second.stdout + second.stderr


def test_the_image_is_what_build_image_builds_and_its_push_is_documented() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    image = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    docs = render("demo-values.yaml")
    assert pod_spec(docs, "Deployment", "sk-slotkeeper-gateway")["containers"][0]["image"] == image
    readme = (CHART / "README.md").read_text()
    assert f".ci/build-image {image}" in readme  # the tag the chart pulls
    assert "buildah push" in readme


@pytest.mark.parametrize(
    ("sets", "topology", "in_chart"),
    [
        (("redis.enabled=true",), "standalone", True),
        (("redis.mode=standalone",), "standalone", True),
        (("redis.url=redis://:pw@r.example:6379/0",), "standalone", False),
        (("redis.mode=external", "redis.url=redis-cluster://a:6379\\,b:6379"), "cluster", False),
        (
            (
                "redis.mode=cluster",
                "redis.cluster.nodes={a:6379,b:6379}",
                "redis.password=p@ss",
                "redis.tls=true",
            ),
            "cluster",
            False,
        ),
        (
            ("redis.mode=sentinel", "redis.sentinel.nodes={s0:26379,s1:26379}", "redis.sentinel.password=x"),
            "sentinel",
            False,
        ),
    ],
)
def test_each_redis_mode_renders_a_url_the_processes_read(
    sets: tuple[str, ...], topology: str, in_chart: bool
) -> None:
    """redis.mode: the chart's Secret holds a --redis-url of that topology, which the real settings
    accept; only standalone runs a Redis in the release."""
    import base64

    from storage.index.topology import parse_redis_url

    docs = render(sets=(KEY, "s3.bucket=b", *sets), set_json=(MODELS,))
    secret = next(
        d for (kind, _), d in docs.items() if kind == "Secret" and "redis-url" in (d.get("data") or {})
    )
    url = base64.b64decode(secret["data"]["redis-url"]).decode()
    target = parse_redis_url(url)
    assert target.topology.value == topology, url
    if "redis.password=p@ss" in sets:
        assert target.password == "p@ss" and target.tls
    if topology == "sentinel":
        assert target.master == "mymaster" and target.options == {"sentinel_password": "x"}
    gw_env, _ = container_env(
        docs, "Deployment", "sk-slotkeeper-gateway", {**FAKE, "SLOTKEEPER_REDIS_URL": url}
    )
    assert parse_settings([], gw_env).redis_url == url
    assert (("Deployment", "sk-slotkeeper-redis") in docs) is in_chart


@pytest.mark.parametrize(
    ("sets", "where"),
    [
        (("redis.mode=cluster",), "redis.cluster.nodes"),
        (("redis.mode=cluster", "redis.cluster.nodes={a}"), "/redis/cluster/nodes/0"),
    ],
)
def test_a_redis_mode_without_its_nodes_is_refused(sets: tuple[str, ...], where: str) -> None:
    assert where in render_error(KEY, "s3.bucket=b", *sets)
