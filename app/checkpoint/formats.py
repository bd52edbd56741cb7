"""The only module that touches Ray's or DeepSpeed's private formats. tests/test_reliability.py
(`test_private_formats_match_the_pinned_versions`) fails when the pinned Ray or DeepSpeed changes them.

- Ray Train's checkpoint manager snapshot (`checkpoint_manager_snapshot.json`, Ray's `_CheckpointManagerState`):
  Ray refuses to start a run whose snapshot names a missing folder, so it is repaired before Ray starts.
- DeepSpeed's checkpoint engine: `engine.save_checkpoint` hands every file to `engine.checkpoint_engine.save`; a
  background save swaps in its own engine for that one call.
- DeepSpeed's universal checkpoint: `ds_to_universal.main` takes its command line as a Namespace, and the engine
  loads a universal checkpoint only when its private `_config.load_universal_checkpoint` is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from argparse import Namespace
from pathlib import Path

from app.checkpoint.layout import write_atomic

RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
# The snapshot's lists of checkpoint folder names, besides the results kept in step with their report indices.
RAY_NAME_LISTS = (
    "validated_checkpoint_dir_names",
    "timed_out_validation_checkpoint_dir_names",
    "failed_validation_checkpoint_dir_names",
)


def repair_ray_snapshot(run_dir: Path) -> list[str]:
    """The driver, holding the lease, before Ray starts: Ray refuses to start a run whose snapshot names a
    checkpoint folder that no longer exists, or that it cannot parse ("corrupted run directory"), which would
    block the experiment for good. Drop the missing folders from the snapshot (a backup is kept), or move an
    unreadable snapshot aside so that the run resumes from the newest complete checkpoint on disk. Returns
    warnings for the log."""
    path = Path(run_dir) / RAY_SNAPSHOT
    if not path.exists():
        return []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    try:
        snap = json.loads(path.read_text())
        missing = {
            r["checkpoint_dir_name"]
            for r in snap["checkpoint_results"]
            if not (Path(run_dir) / r["checkpoint_dir_name"]).is_dir()
        }
        if not missing:
            return []
        _drop_from_snapshot(snap, missing)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        aside = path.with_name(f"{RAY_SNAPSHOT}.unreadable-{stamp}")
        os.replace(path, aside)
        return [
            f"Ray's record of this experiment's checkpoints ({path}) is unreadable ({type(exc).__name__}: {exc}): "
            f"moved it aside to {aside.name}; the run resumes from the newest complete checkpoint on disk"
        ]
    backup = path.with_name(f"{RAY_SNAPSHOT}.bak-{stamp}")
    shutil.copy2(path, backup)
    write_atomic(path, json.dumps(snap))
    gone = ", ".join(sorted(Path(n).name for n in missing))
    return [
        f"Ray's record of this experiment's checkpoints names folders that no longer exist ({gone}); Ray would "
        f"refuse to start, so they were dropped from it (backup: {backup.name})"
    ]


def _drop_from_snapshot(snap: dict, missing: set[str]) -> None:
    results = snap["checkpoint_results"]
    keep = [i for i, r in enumerate(results) if r["checkpoint_dir_name"] not in missing]
    snap["checkpoint_results"] = [results[i] for i in keep]
    snap["checkpoint_report_indices"] = [snap["checkpoint_report_indices"][i] for i in keep]
    latest = snap.get("latest_checkpoint_result")
    if latest is not None and latest["checkpoint_dir_name"] in missing:
        by_index = sorted(zip(snap["checkpoint_report_indices"], snap["checkpoint_results"]), key=lambda x: x[0])
        snap["latest_checkpoint_result"] = by_index[-1][1] if by_index else None
    pending = snap.get("pending_training_results", [])
    specs = snap.get("pending_validation_specs", [])
    kept = [i for i, r in enumerate(pending) if r["checkpoint_dir_name"] not in missing]
    snap["pending_training_results"] = [pending[i] for i in kept]
    snap["pending_validation_specs"] = [specs[i] for i in kept if i < len(specs)]
    for key in RAY_NAME_LISTS:
        if isinstance(snap.get(key), list):
            snap[key] = [n for n in snap[key] if n not in missing]


def universal_args(src: Path, dst: Path) -> Namespace:
    """`ds_to_universal`'s command line: one extract and one merge worker (the conversion runs once, at a
    world-size change, while the other ranks wait), strict, optimizer state injected where a rank lacks it."""
    return Namespace(
        input_folder=str(src),
        output_folder=str(dst),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )


def convert_to_universal(src: Path, dst: Path) -> None:
    from deepspeed.checkpoint.ds_to_universal import main as convert

    convert(universal_args(src, dst))


@contextlib.contextmanager
def loading_universal(engine, universal: bool):
    """DeepSpeed reads a universal checkpoint only with this private config flag set (its `checkpoint`
    section sets it for every load; here it is set for this one load only)."""
    engine._config.load_universal_checkpoint = universal
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = False


@contextlib.contextmanager
def checkpoint_engine(engine, replacement):
    """`engine.save_checkpoint` within this block writes through `replacement` (DeepSpeed's CheckpointEngine
    interface: create, makedirs, save, commit); the engine's own is back afterwards, for loads too."""
    original = engine.checkpoint_engine
    engine.checkpoint_engine = replacement
    try:
        yield replacement
    finally:
        engine.checkpoint_engine = original
