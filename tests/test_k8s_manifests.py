"""docker/k8s/: every manifest validates offline against the Kubernetes schemas
(kubernetes-validate), the custom resources against what their operators read, and the
drain and probe settings agree with the server's own flags and endpoints."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from engine import EngineStats
from server.metrics import EngineCollector
from server.settings import load_settings

K8S = Path(__file__).resolve().parent.parent / "docker" / "k8s"
KUBERNETES = "1.30.0"
CUSTOM = {"ServiceMonitor", "RayService", "Kustomization"}


def _docs() -> list[tuple[Path, dict]]:
    return [
        (path, doc)
        for path in sorted(K8S.rglob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _kind(kind: str) -> dict:
    [doc] = [d for _, d in _docs() if d["kind"] == kind]
    return doc


@pytest.mark.parametrize(
    "path, doc",
    [(path, doc) for path, doc in _docs() if doc["kind"] not in CUSTOM],  # those: below
    ids=lambda v: v.name if isinstance(v, Path) else "",
)
def test_every_manifest_validates_offline(path, doc):
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # strict: no unknown field


def test_kustomization_lists_every_manifest_but_the_optional_ones():
    listed = set(_kind("Kustomization")["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed <= present
    assert present - listed == {"prometheus-adapter.yaml"}  # goes to the adapter's namespace


def _container() -> dict:
    [container] = _kind("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in _container()["env"]}


def test_the_drain_fits_in_the_grace_period_and_matches_the_server_flag():
    pod = _kind("Deployment")["spec"]["template"]["spec"]
    settings = load_settings(None, {}, environ=_env())  # the server reads these variables
    drain = settings.server.drain_timeout
    assert drain == float(_env()["TANDEM_DRAIN_TIMEOUT"]) == 30
    sleep = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    # The pod leaves the Service during the sleep, then drains; the kill comes after both.
    assert pod["terminationGracePeriodSeconds"] >= int(sleep[1]) + drain + 5
    # Likewise for Ray's workers, whose replicas drain for --drain-timeout too.
    ray = yaml.safe_load(_kind("RayService")["spec"]["serveConfigV2"])
    [app] = ray["applications"]
    assert app["args"]["overrides"]["server.drain_timeout"] == drain
    worker = _kind("RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert worker["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 5


def test_probes_use_the_servers_health_endpoint_and_tolerate_a_busy_replica():
    container = _container()
    port = container["ports"][0]
    settings = load_settings(None, {}, environ=_env())
    assert port["name"] == "http" and port["containerPort"] == settings.server.port == 8000
    assert settings.server.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert check == {"path": "/health", "port": "http"}, probe
    # Loading may take minutes; a liveness failure needs a minute of unanswered /health.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60 and live["timeoutSeconds"] >= 5
    # Readiness reacts at once: a draining replica leaves the Service within a period.
    assert container["readinessProbe"]["failureThreshold"] == 1


def test_service_monitor_hpa_and_adapter_name_real_ports_and_metrics():
    service_port = _kind("Service")["spec"]["ports"][0]
    assert service_port["targetPort"] == _container()["ports"][0]["name"]
    monitor = _kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint == {"port": service_port["name"], "path": "/metrics", "interval": "15s"}
    labels = _kind("Service")["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    metric = _kind("HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"]
    exported = {m.name for m in EngineCollector(lambda: EngineStats()).collect()}
    assert metric in exported
    rules = yaml.safe_load(_kind("ConfigMap")["data"]["config.yaml"])["rules"]
    assert rules[0]["seriesQuery"].startswith(metric + "{")
    assert rules[0]["name"]["as"] == metric


def test_the_ray_service_builds_the_served_application():
    from server import ray_serve

    spec = _kind("RayService")["spec"]
    assert _kind("RayService")["apiVersion"] == "ray.io/v1"
    config = yaml.safe_load(spec["serveConfigV2"])
    [app] = config["applications"]
    module, name = app["import_path"].split(":")
    assert module == "server.ray_serve" and getattr(ray_serve, name) is ray_serve.app_builder
    args = dict(app["args"])
    overrides = args.pop("overrides")
    inspect.signature(ray_serve.build_app).bind(overrides, **args)  # every argument known
    load_settings(None, overrides, environ={})  # every override a Tandem setting
    assert config["http_options"]["port"] == 8000
    assert spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("source", ["docker/ray-serve.yaml", "RayService"])
def test_serve_configs_validate_and_build(source):
    from ray.serve.schema import ServeDeploySchema

    if source == "RayService":
        config = yaml.safe_load(_kind("RayService")["spec"]["serveConfigV2"])
    else:
        config = yaml.safe_load((K8S.parent.parent / source).read_text())
    schema = ServeDeploySchema.model_validate(config)
    [app] = schema.applications
    path = app.import_path  # as Serve reads it: module:attribute or module.attribute
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    builder = getattr(importlib.import_module(module), name)
    builder(app.args)  # the application Serve would deploy: settings checked, no Ray needed
