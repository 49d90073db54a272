"""The decoder's decode step as one flat loop of native calls (bf16 on x86-64 CPUs).

A decode step of a small model spends a large share of its time in Python around the GEMMs:
about ten module calls per layer, each with its checks and dispatch. `DecodePlan` looks all of
that up once (norm weights, each linear bound to the kernel variant's op, attention parameters)
and runs the layers as the same sequence of native ops the modules run, in the same order and
on the same tensors, so its results are equal bit for bit to the module path's.

It applies only where every piece takes the kernel path anyway: bf16 CPU weights packed for
`pagoda.kernels.cpu_gemm` (or quantized `QuantLinear`s), one tensor-parallel rank, the torch
paged attention backend, and a decode-only batch over a bf16 KV cache. Everything else runs the
modules (`DecoderModel.forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.kernels import build, cpu_gemm
from pagoda.layers.attention import Attention
from pagoda.quant.linear import QuantLinear

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None  # per-head q/k RMSNorm weights (Qwen3), or None
    k_norm: torch.Tensor | None
    attn: Attention  # holds the layer's KV cache (bound by the model runner)
    scale: float
    sliding_window: int  # 0: none


def _bind(packed) -> Linear | None:
    if isinstance(packed, cpu_gemm.PackedWeight):
        return cpu_gemm.bound(packed)
    if isinstance(packed, QuantLinear):
        return packed.bound()
    return None


class DecodePlan:
    """Built by `DecodePlan.build(model)` (None where it does not apply); `run` is the layers'
    forward for a decode-only batch of bf16 CPU activations. Valid for the kernel variant in
    use when it was built (the model rebuilds it when that changes)."""

    def __init__(self, layers: list[_Layer], num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.layers = layers
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self._norm = build.op("add_rms_norm")
        self._rotary = build.op("rotary_")
        self._attend = build.op("paged_attention")

    @staticmethod
    def build(model) -> DecodePlan | None:
        """The plan for a `DecoderModel`, or None where some layer does not take the kernels."""
        if not model.layers or not build.available():
            return None
        layers = []
        for layer in model.layers:
            sa, mlp = layer.self_attn, layer.mlp
            impl = sa.attn.impl
            if (
                type(impl) is not TorchPagedAttention
                or sa.o_proj.tp.size != 1
                or mlp.down_proj.tp.size != 1
                or layer.input_layernorm.weight.dtype is not torch.bfloat16
            ):
                return None
            linears = [_bind(m.packed) for m in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(f is None for f in linears):
                return None
            layers.append(
                _Layer(
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    layer.input_layernorm.eps,
                    *linears,
                    sa.q_norm.weight if sa.qk_norm else None,
                    sa.k_norm.weight if sa.qk_norm else None,
                    sa.attn,
                    impl.scale,
                    impl.sliding_window or 0,
                )
            )
        first = model.layers[0].self_attn
        return DecodePlan(layers, first.num_heads, first.num_kv_heads, first.head_dim)

    def kv_ready(self) -> bool:
        """Whether the layers' KV caches are bound and bf16 on the CPU (the native attention's)."""
        for layer in self.layers:
            kv = layer.attn.kv_cache
            if kv is None or kv.dtype is not torch.bfloat16 or not kv.is_cpu:
                return False
        return True

    def run(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, md: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers on the embedded tokens `hidden` → `(last mlp output, residual)`, as
        `DecoderLayer.forward` computes them layer after layer."""
        norm, rotary, attend = self._norm, self._rotary, self._attend
        tokens = hidden.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        tables, seq_lens, starts, slots = md.block_tables, md.seq_lens, md.query_start_loc, md.slot_mapping
        residual = None
        for layer in self.layers:
            if residual is None:
                residual = hidden
                hidden = norm(hidden, None, layer.input_norm, layer.eps)[0]
            else:
                hidden, residual = norm(hidden, residual, layer.input_norm, layer.eps)
            qkv = layer.qkv(hidden)
            if layer.q_norm is None:
                qk = qkv[:, :k_end].view(tokens, heads + kv_heads, head_dim)
                rotary(qk, cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q = norm(qkv[:, :q_end].reshape(tokens * heads, head_dim), None, layer.q_norm, layer.eps)[0]
                k = norm(
                    qkv[:, q_end:k_end].reshape(tokens * kv_heads, head_dim), None, layer.k_norm, layer.eps
                )[0]
                q = q.view(tokens, heads, head_dim)
                k = k.view(tokens, kv_heads, head_dim)
                rotary(q, cos, sin)
                rotary(k, cos, sin)
            v = qkv[:, k_end:].view(tokens, kv_heads, head_dim)
            out = attend(
                q,
                layer.attn.kv_cache,
                tables,
                seq_lens,
                starts,
                layer.scale,
                layer.sliding_window,
                k,
                v,
                slots,
            )
            hidden = layer.o(out.view(tokens, q_end))
            hidden, residual = norm(hidden, residual, layer.post_norm, layer.eps)
            hidden = layer.down(layer.gate_up(hidden))
        return hidden, residual
