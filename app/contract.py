"""The resume contract: what an experiment's checkpoints depend on, recorded at its first start
(`<experiment>/contract.json`) and compared at every redeploy before any cluster starts, like a `terraform plan`.

A checkpoint depends on the model it was trained from and the settings that shape its tensors (the base model,
full fine-tuning or LoRA and the adapters' rank, alpha and targets, pure bf16 weights), and on the data whose
batches its position counts (the prepared data's key fields: the files, tokenizer, template, format, seq_length,
packing, mixture). A change to any of them is refused with the field, its old and new value and the fix (a new
experiment name, or `--accept-changed FIELD` to continue anyway, which is logged and recorded). Everything else
(learning rate, schedule, epochs, evaluation, logging, checkpoint cadence, workers) may change between deploys;
what did is said in one line. A dependency the config leaves to "auto" (train.pure_bf16) keeps on a redeploy the
value recorded here, where it fits (app.autoset, before this comparison): other GPUs make no change nobody wrote.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from app.config import TrainingConfig
from app.errors import Problem

RECORD = "contract.json"
log = logging.getLogger("finetune")


def dependencies(cfg: TrainingConfig) -> dict[str, Any]:
    """What the experiment's checkpoints depend on, by field name, as plain JSON values."""
    from app.data import pipeline

    lora = cfg.model.lora
    found: dict[str, Any] = {
        "model.name_or_path": cfg.model.name_or_path,
        "model.lora": "LoRA" if lora is not None else "full fine-tuning",
        "train.pure_bf16": cfg.train.pure_bf16,
    }
    if lora is not None:
        found |= {"model.lora.r": lora.r, "model.lora.alpha": lora.alpha}
        found["model.lora.target_modules"] = lora.target_modules
    for name, value in pipeline.key_fields(cfg).items():
        found[DATA_FIELDS.get(name, f"data.{name}")] = value
    return json.loads(json.dumps(found))


# The prepared data's key fields under the names a user sets (the sources are data.dataset and its neighbours).
DATA_FIELDS = {
    "sources": "data.dataset",
    "tokenizer": "model.tokenizer",
    "template": "data.chat_template",
    "seed": "train.seed",
    "version": "the data preparation's version",
    "unit_rows": "the data preparation's units",
}


def plan(cfg: TrainingConfig, accepted: tuple[str, ...] = ()) -> list[Problem]:
    """The problems of redeploying `cfg` over its experiment's checkpoints (none for a first start, or an
    experiment without a complete checkpoint); the changes it may make are logged in one line."""
    from app.checkpoint import newest_usable

    recorded = read(cfg.experiment_dir)
    if recorded is None or newest_usable(cfg.experiment_dir) is None:
        return []
    try:
        now = dependencies(cfg)
    except (OSError, ValueError):  # the data cannot be listed: the data checks say so
        return []
    changed = {k for k in set(recorded["depends_on"]) | set(now) if recorded["depends_on"].get(k) != now.get(k)}
    if unknown := [name for name in accepted if name not in changed]:
        return [
            Problem(
                "--accept-changed",
                unknown,
                f"names no changed field of {cfg.experiment.name}'s checkpoints"
                + (f" (changed: {', '.join(sorted(changed))})" if changed else " (none changed)"),
                "name only the fields this deploy changes, as the refusal lists them",
            )
        ]
    problems = [
        Problem(
            name,
            now.get(name),
            f"was {_short(recorded['depends_on'].get(name))} when {cfg.experiment.name} started, and its checkpoints "
            "depend on it (the weights' shapes, or the data whose batches the resume position counts)",
            f"deploy under a new experiment name, or pass --accept-changed {name} to continue these checkpoints",
        )
        for name in sorted(changed - set(accepted))
    ]
    if not problems:
        _log_changes(recorded, cfg, sorted(changed))
    return problems


def _log_changes(recorded: dict[str, Any], cfg: TrainingConfig, accepted: list[str]) -> None:
    before, after = _flat(recorded.get("config", {})), _flat(cfg.model_dump(mode="json"))
    ignored = ("experiment.storage_path",)
    safe = [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k) and k not in ignored]
    safe = [k for k in safe if not any(k == a or k.startswith(a + ".") for a in accepted)]
    if safe:
        shown = ", ".join(f"{k} {_short(before.get(k))} -> {_short(after.get(k))}" for k in safe[:12])
        more = f" and {len(safe) - 12} more" if len(safe) > 12 else ""
        log.info(f"changed since {cfg.experiment.name} started (its checkpoints do not depend on them): {shown}{more}")
    if accepted:
        names = ", ".join(accepted)
        log.warning(f"WARNING: continuing {cfg.experiment.name}'s checkpoints with changed {names} (--accept-changed)")


def record(cfg: TrainingConfig, accepted: tuple[str, ...] = ()) -> None:
    """At the experiment's first start (and after an accepted change): what its checkpoints depend on from now on,
    and the config, for the next deploy's comparison. Called under the experiment's lease."""
    from app.checkpoint import write_atomic

    existing = read(cfg.experiment_dir)
    if existing is not None and not accepted:
        if not _same(existing, cfg):  # safe changes: the next deploy compares with this one's config
            existing["config"] = cfg.model_dump(mode="json")
            write_atomic(cfg.experiment_dir / RECORD, json.dumps(existing, indent=1) + "\n")
        return
    document = {"depends_on": dependencies(cfg), "config": cfg.model_dump(mode="json")}
    if existing is not None:
        document["accepted"] = existing.get("accepted", []) + [list(accepted)]
    write_atomic(cfg.experiment_dir / RECORD, json.dumps(document, indent=1) + "\n")


def _same(existing: dict[str, Any], cfg: TrainingConfig) -> bool:
    return existing.get("config") == json.loads(json.dumps(cfg.model_dump(mode="json")))


def read(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / RECORD).read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out |= _flat(inner, f"{prefix}.{key}" if prefix else str(key))
        return out
    return {prefix: value}


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."
