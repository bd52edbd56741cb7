"""Checkpointing, resume and export.

A checkpoint is `<experiment>/checkpoints/step-NNNNNNNN/`: DeepSpeed's shards under `ds/`, each rank's RNG
states, the model config and tokenizer under `hf/` (so it can be exported offline), and `trainer_state.json`,
written last. Every rank writes its shards straight into that folder on the shared volume (no temp copy),
then the folder is reported to Ray with NO_UPLOAD: Ray registers it only when every rank has reported, so
a checkpoint is either complete and registered, or ignored on resume.

`trainer_state.json` also lists every file of the checkpoint with its size, so a resume can tell a complete
checkpoint from a truncated or half-deleted one without reading it. Resume (`plan_resume`) starts from the
checkpoint Ray registered; when that one is missing, incomplete or failed to load, it falls back to the newest
older complete one with a warning, and it refuses to start from scratch over an experiment with progress.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app import faults

log = logging.getLogger("finetune")
TAG = "ds"
STATE_FILE = "trainer_state.json"
UNIVERSAL = "universal"  # DeepSpeed universal checkpoint, converted at a world-size change
UNLOADABLE = ".unloadable"  # written into a checkpoint that failed to load: later resumes skip it
STEP_DIR = re.compile(r"^step-(\d+)$")
# What save() writes into a step folder; anything else there is someone else's.
OUR_NAMES = {TAG, UNIVERSAL, UNIVERSAL + ".tmp", "hf", "latest", STATE_FILE, STATE_FILE + ".tmp", "zero_to_fp32.py", "zero_to_torch.py", UNLOADABLE}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the folder and what to do."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, path: Path, state: dict[str, Any], rank: int, barrier, hf_files) -> None:
    """All ranks call this; on return `path` holds a complete checkpoint (not yet registered with Ray).

    A full or read-only volume fails the save with a CheckpointError that says where, how much a checkpoint
    needs and how much is free; the previous checkpoint is untouched and stays registered.
    """
    path = Path(path)
    run_dir, step, world = path.parent.parent, state.get("global_step", 0), state.get("world_size", 1)
    try:
        if rank == 0 and path.exists():
            # Left by a run that died while saving this same step: never registered, safe to replace.
            shutil.rmtree(path)
        barrier()
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        faults.maybe_pause("before_shards", step, rank, world, run_dir)
        with faults.pausing_engine(engine, step, rank, world, run_dir):
            engine.save_checkpoint(str(path), tag=TAG, client_state=state, save_latest=True)
        torch.save(rng_state(), path / f"rng-rank{rank}.pt")
        if rank == 0:
            hf_files(path / "hf")
    except (OSError, RuntimeError) as exc:
        raise _storage_error(exc, path, engine) or exc
    barrier()
    if rank == 0:
        faults.maybe_pause("before_state", step, rank, world, run_dir)
        try:
            # The completion mark, written last: with it, the list of files and sizes that make the checkpoint.
            write_atomic(path / STATE_FILE, json.dumps({**state, "files": _manifest(path)}, indent=2))
        except OSError as exc:
            raise _storage_error(exc, path, engine) or exc
        faults.maybe_pause("before_report", step, rank, world, run_dir)


def _manifest(path: Path) -> dict[str, int]:
    files = [p for sub in (TAG, "hf") for p in (path / sub).rglob("*") if p.is_file()]
    files += list(path.glob("rng-rank*.pt"))
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(files)}


def _storage_error(exc: BaseException, path: Path, engine) -> CheckpointError | None:
    """A clear error when the save failed because the volume is full or read-only; None otherwise."""
    code = getattr(exc, "errno", None)
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    previous, _ = _newest_usable(path.parent.parent, step_of(path))
    need = (sum(p.stat().st_size for p in previous.rglob("*") if p.is_file()) if previous else 0) or _estimate_bytes(engine)
    read_only = code == errno.EROFS or bool(st.f_flag & os.ST_RDONLY)
    full = code in (errno.ENOSPC, errno.EDQUOT) or (code is None and free < need)
    if not (read_only or full):
        return None
    mount = _mount_point(probe)
    what = "is read-only" if read_only else "is full"
    kept = (f"The previous checkpoint {previous.name} is intact and stays the one to resume from"
            if previous else "No earlier checkpoint exists")
    reason = os.strerror(code or (errno.EROFS if read_only else errno.ENOSPC))
    fix = "Mount it read-write" if read_only else "Free space on it (or lower checkpoint.keep, or grow the volume)"
    return CheckpointError(
        f"cannot write checkpoint {path}: the volume {mount} {what} ({reason}). A checkpoint of this run needs "
        f"about {_mib(need)}; {_mib(free)} are free there. {kept}. {fix}, then deploy again with the same "
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


def step_of(path: Path) -> int:
    m = STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else -1


def step_folders(run_dir: Path) -> list[Path]:
    """This app's step-NNNNNNNN folders, newest first; other names in checkpoints/ are ignored."""
    folders = [f for f in (Path(run_dir) / "checkpoints").glob("step-*") if STEP_DIR.match(f.name) and f.is_dir()]
    return sorted(folders, key=step_of, reverse=True)


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).exists() and (path / TAG).is_dir()


def problem(path: Path) -> str | None:
    """Why `path` cannot be resumed from (missing, never finished, truncated, failed to load), or None."""
    path = Path(path)
    if not path.is_dir():
        return "its folder does not exist (deleted?)"
    if (path / UNLOADABLE).exists():
        return f"it failed to load before: {(path / UNLOADABLE).read_text().strip()[:300]}"
    if not (path / STATE_FILE).exists():
        return f"it was never finished (no {STATE_FILE}: the run died while saving it)"
    try:
        state = read_state(path)
    except (OSError, ValueError) as exc:
        return f"its {STATE_FILE} is unreadable ({exc})"
    if not (path / TAG).is_dir():
        return f"it has no {TAG}/ folder of DeepSpeed shards"
    files = state.get("files")
    if files is None:  # written before manifests existed: check the shards' zip structure at least
        files = {str(p.relative_to(path)): None for p in (path / TAG).glob("*.pt")}
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if size is not None and f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written (truncated or replaced)"
        if f.suffix == ".pt" and not zipfile.is_zipfile(f):
            return f"{name} is not a readable torch file"
    return None


def plan_resume(run_dir: Path, registered: Path | None) -> tuple[Path | None, list[str]]:
    """(checkpoint to resume from or None to start fresh, warnings). Raises CheckpointError rather than
    start from scratch over an experiment that has progress."""
    warnings = []
    if registered is not None:
        registered = Path(registered)
        why = problem(registered)
        if why is None:
            return registered, warnings
        ceiling = step_of(registered) if step_of(registered) >= 0 else None
        fallback, skipped = _newest_usable(run_dir, ceiling)
        if fallback is None:
            raise CheckpointError(
                f"Ray's latest registered checkpoint {registered} cannot be used: {why}; and no older complete "
                f"checkpoint is left in {Path(run_dir) / 'checkpoints'}{_skipped(skipped)}. Not starting from scratch "
                "over an experiment that has progress: restore that folder from a backup, or deploy under a new "
                f"experiment name (or delete {run_dir} to start this one over)."
            )
        warnings.append(f"Ray's latest registered checkpoint {registered.name} cannot be used: {why}; falling back "
                        f"to {fallback.name}, the newest older complete checkpoint{_skipped(skipped)}")
        return fallback, warnings
    newest, skipped = _newest_usable(run_dir, None)
    if newest is not None:
        warnings.append(f"Ray has no registered checkpoint for this experiment (its checkpoint_manager_snapshot.json "
                        f"is missing or unreadable), but {newest} is complete: resuming from it rather than starting "
                        f"over{_skipped(skipped)}")
        return newest, warnings
    finished = [f for f in step_folders(run_dir) if (f / STATE_FILE).exists()]
    if finished:
        raise CheckpointError(
            f"Ray has no registered checkpoint for this experiment and no checkpoint in {Path(run_dir) / 'checkpoints'} "
            f"is usable{_skipped(skipped)}. Not starting from scratch over an experiment that has progress: restore a "
            f"checkpoint folder, or deploy under a new experiment name (or delete {run_dir} to start this one over)."
        )
    if skipped:
        warnings.append(f"no finished checkpoint in {Path(run_dir) / 'checkpoints'}{_skipped(skipped)}; starting "
                        "from scratch")
    return None, warnings


def newest_usable(run_dir: Path) -> Path | None:
    """The newest checkpoint a resume could use, judged from the files alone."""
    return _newest_usable(run_dir, None)[0]


def _newest_usable(run_dir: Path, ceiling: int | None) -> tuple[Path | None, list[str]]:
    """The newest usable checkpoint below step `ceiling` (None: any), and why newer ones were skipped."""
    skipped = []
    for folder in step_folders(run_dir):
        if ceiling is not None and step_of(folder) >= ceiling:
            continue
        why = problem(folder)
        if why is None:
            return folder, skipped
        skipped.append(f"{folder.name}: {why}")
    return None, skipped


def _skipped(skipped: list[str]) -> str:
    return f" (skipped {'; '.join(skipped)})" if skipped else ""


def remove_newer(run_dir: Path, step: int) -> list[str]:
    """Rank 0, at resume: step folders newer than the resumed step were never registered (or are broken);
    remove them so that nothing half-written lingers. Folders holding files this app never writes are
    moved aside, not deleted. Returns what was done, for the log."""
    done = []
    for folder in step_folders(run_dir):
        if step_of(folder) <= step:
            continue
        names = {p.name for p in folder.iterdir()}
        if all(n in OUR_NAMES or n.startswith("rng-rank") for n in names):
            why = problem(folder) or "complete, but Ray never registered it (the run stopped before every rank reported it)"
            shutil.rmtree(folder)
            done.append(f"removed {folder.name}, newer than the checkpoint resumed from: {why}")
        else:
            aside = folder.with_name(f"{folder.name}.foreign-{time.strftime('%Y%m%dT%H%M%S')}")
            os.rename(folder, aside)
            done.append(f"moved {folder.name} aside to {aside.name} (it holds files this app does not write)")
    return done


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


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
        results = snap["checkpoint_results"]
        names = [r["checkpoint_dir_name"] for r in results]
        missing = {n for n in names if not (Path(run_dir) / n).is_dir()}
        if not missing:
            return []
        keep = [i for i, n in enumerate(names) if n not in missing]
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
        for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                    "failed_validation_checkpoint_dir_names"):
            if isinstance(snap.get(key), list):
                snap[key] = [n for n in snap[key] if n not in missing]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        aside = path.with_name(f"{RAY_SNAPSHOT}.unreadable-{stamp}")
        os.replace(path, aside)
        return [f"Ray's record of this experiment's checkpoints ({path}) is unreadable ({type(exc).__name__}: {exc}): "
                f"moved it aside to {aside.name}; the run resumes from the newest complete checkpoint on disk"]
    backup = path.with_name(f"{RAY_SNAPSHOT}.bak-{stamp}")
    shutil.copy2(path, backup)
    write_atomic(path, json.dumps(snap))
    gone = ", ".join(sorted(Path(n).name for n in missing))
    return [f"Ray's record of this experiment's checkpoints names folders that no longer exist ({gone}); Ray would "
            f"refuse to start, so they were dropped from it (backup: {backup.name})"]


def last_logged_step(run_dir: Path) -> int | None:
    """The step of the last progress record in metrics.jsonl: how far the previous attempt got."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    last = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "train" and isinstance(rec.get("step"), int):
            last = rec["step"]
    return last


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((path / STATE_FILE).read_text())


def resume(engine, registered, run_dir: Path, rank: int, world: int) -> dict[str, Any]:
    """All ranks: choose the checkpoint (rank 0 decides, the others follow), clean up newer unregistered
    folders, load it, and log where the run resumes and which steps are redone. Returns the position."""
    import torch.distributed as dist

    run_dir = Path(run_dir)
    plan: list[Any] = [None, [], None, None]
    if rank == 0:
        try:
            path, warnings = plan_resume(run_dir, Path(registered.path) if registered else None)
            plan = [str(path) if path else None, warnings, None, last_logged_step(run_dir)]
        except CheckpointError as exc:
            plan = [None, [], str(exc), None]
    if dist.is_initialized() and world > 1:
        dist.broadcast_object_list(plan, src=0)
    chosen, warnings, error, last_step = plan
    if error:
        raise CheckpointError(error)
    for warning in warnings:
        log.warning(f"WARNING: {warning}")
    if rank == 0:
        for line in remove_newer(run_dir, step_of(Path(chosen)) if chosen else -1):
            log.warning(f"WARNING: {line}")
    if dist.is_initialized() and world > 1:
        dist.barrier()
    if chosen is None:
        return {"epoch": 0, "step_in_epoch": 0, "global_step": 0}
    started = time.perf_counter()
    position = restore(engine, Path(chosen), rank, world)
    position["resumed_from"] = str(chosen)
    position["load_s"] = round(time.perf_counter() - started, 2)
    s = position["global_step"]
    if last_step is not None and last_step > s:
        redone = f"steps {s + 1}..{last_step} ({last_step - s}) that the previous attempt had done are redone"
    else:
        redone = "no step is redone"
    source = "registered by Ray" if registered and Path(registered.path) == Path(chosen) else "fallback"
    log.info(f"resumed from {chosen} ({source}) at global step {s} (epoch {position['epoch']}, "
             f"step {position['step_in_epoch']} of the epoch), loaded in {position['load_s']:.1f}s; {redone}")
    return position


def restore(engine, path: Path, rank: int, world: int) -> dict[str, Any]:
    """Load engine, optimizer and scheduler states; return the trainer state saved with them.

    A checkpoint written by another number of workers is converted once to DeepSpeed's universal checkpoint
    format (into `<checkpoint>/universal/`) and loaded from there. If loading fails, the checkpoint is marked
    unloadable so that the next attempt (Ray's max_failures) or the next deploy falls back to the previous
    complete checkpoint instead of failing the same way again."""
    import torch.distributed as dist

    state = read_state(path)
    saved_world = state.get("world_size") or world
    universal = saved_world != world
    tag = TAG
    if universal:
        saved_batch = state.get("micro_batch_size", 0) * state.get("gradient_accumulation_steps", 0) * saved_world
        if saved_batch and saved_batch != engine.train_batch_size():
            raise CheckpointError(
                f"{path} was written by {saved_world} workers with a global batch of {saved_batch}; this run of {world} "
                f"workers has a global batch of {engine.train_batch_size()}, so it cannot resume at the same sample. "
                "Deploy with the same number of workers, or a micro-batch and accumulation that keep the global batch")
        try:
            tag = to_universal(path, rank)
        except Exception as exc:
            raise CheckpointError(f"converting {path} (written by {saved_world} workers) to DeepSpeed's universal "
                                  f"checkpoint format for {world} workers failed: {type(exc).__name__}: {exc}. "
                                  f"Deploy with {saved_world} workers to resume without conversion") from exc
        finally:
            if dist.is_initialized():
                dist.barrier()
        if not (path / tag).is_dir():
            raise CheckpointError(f"rank 0 could not convert {path} to the universal checkpoint format (see its log)")
        engine._config.load_universal_checkpoint = True
    try:
        load_path, _ = engine.load_checkpoint(str(path), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError("DeepSpeed found nothing to load")
    except Exception as exc:
        if universal:  # not the checkpoint's fault as far as we know: leave it usable by its own world size
            raise CheckpointError(f"could not load {path / tag} (universal format) on rank {rank}: "
                                  f"{type(exc).__name__}: {exc}. Deploy with {saved_world} workers to resume") from exc
        try:
            (path / UNLOADABLE).write_text(f"rank {rank}: {type(exc).__name__}: {exc}\n")
        except OSError:
            pass
        raise CheckpointError(f"could not load checkpoint {path} on rank {rank}: {type(exc).__name__}: {exc}. It is "
                              "marked unloadable: the next attempt or deploy falls back to the previous complete "
                              "checkpoint") from exc
    finally:
        engine._config.load_universal_checkpoint = False
    if universal and rank == 0:
        log.info(f"{path.name} was written by {saved_world} workers and this run has {world}: loaded it through "
                 f"DeepSpeed's universal checkpoint format ({path / tag}); global batch {engine.train_batch_size()} "
                 f"= {engine.train_micro_batch_size_per_gpu()} x {engine.gradient_accumulation_steps()} accumulation "
                 f"x {world} workers (was {state.get('micro_batch_size')} x {state.get('gradient_accumulation_steps')} "
                 f"x {saved_world})")
    rng_file = path / f"rng-rank{rank}.pt"
    if not universal and rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def to_universal(path: Path, rank: int) -> str:
    """Rank 0 converts `<path>/ds` to `<path>/universal` once (atomically: a temp folder renamed into place);
    returns the tag to load. The other ranks only return the tag (the caller holds a barrier)."""
    out = path / UNIVERSAL
    if rank == 0 and not (out / ".done").exists():
        from argparse import Namespace

        from deepspeed.checkpoint.ds_to_universal import main as convert

        tmp = path / (UNIVERSAL + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        log.info(f"converting {path / TAG} to DeepSpeed's universal checkpoint format in {out} (once)")
        convert(Namespace(input_folder=str(path / TAG), output_folder=str(tmp), num_extract_workers=1,
                          num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
        (tmp / ".done").write_text("ok\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return UNIVERSAL


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def export(checkpoint: Path, out: Path, dtype: str | None = None, model_source: Path | str | None = None) -> Path:
    """A Hugging Face folder (safetensors + tokenizer) from a checkpoint, consolidated from ZeRO shards.

    `checkpoint` is one of this app's checkpoint folders, or any DeepSpeed save_dir (with a `latest` file or
    one tag folder); for the latter, `model_source` names the model folder or hub name that gives the config
    and tokenizer.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    checkpoint, out = Path(checkpoint), Path(out)
    ours = (checkpoint / TAG).is_dir()
    source = model_source or (checkpoint / "hf" if ours else None)
    if source is None or (ours and not model_source and not (checkpoint / "hf" / "config.json").exists()):
        raise FileNotFoundError(f"{checkpoint} has no hf/ folder with the model config: pass the model it was trained from")
    tag = TAG if ours else None
    if not ours and not (checkpoint / "latest").exists():
        tags = [p.name for p in checkpoint.iterdir() if p.is_dir()]
        if len(tags) != 1:
            raise FileNotFoundError(f"{checkpoint} has no 'latest' file and {len(tags)} tag folders: pass the tag folder's parent with one tag")
        tag = tags[0]
    state = read_state(checkpoint) if (checkpoint / STATE_FILE).exists() else {}
    dtype = dtype or state.get("precision", "bf16")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    weights = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag)
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [k for k, v in model.state_dict().items() if v.is_meta]
    if missing:
        raise RuntimeError(f"checkpoint {checkpoint} lacks weights for {missing[:5]}")
    model = model.to(torch_dtype)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
