"""--quantization (engine/model/quantization.py): weights rounded once at load to bf16, int8
or int4, served by the CPU kernels on blocks holding exactly those weights, speculation
lossless with respect to them, and transformers' generate() on the same rounded weights as
the reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.config import EngineConfig, ModelConfig, SpecConfig
from engine.cpu import kernels as cpu_kernels
from engine.model.on_cpu import draft_beside_gguf_blocks
from engine.model.quantization import round_weights
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts

gguf = pytest.importorskip("gguf")


def _representable(weight: torch.Tensor, kind: str) -> bool:
    qtype = gguf.GGMLQuantizationType[kind]
    w = weight.detach().numpy()
    back = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
    return np.array_equal(back.astype(np.float32), w)


@pytest.mark.parametrize(
    ("method", "kind", "head_kind"),
    [("bf16", "bfloat16", "bfloat16"), ("int8", "Q8_0", "Q8_0"), ("int4", "Q4_1", "Q8_0")],
)
def test_every_linear_weight_is_rounded_to_the_method_and_odd_widths_to_bf16(
    method: str, kind: str, head_kind: str
):
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40), nn.Linear(40, 64))  # 40: no blocks
    head = nn.Linear(64, 50, bias=False)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = body, head

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    model = Model()
    before = [layer.weight.detach().clone() for layer in (*body, head)]
    counts = round_weights(model, method)

    expected: dict[str, int] = {}
    wanted = (kind, kind, "bfloat16", head_kind)
    for layer, old, want in zip((*body, head), before, wanted, strict=True):
        w = layer.weight.detach()
        assert not torch.equal(w, old)  # rounded ...
        assert (w - old).abs().max() <= old.abs().max() * 0.2  # ... to nearby values
        if want == "bfloat16":
            assert torch.equal(w.to(torch.bfloat16).float(), w)
        else:
            assert _representable(w, want)
        expected[want] = expected.get(want, 0) + 1
    assert counts == expected
    if method == "int4":  # the head is int8, finer than any 4-bit rounding of it
        assert not _representable(head.weight, "Q4_1")


def test_unknown_method_and_gguf_models_are_refused():
    with pytest.raises(ValueError, match="--quantization must be one of"):
        ModelConfig(model="m", quantization="fp8")
    with pytest.raises(ValueError, match="applies to Hugging Face checkpoints"):
        ModelConfig(model="model.Q4_1.gguf", quantization="int8")


def test_quantization_needs_the_cpu_in_float32(tiny_dirs: dict[str, Path]):
    with pytest.raises(ValueError, match="runs on the CPU in float32"):
        make_engine(tiny_dirs["llama"], dtype="bfloat16", quantization="int8")


@pytest.mark.parametrize("method", ["bf16", "int8", "int4"])
def test_quantized_greedy_equals_generate_on_the_rounded_weights_with_speculation(
    tiny_dirs: dict[str, Path], method: str
):
    prompts = random_prompts([5, 17, 9], vocab=200, seed=3)
    want = hf_greedy(tiny_dirs["llama"], prompts, 12, quantization=method)
    if method == "int4":  # a change this model's greedy text shows (its weights are bf16)
        assert want != hf_greedy(tiny_dirs["llama"], prompts, 12)
    for spec in (
        SpecConfig(method="off"),
        SpecConfig(method="draft", draft_model=str(tiny_dirs["llama_draft"]), draft_length="fixed"),
        SpecConfig(method="ngram", draft_length="fixed"),
    ):
        engine = make_engine(tiny_dirs["llama"], spec=spec, quantization=method)
        if cpu_kernels.available() and method != "bf16":
            blocks = "on Q8_0" if method == "int8" else "on Q4_1, 1 on Q8_0"  # int4: head int8
            assert f"{blocks} blocks (--quantization {method})" in engine.runner.kernels
            draft = getattr(engine.proposer, "runner", None)
            assert draft is None or draft.quantization == method
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy(12))
        got = drain(engine)
        assert [got[str(i)] for i in range(len(prompts))] == want, (method, spec.method)


def test_the_draft_takes_its_own_quantization_and_the_output_stays_the_targets(
    tiny_dirs: dict[str, Path],
):
    """--draft-quantization rounds the draft's weights alone (auto: the target's, or int4
    beside a target on GGUF blocks): the target is served unrounded, so greedy output equals
    generate() on its own weights, and the draft's blocks are int8 while the target's stay
    float32."""
    with pytest.raises(ValueError, match="--draft-quantization must be one of"):
        SpecConfig(draft_model="d", draft_quantization="fp8")
    assert SpecConfig(draft_model="d").draft_weights("int4") == "int4"
    assert SpecConfig(draft_model="d", draft_quantization="none").draft_weights("int4") == "none"
    # Beside a target on a GGUF file's blocks, auto rounds the draft to int4 blocks.
    assert SpecConfig(draft_model="d").draft_weights("none", True) == "int4"
    assert SpecConfig(draft_model="d").draft_weights("none", False) == "none"
    spec = SpecConfig(draft_model="d", draft_quantization="none")
    assert spec.draft_weights("none", True) == "none"
    with pytest.raises(ValueError, match="--draft-quantization int8 runs on the CPU in float32"):
        spec = SpecConfig(draft_model=str(tiny_dirs["llama_draft"]), draft_quantization="int8")
        make_engine(tiny_dirs["llama"], dtype="bfloat16", spec=spec)
    prompts = random_prompts([5, 17, 9], vocab=200, seed=4)
    want = hf_greedy(tiny_dirs["llama"], prompts, 12)
    spec = SpecConfig(
        draft_model=str(tiny_dirs["llama_draft"]), draft_length="fixed", draft_quantization="int8"
    )
    engine = make_engine(tiny_dirs["llama"], spec=spec)
    assert engine.runner.quantization == "none" and engine.proposer.runner.quantization == "int8"
    if cpu_kernels.available():
        assert "blocks (--quantization int8)" in engine.proposer.runner.kernels
        assert "--quantization" not in engine.runner.kernels
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(12))
    got = drain(engine)
    assert [got[str(i)] for i in range(len(prompts))] == want
    assert engine.stats().spec_drafted_tokens > 0


def test_auto_rounds_a_hugging_face_draft_beside_a_target_on_gguf_blocks(tmp_path: Path):
    """`--draft-quantization auto` means int4 only where the target runs on its GGUF file's
    blocks (CPU kernels, float32, --gguf-blocks) and the draft is not a GGUF conversion."""
    if not cpu_kernels.available():
        pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable_reason()}")

    def converted(name: str | None) -> str:
        directory = tmp_path / f"{name or 'plain'}-dir"
        directory.mkdir(exist_ok=True)
        if name is not None:
            (tmp_path / name).write_bytes(b"GGUF")
            marker = {"source": str(tmp_path / name)}
            (directory / "tandem-gguf.json").write_text(json.dumps(marker))
        return str(directory)

    gguf_target, gguf_draft, hf = converted("t.gguf"), converted("d.gguf"), converted(None)
    cpu, f32 = torch.device("cpu"), torch.float32

    def beside(target: str, draft: str, **model) -> bool:
        config = EngineConfig(ModelConfig(target, **model), spec=SpecConfig(draft_model=draft))
        return draft_beside_gguf_blocks(config, cpu, f32)

    assert beside(gguf_target, hf)
    assert not beside(gguf_target, gguf_draft)  # a GGUF draft runs on its own blocks
    assert not beside(hf, hf)  # a Hugging Face target: auto is its --quantization
    assert not beside(gguf_target, hf, gguf_blocks=False)
    assert not beside(gguf_target, hf, cpu_packed_linear=False)
    config = EngineConfig(ModelConfig(gguf_target), spec=SpecConfig(draft_model=hf))
    assert not draft_beside_gguf_blocks(config, cpu, torch.bfloat16)


@pytest.fixture
def float32_after():
    """--cpu-activations is process-wide: put the kernels back to float32 after the test."""
    yield
    if cpu_kernels.available():
        cpu_kernels.use_activations("float32")


def test_int8_activations_keep_speculation_exactly_the_servers_own_output(
    tiny_dirs: dict[str, Path], float32_after, monkeypatch
):
    """--cpu-activations int8 changes the model's numbers, never the lossless contract: with
    drafts or without, greedy output is the same engine's speculation-off output, and a
    prompt's output is the same whether its blocks came from the prefix cache or not. It is
    refused where nothing runs on quantized blocks and where the CPU has no VNNI."""
    if not cpu_kernels.available() or not cpu_kernels.use_activations("int8"):
        pytest.skip("no CPU kernels with AVX-512 VNNI here")
    with pytest.raises(ValueError, match="--cpu-activations int8 applies to quantized linears"):
        make_engine(tiny_dirs["llama"], cpu_activations="int8")
    prompts = random_prompts([5, 17, 45, 70], vocab=200, seed=5)  # 45, 70: prefill chunks
    outputs = {}
    for spec in (
        SpecConfig(method="off"),
        SpecConfig(method="draft", draft_model=str(tiny_dirs["llama_draft"]), draft_length="fixed"),
        SpecConfig(method="ngram", draft_length="fixed"),
    ):
        engine = make_engine(
            tiny_dirs["llama"], spec=spec, quantization="int4", cpu_activations="int8"
        )
        assert engine.cpu_isa.endswith("+vnni-int8")
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy(16))
        got = drain(engine)
        outputs[spec.method] = [got[str(i)] for i in range(len(prompts))]
        assert spec.method == "off" or engine.stats().spec_drafted_tokens > 0
        for i, prompt in enumerate(prompts):  # alone now, the prompts' blocks cached
            engine.add_request(f"again{i}", prompt, greedy(16))
            assert drain(engine)[f"again{i}"] == outputs[spec.method][i]
    assert outputs["draft"] == outputs["off"] == outputs["ngram"]
    monkeypatch.setattr(cpu_kernels, "use_activations", lambda mode: mode == "float32")
    with pytest.raises(ValueError, match="--cpu-activations int8 needs AVX-512 VNNI"):
        make_engine(tiny_dirs["llama"], quantization="int4", cpu_activations="int8")
