"""Token embedding and the language-model head (optionally sharing the embedding weight).

A tied pair shares one tensor: after loading, the head may repack it for the CPU kernel (or
keep it quantized), and the embedding then reads its rows from the head's copy (`use_packed`).
An untied embedding whose weight stays quantized dequantizes only the rows it looks up.

Vocab-parallel over a `ParallelGroup`: each rank holds the rows of its vocabulary range
(`vocab_shard`); the embedding looks up the ids in its range, zeros the others and all-reduces;
the head computes its range's logits, which are gathered on rank 0 (for sampling)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed import SINGLE, ParallelGroup, vocab_shard
from pagoda.distributed.sharding import vocab_padded
from pagoda.kernels import cpu_gemm
from pagoda.layers.linear import LinearBase, apply_packed, default_weight_loader, linear, weight_parameter
from pagoda.layers.sharding import CheckpointTensor, narrow
from pagoda.quant.linear import QuantLinear
from pagoda.quant.methods import current_weight_format
from pagoda.quant.tensor import GGMLTensor


def _vocab_rows(module: nn.Module, vocab_size: int, tp: ParallelGroup) -> int:
    """Set `module`'s vocabulary range; returns its row count."""
    module.tp = tp
    module.vocab_size = vocab_size
    module.vocab_start, module.vocab_rows = vocab_shard(vocab_size, tp.rank, tp.size)
    return module.vocab_rows


def _load_vocab_rows(module: nn.Module, param: nn.Parameter, loaded: CheckpointTensor) -> None:
    default_weight_loader(param, narrow(loaded, 0, module.vocab_start, module.vocab_rows, "vocab rows"))


class VocabEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: ParallelGroup = SINGLE
    ) -> None:
        super().__init__()
        self.weight_format = current_weight_format()
        self.weight = weight_parameter(_vocab_rows(self, vocab_size, tp), hidden_size, dtype)
        if tp.size > 1:
            self.weight.weight_loader = self.weight_loader
        self.dtype = dtype
        self.packed: cpu_gemm.PackedWeight | QuantLinear | None = None
        self.quantized: GGMLTensor | None = None

    def process_weights_after_loading(self) -> None:
        if self.weight is None:
            return
        self.quantized = self.weight_format.process_embedding(self.weight)
        if self.quantized is not None:
            self.weight = None  # a tied LM head keeps its own reference until it is processed

    def use_packed(self, packed: cpu_gemm.PackedWeight | QuantLinear) -> None:
        """Read rows from a tied LM head's packed (or quantized) copy of this weight, and drop the weight."""
        self.packed = packed
        self.weight = None
        self.quantized = None

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        _load_vocab_rows(self, param, loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        rows = self._lookup(local.masked_fill(outside, 0))
        rows.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.packed, QuantLinear):
            return self.packed.gather_rows(input_ids).to(self.dtype)
        if self.packed is not None:
            return cpu_gemm.gather_rows(self.packed, input_ids)
        if self.quantized is not None:
            rows = self.quantized.take_rows(input_ids.reshape(-1)).dequantize().to(self.dtype)
            return rows.reshape(*input_ids.shape, self.quantized.shape[1])
        return F.embedding(input_ids, self.weight)


class LMHead(LinearBase):
    """Hidden states → float32 logits. Pass `tied_weight` to share the embedding matrix."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        tied_weight: nn.Parameter | None = None,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        rows = _vocab_rows(self, vocab_size, tp)
        if tied_weight is not None:
            shape = tuple(getattr(tied_weight, "logical_shape", tied_weight.shape))  # a GGUF placeholder's
            if shape != (rows, hidden_size):
                raise ValueError(f"tied weight shape {shape} != {(rows, hidden_size)}")
            self.weight = tied_weight
        else:
            self.weight = weight_parameter(rows, hidden_size, dtype)
            if tp.size > 1:
                self.weight.weight_loader = self.weight_loader
        self.bias = None

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        _load_vocab_rows(self, param, loaded)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`[N, vocab_size]` float32 logits; with tensor parallelism on rank 0 only (None elsewhere)."""
        if self.packed is not None:
            logits = apply_packed(hidden, self.packed, out_dtype=torch.float32)
        else:
            logits = linear(hidden, self.weight, None).float()
        if self.tp.size == 1:
            return logits
        per_rank = vocab_padded(self.vocab_size, self.tp.size) // self.tp.size
        if logits.shape[-1] < per_rank:  # the last rank's range may be shorter
            logits = torch.nn.functional.pad(logits, (0, per_rank - logits.shape[-1]))
        gathered = self.tp.gather(logits, dim=-1)
        return None if gathered is None else gathered[..., : self.vocab_size]
