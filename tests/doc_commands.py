"""Every invocation of the project's own programs that the deployment files and the docs name,
found by parsing them (tests/test_command_guard.py checks each one).

Sources: the Dockerfile (RUN, CMD, ENTRYPOINT, HEALTHCHECK, and the example lines and
backquoted commands of its comments), docker/entrypoint.sh, docker/compose*.yaml, docker/k8s/
and docker/ray-serve.yaml (container commands, args and exec probes; Ray Serve import paths),
the Makefile's recipes, and the shell code of README.md, docs/*.md and docker/README.md (fenced
and indented blocks, backquoted commands). Arguments given to the image (`docker run ... tandem
ARGS`, a compose `command:`, a pod's `args:`) become the command the image's ENTRYPOINT makes
of them, found by running the real entry point script with stand-ins for the programs it execs.

Only the standard library and PyYAML: this module is imported at collection time.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent

SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh"}
SEPARATORS = {"&&", "||", ";", ";;", "|", "&"}
CHOICE = re.compile(r"(?<=[\w+.-])\|(?=[\w+.-])")
# Programs that run the command after them: their options that take a value, and how many
# operands of their own come before the command (taskset -c 1 CMD, timeout 10 CMD).
WRAPPERS = {
    "exec": (set(), 0),
    "command": (set(), 0),
    "time": (set(), 0),
    "env": ({"-u", "-C"}, 0),
    "nice": ({"-n"}, 0),
    "taskset": (set(), 1),
    "timeout": ({"-s", "-k"}, 1),
}
SHELL_KEYWORDS = {"if", "then", "else", "elif", "do", "while", "until", "!", "{", "}"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
VENV_BIN = re.compile(r"(^|/)[\w.-]*venv[\w.-]*/bin/[^/]+$")  # .venv/bin/X, /opt/venv/bin/X
IMAGE = re.compile(r"^tandem(:[\w.-]+)?$")  # the image the Dockerfile builds (`docker build -t`)
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


@dataclass(frozen=True)
class Invocation:
    """One command line as a document gives it: the program first, its arguments after.
    `named` marks a program only named in prose (`python -m server.ray_serve` builds ...):
    it must exist and answer --help, but those words are not a command line to parse."""

    source: str  # "README.md:142"
    argv: tuple[str, ...]
    named: bool = False
    env: tuple[str, ...] = ()  # variables `docker run -e` sets in the container


@dataclass(frozen=True)
class Program:
    """What an invocation runs: kind is module (python -m), console (a [project.scripts]
    name), script (python PATH.py), code (python -c), make, shell (a .sh file), foreign
    (python -m of a package not in this repo), venv (another program of the virtual
    environment) or build-arg (docker build: args are its --build-arg names); args are the
    words after the program."""

    kind: str
    target: str
    args: tuple[str, ...]


# ---------------------------------------------------------------- shell words


def _words(line: str) -> list[str] | None:
    """Shell words of `line`, comments dropped, `;` `|` `||` `;;` words of their own even
    unspaced (a quoted `;` stays in its word); None when a quote is still open. A `|` between
    two word characters is the docs' notation for choices (off|auto), kept in its word."""
    lexer = shlex.shlex(CHOICE.sub("\x1f", line), posix=True, punctuation_chars=";|")
    lexer.whitespace_split = True
    try:
        return [word.replace("\x1f", "|") for word in lexer]
    except ValueError:
        return None


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line: split at && || ; | &, each without its leading
    variable assignments, shell keywords and wrappers (exec, nice, taskset -c N, set --)."""
    words = _words(line) or []
    commands, current = [], []
    for word in words:
        if word in SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)
    return [c for c in (_strip_prefix(c) for c in commands) if c]


def _strip_prefix(words: list[str]) -> list[str]:
    words = [w for w in words if w not in ("$@", "$*")]  # a script's own arguments passed on
    while words:
        head = words[0]
        if ASSIGNMENT.match(head) or head in SHELL_KEYWORDS:
            words = words[1:]
        elif head == "set" and words[1:2] == ["--"]:  # set -- PROGRAM ARGS; exec "$@"
            words = words[2:]
        elif head in WRAPPERS:
            takes_value, operands = WRAPPERS[head]
            words = words[1:]
            while words and words[0].startswith("-"):
                words = words[2:] if words[0] in takes_value else words[1:]
            words = words[operands:]
        else:
            break
    return words


def alternatives(argv: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Docs write choices as `off|adaptive+lookup` (no spaces, so not a pipe): the i-th
    command line takes the i-th choice of each such word."""
    choices = [w.split("|") if "|" in w.strip("|") else [w] for w in argv]
    count = max((len(c) for c in choices), default=1)
    return [tuple(c[min(i, len(c) - 1)] for c in choices) for i in range(count)]


# ---------------------------------------------------------------- what runs


@functools.cache
def console_scripts() -> dict[str, str]:
    """[project.scripts] of pyproject.toml: console name -> "module:function"."""
    text = (REPO / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
        pairs = re.findall(r'^([\w.-]+)\s*=\s*"([^"]+)"', section.group(1) if section else "", re.M)
        return dict(pairs)
    return dict(tomllib.loads(text)["project"].get("scripts", {}))


@functools.cache
def project_packages() -> frozenset[str]:
    """Top-level importable names of this repository (packages and modules at its root)."""
    found = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    return frozenset(found | {p.stem for p in REPO.glob("*.py")})


def module_file(module: str) -> Path | None:
    """The file `python -m module` runs from this repository, or None."""
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def program(argv: tuple[str, ...]) -> Program | None:
    """What `argv` runs, when it is this project's (or python -m of something else); None for
    other programs (docker, curl, kubectl, Ray's `serve`, ...)."""
    head, rest = argv[0], argv[1:]
    name = Path(head).name
    if PYTHON.match(name):  # python, /opt/venv/bin/python, .venv/bin/python3
        while rest and rest[0] in ("-u", "-O", "-B", "-E", "-I", "-s", "-S"):
            rest = rest[1:]
        if rest[:1] == ("-m",) and len(rest) > 1:
            module = rest[1]
            kind = "module" if module.split(".")[0] in project_packages() else "foreign"
            return Program(kind, module, rest[2:])
        if rest[:1] == ("-c",) and len(rest) > 1:
            return Program("code", rest[1], ())
        if rest and rest[0].endswith(".py"):
            return Program("script", rest[0], rest[1:])
        return None
    in_venv = VENV_BIN.search(head) is not None
    if name in console_scripts() and (in_venv or head == name):
        return Program("console", name, rest)
    if in_venv:  # .venv/bin/NAME: a program the install put there
        return Program("venv", name, rest)
    if head == "make":
        return Program("make", "make", tuple(w for w in rest if "=" not in w))
    if argv[:2] == ("docker", "build"):  # the image's build arguments: ARGs of the Dockerfile
        values = [b for a, b in zip(argv, argv[1:], strict=False) if a == "--build-arg"]
        values += [a.removeprefix("--build-arg=") for a in argv if a.startswith("--build-arg=")]
        return Program("build-arg", "Dockerfile", tuple(v.split("=", 1)[0] for v in values))
    if head in ("bash", "sh") and rest and rest[0].endswith(".sh"):
        return Program("shell", rest[0], rest[1:])
    if head.endswith(".sh") and "/" in head:
        return Program("shell", head, rest)
    return None


# ---------------------------------------------------------------- the image


def dockerfile(text: str | None = None) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = (REPO / "Dockerfile").read_text() if text is None else text
    out, pending, start = [], "", 0
    for number, line in enumerate(lines.splitlines(), 1):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):  # a comment inside a continued RUN
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        out.append((start, keyword.upper(), rest.strip()))
        pending = ""
    return out


def _exec_or_shell(text: str) -> tuple[list[str], bool]:
    """A Dockerfile command's words and whether it is the exec (JSON) form."""
    if text.startswith("["):
        try:
            return [str(w) for w in json.loads(text)], True
        except json.JSONDecodeError:
            pass
    return [text], False


def image_command(args: list[str] | None, text: str | None = None) -> list[str] | None:
    """The command a container of the image runs for `docker run IMAGE ARGS` (args None: no
    arguments given, CMD applies), following an ENTRYPOINT script copied into the image by
    running it with stand-ins for the programs it could exec; None when it runs none of them."""
    instructions = dockerfile(text)
    entry = cmd = None
    for _, keyword, rest in instructions:
        if keyword == "ENTRYPOINT":
            entry = _exec_or_shell(rest)
        elif keyword == "CMD":
            cmd = _exec_or_shell(rest)
    if args is not None:
        words = list(args)
    elif cmd is None:
        words = []
    else:
        words = cmd[0] if cmd[1] else ["/bin/sh", "-c", cmd[0][0]]
    if entry is None:
        return words or None
    entry_words, exec_form = entry
    if not exec_form:  # shell form: `sh -c TEXT`, which ignores CMD and arguments
        return ["/bin/sh", "-c", entry_words[0]]
    script = copied_script(entry_words[0], instructions)
    if script is None:
        return [*entry_words, *words]
    return run_with_stand_ins(script, [*entry_words[1:], *words])


def copied_script(name: str, instructions: list[tuple[int, str, str]]) -> Path | None:
    """The repository file a COPY installs as `name` (a path, or a name on PATH)."""
    for _, keyword, rest in instructions:
        if keyword != "COPY":
            continue
        parts = [p for p in rest.split() if not p.startswith("--")]
        if len(parts) == 2 and (parts[1] == name or Path(parts[1]).name == name):
            return REPO / parts[0]
    return None


def run_with_stand_ins(script: Path, args: list[str]) -> list[str] | None:
    """What `script ARGS` execs, with each console script replaced by a stand-in that prints
    its arguments; None when it execs anything else (nothing else is on PATH)."""
    with tempfile.TemporaryDirectory() as bin_dir:
        for name in console_scripts():
            stand_in = Path(bin_dir) / name
            stand_in.write_text('#!/bin/sh\nprintf "%s\\0" "${0##*/}" "$@"\n')
            stand_in.chmod(0o755)
        done = subprocess.run(
            ["/bin/sh", str(script), *args],
            env={"PATH": bin_dir},
            capture_output=True,
            timeout=10,
        )
    if done.returncode != 0 or not done.stdout:
        return None
    return done.stdout.decode().split("\0")[:-1]


def _is_our_image(image: object) -> bool:
    name = str(image or "")
    name = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", name)  # ${TANDEM_IMAGE:-tandem:latest}
    return bool(IMAGE.match(name.rsplit("/", 1)[-1]))


def dockerfile_invocations(text: str | None = None, label: str = "Dockerfile") -> list[Invocation]:
    """RUN and HEALTHCHECK commands, the container's default command (ENTRYPOINT and CMD,
    at the line of the last of them), and the commands of the comments."""
    found, default_at = [], None
    for line, keyword, rest in dockerfile(text):
        if keyword == "HEALTHCHECK":
            rest = rest.partition(" CMD ")[2] or rest.removeprefix("CMD ")
            keyword = "RUN"
        if keyword == "RUN":
            words, exec_form = _exec_or_shell(rest)
            if exec_form:
                found.append(Invocation(f"{label}:{line}", tuple(words)))
            else:
                found += _shell_line(words[0], f"{label}:{line}")
        elif keyword in ("ENTRYPOINT", "CMD"):
            default_at = line
    command = image_command(None, text) if default_at else None
    if command:
        found += _command_value(command, f"{label}:{default_at} (ENTRYPOINT and CMD)")
    raw = (REPO / "Dockerfile").read_text() if text is None else text
    found += markdown_invocations(comment_text(raw), label, comments=True, image_text=text)
    return found


# ---------------------------------------------------------------- docs and scripts


def _shell_line(
    line: str, source: str, prose: bool = False, image_text: str | None = None
) -> list[Invocation]:
    found = []
    for words in simple_commands(line):
        env: tuple[str, ...] = ()
        if words[:2] == ["docker", "run"]:
            env = _docker_run_env(words)
            words = _docker_run(words, image_text) or words
        found.append(Invocation(source, tuple(words), named=prose, env=env))
    return found


def _docker_run(words: list[str], image_text: str | None) -> list[str] | None:
    """`docker run [options] tandem[:tag] ARGS`: the command the container runs."""
    for i, word in enumerate(words[2:], 2):
        if IMAGE.match(word):
            args = words[i + 1 :]
            return image_command(args if args else None, image_text)
    return None


def _docker_run_env(words: list[str]) -> tuple[str, ...]:
    """The variables `docker run -e NAME=VALUE` (or --env) sets on the image."""
    names = []
    for i, word in enumerate(words):
        if IMAGE.match(word):
            break
        if word in ("-e", "--env") and i + 1 < len(words):
            names.append(words[i + 1].split("=", 1)[0])
        elif word.startswith("--env="):
            names.append(word.removeprefix("--env=").split("=", 1)[0])
    return tuple(names)


def _logical_lines(lines: list[tuple[int, str]], join_quotes: bool) -> Iterator[tuple[int, str]]:
    """Lines with backslash continuations joined, and with join_quotes lines inside an open
    quote too (curl -d '{ ... }'), each with its first line's number."""
    pending, start = "", 0
    for number, line in lines:
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        pending += line
        if join_quotes and _words(pending) is None:
            pending += "\n"
            continue
        yield start, pending
        pending = ""
    if pending:
        yield start, pending


def markdown_invocations(
    text: str, label: str, comments: bool = False, image_text: str | None = None
) -> list[Invocation]:
    """Shell commands of a Markdown text: fenced blocks in a shell language (or none), blocks
    indented by 4 spaces after a blank line, and backquoted commands in prose (`named` when
    they are a program's name alone). comments: the text of a file's comments, where example
    lines are indented by 2 and may follow prose directly."""
    indent = 2 if comments else 4
    found: list[Invocation] = []
    block: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    fence = language = None
    previous_blank = True

    def flush_block() -> None:
        for number, line in _logical_lines(block, join_quotes=not comments):
            line = line.strip().removeprefix("$ ")
            found.extend(_shell_line(line, f"{label}:{number}", image_text=image_text))
        block.clear()

    def flush_prose() -> None:
        joined = " ".join(line.strip() for _, line in prose)
        for match in INLINE_CODE.finditer(joined):
            source = f"{label}:{_line_of(prose, match.start())}"
            found.extend(_shell_line(match.group(2).strip(), source, True, image_text))
        prose.clear()

    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith(fence):
                if language in SHELL_LANGUAGES:
                    flush_block()
                block.clear()
                fence = None
            else:
                block.append((number, line))
            continue
        if stripped.startswith(("```", "~~~")):
            flush_block()
            flush_prose()
            fence, language = stripped[:3], stripped[3:].strip().lower()
            continue
        if stripped and line.startswith(" " * indent) and (previous_blank or block or comments):
            flush_prose()
            block.append((number, line))
            previous_blank = False
            continue
        flush_block()
        if stripped:
            prose.append((number, line))
        else:
            flush_prose()
        previous_blank = not stripped
    flush_block()
    flush_prose()
    return found


def _line_of(prose: list[tuple[int, str]], position: int) -> int:
    """The line number of character `position` of the prose lines stripped and joined by
    single spaces."""
    for number, line in prose:
        if position <= len(line.strip()):
            return number
        position -= len(line.strip()) + 1
    return prose[-1][0]


def comment_text(text: str) -> str:
    """A file's `#` comments, line for line (other lines blank), without the `#`."""
    return "\n".join(
        line.lstrip()[1:] if line.lstrip().startswith("#") else "" for line in text.splitlines()
    )


def shell_script_invocations(path: Path) -> list[Invocation]:
    label = _label(path)
    numbered = [
        (n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()
    ]
    found = []
    for number, line in _logical_lines(numbered, join_quotes=False):
        found += _shell_line(line.strip(), f"{label}:{number}")
    return found


def makefile_invocations(text: str | None = None) -> list[Invocation]:
    """The Makefile's recipe lines, its variables' defaults substituted."""
    text = (REPO / "Makefile").read_text() if text is None else text
    values = dict(re.findall(r"^([A-Z_]+)\s*[?:]?=[ \t]*(.*)$", text, re.M))

    def expand(line: str) -> str:
        for _ in range(5):
            line = re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), line)
        return line.replace("$@", "TARGET")

    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("\t"):
            found += _shell_line(expand(line.strip()), f"Makefile:{number}")
    return found


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    targets = set()
    for names in re.findall(r"^([^\s#=:][^=:]*?)\s*:(?!=)", text, re.M):
        targets.update(names.split())
    return targets


# ---------------------------------------------------------------- YAML


def _label(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def _argv(value: object) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else shlex.split(str(value))


def _command_value(value: object, source: str) -> list[Invocation]:
    """A YAML command: a list is argv (sh -c SCRIPT: the script), a string a shell line."""
    if isinstance(value, str):
        return _shell_line(value, source)
    argv = _argv(value)
    if argv[:1] == ["CMD-SHELL"]:
        return _shell_line(" ".join(argv[1:]), source)
    if argv[:1] == ["CMD"]:
        argv = argv[1:]
    if len(argv) >= 3 and Path(argv[0]).name in ("sh", "bash") and argv[1] == "-c":
        return _shell_line(argv[2], source)
    return [Invocation(source, tuple(argv))] if argv else []


def _compose_services(path: Path) -> dict[str, dict]:
    return yaml.safe_load(path.read_text()).get("services") or {}


def _builds_our_image(path: Path, service: dict) -> bool:
    build = service.get("build") or {}
    if isinstance(build, str):
        build = {"context": build}
    built = path.parent / build.get("context", ".") / build.get("dockerfile", "Dockerfile")
    return bool(build) and built.resolve() == REPO / "Dockerfile"


def compose_service_is_ours(path: Path, name: str, service: dict) -> bool:
    """A service on the image: by its image or build, or, in an override file that names
    neither (compose.gpu.yaml), when a compose file beside it has it on the image."""
    if "image" in service or "build" in service:
        return _is_our_image(service.get("image")) or _builds_our_image(path, service)
    for other in sorted(path.parent.glob("compose*.yaml")):
        base = _compose_services(other).get(name) or {}
        if other != path and ("image" in base or "build" in base):
            return compose_service_is_ours(other, name, base)
    return False


def compose_invocations(path: Path) -> list[Invocation]:
    label = _label(path)
    found = []
    for name, service in _compose_services(path).items():
        where = f"{label} services.{name}"
        ours = compose_service_is_ours(path, name, service)
        if ours and ("command" in service or "entrypoint" in service):
            if "entrypoint" in service:
                found += _command_value(
                    _argv(service["entrypoint"]) + _argv(service.get("command")), where
                )
            else:
                command = image_command(_argv(service["command"]))
                if command:
                    found.append(Invocation(f"{where}.command", tuple(command)))
        elif "command" in service:
            found += _command_value(service["command"], f"{where}.command")
        test = (service.get("healthcheck") or {}).get("test")
        if test is not None and test != ["NONE"]:
            found += _command_value(test, f"{where}.healthcheck")
    return found


def _walk(node: object, path: str) -> Iterator[tuple[str, dict]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def kubernetes_invocations(path: Path) -> list[Invocation]:
    """Containers' command and args (with the image's ENTRYPOINT for args alone), exec probes
    and lifecycle hooks, in every document of a manifest."""
    label = _label(path)
    found = []
    for doc in yaml.safe_load_all(path.read_text()):
        for where, node in _walk(doc, label):
            containers = [*(node.get("containers") or []), *(node.get("initContainers") or [])]
            for container in containers:
                at = f"{where}.containers.{container.get('name')}"
                command, args = container.get("command"), container.get("args")
                if command is not None:
                    found += _command_value(_argv(command) + _argv(args), at)
                elif args is not None and _is_our_image(container.get("image")):
                    resolved = image_command(_argv(args))
                    if resolved:
                        found.append(Invocation(f"{at}.args", tuple(resolved)))
                for key in ("startupProbe", "readinessProbe", "livenessProbe"):
                    exec_ = (container.get(key) or {}).get("exec")
                    if exec_:
                        found += _command_value(exec_.get("command"), f"{at}.{key}")
                for hook, spec in (container.get("lifecycle") or {}).items():
                    if (spec or {}).get("exec"):
                        found += _command_value(spec["exec"].get("command"), f"{at}.{hook}")
    return found


def image_variables() -> list[tuple[str, str]]:
    """(source, NAME) of every variable set for the image: the Dockerfile's ENV, compose's
    environment of the services on the image, the env of pods' containers on it, and
    `docker run -e` in the docs."""
    found = []
    for line, keyword, rest in dockerfile():
        if keyword == "ENV":
            pairs = shlex.split(rest)
            names = [p.split("=", 1)[0] for p in pairs] if "=" in rest else pairs[:1]
            found += [(f"Dockerfile:{line}", name) for name in names]
    for path in sorted((REPO / "docker").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for where, node in _walk(doc, _label(path)):
                services = node.get("services") if path.name.startswith("compose") else None
                for name, service in (services or {}).items():
                    if compose_service_is_ours(path, name, service):
                        env = service.get("environment") or {}
                        keys = env if isinstance(env, dict) else [e.split("=")[0] for e in env]
                        found += [(f"{where}.services.{name}", str(k)) for k in keys]
                for container in node.get("containers") or []:
                    if _is_our_image(container.get("image")):
                        at = f"{where}.containers.{container.get('name')}"
                        found += [(at, e["name"]) for e in container.get("env") or []]
    found += [(i.source, name) for i in all_invocations() for name in i.env]
    return found


def serve_import_paths() -> list[tuple[str, str, dict]]:
    """(source, import_path, args) of every Ray Serve application under docker/, including
    Serve configs embedded as YAML text (a RayService's serveConfigV2)."""
    found = []

    def visit(node: object, label: str) -> None:
        for where, mapping in _walk(node, label):
            if "import_path" in mapping:
                found.append((where, str(mapping["import_path"]), mapping.get("args") or {}))
            for key, value in mapping.items():
                if isinstance(value, str) and "import_path" in value:
                    visit(yaml.safe_load(value), f"{where}.{key}")

    for path in sorted((REPO / "docker").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            visit(doc, _label(path))
    return found


# ---------------------------------------------------------------- everything


def document_paths() -> list[Path]:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "docker/README.md"]
    return [p for p in docs if p.is_file()]


def all_invocations() -> list[Invocation]:
    found = dockerfile_invocations()
    found += shell_script_invocations(REPO / "docker" / "entrypoint.sh")
    for path in sorted((REPO / "docker").rglob("*.yaml")):
        if path.name.startswith("compose"):
            found += compose_invocations(path)
        else:
            found += kubernetes_invocations(path)
        found += markdown_invocations(comment_text(path.read_text()), _label(path), comments=True)
    found += makefile_invocations()
    for path in document_paths():
        found += markdown_invocations(path.read_text(), _label(path))
    return found


def ours(invocations: Iterable[Invocation]) -> list[tuple[Invocation, Program]]:
    """The invocations of this project's programs (and python -m of others), each once; a
    program named in prose without arguments is kept as `named`."""
    seen, out = set(), []
    for invocation in invocations:
        for argv in alternatives(invocation.argv):
            found = program(argv)
            if found is None:
                continue
            named = invocation.named and not found.args
            if (found, named) in seen:
                continue
            seen.add((found, named))
            out.append((Invocation(invocation.source, argv, named), found))
    return out
