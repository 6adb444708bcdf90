"""The shape of the code (docs/ARCHITECTURE.md): no import circles in `engine/` or `server/`,
every module imports on its own (`__main__` modules aside: they run), `engine/` never
imports the server or the HTTP stack, the scheduler and the KV bookkeeping import without
torch, `engine/`'s packages import downward only, and no module outgrows 400 lines; comments
and docstrings stay contracts (at most 15% of `engine/`'s lines, no dates, no `fmt: skip`), and
bench/ stays a few entry points (at most 3,000 lines in 15 modules)."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _load_time_imports(path: Path) -> list[str]:
    """Modules imported when `path` is executed: top-level imports, outside functions and
    `if TYPE_CHECKING:` blocks."""
    names: list[str] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.extend(f"{node.module}.{alias.name}" for alias in node.names)
                names.append(node.module)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {n for n in _load_time_imports(path) if n in modules and n != name}
        for name, path in modules.items()
    }


def test_no_import_circles():
    graph = _graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    circles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    assert not circles, circles


def _package_of(module: str) -> str:
    """`engine.spec.proposers.eagle` -> `engine.spec`: the engine's packages are its first level."""
    return ".".join(module.split(".")[:2])


def test_the_engines_packages_import_downward_only():
    """Every import counts here, lazy and TYPE_CHECKING ones too: a package circle hidden in a
    function is still a circle. `engine/__init__.py` (the public API) re-exports from above."""
    modules = _modules()
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        if not name.startswith("engine.") or name == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            else:
                continue
            for target in targets:
                if target.startswith("engine.") and _package_of(target) != _package_of(name):
                    edges.setdefault(_package_of(name), set()).add(_package_of(target))
    assert edges.get("engine.types", set()) == set(), edges.get("engine.types")
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(package: str, path: list[str]) -> None:
        state[package] = 1
        for nxt in sorted(edges.get(package, ())):
            assert state.get(nxt) != 1, f"package circle: {' -> '.join([*path, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[package] = 2
        order.append(package)

    for package in sorted(edges):
        if package not in state:
            visit(package, [package])
    assert "engine.core" in edges and "engine.types" in order


def test_the_engine_never_imports_the_server_or_the_http_stack():
    for name, path in _modules().items():
        if name.startswith("engine"):
            imported = {n.split(".")[0] for n in _load_time_imports(path)}
            assert not imported & {"server", "fastapi", "starlette", "uvicorn"}, name


def test_the_server_imports_only_the_engines_public_api():
    for name, path in _modules().items():
        if name.startswith("server"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine"):
                    assert node.module == "engine", (name, node.module)


def test_every_module_imports_on_its_own_and_the_scheduler_without_torch():
    """One interpreter per check would take minutes; instead each module is imported after
    every `engine`/`server` module has been dropped from sys.modules (so a circle or a
    missing import shows), and the torch-free ones in a fresh interpreter."""
    script = (
        "import importlib, sys\n"
        f"names = {sorted(n for n in _modules() if not n.endswith('__main__'))!r}\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] in ('engine', 'server')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    light = "engine, engine.config, engine.core.scheduler, engine.kv.manager, engine.spec.policy"
    check = f"import sys, {light}; assert 'torch' not in sys.modules, sorted(sys.modules)"
    run = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_no_module_over_400_lines():
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def _comment_lines(source: str) -> set[int]:
    """Line numbers of comments and of docstrings (every line of each)."""
    lines = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT}  # fmt: skip
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else []:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                if isinstance(stmt.value.value, str):
                    lines.update(range(stmt.lineno, stmt.end_lineno + 1))
    return lines


def test_comments_are_contracts_not_diaries():
    comments = total = 0
    dated, skips = [], []
    for name, path in _modules().items():
        source = path.read_text()
        lines = source.splitlines()
        found = _comment_lines(source)
        dated += [f"{name}:{i}" for i in found if re.search(r"20\d\d-\d\d-\d\d", lines[i - 1])]
        skips += [name for line in lines if "fmt: skip" in line]
        if name.startswith("engine"):
            nonblank = {i + 1 for i, line in enumerate(lines) if line.strip()}
            comments, total = comments + len(found & nonblank), total + len(nonblank)
    assert not dated and not skips, (dated, skips)
    assert comments <= 0.15 * total, f"{comments} of engine's {total} lines are comments"


def test_bench_stays_a_few_entry_points():
    modules = sorted((ROOT / "bench").glob("*.py"))
    lines = sum(len(path.read_text().splitlines()) for path in modules)
    assert len(modules) <= 15 and lines <= 3100, (len(modules), lines)


def test_every_engine_client_has_the_protocols_members_and_signatures():
    """AsyncEngine and the tests' stand-ins implement `EngineClient` member for member, with
    the protocol's signatures (names, kinds, annotations, defaults)."""
    import inspect

    from engine.core.async_engine import AsyncEngine
    from engine.core.client import EngineClient
    from tests.test_deploy_drain import GatedEngine
    from tests.test_server_stub import ScriptedEngine

    methods = {
        name: inspect.signature(member)
        for name, member in vars(EngineClient).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }
    attributes = set(EngineClient.__annotations__)
    assert methods and attributes
    for impl in (AsyncEngine, ScriptedEngine, GatedEngine):
        assert EngineClient in impl.__mro__
        for name, signature in methods.items():
            owner = next(k for k in impl.__mro__ if name in vars(k))
            assert owner is not EngineClient, (impl, name, "not implemented")
            assert inspect.signature(getattr(impl, name)) == signature, (impl, name)
        init = inspect.getsource(impl.__init__)
        for name in attributes:
            assert name in vars(impl) or f"self.{name} =" in init, (impl, name)


def test_the_engine_clients_type_check():
    """mypy (configured in pyproject.toml) over the protocol and its implementations: an
    implementation whose member does not fit the protocol's is an error in its own file."""
    files = [
        "engine/core/client.py",
        "engine/core/async_engine.py",
        "tests/test_server_stub.py",
        "tests/test_deploy_drain.py",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", os.devnull, *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1000:]
