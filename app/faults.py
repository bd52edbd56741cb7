"""Test-only fault hooks, off unless their environment variable is set (reliability drills and tests).

FINETUNE_FAULT_KILL_AT_STEP=N
    After global step N (its logging and checkpoint done), the last rank SIGKILLs its own process, once per
    experiment (a marker file in the experiment folder remembers it), as a crashed or OOM-killed worker would.
FINETUNE_FAULT_SAVE_PAUSE=PHASE:SECONDS[:STEP]
    Pause one rank for SECONDS at PHASE of a checkpoint save (every save, or only that of global STEP), after
    writing `<experiment>/.fault-paused-PHASE-STEP`, so that a test can kill the run, fill the volume or make it
    read-only at a known moment; the pause ends early once `<experiment>/.fault-continue-PHASE-STEP` exists:
      before_shards  rank 0, the folder exists and no shard has been written
      mid_shards     the last rank, after rank 0 wrote all its shards and before this rank's optimizer shard (with
                     checkpoint.async_save, in the background write: the loop goes on meanwhile)
      before_state   rank 0, every shard written, trainer_state.json (the completion mark) not yet
      before_report  rank 0, the checkpoint is complete on disk but not yet reported to (registered by) Ray

FINETUNE_FAULT_SLOW_PREPARE=SECONDS
    Every unit of data preparation (app.data.pipeline) takes SECONDS longer, as a large dataset would.
FINETUNE_FAULT_RAISE=PHASE:RANK[:STEP]
    Raise RuntimeError on that rank only: at PHASE "data" (before it opens the prepared data) or "step" (after global
    step STEP), while the other ranks go on into their next collective, as a bug or a bad row on one rank would.
FINETUNE_FAULT_NAN_FROM_STEP=N
    From global step N on, every rank's loss is multiplied by NaN before backward, so gradients and then the
    weights become NaN, as a diverging run's would.
FINETUNE_FAULT_SIGTERM_AT_STEP=N[:RANK[:COUNT]]
    Right after optimizer step N, rank RANK (default: the last) sends its own process COUNT real SIGTERMs
    (default 1; 2 is a second SIGTERM, which stops the rank at once), once per experiment, as a node drain would.

These variables travel to the workers (driver.PASSTHROUGH_PREFIXES), on a cluster too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("finetune")
KILL_AT_STEP = "FINETUNE_FAULT_KILL_AT_STEP"
RAISE = "FINETUNE_FAULT_RAISE"
NAN_FROM_STEP = "FINETUNE_FAULT_NAN_FROM_STEP"
SAVE_PAUSE = "FINETUNE_FAULT_SAVE_PAUSE"
SIGTERM_AT_STEP = "FINETUNE_FAULT_SIGTERM_AT_STEP"
SLOW_PREPARE = "FINETUNE_FAULT_SLOW_PREPARE"
PHASES = ("before_shards", "mid_shards", "before_state", "before_report")


def step_hook(rank: int, world: int, run_dir: Path) -> Callable[[int], None]:
    """What the training loop calls after each step (its logging and checkpoint done): the kill and raise drills
    when FINETUNE_FAULT_KILL_AT_STEP or FINETUNE_FAULT_RAISE is set, nothing otherwise."""
    if not os.environ.get(KILL_AT_STEP) and not os.environ.get(RAISE):
        return lambda step: None

    def after_step(step: int) -> None:
        maybe_kill(step, rank, world, run_dir)
        maybe_raise("step", rank, step)

    return after_step


def maybe_kill(step: int, rank: int, world: int, run_dir: Path) -> None:
    at = os.environ.get(KILL_AT_STEP)
    if not at or int(at) != step or rank != world - 1:
        return
    try:
        os.close(os.open(Path(run_dir) / f".fault-killed-step-{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # killed once already: the restarted attempt runs through
    log.warning(f"FAULT INJECTION: rank {rank} (pid {os.getpid()}) kills itself with SIGKILL after step {step}")
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_sigterm(step: int, rank: int, world: int, run_dir: Path) -> None:
    spec = os.environ.get(SIGTERM_AT_STEP)
    if not spec:
        return
    parts = [int(p) for p in spec.split(":")]
    at, who, count = parts[0], parts[1] if len(parts) > 1 else world - 1, parts[2] if len(parts) > 2 else 1
    if step != at or rank != who:
        return
    try:
        os.close(os.open(Path(run_dir) / f".fault-sigterm-step-{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    from app import preemption

    log.warning(f"FAULT INJECTION: rank {rank} (pid {os.getpid()}) sends itself {count} SIGTERM after step {step}")
    for _ in range(count):
        os.kill(os.getpid(), signal.SIGTERM)
        # The handler runs in the main thread; wait for it, so the drill lands on this step.
        deadline = time.monotonic() + 10
        while not preemption.requested_in_this_process() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)


def maybe_slow_prepare() -> None:
    if seconds := float(os.environ.get(SLOW_PREPARE) or 0):
        time.sleep(seconds)


def maybe_raise(phase: str, rank: int, step: int | None = None) -> None:
    spec = os.environ.get(RAISE)
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] != phase or int(parts[1]) != rank or (phase == "step" and int(parts[2]) != step):
        return
    where = f"{phase} {step}" if phase == "step" else phase
    raise RuntimeError(f"FAULT INJECTION: rank {rank} fails at {where} (at {time.time():.3f})")


def maybe_poison(loss, step: int):
    """`loss` (of the step about to be taken, `step`), times NaN once FINETUNE_FAULT_NAN_FROM_STEP is reached."""
    at = os.environ.get(NAN_FROM_STEP)
    return loss * float("nan") if at and step >= int(at) else loss


def _pause_spec() -> tuple[str, float, int | None] | None:
    spec = os.environ.get(SAVE_PAUSE)
    if not spec:
        return None
    parts = spec.split(":")
    if parts[0] not in PHASES:
        raise ValueError(f"{SAVE_PAUSE}={spec}: the phase must be one of {', '.join(PHASES)}")
    return parts[0], float(parts[1]), int(parts[2]) if len(parts) > 2 and parts[2] else None


def pause_rank(phase: str, world: int) -> int:
    return world - 1 if phase == "mid_shards" else 0


def maybe_pause(phase: str, step: int, rank: int, world: int, run_dir: Path) -> None:
    spec = _pause_spec()
    if not spec or spec[0] != phase or rank != pause_rank(phase, world) or spec[2] not in (None, step):
        return
    (Path(run_dir) / f".fault-paused-{phase}-{step}").write_text(f"{os.getpid()}\n")
    log.warning(f"FAULT INJECTION: rank {rank} pauses {spec[1]:.0f}s at {phase} of the step-{step} save")
    go_on, deadline = Path(run_dir) / f".fault-continue-{phase}-{step}", time.monotonic() + spec[1]
    while time.monotonic() < deadline and not go_on.exists():
        time.sleep(0.2)


@contextlib.contextmanager
def pausing_engine(engine, step: int, rank: int, world: int, run_dir: Path, in_loop: bool = True):
    """For mid_shards: pause inside DeepSpeed's save, after this rank's model shard, before its optimizer shard
    (`in_loop`; a background save pauses in its writer thread instead)."""
    spec = _pause_spec()
    if not in_loop or not spec or spec[0] != "mid_shards" or rank != pause_rank("mid_shards", world):
        yield
        return
    original = engine._save_zero_checkpoint

    def paused(save_dir, tag):
        maybe_pause("mid_shards", step, rank, world, run_dir)
        return original(save_dir, tag)

    engine._save_zero_checkpoint = paused
    try:
        yield
    finally:
        del engine._save_zero_checkpoint
