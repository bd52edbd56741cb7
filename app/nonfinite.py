"""A run whose loss or gradients stay non-finite stops with exit 1, naming the step and the likely cause.

bf16 and fp32 have no loss scaler: a NaN or inf gradient is applied as is and every later step is NaN too, while
the run would go on and report success. Every rank computes the same verdict (one all-reduce of two flags per
optimizer step), so all stop together; no checkpoint is written while the streak lasts, so the last one on
storage is the last good one.
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
    def __init__(self, limit: int, precision: str, learning_rate: float):
        self.limit, self.precision, self.learning_rate = limit, precision, learning_rate
        self.streak = 0
        self.first_bad: int | None = None

    @property
    def healthy(self) -> bool:
        """False while non-finite steps go on: the weights may already be poisoned, so nothing is saved."""
        return self.streak == 0

    def check(self, step: int, loss: torch.Tensor, grad_norm: float | torch.Tensor | None) -> None:
        """After optimizer step `step`, with that step's loss (summed over its micro-batches) on this rank."""
        grad_bad = grad_norm is not None and not math.isfinite(float(grad_norm))
        # fp16's loss scaler skips a step whose gradients overflowed, and lowers the scale: that is its job.
        flags = torch.tensor(
            [0.0 if torch.isfinite(loss).all() else 1.0, 1.0 if grad_bad and self.precision != "fp16" else 0.0],
            device=loss.device,
        )
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        loss_bad, grad_bad = bool(flags[0].item()), bool(flags[1].item())
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
        raise NonFiniteError(
            f"step {step}: non-finite {what} for {self.streak} consecutive steps (since step {self.first_bad}); "
            f"likely cause: {self._cause(loss_bad, grad_bad)}. The last checkpoint saved before step "
            f"{self.first_bad} is the last good one; fix the cause and deploy again to resume from it "
            "(train.nonfinite_steps_limit sets how many such steps are tolerated)"
        )

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
