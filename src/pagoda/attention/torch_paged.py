"""Reference paged attention in pure PyTorch (CPU and CUDA).

Cache layout per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (keys, then values),
so a flat slot index addresses one token's `[num_kv_heads, head_dim]` row.

Decodes run as one batched call: their blocks are gathered through the block tables into
`[B, max_len, num_kv_heads, head_dim]` and masked per sequence length. Prefills (and prompt chunks)
run one sequence at a time; a prompt with no cached context attends to its own fresh K/V with
`is_causal`, otherwise its context is gathered from the cache and masked bottom-right causally.
Long bfloat16 prefills on CPUs without AMX run in float32 (see `pagoda.kernels.precision`). In
bf16 and fp32 on x86-64 CPUs (AVX2 and up) every sequence with few new tokens (decodes,
speculative verification steps, short chunks, a prompt's tail after a prefix-cache hit) runs in
one native call that reads the blocks in place
(`pagoda.kernels.cpu_ops.paged_attention`); the runner puts those sequences first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.attention.backend import AttentionBackend, register_attention_backend
from pagoda.attention.metadata import AttentionMetadata
from pagoda.kernels import cpu_ops
from pagoda.kernels.precision import upcast_to_fp32

# Sequences with at most this many new tokens (decodes, the k + 1 rows that verify k <= 64
# speculative drafts, short prompt chunks) attend in the native kernel where it applies; longer
# ones through scaled_dot_product_attention.
NATIVE_MAX_QUERY_LEN = 65


@register_attention_backend("torch")
class TorchPagedAttention(AttentionBackend):
    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_cache[:, dst] = kv_cache[:, src]

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        key_cache.index_copy_(0, slot_mapping, k)
        value_cache.index_copy_(0, slot_mapping, v)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        md = attn_metadata
        native = md.num_leading_seqs_with_at_most(NATIVE_MAX_QUERY_LEN)
        if native and cpu_ops.attention_applies(q, k, v, kv_cache):
            if native == md.num_seqs:
                # One native call writes the new K/V rows and attends (decodes and verification steps).
                return cpu_ops.paged_attention(
                    q,
                    kv_cache,
                    md.block_tables,
                    md.seq_lens,
                    md.query_start_loc,
                    self.scale,
                    self.sliding_window,
                    (k, v, md.slot_mapping),
                )
            self.write_kv(k, v, kv_cache, md.slot_mapping)
            out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
            short = md.query_start_loc_cpu[native]
            out[:short] = cpu_ops.paged_attention(
                q[:short],
                kv_cache,
                md.block_tables,
                md.seq_lens,
                md.query_start_loc[: native + 1],
                self.scale,
                self.sliding_window,
            )
            return self._prefills(q, k, v, kv_cache, md, native, out)
        self.write_kv(k, v, kv_cache, md.slot_mapping)
        num_decodes = md.num_decodes
        if num_decodes and num_decodes == md.num_seqs:
            return self._decode(q, kv_cache, md)
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], kv_cache, md)
        return self._prefills(q, k, v, kv_cache, md, num_decodes, out)

    def _prefills(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        first: int,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Sequences `first ...` one at a time, into `out`."""
        starts = md.query_start_loc_cpu
        for i in range(first, md.num_seqs):
            start, end = starts[i], starts[i + 1]
            out[start:end] = self._prefill(
                q[start:end], k[start:end], v[start:end], kv_cache, md, i, md.seq_lens_cpu[i]
            )
        return out

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
        """`[*block_ids.shape[:-1], n * block_size, kv_heads, head_dim]` rows of `cache` (one of K/V)."""
        rows = cache.index_select(0, block_ids.reshape(-1))
        return rows.view(
            *block_ids.shape[:-1], block_ids.shape[-1] * block_size, self.num_kv_heads, self.head_dim
        )

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        batch = q.shape[0]
        block_size = md.block_size
        max_len = max(md.seq_lens_cpu[:batch])
        num_blocks = -(-max_len // block_size)
        block_ids = md.block_tables[:batch, :num_blocks]
        # [B, S, Hkv, D] viewed as [B, Hkv, S, D]; the query heads of one KV group act as G "rows".
        keys = self._gather(kv_cache[0], block_ids, block_size).transpose(1, 2)
        values = self._gather(kv_cache[1], block_ids, block_size).transpose(1, 2)
        group = self.num_heads // self.num_kv_heads
        query = q.reshape(batch, self.num_kv_heads, group, self.head_dim)

        seq_lens = md.seq_lens[:batch].to(torch.long)
        key_pos = torch.arange(num_blocks * block_size, device=q.device)
        visible = key_pos[None, :] < seq_lens[:, None]
        if self.sliding_window is not None:
            visible &= key_pos[None, :] > (seq_lens[:, None] - 1 - self.sliding_window)
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=visible[:, None, None, :], scale=self.scale
        )
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        seq_index: int,
        seq_len: int,
    ) -> torch.Tensor:
        query_len = q.shape[0]
        context_len = seq_len - query_len
        if context_len == 0:
            keys, values = k, v
        else:
            num_blocks = -(-seq_len // md.block_size)
            block_ids = md.block_tables[seq_index, :num_blocks]
            keys = self._gather(kv_cache[0], block_ids, md.block_size)[:seq_len]
            values = self._gather(kv_cache[1], block_ids, md.block_size)[:seq_len]

        window = self.sliding_window
        mask = None
        if context_len > 0 or (window is not None and window < query_len):
            query_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]
            key_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = key_pos <= query_pos
            if window is not None:
                mask &= key_pos > query_pos - window
        dtype = q.dtype
        if upcast_to_fp32(q, query_len):
            q, keys, values = q.float(), keys.float(), values.float()
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(0).transpose(0, 1).to(dtype)
