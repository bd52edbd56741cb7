"""Attention that keeps packed documents apart: variable-length FlashAttention over the whole batch on GPUs.

A packed batch (app.data.PackedCollator) carries `cu_seq_lens_q/k` (where each document starts in the batch
flattened to one row) and `max_length_q/k`, the names transformers' own FlashAttention path reads. This function
hands them to PyTorch's built-in FlashAttention-2 varlen kernel (with GQA's fewer K/V heads), so a document
attends only to itself and no (batch, seq, seq) mask is ever built. It is registered with transformers under
`VARLEN` without a mask function, so the model builds no mask at all; batches without the fields (a model
called outside the training loop) are one document a row.

It computes what the model's own attention computes or it does not run: a layer's sliding window (Mistral, Gemma,
Phi-3, Qwen2's sliding layers) becomes the kernel's left window and attention dropout (GPT-2's) the kernel's own; a
layer that asks for what the kernels do not compute (Gemma 2's logit soft-capping, gpt-oss's attention sinks, a
non-causal layer) runs its model's eager attention over a mask of the batch's documents instead, slower but the
same function.

On CPUs, with no such kernel, every layer runs SDPA over that mask, built from the same boundaries: a model keeps
its documents apart wherever its layers go through transformers' attention functions, including models that give
transformers' own masks no position ids (OPT).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import weakref
from functools import lru_cache

import torch

VARLEN = "finetune_varlen"
log = logging.getLogger("finetune")


# Arguments of transformers' attention functions that these kernels do not compute: softcap (Gemma 2), s_aux and
# sinks (gpt-oss' attention sinks), position_bias (T5's), indices and block_indices (sparse attention).
UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias", "indices", "block_indices")
BATCH_FIELDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _aten_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None, dropout=0.0):
    """FlashAttention-2's varlen kernel as PyTorch ships it (with its autograd formula, dropout's random state
    included); it takes GQA's fewer K/V heads as they are, so K and V are never repeated to the query's head
    count. `window`: how many earlier tokens a token sees (None: all of its document's)."""
    return torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout,
        True,
        False,
        scale=scale,
        window_size_left=window,
        window_size_right=None if window is None else 0,
    )[0]


def _public_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None, dropout=0.0):
    """torch.nn.attention.varlen.varlen_attn, whose keywords differ between releases; where it takes no GQA,
    K and V are repeated to the query's head count."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if dropout or (window is not None and "window_size" not in params):
        raise NotImplementedError(
            "this torch's varlen_attn takes no dropout or window; torch.ops.aten._flash_attention_forward does"
        )
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1 if window is None else window, 0)}
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


KERNELS = {"aten": _aten_varlen, "varlen_attn": _public_varlen}


@lru_cache(maxsize=1)
def _kernel():
    """The varlen kernel: f(q, k, v, cu_q, cu_k, max_q, max_k, scale, window, dropout) on (tokens, heads, head
    size) tensors, or None where this torch has none: PyTorch's FlashAttention-2, through its public wrapper where
    the op is not there. FlashAttention-4 was 5% faster a step on the 1.1B, no faster on the 8B, compiled its
    kernels for 8-14 s at every start and is a beta package the image does not ship: not offered
    (docs/benchmarks.md, "Documents kept apart: the attention kernel"; benchmarks/check_varlen.py measures it)."""
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
    b, h, s, d = query.shape
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None and attention_mask is not None:  # a caller's own (padding) mask: SDPA reads it
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if cu is None:  # a model called outside the training loop: each row one document
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=query.device)
        kwargs = {**kwargs, "cu_seq_lens_k": cu, "max_length_q": s, "max_length_k": s}
    window = left_window(kwargs.get("sliding_window"))
    kernel = _kernel()
    if not query.is_cuda and kernel in KERNELS.values():
        kernel = None  # CUDA kernels: a CPU run (on any machine) takes the mask
    if kernel is None or unsupported(module, kwargs) or (dropout and kernel is not _aten_varlen):
        return over_documents(module, query, key, value, cu, window, dropout, scaling, kwargs)
    dv = value.shape[-1]
    size = max(d, dv)  # the kernels take one head size; MLA's (DeepSeek-V2/V3) values are narrower than its keys
    q, k, v = (_tokens_first(x, size) for x in (query, key, value))
    scale = d**-0.5 if scaling is None else scaling
    out = kernel(
        q, k, v, cu, kwargs["cu_seq_lens_k"], kwargs["max_length_q"], kwargs["max_length_k"], scale, window, dropout
    )
    return out[..., :dv].reshape(b, s, h, dv), None


def _tokens_first(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, H, S, D) as the kernels' (B * S, H, size): zeros past D change no dot product and no output column
    that is kept."""
    b, h, s, d = x.shape
    x = x.transpose(1, 2).reshape(b * s, h, d)
    return x if d == size else torch.nn.functional.pad(x, (0, size - d))


def left_window(sliding_window: int | None) -> int | None:
    """transformers' sliding window (a token sees itself and the `sliding_window` - 1 tokens before it) as the
    kernels' left window."""
    return None if sliding_window is None else max(0, int(sliding_window) - 1)


def unsupported(module, kwargs: dict) -> list[str]:
    """What this layer asks for that the varlen kernels do not compute (empty: nothing)."""
    asked = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if not causal(module, kwargs):
        asked.append("non-causal attention")
    return asked


def causal(module, kwargs: dict) -> bool:
    return kwargs.get("is_causal") is not False and getattr(module, "is_causal", True) is not False


_fallbacks_logged: set[str] = set()


def over_documents(module, query, key, value, cu, window, dropout, scaling, kwargs: dict):
    """The layer's attention over an additive mask that keeps the batch's documents apart (and the sliding window):
    SDPA's, or where the layer asks for what SDPA does not compute, its own model's eager attention, which computes
    every feature transformers gives it. The same function as the kernels', with a (batch, 1, seq, seq) mask."""
    asked = unsupported(module, kwargs)
    b, _, s, _ = query.shape
    mask = shared_document_mask(cu, b, s, window, query.dtype, causal(module, kwargs))
    rest = {k: v for k, v in kwargs.items() if k not in BATCH_FIELDS}
    if not asked:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **rest)
    eager = getattr(importlib.import_module(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            f"{type(module).__name__} asks for {', '.join(asked)}, which variable-length FlashAttention does not "
            "compute, and its model has no eager attention to use instead; set data.separate_documents=false"
        )
    name = type(module).__name__
    if name not in _fallbacks_logged:
        _fallbacks_logged.add(name)
        log.warning(
            f"attention: {name} asks for {', '.join(asked)}; its packed documents are kept apart through the "
            "model's eager attention and a mask (slower than FlashAttention, the same function)"
        )
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **rest)


_masks: tuple | None = None  # (weak reference to a batch's `cu`, {(rows, seq, window, dtype, causal): mask})


def shared_document_mask(
    cu: torch.Tensor, rows: int, seq: int, window: int | None, dtype: torch.dtype, causal: bool = True
) -> torch.Tensor:
    """document_mask, built once per batch and kind of layer instead of once per layer: every layer of a forward
    (and its recomputation under activation checkpointing) gets the same `cu` tensor. Kept only while that tensor
    lives, so no mask outlives its batch."""
    global _masks
    if _masks is None or _masks[0]() is not cu:
        _masks = (weakref.ref(cu, _forget_masks), {})
    key = (cu._version, rows, seq, window, dtype, causal)
    if key not in _masks[1]:
        _masks[1][key] = document_mask(cu, rows, seq, window, dtype, causal)
    return _masks[1][key]


def _forget_masks(ref) -> None:
    global _masks
    if _masks is not None and _masks[0] is ref:
        _masks = None


def document_mask(
    cu: torch.Tensor, rows: int, seq: int, window: int | None, dtype: torch.dtype, causal: bool = True
) -> torch.Tensor:
    """Additive (rows, 1, seq, seq) mask: a token sees the tokens of its own document, the earlier ones only when
    `causal`, and only those within `window` positions when set; `cu` holds the documents' starts in the batch
    flattened to one row, then its end."""
    position = torch.arange(rows * seq, device=cu.device)
    document = torch.searchsorted(cu.to(position.dtype), position, right=True).view(rows, seq)
    i = torch.arange(seq, device=cu.device)
    back = i[:, None] - i[None, :]  # how far back the key is from the query
    seen = document[:, :, None] == document[:, None, :]
    if causal:
        seen &= back >= 0
    if window is not None:
        seen &= back.abs() <= window
    mask = torch.full((rows, 1, seq, seq), torch.finfo(dtype).min, dtype=dtype, device=cu.device)
    return mask.masked_fill(seen[:, None], 0.0)


def register() -> str:
    """Register the function with transformers (idempotent); returns the attn_implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    return VARLEN
