"""Preference tuning on the workers (issue #51): a micro-batch of pairs (app.data.PairCollator) scored by one
forward pass of the policy, the reference model's log-probabilities of the same answers, the loss and TRL's metrics
(app.preference), and the pass that stores the reference log-probabilities before training where no model can give
them during it.

Where the reference comes from (`preference.reference`; the reference-free losses need none):
- `auto` with LoRA: the model itself with its adapters switched off (peft's `disable_adapter`), under no_grad, at
  each step, as TRL does: no second model in memory;
- `auto` with full fine-tuning: the model before its first step. A pass over the prepared splits scores every answer
  once, before any step and before a resume loads its checkpoint, and stores the values beside the prepared data
  (`<storage>/prepared/<key>/reference-<model key>/`, laid out as the data's units), keyed by the model's identity
  and the numerics that change its log-probabilities; a resumed run, or another experiment over the same data and
  model, reads them instead of computing them again;
- a model path: that model, loaded frozen for the same pass and freed before training, stored the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from app.config import ModelConfig, TrainingConfig
from app.data.store import REFERENCE, PreparedSplit, remove_tree, unit_path
from app.ds_config import plain_bf16
from app.errors import Problem
from app.model import load_model, model_source
from app.preference import IGNORE, PreferenceConfig, SequenceLogps, preference_loss, sequence_logps, token_logps

log = logging.getLogger("finetune")
RECORD = "reference.json"  # written last: a reference folder without it is not complete
VERSION = "reference-v1"  # of the pass's code: a change to the values it stores changes it
NOT_MODEL_INPUTS = ("labels", "sequences", "reference")  # the collator's, for the loss: the forward takes no labels


# --- one micro-batch -------------------------------------------------------------------------------------------


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


def scored(logits: torch.Tensor, batch: dict[str, Any], prompts: bool = False) -> tuple[SequenceLogps, Any]:
    """(each answer's log-probability, in the collator's order: chosen, rejected, chosen, ...; with `prompts`, the
    chosen sequences' NLL over their prompts and answers, ORPO's, else None)."""
    sequences, labels = batch["sequences"], batch["labels"]
    count = int(sequences.max()) + 1
    slots = torch.where(sequences >= 0, sequences, count)  # padding into one spare slot, left out below
    targets = torch.where(sequences >= 0, batch["input_ids"], IGNORE) if prompts else labels
    per_token = token_logps(logits, targets)
    answers = sequence_logps(per_token, labels != IGNORE, slots, count + 1)[:count]
    if not prompts:
        return answers, None
    return answers, sequence_logps(per_token, targets != IGNORE, slots, count + 1)[:count:2].nll()


class Objective:
    """The preference loss of a micro-batch; keeps the sums of its metrics until the loop's next progress line."""

    def __init__(self, cfg: PreferenceConfig, adapters_off: Callable[[], Any] | None):
        self.cfg, self.adapters_off = cfg, adapters_off
        self.sums: dict[str, torch.Tensor] = {}
        self.batches = 0

    def cfg_metrics(self) -> list[str]:
        """The names of the metrics this loss logs (the same on every rank, whatever its batches)."""
        names = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
        names += ["logps/chosen", "logps/rejected"]
        if self.cfg.loss == "orpo":
            names += ["nll_loss", "log_odds_ratio", "log_odds_chosen"]
        elif self.cfg.loss == "simpo" and self.cfg.cpo_alpha:
            names.append("nll_loss")
        return names

    def loss(self, engine, batch: dict[str, Any], keep: bool = True):
        """(the loss, its metrics (TRL's names), the tokens the forward read, the pairs scored), over the pairs whose
        answers both have a scored token (EvalShard's repeated samples have none)."""
        inputs = model_inputs(batch)
        reference = batch.get(REFERENCE)
        if self.cfg.needs_reference and reference is None:
            with torch.no_grad(), self.adapters_off():  # first: the policy's graph is the last forward's
                reference = scored(engine(**inputs).logits, batch)[0].summed
        answers, nll = scored(engine(**inputs).logits, batch, prompts=self.cfg.loss == "orpo")
        chosen, rejected = answers[0::2], answers[1::2]
        valid = (chosen.tokens > 0) & (rejected.tokens > 0)
        if not bool(valid.all()):
            chosen, rejected = chosen[valid], rejected[valid]
        pair_reference = None if reference is None else (reference[0::2][valid], reference[1::2][valid])
        loss, metrics = preference_loss(self.cfg, chosen, rejected, pair_reference, nll)
        if keep:
            for name, value in metrics.items():
                self.sums[name] = self.sums.get(name, 0.0) + value.float()
            self.batches += 1
        return loss, metrics, (batch["sequences"] >= 0).sum(), valid.sum()

    def take(self) -> dict[str, torch.Tensor]:
        """Each metric's mean over the micro-batches since the last call (on this rank)."""
        taken = {name: self.sums.get(name, torch.zeros(())) / max(self.batches, 1) for name in self.cfg_metrics()}
        self.sums, self.batches = {}, 0
        return taken


def averaged(values: dict[str, Any], world: int, device) -> dict[str, float]:
    """Each rank's values (tensors or numbers) averaged over `world` ranks (one all-reduce; world 1: summed); every
    rank passes the same names."""
    if not values:
        return {}
    names = sorted(values)
    stacked = torch.stack([torch.as_tensor(values[n], dtype=torch.float32, device=device) for n in names])
    dist.all_reduce(stacked)
    return {name: float(v) / world for name, v in zip(names, stacked.tolist())}


# --- the reference ----------------------------------------------------------------------------------------------


def policy_model(cfg: TrainingConfig) -> ModelConfig:
    """The model training loads: for preference tuning, every dropout of the model off unless model.dropout is set
    (TRL's and LLaMA-Factory's disable_dropout, on by default). The reference (the adapters switched off in the
    training step, or the pass before training, in eval mode) then scores an answer as the policy before its first
    step does: the first step's loss is log 2, and a reward is the policy's move, not two dropout masks' difference."""
    if cfg.preference is None or cfg.model.dropout is not None:
        return cfg.model
    return cfg.model.model_copy(update={"dropout": 0.0})


def reference_source(cfg: TrainingConfig) -> str | None:
    """The model whose log-probabilities a pass before training stores; None when the run needs no pass (no
    reference, or LoRA's own base model)."""
    pref = cfg.preference
    if pref is None or not pref.needs_reference:
        return None
    if pref.reference != "auto":
        return pref.reference
    return None if cfg.model.lora is not None else cfg.model.name_or_path


def model_identity(name_or_path: str, seed: int) -> Any:
    """A local model folder: its files' names, sizes and modification times (as the data's identity); a hub name:
    the name; a random initialisation: its folder and the seed that draws it."""
    source, random_init = model_source(name_or_path)
    folder = Path(os.path.expanduser(source))
    if not folder.is_dir():
        return {"hub": source}
    files = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(folder.iterdir()) if f.is_file()]
    return {"folder": str(folder.resolve()), "files": files, "random_init_seed": seed if random_init else None}


def reference_fields(cfg: TrainingConfig, source: str) -> dict[str, Any]:
    """What the stored values depend on besides the prepared data: the model and the numerics of its forward."""
    return {
        "version": VERSION,
        "model": model_identity(source, cfg.train.seed),
        "precision": cfg.train.precision,
        "pure_bf16": cfg.train.pure_bf16,
        "attn_implementation": cfg.model.attn_implementation,
    }


def reference_folder(cfg: TrainingConfig, prepared: Path, source: str) -> Path:
    key = hashlib.sha256(json.dumps(reference_fields(cfg, source), sort_keys=True).encode()).hexdigest()[:16]
    return prepared / f"reference-{key}"


def setup(cfg: TrainingConfig, engine, ds_config: dict, splits: dict[str, PreparedSplit], where: dict, rank: int):
    """The run's Objective (None without `preference`), its reference in place: the stored values read by the
    splits (computed now, by every rank, when not stored yet), or the adapters switched off."""
    if cfg.preference is None:
        return None
    source = reference_source(cfg)
    if source is None:
        adapters_off = (lambda: engine.module.disable_adapter()) if cfg.preference.needs_reference else None
        return Objective(cfg.preference, adapters_off)
    if "prepared" not in where:
        raise Problem("preference", cfg.preference.loss, "needs prepared data", "prepare the data again")
    folder = reference_folder(cfg, Path(where["prepared"]), source)
    if (folder / RECORD).is_file():
        if rank == 0:
            log.info(f"reference log-probabilities: reusing {folder}")
    else:
        reference_pass(cfg, engine, ds_config, source, splits, folder, rank)
    for split in splits.values():
        split.use_reference(folder)
    return Objective(cfg.preference, None)


def reference_pass(cfg: TrainingConfig, engine, ds_config: dict, source: str, splits, folder: Path, rank: int):
    """Every answer of every split scored by the reference (the policy before its first step, or the model at
    `source`, loaded for this pass), each rank a share of the blocks; rank 0 stores the values."""
    started, world = time.perf_counter(), dist.get_world_size()
    own = source != cfg.model.name_or_path or cfg.model.lora is not None
    forward = reference_engine(cfg, ds_config, source) if own else engine
    forward.eval()
    from app.data.loader import PairCollator

    collate = PairCollator(splits["train"].eos, cfg.data.packing)
    try:
        with torch.no_grad():
            found = {
                name: _score(forward, split, collate, rank, world, cfg.train.micro_batch_size)
                for name, split in splits.items()
            }
    finally:
        if own:
            del forward
        else:
            engine.train()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, found)
    if rank == 0:
        answers = _store(folder, splits, gathered, reference_fields(cfg, source))
        log.info(
            f"reference log-probabilities of {answers:,} answers ({source}) computed in "
            f"{time.perf_counter() - started:.1f}s, stored in {folder}"
        )
    dist.barrier()


def reference_engine(cfg: TrainingConfig, ds_config: dict, source: str):
    """The model at `source`, frozen, for inference under DeepSpeed: partitioned as training is under ZeRO-3, else
    whole on each worker (TRL's prepare_deepspeed does the same)."""
    import deepspeed

    model_cfg = cfg.model.model_copy(
        update={"name_or_path": source, "lora": None, "fp8": False, "gradient_checkpointing": False, "compile": False}
    )
    model = load_model(model_cfg, ds_config, separate_documents=cfg.data.packing)
    if plain_bf16(cfg):
        model = model.to(torch.bfloat16)
    config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
    if cfg.zero_stage != 3:
        config["zero_optimization"] = {"stage": 0}
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


def _score(forward, split: PreparedSplit, collate, rank: int, world: int, micro: int) -> dict[int, np.ndarray]:
    """{block: its answers' reference log-probabilities} for this rank's share of the split's blocks. Every rank
    runs as many forward passes (ZeRO-3 gathers parameters in lockstep): the last shares wrap around."""
    n = len(split)
    positions = list(range(rank, -(-n // world) * world, world))
    device = forward.device if hasattr(forward, "device") else next(forward.parameters()).device
    values: dict[int, np.ndarray] = {}
    for lo in range(0, len(positions), micro):
        chunk = positions[lo : lo + micro]
        items = [split[p % n] for p in chunk]
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate(items).items()}
        sums = scored(forward(**model_inputs(batch)).logits, batch)[0].summed.float().cpu().numpy()
        at = 0
        for p, item in zip(chunk, items):
            k = int(item["documents"].max()) + 1  # the block's answers (a pair's two rows: 2)
            if p < n:
                values[p] = sums[at : at + k]
            at += k
    return values


def _store(folder: Path, splits: dict[str, PreparedSplit], gathered: list[dict], fields: dict) -> int:
    """Each unit's values (one a document) into a temporary folder, the record last, then renamed into place;
    where another run stored the same folder first, its (same) values stay. Returns the answers stored."""
    tmp = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
    answers = 0
    try:
        for name, split in splits.items():
            per_unit = {u: np.zeros(split.document_count(u), dtype=np.float32) for u in range(len(split.units))}
            for part in gathered:
                for block, values in part[name].items():
                    unit, lo, hi = split.documents_of(block)
                    per_unit[unit][lo:hi] = values
                    answers += hi - lo
            for unit, values in per_unit.items():
                path = unit_path(tmp, name, split.units[unit]["unit"], REFERENCE)
                path.parent.mkdir(parents=True, exist_ok=True)
                np.save(path, values, allow_pickle=False)
        (tmp / RECORD).write_text(json.dumps({**fields, "answers": answers}, indent=1) + "\n")
        with contextlib.suppress(OSError):
            os.rename(tmp, folder)
    finally:
        remove_tree(tmp)  # gone once renamed; left behind only where another run's folder was first
    if not (folder / RECORD).is_file():
        raise OSError(f"could not store the reference log-probabilities in {folder}")
    return answers
