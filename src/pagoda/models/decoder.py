"""One pre-norm decoder shared by the Llama, Mistral, Qwen2 and Qwen3 families.

Family differences are config flags (`ModelArchConfig`): q/k/v and o biases, MLP bias,
per-head q/k RMSNorm (Qwen3), per-layer sliding windows, tied embeddings, rope scaling.
Tensor parallelism is in the layers, which take the group `tp`: the model code below sees only
this rank's heads and intermediate features.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.metadata import AttentionMetadata
from pagoda.distributed import SINGLE, ParallelGroup
from pagoda.kernels import build
from pagoda.layers.attention import Attention
from pagoda.layers.embedding import LMHead, VocabEmbedding
from pagoda.layers.linear import GateUpLinear, ShardId
from pagoda.layers.norm import RMSNorm
from pagoda.layers.parallel import QKVParallelLinear, RowParallelLinear
from pagoda.layers.rotary import RotaryEmbedding, apply_rotary
from pagoda.models.base import CausalLM
from pagoda.models.config import ModelArchConfig
from pagoda.models.decode_plan import DecodePlan


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        layer_index: int,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            self.head_dim,
            bias=config.qkv_bias,
            dtype=dtype,
            tp=tp,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.q_size,
            config.hidden_size,
            config.o_proj_bias,
            dtype,
            tp,
            what="num_attention_heads * head_dim",
        )
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.attn = Attention(
            attn_backend,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=config.layer_sliding_windows[layer_index],
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.qk_norm:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rotary(
                self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim)), cos, sin, inplace=True
            )
            k = apply_rotary(
                self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)), cos, sin, inplace=True
            )
        else:
            # Queries and keys share one rotation pass (in place: qkv is this layer's own output).
            qk = qkv[:, : self.q_size + self.kv_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
            )
            qk = apply_rotary(qk, cos, sin, inplace=True)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, attn_metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderMLP(nn.Module):
    def __init__(self, config: ModelArchConfig, dtype: torch.dtype, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = GateUpLinear(config.hidden_size, size, config.mlp_bias, dtype, tp)
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, config.mlp_bias, dtype, tp, what="intermediate_size"
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(hidden))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        layer_index: int,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_index, attn_backend, dtype, tp)
        self.mlp = DecoderMLP(config, dtype, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mlp_output, residual)`; the caller adds them (fused into the next norm)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, attn_metadata)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, index, attn_backend, dtype, tp) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # The decode step as one native call (see decode_plan), built on the first decode-only
        # step under each kernel variant; None where the layers do not take the kernels. It binds
        # the weights and KV caches: reset when either changes.
        self._decode_plan: DecodePlan | None = None
        self._plan_variant: object = None

    def reset_decode_plan(self) -> None:
        """Forget the plan (the layers' weights or KV caches changed)."""
        self._decode_plan, self._plan_variant = None, None

    def _plan_for(self, hidden: torch.Tensor, md: AttentionMetadata) -> DecodePlan | None:
        if not md.num_decodes or md.num_decodes != md.num_seqs:
            return None
        if hidden.dtype is not torch.bfloat16 or not hidden.is_cpu:
            return None
        variant = build.active()
        if variant is None:
            return None
        if variant is not self._plan_variant:
            self._decode_plan, self._plan_variant = DecodePlan.build(self), variant
        return self._decode_plan

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        cos, sin = self.rotary_emb(positions)
        hidden = self.embed_tokens(input_ids)
        plan = self._plan_for(hidden, attn_metadata)
        if plan is not None:
            hidden, residual = plan.run(hidden, cos, sin, attn_metadata)
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, cos, sin, attn_metadata)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


class DecoderForCausalLM(CausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ShardId]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config: ModelArchConfig,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        super().__init__(config, attn_backend, tp)
        self.model = DecoderModel(config, attn_backend, dtype, tp)
        self.lm_head = LMHead(
            config.vocab_size,
            config.hidden_size,
            dtype,
            tied_weight=self.model.embed_tokens.weight if config.tie_word_embeddings else None,
            tp=tp,
        )

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        self.model.reset_decode_plan()
        if self.config.tie_word_embeddings and self.lm_head.packed is not None:
            self.model.embed_tokens.use_packed(self.lm_head.packed)

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        super().bind_kv_cache(kv_caches)
        self.model.reset_decode_plan()  # the plan holds the caches it was built over

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)
