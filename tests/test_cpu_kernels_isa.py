"""The C kernels built for other instruction sets than this machine's: the AVX2 path (what
most x86 servers run) and the portable SSE2 one (x86-64 baseline) pass the same kernel tests
(bit-equality of the GGUF block kernels, packed linears against torch, attention over float32
and 16-bit caches, the native forward on the kernels) as the native build. The compiler is
wrapped so that `-march=native` becomes the target; the library goes to a cache of its own.
On a machine whose own build is one of these (an AVX2 machine), that case is skipped: the
kernel tests ran those code paths already. And every kernel's code is the same whatever GCC's
tuning says about fused multiply-add chains (the bit-equality tests rest on it)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.cpu import build as kernel_build
from engine.cpu import kernels as cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = [
    "tests/test_cpu_kernels.py",
    "tests/test_cpu_linear.py",
    "tests/test_gguf_linear.py",
    "tests/test_kv_cache_dtype.py",
]
# Tests of those modules that run no kernel code: the library's cache (a one-file source
# tree) and an engine on torch without a compiler. They pass or fail alike whatever -march the
# kernels were built for, and the suite runs them once already.
NO_KERNEL_CODE = [
    "tests/test_cpu_kernels.py::test_without_a_compiler_the_engine_runs_on_torch",
    "tests/test_cpu_kernels.py::test_the_library_is_cached_per_cpu_and_source",
    "tests/test_cpu_kernels.py::test_another_copy_of_the_sources_builds_its_own_library",
    "tests/test_cpu_kernels.py::test_an_unwritable_cache_falls_back_to_the_temp_dir",
]

pytestmark = [
    pytest.mark.slow,
    # A test waits for its build (up to 900 s) and runs the kernel tests (up to 600 s): their
    # own limits, with their errors, come before pytest-timeout's.
    pytest.mark.timeout(1600),
    pytest.mark.skipif(
        platform.machine() != "x86_64" or not cpu_kernels.available(),
        reason="needs an x86-64 machine whose compiler builds the kernels",
    ),
]


def _compiler() -> str:
    """The C compiler the kernels' build takes ($CC, else cc or gcc)."""
    return next(
        path
        for name in (os.environ.get("CC"), "cc", "gcc")
        if name and (path := shutil.which(name))
    )


def _assembly(compiler: str, source: Path, flags: list[str]) -> subprocess.CompletedProcess:
    build_flags = [f for f in kernel_build._BASE_FLAGS if f not in ("-shared", "-fPIC")]
    cmd = [compiler, *build_flags, "-fopenmp", *flags, "-S"]
    return subprocess.run([*cmd, str(source), "-o", "-"], capture_output=True, text=True)


def test_each_kernel_compiles_to_the_same_code_whatever_the_tuning_says_of_fma_chains():
    """GCC splits a loop's lone chain of multiply-adds into multiplies and adds where its
    tuning asks (`--param avoid-fma-max-bits`; -mtune=sapphirerapids in GCC 13 does), and
    fuses the tiles that have several chains: a 1-row tile's bits then differed from an 8-row
    tile's on a Sapphire Rapids machine with GCC 13, where the 16-lane (AVX-512) tiles make a
    1-row, 1-panel tile a single chain. The kernels write their accumulations as explicit
    fused multiply-adds (vec.h `madd`), so that setting at its widest changes no instruction.
    Static: it compiles for Sapphire Rapids (on any x86 machine) and runs nothing."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version or "clang" in version:
        pytest.skip("the FMA-chain setting is GCC's")
    sources = sorted(kernel_build.CSRC.glob("*.c"))
    plain = ["-march=sapphirerapids"]
    tuned = [*plain, "--param", "avoid-fma-max-bits=512"]
    jobs = [(source, flags) for source in sources for flags in (plain, tuned)]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        runs = list(pool.map(lambda job: _assembly(compiler, *job), jobs))
    if any(run.returncode for run in runs):
        pytest.skip(f"{compiler} does not build for Sapphire Rapids: {runs[0].stderr[-300:]}")
    pairs = zip(runs[::2], runs[1::2], strict=True)
    differ = [s.name for s, (a, b) in zip(sources, pairs, strict=True) if a.stdout != b.stdout]
    assert not differ, f"compiled differently where GCC avoids FMA chains: {differ}"


ISAS = {"haswell": "avx2+fma", "x86-64": "sse2"}
"""-march target: the instruction set the kernels report when built for it."""


@dataclass
class Build:
    """The kernels built for one -march target in a process of their own, started early."""

    env: dict[str, str]
    proc: subprocess.Popen

    def wait(self) -> str:
        """The ISA the library reports, once built; fails with the build's errors."""
        out, err = self.proc.communicate(timeout=900)
        assert self.proc.returncode == 0, err[-2000:]
        return out.strip()


def _start_build(root: Path, march: str) -> Build:
    compiler = _compiler()
    wrapper = root / "cc"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"args = ['-march={march}' if a == '-march=native' else a for a in sys.argv[1:]]\n"
        f"os.execv({compiler!r}, [{compiler!r}, *args])\n"
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
    )
    return Build(env, proc)


@pytest.fixture(scope="module", autouse=True)
def builds(tmp_path_factory) -> Iterator[dict[str, Build]]:
    """Every -march target's library, compiling in the background from the module's start,
    while the FMA-chain check and the first rerun run."""
    started = {
        march: _start_build(tmp_path_factory.mktemp(march), march)
        for march, isa in ISAS.items()
        if cpu_kernels.isa() != isa
    }
    yield started
    for build in started.values():
        if build.proc.poll() is None:
            build.proc.kill()
            build.proc.communicate()


@pytest.mark.parametrize(("march", "isa"), list(ISAS.items()))
def test_kernels_built_for_another_instruction_set_pass_the_kernel_tests(builds, march, isa):
    if cpu_kernels.isa() == isa:  # the same code paths as the native build's
        pytest.skip(f"this machine's own build is {isa}: the kernel tests already ran it")
    build = builds[march]
    assert build.wait() == isa
    deselect = [arg for test in NO_KERNEL_CODE for arg in ("--deselect", test)]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS, *deselect],
        cwd=ROOT,
        env=build.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
