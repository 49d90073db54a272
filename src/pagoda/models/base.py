"""The interface every model exposes to the model runner, and the generic weight loading."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.metadata import AttentionMetadata
from pagoda.distributed import SINGLE, ParallelGroup, kv_head_shard
from pagoda.layers.attention import Attention
from pagoda.layers.linear import ShardId
from pagoda.layers.sharding import CheckpointTensor
from pagoda.models.config import ModelArchConfig


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over a paged KV cache.

    Parameter names mirror the HF checkpoint, except that the projections listed in
    `packed_modules_mapping` are packed: checkpoint module `q_proj` maps to `(qkv_proj, "q")`.

    Under tensor parallelism (`tp` of size > 1) every rank builds the same model holding only its
    shard of each split weight, and its KV cache holds only its KV heads (for the same block ids
    on every rank); the forward runs on all ranks together and the logits come out on rank 0.
    """

    packed_modules_mapping: ClassVar[dict[str, tuple[str, ShardId]]] = {}
    # Checkpoint tensors that carry no parameters (e.g. cached rotary frequencies in old checkpoints).
    ignored_checkpoint_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(
        self, config: ModelArchConfig, attn_backend: type[AttentionBackend], tp: ParallelGroup = SINGLE
    ) -> None:
        super().__init__()
        config.check_tensor_parallel(tp.size)
        self.config = config
        self.attn_backend = attn_backend
        self.tp = tp
        self.num_local_kv_heads = kv_head_shard(config.num_kv_heads, tp.rank, tp.size)[1]

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`input_ids`, `positions`: `[T]` int64 → final hidden states `[T, hidden_size]`."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`[N, hidden_size]` (only the rows that need logits) → `[N, vocab_size]` float32; under
        tensor parallelism every rank calls it and rank 0 gets the logits (the others None)."""

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def attention_layers(self) -> list[Attention]:
        return [module for module in self.modules() if isinstance(module, Attention)]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (this rank's KV heads) under the attention backend."""
        return self.attn_backend.kv_cache_shape(
            num_blocks, block_size, self.num_local_kv_heads, self.config.head_dim
        )

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """One zero-filled cache tensor per layer, in the model's dtype and device (not bound)."""
        return [
            self.attn_backend.allocate_kv_cache(
                num_blocks,
                block_size,
                self.num_local_kv_heads,
                self.config.head_dim,
                self.dtype,
                self.device,
            )
            for _ in range(self.config.num_layers)
        ]

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        layers = self.attention_layers()
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} KV cache tensors (one per layer), got {len(kv_caches)}")
        dtype, device = self.dtype, self.device
        for index, (layer, cache) in enumerate(zip(layers, kv_caches, strict=True)):
            if cache.dtype != dtype or cache.device != device:
                raise ValueError(
                    f"KV cache {index} is {cache.dtype} on {cache.device}; the model is {dtype} on {device}"
                )
            layer.kv_cache = cache

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Load checkpoint tensors by name; raises ValueError on unknown, missing or misshapen ones.
        Each parameter's loader takes its own shard of a split tensor."""
        params = dict(self.named_parameters())
        expected = {
            (name, shard) for name, param in params.items() for shard in getattr(param, "shard_ids", (None,))
        }
        loaded: set[tuple[str, ShardId | None]] = set()
        for ckpt_name, tensor in weights:
            if ckpt_name.endswith(self.ignored_checkpoint_suffixes) or self._is_tied_duplicate(ckpt_name):
                continue
            name, shard = self._map_checkpoint_name(ckpt_name)
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} matches no model parameter")
            try:
                if shard is None:
                    param.weight_loader(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard)
            except ValueError as err:
                raise ValueError(f"cannot load {ckpt_name!r}: {err}") from None
            loaded.add((name, shard))
        missing = sorted(
            f"{name}" + ("" if shard is None else f"[{shard}]") for name, shard in expected - loaded
        )
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing weights for: {shown}")

    def process_weights_after_loading(self) -> None:
        """Let each layer convert its loaded weights for inference (e.g. repack them for a kernel)."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()

    def _is_tied_duplicate(self, ckpt_name: str) -> bool:
        return self.config.tie_word_embeddings and ckpt_name == "lm_head.weight"

    def _map_checkpoint_name(self, ckpt_name: str) -> tuple[str, ShardId | None]:
        parts = ckpt_name.split(".")
        for index, part in enumerate(parts):
            packed = self.packed_modules_mapping.get(part)
            if packed is not None:
                packed_name, shard = packed
                return ".".join([*parts[:index], packed_name, *parts[index + 1 :]]), shard
        return ckpt_name, None
