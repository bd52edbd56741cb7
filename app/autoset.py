"""The auto settings of a training config, settled: the ZeRO stage, pure bf16, activation checkpointing and the
micro-batch that a config leaves to "auto" become values once, in the driver's pass before any cluster starts
(`driver.prepare`), so that the resume plan and contract, every check, the DeepSpeed config and the workers read a
concrete config and never "auto".

On GPUs the choice is app/resolve.py's, from the GPU count (scaling.num_workers), each GPU's memory
(scaling.gpu_memory, which `finetune validate --gpu-memory` sets; else what the cluster tells `finetune train`), the
model's config, the method and seq_length; its reasons are the run's start-up lines. On CPUs (tests, the laptop
path) the choice is fixed (CPU_DEFAULTS), without the memory model. A redeploy over an experiment's checkpoints keeps
what they depend on: the pure bf16 its contract recorded (unless --accept-changed names it), and the micro-batch whose
batches the resume position counts, each as long as it fits; the ZeRO stage is chosen afresh (a resume at another
stage converts the checkpoint, stage 0 included).

Where no choice can be made (`validate` or `prepare` without the GPUs' memory, or without the model's config
offline), stand-ins take the fields' place for the checks and a note says so; `finetune train` refuses instead,
naming scaling.gpu_memory. A GPU config whose memory is known is checked even when it sets every field itself: an
explicit value wins and is only checked.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app import contract, preflight, resolve
from app.config import AUTO_FIELDS, BEFORE_AUTO, TrainingConfig, value_at, with_values
from app.errors import Problem

STAGE, PURE, CKPT, MICRO = FIELDS = AUTO_FIELDS
# CPU workers (scaling.use_gpu false) take what the CPU examples ran before "auto" existed: ZeRO-3, fp32 master
# weights, no recomputation, one sequence a micro-batch. The same values stand in for the checks where a GPU choice
# cannot be made yet: ZeRO-3 keeps every key of the deepspeed block, micro-batch 1 asks the least of the data.
CPU_DEFAULTS = BEFORE_AUTO
# Each GPU's memory (nvidia-smi's total, MiB) by Ray's accelerator_type, where the type has one size; where it has
# several (H100 PCIe/SXM 80 GB and NVL 94 GB; A100 40 and 80 GB), the smallest.
ACCELERATOR_MIB = {
    "H100": 81_559,
    "H200": 143_771,
    "H20": 97_871,
    "B200": 183_359,
    "A100": 40_960,
    "A100-40G": 40_960,
    "A100-80G": 81_920,
    "L40S": 46_068,
    "L4": 23_034,
    "A10G": 23_028,
}


@dataclass(frozen=True)
class Hardware:
    """How `finetune train` learns the GPUs' memory when scaling.gpu_memory is unset: `detect()` returns (bytes,
    where it came from) or None. `strict`: unknown memory is a problem (train), not a note (validate, prepare)."""

    detect: Callable[[], tuple[int, str] | None] | None = None
    strict: bool = False


@dataclass
class Kept:
    """What a field left to auto keeps: {field: (value, why)} (a micro-batch the deepspeed block sets; over an
    experiment's checkpoints what they depend on), and the newest checkpoint's name."""

    values: dict[str, tuple[Any, str]] = field(default_factory=dict)
    checkpoint: str = ""
    resumed_batch: bool = (
        False  # the micro-batch is the checkpoint's: halving it (accumulation doubled) keeps its batch
    )


@dataclass
class Settled:
    """The concrete config, the lines that say what was chosen and why, the problems (a choice that cannot fit,
    memory that cannot be known), whether stand-ins took the fields' place (and the note that says why), and the
    model config as read here (preflight.read_model_config's answer, passed on so that the checks do not read it
    again)."""

    config: TrainingConfig
    auto: tuple[str, ...] = ()
    lines: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    note: str | None = None
    model: tuple[Any, list[Problem], str | None] | None = None
    resolved: resolve.Resolved | None = None
    standing_in: tuple[str, ...] = ()  # the fields whose stand-ins the checks used

    @property
    def values(self) -> dict[str, Any]:
        """What each field left to auto became."""
        return {path: value_at(self.config, path) for path in self.auto}


def auto_fields(cfg: TrainingConfig) -> tuple[str, ...]:
    return tuple(path for path in FIELDS if value_at(cfg, path) == "auto")


def settle(
    cfg: TrainingConfig, offline: bool = True, accepted: tuple[str, ...] = (), hardware: Hardware | None = None
) -> Settled:
    """`cfg` with its auto settings chosen (see the module's docstring); `accepted`: train's --accept-changed."""
    hardware = hardware or Hardware()
    auto = auto_fields(cfg)
    if not cfg.scaling.use_gpu:
        return _on_cpus(cfg, auto, kept_choices(cfg, auto, accepted)) if auto or long_auto(cfg) else Settled(cfg)
    memory, where = gpu_memory(cfg, hardware if auto or long_auto(cfg) else Hardware())
    if not auto and memory is None:  # nothing to choose, and nothing to check the explicit values against
        return Settled(with_values(cfg, long_off(cfg)) if long_auto(cfg) else cfg)
    kept = kept_choices(cfg, auto, accepted)
    model = preflight.read_model_config(cfg, offline)
    if memory is None or model[0] is None:
        note = _unknown(auto, hardware, memory is None, model)
        missing = [_memory_problem(auto, hardware)] if memory is None and hardware.strict else []
        return _stand_ins(cfg, auto, kept, model, note, missing)
    try:
        shape = resolve.shape_from_config(model[0])
        if cfg.preference is not None:
            raise _unmodelled_preference(cfg)
    except Problem as problem:
        if not auto:  # explicit settings are the user's to judge on a model the memory model does not cover
            return Settled(cfg, lines=[f"GPU memory not predicted: {problem.message}"], model=model)
        return _stand_ins(cfg, auto, kept, model, None, [problem])
    resolved = _resolve(cfg, shape, liger(cfg, model[0]), memory, kept)
    values = {path: getattr(resolved, ATTRIBUTES[path]).value for path in auto}
    values |= {LONG: resolve.long_values(resolved)} if long_auto(cfg) else {}
    values |= {path: v for path, (v, _) in kept.values.items() if path not in FIELDS}  # a kept batch's accumulation
    given = cfg.scaling.gpu_memory if where == "scaling.gpu_memory" else f"{memory / resolve.GIB:.1f}GiB"
    problems = [_named(p, where, given) if p.field == GPU_FIGURE else p for p in resolved.problems]
    lines = [f"settings for {resolved.gpus} GPU(s) of {resolved.gpu_memory / resolve.GIB:.1f} GiB ({where}):"]
    lines += [f"  {line}" for line in resolve.describe(dataclasses.replace(resolved, problems=[]))]
    return Settled(with_values(cfg, values), auto, lines, problems, None, model, resolved)


GPU_FIGURE = "GPU memory (GiB)"  # the field of app.resolve's "does not fit" problem
ATTRIBUTES = {STAGE: "zero_stage", PURE: "pure_bf16", CKPT: "gradient_checkpointing", MICRO: "micro_batch_size"}


def _on_cpus(cfg: TrainingConfig, auto: tuple[str, ...], kept: Kept) -> Settled:
    values = _fixed(auto, kept) | long_off(cfg)
    shown = ", ".join([*(_said(path, values[path]) for path in auto), *([LONG_OFF_SAID] if long_auto(cfg) else [])])
    lines = [f"auto settings on CPU workers (scaling.use_gpu: false), fixed, without the GPU memory model: {shown}"]
    lines += [f"  {path}: {v} - {why}" for path, (v, why) in kept.values.items()]
    return Settled(with_values(cfg, values), auto, lines)


def _said(path: str, v: Any) -> str:
    return {
        STAGE: f"ZeRO stage {v}",
        PURE: "pure bf16" if v else "fp32 master weights",
        CKPT: f"activation checkpointing {'on' if v else 'off'}",
        MICRO: f"micro-batch {v}",
    }[path]


def _fixed(auto: tuple[str, ...], kept: Kept) -> dict[str, Any]:
    """CPU_DEFAULTS for the fields left to auto, the kept values first."""
    values = {path: kept.values[path][0] if path in kept.values else CPU_DEFAULTS[path] for path in auto}
    return values | {path: v for path, (v, _) in kept.values.items() if path not in FIELDS}


def _stand_ins(
    cfg: TrainingConfig,
    auto: tuple[str, ...],
    kept: Kept,
    model: tuple[Any, list[Problem], str | None],
    note: str | None,
    problems: list[Problem],
) -> Settled:
    standing_in = tuple(path for path in auto if path not in kept.values)
    values = _fixed(auto, kept) | long_off(cfg)
    return Settled(with_values(cfg, values), auto, [], problems, note, model, standing_in=standing_in)


LONG = "model.long_sequence"
LONG_OFF_SAID = "tiled MLP, tiled loss and offloaded checkpoints off"


def long_auto(cfg: TrainingConfig) -> bool:
    """Whether a switch of model.long_sequence is left to auto."""
    return resolve.long_ask(cfg.model.long_sequence).auto


def long_off(cfg: TrainingConfig) -> dict[str, Any]:
    """model.long_sequence with its auto switches off (CPU workers; where no choice can be made), the explicit ones
    kept; nothing when none is auto."""
    if not long_auto(cfg):
        return {}
    ask = resolve.long_ask(cfg.model.long_sequence)
    return {
        LONG: {
            "tiled_mlp": bool(ask.tiled_mlp),
            "tiled_loss": bool(ask.tiled_loss),
            "offload_checkpoints": ask.offload or 0,
        }
    }


def _unknown(auto: tuple[str, ...], hardware: Hardware, no_memory: bool, model: tuple) -> str | None:
    """The note of stand-ins; None when the model config could not be read from a folder (the checks say why)."""
    fields = ", ".join(auto)
    if no_memory:
        why = "scaling.gpu_memory is unset" + ("" if hardware.detect is None else " and the cluster did not tell it")
        return (
            f"{fields} left to auto are not chosen: {why} (--gpu-memory 80GiB chooses them for such GPUs); shown as "
            "auto, and checked with ZeRO-3, fp32 master weights, no checkpointing and micro-batch 1"
        )
    return f"{fields} left to auto are chosen when the run starts, from the model's config" if model[2] else None


def _memory_problem(auto: tuple[str, ...], hardware: Hardware) -> Problem:
    return Problem(
        "scaling.gpu_memory",
        None,
        f"{', '.join(auto)} are auto and each GPU's memory is unknown: no GPU is visible here and the cluster's GPU "
        "type is not one app/autoset.py knows",
        "set scaling.gpu_memory (e.g. 80GiB; in the chart workers.<group>.gpuMemory), or set those fields explicitly",
    )


def gpu_memory(cfg: TrainingConfig, hardware: Hardware) -> tuple[int | None, str]:
    """Each GPU's memory in bytes and where it came from: scaling.gpu_memory, else `hardware.detect()`."""
    if cfg.scaling.gpu_memory:
        return resolve.parse_memory(cfg.scaling.gpu_memory), "scaling.gpu_memory"
    found = hardware.detect() if hardware.detect else None
    return found if found else (None, "")


def host_memory(cfg: TrainingConfig) -> tuple[int | None, str]:
    """Each GPU worker's share of host memory in bytes and where it came from: scaling.host_memory; else, where the
    run starts its own Ray cluster (no RAY_ADDRESS), this machine's memory or its cgroup's limit, the smaller,
    divided by the workers (all of them on this machine); else unknown (None)."""
    if cfg.scaling.host_memory:
        return resolve.parse_memory(cfg.scaling.host_memory), "scaling.host_memory"
    if os.environ.get("RAY_ADDRESS"):
        return None, "unknown on a joined cluster (scaling.host_memory unset)"
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [physical]
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    workers = cfg.scaling.num_workers
    return min(limits) // workers, "this machine's memory" + (f" over {workers} workers" if workers > 1 else "")


def memory_of_types(types: list[str]) -> tuple[int, str] | None:
    """The smallest memory of Ray accelerator types (ACCELERATOR_MIB); None when one is not in the table."""
    sizes = [ACCELERATOR_MIB.get(kind) for kind in types]
    if not sizes or None in sizes:
        return None
    return min(sizes) * 2**20, f"the cluster's {'/'.join(sorted(set(types)))} GPUs"


def _unmodelled_preference(cfg: TrainingConfig) -> Problem:
    return Problem(
        "preference",
        cfg.preference.loss,
        "preference training (two answers a row, a reference model) is not in app/resolve.py's memory model, so "
        "its settings cannot be left to auto on GPUs",
        "set deepspeed.zero_optimization.stage, train.pure_bf16, model.gradient_checkpointing and "
        "train.micro_batch_size explicitly",
    )


def _named(problem: Problem, where: str, given: str) -> Problem:
    """The resolver's 'does not fit' under the setting the memory came from."""
    name = where if where == "scaling.gpu_memory" else f"GPU memory ({where})"
    return Problem(name, given, problem.message, problem.fix)


# --- the choice, and what a resumed experiment keeps --------------------------------------------------------


# Model types Liger patches (liger_kernel's MODEL_TYPE_TO_APPLY_LIGER_FN, in part): known without importing it, which
# took the driver 0.9 s of its start-up on an H100 host (its Triton ops and every patched model's modelling code;
# record 2026-12-06-driver-profile-h100.txt); only another type is looked up in liger_kernel's own table.
LIGER_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"})


def liger(cfg: TrainingConfig, model_config: Any) -> bool:
    """Whether Liger's kernels will patch this model on the workers. Required (true): for a model type Liger knows
    (the run fails without it). auto: where liger-kernel is installed here (the image has it; where this process
    lacks it the workers are taken to lack it too, which errs towards more memory)."""
    wanted, model_type = cfg.model.liger_kernels, getattr(model_config, "model_type", None)
    if wanted is False or (wanted == "auto" and importlib.util.find_spec("liger_kernel") is None):
        return False
    if model_type in LIGER_TYPES:
        return True
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # noqa: BLE001 - not importable here
        return model_type in LIGER_TYPES
    return model_type in MODEL_TYPE_TO_APPLY_LIGER_FN


def _resolve(cfg: TrainingConfig, shape: resolve.Shape, liger_on: bool, memory: int, kept: Kept) -> resolve.Resolved:
    """The resolver's choice with the kept values fixed (their reasons said). A kept micro-batch that no longer fits
    is halved and the accumulation doubled while the global batch stays whole; a kept value that cannot fit at all
    is chosen afresh (the contract or the resume plan then refuses the change, with its own fix). The ZeRO stage is
    chosen afresh: a resume at another stage converts the checkpoint (app.checkpoint.ResumePlan), stage 0 included."""
    base = resolve.request_from_config(cfg, liger_on)
    base = dataclasses.replace(base, host_memory=host_memory(cfg)[0])
    request = dataclasses.replace(base, **{ATTRIBUTES[p]: v for p, (v, _) in kept.values.items() if p in FIELDS})
    gpus = cfg.scaling.num_workers
    resolved = resolve.resolve(shape, gpus, memory, request)
    while not resolved.fits and kept.resumed_batch and request.micro_batch_size % 2 == 0:
        request = dataclasses.replace(
            request,
            micro_batch_size=request.micro_batch_size // 2,
            gradient_accumulation_steps=request.gradient_accumulation_steps * 2,
        )
        resolved = resolve.resolve(shape, gpus, memory, request)
        why = f"{kept.values[MICRO][1].split(';')[0]}; halved to fit, the accumulation doubled to keep its batch"
        kept.values[MICRO] = (request.micro_batch_size, why)
        kept.values["train.gradient_accumulation_steps"] = (request.gradient_accumulation_steps, why)
    if not resolved.fits and kept.values and resolve.resolve(shape, gpus, memory, base).fits:
        kept.values.clear()
        resolved = resolve.resolve(shape, gpus, memory, base)
    return _with_reasons(resolved, kept)


def _with_reasons(resolved: resolve.Resolved, kept: Kept) -> resolve.Resolved:
    """The kept fields' choices as auto's, with the reason they were kept."""
    changes = {
        ATTRIBUTES[path]: resolve.Choice(getattr(resolved, ATTRIBUTES[path]).value, why)
        for path, (_, why) in kept.values.items()
        if path in FIELDS
    }
    return dataclasses.replace(resolved, **changes)


def kept_choices(cfg: TrainingConfig, auto: tuple[str, ...], accepted: tuple[str, ...]) -> Kept:
    """What the fields left to auto keep (Kept); nothing when none is."""
    kept = Kept()
    block = cfg.deepspeed.train_micro_batch_size_per_gpu
    if MICRO in auto and isinstance(block, int):
        kept.values[MICRO] = (block, "deepspeed.train_micro_batch_size_per_gpu sets it")
    if not auto or cfg.experiment.name is None:  # unnamed: a new experiment, no checkpoint yet
        return kept
    from app.checkpoint.layout import newest_usable, read_state

    latest = newest_usable(cfg.experiment_dir)
    if latest is None:
        return kept
    kept.checkpoint = latest.name
    recorded = (contract.read(cfg.experiment_dir) or {}).get("depends_on", {})
    if PURE in auto and PURE not in accepted and isinstance(recorded.get(PURE), bool):
        why = f"kept: the experiment's checkpoints were trained with it (contract.json; --accept-changed {PURE} "
        kept.values[PURE] = (recorded[PURE], why + "chooses again)")
    try:
        state = read_state(latest)
    except (OSError, ValueError):
        return kept
    if MICRO in auto and MICRO not in kept.values and isinstance(state.get("micro_batch_size"), int):
        why = f"kept from {latest.name}: the resume position counts its batches"
        kept.values[MICRO], kept.resumed_batch = (state["micro_batch_size"], why), True
    return kept


# --- what validate prints -------------------------------------------------------------------------------------


def shown_config(cfg: TrainingConfig, settled: Settled) -> dict[str, Any]:
    """The config as validate prints it: the fields whose stand-ins the checks used, as auto."""
    doc = cfg.model_dump(mode="json")
    for path in settled.standing_in:
        *parents, leaf = path.split(".")
        node = doc
        for part in parents:
            node = node[part]
        node[leaf] = "auto"
    return doc


def shown_ds(ds: dict[str, Any], settled: Settled) -> dict[str, Any]:
    """The DeepSpeed config as validate prints it: what a stand-in decided, as auto (pure bf16 shows as fp32 master
    weights, the note says so)."""
    out = {**ds, "zero_optimization": dict(ds.get("zero_optimization", {}))}
    if STAGE in settled.standing_in:
        out["zero_optimization"]["stage"] = "auto"
    if MICRO in settled.standing_in:
        out["train_micro_batch_size_per_gpu"] = out["train_batch_size"] = "auto"
    return out
