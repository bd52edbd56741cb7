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
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F


def losses_match() -> dict:
    from transformers import LlamaConfig

    from app import attention, data
    from app.config import ModelConfig
    from app.model import load_model

    folder = tempfile.mkdtemp()
    LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        dtype="bfloat16",
    ).save_pretrained(folder)
    cfg = ModelConfig(name_or_path=f"random-init:{folder}", liger_kernels=False)
    torch.manual_seed(0)
    varlen = load_model(cfg, {}, separate_documents=True).cuda().bfloat16().eval()
    sdpa = load_model(cfg, {}, separate_documents=False).cuda().bfloat16().eval()
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
        "varlen_fa4": varlen(attention.KERNELS["fa4"]),
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for name, fn in (("losses", losses_match), ("attention", attention_costs)):
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
