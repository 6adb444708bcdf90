"""The compiler work of tests/test_cpu_kernels_isa.py, started in the background (at the
lowest CPU priority) as soon as the session knows those tests will run: the kernels built for
other -march targets, and each source compiled to assembly for Sapphire Rapids with and without
GCC's FMA-chain tuning. It then uses the cores the rest of the suite leaves idle (tests waiting
on servers and subprocesses) instead of holding up the session when the module runs."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.cpu import build as kernel_build

ROOT = Path(__file__).resolve().parents[1]
ISAS = {"haswell": "avx2+fma", "x86-64": "sse2"}
"""-march target: the instruction set the kernels report when built for it."""
FMA_TUNING = ["--param", "avoid-fma-max-bits=512"]
"""GCC's setting that splits a lone chain of multiply-adds (-mtune=sapphirerapids in GCC 13)."""


def compiler() -> str:
    """The C compiler the kernels' build takes ($CC, else cc or gcc)."""
    return next(
        path
        for name in (os.environ.get("CC"), "cc", "gcc")
        if name and (path := shutil.which(name))
    )


def _niced() -> None:
    os.nice(19)


@dataclass
class Build:
    """The kernels built for one -march target in a process of their own."""

    env: dict[str, str]
    proc: subprocess.Popen

    def wait(self) -> str:
        """The ISA the library reports, once built; fails with the build's errors."""
        out, err = self.proc.communicate(timeout=900)
        assert self.proc.returncode == 0, err[-2000:]
        return out.strip()


@dataclass
class Assembly:
    """One source compiled to assembly (into `out`), `tuned` or not."""

    source: Path
    tuned: bool
    out: Path
    proc: subprocess.Popen

    def wait(self) -> tuple[int, str, str]:
        """(return code, the assembly, the compiler's errors)."""
        _, err = self.proc.communicate(timeout=900)
        text = self.out.read_text() if self.proc.returncode == 0 else ""
        return self.proc.returncode, text, err


@dataclass
class Started:
    builds: dict[str, Build]
    assemblies: list[Assembly]
    root: Path

    def stop(self) -> None:
        for proc in [b.proc for b in self.builds.values()] + [a.proc for a in self.assemblies]:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        shutil.rmtree(self.root, ignore_errors=True)


STARTED: Started | None = None


def start(native_isa: str) -> Started:
    """Start every build (but the one this machine's own is) and every assembly, once."""
    global STARTED
    if STARTED is None:
        root = Path(tempfile.mkdtemp(prefix="tandem-isa-"))
        builds = {
            march: _start_build(root / march, march)
            for march, isa in ISAS.items()
            if native_isa != isa
        }
        STARTED = Started(builds, _start_assemblies(root / "asm"), root)
    return STARTED


def wanted(items: list) -> bool:
    """Whether the session will run the module's tests on an x86-64 machine."""
    return platform.machine() == "x86_64" and any(
        Path(str(item.fspath)).name == "test_cpu_kernels_isa.py" for item in items
    )


def _start_build(root: Path, march: str) -> Build:
    cc = compiler()
    root.mkdir(parents=True)
    wrapper = root / "cc"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"args = ['-march={march}' if a == '-march=native' else a for a in sys.argv[1:]]\n"
        f"os.execv({cc!r}, [{cc!r}, *args])\n"
    )
    wrapper.chmod(0o755)
    (root / "tmp").mkdir()
    # Both of the library's cache places are this build's own: the native build's key is the
    # same (the flags read -march=native), and it must not be found.
    env = os.environ | {
        "CC": str(wrapper),
        "TANDEM_KERNEL_CACHE": str(root / "cache"),
        "TMPDIR": str(root / "tmp"),
    }
    check = "from engine.cpu import kernels; print(kernels.isa())"
    proc = subprocess.Popen(
        [sys.executable, "-c", check],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_niced,
    )
    return Build(env, proc)


def _start_assemblies(root: Path) -> list[Assembly]:
    cc = compiler()
    root.mkdir(parents=True)
    flags = [f for f in kernel_build._BASE_FLAGS if f not in ("-shared", "-fPIC")]
    flags += ["-fopenmp", "-march=sapphirerapids", "-S"]
    jobs = []
    for source in sorted(kernel_build.CSRC.glob("*.c")):
        for tuned in (False, True):
            out = root / f"{source.stem}{'-tuned' if tuned else ''}.s"
            cmd = [cc, *flags, *(FMA_TUNING if tuned else []), str(source), "-o", str(out)]
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=_niced,
            )
            jobs.append(Assembly(source, tuned, out, proc))
    return jobs
