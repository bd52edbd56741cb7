"""A run whose loss or gradients stay non-finite stops with exit 1, naming the step and the likely cause.

bf16 and fp32 have no loss scaler: a NaN or inf gradient is applied as is and every later step is NaN too, while
the run would go on and report success. Every rank computes the same verdict (one all-reduce of two flags per
optimizer step), so all stop together; no checkpoint is written while the streak lasts, so the last one on
storage is the last good one.

A step's flags are read one step late, once the next step's work is queued, so that the check never leaves the
GPU idle waiting for the host (a read right after the step would drain the queue every step); before a save,
and at the run's end, they are read at once (`healthy`).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

log = logging.getLogger("finetune")


class NonFiniteError(RuntimeError):
    """Raised on every rank; the driver shows its message as the run's error."""


class NonFiniteGuard:
    def __init__(self, limit: int, precision: str, learning_rate: float, before_raise=lambda: None):
        self.limit, self.precision, self.learning_rate = limit, precision, learning_rate
        self.before_raise = before_raise  # e.g. let a save of the last healthy step being written complete
        self.streak = 0
        self.first_bad: int | None = None
        self.judged, self.finite = 0, 0  # steps of this attempt judged, and those with a finite loss
        self.pending: tuple[int, torch.Tensor] | None = None  # (step, its flags), not yet read on the host

    @property
    def healthy(self) -> bool:
        """False while non-finite steps go on: the weights may already be poisoned, so nothing is saved. Reads the
        last step's flags (a host sync), and raises as `check` does."""
        self._judge()
        return self.streak == 0

    def check(self, step: int, loss: torch.Tensor, grad_norm: float | torch.Tensor | None) -> None:
        """After optimizer step `step`, with that step's loss (summed over its micro-batches) on this rank: queues
        its flags without waiting for them, and judges the step before it."""
        self._judge()
        loss_bad = (~torch.isfinite(loss).all()).float()
        # fp16's loss scaler skips a step whose gradients overflowed, and lowers the scale: that is its job.
        if grad_norm is None or self.precision == "fp16":
            grad_bad = torch.zeros_like(loss_bad)
        elif torch.is_tensor(grad_norm):
            grad_bad = (~torch.isfinite(grad_norm)).float().reshape(()).to(loss_bad.device)
        else:  # a number DeepSpeed already read on the host; a fill, not a host-to-device copy
            grad_bad = torch.full_like(loss_bad, 0.0 if math.isfinite(grad_norm) else 1.0)
        flags = torch.stack([loss_bad, grad_bad])
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.pending = (step, flags)

    def _judge(self) -> None:
        if self.pending is None:
            return
        (step, flags), self.pending = self.pending, None
        loss_bad, grad_bad = (bool(v) for v in flags.tolist())
        self.judged, self.finite = self.judged + 1, self.finite + (not loss_bad)
        if not (loss_bad or grad_bad):
            self.streak, self.first_bad = 0, None
            return
        self.streak += 1
        self.first_bad = self.first_bad or step
        what = " and ".join(w for w, bad in (("loss", loss_bad), ("gradient norm", grad_bad)) if bad)
        if self.streak < self.limit:
            log.warning(
                f"step {step}: non-finite {what} ({self.streak} of at most {self.limit} in a row); "
                "no checkpoint is saved until a step is finite again"
            )
            return
        self.before_raise()
        raise NonFiniteError(
            f"step {step}: non-finite {what} for {self.streak} consecutive steps (since step {self.first_bad}); "
            f"likely cause: {self._cause(loss_bad, grad_bad)}. The last checkpoint saved before step "
            f"{self.first_bad} is the last good one; fix the cause and deploy again to resume from it "
            "(train.nonfinite_steps_limit sets how many such steps are tolerated)"
        )

    def finish(self) -> bool:
        """At the run's end: `healthy`, and a run none of whose steps had a finite loss (fewer than
        train.nonfinite_steps_limit steps, every one non-finite: a template that marks no target, say) raises
        rather than end as a success."""
        healthy = self.healthy
        if self.judged and not self.finite:
            raise NonFiniteError(
                f"none of the {self.judged} steps of this run had a finite loss: nothing was learned; likely cause: "
                f"{self._cause(True, False)}"
            )
        return healthy

    def _cause(self, loss_bad: bool, grad_bad: bool) -> str:
        if self.precision == "fp16":
            return "fp16 overflow in the forward pass (use precision bf16, or lower train.learning_rate)"
        if grad_bad and not loss_bad:
            return (
                f"diverging updates: train.learning_rate {self.learning_rate:g} is too high (lower it, add "
                "train.warmup_steps, or keep train.max_grad_norm on)"
            )
        return (
            f"the model diverged (train.learning_rate {self.learning_rate:g} too high? lower it or add "
            "train.warmup_steps), or a batch has no token to predict"
        )
