"""The decoder's decode step as one native call (bf16 on x86-64 CPUs).

A decode step of a small model spends a large share of its time around the GEMMs: eight native
calls per layer (norm, qkv, rotary, attention with the KV write, o, norm, gate_up, down), each
with Python's argument handling and dispatch, and the views of the qkv output between them.
`DecodePlan` binds every layer's weights, norm weights, KV cache and attention parameters once
into a `DecodeProgram` (kernels/csrc/decode_step.cpp), which runs those ops for all layers in one
call: the same ops in `DecoderLayer.forward`'s order on the same tensors, so its results equal
the module path's bit for bit (tests/models/test_decode_plan.py checks it on every variant and
architecture; tests/quant/test_gguf_decode_plan.py for quantized layers).

It applies only where every piece takes the kernel path anyway: bf16 CPU weights packed for
`pagoda.kernels.cpu_gemm` (or fused quantized `QuantLinear`s), one tensor-parallel rank, the
torch paged attention backend, and a decode-only batch over a bf16 KV cache. Everything else runs
the modules (`DecoderModel.forward`).
"""

from __future__ import annotations

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.kernels import build, cpu_gemm
from pagoda.quant.linear import QuantLinear


def _add_linear(program, packed) -> bool:
    """Bind one linear's weight into `program`; False where it does not run a kernel op."""
    if isinstance(packed, cpu_gemm.PackedWeight):
        out_fp32 = packed.data.dtype is torch.float32
        program.add_packed(packed.data, packed.out_features, packed.bias, packed.epilogue, out_fp32)
        return True
    if isinstance(packed, QuantLinear):
        args = packed.kernel_arguments()
        if args is None:
            return False
        program.add_quant(*args)
        return True
    return False


class DecodePlan:
    """Built by `DecodePlan.build(model)` (None where it does not apply) once the layers' KV
    caches are bound; `run` is the layers' forward for a decode-only batch of bf16 CPU
    activations. Valid for the kernel variant in use and the KV caches bound when it was built
    (the model rebuilds it when either changes)."""

    def __init__(
        self, program, kv_caches: tuple[torch.Tensor, ...], sliding_windows: tuple[int, ...]
    ) -> None:
        self.program = program
        self.kv_caches = kv_caches  # the caches bound into the program, one per layer
        self.sliding_windows = sliding_windows  # per layer (0: none)

    @staticmethod
    def build(model) -> DecodePlan | None:
        """The plan for a `DecoderModel`, or None where some layer does not take the kernels or
        a KV cache is not bound bf16 on the CPU."""
        if not model.layers or not build.available():
            return None
        first = model.layers[0]
        eps = first.input_layernorm.eps
        sa = first.self_attn
        namespace = getattr(torch.classes, build.active().name)
        program = namespace.DecodeProgram(sa.num_heads, sa.num_kv_heads, sa.head_dim, eps)
        caches, windows = [], []
        for layer in model.layers:
            sa, mlp = layer.self_attn, layer.mlp
            impl, kv = sa.attn.impl, sa.attn.kv_cache
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if sa.qk_norm:
                norms += (sa.q_norm, sa.k_norm)
            if (
                type(impl) is not TorchPagedAttention
                or sa.o_proj.tp.size != 1
                or mlp.down_proj.tp.size != 1
                or any(n.weight.dtype is not torch.bfloat16 or n.eps != eps for n in norms)
                or kv is None
                or kv.dtype is not torch.bfloat16
                or not kv.is_cpu
            ):
                return None
            for linear in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if not _add_linear(program, linear.packed):
                    return None
            window = impl.sliding_window or 0
            program.add_layer(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                sa.q_norm.weight if sa.qk_norm else None,
                sa.k_norm.weight if sa.qk_norm else None,
                kv,
                impl.scale,
                window,
            )
            caches.append(kv)
            windows.append(window)
        return DecodePlan(program, tuple(caches), tuple(windows))

    def run(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, md: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers on the embedded tokens `hidden` → `(last mlp output, residual)`, as
        `DecoderLayer.forward` computes them layer after layer."""
        return self.program.run(
            hidden, cos, sin, md.block_tables, md.seq_lens, md.query_start_loc, md.slot_mapping
        )
