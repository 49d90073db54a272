"""Which part of a tensor-parallel dimension each rank holds (Megatron's split, vLLM's KV-head
replication), with a clear error where a shape cannot be split."""

from __future__ import annotations


def even_split(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """`(start, length)` of rank `rank`'s equal part of `total`; ValueError unless `size` divides it."""
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({size})")
    length = total // size
    return rank * length, length


def kv_head_shard(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """`(first_head, count)` of the KV heads rank `rank` holds: an equal split where there are at
    least as many KV heads as ranks, else one head replicated on `size / num_kv_heads` ranks."""
    if num_kv_heads >= size:
        return even_split(num_kv_heads, rank, size, "num_key_value_heads")
    if size % num_kv_heads:
        raise ValueError(
            f"the tensor-parallel size ({size}) must be a multiple of num_key_value_heads "
            f"({num_kv_heads}) when it is larger"
        )
    return rank // (size // num_kv_heads), 1


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """`(start, length)` of rank `rank`'s vocabulary rows: `ceil(vocab / size)` each, the last
    rank the rest (so any vocabulary splits; `vocab_padded` is what gathered logits are padded to)."""
    per_rank = -(-vocab_size // size)
    start = rank * per_rank
    if start >= vocab_size:
        raise ValueError(f"vocab_size ({vocab_size}) is too small for the tensor-parallel size ({size})")
    return start, min(per_rank, vocab_size - start)


def vocab_padded(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size) * size
