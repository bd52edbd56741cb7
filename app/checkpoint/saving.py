"""Writing a checkpoint: every rank writes its shards straight into the step folder on the shared volume (no temp
copy of the folder), rank 0 writes the state file last, and only while the experiment's lease is still this run's.
The caller then reports the folder to Ray with NO_UPLOAD: Ray registers it when every rank has reported. A checkpoint
whose state file is written is complete: a resume uses it even when the run died before Ray registered it.

By default (`checkpoint.async_save`) the shards are written in the background (`Saver`, `background`): the loop goes
on once each rank's state is in host memory, and the state file is written only when every rank's files are on
disk (fsynced), so a run that dies meanwhile leaves a folder without it, which a resume skips.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app import faults, lease, lora
from app.checkpoint import background as background_mod
from app.checkpoint import formats
from app.checkpoint.layout import (
    STATE_FILE,
    TAG,
    CheckpointError,
    manifest,
    move_aside,
    nearest_existing,
    problem,
    rng_file,
    scan_usable,
    step_of,
    write_atomic,
)

log = logging.getLogger("finetune")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(
    engine, path: Path, state: dict[str, Any], rank: int, barrier, hf_files, lease_token: str | None = None
) -> None:
    """All ranks call this; on return `path` holds a complete checkpoint (not yet registered with Ray).

    A full or read-only volume fails the save with a CheckpointError that says where, how much a checkpoint
    needs and how much is free; the previous checkpoint is untouched and stays registered. Rank 0 checks that
    the experiment's lease still carries this run's `lease_token` before it touches the folder and again just
    before the completion mark: the late workers of a run whose lease was taken over never complete one.
    """
    write(engine, path, state, rank, barrier, hf_files, lease_token)
    barrier()
    complete(engine, path, state, rank, lease_token)


def write(
    engine,
    path: Path,
    state: dict[str, Any],
    rank: int,
    barrier,
    hf_files,
    lease_token: str | None,
    background: bool = False,
) -> None:
    """Every rank's files of the checkpoint at `path`, the completion mark not yet. With `background` the engine's
    checkpoint engine is a `background.Capture` (files queued for the writer thread), else they are on disk."""
    path = Path(path)
    run_dir, step, world = path.parent.parent, state.get("global_step", 0), state.get("world_size", 1)
    try:
        if rank == 0:
            _check_lease(run_dir, lease_token, path)
        if rank == 0 and path.exists():
            # Left by a run that died while saving this same step; a complete one is set aside, never deleted.
            if problem(path) is None:
                move_aside(path, "complete")
            else:
                shutil.rmtree(path)
        barrier()
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        faults.maybe_pause("before_shards", step, rank, world, run_dir)
        with faults.pausing_engine(engine, step, rank, world, run_dir, in_loop=not background):
            # A LoRA run's checkpoint holds the adapters only: the frozen base is the model's own (app.lora).
            adapters_only = {"exclude_frozen_parameters": True} if lora.is_lora(getattr(engine, "module", None)) else {}
            engine.save_checkpoint(str(path), tag=TAG, client_state=state, save_latest=True, **adapters_only)
        torch.save(rng_state(), rng_file(path, rank))
        if rank == 0:
            hf_files(path / "hf")
    except (OSError, RuntimeError) as exc:
        raise storage_error(exc, path, engine) or exc


def complete(engine, path: Path, state: dict[str, Any], rank: int, lease_token: str | None) -> None:
    """Once every rank's files are written: rank 0 writes the completion mark (other ranks return at once)."""
    if rank != 0:
        return
    path = Path(path)
    run_dir, step, world = path.parent.parent, state.get("global_step", 0), state.get("world_size", 1)
    faults.maybe_pause("before_state", step, rank, world, run_dir)
    _check_lease(run_dir, lease_token, path)
    try:
        # The completion mark, written last: with it, the list of files and sizes that make the checkpoint.
        write_atomic(path / STATE_FILE, json.dumps({**state, "files": manifest(path)}, indent=2))
    except OSError as exc:
        raise storage_error(exc, path, engine) or exc
    faults.maybe_pause("before_report", step, rank, world, run_dir)


# What each rank tells the others about its background write, after every step (a MAX over the ranks).
IDLE, WRITING, FAILED = 0, 1, 2


@dataclass
class Saved:
    """A checkpoint that has just become complete: the loop reports it to Ray."""

    path: Path
    state: dict[str, Any]
    extra: dict[str, Any]
    stall_s: float  # how long the loop waited for it
    total_s: float  # from the start of the save until it was complete (every rank's files durable, the mark)
    background: bool


class Saver:
    """Every rank: writes checkpoints, in the background unless `background` is false, one at a time.

    `save` returns once this rank's state is in host memory (or, with `wait`, once the checkpoint is complete);
    the loop tells the ranks each other's `status()` after every step (`preemption.RankWatch.agreed`) and calls
    `settle` with the highest: when no rank is still writing, rank 0 writes the completion mark and the save is
    returned for the report to Ray. A failed write stops the run on every rank with the failing rank's message.
    The next save, the last one and a preemption's first wait for the one in flight (`drain`).
    """

    def __init__(
        self, engine, rank: int, world: int, barrier, hf_files, lease_token: str | None, background: bool, group=None
    ):
        self.engine, self.rank, self.world, self.barrier = engine, rank, world, barrier
        self.hf_files, self.lease_token, self.group = hf_files, lease_token, group
        self.background = background
        self.copier = background_mod.HostCopy()
        self.writer = background_mod.Writer(self._before_write) if background else None
        self.pending: tuple[Path, dict[str, Any], dict[str, Any], float, float] | None = None
        self.prepared = self.logged = False

    def prepare(self) -> None:
        """After the first optimizer step (torch's Adam creates its moments there): allocate the host buffers for
        the optimizer's state in the background, while training goes on, so that the first save only copies into
        them. Called after every step; does something once."""
        if not self.background or self.prepared:
            return
        self.prepared = True
        try:
            state = self.engine.optimizer.state_dict()
        except Exception:  # noqa: BLE001 - no state to size the buffers by: the first save allocates them
            return
        self.writer.reserve(self.copier, state)

    def status(self) -> int:
        if self.pending is None:
            return IDLE
        if self.writer.error is not None:
            return FAILED
        return IDLE if self.writer.idle.is_set() else WRITING

    def save(self, path: Path, state: dict[str, Any], extra: dict[str, Any], wait: bool = False) -> list[Saved]:
        """All ranks: save `state` at `path`; returns the saves that became complete meanwhile."""
        done = self.drain()
        started = time.perf_counter()
        args = (self.engine, path, state, self.rank, self.barrier, self.hf_files, self.lease_token)
        if not self.background:
            save(*args)
            took = time.perf_counter() - started
            return [*done, Saved(Path(path), state, extra, took, took, False)]
        self.writer.wait()  # buffers being reserved
        self.copier.release()
        self.writer.begin()
        capture = background_mod.capture_engine(self.engine.checkpoint_engine, self.copier, self.writer)
        with formats.checkpoint_engine(self.engine, capture):
            write(*args, background=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies have left the GPU: the next step may change what they copied
        self.writer.seal(*self._written_in_loop(Path(path)))
        self.pending = (Path(path), state, extra, started, time.perf_counter() - started)
        if self.rank == 0 and not self.logged:
            self.logged = True
            (reserved, took), now = self.copier.reserved, self.copier.allocated
            log.info(
                f"background checkpoint writes keep {_mib(reserved + now)} of host memory per rank ({_mib(reserved)} "
                f"allocated ahead in {took:.1f} s, {_mib(now)} during this save)"
            )
        if not wait:
            return done
        return [*done, *(replace(d, stall_s=d.total_s) for d in self.drain())]  # the loop waited for all of it

    def settle(self, agreed: int) -> list[Saved]:
        """After the ranks agreed on the highest `status()`: complete the save in flight when every rank's write
        is durable; raise when one failed."""
        if self.pending is None or agreed == WRITING:
            return []
        if agreed == FAILED:
            self._fail()
        path, state, extra, started, stall = self.pending
        self.pending = None
        complete(self.engine, path, state, self.rank, self.lease_token)
        return [Saved(path, state, extra, stall, time.perf_counter() - started, True)]

    def drain(self) -> list[Saved]:
        """All ranks: wait until the save in flight (if any) is complete, and return it."""
        if self.pending is None:
            return []
        self.writer.wait()
        return self.settle(self._max_over_ranks(self.status()))

    def _max_over_ranks(self, value: int) -> int:
        import torch.distributed as dist

        if self.world == 1 or not dist.is_initialized():
            return value
        t = torch.tensor([value], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0])

    def _fail(self) -> None:
        """Every rank raises the message of the first rank whose write failed."""
        import torch.distributed as dist

        path = self.pending[0]
        self.pending = None
        exc = self.writer.error
        mine = None
        if exc is not None:
            err = storage_error(exc, path, self.engine) if isinstance(exc, OSError) else None
            mine = str(err) if err else f"cannot write checkpoint {path}: {type(exc).__name__}: {exc}"
        texts = [mine]
        if self.world > 1 and dist.is_initialized():
            texts = [None] * self.world
            dist.all_gather_object(texts, mine, group=self.group)
        raise CheckpointError(next(t for t in texts if t))

    def _written_in_loop(self, path: Path) -> tuple[list[Path], list[Path]]:
        """The files this rank wrote itself in the loop (small ones: RNG states; on rank 0 DeepSpeed's `latest`,
        its recovery script, the model config and tokenizer) and the folders, for the writer to fsync."""
        files = [rng_file(path, self.rank)]
        if self.rank == 0:
            files += [p for p in path.iterdir() if p.is_file()]
            files += [p for p in (path / "hf").rglob("*") if p.is_file()]
        return files, [path / TAG, path / "hf", path, path.parent]

    def _before_write(self, file: str) -> None:
        if file.endswith("optim_states.pt"):  # test-only: the mid_shards drill pauses in the background write
            path = Path(file).parent.parent
            faults.maybe_pause("mid_shards", step_of(path), self.rank, self.world, path.parent.parent)


def _check_lease(run_dir: Path, token: str | None, path: Path) -> None:
    if not lease.holds(run_dir, token):
        raise CheckpointError(
            f"not completing {path}: the lease on {run_dir} no longer belongs to this run (another deploy took it "
            "over), so this run must not write there; the new holder resumes from the last complete checkpoint"
        )


def storage_error(exc: BaseException, path: Path, engine) -> CheckpointError | None:
    """A clear error when the save failed because the volume is full or read-only; None otherwise."""
    code = getattr(exc, "errno", None)
    probe = nearest_existing(path)
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    previous, _ = scan_usable(path.parent.parent, step_of(path))
    need = (sum(p.stat().st_size for p in previous.rglob("*") if p.is_file()) if previous else 0) or _estimate_bytes(
        engine
    )
    read_only = code == errno.EROFS or bool(st.f_flag & os.ST_RDONLY)
    full = code in (errno.ENOSPC, errno.EDQUOT) or (code is None and free < need)
    if not (read_only or full):
        return None
    what = "is read-only" if read_only else "is full"
    kept = (
        f"The previous checkpoint {previous.name} is intact and stays the one to resume from"
        if previous
        else "No earlier checkpoint exists"
    )
    reason = os.strerror(code or (errno.EROFS if read_only else errno.ENOSPC))
    fix = "Mount it read-write" if read_only else "Free space on it (or lower checkpoint.keep, or grow the volume)"
    return CheckpointError(
        f"cannot write checkpoint {path}: the volume {_mount_point(probe)} {what} ({reason}). A checkpoint of this run "
        f"needs about {_mib(need)}; {_mib(free)} are free there. {kept}. {fix}, then deploy again with the same "
        "experiment name to resume."
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path.parent != path:
        path = path.parent
    return path


def _estimate_bytes(engine) -> int:
    """Without an earlier checkpoint: fp32 master weights and two Adam moments, plus 16-bit weights."""
    try:
        n = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    except Exception:  # noqa: BLE001 - an estimate only
        return 0
    return n * 14
