"""docker/k8s/: every manifest validates offline against the Kubernetes schemas
(kubernetes-validate), the custom resources against what their operators read, the drain
and probe settings agree with the server's own flags and endpoints, and the secure defaults
hold: the key from a Secret, locked-down pods, pinned images, a NetworkPolicy, Ray's ports
kept inside the cluster. (`make scan` runs checkov over the same files.)"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from engine import EngineStats
from server.metrics import EngineCollector
from server.settings import load_settings
from tests.deploy_helpers import dockerfile_instructions

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "docker" / "k8s"
KUBERNETES = "1.30.0"
CUSTOM = {"ServiceMonitor", "RayService", "Kustomization"}
VERSION = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)[1]


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


def _settings(tmp_path: Path, env: dict[str, str] | None = None):
    """The settings the server builds from the container's variables, with the Secret's key
    file where the pod would have it mounted (here: under tmp_path)."""
    env = dict(_env() if env is None else env)
    key_file = tmp_path / Path(env["TANDEM_API_KEY_FILE"]).name
    key_file.write_text("the-key\n")  # as `kubectl create secret --from-file` stores it
    return load_settings(None, {}, environ={**env, "TANDEM_API_KEY_FILE": str(key_file)})


def test_the_drain_fits_in_the_grace_period_and_matches_the_server_flag(tmp_path):
    pod = _kind("Deployment")["spec"]["template"]["spec"]
    settings = _settings(tmp_path)  # the server reads these variables
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


def test_probes_use_the_servers_health_endpoint_and_tolerate_a_busy_replica(tmp_path):
    container = _container()
    port = container["ports"][0]
    settings = _settings(tmp_path)
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


# Secure by default.

RAY_INTERNAL_PORTS = {6379, 8265, 10001}  # GCS, dashboard (job submission), Ray client
RAY_MIN_TOKEN_AUTH = (2, 52)  # Ray's token auth, which KubeRay's authOptions turns on


def _pods() -> dict[str, dict]:
    """Every pod template: the Deployment's and the RayService's head and worker groups."""
    ray = _kind("RayService")["spec"]["rayClusterConfig"]
    pods = {"Deployment": _kind("Deployment")["spec"]["template"]}
    pods["RayService head"] = ray["headGroupSpec"]["template"]
    for group in ray["workerGroupSpecs"]:
        pods[f"RayService {group['groupName']}"] = group["template"]
    return pods


def _written_paths() -> list[str]:
    """Where the server writes: the temp dir, ~/.cache, and the caches the image points
    under it (Hugging Face's, triton's, CUDA's JIT)."""
    env = {}
    for kind, rest in dockerfile_instructions():
        if kind == "ENV":
            env.update(pair.split("=", 1) for pair in rest.split())
    written = ["/tmp", "/home/tandem/.cache"]
    written += [env[name] for name in ("HF_HOME", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH")]
    return written


def _policy(name: str) -> dict:
    [policy] = [
        d for _, d in _docs() if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == name
    ]
    return policy


@pytest.mark.parametrize("name", list(_pods()))
def test_every_pod_runs_locked_down(name):
    pod = _pods()[name]["spec"]
    assert pod["automountServiceAccountToken"] is False  # no Kubernetes API to call
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 1000  # the image's user
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    containers = pod.get("initContainers", []) + pod["containers"]
    for container in containers:
        own = container["securityContext"]
        assert own["allowPrivilegeEscalation"] is False, container["name"]
        assert own["readOnlyRootFilesystem"] is True, container["name"]
        assert own["capabilities"] == {"drop": ["ALL"]}, container["name"]
        assert not own.get("privileged") and own.get("runAsUser", 1000) != 0
        # A read-only root: everything the server writes lies on a writable scratch volume.
        writable = [
            mount["mountPath"]
            for mount in container["volumeMounts"]
            if "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly")
        ]
        for path in _written_paths():
            assert any(path == w or path.startswith(w + "/") for w in writable), (name, path)


def test_images_are_pinned_to_the_release():
    images = [c["image"] for pod in _pods().values() for c in pod["spec"]["containers"]]
    assert len(images) == len(_pods())
    for image in images:  # the tag `docker build -t tandem:VERSION` gives, never :latest
        assert re.fullmatch(rf"tandem:{re.escape(VERSION)}(-ray)?", image), image


@pytest.mark.parametrize("name", list(_pods()))
def test_the_api_key_comes_from_the_secret(name, tmp_path):
    pod = _pods()[name]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert "TANDEM_API_KEY" not in env  # no key in the manifest, nor one the pod spec shows
    path = Path(env["TANDEM_API_KEY_FILE"]["value"])
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
    assert mount["readOnly"] is True
    secret = {v["name"]: v for v in pod["volumes"]}[mount["name"]]["secret"]
    assert secret["secretName"] == "tandem-api-key"
    assert secret.get("optional") is not True  # no Secret, no pod: never a server without a key
    assert secret["items"] == [{"key": "api-key", "path": path.name}]
    # Readable by the server's group (the pod's fsGroup) only, not by everyone.
    assert secret["defaultMode"] == 0o440
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    settings = _settings(tmp_path, {k: e["value"] for k, e in env.items()})
    assert settings.server.api_key == "the-key"  # what the server requires from clients


def test_the_hpa_alone_sets_the_replica_count():
    deployment = _kind("Deployment")
    assert "replicas" not in deployment["spec"]  # an apply would reset the HPA's count
    target = _kind("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "hpa.yaml" in _kind("Kustomization")["resources"]


def test_the_network_policy_admits_the_server_port_only_and_no_egress():
    policy = _policy("tandem")
    assert "networkpolicy.yaml" in _kind("Kustomization")["resources"]
    labels = _kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert policy["spec"]["egress"] == []  # the server needs no network, not even DNS
    port = _container()["ports"][0]
    rules = policy["spec"]["ingress"]
    assert rules
    for rule in rules:
        assert rule.get("from"), "a rule without `from` admits every source"
        assert rule["ports"] == [{"port": port["name"], "protocol": "TCP"}]


def test_ray_keeps_its_dashboard_and_gcs_inside_the_cluster():
    service = _kind("RayService")["spec"]
    ray = service["rayClusterConfig"]
    head = ray["headGroupSpec"]
    # The head's Service (GCS, dashboard, client, serve ports) is a ClusterIP, no Ingress.
    assert head["serviceType"] == "ClusterIP" and head["enableIngress"] is False
    assert head.get("headService", {}).get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
    assert service.get("serveService", {}).get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
    services = [d for _, d in _docs() if d["kind"] == "Service"]
    assert all(d["spec"].get("type", "ClusterIP") == "ClusterIP" for d in services)
    # Ray's own token on the dashboard and GCS, on a Ray version that has it.
    assert ray["authOptions"]["mode"] == "token"
    assert tuple(map(int, ray["rayVersion"].split(".")[:2])) >= RAY_MIN_TOKEN_AUTH
    # Inside the cluster, only the Ray pods themselves reach Ray's ports, and the KubeRay
    # operator the dashboard.
    policy = _policy("tandem-ray")
    selector = policy["spec"]["podSelector"]
    for template in [t for n, t in _pods().items() if n.startswith("RayService")]:
        assert selector["matchLabels"].items() <= template["metadata"]["labels"].items()
    ray_pods = {"podSelector": selector}
    operator = {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
    }
    rules = policy["spec"]["ingress"]
    assert any(rule["from"] == [ray_pods] and "ports" not in rule for rule in rules)
    for rule in rules:
        assert rule.get("from"), "a rule without `from` admits every source"
        ports = {p["port"] for p in rule.get("ports", [])}
        if not ports:  # every port
            assert rule["from"] == [ray_pods], rule
        elif ports & RAY_INTERNAL_PORTS:
            assert ports == {8265} and rule["from"] == [operator], rule


@pytest.mark.parametrize("name", [n for n in _pods() if n.startswith("RayService")])
def test_ray_pod_templates_validate_offline(name):
    template = _pods()[name]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "ray", **template.get("metadata", {})},
    }
    kubernetes_validate.validate({**pod, "spec": template["spec"]}, KUBERNETES, strict=True)


def test_every_checkov_skip_gives_its_reason():
    skips = [
        (path.name, value)
        for path, doc in _docs()
        for key, value in doc.get("metadata", {}).get("annotations", {}).items()
        if key.startswith("checkov.io/skip")
    ]
    assert skips  # the Deployment's, at least
    for name, value in skips:
        check, _, reason = value.partition("=")
        assert re.fullmatch(r"CKV2?_K8S_\d+", check), (name, value)
        assert "=" not in reason, (name, value)  # checkov splits the annotation on every '='
        assert len(reason.split()) >= 8, (name, value)
