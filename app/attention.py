"""Attention that keeps packed documents apart on GPUs: variable-length FlashAttention over the whole batch.

A packed batch (app.data.PackedCollator) carries `cu_seq_lens_q/k` (where each document starts in the batch
flattened to one row) and `max_length_q/k`, the names transformers' own FlashAttention path reads. This function
hands them to PyTorch's built-in FlashAttention-2 varlen kernel (with GQA's fewer K/V heads), so a document
attends only to itself and no (batch, seq, seq) mask is ever built. It is registered with transformers under
`VARLEN` without a mask function, so the model builds no mask at all; batches without the fields (a model
called outside the training loop) fall back to plain causal SDPA.

On CPUs the model keeps "sdpa", where transformers derives a block-diagonal mask from the per-document
`position_ids`: slower, but the same function.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch

VARLEN = "finetune_varlen"


def _aten_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """FlashAttention-2's varlen kernel as PyTorch ships it (with its autograd formula); it takes GQA's fewer K/V
    heads as they are, so K and V are never repeated to the query's head count."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]


def _public_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """torch.nn.attention.varlen.varlen_attn, whose keywords differ between releases; where it takes no GQA,
    K and V are repeated to the query's head count."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if "scale" in params:
        kw["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-6:
        raise NotImplementedError(f"this torch's varlen_attn takes no scale; the model needs {scale}")
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def _fa4_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """FlashAttention-4's CuTe-DSL kernels (package flash-attn-4, Hopper and Blackwell), GQA native."""
    from flash_attn.cute.interface import flash_attn_varlen_func

    out = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        softmax_scale=scale,
        causal=True,
    )
    return out[0] if isinstance(out, tuple) else out


KERNELS = {"aten": _aten_varlen, "varlen_attn": _public_varlen, "fa4": _fa4_varlen}


@lru_cache(maxsize=1)
def _kernel():
    """The varlen kernel: f(q, k, v, cu_q, cu_k, max_q, max_k, scale) on (tokens, heads, head size) tensors, or
    None where this torch has none. PyTorch's FlashAttention-2 unless FINETUNE_VARLEN_KERNEL names another of
    KERNELS: FlashAttention-4 ("fa4") is 1.55x faster per layer on an H200 but compiles its kernels at the first
    step (8-14 s a process) and is a beta package, so it is not the default (docs/benchmarks.md, run N)."""
    import os

    name = os.environ.get("FINETUNE_VARLEN_KERNEL")
    if name in KERNELS:
        return KERNELS[name]
    if hasattr(torch.ops.aten, "_flash_attention_forward"):
        return _aten_varlen
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return None
    return _public_varlen


def available() -> bool:
    return torch.cuda.is_available() and _kernel() is not None


def varlen_attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
):
    """transformers' attention-function contract: (B, H, S, D) in, (B, S, H, D) out."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    b, h, s, d = query.shape
    q = query.transpose(1, 2).reshape(b * s, h, d)
    k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
    out = _kernel()(
        q,
        k,
        v,
        cu,
        kwargs["cu_seq_lens_k"],
        kwargs["max_length_q"],
        kwargs["max_length_k"],
        d**-0.5 if scaling is None else scaling,
    )
    return out.view(b, s, h, d), None


def register() -> str:
    """Register the function with transformers (idempotent); returns the attn_implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    return VARLEN
