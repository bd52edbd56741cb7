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


def test_packed_documents_take_the_app_attention_on_every_device():
    # GPUs: variable-length FlashAttention; CPUs: SDPA over the documents' mask built from the same boundaries. A
    # model whose layers compute their own attention (Falcon: any other name fails at its first forward) keeps SDPA.
    from transformers import FalconConfig

    llama = LlamaConfig()
    assert attention_kernel(ModelConfig(), True, llama) == "finetune_varlen"
    assert attention_kernel(ModelConfig(), False, llama) == "sdpa"
    assert attention_kernel(ModelConfig(attn_implementation="eager"), True, llama) == "eager"
    assert attention_kernel(ModelConfig(), True, FalconConfig()) == "sdpa"
    assert attention_kernel(ModelConfig(), True, None) == "sdpa"


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_models_without_sdpa_train_unpacked_through_their_eager_attention(tmp_path, model_type):
    # transformers refuses SDPA for Gemma 2 (soft-capping) and gpt-oss (sinks) at load; "sdpa" (the default) then
    # takes the model's eager attention, as transformers does when asked for nothing.
    settings = {"num_local_experts": 4, "num_experts_per_tok": 2} if model_type == "gpt_oss" else {}
    model = tiny_config(model_type, tmp_path / "sdpa", **settings).eval()
    assert model.config._attn_implementation == "eager"
    eager = tiny_config(model_type, tmp_path / "eager", attn="eager", **settings).eval()
    batch = {"input_ids": packed_ids(50)["input_ids"], "labels": packed_ids(50)["input_ids"]}
    torch.testing.assert_close(per_token_losses(model, batch), per_token_losses(eager, batch))


def test_documents_stay_apart_where_transformers_mask_would_join_them(tmp_path):
    # OPT gives transformers' mask no position ids, so SDPA with that mask lets a packed document see the one before
    # it; the app's attention builds its mask from the batch's boundaries, so each document computes what it
    # computes alone.
    model = tiny_config("opt", tmp_path, apart=True, ffn_dim=128, num_key_value_heads=None, head_dim=None).eval()
    assert model.config._attn_implementation == "finetune_varlen"
    batch = packed_ids(50)
    packed = per_token_losses(model, batch)
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    for lo, hi in itertools.pairwise(starts):
        doc = batch["input_ids"][0, lo:hi][None]
        alone = per_token_losses(model, {"input_ids": doc, "labels": doc})[0]
        torch.testing.assert_close(packed[0, lo : hi - 1], alone, rtol=1e-4, atol=1e-4)
    joined = load_model(ModelConfig(name_or_path=f"random-init:{tmp_path}"), {}, separate_documents=False).eval()
    joined.load_state_dict(model.state_dict())
    assert not torch.allclose(per_token_losses(joined, batch).nan_to_num(), packed.nan_to_num(), atol=1e-3)


def test_recurrent_layers_carry_state_across_packed_documents(tmp_path):
    # Why the driver refuses packing for models with recurrent layers (app.model.packed_documents_problems): Bamba's
    # Mamba layers see the document before, whatever the attention layers do. Should transformers keep packed
    # documents apart there, this fails, and the refusal can go.
    model = tiny_config("bamba", tmp_path, apart=True).eval()
    batch = packed_ids(50)
    packed = per_token_losses(model, batch)
    start, end = (batch["position_ids"][0] == 0).nonzero().flatten()[1:3].tolist()  # the first row's 2nd document
    doc = batch["input_ids"][0, start:end][None]
    alone = per_token_losses(model, {"input_ids": doc, "labels": doc})[0]
    assert not torch.allclose(packed[0, start : end - 1], alone, atol=1e-3)
    llama = tiny_config("llama", tmp_path / "llama", apart=True).eval()  # attention alone: the same losses
    alone = per_token_losses(llama, {"input_ids": doc, "labels": doc})[0]
    torch.testing.assert_close(per_token_losses(llama, batch)[0, start : end - 1], alone, rtol=1e-4, atol=1e-4)


class EngineStandIn:
    """What app.train_loop.refuse_leaking_attention uses of DeepSpeed's engine (the CPU runs use the real one)."""

    def __init__(self, model):
        self.model, self.device = model, torch.device("cpu")

    def __call__(self, **fields):
        return self.model(**fields)

    def eval(self):
        self.model.eval()

    def train(self):
        self.model.train()


OPT = {"ffn_dim": 128, "num_key_value_heads": None, "head_dim": None}


@pytest.mark.parametrize(
    "model_type, attn, settings, apart",
    [
        ("llama", "sdpa", {}, True),  # the app's attention
        ("opt", "sdpa", OPT, True),  # the app's attention, where transformers' mask would join them
        ("stablelm", "sdpa", {}, True),  # its own attention, with transformers' packed mask
        ("biogpt", "sdpa", {}, False),  # its own attention: transformers' mask joins them
        ("bloom", "sdpa", {}, False),  # no SDPA: its eager attention, whose ALiBi ignores position ids
        ("opt", "eager", OPT, False),  # eager chosen: transformers' mask without position ids
    ],
)
def test_packed_documents_through_attention_that_joins_them_stop_the_run(tmp_path, model_type, attn, settings, apart):
    from app.errors import Problem
    from app.train_loop import packed_documents_leak, refuse_leaking_attention

    model = tiny_config(model_type, tmp_path, attn=attn, apart=True, **settings).eval()
    leak = packed_documents_leak(model, 50, "cpu")
    model.train()  # as the engine is built: the check evaluates, then hands it back training
    if apart:
        assert leak == 0.0
        refuse_leaking_attention(EngineStandIn(model), model.config)
    else:
        assert leak > 1e-3
        with pytest.raises(Problem) as caught:
            refuse_leaking_attention(EngineStandIn(model), model.config)
        assert caught.value.field == "data.packing" and "data.packing=false" in caught.value.fix
        assert ("model.attn_implementation=sdpa" in caught.value.fix) == (attn == "eager")
    assert model.training


def per_token_losses(model, batch: dict) -> torch.Tensor:
    """Cross-entropy of each next-token prediction, (rows, seq-1); NaN where the label is ignored."""
    fields = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**fields).logits.float()
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels.clamp(min=0), reduction="none")
    return loss.masked_fill(labels == -100, float("nan"))


def build(arch: str, tiny_model, vocab: int, tmp_path, apart: bool = True):
    """The model as the training loop builds it (app.model.load_model), the tiny GPT-2 or a tiny Llama; `apart`:
    with the app's attention for packed documents, else transformers' SDPA."""
    torch.manual_seed(0)
    if arch == "gpt2":
        return load_model(ModelConfig(name_or_path=str(tiny_model)), {}, separate_documents=apart)
    LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ).save_pretrained(tmp_path)
    return load_model(ModelConfig(name_or_path=f"random-init:{tmp_path}"), {}, separate_documents=apart)


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


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None, dropout=0.0):
    """What FlashAttention's causal varlen kernel computes, one document at a time with SDPA (CPU stand-in); with
    `window`, a token sees itself and the `window` tokens before it."""
    assert dropout == 0.0, "the stand-in has no dropout"
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FlashAttention takes one head size for q, k and v"
    out = torch.empty_like(q)
    for lo, hi in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        seg = [t[lo:hi].transpose(0, 1) for t in (q, k, v)]
        i = torch.arange(hi - lo)
        seen = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= (window if window is not None else hi))
        out[lo:hi] = F.scaled_dot_product_attention(*seg, attn_mask=seen, scale=scale, enable_gqa=True).transpose(0, 1)
    return out


def packed_ids(vocab: int, rows: int = 3, seq: int = 40) -> dict:
    torch.manual_seed(1)
    ids = torch.randint(3, vocab, (rows, seq))
    ids[0, [5, 17, 30]] = EOS
    ids[2, [0, 39]] = EOS
    return data.packed_batch(ids, ids.clone(), EOS)


def varlen_twin(monkeypatch, reference, config, kernel=reference_varlen):
    """The model `config` describes as load_model builds it on a GPU (app.attention, its CUDA kernel replaced by
    `kernel`), with `reference`'s weights."""
    from app import attention

    monkeypatch.setattr(attention, "_kernel", lambda: kernel)
    monkeypatch.setattr(attention, "available", lambda: True)
    varlen = load_model(ModelConfig(name_or_path=f"random-init:{config}"), {}, separate_documents=True).eval()
    assert varlen.config._attn_implementation == attention.VARLEN
    varlen.load_state_dict(reference.state_dict())
    return varlen


def test_varlen_path_computes_what_the_block_mask_computes(monkeypatch, tmp_path):
    # The GPU path's own code (layouts, GQA's fewer K/V heads, the batch's boundaries), with the CUDA kernel replaced
    # by a per-document reference: the model's logits equal those of SDPA with transformers' block mask.
    sdpa = build("llama", None, 50, tmp_path, apart=False).eval()
    assert sdpa.config._attn_implementation == "sdpa"
    varlen = varlen_twin(monkeypatch, sdpa, tmp_path)
    batch = packed_ids(50)
    torch.testing.assert_close(per_token_losses(varlen, batch), per_token_losses(sdpa, batch), equal_nan=True)
    # Without the boundaries (a model called outside the loop) it is plain causal attention.
    plain = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
    torch.testing.assert_close(per_token_losses(varlen, plain), per_token_losses(sdpa, plain))


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY_IDS = {"num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def tiny_config(model_type: str, folder, attn: str = "sdpa", apart: bool = False, **settings):
    """A random-init model of `model_type` written to `folder`, built by load_model with `attn` (`apart`: with the
    app's attention for packed documents, else as transformers builds it)."""
    from transformers import AutoConfig

    sizes = {**TINY, **TINY_IDS, **settings}
    config = AutoConfig.for_model(model_type, vocab_size=50, **{k: v for k, v in sizes.items() if v is not None})
    config.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = ModelConfig(name_or_path=f"random-init:{folder}", attn_implementation=attn)
    return load_model(cfg, {}, separate_documents=apart)


def test_varlen_path_takes_values_narrower_than_keys(monkeypatch, tmp_path):
    # DeepSeek-V2/V3's multi-head latent attention: keys of 24 (16 + 8 rotary), values of 16. The kernels take one
    # head size, so the values are padded with zeros and the output cut back.
    mla = {"qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32, "q_lora_rank": None}
    moe = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1}
    sdpa = tiny_config("deepseek_v3", tmp_path, head_dim=8, num_key_value_heads=4, **mla, **moe).eval()
    varlen = varlen_twin(monkeypatch, sdpa, tmp_path)
    batch = packed_ids(50)
    torch.testing.assert_close(per_token_losses(varlen, batch), per_token_losses(sdpa, batch), equal_nan=True)


def test_varlen_path_keeps_the_sliding_window(monkeypatch, tmp_path):
    # Mistral attends within a sliding window of 6 tokens, shorter than the documents: transformers' SDPA applies
    # it through its mask, the varlen kernel through its left window. Without it the losses differ (not vacuous).
    sdpa = tiny_config("mistral", tmp_path, sliding_window=6).eval()
    varlen = varlen_twin(monkeypatch, sdpa, tmp_path)
    batch = packed_ids(50)
    expected = per_token_losses(sdpa, batch)
    torch.testing.assert_close(per_token_losses(varlen, batch), expected, equal_nan=True)
    plain = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
    torch.testing.assert_close(per_token_losses(varlen, plain), per_token_losses(sdpa, plain))
    monkeypatch.setattr("app.attention._kernel", lambda: lambda *args: reference_varlen(*args[:8]))  # no window
    assert not torch.allclose(per_token_losses(varlen, batch).nan_to_num(), expected.nan_to_num(), atol=1e-3)


def test_varlen_path_runs_eager_attention_for_what_the_kernel_lacks(monkeypatch, tmp_path, caplog):
    # Gemma 2 soft-caps its attention logits (and slides a window on every other layer): FlashAttention-2's varlen
    # kernel has no soft-capping, so such layers run the model's eager attention over the batch's documents,
    # which equals transformers' own eager attention with its packed-sequence mask. The kernel is never called.
    eager = tiny_config("gemma2", tmp_path, "eager", sliding_window=6, attn_logit_softcapping=0.002).eval()
    assert eager.config._attn_implementation == "eager"

    def no_kernel(*args, **kwargs):
        raise AssertionError("the varlen kernel ran a soft-capped layer")

    varlen = varlen_twin(monkeypatch, eager, tmp_path, kernel=no_kernel)
    batch = packed_ids(50)
    with caplog.at_level("WARNING", logger="finetune"):
        got = per_token_losses(varlen, batch)
    torch.testing.assert_close(got, per_token_losses(eager, batch), equal_nan=True)
    assert "asks for softcap" in caplog.text
    # Not vacuous: without the cap the same weights give other losses.
    varlen.config.attn_logit_softcapping = None
    for layer in varlen.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    monkeypatch.setattr("app.attention._kernel", lambda: reference_varlen)
    assert not torch.allclose(per_token_losses(varlen, batch).nan_to_num(), got.nan_to_num(), atol=1e-3)


def test_varlen_path_hands_attention_dropout_to_the_kernel(monkeypatch, tiny_model):
    # GPT-2 drops 10% of its attention weights in training: the kernel (PyTorch's FlashAttention-2) gets that rate
    # rather than silently training without it; in eval mode it gets none.
    from app import attention

    rates = []

    def recording(*args):
        rates.append(args[9])  # (q, k, v, cu_q, cu_k, max_q, max_k, scale, window, dropout)
        return reference_varlen(*args[:9])

    monkeypatch.setattr(attention, "_aten_varlen", recording)
    monkeypatch.setattr(attention, "_kernel", lambda: recording)
    monkeypatch.setattr(attention, "available", lambda: True)
    model = load_model(ModelConfig(name_or_path=str(tiny_model)), {}, separate_documents=True)
    batch = packed_ids(model.config.vocab_size)
    model.train()
    model(**{k: v for k, v in batch.items() if k != "labels"})
    model.eval()
    model(**{k: v for k, v in batch.items() if k != "labels"})
    layers = model.config.n_layer
    assert rates == [model.config.attn_pdrop] * layers + [0.0] * layers and model.config.attn_pdrop > 0


def test_layers_share_one_document_mask_per_batch_and_drop_it_with_the_batch(monkeypatch, tmp_path):
    import gc

    from app import attention

    built = []
    real = attention.document_mask
    monkeypatch.setattr(attention, "document_mask", lambda cu, *rest: built.append(rest) or real(cu, *rest))
    model = tiny_config("llama", tmp_path, apart=True).eval()
    assert model.config.num_hidden_layers > 1
    batch = packed_ids(50)
    first = per_token_losses(model, batch)
    assert len(built) == 1
    torch.testing.assert_close(per_token_losses(model, batch), first, equal_nan=True)
    assert len(built) == 1
    other = packed_ids(50, seq=48)
    per_token_losses(model, other)
    assert len(built) == 2
    del batch, other
    gc.collect()
    assert attention._masks is None


def test_document_mask_sees_own_earlier_tokens_within_the_window():
    from app.attention import document_mask

    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)  # rows of 4: documents [0, 3), [3, 4); [4, 8)
    seen = document_mask(cu, 2, 4, None, torch.float32) == 0
    assert seen[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    assert seen[1, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    windowed = document_mask(cu, 2, 4, 1, torch.float32) == 0
    assert windowed[1, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    both_ways = document_mask(cu, 2, 4, 1, torch.float32, causal=False) == 0  # a non-causal layer's
    assert both_ways[0, 0].int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 1]]
