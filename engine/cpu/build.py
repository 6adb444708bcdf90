"""Compiles engine/cpu/csrc into one shared library for this machine, cached under a key of
sources, compiler, flags and CPU features (`-march=native`)."""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
LIBRARY = "libtandem_cpu.so"
# Loops start on 64-byte lines so a hot loop's speed does not move with unrelated code.
_BASE_FLAGS = ["-std=gnu11", "-O3", "-ffp-contract=fast", "-falign-loops=64", "-shared", "-fPIC"]
# Tried in order; the first that compiles is used. Without OpenMP the kernels run on one
# thread whatever torch's thread count.
_FLAG_SETS = (["-march=native", "-fopenmp"], ["-march=native"], ["-fopenmp"], [])


def build(csrc: Path = CSRC) -> Path:
    """The library's path, compiled first if this machine has no copy yet; raises
    RuntimeError saying why when it cannot be built. `csrc`: another copy of the sources."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    sources = sorted(csrc.glob("*.c"))
    contents = b"\0".join(p.read_bytes() for p in sorted(csrc.glob("*.[ch]")))
    errors = []
    for extra in _FLAG_SETS:
        flags = _BASE_FLAGS + extra
        parts = [contents, version.encode(), " ".join(flags).encode(), cpu_identity().encode()]
        key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
        places = (_private_place(root, key) for root in _cache_dirs())
        target = None
        for place in filter(None, places):
            if _trusted_library(place / LIBRARY):
                return place / LIBRARY
            if os.access(place, os.W_OK):
                target = place / LIBRARY
                break
        target = target or _fresh_place() / LIBRARY
        error = _compile(cc, flags, sources, target)
        if error is None:
            logger.info("built Tandem's CPU kernels (%s) into %s", " ".join(flags), target)
            return target
        errors.append(f"{' '.join(extra) or 'no extra flags'}: {error[-300:]}")
    raise RuntimeError(f"{cc} could not build {csrc}: " + " | ".join(errors))


def _compile(cc: str, flags: list[str], sources: list[Path], target: Path) -> str | None:
    """Compile each source to an object (as many at once as there are CPUs), link them into
    `target`; None when done, else the compiler's errors. Built beside the target, then
    renamed: two processes building at once both finish."""
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects = [Path(work) / f"{source.stem}.o" for source in sources]
        compile_flags = [f for f in flags if f != "-shared"]
        commands = [
            [cc, *compile_flags, "-c", str(source), "-o", str(obj)]
            for source, obj in zip(sources, objects, strict=True)
        ]
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            runs = list(
                pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), commands)
            )
        failed = [run.stderr.strip() for run in runs if run.returncode != 0]
        if failed:
            return " ".join(failed)
        linked = Path(work) / LIBRARY
        link = subprocess.run(
            [cc, *flags, *map(str, objects), "-o", str(linked), "-lm"],
            capture_output=True,
            text=True,
        )
        if link.returncode != 0:
            return link.stderr.strip()
        os.chmod(linked, 0o700)  # whatever the umask: `_trusted_library` refuses g/o-writable
        os.replace(linked, target)
    return None


def compiler() -> str:
    """The system's C compiler: `$CC`, else the first of cc, gcc and clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C compiler found (set $CC, or install gcc)")


def _cache_dirs() -> list[Path]:
    """Where the library may be built: the configured cache, then a per-user temp dir."""
    if os.environ.get("TANDEM_KERNEL_CACHE"):
        first = Path(os.environ["TANDEM_KERNEL_CACHE"])
    else:
        first = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem"
        first /= "kernels"
    return [first, Path(tempfile.gettempdir()) / f"tandem-kernels-{_uid()}"]


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def _refusal(path: Path, kind: int) -> str | None:
    """Why `path` must not be or hold a library we load, or None: it must be a `kind` (a file
    not through a symlink), this user's own and writable by no one else (no planted code)."""
    st = os.stat(path) if kind == stat.S_IFDIR else os.lstat(path)
    if stat.S_IFMT(st.st_mode) != kind:
        return "not a directory" if kind == stat.S_IFDIR else "not a regular file"
    if _uid() is not None and st.st_uid != _uid():
        return f"owned by uid {st.st_uid}, not this user's ({_uid()})"
    if st.st_mode & 0o022:
        return f"writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_NOT_USED = "not using %s for Tandem's CPU kernels: it is %s (must be yours, writable by you only)"


def _private_place(root: Path, key: str) -> Path | None:
    """`root/key`, made mode 0700 (with `root`'s missing parents); None when it cannot be, or
    (with a warning) when `root` or `root/key` fails `_refusal`."""
    try:
        for part in [*reversed(root.parents), root, root / key]:
            if not part.is_dir():
                part.mkdir(mode=0o700, exist_ok=True)
            if part in (root, root / key) and (problem := _refusal(part, stat.S_IFDIR)):
                logger.warning(_NOT_USED, part, problem)
                return None
    except OSError:
        return None
    return root / key


def _trusted_library(library: Path) -> bool:
    try:
        problem = _refusal(library, stat.S_IFREG)
    except FileNotFoundError:
        return False
    if problem:
        logger.warning("refusing to load %s: it is %s; building a new one", library, problem)
    return problem is None


@functools.cache
def _fresh_place() -> Path:
    """A private temp dir of this process's own (removed at exit) when no cache dir will do."""
    try:
        place = Path(tempfile.mkdtemp("", "tandem-kernels-", tempfile.gettempdir()))
    except OSError as exc:
        raise RuntimeError(f"no private directory for the kernels: {exc}") from exc
    atexit.register(shutil.rmtree, place, ignore_errors=True)
    logger.warning("Tandem's CPU kernels are built into %s for this process only", place)
    return place


def cpu_identity() -> str:
    """What -march=native depends on: the CPU's model name and feature flags."""
    wanted = ("model name", "flags", "Features", "CPU part")
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    seen = {}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in wanted and key not in seen:
            seen[key] = line
    return platform.machine() + "\n" + "\n".join(seen[k] for k in sorted(seen))
