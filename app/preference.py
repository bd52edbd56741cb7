"""Preference tuning's arithmetic (issue #51): answer log-probabilities from logits, and the DPO, IPO, SimPO and
ORPO losses with the metrics TRL logs, in plain torch (no Ray, no DeepSpeed), so that the training loop only has
to run the forward passes and hand the logits here.

The losses are TRL 1.16's, term for term (tests/test_preference.py checks them against TRL's own code):
- `sigmoid`: `DPOTrainer` with `loss_type="sigmoid"`; a `label_smoothing` above 0 gives the conservative DPO form
  that TRL's `CPOTrainer` (and its DPOTrainer before 1.0) applies, which TRL 1.16's DPOTrainer no longer does.
- `ipo`: `DPOTrainer` with `loss_type="ipo"`: the log-ratios summed over the answer, divided by its token count.
- `simpo`: `CPOTrainer` with `loss_type="simpo"`: average log-probabilities, margin `simpo_gamma`, plus
  `cpo_alpha` times the chosen answers' NLL (0 here: plain SimPO, as TRL's docs set it; CPOConfig's default is 1).
- `orpo`: `ORPOTrainer`: its `beta` (the paper's lambda) is `orpo_alpha` here; the NLL term is over the chosen
  sequences' prompt and answer, as TRL computes it, so the caller scores the prompt tokens too (`targets`).

Sequences are either rows (a padded batch; TRL's layout is all chosen rows, then all rejected rows) or documents
packed into rows, told apart by `sequence_ids` (from position ids that restart at 0, or from `cu_seq_lens`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.ds_block import rule

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: app.config imports this module for PreferenceConfig, and reading a config
# (finetune validate, Ray Train's controller) loads no torch.

IGNORE = -100
# Tokens scored at once: a chunk of float32 logits is CHUNK_TOKENS x vocab (1024 x 152k: 0.6 GB), where the
# whole batch at once would be the size of the logits in float32 (16k tokens x 152k: 10 GB).
CHUNK_TOKENS = 1024

Loss = Literal["sigmoid", "ipo", "simpo", "orpo"]
# Which loss reads each hyper-parameter: one set to another value under another loss would be ignored silently.
APPLIES_TO: dict[str, set[str]] = {
    "beta": {"sigmoid", "ipo", "simpo"},
    "label_smoothing": {"sigmoid", "simpo"},
    "reference": {"sigmoid", "ipo"},
    "simpo_gamma": {"simpo"},
    "cpo_alpha": {"simpo"},
    "orpo_alpha": {"orpo"},
}


def _number(default: float, description: str, **bounds: float) -> Any:
    """A hyper-parameter's field: a number only (strict: `true` is not 1), within `bounds`."""
    return Field(default, strict=True, description=description, **bounds)


class PreferenceConfig(BaseModel):
    """`preference:` of the training config; null trains SFT. Defaults are TRL 1.16's (DPOConfig, CPOConfig,
    ORPOConfig), except `cpo_alpha` (see below)."""

    # As app.config's sections (not imported from there: app.config will import this module).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    loss: Loss = Field(
        "sigmoid",
        description="sigmoid (DPO), ipo, simpo or orpo; simpo and orpo need no reference model.",
    )
    beta: float = _number(
        0.1, "How far the policy may move from the reference (DPO); IPO's tau; SimPO's reward scale.", gt=0
    )
    label_smoothing: float = _number(
        0.0,
        "Probability that a pair's preference is flipped (conservative DPO), for sigmoid and simpo.",
        ge=0,
        lt=0.5,
    )
    reference: str = Field(
        "auto",
        min_length=1,
        description="The reference model of sigmoid and ipo: auto (with LoRA the base model, adapters off; else "
        "the model before training, its log-probabilities computed once before training) or a model path.",
    )
    simpo_gamma: float = _number(0.5, "SimPO's target reward margin.", ge=0)
    cpo_alpha: float = _number(
        0.0, "SimPO: weight of the chosen answers' NLL (TRL's CPO-SimPO when above 0; TRL's default is 1.0).", ge=0
    )
    orpo_alpha: float = _number(
        0.1, "ORPO's lambda (TRL's ORPOConfig.beta): weight of the odds-ratio term beside the NLL.", gt=0
    )

    @model_validator(mode="after")
    def _no_ignored_setting(self) -> PreferenceConfig:
        for name, losses in APPLIES_TO.items():
            if self.loss not in losses and getattr(self, name) != type(self).model_fields[name].default:
                raise rule(
                    f"has no effect with loss {self.loss} (it applies to {', '.join(sorted(losses))})",
                    f"remove it, or set preference.loss to one of {', '.join(sorted(losses))}",
                    name,
                    getattr(self, name),
                )
        return self

    @property
    def needs_reference(self) -> bool:
        return self.loss in APPLIES_TO["reference"]


# --- log-probabilities -----------------------------------------------------------------------------------


@functools.cache
def _label_log_prob():
    """The autograd function below, defined once torch is loaded."""
    import torch

    class _LabelLogProb(torch.autograd.Function):
        """log p(target) = logit[target] - logsumexp(logits) for the chosen rows of a (rows, vocab) logits matrix,
        chunk by chunk, in float32 at least. Its own backward recomputes each chunk's softmax, so that autograd keeps
        no float32 copy of the logits (logsumexp's would keep every chunk)."""

        @staticmethod
        def forward(ctx: Any, logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, chunk: int):
            dtype = torch.promote_types(logits.dtype, torch.float32)
            out = torch.empty(rows.numel(), dtype=dtype, device=logits.device)
            for start in range(0, rows.numel(), chunk):
                part = logits.index_select(0, rows[start : start + chunk]).to(dtype)
                picked = part.gather(1, targets[start : start + chunk, None]).squeeze(1)
                out[start : start + chunk] = picked - part.logsumexp(dim=1)
            ctx.save_for_backward(logits, rows, targets)
            ctx.chunk = chunk
            return out

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor):
            logits, rows, targets = ctx.saved_tensors
            grad = torch.zeros_like(logits)
            for start in range(0, rows.numel(), ctx.chunk):
                index, g = rows[start : start + ctx.chunk], grad_out[start : start + ctx.chunk, None]
                part = torch.softmax(logits.index_select(0, index).to(grad_out.dtype), dim=1).mul_(-g)
                part.scatter_add_(1, targets[start : start + ctx.chunk, None], g)
                grad.index_copy_(0, index, part.to(grad.dtype))  # rows are distinct: no two chunks write one row
            return grad, None, None, None

    return _LabelLogProb


def token_logps(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """Per-token log-probabilities of `targets` (batch, seq) under causal-LM `logits` (batch, seq, vocab): at
    position t, log p(targets[t] | tokens before t), read from the logits at t - 1; 0 where targets is -100 and at
    position 0. Float32 (float64 logits stay float64). Only the scored positions are computed."""
    import torch

    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    length, vocab = targets.shape[1], logits.shape[-1]
    row, col = (targets[:, 1:] != IGNORE).nonzero(as_tuple=True)
    col = col + 1
    values = _label_log_prob().apply(logits.reshape(-1, vocab), row * length + col - 1, targets[row, col], chunk_tokens)
    return torch.zeros(targets.shape, dtype=values.dtype, device=values.device).index_put((row, col), values)


def sequence_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """The sequence each token belongs to, numbered across the batch row by row, from position ids that restart
    at 0 at each packed document (app.data's packed batches); every row starts a sequence."""
    starts = position_ids == 0
    starts[:, 0] = True
    return starts.flatten().cumsum(0).sub_(1).view(position_ids.shape)


def sequence_ids_from_bounds(cu_seq_lens: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """The same from the flattened batch's document boundaries (`cu_seq_lens_q`: 0, end of the first, ..., total)."""
    import torch

    flat = torch.arange(shape[0] * shape[1], device=cu_seq_lens.device)
    return torch.bucketize(flat, cu_seq_lens[1:].to(flat.dtype), right=True).view(shape)


@dataclass(frozen=True)
class SequenceLogps:
    """Per sequence: the log-probabilities of its scored tokens, summed, and how many there are."""

    summed: torch.Tensor
    tokens: torch.Tensor

    @property
    def averaged(self) -> torch.Tensor:
        return self.summed / self.tokens.clamp(min=1)

    def __getitem__(self, index: Any) -> SequenceLogps:
        return SequenceLogps(self.summed[index], self.tokens[index])

    def halves(self) -> tuple[SequenceLogps, SequenceLogps]:
        """(chosen, rejected) of a batch laid out as TRL's: all chosen sequences, then all rejected ones."""
        half = self.summed.shape[0] // 2
        return self[:half], self[half:]

    def nll(self) -> torch.Tensor:
        """Negative log-likelihood per token over all these sequences' tokens together (torch's cross-entropy
        with mean reduction, as TRL's CPO and ORPO compute their NLL terms)."""
        return -self.summed.sum() / self.tokens.sum().clamp(min=1)


def sequence_logps(
    per_token: torch.Tensor, mask: torch.Tensor, sequences: torch.Tensor | None = None, count: int | None = None
) -> SequenceLogps:
    """Sum `per_token` (from token_logps) over `mask` (batch, seq), per row (sequences None: a padded batch) or
    per sequence of `sequences` (from sequence_ids: a packed batch; `count` sequences, by default all found). A
    token predicted from another sequence (a document's first) never counts, whatever the mask says."""
    import torch

    mask = mask.to(torch.bool, copy=True)
    mask[:, 0] = False
    if sequences is not None:
        mask[:, 1:] &= sequences[:, 1:] == sequences[:, :-1]
    values = torch.where(mask, per_token, 0)
    if sequences is None:
        return SequenceLogps(values.sum(dim=1), mask.sum(dim=1).to(values.dtype))
    count = int(sequences.max()) + 1 if count is None else count
    flat = sequences.flatten()
    summed = values.new_zeros(count).index_add(0, flat, values.flatten())
    tokens = values.new_zeros(count).index_add(0, flat, mask.flatten().to(values.dtype))
    return SequenceLogps(summed, tokens)


# --- losses ----------------------------------------------------------------------------------------------


def preference_loss(
    cfg: PreferenceConfig,
    chosen: SequenceLogps,
    rejected: SequenceLogps,
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
    nll: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss (mean over the pairs) and its metrics under TRL's names (detached, each a batch mean), for pairs
    chosen[i] / rejected[i]. `reference`: the reference model's summed answer log-probabilities (chosen, rejected),
    for sigmoid and ipo. `nll`: ORPO's NLL of the chosen sequences, prompts included (SequenceLogps.nll)."""
    if cfg.needs_reference and reference is None:
        raise ValueError(f"loss {cfg.loss} needs the reference log-probabilities")
    if cfg.loss == "orpo" and nll is None:
        raise ValueError("loss orpo needs the chosen sequences' NLL (prompt and answer)")
    if cfg.loss in ("sigmoid", "ipo"):
        return _dpo(cfg, chosen, rejected, reference)
    if cfg.loss == "simpo":
        return _simpo(cfg, chosen, rejected)
    return _orpo(cfg, chosen, rejected, nll)


def _smoothed_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(logits), with the preference taken as flipped with probability `label_smoothing`."""
    import torch.nn.functional as F

    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def _metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
) -> dict[str, torch.Tensor]:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
    }


def _dpo(cfg, chosen, rejected, reference):
    """TRL DPOTrainer._compute_loss (f_divergence_type reverse_kl, no ld_alpha, no weighting)."""
    chosen_ratio = chosen.summed - reference[0]
    rejected_ratio = rejected.summed - reference[1]
    if cfg.loss == "sigmoid":
        losses = _smoothed_sigmoid(cfg.beta * (chosen_ratio - rejected_ratio), cfg.label_smoothing)
    else:
        # IPO's target 1 / (2 beta) is for per-token log-ratios: TRL divides the sums by the answers' lengths.
        delta = chosen_ratio / chosen.tokens.clamp(min=1) - rejected_ratio / rejected.tokens.clamp(min=1)
        losses = (delta - 1 / (2 * cfg.beta)) ** 2
    # The rewards are the summed log-ratios for IPO too, as TRL logs them.
    metrics = _metrics(cfg.beta * chosen_ratio, cfg.beta * rejected_ratio, chosen.summed, rejected.summed)
    return losses.mean(), metrics


def _simpo(cfg, chosen, rejected):
    """TRL CPOTrainer.cpo_loss with loss_type "simpo" (alpha 0), plus cpo_alpha times the NLL of the chosen answers
    (get_batch_loss_metrics)."""
    logits = chosen.averaged - rejected.averaged - cfg.simpo_gamma / cfg.beta
    loss = _smoothed_sigmoid(cfg.beta * logits, cfg.label_smoothing).mean()
    metrics = _metrics(cfg.beta * chosen.averaged, cfg.beta * rejected.averaged, chosen.averaged, rejected.averaged)
    # TRL logs nll_loss 0 when cpo_alpha is 0 (it does not compute it); here it is left out then.
    if cfg.cpo_alpha:
        nll = chosen.nll()
        loss = loss + cfg.cpo_alpha * nll
        metrics["nll_loss"] = nll.detach()
    return loss, metrics


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, each branch where it does not cancel (TRL's orpo_trainer.log1mexp)."""
    import torch

    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _orpo(cfg, chosen, rejected, nll):
    """TRL ORPOTrainer.odds_ratio_loss and get_batch_loss_metrics: NLL minus lambda times log sigmoid of the log odds
    ratio of the average answer log-probabilities."""
    import torch.nn.functional as F

    chosen_logps, rejected_logps = chosen.averaged.float(), rejected.averaged.float()
    log_odds = (chosen_logps - rejected_logps) - (_log1mexp(chosen_logps) - _log1mexp(rejected_logps))
    ratio = F.logsigmoid(log_odds)
    loss = nll - (cfg.orpo_alpha * ratio).mean()
    metrics = _metrics(cfg.orpo_alpha * chosen_logps, cfg.orpo_alpha * rejected_logps, chosen_logps, rejected_logps)
    metrics |= {
        "nll_loss": nll.detach(),
        "log_odds_ratio": ratio.detach().mean(),
        "log_odds_chosen": log_odds.detach().mean(),
    }
    return loss, metrics
