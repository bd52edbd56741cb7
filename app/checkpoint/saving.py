"""Writing a checkpoint: every rank writes its shards straight into the step folder on the shared volume (no temp
copy), rank 0 writes the state file last, and only while the experiment's lease is still this run's. The caller then
reports the folder to Ray with NO_UPLOAD: Ray registers it when every rank has reported. A checkpoint whose state
file is written is complete: a resume uses it even when the run died before Ray registered it.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app import faults, lease
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
        with faults.pausing_engine(engine, step, rank, world, run_dir):
            engine.save_checkpoint(str(path), tag=TAG, client_state=state, save_latest=True)
        torch.save(rng_state(), rng_file(path, rank))
        if rank == 0:
            hf_files(path / "hf")
    except (OSError, RuntimeError) as exc:
        raise storage_error(exc, path, engine) or exc
    barrier()
    if rank == 0:
        faults.maybe_pause("before_state", step, rank, world, run_dir)
        _check_lease(run_dir, lease_token, path)
        try:
            # The completion mark, written last: with it, the list of files and sizes that make the checkpoint.
            write_atomic(path / STATE_FILE, json.dumps({**state, "files": manifest(path)}, indent=2))
        except OSError as exc:
            raise storage_error(exc, path, engine) or exc
        faults.maybe_pause("before_report", step, rank, world, run_dir)


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
