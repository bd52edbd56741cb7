"""The only module that touches Ray's or DeepSpeed's private formats. tests/test_reliability.py
(`test_private_formats_match_the_pinned_versions`) fails when the pinned Ray or DeepSpeed changes them.

- Ray Train's checkpoint manager snapshot (`checkpoint_manager_snapshot.json`, Ray's `_CheckpointManagerState`):
  Ray refuses to start a run whose snapshot names a missing folder, so it is repaired before Ray starts.
- DeepSpeed's checkpoint engine: `engine.save_checkpoint` hands every file to `engine.checkpoint_engine.save`; a
  background save swaps in its own engine for that one call.
- DeepSpeed's universal checkpoint: `ds_to_universal.main` takes its command line as a Namespace, and the engine
  loads a universal checkpoint only when its private `_config.load_universal_checkpoint` is set. It reads the
  weights from the converted fp32 files, and only metadata (step counts, the scheduler) from a model-states file
  whose name depends on the loading engine's stage, and the converter's layouts for stage 3 and for stages 0-2 differ
  (`complete_universal` fills in each from the other).
- DeepSpeed's stage-0 checkpoint: no ZeRO partitions, which its converter reads, and no universal reader at stage 0;
  the whole optimizer is a torch state_dict in the one model-states file. `stage0_to_universal` and
  `load_universal_stage0` convert it to and from the universal folder, so that a redeploy may change the stage to or
  from 0.
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


# The model-states file an engine looks for in a universal folder: stage 3 (weights partitioned) asks for data-parallel
# rank 0's, stages 0-2 for the single one; the converter keeps the name the checkpoint was written with.
MODEL_STATES_NAMES = ("zero_pp_rank_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt")
OPTIMIZER_STATE = Path("zero") / "optimizer_state.pt"  # the optimizer's global state in a universal folder


def saved_groups(folder: Path) -> list[list[str]] | None:
    """The parameter names of each flat group of the optimizer that wrote the DeepSpeed checkpoint `folder` (its `ds/`),
    in order, as its model-states file records them (`param_shapes`, which DeepSpeed's own converters read; at stage 3
    its sub-groups); None where it has no model-states file. Memory-mapped: only the small metadata is read."""
    import torch
    from deepspeed.checkpoint.constants import PARAM_SHAPES

    name = next((name for name in MODEL_STATES_NAMES if (folder / name).is_file()), None)
    if name is None:
        return None
    states = torch.load(folder / name, map_location="cpu", weights_only=False, mmap=True)
    return [list(shapes) for shapes in states.get(PARAM_SHAPES) or []]


def engine_groups(engine) -> list[list[str]]:
    """What `saved_groups` reads from a checkpoint, for `engine`'s optimizer as it is: the groups it would save."""
    return [list(shapes) for shapes in engine._get_zero_param_shapes()]


def complete_universal(folder: Path, groups: int = 1) -> list[str]:
    """Makes a converted universal folder loadable at any ZeRO stage, whichever stage wrote the checkpoint, by an
    optimizer of `groups` parameter groups. DeepSpeed's converter writes a stage-3 checkpoint in the layout its
    stage-3 reader expects and a stage 0-2 one in the layout the other readers expect; they differ in five places,
    each filled in here from what the folder holds: the model-states file's name (stage 3 asks for data-parallel
    rank 0's, stages 0-2 for the single one: a hard link, else a copy); each parameter's states as {"param": tensor}
    (stage 3 writes bare tensors, which stages 0-2 cannot index; stage 3 reads both); the Adam step as `step.pt`
    beside them (stages 0-2) and in the optimizer's global state (stage 3 reads it there); the parameter groups
    (stages 0-2 read group i's parameters only where the saved state has a group i; a ZeRO-3 checkpoint of the app's
    first grouping, app.model.DECAY_GROUPS_LAYOUT, has one); and the
    DeepSpeed version, which stages 0-2 assert. Every file is written under a temporary name and renamed. Returns
    what it added, for the log."""
    present = [name for name in MODEL_STATES_NAMES if (folder / name).is_file()]
    if not present:
        return []
    added = []
    for name in MODEL_STATES_NAMES:
        if name not in present:
            tmp = folder / (name + ".tmp")
            tmp.unlink(missing_ok=True)
            try:
                os.link(folder / present[0], tmp)
            except OSError:
                shutil.copy2(folder / present[0], tmp)
            os.replace(tmp, folder / name)
            added.append(name)
    if (folder / OPTIMIZER_STATE).is_file():
        added += _complete_optimizer_states(folder, folder / present[0], groups)
    return added


def _complete_optimizer_states(folder: Path, model_states: Path, groups: int) -> list[str]:
    import torch
    from deepspeed.checkpoint.constants import DS_VERSION, OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

    def save(value, path: Path) -> None:
        torch.save(value, path.with_name(path.name + ".tmp"))
        os.replace(path.with_name(path.name + ".tmp"), path)

    optimizer = torch.load(folder / OPTIMIZER_STATE, map_location="cpu", weights_only=False)
    added, step = [], None
    if (inner := optimizer.get(OPTIMIZER_STATE_DICT)) and inner.get("state"):
        step = next(iter(inner["state"].values())).get("step")  # one step for every parameter
    wrapped = 0
    for param in sorted(p for p in (folder / OPTIMIZER_STATE).parent.iterdir() if p.is_dir()):
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            if (param / f"{key}.pt").is_file():
                value = torch.load(param / f"{key}.pt", map_location="cpu", weights_only=False)
                if torch.is_tensor(value):
                    save({PARAM: value}, param / f"{key}.pt")
                    wrapped += 1
        if (param / "step.pt").is_file():
            step = torch.load(param / "step.pt", map_location="cpu", weights_only=False) if step is None else step
        elif step is not None:
            save(step, param / "step.pt")
    if wrapped:
        added.append(f"{wrapped} parameter states as {{'{PARAM}': tensor}}")
    changed = False
    if not optimizer.get(DS_VERSION):
        optimizer[DS_VERSION] = torch.load(model_states, map_location="cpu", weights_only=False).get(DS_VERSION)
        added.append(f"{DS_VERSION} {optimizer[DS_VERSION]} in {OPTIMIZER_STATE}")
        changed = True
    if len(optimizer[PARAM_GROUPS]) < groups:
        # Stages 0-2 load the parameters of group i only where the saved state has a group i, and a ZeRO-3 checkpoint
        # of the first grouping (app.model.DECAY_GROUPS_LAYOUT) has one: repeated, every group of the loading
        # optimizer is read (the app then puts back each group's own weight decay: app.checkpoint.resuming.restore).
        optimizer[PARAM_GROUPS] += [optimizer[PARAM_GROUPS][-1]] * (groups - len(optimizer[PARAM_GROUPS]))
        added.append(f"{groups} parameter groups in {OPTIMIZER_STATE}")
        changed = True
    if OPTIMIZER_STATE_DICT not in optimizer and step is not None:
        optimizer[OPTIMIZER_STATE_DICT] = {"state": {0: {"step": step}}, PARAM_GROUPS: optimizer[PARAM_GROUPS]}
        added.append(f"the step in {OPTIMIZER_STATE}")
        changed = True
    if changed:
        save(optimizer, folder / OPTIMIZER_STATE)
    return added


def stage0_to_universal(src: Path, dst: Path, names: list[list[str]]) -> str:
    """Writes the stage-0 checkpoint in `src` as a universal folder `dst` that stages 1-3 load. Stage 0 saves its whole
    optimizer in its model-states file: a torch optimizer's state_dict, whose entries are numbered across its parameter
    groups (`names`: each group's parameter names in that order, `app.model.decay_groups`), either over the model's own
    parameters (train.pure_bf16 or fp32 training: the module holds the master weights) or inside DeepSpeed's mixed
    precision wrapper (FP16_UnfusedOptimizer), with the fp32 masters beside it (`fp32_groups`). Each parameter's master
    weight, Adam moments and step go to `zero/<name>/` in fp32 (a bf16 value is exact in fp32), as DeepSpeed's converter
    writes a stage 0-2 checkpoint; the groups' settings to `zero/optimizer_state.pt`; the model-states file, without the
    optimizer and module, keeps the step counters and the schedule. Returns the master weights' dtype (bfloat16,
    float32), for the log. Raises ValueError where the optimizer does not match `names`."""
    import torch
    from deepspeed.checkpoint.constants import DS_VERSION, OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

    states = torch.load(src / MODEL_STATES_NAMES[1], map_location="cpu", weights_only=False)
    saved = states.get("optimizer")
    if not saved:
        raise ValueError(f"{src / MODEL_STATES_NAMES[1]} holds no optimizer state")
    mixed = "fp32_groups" in saved
    inner = saved[OPTIMIZER_STATE_DICT] if mixed else saved
    sizes, wanted = [len(group["params"]) for group in inner[PARAM_GROUPS]], [len(group) for group in names]
    if sizes != wanted:
        raise ValueError(f"its optimizer's groups hold {sizes} parameters, this model's {wanted}")
    dtype, step = None, 0.0
    for g, group in enumerate(inner[PARAM_GROUPS]):
        for i, (index, name) in enumerate(zip(group["params"], names[g])):
            master = saved["fp32_groups"][g][i] if mixed else states["module"][name]
            state, dtype = inner["state"].get(index, {}), dtype or master.dtype
            step = float(state.get("step", 0.0))
            folder = dst / "zero" / name
            folder.mkdir(parents=True, exist_ok=True)
            torch.save({PARAM: master.float()}, folder / "fp32.pt")
            for key in ("exp_avg", "exp_avg_sq"):
                moment = state.get(key, torch.zeros_like(master))
                torch.save({PARAM: moment.float().reshape(master.shape)}, folder / f"{key}.pt")
            torch.save(torch.tensor(step), folder / "step.pt")
    global_state = {
        PARAM_GROUPS: inner[PARAM_GROUPS],
        DS_VERSION: states.get(DS_VERSION),
        OPTIMIZER_STATE_DICT: {"state": {0: {"step": torch.tensor(step)}}, PARAM_GROUPS: inner[PARAM_GROUPS]},
    }
    torch.save(global_state, dst / OPTIMIZER_STATE)
    torch.save({**states, "optimizer": None, "module": None}, dst / MODEL_STATES_NAMES[1])
    return str(dtype).removeprefix("torch.")


def load_universal_stage0(engine, folder: Path) -> None:
    """Loads the universal folder `folder` into a stage-0 engine (DeepSpeed's stage-0 optimizers have no universal
    reader: a TypeError in every worker, measured 3 -> 0 with 0.19.8): each parameter's master weight into the
    optimizer's masters (the fp32 copies of DeepSpeed's mixed precision, or the model's own parameters under
    train.pure_bf16 or fp32 training) and into the model, its Adam moments and step into the torch optimizer's state
    (cast to the dtype of the parameters it updates: bf16 under train.pure_bf16), each group's learning rate, and the
    engine's step counters. The schedule is `scheduler_state`'s."""
    import torch
    from deepspeed.checkpoint.constants import PARAM, PARAM_GROUPS

    def read(path: Path):
        value = torch.load(path, map_location="cpu", weights_only=False)
        return value[PARAM] if isinstance(value, dict) else value

    optimizer = engine.optimizer
    mixed = hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups")
    inner = optimizer.optimizer if mixed else optimizer
    names = {id(param): name for name, param in engine.module.named_parameters()}
    state, index = {}, 0
    for g, group in enumerate(inner.param_groups):
        for lp, hp in zip(optimizer.fp16_groups[g] if mixed else group["params"], group["params"]):
            zero = folder / "zero" / names[id(lp)]
            with torch.no_grad():
                hp.copy_(read(zero / "fp32.pt").reshape(hp.shape))
                if lp is not hp:
                    lp.copy_(hp)
            state[index] = {"step": torch.tensor(float(read(zero / "step.pt")))}
            state[index].update({key: read(zero / f"{key}.pt").reshape(hp.shape) for key in ("exp_avg", "exp_avg_sq")})
            index += 1
    inner.load_state_dict({"state": state, PARAM_GROUPS: inner.state_dict()[PARAM_GROUPS]})
    saved_groups = torch.load(folder / OPTIMIZER_STATE, map_location="cpu", weights_only=False)[PARAM_GROUPS]
    for g, group in enumerate(inner.param_groups):  # fewer saved groups (old ZeRO-3): the last serves for the rest
        saved = saved_groups[min(g, len(saved_groups) - 1)]
        group.update({key: saved[key] for key in ("lr", "initial_lr") if key in saved})
    counters = torch.load(folder / MODEL_STATES_NAMES[1], map_location="cpu", weights_only=False)
    engine.global_steps, engine.skipped_steps = counters["global_steps"], counters.get("skipped_steps", 0)
    engine.global_samples = counters.get("global_samples", engine.global_steps * engine.train_batch_size())


def master_dtype(engine) -> str:
    """The dtype an engine's optimizer keeps its master weights in (bfloat16, float32): DeepSpeed's masters at stages
    1-3 (bf16 with bf16_master_weights_and_grads) and under its mixed precision at stage 0, else the parameters the
    optimizer updates (stage 0 with train.pure_bf16: the bf16 model)."""
    optimizer = engine.optimizer
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups"):
        groups = getattr(optimizer, attr, None)
        if groups:
            first = groups[0][0] if isinstance(groups[0], list) else groups[0]
            return str(first.dtype).removeprefix("torch.")
    return str(optimizer.param_groups[0]["params"][0].dtype).removeprefix("torch.")


def scheduler_state(folder: Path, groups: int) -> dict:
    """The learning-rate scheduler's state saved in a universal folder's model-states file, its per-group lists
    fitted to an optimizer of `groups` parameter groups (another ZeRO stage may group them otherwise; the app gives
    every group the same rate and schedule, so the first group's entry serves for each)."""
    import torch

    name = next(name for name in MODEL_STATES_NAMES if (folder / name).is_file())
    state = torch.load(folder / name, map_location="cpu", weights_only=False)["lr_scheduler"]
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        if isinstance(state.get(key), list) and state[key] and len(state[key]) != groups:
            state[key] = [state[key][0]] * groups
    return state


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
