"""Packing keeps documents apart: a packed batch computes, token for token, what each document computes alone."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import CORPUS
from transformers import AutoTokenizer, LlamaConfig

from app import data
from app.config import DataConfig, ModelConfig
from app.model import attention_kernel, load_model

EOS = 0


def test_packed_batch_restarts_positions_and_masks_cross_document_targets():
    ids = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 4], [3, EOS, EOS, 2, 2, 2, 2, 2]])
    b = data.packed_batch(ids, ids.clone(), EOS)
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 0, 1, 2, 3, 4]]
    starts = b["position_ids"] == 0
    assert (b["labels"][starts] == -100).all() and torch.equal(b["labels"][~starts], ids[~starts])
    # Boundaries of the batch flattened to one row: every document start, then the end.
    assert b["cu_seq_lens_q"].tolist() == [0, 3, 7, 8, 10, 11, 16] and b["cu_seq_lens_q"].dtype == torch.int32
    assert b["max_length_q"] == 5 and b["cu_seq_lens_k"] is b["cu_seq_lens_q"]


def test_collator_only_when_packed_documents_are_kept_apart():
    tok = type("Tok", (), {"eos_token_id": EOS})()
    assert isinstance(data.collator(DataConfig(dataset="x"), tok), data.PackedCollator)  # the default
    assert data.collator(DataConfig(dataset="x", separate_documents=False), tok) is None
    assert data.collator(DataConfig(dataset="x", packing=False), tok) is None


def test_cpu_keeps_sdpa():
    # On CPUs the model keeps SDPA, which builds a block-diagonal mask from the per-document position ids.
    assert attention_kernel(ModelConfig(), separate_documents=True) == (
        "sdpa" if not torch.cuda.is_available() else "finetune_varlen"
    )
    assert attention_kernel(ModelConfig(), separate_documents=False) == "sdpa"


def per_token_losses(model, batch: dict) -> torch.Tensor:
    """Cross-entropy of each next-token prediction, (rows, seq-1); NaN where the label is ignored."""
    fields = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**fields).logits.float()
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels.clamp(min=0), reduction="none")
    return loss.masked_fill(labels == -100, float("nan"))


def build(arch: str, tiny_model, vocab: int, tmp_path):
    """The model as the training loop builds it (app.model.load_model), the tiny GPT-2 or a tiny Llama."""
    torch.manual_seed(0)
    if arch == "gpt2":
        return load_model(ModelConfig(name_or_path=str(tiny_model)), {}, separate_documents=True)
    LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ).save_pretrained(tmp_path)
    return load_model(ModelConfig(name_or_path=f"random-init:{tmp_path}"), {}, separate_documents=True)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_losses_equal_each_document_run_alone(tiny_model, tmp_path, arch):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = DataConfig(dataset=str(CORPUS), split="train[:120]", seq_length=64)
    blocks = data.tokenize(data.load_split(cfg, cfg.split), tok, cfg)
    model = build(arch, tiny_model, len(tok), tmp_path).eval()
    batch = data.PackedCollator(tok.eos_token_id)([blocks[i] for i in range(4)])
    packed = per_token_losses(model, batch)

    # Every document (or document piece) of every block, run on its own from position 0.
    compared = 0
    for row in range(batch["input_ids"].shape[0]):
        starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [cfg.seq_length]
        for lo, hi in itertools.pairwise(starts):
            if hi - lo < 2:
                continue
            doc = batch["input_ids"][row, lo:hi][None]
            alone = per_token_losses(model, {"input_ids": doc, "labels": doc})[0]
            torch.testing.assert_close(packed[row, lo : hi - 1], alone, rtol=1e-4, atol=1e-4)
            compared += hi - lo - 1
    assert compared > 200
    # Not vacuous: the same blocks with today's concatenation (no position ids) give other losses.
    across = per_token_losses(model, {"input_ids": batch["input_ids"], "labels": batch["labels"]})
    assert not torch.allclose(across.nan_to_num(), packed.nan_to_num(), atol=1e-3)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """What FlashAttention's causal varlen kernel computes, one document at a time with SDPA (CPU stand-in)."""
    out = torch.empty_like(q)
    for lo, hi in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        seg = [t[lo:hi].transpose(0, 1) for t in (q, k, v)]
        out[lo:hi] = F.scaled_dot_product_attention(*seg, is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
    return out


def test_varlen_path_computes_what_the_block_mask_computes(monkeypatch, tmp_path):
    # The GPU path's own code (layouts, GQA's fewer K/V heads, the batch's boundaries), with the CUDA kernel replaced
    # by a per-document reference: the model's logits equal those of SDPA with transformers' block mask.
    from app import attention

    sdpa = build("llama", None, 50, tmp_path).eval()
    assert sdpa.config._attn_implementation == "sdpa"
    monkeypatch.setattr(attention, "_kernel", lambda: reference_varlen)
    monkeypatch.setattr(attention, "available", lambda: True)
    varlen = load_model(ModelConfig(name_or_path=f"random-init:{tmp_path}"), {}, separate_documents=True).eval()
    assert varlen.config._attn_implementation == attention.VARLEN
    varlen.load_state_dict(sdpa.state_dict())
    ids = torch.randint(1, 50, (3, 40))
    ids[0, [5, 17, 30]] = EOS
    ids[2, [0, 39]] = EOS
    batch = data.packed_batch(ids, ids.clone(), EOS)
    torch.testing.assert_close(per_token_losses(varlen, batch), per_token_losses(sdpa, batch), equal_nan=True)
    # Without the boundaries (a model called outside the loop) it is plain causal attention.
    plain = {"input_ids": ids, "labels": ids}
    torch.testing.assert_close(per_token_losses(varlen, plain), per_token_losses(sdpa, plain))
