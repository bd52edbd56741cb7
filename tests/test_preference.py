"""app.preference against TRL 1.16 itself (issue #51, Done-when 1): for fixed pairs through a tiny fp32 Llama and
a second one as the reference, each loss, its metrics and the per-sequence log-probabilities equal what TRL's own
code computes (DPOTrainer._compute_loss with its fused LM head, CPOTrainer and ORPOTrainer.get_batch_loss_metrics)
within 1e-5, and the same sequences packed into rows give the same values as padded. TRL's trainers are not
built: each method runs on a bare instance given the attributes it reads."""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaConfig, LlamaForCausalLM
from trl import DPOConfig, DPOTrainer
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer
from trl.trainer.utils import add_fused_lm_head

from app.preference import (
    IGNORE,
    PreferenceConfig,
    SequenceLogps,
    preference_loss,
    sequence_ids,
    sequence_ids_from_bounds,
    sequence_logps,
    token_logps,
)

TOL = dict(rtol=0, atol=1e-5)
VOCAB, PAD = 48, 0
METRICS = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
]
# (prompt, chosen, rejected) lengths: the answers of a pair differ in length, the prompts between pairs.
SHAPES = [(3, 4, 6), (5, 2, 3), (2, 7, 4), (4, 3, 3)]
ACCELERATOR = SimpleNamespace(
    device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x, autocast=nullcontext
)


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, initializer_range=0.5,
    )  # fmt: skip
    # initializer_range 0.5: log-probabilities far from uniform, so that wrong token alignment shows.
    return LlamaForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def pairs() -> list[tuple[list[int], list[int], list[int]]]:
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(1, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    return [(draw(p), draw(c), draw(r)) for p, c, r in SHAPES]


@pytest.fixture(scope="module")
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    return tiny_llama(1), tiny_llama(2)


def padded(pairs) -> dict[str, torch.Tensor]:
    """TRL's DPO batch: prompt + answer, right-padded, all chosen rows then all rejected rows."""
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    width = max(len(p) + len(a) for p, a in rows)
    ids, attention, completion = [torch.full((len(rows), width), v) for v in (PAD, 0, 0)]
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        attention[i, : len(p) + len(a)] = 1
        completion[i, len(p) : len(p) + len(a)] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def side(batch, rows: slice, prefix: str) -> dict[str, torch.Tensor]:
    """CPO/ORPO's per-side batch keys (labels -100 on the prompt and the padding)."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE)
    return {
        f"{prefix}_input_ids": batch["input_ids"][rows],
        f"{prefix}_attention_mask": batch["attention_mask"][rows],
        f"{prefix}_labels": labels[rows],
    }


def app_logps(model, batch) -> SequenceLogps:
    """The app's answer log-probabilities of a padded batch, from the model's ordinary logits."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    per_token = token_logps(logits, labels, chunk_tokens=5)  # several chunks
    return sequence_logps(per_token, labels != IGNORE)


def trl_dpo(policy, reference, batch, loss: str, beta: float) -> tuple[torch.Tensor, dict, tuple, tuple]:
    """TRL DPOTrainer's loss and logged metrics, and its per-sequence log-probabilities (compute_ref_log_probs) for
    the policy and the reference, each model given TRL's fused LM head as DPOTrainer.__init__ does."""
    policy, reference = copy.deepcopy(policy), copy.deepcopy(reference)
    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(reference)
    trainer, args = object.__new__(DPOTrainer), SimpleNamespace(gradient_checkpointing_kwargs=None)
    vars(trainer).update(
        model=policy, ref_model=reference, accelerator=ACCELERATOR, args=args,
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=False, f_divergence_type="reverse_kl",
        loss_types=[loss], loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    with torch.no_grad():
        value = trainer._compute_loss(policy, batch, return_outputs=False)
        logps = trainer.compute_ref_log_probs(policy, batch), trainer.compute_ref_log_probs(reference, batch)
    return value, {k: v[0] for k, v in trainer._metrics["eval"].items()}, *logps


def cpo_trainer(**attrs) -> CPOTrainer:
    trainer = object.__new__(CPOTrainer)
    vars(trainer).update(
        is_encoder_decoder=False, pad_token_id=PAD, accelerator=ACCELERATOR, aux_loss_enabled=False, alpha=0.0, **attrs
    )
    return trainer


def close(app: dict, ref: dict, keys) -> None:
    for key in keys:
        assert float(app[key]) == pytest.approx(float(ref[key]), abs=1e-5), key


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_and_ipo_equal_trl_dpo_trainer(pairs, models, loss):
    batch, n = padded(pairs), len(pairs)
    cfg = PreferenceConfig(loss=loss, beta=0.3)
    chosen, rejected = app_logps(models[0], batch).halves()
    ref_chosen, ref_rejected = app_logps(models[1], batch).halves()
    value, metrics = preference_loss(cfg, chosen, rejected, (ref_chosen.summed, ref_rejected.summed))

    trl_value, trl_metrics, trl_policy, trl_reference = trl_dpo(*models, batch, loss, cfg.beta)
    torch.testing.assert_close(value, trl_value, **TOL)
    close(metrics, trl_metrics, METRICS)
    torch.testing.assert_close(torch.cat([chosen.summed, rejected.summed]), torch.cat(trl_policy), **TOL)
    torch.testing.assert_close(torch.cat([ref_chosen.summed, ref_rejected.summed]), torch.cat(trl_reference), **TOL)
    assert chosen.tokens.tolist() == [c for _, c, _ in SHAPES] and rejected.summed.shape == (n,)
    assert 0 < float(metrics["rewards/accuracies"]) < 1  # the pairs disagree: accuracy and margins are not trivial


def test_label_smoothing_is_conservative_dpo_as_trl_cpo_computes_it(pairs, models):
    """TRL 1.16's DPOTrainer reads label_smoothing only for its robust/EXO/AOT losses; the conservative-DPO form
    of sigmoid is CPOTrainer.cpo_loss's, fed here with the DPO log-ratios."""
    batch = padded(pairs)
    cfg = PreferenceConfig(beta=0.3, label_smoothing=0.2)
    chosen, rejected = app_logps(models[0], batch).halves()
    ref = app_logps(models[1], batch).halves()
    value, metrics = preference_loss(cfg, chosen, rejected, (ref[0].summed, ref[1].summed))
    trainer = cpo_trainer(loss_type="sigmoid", beta=0.3, label_smoothing=0.2)
    losses, chosen_rewards, rejected_rewards = trainer.cpo_loss(
        chosen.summed - ref[0].summed, rejected.summed - ref[1].summed
    )
    torch.testing.assert_close(value, losses.mean(), **TOL)
    close(metrics, {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean()}, METRICS[:2])


@pytest.mark.parametrize("cpo_alpha, label_smoothing", [(0.0, 0.0), (1.0, 0.1)])
def test_simpo_equals_trl_cpo_trainer(pairs, models, cpo_alpha, label_smoothing):
    batch, n = padded(pairs), len(pairs)
    cfg = PreferenceConfig(
        loss="simpo", beta=2.0, simpo_gamma=0.7, cpo_alpha=cpo_alpha, label_smoothing=label_smoothing
    )
    chosen, rejected = app_logps(models[0], batch).halves()
    value, metrics = preference_loss(cfg, chosen, rejected)

    trainer = cpo_trainer(
        loss_type="simpo", beta=2.0, simpo_gamma=0.7, cpo_alpha=cpo_alpha, label_smoothing=label_smoothing
    )
    trl_batch = side(batch, slice(0, n), "chosen") | side(batch, slice(n, None), "rejected")
    with torch.no_grad():
        trl_value, trl_metrics = trainer.get_batch_loss_metrics(models[0], trl_batch)
    torch.testing.assert_close(value, trl_value, **TOL)
    close(metrics, trl_metrics, METRICS + (["nll_loss"] if cpo_alpha else []))
    assert ("nll_loss" in metrics) == bool(cpo_alpha)
    # SimPO's log-probabilities are the answers' averages, as CPOTrainer.get_batch_logps gives them.
    with torch.no_grad():
        logits = models[0](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = side(batch, slice(None), "all")["all_labels"]
    averaged = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    torch.testing.assert_close(torch.cat([chosen.averaged, rejected.averaged]), averaged, **TOL)


def test_orpo_equals_trl_orpo_trainer(pairs, models):
    """ORPO's NLL covers the chosen sequences' prompts too (TRL's concatenated_forward), so the prompt tokens are
    scored (`targets`) while the odds ratio reads the answers only."""
    batch, n = padded(pairs), len(pairs)
    cfg = PreferenceConfig(loss="orpo", orpo_alpha=0.25)
    targets = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
    with torch.no_grad():
        logits = models[0](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    per_token = token_logps(logits, targets, chunk_tokens=5)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE)
    chosen, rejected = sequence_logps(per_token, labels != IGNORE).halves()
    nll = sequence_logps(per_token, targets != IGNORE)[:n].nll()
    value, metrics = preference_loss(cfg, chosen, rejected, nll=nll)

    trainer = object.__new__(ORPOTrainer)
    vars(trainer).update(
        is_encoder_decoder=False, padding_value=PAD, accelerator=ACCELERATOR, aux_loss_enabled=False, beta=0.25
    )
    trl_batch = side(batch, slice(0, n), "chosen") | side(batch, slice(n, None), "rejected")
    with torch.no_grad():
        trl_value, trl_metrics = trainer.get_batch_loss_metrics(models[0], trl_batch)
    torch.testing.assert_close(value, trl_value, **TOL)
    close(metrics, trl_metrics, METRICS + ["nll_loss", "log_odds_ratio", "log_odds_chosen"])


def packed(pairs) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """The same sequences packed: c0 r0 c1 r1 ..., the first half of them in row 0 and the rest in row 1, each
    row ending in a padding run whose positions restart at 0 (as app.data.store lays out a block). Also the
    documents of each row, numbered as padded() orders the rows (chosen i: i, rejected i: n + i)."""
    n = len(pairs)
    docs = [(i + side * n, p + a, len(p)) for i, (p, c, r) in enumerate(pairs) for side, a in ((0, c), (1, r))]
    rows = [docs[:n], docs[n:]]
    width = max(sum(len(ids) for _, ids, _ in row) for row in rows) + 2
    out = {k: torch.full((2, width), v) for k, v in [("input_ids", PAD), ("labels", IGNORE), ("position_ids", 0)]}
    for r, row in enumerate(rows):
        at = 0
        for _, ids, prompt in row:
            out["input_ids"][r, at : at + len(ids)] = torch.tensor(ids)
            out["labels"][r, at + prompt : at + len(ids)] = torch.tensor(ids[prompt:])
            out["position_ids"][r, at : at + len(ids)] = torch.arange(len(ids))
            at += len(ids)
        out["position_ids"][r, at:] = torch.arange(width - at)
    return out, [[d for d, _, _ in row] for row in rows]


def test_packed_and_padded_give_the_same_values(pairs, models):
    """Packed documents, given the logits each has on its own (what a forward that keeps documents apart
    computes), give the padded batch's log-probabilities and losses; the padding runs are empty sequences."""
    batch, n = padded(pairs), len(pairs)
    with torch.no_grad():
        logits = models[0](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lengths = batch["attention_mask"].sum(1).tolist()
    pack, rows = packed(pairs)
    packed_logits = torch.zeros(*pack["input_ids"].shape, VOCAB)
    for r, docs in enumerate(rows):
        placed = torch.cat([logits[d, : lengths[d]] for d in docs])
        packed_logits[r, : len(placed)] = placed
    sequences = sequence_ids(pack["position_ids"])
    bounds = torch.cat([(pack["position_ids"].flatten() == 0).nonzero().flatten(), torch.tensor([sequences.numel()])])
    assert torch.equal(sequence_ids_from_bounds(bounds, sequences.shape), sequences)
    seqs = sequence_logps(token_logps(packed_logits, pack["labels"]), pack["labels"] != IGNORE, sequences)

    # Sequence ids run row by row: a row's documents, then its padding run (an empty sequence).
    index = {}
    for r, docs in enumerate(rows):
        index |= {d: r * (len(rows[0]) + 1) + k for k, d in enumerate(docs)}
    assert seqs.summed.shape == (2 * n + 2,) and seqs.tokens[[len(rows[0]), -1]].tolist() == [0, 0]
    chosen, rejected = (seqs[torch.tensor([index[d] for d in range(lo, lo + n)])] for lo in (0, n))
    want_chosen, want_rejected = app_logps(models[0], batch).halves()
    for mine, want in ((chosen, want_chosen), (rejected, want_rejected)):
        torch.testing.assert_close(mine.summed, want.summed, **TOL)
        assert torch.equal(mine.tokens, want.tokens)
    reference = (want_chosen.summed - 0.5, want_rejected.summed + 0.25)
    for cfg in (PreferenceConfig(), PreferenceConfig(loss="ipo"), PreferenceConfig(loss="simpo", cpo_alpha=1.0)):
        args = (reference,) if cfg.needs_reference else ()
        value, metrics = preference_loss(cfg, chosen, rejected, *args)
        want_value, want_metrics = preference_loss(cfg, want_chosen, want_rejected, *args)
        torch.testing.assert_close(value, want_value, **TOL)
        close(metrics, want_metrics, want_metrics)


def test_a_document_start_never_counts_even_when_labelled(pairs):
    """A packed document's first token would be read from the previous document's last logits: it is left out
    by sequence_logps even if the labels forget to mask it."""
    pack, _ = packed(pairs)
    logits = torch.randn(*pack["input_ids"].shape, VOCAB)
    sequences = sequence_ids(pack["position_ids"])
    careless = torch.where(pack["position_ids"] == 0, pack["input_ids"], pack["labels"])
    per_token = token_logps(logits, careless)
    a = sequence_logps(per_token, careless != IGNORE, sequences)
    b = sequence_logps(token_logps(logits, pack["labels"]), pack["labels"] != IGNORE, sequences)
    torch.testing.assert_close(a.summed, b.summed, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_log_probs_and_their_gradient_equal_log_softmax(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 9, 50, generator=g) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (3, 9), generator=g).masked_fill(torch.rand(3, 9, generator=g) < 0.3, IGNORE)
    weights = torch.randn(3, 9, generator=g)
    mine = token_logps(logits, labels, chunk_tokens=4)
    (grad,) = torch.autograd.grad((mine * weights).sum(), logits)

    full = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    expected = torch.nn.functional.pad(full.masked_fill(labels[:, 1:] == IGNORE, 0), (1, 0))
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    assert mine.dtype == torch.float32
    torch.testing.assert_close(mine, expected, **TOL)
    torch.testing.assert_close(grad.float(), expected_grad.float(), **TOL)


def test_the_gradient_passes_gradcheck():
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[IGNORE, 1, 2, IGNORE, 6], [3, IGNORE, 0, 4, 5]])
    assert torch.autograd.gradcheck(lambda x: token_logps(x, labels, chunk_tokens=2), (logits,))


def test_defaults_and_names_are_trls():
    dpo, cpo = {f.name: f for f in dataclasses.fields(DPOConfig)}, {f.name: f for f in dataclasses.fields(CPOConfig)}
    orpo = {f.name: f for f in dataclasses.fields(ORPOConfig)}
    cfg = PreferenceConfig()
    assert cfg.loss == dpo["loss_type"].default_factory()[0] == "sigmoid"
    assert cfg.beta == dpo["beta"].default == cpo["beta"].default
    assert cfg.label_smoothing == dpo["label_smoothing"].default
    assert cfg.simpo_gamma == cpo["simpo_gamma"].default
    assert cfg.orpo_alpha == orpo["beta"].default
    assert cfg.cpo_alpha == 0 != cpo["cpo_alpha"].default  # plain SimPO; TRL's default 1.0 is CPO-SimPO
    assert cfg.reference == "auto" and cfg.needs_reference and not PreferenceConfig(loss="orpo").needs_reference


@pytest.mark.parametrize(
    "values, message",
    [
        ({"loss": "orpo", "beta": 0.5}, "has no effect with loss orpo"),
        ({"loss": "ipo", "label_smoothing": 0.1}, "has no effect with loss ipo"),
        ({"loss": "simpo", "reference": "/models/sft"}, "has no effect with loss simpo"),
        ({"orpo_alpha": 0.2}, "has no effect with loss sigmoid"),
        ({"loss": "kto"}, "loss"),
        ({"beta": 0}, "greater than 0"),
        ({"beta": True}, "valid number"),
        ({"label_smoothing": 0.5}, "less than 0.5"),
        ({"betta": 0.1}, "Extra inputs are not permitted"),
    ],
)
def test_bad_settings_are_refused(values, message):
    with pytest.raises(ValidationError, match=message):
        PreferenceConfig(**values)


def test_each_loss_says_what_it_needs():
    one = SequenceLogps(torch.tensor([-3.0]), torch.tensor([2.0]))
    with pytest.raises(ValueError, match="reference"):
        preference_loss(PreferenceConfig(), one, one)
    with pytest.raises(ValueError, match="NLL"):
        preference_loss(PreferenceConfig(loss="orpo"), one, one)
    loss, metrics = preference_loss(PreferenceConfig(loss="simpo"), one, one)
    assert loss.ndim == 0 and set(metrics) == set(METRICS)


def test_the_loss_gradient_reaches_the_logits_of_a_packed_batch(pairs):
    """Through token_logps' own backward, sequence_logps' scatter and the loss: the same gradient as autograd
    through a full log_softmax."""
    pack, rows = packed(pairs)
    n = len(pairs)
    logits = torch.randn(*pack["input_ids"].shape, VOCAB, dtype=torch.float64, requires_grad=True)
    sequences = sequence_ids(pack["position_ids"])
    index = {d: r * (len(rows[0]) + 1) + k for r, docs in enumerate(rows) for k, d in enumerate(docs)}
    chosen_at, rejected_at = (torch.tensor([index[d] for d in range(lo, lo + n)]) for lo in (0, n))
    reference = (torch.full((n,), -40.0, dtype=torch.float64), torch.full((n,), -41.0, dtype=torch.float64))

    def dpo(per_token: torch.Tensor) -> torch.Tensor:
        seqs = sequence_logps(per_token, pack["labels"] != IGNORE, sequences)
        return preference_loss(PreferenceConfig(), seqs[chosen_at], seqs[rejected_at], reference)[0]

    (grad,) = torch.autograd.grad(dpo(token_logps(logits, pack["labels"], chunk_tokens=3)), logits)
    full = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, pack["labels"][:, 1:].clamp(min=0)[..., None])[..., 0]
    naive = torch.nn.functional.pad(full.masked_fill(pack["labels"][:, 1:] == IGNORE, 0), (1, 0))
    (expected,) = torch.autograd.grad(dpo(naive), logits)
    assert grad.abs().sum() > 0
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-10)


def test_a_setting_of_another_loss_is_one_line_naming_it():
    """In the training config, `preference.<setting>` with its value and the fix, as every config problem reads;
    reading a config loads no torch (Ray Train's controller and `finetune validate` read it)."""
    import subprocess
    import sys

    from app.config import ConfigError, parse

    with pytest.raises(ConfigError) as caught:
        parse({"preference": {"loss": "simpo", "orpo_alpha": 0.2}})
    (problem,) = caught.value.problems
    assert (problem.field, problem.value) == ("preference.orpo_alpha", 0.2), problem
    assert "no effect with loss simpo" in problem.message and "remove it" in problem.fix
    probe = "import sys; import app.config; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"
