"""The Llama family's forward pass (Llama, Mistral, Qwen2, Qwen3) on the packed batch; q/k/v
and gate/up are fused, the Hugging Face projections re-pointed at slices of the fused weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.paged import AttentionMetadata
from engine.cpu import kernels as cpu_kernels
from engine.cpu.linear import PackedLinear, pack_linears
from engine.model.native.stack import LayerStack, build_stack, stack_key

# Rotary types whose inverse frequencies do not depend on the sequence length; "dynamic" and
# "longrope" recompute them as the context grows, which this forward does not follow.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def supports(hf_model: nn.Module) -> str | None:
    """None when this forward can run `hf_model`, else why not."""
    config = hf_model.config.get_text_config()
    base = hf_model.base_model
    act = getattr(config, "hidden_act", None)
    if act != "silu":
        return f"hidden_act {act!r} (only silu)"
    rope = getattr(base, "rotary_emb", None)
    rope_type = getattr(rope, "rope_type", None)
    if rope is None or rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} (supported: {', '.join(STATIC_ROPE_TYPES)})"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias"
    return None


def _fuse(hf_linears: list[nn.Linear]) -> nn.Linear:
    """One linear computing `hf_linears` side by side, each left working on its slice."""
    weight = torch.cat([lin.weight.detach() for lin in hf_linears])
    has_bias = hf_linears[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in hf_linears]), False)
    start = 0
    for lin in hf_linears:
        end = start + lin.out_features
        lin.weight = nn.Parameter(fused.weight[start:end], requires_grad=False)
        if has_bias:
            lin.bias = nn.Parameter(fused.bias[start:end], requires_grad=False)
        start = end
    return fused


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # As transformers does it for half types: normalise in float32, scale in the input dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding. x [tokens, heads, head_dim]; cos, sin [tokens, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Layer(nn.Module):
    def __init__(self, hf_layer: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.layer_idx = attn.layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = attn.scaling
        self.input_norm = hf_layer.input_layernorm
        self.post_norm = hf_layer.post_attention_layernorm
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.intermediate = mlp.gate_proj.out_features

    def forward(
        self,
        hidden: torch.Tensor,  # [tokens, hidden]
        cos: torch.Tensor,  # [tokens, 1, head_dim]
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [tokens, hidden]
        n, heads, kv_heads, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        norm = self.input_norm
        qkv = self.qkv(_rms_norm(hidden, norm.weight, norm.variance_epsilon))
        q = qkv[:, : heads * d].view(n, heads, d)
        k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
        if self.q_norm is not None:
            q = _rms_norm(q, self.q_norm.weight, self.q_norm.variance_epsilon)
            k = _rms_norm(k, self.k_norm.weight, self.k_norm.variance_epsilon)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        key_cache, value_cache = metadata.kv_caches[self.layer_idx]
        slots = metadata.slot_mapping
        key_cache.view(-1, kv_heads, d)[slots] = k.to(key_cache.dtype)
        value_cache.view(-1, kv_heads, d)[slots] = v.to(value_cache.dtype)
        attn = metadata.backend.attend(q, key_cache, value_cache, metadata, self.scaling)
        hidden = hidden + self.o_proj(attn.reshape(n, heads * d))
        norm = self.post_norm
        gate_up = self.gate_up(_rms_norm(hidden, norm.weight, norm.variance_epsilon))
        act = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        return hidden + self.down_proj(act)

    def forward_triton(
        self,
        hidden: torch.Tensor,  # [tokens, hidden]
        positions: torch.Tensor,  # [tokens] int64
        cos: torch.Tensor,  # [max positions, head_dim]: the whole table
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`forward` on CUDA through triton_ops; needs no q/k norms and no o/down biases."""
        from engine.model.native import triton_ops

        n, heads, d = hidden.shape[0], self.num_heads, self.head_dim
        norm = self.input_norm
        qkv = self.qkv(triton_ops.rms_norm(hidden, norm.weight, norm.variance_epsilon))
        key_cache, value_cache = metadata.kv_caches[self.layer_idx]
        q = triton_ops.rotary_cache(
            qkv,
            cos,
            sin,
            positions,
            metadata.slot_mapping,
            key_cache,
            value_cache,
            heads,
            self.num_kv_heads,
            d,
        )
        attn = metadata.backend.attend(q, key_cache, value_cache, metadata, self.scaling)
        hidden = torch.addmm(hidden, attn.view(n, heads * d), self.o_proj.weight.t())
        norm = self.post_norm
        gate_up = self.gate_up(triton_ops.rms_norm(hidden, norm.weight, norm.variance_epsilon))
        return torch.addmm(hidden, triton_ops.silu_mul(gate_up), self.down_proj.weight.t())

    def forward_cpu(
        self,
        hidden: torch.Tensor,  # [tokens, hidden] float32; updated in place and returned
        positions: torch.Tensor,  # [tokens] int64
        cos: torch.Tensor,  # [max positions, head_dim]: the whole table
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`forward` through the C kernels; needs packed linears and no q/k norms."""
        n = hidden.shape[0]
        norm = self.input_norm
        x = cpu_kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon)
        key_cache, value_cache = metadata.kv_caches[self.layer_idx]
        q = cpu_kernels.rotary_cache(
            self.qkv.rows(x),
            positions,
            metadata.slot_mapping,
            cos,
            sin,
            self.num_heads,
            key_cache,
            value_cache,
        )
        attn = metadata.backend.attend(q, key_cache, value_cache, metadata, self.scaling)
        hidden = self.o_proj.rows(attn.reshape(n, self.num_heads * self.head_dim), hidden)
        norm = self.post_norm
        x = cpu_kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon)
        return self.down_proj.rows(cpu_kernels.silu_mul(self.gate_up.rows(x)), hidden)


class LlamaForward(nn.Module):
    """Body and LM head of a loaded Llama-family model over one packed batch."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        config = hf_model.config.get_text_config()
        base = hf_model.base_model
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.embed_tokens = base.embed_tokens
        self.layers = nn.ModuleList(
            _Layer(layer, num_heads, num_kv_heads, head_dim) for layer in base.layers
        )
        self.norm = base.norm
        self.lm_head = hf_model.get_output_embeddings()
        # cos/sin for every position, in float32 then cast, as transformers computes them per step
        rope = base.rotary_emb
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        inv_freq = rope.inv_freq.detach().to("cpu", torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        scaling = rope.attention_scaling
        self.register_buffer("cos", (emb.cos() * scaling).to(device, dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(device, dtype), persistent=False)
        self.cpu_kernels = self.triton_ops = self.one_call = False
        self._stack: LayerStack | None = None

    def use_cpu_kernels(self) -> bool:
        """Pack the linears, layers through `_Layer.forward_cpu`; False (no change) if not."""
        weight = self.embed_tokens.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            return False
        if any(layer.q_norm is not None for layer in self.layers):
            return False
        pack_linears(self)
        self.cpu_kernels = True
        shapes = {
            (
                x.num_heads,
                x.num_kv_heads,
                x.head_dim,
                x.intermediate,
                x.scaling,
                x.input_norm.variance_epsilon,
                x.post_norm.variance_epsilon,
            )
            for x in self.layers
        }
        self.one_call = len(shapes) == 1  # `_forward_stack` needs one shape for every layer
        return True

    def use_triton_ops(self) -> bool:
        """Layers through `_Layer.forward_triton`; False (no change) where that does not apply."""
        from engine.attention.backends import triton_available

        layers_ok = all(
            x.q_norm is None and x.o_proj.bias is None and x.down_proj.bias is None
            for x in self.layers
        )
        if self.embed_tokens.weight.device.type != "cuda" or not layers_ok:
            return False
        self.triton_ops = triton_available()
        return self.triton_ops

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [tokens, hidden], before the final norm
        hidden = self.embed_tokens(input_ids)
        if self.one_call and metadata.kernel_seqs is not None and not metadata.groups:
            # Every request is the attention kernel's: all layers in one C call.
            return self._forward_stack(hidden, positions, metadata)
        if self.cpu_kernels or self.triton_ops:
            for layer in self.layers:
                run = layer.forward_cpu if self.cpu_kernels else layer.forward_triton
                hidden = run(hidden, positions, self.cos, self.sin, metadata)
            return hidden
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, metadata)
        return hidden

    def _forward_stack(
        self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`forward` as one C call: `_Layer.forward_cpu`'s kernels with no Python between."""
        seqs, stack = metadata.kernel_seqs, self.layer_stack(metadata.kv_caches)
        batch = cpu_kernels.Batch(
            positions.data_ptr(),
            metadata.slot_mapping.data_ptr(),
            stack.cos,
            stack.sin,
            seqs.tables.data_ptr(),
            seqs.tables.shape[1],
            seqs.q_starts.data_ptr(),
            seqs.q_lens.data_ptr(),
            seqs.ctx_lens.data_ptr(),
            seqs.tables.shape[0],
            stack.block_size,
            None if seqs.tree is None else seqs.tree.data_ptr(),
            None if seqs.tree_base is None else seqs.tree_base.data_ptr(),
            stack.kv_type,
        )
        self.run_stack(hidden := hidden.contiguous(), batch, stack)
        return hidden

    def run_stack(
        self,
        hidden: torch.Tensor,  # [tokens, hidden] float32, contiguous: updated in place
        batch: cpu_kernels.Batch,
        stack: LayerStack,  # `layer_stack` of the caches the batch's slots and tables index
        with_logits: bool = False,
    ) -> torch.Tensor | None:
        """Every layer over `hidden` in one C call for `batch`'s layout; `with_logits`: the
        final norm and LM head follow and every row's logits are returned, else None."""
        head = (stack.head, stack.final_norm, stack.final_eps, stack.width) if with_logits else None
        return cpu_kernels.layers(
            stack.layers,
            batch,
            hidden,
            stack.shape,
            stack.eps,
            stack.scale,
            head,
            scratch=stack.scratch_for,
        )

    def layer_stack(self, kv_caches: list) -> LayerStack:
        """What `run_stack` needs, rebuilt when the caches or any packed panels changed."""
        key = stack_key(kv_caches)
        if self._stack is None or self._stack.key != key:
            self._stack = build_stack(self, kv_caches, key)
        return self._stack

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] body output -> [rows, vocab]; rows normalise independently: pick first."""
        if self.cpu_kernels:
            head: PackedLinear = self.lm_head
            x = cpu_kernels.rms_norm(hidden, self.norm.weight, self.norm.variance_epsilon)
            return head.rows(x)
        if self.triton_ops:
            from engine.model.native import triton_ops

            x = triton_ops.rms_norm(hidden, self.norm.weight, self.norm.variance_epsilon)
            return self.lm_head(x)
        return self.lm_head(_rms_norm(hidden, self.norm.weight, self.norm.variance_epsilon))
