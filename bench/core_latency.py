"""How long a cache line takes to go from one core to another and back, over time.

  python -m bench.core_latency                  # cores 0 and 1, one reading a second, 60 s
  python -m bench.core_latency --cores 0 1 --seconds 120 --interval 0.5

Two threads, pinned to the two cores, hand one cache line back and forth 200,000 times per
reading (each writes the next number, the other waits for it); a reading is the mean round
trip. Within one core complex of an AMD EPYC (cores sharing an L3) a round trip takes about
60-90 ns; between complexes several times that.

Why it is here: on a virtual machine the host places the guest's virtual CPUs on physical
cores and moves them. On the 2-core EPYC these benchmarks ran on (docs/BENCHMARKS.md, "Why
this machine has two speeds") the round trip switched between ~70 ns and ~350 ns for
stretches of seconds to minutes, and a two-thread target pass with it: every linear hands
its output from one thread to the other. A single-thread pass did not move. Run this beside a
benchmark (or before each of its rounds) to tell the machine's state from a change's effect.

The probe is C (Python is far too slow to time a cache line), compiled here with the system's
compiler (`$CC`, else cc, gcc or clang, as the engine's kernels are) into a temporary
directory.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.cpu.build import compiler

SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long TRIPS;
static _Atomic long line __attribute__((aligned(64)));
static int core_b;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int pin(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

/* The other core's side: says whether it could be pinned (-1 yes, -2 no), then answers. */
static void *answer(void *unused) {
  (void)unused;
  if (pin(core_b)) {
    atomic_store(&line, -2);
    return (void *)1;
  }
  atomic_store(&line, -1);
  for (long i = 0; i < TRIPS; i++) {
    while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i + 1) {
    }
    atomic_store_explicit(&line, 2 * i + 2, memory_order_release);
  }
  return 0;
}

/* argv: core a, core b, readings, seconds between readings, round trips per reading. Prints
 * one mean round trip (ns) per reading, or exits 2 when a core cannot be pinned. */
int main(int argc, char **argv) {
  if (argc != 6) return 1;
  TRIPS = atol(argv[5]);
  const int core_a = atoi(argv[1]), readings = atoi(argv[3]);
  const double pause = atof(argv[4]);
  core_b = atoi(argv[2]);
  if (pin(core_a)) return 2;
  for (int r = 0; r < readings; r++) {
    atomic_store(&line, 0);
    pthread_t other;
    if (pthread_create(&other, 0, answer, 0)) return 1;
    long ready;
    while ((ready = atomic_load(&line)) == 0) {
    }
    if (ready == -2) {
      pthread_join(other, 0);
      return 2;
    }
    const double start = now();
    for (long i = 0; i < TRIPS; i++) {
      atomic_store_explicit(&line, 2 * i + 1, memory_order_release);
      while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i + 2) {
      }
    }
    const double took = now() - start;
    pthread_join(other, 0);
    printf("%.1f\n", took / TRIPS * 1e9);
    fflush(stdout);
    struct timespec wait = {(time_t)pause, (long)((pause - (time_t)pause) * 1e9)};
    nanosleep(&wait, 0);
  }
  return 0;
}
"""


def build(directory: Path) -> Path:
    """Compile the probe into `directory`; return the executable's path."""
    source, binary = directory / "core_latency.c", directory / "core_latency"
    source.write_text(SOURCE)
    cmd = [compiler(), "-O2", "-pthread", str(source), "-o", str(binary)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return binary


def readings(cores: tuple[int, int], count: int, interval: float, trips: int = 200_000):
    """Yield `count` mean round trips in ns between the two cores (`trips` each), `interval`
    seconds apart."""
    with tempfile.TemporaryDirectory() as tmp:
        yield from run(build(Path(tmp)), cores, count, interval, trips)


def run(binary: Path, cores: tuple[int, int], count: int, interval: float, trips: int):
    """`readings` with a probe `build` made already."""
    args = [str(binary), *map(str, cores), str(count), str(interval), str(trips)]
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            yield float(line)
    if proc.returncode == 2:
        raise RuntimeError(f"cores {cores} cannot both be pinned here")
    if proc.returncode:
        raise RuntimeError(f"the probe failed ({proc.returncode})")


class Probe:
    """One reading at a time between the first two cores this process may use, the probe
    built once (for a benchmark to read beside each of its measurements)."""

    def __init__(self) -> None:
        cores = sorted(os.sched_getaffinity(0))
        self.cores = (cores[0], cores[1]) if len(cores) >= 2 else None
        self._tmp = tempfile.TemporaryDirectory()  # removed with this object or at exit
        self.binary = None
        if self.cores:
            try:
                self.binary = build(Path(self._tmp.name))
            except (RuntimeError, OSError, subprocess.CalledProcessError):
                pass  # no C compiler, or it refused: every reading is None

    def reading(self, trips: int = 200_000) -> float | None:
        """A mean round trip in ns, or None on one core, without a C compiler, or where the
        cores cannot be pinned."""
        if self.binary is None or self.cores is None:
            return None
        try:
            return list(run(self.binary, self.cores, 1, 0.0, trips))[0]
        except RuntimeError:
            return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cores", type=int, nargs=2, default=[0, 1])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between readings")
    args = p.parse_args(argv)
    allowed = os.sched_getaffinity(0)
    if not set(args.cores) <= allowed or args.cores[0] == args.cores[1]:
        sys.exit(f"--cores needs two different cores of this process's {sorted(allowed)}")
    count = max(1, round(args.seconds / args.interval))
    for i, ns in enumerate(readings(tuple(args.cores), count, args.interval)):
        print(f"{i * args.interval:7.1f} s  round trip {ns:7.1f} ns", flush=True)


if __name__ == "__main__":
    main()
