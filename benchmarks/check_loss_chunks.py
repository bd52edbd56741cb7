"""On a GPU: Liger's fused linear cross-entropy in the chunks app.model.loss_options asks for, against Liger's own
chunking, both against the same loss in fp32 (logits materialised whole): the loss and the gradients of the
hidden states and of the head's weight, bf16 inputs, at the Qwen2-0.5B shape's head (vocabulary 151,936, hidden
size 896) and the Llama 1.1B's (32,000 x 2048), 16,384 tokens a micro-batch, a third of them not targets. Then the
option through a model's forward: the chunk bound Liger received. One JSON object on stdout or in --out.

    python -m benchmarks.check_loss_chunks [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import torch.nn.functional as F


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def head_loss(vocab: int, hidden: int, tokens: int = 16384) -> dict:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    torch.manual_seed(0)
    h = (torch.randn(tokens, hidden, device="cuda") * 0.5).bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).bfloat16()
    y = torch.randint(0, vocab, (tokens,), device="cuda")
    y[torch.rand(tokens, device="cuda") < 0.33] = -100

    def run(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(hh, ww)
        loss.backward()
        return loss.float().item(), hh.grad, ww.grad

    ref = run(lambda a, b: F.cross_entropy(a.float() @ b.float().t(), y, ignore_index=-100))
    chunks = max(1, 2**27 // (tokens * hidden))
    out = {"chunk_mem_const": chunks, "loss_fp32": ref[0]}
    for name, c in (("liger_own", 1), ("app", chunks)):
        got = run(lambda a, b, c=c: liger_fused_linear_cross_entropy(a, b, y, chunk_mem_const=c))
        out[name] = {"loss": got[0], "dh_rel_err": relative(got[1], ref[1]), "dw_rel_err": relative(got[2], ref[2])}
    return out


def through_the_model() -> dict:
    """The option reaches Liger's loss through a Liger-patched model's forward (the chunk bound it was called with)."""
    from liger_kernel.ops import fused_linear_cross_entropy as flce
    from transformers import Qwen2Config

    from app import data
    from app.config import ModelConfig
    from app.model import load_model, loss_options

    folder = tempfile.mkdtemp()
    Qwen2Config(vocab_size=151936, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(folder)  # fmt: skip
    model = load_model(ModelConfig(name_or_path=f"random-init:{folder}"), {}, separate_documents=True)
    model = model.cuda().bfloat16().train()
    ids = torch.randint(1, 151936, (4, 1024))
    ids[:, 500] = 0
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in data.packed_batch(ids, ids.clone(), 0).items()}
    seen = []
    original = flce.fused_linear_cross_entropy_forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("chunk_mem_const"))
        return original(*args, **kwargs)

    flce.fused_linear_cross_entropy_forward = spy
    try:
        options = loss_options(model, 4 * 1024)
        losses = [model(**batch, **extra).loss.float().item() for extra in ({}, options)]
    finally:
        flce.fused_linear_cross_entropy_forward = original
    return {"forward": model.forward.__module__, "options": options, "liger_got": seen, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()
    result = {
        "qwen2-0.5b head": head_loss(151936, 896),
        "llama-1.1b head": head_loss(32000, 2048),
        "through the model": through_the_model(),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
