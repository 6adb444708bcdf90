"""The C kernels built for other instruction sets than this machine's: the AVX2 path (what
most x86 servers run) and the portable SSE2 one (x86-64 baseline) pass the same kernel tests
(bit-equality of the GGUF block kernels, packed linears against torch, attention over float32
and 16-bit caches, the native forward on the kernels) as the native build. The compiler is
wrapped so that `-march=native` becomes the target; the library goes to a cache of its own.
On a machine whose own build is one of these (an AVX2 machine), that case is skipped: the
kernel tests ran those code paths already."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cpu import kernels as cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = [
    "tests/test_cpu_kernels.py",
    "tests/test_cpu_linear.py",
    "tests/test_gguf_linear.py",
    "tests/test_kv_cache_dtype.py",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        platform.machine() != "x86_64" or not cpu_kernels.available(),
        reason="needs an x86-64 machine whose compiler builds the kernels",
    ),
]


@pytest.mark.parametrize(("march", "isa"), [("haswell", "avx2+fma"), ("x86-64", "sse2")])
def test_kernels_built_for_another_instruction_set_pass_the_kernel_tests(tmp_path, march, isa):
    if cpu_kernels.isa() == isa:  # the same code paths as the native build's
        pytest.skip(f"this machine's own build is {isa}: the kernel tests already ran it")
    compiler = next(
        path
        for name in (os.environ.get("CC"), "cc", "gcc")
        if name and (path := shutil.which(name))
    )
    wrapper = tmp_path / "cc"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"args = ['-march={march}' if a == '-march=native' else a for a in sys.argv[1:]]\n"
        f"os.execv({compiler!r}, [{compiler!r}, *args])\n"
    )
    wrapper.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    # Both of the library's cache places are this test's own: the native build's key is the
    # same (the flags read -march=native), and it must not be found.
    env = os.environ | {
        "CC": str(wrapper),
        "TANDEM_KERNEL_CACHE": str(tmp_path / "cache"),
        "TMPDIR": str(tmp_path / "tmp"),
    }
    check = "from engine.cpu import kernels; print(kernels.isa())"
    built = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert built.returncode == 0 and built.stdout.strip() == isa, built.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
