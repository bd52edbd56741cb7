"""The loop's non-finite guard reads a step's flags one step late (never draining the GPU's queue each step), at
once before a save, and stops the run after `limit` bad steps in a row with the drain hook run first."""

from __future__ import annotations

import logging

import pytest
import torch

from app.nonfinite import NonFiniteError, NonFiniteGuard

NAN = torch.tensor(float("nan"))


def test_a_steps_flags_are_read_at_the_next_check_and_a_save_reads_them_at_once(caplog):
    drained = []
    guard = NonFiniteGuard(2, "bf16", 1e-4, before_raise=lambda: drained.append(True))
    guard.check(1, torch.tensor(2.0), torch.tensor(1.0))
    assert guard.pending[0] == 1 and guard.streak == 0  # queued, not read
    with caplog.at_level(logging.WARNING, logger="finetune"):
        guard.check(2, NAN, 0.5)  # judges step 1 (finite), queues step 2
        assert guard.streak == 0 and not caplog.records
        guard.check(3, torch.tensor(1.0), torch.tensor(float("inf")))  # step 2's NaN loss is seen now
    assert guard.streak == 1 and "step 2: non-finite loss (1 of at most 2 in a row)" in caplog.text
    with pytest.raises(
        NonFiniteError, match=r"step 3: non-finite gradient norm for 2 consecutive steps \(since step 2\)"
    ):
        guard.healthy  # noqa: B018  (a save would ask: it reads step 3's flags now)
    assert drained == [True] and guard.pending is None


def test_a_finite_step_ends_the_streak_and_fp16_overflow_is_the_scalers_job():
    guard = NonFiniteGuard(3, "bf16", 1e-4)
    guard.check(1, NAN, None)
    guard.check(2, torch.tensor(1.0), 1.0)
    assert guard.healthy and guard.first_bad is None  # step 1 was bad, step 2 finite: the streak ended
    fp16 = NonFiniteGuard(1, "fp16", 1e-4)
    fp16.check(1, torch.tensor(1.0), float("inf"))
    assert fp16.healthy
