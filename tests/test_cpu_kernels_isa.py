"""The C kernels built for other instruction sets than this machine's: the AVX2 path (what
most x86 servers run) and the portable SSE2 one (x86-64 baseline) pass the same kernel tests
(bit-equality of the GGUF block kernels, packed linears against torch, attention over float32
and 16-bit caches, the native forward on the kernels) as the native build. The compiler is
wrapped so that `-march=native` becomes the target; the library goes to a cache of its own.
On a machine whose own build is one of these (an AVX2 machine), that case is skipped: the
kernel tests ran those code paths already. And every kernel's code is the same whatever GCC's
tuning says about fused multiply-add chains (the bit-equality tests rest on it)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from engine.cpu import kernels as cpu_kernels
from tests import isa_builds
from tests.isa_builds import ISAS, ROOT

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
    pytest.mark.skipif(
        platform.machine() != "x86_64" or not cpu_kernels.available(),
        reason="needs an x86-64 machine whose compiler builds the kernels",
    ),
]


@pytest.fixture(scope="module")
def started() -> isa_builds.Started:
    """The compiler work, started in the background when the session began (conftest.py);
    started here when it was not (e.g. the module run on its own)."""
    return isa_builds.start(cpu_kernels.isa())


def test_each_kernel_compiles_to_the_same_code_whatever_the_tuning_says_of_fma_chains(started):
    """GCC splits a loop's lone chain of multiply-adds into multiplies and adds where its
    tuning asks (`--param avoid-fma-max-bits`; -mtune=sapphirerapids in GCC 13 does), and
    fuses the tiles that have several chains: a 1-row tile's bits then differed from an 8-row
    tile's on a Sapphire Rapids machine with GCC 13, where the 16-lane (AVX-512) tiles make a
    1-row, 1-panel tile a single chain. The kernels write their accumulations as explicit
    fused multiply-adds (vec.h `madd`), so that setting at its widest changes no instruction.
    Static: it compiles for Sapphire Rapids (on any x86 machine) and runs nothing."""
    compiler = isa_builds.compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version or "clang" in version:
        pytest.skip("the FMA-chain setting is GCC's")
    runs = [(job.source, job.tuned, *job.wait()) for job in started.assemblies]
    failed = [err for *_, code, _, err in runs if code]
    if failed:
        pytest.skip(f"{compiler} does not build for Sapphire Rapids: {failed[0][-300:]}")
    plain = {source.name: text for source, tuned, _, text, _ in runs if not tuned}
    tuned = {source.name: text for source, tuned, _, text, _ in runs if tuned}
    assert plain.keys() == tuned.keys() and len(plain) >= 5
    differ = [name for name in plain if plain[name] != tuned[name]]
    assert not differ, f"compiled differently where GCC avoids FMA chains: {differ}"


@pytest.mark.parametrize(("march", "isa"), list(ISAS.items()))
def test_kernels_built_for_another_instruction_set_pass_the_kernel_tests(started, march, isa):
    if cpu_kernels.isa() == isa:  # the same code paths as the native build's
        pytest.skip(f"this machine's own build is {isa}: the kernel tests already ran it")
    build = started.builds[march]
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
