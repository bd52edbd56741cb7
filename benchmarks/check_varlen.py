"""On a GPU: does the varlen attention path (app.attention) compute what SDPA with transformers' block mask
computes, and what do the three ways of attending cost at the 1.1B shape? One JSON object on stdout.

    python -m benchmarks.check_varlen [--out FILE]

1. A small Llama in bf16 on the GPU, built by app.model.load_model twice (varlen, and SDPA with the block mask
   derived from the per-document position ids), same weights, same packed batch: per-token losses compared.
2. Attention forward+backward alone at Llama 1.1B's attention shape (16 x 2048 tokens, 32 query heads, 4 K/V
   heads, head size 64) on the benchmark corpus' document lengths: causal SDPA over whole blocks (the earlier,
   cross-document packing; FlashAttention's and cuDNN's), varlen FlashAttention-2 per document (PyTorch's op and
   its public wrapper), FlashAttention-4 (where flash-attn-4 is importable), cuDNN's varlen op, and SDPA with a
   block-diagonal mask.
3. The kernel's window and dropout (app.attention hands it a layer's sliding window and attention dropout): at that
   shape with a 256-token window, output and gradients against SDPA with the block mask and the window; with
   dropout 0.1, the same output for the same seed, its mean over seeds against the output without dropout, and the
   gradient of V against the change of the output for a change of V (the output is linear in V for one dropout
   draw, so a backward pass that dropped other weights than its forward would not match); and a small Mistral
   with a 64-token window, built by load_model both ways, per-token losses compared; a small Gemma 2 (soft-capped
   attention logits, which the kernel lacks: the varlen path runs its eager attention) against its eager model.
4. A small DeepSeek-V3 (multi-head latent attention: values narrower than keys, padded for the kernel), built by
   load_model both ways, per-token losses compared; and whether the kernel itself takes narrower values.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F


def losses_match(model_type: str = "llama", reference_attn: str = "sdpa", **settings) -> dict:
    """Per-token losses of a small `model_type` built by load_model with the varlen path and with `reference_attn`
    (transformers' own mask from the per-document position ids), same weights, same packed batch."""
    from transformers import AutoConfig

    from app import attention, data
    from app.config import ModelConfig
    from app.model import load_model

    folder = tempfile.mkdtemp()
    sizes = {"intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}
    AutoConfig.for_model(
        model_type,
        vocab_size=1000,
        hidden_size=256,
        max_position_embeddings=1024,
        dtype="bfloat16",
        **{"head_dim": 32, **sizes, **settings},
    ).save_pretrained(folder)
    cfg = ModelConfig(name_or_path=f"random-init:{folder}", liger_kernels=False)
    torch.manual_seed(0)
    varlen = load_model(cfg, {}, separate_documents=True).cuda().bfloat16().eval()
    reference = cfg.model_copy(update={"attn_implementation": reference_attn})
    sdpa = load_model(reference, {}, separate_documents=False).cuda().bfloat16().eval()
    sdpa.load_state_dict(varlen.state_dict())
    ids = torch.randint(1, 1000, (4, 512))
    for row in range(4):
        ids[row, torch.randint(0, 512, (6,))] = 0
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in data.packed_batch(ids, ids.clone(), 0).items()}
    with torch.no_grad():
        a = varlen(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        b = sdpa(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.float()
    keep = batch["labels"][:, 1:] != -100
    la = F.cross_entropy(a[:, :-1][keep], batch["labels"][:, 1:][keep], reduction="none")
    lb = F.cross_entropy(b[:, :-1][keep], batch["labels"][:, 1:][keep], reduction="none")
    return {
        "attn": varlen.config._attn_implementation,
        "tokens": int(keep.sum()),
        "max_abs_loss_diff": float((la - lb).abs().max()),
        "mean_loss": [float(la.mean()), float(lb.mean())],
        "logits_rel_err": float((a - b).norm() / b.norm()),
        "kernel": attention._kernel().__name__,
    }


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def _fa4_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """FlashAttention-4's CuTe-DSL kernels (package flash-attn-4, Hopper and Blackwell), GQA native: measured here,
    not offered by the app (app.attention._kernel says why)."""
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


def _cudnn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """cuDNN's varlen attention (torch's private op; torch's own varlen_attn keeps it switched off and gives it no
    GQA), K/V repeated to the query's heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, True, False, scale=scale
    )[0]


def _cudnn_whole(q, k, v):
    def forward():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

    return forward


def attention_costs() -> dict:
    from app import attention, data
    from benchmarks import assets

    b, s, h, kv, d = 16, 2048, 32, 4, 64
    rng = np.random.default_rng(0)
    lens = assets.LENGTHS["docs"].sample(rng, 4000)
    ids = torch.full((b * s,), 5)
    ends = np.cumsum(lens + 1) - 1
    ids[ends[ends < b * s]] = 0
    batch = data.packed_batch(ids.view(b, s), ids.view(b, s).clone(), 0)
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    cu = batch["cu_seq_lens_q"].cuda()
    pos = batch["position_ids"].cuda()
    doc = (pos == 0).cumsum(1)
    mask = (doc[:, None, :, None] == doc[:, None, None, :]) & torch.ones(s, s, dtype=torch.bool, device="cuda").tril()

    def run(forward):
        def step():
            out = forward()
            out.backward(grad)

        return step

    def varlen(kernel):
        def forward():
            bs, heads = b * s, q.shape[1]
            flat = [t.transpose(1, 2).reshape(bs, t.shape[1], d) for t in (q, k, v)]
            return kernel(*flat, cu, cu, batch["max_length_q"], batch["max_length_q"], d**-0.5).view(b, s, heads, d)

        return forward

    forwards = {
        "causal_sdpa_whole_blocks": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ).transpose(1, 2),
        "varlen_aten_gqa": varlen(attention.KERNELS["aten"]),
        "varlen_attn_public": varlen(attention.KERNELS["varlen_attn"]),
        "varlen_fa4": varlen(_fa4_varlen),
        "varlen_cudnn_kv_repeated": varlen(_cudnn_varlen),
        "causal_cudnn_whole_blocks": _cudnn_whole(q, k, v),
        "sdpa_block_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(
            1, 2
        ),
    }
    out = {
        "docs_in_batch": int(len(cu) - 1),
        "longest_doc": batch["max_length_q"],
        "ms_fwd_bwd": {},
        "rel_err_vs_block_mask": {},
    }
    reference = None
    for name in (
        "sdpa_block_mask",
        "causal_sdpa_whole_blocks",
        "varlen_aten_gqa",
        "varlen_attn_public",
        "varlen_fa4",
        "varlen_cudnn_kv_repeated",
        "causal_cudnn_whole_blocks",
    ):
        try:
            for t in (q, k, v):
                t.grad = None
            o = forwards[name]()
            o.backward(grad)
            got = [o.detach().float()] + [t.grad.float() for t in (q, k, v)]
            if reference is None:
                reference = got
            else:
                out["rel_err_vs_block_mask"][name] = [
                    round(float((a - r).norm() / r.norm()), 5) for a, r in zip(got, reference)
                ]
            out["ms_fwd_bwd"][name] = round(timed(run(forwards[name])), 3)
        except Exception as exc:  # noqa: BLE001 - report, keep measuring the others
            out["ms_fwd_bwd"][name] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def kernel_features() -> dict:
    """The aten kernel's window and dropout at the 1.1B's attention shape (module docstring, 3)."""
    from app import attention
    from benchmarks import assets

    b, s, h, kv, d, window, p = 16, 2048, 32, 4, 64, 255, 0.1
    rng = np.random.default_rng(0)
    lens = assets.LENGTHS["docs"].sample(rng, 4000) * 4  # documents longer than the window
    starts = np.concatenate([[0], np.cumsum(lens)])
    starts = starts[starts < b * s].tolist()
    # Every row starts a document, as the loader's blocks do.
    cu_list = sorted(set(starts) | set(range(0, b * s, s))) + [b * s]
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    longest = int(max(np.diff(cu_list)))
    torch.manual_seed(0)
    q, k, v = (torch.randn(b * s, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in (h, kv, kv))
    grad = torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16)
    kernel = attention.KERNELS["aten"]

    def forward_backward(window_=None, dropout=0.0, seed=0, value=None):
        torch.manual_seed(seed)
        for t in (q, k, v):
            t.grad = None
        out = kernel(q, k, v if value is None else value, cu, cu, longest, longest, d**-0.5, window_, dropout)
        out.backward(grad)
        return out.detach().float(), [t.grad.float() if t.grad is not None else None for t in (q, k, v)]

    # Reference: SDPA over (rows, heads, seq, seq) with the block mask and the window.
    position = torch.arange(b * s, device="cuda")
    doc = torch.searchsorted(cu.long(), position, right=True).view(b, s)
    i = torch.arange(s, device="cuda")
    back = i[:, None] - i[None, :]
    mask = (doc[:, None, :, None] == doc[:, None, None, :]) & (back >= 0) & (back <= window)
    qr, kr, vr = (t.detach().view(b, s, -1, d).transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    ref.backward(grad.view(b, s, h, d))
    ref_all = [ref.detach().float().reshape(b * s, h, d)] + [
        t.grad.float().transpose(1, 2).reshape(b * s, -1, d) for t in (qr, kr, vr)
    ]
    got_out, got_grads = forward_backward(window)
    out = {"window": window, "docs": len(cu_list) - 1, "longest_doc": longest}
    out["window_rel_err_out_dq_dk_dv"] = [
        round(float((a - r).norm() / r.norm()), 5) for a, r in zip([got_out, *got_grads], ref_all)
    ]
    full_out, _ = forward_backward(None)
    out["window_changes_output_rel"] = round(float((full_out - got_out).norm() / full_out.norm()), 4)
    out["ms_fwd_bwd_full_vs_window"] = [
        round(timed(lambda: forward_backward(None)), 3),
        round(timed(lambda: forward_backward(window)), 3),
    ]

    # Dropout: deterministic for a seed, unbiased, and the backward drops what the forward dropped.
    a, ga = forward_backward(None, p, seed=1)
    a2, ga2 = forward_backward(None, p, seed=1)
    out["dropout_same_seed_same_output"] = bool(torch.equal(a, a2))
    # FlashAttention-2's backward adds into dq atomically, so gradients differ in their last bits between calls.
    out["dropout_same_seed_grad_rel_diff"] = [round(float((x - y).norm() / y.norm()), 5) for x, y in zip(ga, ga2)]
    out["dropout_changes_output_rel"] = round(float((a - full_out).norm() / full_out.norm()), 4)
    draws = 64
    mean = sum(forward_backward(None, p, seed=100 + n)[0] for n in range(draws)) / draws
    out[f"dropout_mean_of_{draws}_vs_no_dropout_rel"] = round(float((mean - full_out).norm() / full_out.norm()), 4)
    dv = torch.randn_like(v) * 0.1
    moved, _ = forward_backward(None, p, seed=1, value=(v + dv).detach().requires_grad_())
    change = float((grad.float() * (moved - a)).sum())  # <grad, out(v + dv) - out(v)>, exact for one draw
    predicted = float((dv.float() * ga[2]).sum())  # <dv, dL/dv>
    out["dropout_dv_change_vs_gradient"] = [round(change, 3), round(predicted, 3)]
    out["dropout_dv_rel_err"] = round(abs(change - predicted) / abs(predicted), 4)
    return out


DEEPSEEK_V3_SMALL = {
    "num_key_value_heads": 8,
    "head_dim": 16,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "kv_lora_rank": 64,
    "q_lora_rank": None,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
}

DEEPSEEK_V3_DENSE = {**DEEPSEEK_V3_SMALL, "first_k_dense_replace": 2}  # both layers dense: no experts


def one_head_size() -> dict:
    """Whether PyTorch's FlashAttention-2 varlen op takes values narrower than the keys (why app.attention pads)."""
    q = torch.randn(64, 4, 48, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(64, 4, 32, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 64], device="cuda", dtype=torch.int32)
    try:
        torch.ops.aten._flash_attention_forward(q, q, v, cu, cu, 64, 64, 0.0, True, False, scale=0.1)
    except Exception as exc:  # noqa: BLE001
        return {"narrower_values": f"refused: {type(exc).__name__}: {exc}"[:300]}
    return {"narrower_values": "taken"}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    checks = (
        ("losses", losses_match),
        ("losses_sliding_window", lambda: losses_match("mistral", sliding_window=64)),
        # Soft-capped attention logits: the varlen path runs Gemma 2's eager attention over the documents' mask.
        ("losses_gemma2_softcap", lambda: losses_match("gemma2", "eager", sliding_window=64)),
        # Multi-head latent attention: keys of 48 (32 + 16 rotary), values of 32, padded for the kernel.
        ("losses_deepseek_v3_mla", lambda: losses_match("deepseek_v3", **DEEPSEEK_V3_SMALL)),
        # The same without its mixture of experts (both layers dense): no top-k routing to flip on bf16 noise.
        ("losses_deepseek_v3_mla_dense", lambda: losses_match("deepseek_v3", **DEEPSEEK_V3_DENSE)),
        ("kernel_one_head_size", one_head_size),
        ("attention", attention_costs),
        ("kernel_window_dropout", kernel_features),
    )
    for name, fn in checks:
        try:
            result[name] = fn()
        except Exception as exc:  # noqa: BLE001
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
