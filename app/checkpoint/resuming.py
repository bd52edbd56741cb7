"""Resuming: what a deploy does with the experiment's checkpoints, in two pure decisions and one load.

1. `ResumePlan.decide` (the driver, before any check): from the newest usable checkpoint's trainer state and the
   config, whether this run can continue it and with which gradient accumulation (a changed number of workers
   keeps the global batch); `apply` gives the config the run uses. Nothing is mutated.
2. `choose` (rank 0, in the workers): which checkpoint to load: the one Ray registered, or, when that one is
   missing, incomplete or failed to load, the newest older complete one, with a warning; a newer complete one
   that Ray never registered wins over it; never a fresh start over an experiment with progress. The ranks
   receive it as one typed `LoadPlan`.
3. `resume` / `restore` (every rank): remove newer partial folders (a complete one is only set aside), load,
   and say which steps are redone.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from app import lora
from app.checkpoint import formats
from app.checkpoint.layout import (
    OUR_NAMES,
    STATE_FILE,
    TAG,
    UNIVERSAL,
    UNLOADABLE,
    CheckpointError,
    last_logged_step,
    move_aside,
    newest_usable,
    problem,
    read_state,
    rng_file,
    scan_usable,
    skipped_text,
    step_folders,
    step_of,
)
from app.errors import Problem

if TYPE_CHECKING:
    from app.config import TrainingConfig

log = logging.getLogger("finetune")


# --- 1. the driver's plan ------------------------------------------------------------------------------------


def saved_replicas(state: dict[str, Any], world: int) -> int:
    """The data-parallel replicas a checkpoint was written by: its workers over its sequence-parallel degree (the
    workers of one sequence read one batch)."""
    return max(1, (state.get("world_size") or world) // state.get("sequence_parallel", 1))


def accumulation_for(state: dict[str, Any], micro_batch_size: int, world: int) -> int | None:
    """The gradient accumulation that keeps a checkpoint's global batch with `world` data-parallel replicas of
    `micro_batch_size`; None when no whole number does (a mid-run resume needs the same global batch)."""
    saved = (
        state.get("micro_batch_size", micro_batch_size)
        * state.get("gradient_accumulation_steps", 1)
        * saved_replicas(state, world)
    )
    return saved // (micro_batch_size * world) if saved % (micro_batch_size * world) == 0 else None


@dataclass(frozen=True)
class ResumePlan:
    """What this deploy does with the experiment's newest usable checkpoint (None: a fresh start)."""

    checkpoint: str | None = None
    gradient_accumulation_steps: int | None = None  # set when a changed world size changes it
    problems: tuple[Problem, ...] = ()
    note: str | None = None  # for the log: how the run continues a checkpoint of another world size

    @classmethod
    def read(cls, cfg: TrainingConfig) -> ResumePlan:
        """The plan for `cfg`'s experiment folder as it is on disk."""
        latest = newest_usable(cfg.experiment_dir)
        if latest is None:
            return cls()
        try:
            state = read_state(latest)
        except (OSError, ValueError):
            return cls(latest.name)  # judged again, with fallbacks, when the run starts
        return cls.decide(latest.name, state, cfg)

    @classmethod
    def decide(cls, name: str, state: dict[str, Any], cfg: TrainingConfig) -> ResumePlan:
        """Pure: from a checkpoint's trainer state and the config."""
        saved, workers, t = state.get("world_size"), cfg.scaling.num_workers, cfg.train
        stage, stage_note = state.get("zero_stage"), None  # absent in checkpoints written before it was recorded
        if stage is not None and stage != cfg.zero_stage:
            stage_note = _stage_change_note(name, state, cfg)
        replicas, sp = cfg.scaling.data_parallel, cfg.scaling.sequence_parallel
        if not saved or (saved == workers and saved_replicas(state, workers) == replicas):
            return cls(name, note=stage_note)
        where = f"the experiment's last checkpoint ({name}) was written by {saved} workers"
        ours = f"{workers}"
        if state.get("sequence_parallel", 1) != 1 or sp != 1:  # the global batch counts data-parallel groups
            where += f" ({saved_replicas(state, workers)} data-parallel)"
            ours += f" ({replicas} data-parallel)"

        def refuse(message: str, fix: str) -> ResumePlan:
            return cls(name, problems=(Problem("scaling.num_workers", workers, message, fix),))

        if cfg.zero_stage == 0 and saved != workers:
            return refuse(
                f"{where}; resuming on another number of workers needs ZeRO stage 1, 2 or 3 "
                "(DeepSpeed's universal checkpoint)",
                f"set scaling.num_workers={saved}, or start a new experiment name",
            )
        mb, gas = state.get("micro_batch_size", t.micro_batch_size), state.get("gradient_accumulation_steps", 1)
        global_batch = mb * gas * saved_replicas(state, workers)
        new_gas = accumulation_for(state, t.micro_batch_size, replicas)
        if new_gas is None:
            return refuse(
                f"{where} with a global batch of {global_batch} sequences ({mb} x {gas} accumulation x {saved}); "
                f"{workers} workers x micro_batch_size {t.micro_batch_size} cannot keep it ({global_batch} is "
                "not a multiple of their product), and a mid-run resume needs the same global batch",
                f"use a number of workers that divides {global_batch // t.micro_batch_size}, set "
                f"train.micro_batch_size to keep {global_batch} sequences per step, or start a new experiment "
                "name",
            )
        if new_gas != t.gradient_accumulation_steps:
            batch = (
                f"train.gradient_accumulation_steps {t.gradient_accumulation_steps} -> {new_gas} keeps the "
                f"global batch of {global_batch} sequences"
            )
        else:
            batch = f"the global batch stays {global_batch} sequences"
        note = f"{where}, this run has {ours}: {batch}; "
        if saved == workers:  # the same ranks hold the same ZeRO partitions: only the batch's split changed
            note += "the checkpoint is loaded as written"
        else:
            note += "the checkpoint is converted to DeepSpeed's universal checkpoint format (once) when the run starts"
        return cls(name, new_gas, note=f"{stage_note}; {note}" if stage_note else note)

    def apply(self, cfg: TrainingConfig) -> TrainingConfig:
        """The config this run uses: `cfg` itself, or a copy with the accumulation that keeps the global batch."""
        if self.gradient_accumulation_steps in (None, cfg.train.gradient_accumulation_steps):
            return cfg
        train = cfg.train.model_copy(update={"gradient_accumulation_steps": self.gradient_accumulation_steps})
        return cfg.model_copy(update={"train": train})


def _stage_change_note(name: str, state: dict[str, Any], cfg: TrainingConfig) -> str:
    """A change of ZeRO stage goes through DeepSpeed's universal checkpoint: its converter and loaders between stages
    1, 2 and 3; to or from stage 0, whose optimizer DeepSpeed saves whole, the app's (app.checkpoint.formats). Where
    train.pure_bf16 changed too (an accepted change, app.contract), the master weights change precision."""
    stage = state.get("zero_stage")
    note = (
        f"the experiment's last checkpoint ({name}) was written at ZeRO stage {stage}, this run has stage "
        f"{cfg.zero_stage}: the checkpoint is converted to DeepSpeed's universal checkpoint format (once) when the run "
        "starts, weights and optimizer state kept"
    )
    if 0 in (stage, cfg.zero_stage):
        note += " (stage 0 saves its optimizer whole, in another layout: the app converts it)"
    if isinstance(state.get("pure_bf16"), bool) and state["pure_bf16"] != (cfg.train.pure_bf16 is True):
        was, now = ("bf16", "fp32") if state["pure_bf16"] else ("fp32", "bf16")
        note += f"; the master weights change precision, {was} -> {now}"
    return note


# --- 2. rank 0's choice, broadcast ------------------------------------------------------------------------


@dataclass
class LoadPlan:
    """Rank 0's decision, sent to every rank as one object."""

    checkpoint: str | None = None  # None: a fresh start
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    last_logged_step: int | None = None  # how far the previous attempt got (metrics.jsonl)


def choose(run_dir: Path, registered: Path | None) -> tuple[Path | None, list[str]]:
    """(checkpoint to resume from or None to start fresh, warnings): the newest complete checkpoint, registered
    with Ray or not, so that finished work is never redone or deleted. Raises CheckpointError rather than start
    from scratch over an experiment that has progress."""
    if registered is not None:
        newer = _complete_newer_than(run_dir, Path(registered))
        if newer is not None:
            return newer, [
                f"{newer.name} is complete on storage but Ray never registered it (the previous run stopped "
                f"between writing it and reporting it; Ray's latest is {Path(registered).name}): resuming from "
                f"{newer.name}, the newest complete checkpoint"
            ]
        return _registered_or_older(run_dir, Path(registered))
    newest, skipped = scan_usable(run_dir)
    if newest is not None:
        return newest, [
            f"Ray has no registered checkpoint for this experiment (its checkpoint_manager_snapshot.json "
            f"is missing or unreadable), but {newest} is complete: resuming from it rather than starting "
            f"over{skipped_text(skipped)}"
        ]
    if any((f / STATE_FILE).exists() for f in step_folders(run_dir)):
        raise CheckpointError(
            f"Ray has no registered checkpoint for this experiment and no checkpoint in "
            f"{Path(run_dir) / 'checkpoints'} is usable{skipped_text(skipped)}. Not starting from scratch over an "
            "experiment that has progress: restore a checkpoint folder, or deploy under a new experiment name (or "
            f"delete {run_dir} to start this one over)."
        )
    if skipped:
        return None, [
            f"no finished checkpoint in {Path(run_dir) / 'checkpoints'}{skipped_text(skipped)}; starting from scratch"
        ]
    return None, []


def _complete_newer_than(run_dir: Path, registered: Path) -> Path | None:
    """The newest complete checkpoint newer than Ray's registered one, if any. Complete means every rank's
    files are there as its manifest lists them, the state file written last; a dead run's late workers cannot
    complete one after a takeover (the save checks the lease first)."""
    newest = newest_usable(run_dir)
    return newest if newest is not None and step_of(newest) > step_of(registered) else None


def _registered_or_older(run_dir: Path, registered: Path) -> tuple[Path, list[str]]:
    why = problem(registered)
    if why is None:
        return registered, []
    fallback, skipped = scan_usable(run_dir, step_of(registered) if step_of(registered) >= 0 else None)
    if fallback is None:
        raise CheckpointError(
            f"Ray's latest registered checkpoint {registered} cannot be used: {why}; and no older complete "
            f"checkpoint is left in {Path(run_dir) / 'checkpoints'}{skipped_text(skipped)}. Not starting from scratch "
            "over an experiment that has progress: restore that folder from a backup, or deploy under a new "
            f"experiment name (or delete {run_dir} to start this one over)."
        )
    return fallback, [
        f"Ray's latest registered checkpoint {registered.name} cannot be used: {why}; falling back "
        f"to {fallback.name}, the newest older complete checkpoint{skipped_text(skipped)}"
    ]


def _decide_on_rank0(run_dir: Path, registered: Path | None) -> LoadPlan:
    try:
        path, warnings = choose(run_dir, registered)
    except CheckpointError as exc:
        return LoadPlan(error=str(exc))
    return LoadPlan(str(path) if path else None, warnings, None, last_logged_step(run_dir))


def _broadcast(plan: LoadPlan, world: int) -> LoadPlan:
    import torch.distributed as dist

    if dist.is_initialized() and world > 1:
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
    return plan


def remove_newer(run_dir: Path, step: int) -> list[str]:
    """Rank 0, at resume: step folders newer than the resumed step were never registered (or are broken);
    remove them so that nothing half-written lingers. Folders holding files this app never writes are
    moved aside, not deleted. Returns what was done, for the log."""
    done = []
    for folder in step_folders(run_dir):
        if step_of(folder) <= step:
            continue
        names = {p.name for p in folder.iterdir()}
        why = problem(folder)
        if why is None:  # complete: never thrown away, only set aside where a later resume does not look
            aside = move_aside(folder, "complete")
            done.append(
                f"moved {folder.name} aside to {aside.name}: complete, but newer than the checkpoint resumed from"
            )
        elif all(n in OUR_NAMES or n.startswith("rng-rank") for n in names):
            shutil.rmtree(folder)
            done.append(f"removed {folder.name}, newer than the checkpoint resumed from: {why}")
        else:
            aside = move_aside(folder, "foreign")
            done.append(f"moved {folder.name} aside to {aside.name} (it holds files this app does not write)")
    return done


# --- 3. every rank: load ------------------------------------------------------------------------------------


def resume(engine, registered, run_dir: Path, rank: int, world: int) -> dict[str, Any]:
    """All ranks: choose the checkpoint (rank 0 decides, the others follow), clean up newer unregistered
    folders, load it, and log where the run resumes and which steps are redone. Returns the position."""
    import torch.distributed as dist

    run_dir = Path(run_dir)
    registered_path = Path(registered.path) if registered else None
    plan = _broadcast(_decide_on_rank0(run_dir, registered_path) if rank == 0 else LoadPlan(), world)
    if plan.error:
        raise CheckpointError(plan.error)
    for warning in plan.warnings:
        log.warning(f"WARNING: {warning}")
    if rank == 0:
        for line in remove_newer(run_dir, step_of(Path(plan.checkpoint)) if plan.checkpoint else -1):
            log.warning(f"WARNING: {line}")
    if dist.is_initialized() and world > 1:
        dist.barrier()
    if plan.checkpoint is None:
        return {"epoch": 0, "step_in_epoch": 0, "global_step": 0}
    chosen = Path(plan.checkpoint)
    started = time.perf_counter()
    position = restore(engine, chosen, rank, world)
    position["resumed_from"] = str(chosen)
    position["load_s"] = round(time.perf_counter() - started, 2)
    s, last_step = position["global_step"], plan.last_logged_step
    if last_step is not None and last_step > s:
        redone = f"steps {s + 1}..{last_step} ({last_step - s}) that the previous attempt had done are redone"
    else:
        redone = "no step is redone"
    if registered_path == chosen:
        source = "registered by Ray"
    elif registered_path is not None and step_of(chosen) > step_of(registered_path):
        source = "complete, newer than Ray's latest"
    else:
        source = "fallback"
    log.info(
        f"resumed from {chosen} ({source}) at global step {s} (epoch {position['epoch']}, "
        f"step {position['step_in_epoch']} of the epoch), loaded in {position['load_s']:.1f}s; {redone}"
    )
    return position


def restore(engine, path: Path, rank: int, world: int) -> dict[str, Any]:
    """Load engine, optimizer and scheduler states; return the trainer state saved with them.

    A checkpoint written by another number of workers, at another ZeRO stage, or with the optimizer's parameters
    grouped otherwise (`_regrouped`) is converted once to DeepSpeed's universal checkpoint format (into
    `<checkpoint>/universal/`) and loaded from there. If loading fails, the checkpoint is marked unloadable so that the
    next attempt (Ray's max_failures) or the next deploy falls back to the previous complete checkpoint instead of
    failing the same way again (not after a conversion: the checkpoint as written is not at fault)."""
    state = read_state(path)
    saved_world = state.get("world_size") or world
    saved_stage = state.get("zero_stage", engine.zero_optimization_stage())
    restaged = saved_stage != engine.zero_optimization_stage()
    regrouped = not restaged and _regrouped(engine, path, state)
    universal = saved_world != world or restaged or regrouped
    tag = _universal_tag(engine, path, state, rank, world, regrouped) if universal else TAG
    # The loaded groups' settings may land on other groups: ZeRO-3 gives every group the first saved one's, and another
    # stage or layout groups the parameters otherwise. The config's weight decay per group stays, and where the groups
    # differ, the scheduler's position is loaded fitted to this run's groups (its per-group lists would not fit).
    decay = [group.get("weight_decay") for group in engine.optimizer.param_groups]
    refit = restaged or regrouped
    try:
        _load(engine, path, tag, universal, refit)
        if universal:
            for group, weight_decay in zip(engine.optimizer.param_groups, decay):
                group["weight_decay"] = weight_decay
        if refit and engine.lr_scheduler is not None:
            groups = len(engine.optimizer.param_groups)
            engine.lr_scheduler.load_state_dict(formats.scheduler_state(path / tag, groups))
    except Exception as exc:
        raise _load_error(exc, path, tag, rank, _written_with(state, regrouped) if universal else None) from exc
    if universal and rank == 0 and restaged:
        log.info(_stage_change_line(engine, path, tag, state))
    if universal and rank == 0 and regrouped:
        log.info(
            f"{path.name} was written at ZeRO stage 3 before the optimizer's parameter groups were fixed (every weight "
            f"in the group without weight decay, so train.weight_decay did nothing): loaded it through DeepSpeed's "
            f"universal checkpoint format ({path / tag}) into this run's groups, weights, Adam moments, step count and "
            f"schedule kept; {_weight_decay(decay)}"
        )
    if universal and rank == 0 and saved_world != world:
        log.info(
            f"{path.name} was written by {saved_world} workers and this run has {world}: loaded it through "
            f"DeepSpeed's universal checkpoint format ({path / tag}); global batch {engine.train_batch_size()} "
            f"= {engine.train_micro_batch_size_per_gpu()} x {engine.gradient_accumulation_steps()} accumulation "
            f"x {world} workers (was {state.get('micro_batch_size')} x {state.get('gradient_accumulation_steps')} "
            f"x {saved_world})"
        )
    if saved_world == world and rng_file(path, rank).exists():  # the same ranks: each its own RNG streams
        _set_rng_state(torch.load(rng_file(path, rank), weights_only=False))
    return state


def _regrouped(engine, path: Path, state: dict[str, Any]) -> bool:
    """Whether a ZeRO-3 checkpoint resumed at stage 3 has other optimizer groups than this run's, so that DeepSpeed's
    load, which restores each group's flat partition as it was saved, cannot take it. Checkpoints without the record of
    app.model.DECAY_GROUPS_LAYOUT were written with one group where the model was built partitioned (every weight
    undecayed); a LoRA run's adapters, built whole, had this run's groups: judged from the checkpoint's own groups."""
    from app.model import DECAY_GROUPS_LAYOUT

    if state.get("decay_groups") == DECAY_GROUPS_LAYOUT or engine.zero_optimization_stage() != 3:
        return False
    saved = formats.saved_groups(path / TAG)  # None: no model-states file, which DeepSpeed's own load then reports
    return saved is not None and saved != formats.engine_groups(engine)


def _weight_decay(decay: list) -> str:
    """What the new groups change, by the weight decay of the decayed group as the config sets it (the other's: 0)."""
    rate = max((d for d in decay if d is not None), default=0.0)
    if not rate:
        return "train.weight_decay is 0, so the updates are as before"
    return f"train.weight_decay={rate:g} applies to the weights from this step on"


def _load(engine, path: Path, tag: str, universal: bool, refit: bool) -> None:
    """DeepSpeed's load, or at stage 0 from a universal folder (which DeepSpeed cannot read there), the app's."""
    if universal and engine.zero_optimization_stage() == 0:
        formats.load_universal_stage0(engine, path / tag)
        return
    with formats.loading_universal(engine, universal):
        load_path, _ = engine.load_checkpoint(
            str(path),
            tag=tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=not refit,  # fitted to this run's groups (restore)
            load_module_strict=not lora.is_lora(engine.module),  # LoRA: the adapters only (app.lora)
        )
    if load_path is None:
        raise RuntimeError("DeepSpeed found nothing to load")


def _stage_change_line(engine, path: Path, tag: str, state: dict[str, Any]) -> str:
    """The one line that says a resume changed the ZeRO stage, how it was loaded, and whether the master weights
    changed precision (the trainer state records train.pure_bf16; older checkpoints do not)."""
    saved_stage, stage = state.get("zero_stage"), engine.zero_optimization_stage()
    line = (
        f"{path.name} was written at ZeRO stage {saved_stage} and this run has stage {stage}: loaded it through "
        f"DeepSpeed's universal checkpoint format ({path / tag})"
    )
    if 0 in (saved_stage, stage):
        line += ", converted by the app (stage 0's optimizer, saved whole), weights, Adam moments and step count kept"
    if not isinstance(state.get("pure_bf16"), bool):
        return line
    was, now = "bfloat16" if state["pure_bf16"] else "float32", formats.master_dtype(engine)
    if now == was:
        return line + f"; precision unchanged (master weights in {now})"
    how = (
        "exact: every bf16 value is one in fp32"
        if now == "float32"
        else "weights and Adam moments rounded to bf16, the optimizer state otherwise kept"
    )
    return line + f"; precision changed: master weights {was} -> {now} ({how})"


def _universal_tag(engine, path: Path, state: dict[str, Any], rank: int, world: int, regrouped: bool = False) -> str:
    """Convert (rank 0, once) and return the tag to load; the engine must keep the checkpoint's global batch."""
    import torch.distributed as dist

    saved_world = state.get("world_size") or world
    recorded = {"micro_batch_size", "gradient_accumulation_steps"} <= state.keys()  # older checkpoints lack them
    micro = engine.train_micro_batch_size_per_gpu()
    replicas = engine.train_batch_size() // (micro * engine.gradient_accumulation_steps())  # world / sequence_parallel
    keeps = engine.gradient_accumulation_steps() == accumulation_for(state, micro, replicas)
    if recorded and not keeps:
        saved_batch = state.get("micro_batch_size", 0) * state.get("gradient_accumulation_steps", 0) * saved_world
        raise CheckpointError(
            f"{path} was written by {saved_world} workers with a global batch of {saved_batch}; this run of {world} "
            f"workers has a global batch of {engine.train_batch_size()}, so it cannot resume at the same sample. "
            "Deploy with the same number of workers, or a micro-batch and accumulation that keep the global batch"
        )
    try:
        names = _stage0_names(engine) if state.get("zero_stage") == 0 else None
        tag = to_universal(path, rank, len(engine.optimizer.param_groups), names)
    except Exception as exc:
        raise CheckpointError(
            f"converting {path} (written with {_written_with(state, regrouped)}) to DeepSpeed's universal checkpoint "
            f"format failed: {type(exc).__name__}: {exc}. Deploy with {_written_with(state, regrouped)} to resume "
            "without conversion"
        ) from exc
    finally:
        if dist.is_initialized():
            dist.barrier()
    if not (path / tag).is_dir():
        raise CheckpointError(f"rank 0 could not convert {path} to the universal checkpoint format (see its log)")
    return tag


def _written_with(state: dict[str, Any], regrouped: bool = False) -> str:
    """The workers and ZeRO stage a checkpoint was written with, as a deploy would set them; `regrouped`: and the
    app's version whose optimizer grouped the parameters as it does (before app.model.DECAY_GROUPS_LAYOUT 2)."""
    stage = state.get("zero_stage")
    workers = f"scaling.num_workers={state.get('world_size', '?')}"
    written = workers + (f" and deepspeed.zero_optimization.stage={stage}" if stage is not None else "")
    return written + (" on the app's image that wrote it (one optimizer group at ZeRO-3)" if regrouped else "")


def _load_error(exc: Exception, path: Path, tag: str, rank: int, universal_from: str | None) -> CheckpointError:
    if universal_from is not None:  # not the checkpoint's fault as far as we know: leave it usable as it was written
        return CheckpointError(
            f"could not load {path / tag} (universal format) on rank {rank}: "
            f"{type(exc).__name__}: {exc}. Deploy with {universal_from} to resume"
        )
    try:
        (path / UNLOADABLE).write_text(f"rank {rank}: {type(exc).__name__}: {exc}\n")
    except OSError:
        pass
    return CheckpointError(
        f"could not load checkpoint {path} on rank {rank}: {type(exc).__name__}: {exc}. It is "
        "marked unloadable: the next attempt or deploy falls back to the previous complete "
        "checkpoint"
    )


def _stage0_names(engine) -> list[list[str]]:
    """The parameter names of a stage-0 optimizer's groups, in order: `build_optimizer`'s groups over the whole
    parameters (DeepSpeed drops an empty group)."""
    from app.model import decay_groups

    return [[name for name, _ in group] for group in decay_groups(engine.module) if group]


def to_universal(path: Path, rank: int, groups: int = 1, stage0_names: list[list[str]] | None = None) -> str:
    """Rank 0 converts `<path>/ds` to `<path>/universal` once (atomically: a temp folder renamed into place; the
    checkpoint itself is only read); returns the tag to load. A stage-0 checkpoint (`stage0_names`: its optimizer's
    parameter names) is converted by the app, the others by DeepSpeed. The other ranks only return the tag (the caller
    holds a barrier)."""
    out = path / UNIVERSAL
    if rank == 0 and not (out / ".done").exists():
        tmp = path / (UNIVERSAL + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        log.info(f"converting {path / TAG} to DeepSpeed's universal checkpoint format in {out} (once)")
        if stage0_names is not None:
            formats.stage0_to_universal(path / TAG, tmp, stage0_names)
        else:
            formats.convert_to_universal(path / TAG, tmp)
        formats.complete_universal(tmp, groups)
        (tmp / ".done").write_text("ok\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    elif rank == 0:
        formats.complete_universal(out, groups)  # converted for another stage, or before this was done
    return UNIVERSAL


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
