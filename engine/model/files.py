"""Where a model's files come from: a Hugging Face directory, `pkg://PACKAGE/PATH`, or a
`.gguf` file converted once (cached by sha256). Problems are ValueErrors naming the flag."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE_SCHEME = "pkg://"
GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
_COMPLETE = "tandem-gguf.json"
"""Written last into a converted directory: its presence means the conversion finished."""
_PLAIN_TYPES = frozenset({"F32", "F16", "BF16"})


CACHE_DIR_ENV = "TANDEM_MODEL_CACHE_DIR"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" / "models"


def locate(path: str, flag: str = "--model") -> Path:
    """The file or directory `path` names, `pkg://` resolved; ValueError when it is missing."""
    if path.startswith(PACKAGE_SCHEME):
        package, _, relative = path[len(PACKAGE_SCHEME) :].partition("/")
        try:
            spec = importlib.util.find_spec(package) if package else None
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"{flag}: {path} names the Python package {package!r}, which is not installed "
                "(scripts/install.sh installs the default model's package)"
            )
        for root in map(Path, spec.submodule_search_locations):
            candidate = root / relative
            if not candidate.resolve().is_relative_to(root.resolve()):
                raise ValueError(f"{flag}: {path} points outside the package {package!r}")
            if candidate.exists():
                return candidate
        raise ValueError(f"{flag}: package {package!r} has no file {relative!r}")
    given = Path(path).expanduser()
    if not given.exists():
        raise ValueError(f"{flag}: no model directory or GGUF file at {path}")
    return given


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == GGUF_SUFFIX


def check_model_path(path: str, flag: str = "--model") -> None:
    """Cheap start-up check: a directory or a file that starts like GGUF (fully checked later)."""
    found = locate(path, flag)
    if found.is_dir():
        return
    with open(found, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{flag}: {found} is neither a Hugging Face model directory nor a GGUF file"
        )


@dataclass(frozen=True)
class GGUFInfo:
    architecture: str
    name: str
    tensor_types: frozenset[str]


def inspect_gguf(path: Path, flag: str = "--model") -> GGUFInfo:
    """Read a GGUF file's header and tensor table, and check that it can be converted."""
    try:
        from gguf.quants import _type_traits as quant_traits  # what gguf can dequantize
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError as exc:
        raise ValueError(
            f"{flag}: reading GGUF needs the gguf package ({exc}); "
            "`pip install gguf accelerate` or re-run scripts/install.sh"
        ) from exc
    size = path.stat().st_size
    try:
        reader = gguf_reader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/struct.error alike
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{flag}: {path} is not a GGUF file (no GGUF magic)") from exc
        raise ValueError(
            f"{flag}: {path} ({size} bytes) is truncated or corrupt: its header or tensor "
            f"table cannot be read ({exc})"
        ) from exc
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ValueError(
            f"{flag}: {path} is truncated: its tensors end at byte {end}, the file has {size}"
        )
    architecture = _field(reader, "general.architecture") or "unknown"
    supported = set(GGUF_SUPPORTED_ARCHITECTURES)
    if architecture not in supported:
        raise ValueError(
            f"{flag}: {path}: GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(sorted(supported))})"
        )
    types = frozenset(t.tensor_type.name for t in reader.tensors)
    convertible = _PLAIN_TYPES | {t.name for t in quant_traits}
    unsupported = sorted(types - convertible)
    if unsupported:
        raise ValueError(
            f"{flag}: {path}: quantization type {', '.join(unsupported)} cannot be "
            f"dequantized (supported: {', '.join(sorted(convertible))})"
        )
    return GGUFInfo(architecture, _field(reader, "general.name") or path.stem, types)


def _field(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        value = field.contents()
    except Exception:
        return None
    return value if isinstance(value, str) else None


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def prepare(path: str, cache_dir: str | None = None, flag: str = "--model") -> str:
    """A Hugging Face directory for `path`: itself, or its GGUF file's (cached) conversion."""
    found = locate(path, flag)
    if found.is_dir():
        return str(found)
    if not is_gguf(found):
        check_model_path(str(found), flag)  # raises: not GGUF
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    digest = file_digest(found)
    target = root / digest[:32]
    if (target / _COMPLETE).exists():
        logger.info("%s: %s (cached conversion of %s)", flag, target, found)
        return str(target)
    with _gguf_parsed_once():
        info = inspect_gguf(found, flag)
        convert_gguf(found, target, info, digest)
    return str(target)


def gguf_reader(path, mode: str = "r"):
    """A `gguf.GGUFReader` of `path` that keeps the mapped file as a plain ndarray view:
    parsing a large vocabulary slices it hundreds of thousands of times, and each slice of an
    `np.memmap` runs numpy's Python-level subclass hooks. The same bytes, the same fields."""
    return _plain_reader()(path, mode)


@functools.cache
def _plain_reader() -> type:
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # the class, also where _gguf_parsed_once runs

    class PlainReader(GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

    return PlainReader


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within it, the gguf package parses each file once and builds its tensor-name map once
    per (architecture, layers), where transformers redoes both per call and per module; both
    are only read, so sharing them changes nothing."""
    try:
        import gguf
    except ImportError:  # inspect_gguf says what is missing
        yield
        return
    original, original_map = gguf.GGUFReader, gguf.get_tensor_name_map  # restored after
    readers: dict[tuple, object] = {}
    maps: dict[tuple, object] = {}

    def shared(path, mode: str = "r"):  # GGUFReader's signature
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = gguf_reader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks: int):  # get_tensor_name_map's signature
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = original_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original, original_map


def convert_gguf(path: Path, target: Path, info: GGUFInfo, digest: str) -> None:
    """Dequantize `path` into a Hugging Face directory at `target` (written beside, renamed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    types = "/".join(sorted(info.tensor_types))
    logger.info(
        "converting %s (%s, %s) into %s; later starts reuse it",
        path,
        info.architecture,
        types,
        target,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        kwargs = {"gguf_file": path.name}
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype="float32", **kwargs)
        # The weights are dequantized now: save them as a plain checkpoint.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        (tmp / _COMPLETE).write_text(
            json.dumps(
                {
                    "source": str(path),
                    "sha256": digest,
                    "architecture": info.architecture,
                    "name": info.name,
                    "tensor_types": sorted(info.tensor_types),
                },
                indent=1,
            )
        )
        if target.exists() and not (target / _COMPLETE).exists():  # a stale, incomplete one
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / _COMPLETE).exists():
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"converting {path} failed: {exc}") from exc
    logger.info("converted %s in %.1fs", path.name, time.perf_counter() - started)


def gguf_source(model_dir: str) -> Path | None:
    """The GGUF file `model_dir` was converted from, if still there (for cpu/gguf_blocks.py)."""
    marker = Path(model_dir) / _COMPLETE
    if not marker.is_file():
        return None
    source = Path(json.loads(marker.read_text())["source"])
    return source if source.is_file() else None


def prepare_config(config):
    """`config` (an EngineConfig) with target and draft paths made Hugging Face directories."""
    from dataclasses import replace

    cache_dir = config.model.cache_dir
    model = prepare(config.model.model, cache_dir, "--model")
    spec = config.spec
    if spec.method == "draft" and spec.draft_model:
        spec = replace(spec, draft_model=prepare(spec.draft_model, cache_dir, "--draft-model"))
    if model == config.model.model and spec is config.spec:
        return config
    return replace(config, model=replace(config.model, model=model), spec=spec)


def default_served_name(path: str) -> str:
    """The `model` name clients send when none is configured: a GGUF file's name without its
    extension (`SmolLM2-135M-Instruct.Q4_1`), else the path as written."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if name.lower().endswith(GGUF_SUFFIX):
        return name[: -len(GGUF_SUFFIX)]
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.model.files PATH [--cache-dir DIR]`: convert (or find) a GGUF file's
    Hugging Face directory ahead of serving, and print it. The cache is the server's: the
    `TANDEM_MODEL_CACHE_DIR` variable (`--model-cache-dir`) when set, as `tandem serve` reads
    it, so an image that converts at build time is found again at start."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m engine.model.files", description=main.__doc__)
    p.add_argument("path", help="a .gguf file, pkg://PACKAGE/FILE, or a model directory")
    env = os.environ.get(CACHE_DIR_ENV) or None
    p.add_argument(
        "--cache-dir", default=env, help=f"default ${CACHE_DIR_ENV}, else {default_cache_dir()}"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        print(prepare(args.path, args.cache_dir))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def eos_token_ids(model_dir: str, hf_config: object) -> tuple[int, ...]:
    """Every EOS id the generation config, then `hf_config`, names, without repeats."""
    from transformers import GenerationConfig

    try:
        generation: object | None = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        generation = None
    ids: list[int] = []
    for source in (generation, hf_config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        for token in eos if isinstance(eos, list) else [eos]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)
