"""Tandem's own Llama-family forward (engine/model/native/) against transformers' on the
same weights."""

from __future__ import annotations

import pytest
import torch

from engine.config import SpecConfig
from engine.model.inputs import SeqInput
from engine.model.on_cpu import use_cpu_kernels
from engine.model.runner import ModelRunner
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts
from tests.tiny_models import build_model

BLOCK = 4


@pytest.fixture(scope="module")
def qwen3_dir(tiny_dirs, tmp_path_factory):
    """Qwen3: per-head q/k RMSNorm before the rotary embedding."""
    return build_model(
        tmp_path_factory.mktemp("qwen3") / "m", "qwen3", seed=4, tokenizer_dir=tiny_dirs["llama"]
    )


def _runner(model_dir, impl: str) -> ModelRunner:
    runner = ModelRunner(str(model_dir), torch.device("cpu"), torch.float32, "reference", impl)
    runner.allocate_kv(64, BLOCK)
    return runner


def _steps(vocab: int) -> list[list[SeqInput]]:
    """A prefill of three requests (lengths 3, 9, 14: inside one block, across blocks), then
    a step of a decode, a 1 + 3 verification and a prefill chunk; every token's logits."""
    prompts = random_prompts([3, 9, 14], vocab=vocab, seed=7)
    tables = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]
    first = [SeqInput(p, 0, t, list(range(len(p)))) for p, t in zip(prompts, tables, strict=True)]
    feeds = random_prompts([1, 4, 5], vocab=vocab, seed=8)
    second = [
        SeqInput(f, len(p), t, list(range(len(f))))
        for f, p, t in zip(feeds, prompts, tables, strict=True)
    ]
    return [first, second]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_native_logits_match_transformers(tiny_dirs, qwen3_dir, family):
    model_dir = qwen3_dir if family == "qwen3" else tiny_dirs[family]
    hf, native = _runner(model_dir, "transformers"), _runner(model_dir, "native")
    assert (hf.model_impl, native.model_impl) == ("transformers", "native")
    assert native.native_error(native.native) < 1e-5
    for seqs in _steps(hf.vocab_size):
        expected, got = hf.forward(seqs), native.forward(seqs)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_native_forward_on_the_cpu_kernels_matches_transformers(tiny_dirs, qwen3_dir, family):
    """Every layer step on the C kernels (Llama, Qwen2, Mistral); Qwen3's q/k norms keep torch,
    its linears go packed. Either way the native forward still gives transformers' logits."""
    from engine.cpu import kernels as cpu_kernels
    from engine.cpu import linear as cpu_linear

    if not cpu_kernels.available():
        pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
    model_dir = qwen3_dir if family == "qwen3" else tiny_dirs[family]
    hf, native = _runner(model_dir, "transformers"), _runner(model_dir, "native")
    done = use_cpu_kernels(native)
    assert native.model_impl == "native"
    if family == "qwen3":
        assert done.startswith("native forward,") and not native.native.cpu_kernels
        assert any(type(m) is cpu_linear.PackedLinear for m in native.native.modules())
    else:
        assert done == "native forward on the C kernels" and native.native.cpu_kernels
    for seqs in _steps(hf.vocab_size):
        torch.testing.assert_close(native.forward(seqs), hf.forward(seqs), rtol=1e-4, atol=1e-4)


def test_all_layers_in_one_call_give_the_per_layer_numbers(tiny_dirs):
    """With the CPU attention kernel taking every request, the layers run as one C call
    (cpu_kernels.layers): bit for bit what the per-layer calls give, on bfloat16-exact and on
    float32 panels, for prefills, a decode, a verification and a chunk."""
    from engine.cpu import kernels as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
    hf = _runner(tiny_dirs["llama"], "transformers")
    for bf16 in (True, False):
        runners = []
        for one_call in (True, False):
            runner = ModelRunner(str(tiny_dirs["llama"]), torch.device("cpu"), torch.float32, "cpu")
            if bf16:  # weights on the bfloat16 grid: bfloat16 panels
                with torch.no_grad():
                    for param in runner.model.parameters():
                        param.copy_(param.to(torch.bfloat16))
            runner.allocate_kv(64, BLOCK)
            use_cpu_kernels(runner)
            runner.native.one_call = one_call and runner.native.one_call
            runners.append(runner)
        fused, per_layer = runners
        assert fused.native.one_call and not per_layer.native.one_call
        formats = {layer.qkv.panels.dtype for layer in fused.native.layers}
        assert formats == {torch.bfloat16 if bf16 else torch.float32}
        for seqs in _steps(hf.vocab_size):
            got = fused.forward(seqs)
            assert torch.equal(got, per_layer.forward(seqs))
            if not bf16:  # the weights transformers has
                torch.testing.assert_close(got, hf.forward(seqs), rtol=1e-4, atol=1e-4)
        assert fused.native._stack is not None  # the one-call path ran


def test_the_runners_lists_path_gives_the_metadata_paths_numbers(tiny_dirs):
    """Batches the C stack takes whole run from the runner's lists (engine/model/native/
    lists.py: one integer array, numpy's embedding rows) instead of an AttentionMetadata: the
    same logits and body output, bit for bit, with every row's logits and with some rows'."""
    from engine.cpu import kernels as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
    runner = ModelRunner(str(tiny_dirs["llama"]), torch.device("cpu"), torch.float32, "cpu")
    runner.allocate_kv(64, BLOCK)
    use_cpu_kernels(runner)
    steps = _steps(runner.vocab_size)
    # the second step again, with the logits of some rows only (a prefill chunk's last row)
    steps.append([SeqInput(s.token_ids, s.start_pos, s.block_table, [len(s.token_ids) - 1])
                  for s in steps[1]])  # fmt: skip
    taken = []
    for seqs in steps:
        runner.lists_path = True
        got, hidden = runner.forward(seqs), runner.last_hidden
        taken.append(runner.last_route)
        runner.lists_path = False
        expected = runner.forward(seqs)
        taken.append(runner.last_route)
        assert torch.equal(got, expected) and torch.equal(hidden, runner.last_hidden)
    assert taken == ["layer-stack", "native"] * len(steps)  # the lists path ran when it was on


def test_native_weights_are_shared_with_transformers(tiny_dirs):
    """q/k/v and gate/up are fused without a second copy; the HF modules read the fused
    weights, so the transformers forward on the same runner still gives the same logits."""
    runner = _runner(tiny_dirs["qwen2"], "native")
    layer = runner.native.layers[0]
    attn = runner.model.base_model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == layer.qkv.weight.data_ptr()
    assert attn.q_proj.bias is not None and attn.q_proj.bias.data_ptr() == layer.qkv.bias.data_ptr()

    def storages(module):
        return {p.untyped_storage().data_ptr() for p in module.parameters()}

    fresh = ModelRunner(
        str(tiny_dirs["qwen2"]), torch.device("cpu"), torch.float32, "reference", "transformers"
    )
    # q/k/v share one storage per layer and gate/up another: fewer storages, none new.
    assert len(storages(runner.model)) < len(storages(fresh.model))
    assert storages(runner.native) <= storages(runner.model)
    assert runner.native_error(runner.native) < 1e-5


def test_auto_falls_back_to_transformers_where_native_cannot_run(tiny_dirs, tmp_path):
    gelu = build_model(tmp_path / "gelu", "llama", seed=5, tokenizer_dir=tiny_dirs["llama"])
    config = (gelu / "config.json").read_text().replace('"silu"', '"gelu"')
    (gelu / "config.json").write_text(config)
    assert _runner(gelu, "auto").model_impl == "transformers"
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        _runner(gelu, "native")


def test_a_native_forward_that_disagrees_is_not_used(tiny_dirs, monkeypatch):
    from engine.model.native import llama

    rotate = llama._rotate
    monkeypatch.setattr(llama, "_rotate", lambda x, cos, sin: rotate(x, sin, cos))  # wrong
    assert _runner(tiny_dirs["llama"], "auto").model_impl == "transformers"
    with pytest.raises(ValueError, match="differ from transformers"):
        _runner(tiny_dirs["llama"], "native")


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_speculative_greedy_equals_hf_generate_with_either_forward(tiny_dirs, impl):
    target = tiny_dirs["llama"]
    prompts = random_prompts([4, 13, 30], vocab=300, seed=31)
    expected = hf_greedy(target, prompts, 16)
    spec = SpecConfig(
        "draft", str(tiny_dirs["llama_draft"]), max_draft_tokens=3, draft_length="fixed"
    )
    engine = make_engine(target, spec=spec, model_impl=impl)
    assert {r.model_impl for r in engine.runners} == {impl}
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, greedy(16))
    outputs = drain(engine)
    assert [outputs[f"p{i}"] for i in range(3)] == expected
