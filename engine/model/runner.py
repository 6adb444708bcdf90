"""Runs one Hugging Face causal LM on its paged KV cache, no policy: one packed forward
(transformers' or engine/model/native/), small steps on fixed shapes (decode_graphs.py)."""

from __future__ import annotations

import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.attention import paged as attention
from engine.attention.backends import BACKENDS
from engine.cpu import kernels as cpu_kernels
from engine.cpu.pairs import pair_slots
from engine.model.decode_graphs import DecodeGraphs
from engine.model.features import check_config, config_window, probe_windows
from engine.model.files import gguf_source
from engine.model.head import OUTSIDE_HEAD, restrict_head
from engine.model.inputs import SeqInput
from engine.model.native import MODEL_IMPLS, NativeForward, build_native
from engine.model.probe import NATIVE_TOLERANCE, native_error
from engine.model.quantization import round_weights
from engine.model.routes import ROUTES, PackedBatch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str = "reference",
        model_impl: str = "auto",
        quantization: str = "none",
        model: torch.nn.Module | None = None,
    ) -> None:
        """`model`: an already built model to run instead of loading model_path's weights
        (a feature draft sharing the target's embedding, engine/spec/proposers/eagle.py)."""
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}")
        attention.register()
        self.device = device
        self.dtype = dtype
        self.kv_dtype = dtype
        """What the KV cache holds (--kv-cache-dtype): set before `allocate_kv`."""
        self.attention_backend = BACKENDS[attention_backend]
        self.name = model_path
        self.hf_config = AutoConfig.from_pretrained(model_path)
        check_config(self.hf_config.get_text_config())
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION
            )
        self.model = model
        self.model.to(device).eval()
        self.quantization = self._quantize(quantization)
        vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.head_tokens = restrict_head(self.model, model_path)
        text_config = self.hf_config.get_text_config()
        self.num_layers = text_config.num_hidden_layers
        self.num_kv_heads = getattr(
            text_config, "num_key_value_heads", text_config.num_attention_heads
        )
        self.head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        windows = probe_windows(
            self.model, self.num_layers, self.num_kv_heads, self.head_dim, dtype, device
        )
        windows += [w for w in [config_window(text_config)] if w]
        self.sliding_window = min(windows, default=None)
        """The narrowest sliding window of any layer: the context must stay within it."""
        why = self.attention_backend.unsupported(
            text_config.num_attention_heads, self.num_kv_heads, self.head_dim, dtype
        )
        if why is not None:
            logger.info("%s: reference attention, not %s: %s", model_path, attention_backend, why)
            self.attention_backend = BACKENDS["reference"]
        self.vocab_size = vocab_size
        """The full vocabulary: `forward`'s logits have this width, restricted head or not."""
        self.max_positions = text_config.max_position_embeddings
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self.scratch_block = 0
        self.decode_graphs: DecodeGraphs | None = None
        self.native: NativeForward | None = None
        self.model_impl_setting = model_impl
        self.kernels = "torch"
        """What runs the layers: torch, triton (native, CUDA) or engine/model/on_cpu.py's."""
        self.cpu_activations = "float32"
        """How the CPU kernels' quantized linears take x in this runner's passes
        (--cpu-activations; set once the start-up probes, which need float32, are done)."""
        if model_impl != "transformers":
            self.native = self._load_native(strict=model_impl == "native")
        self.model_impl = "native" if self.native is not None else "transformers"
        self.hidden_rows = False
        """Set by a proposer reading hidden states: `last_hidden` then has every fed token's row."""
        self.last_hidden: torch.Tensor | None = None
        """The native forward's body output (before the final norm) of the last pass; from a
        decode graph, a view of its buffers, valid until this runner's next pass."""
        self.lists_path = True
        """Batches the C stack takes whole skip the metadata (native/lists.py); off to compare."""
        self.last_route = ""
        """The name of the route (engine/model/routes.py) that ran the last pass."""

    def _quantize(self, method: str) -> str:
        """Round the weights to `method` (engine/model/quantization.py); what is then served."""
        if method != "none" and gguf_source(self.name) is not None:
            logger.info("%s: served on its GGUF file's weights, --quantization ignored", self.name)
            return "none"
        rounded = round_weights(self.model, method)
        if rounded:
            kinds = ", ".join(f"{n} to {kind}" for kind, n in sorted(rounded.items()))
            logger.info("%s: --quantization %s: weights rounded: %s", self.name, method, kinds)
        return method

    @property
    def forward_module(self) -> torch.nn.Module:
        """The module whose layers `forward` runs (to swap kernels into, e.g. packed linears)."""
        return self.native if isinstance(self.native, torch.nn.Module) else self.model

    def _load_native(self, strict: bool) -> NativeForward | None:
        native, why = build_native(self.model)
        if native is not None:
            self.kernels = "triton" if native.use_triton_ops() else "torch"
            error = self.native_error(native)
            if error > NATIVE_TOLERANCE[self.dtype]:
                native, why = None, f"its logits differ from transformers' by {error:.2e}"
        if native is None:
            self.kernels = "torch"
            if strict:
                raise ValueError(f"--model-impl native: {self.name}: {why}")
            logger.info("%s runs through transformers: %s", self.name, why)
        return native

    def native_error(self, native: NativeForward) -> float:
        """How far `native`'s logits are from transformers' (engine/model/probe.py)."""
        return native_error(
            native,
            self.hf_logits,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size,
            self.dtype,
            self.device,
            self.attention_backend,
        )

    def hf_logits(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        metadata: attention.AttentionMetadata,
        logit_index: torch.Tensor | None,  # [rows]; None = every token
    ) -> torch.Tensor:  # [rows, vocab]
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            logits_to_keep=0 if logit_index is None else logit_index,
            use_cache=False,
            tandem_metadata=metadata,
        )
        return out.logits[0]

    def kv_bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Blocks 0 .. num_blocks - 1 for requests, plus a scratch block (index num_blocks)
        that no request owns: padding tokens of fixed-shape steps write their K/V there."""
        shape = (num_blocks + 1, block_size, self.num_kv_heads, self.head_dim)
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]

    @torch.inference_mode()
    def move_kv(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        """Copy K/V at positions `src` of a table to `dst`, every layer (a tree's accepted path)."""
        if not src:
            return
        bs = self.block_size

        def slots(positions: list[int]) -> torch.Tensor:
            flat = [block_table[p // bs] * bs + p % bs for p in positions]
            return torch.tensor(flat, dtype=torch.long, device=self.device)

        src_slots, dst_slots = slots(src), slots(dst)
        for pair in self.kv_caches:
            for value, cache in enumerate(pair):
                if cache.dtype == cpu_kernels.PAIRS:
                    view, at = pair_slots(cache, bool(value), src_slots)
                    _, to = pair_slots(cache, bool(value), dst_slots)
                    view[to] = view[at]
                    continue
                rows = cache.view(-1, cache.shape[2], cache.shape[3])
                rows[dst_slots] = rows[src_slots]  # gathered first: overlapping moves are safe

    def free_kv(self) -> None:
        self.kv_caches = []
        self.decode_graphs = None

    @torch.inference_mode()
    def enable_decode_graphs(self, max_batch: int, max_query_len: int, max_model_len: int) -> bool:
        """Small batches on padded fixed shapes (CUDA graphs on CUDA), after allocate_kv, where
        the backend is graph-safe and the logits are the LM head's; whether it is on."""
        if not self.attention_backend.graph_safe:
            return False
        if self.native is None and not self._head_is_plain():
            logger.warning("%s changes its logits after the LM head: no decode graphs", self.name)
            return False
        self.decode_graphs = DecodeGraphs(
            self._graph_body,
            self.kv_caches,
            self.block_size,
            self.scratch_block,
            -(-max_model_len // self.block_size),
            max_query_len,
            max_batch,
            self.device,
            self.attention_backend,
        )
        return True

    def _head_is_plain(self) -> bool:
        """One token on the scratch block, through the whole model and through body + head.
        Not token 0: it is often the padding token, whose embedding may be zero."""
        metadata = attention.build_metadata(
            self.kv_caches,
            self.block_size,
            [1],
            [1],
            [[self.scratch_block]],
            self.device,
            self.attention_backend,
        )
        inputs = dict(
            input_ids=torch.full((1, 1), self.vocab_size // 2, device=self.device),
            position_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
            use_cache=False,
            tandem_metadata=metadata,
        )
        logits = self.model(**inputs).logits
        hidden = self.model.base_model(**inputs).last_hidden_state
        head = self.model.get_output_embeddings()(hidden)
        return bool(logits.abs().max() > 0) and torch.equal(head, logits)

    def _graph_body(
        self,
        input_ids: torch.Tensor,  # [1, tokens]
        positions: torch.Tensor,  # [1, tokens]
        metadata: attention.AttentionMetadata,
    ) -> torch.Tensor:  # [1, tokens, hidden], what graph_head turns into logits
        if self.native is not None:
            return self.native(input_ids[0], positions[0], metadata)[None]
        out = self.model.base_model(
            input_ids=input_ids, position_ids=positions, use_cache=False, tandem_metadata=metadata
        )
        return out.last_hidden_state

    def graph_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.logits(hidden)
        return self.model.get_output_embeddings()(hidden)

    def forward(self, seqs: list[SeqInput], widen: bool = True) -> torch.Tensor:
        """Run the packed batch on the first route of engine/model/routes.py that takes it;
        return float32 logits [num_logits, vocab], in the order of seqs and, within a request,
        of its logit_offsets. `widen=False`: a restricted head's own columns
        [num_logits, len(head_tokens)] (`widen` makes them the vocabulary's)."""
        return self.forward_packed(PackedBatch.pack(seqs), widen)

    @torch.inference_mode()
    def forward_packed(self, batch: PackedBatch, widen: bool = True) -> torch.Tensor:
        """`forward` of requests already packed (a draft's chain passes build them directly)."""
        if self.kernels != "torch" and cpu_kernels.activations() != self.cpu_activations:
            cpu_kernels.use_activations(self.cpu_activations)  # another runner's passes set it
        route = next(r for r in ROUTES if r.takes(self, batch))
        self.last_route = route.name
        logits = route.run(self, batch)
        return self.widen(logits) if widen else logits

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of a restricted head [rows, head tokens] -> [rows, vocab]."""
        if self.head_tokens is None:
            return logits
        out = logits.new_full((logits.shape[0], self.vocab_size), OUTSIDE_HEAD)
        return out.index_copy_(1, self.head_tokens, logits)
