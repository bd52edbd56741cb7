"""`finetune status PATH`: what an experiment folder says about its run, with no cluster to ask.

Its state (running while a live run holds its lease; finished when its newest complete checkpoint ends the
training its recorded config asks for; else stopped, to resume), the last logged step, the newest complete
checkpoint, the final model, the MLflow run and a small loss curve, all read from the files the run wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app import charts, tracking


def looks_like_a_folder(argument: str) -> bool:
    """An experiment name never holds a '/' (a label value): an argument that does is a path."""
    return "/" in argument or argument in (".", "..")


def describe(run_dir: Path) -> dict[str, Any]:
    from app.checkpoint import newest_usable, read_state
    from app.lease import Lease

    lease = Lease(run_dir, 1)
    holder, age = lease.read()
    train, evals = charts.read_curves(run_dir / "metrics.jsonl")
    newest = newest_usable(run_dir) if (run_dir / "checkpoints").is_dir() else None
    state = read_state(newest) if newest else {}
    if holder is not None and lease.stale(holder, age) is None:
        status = "running"
    elif newest and _finished(run_dir):
        status = "finished"
    else:
        status = "stopped" if train else "not started"
    final = run_dir / "final"
    record = tracking.read_record(run_dir) or {}
    return {
        **_data(run_dir),
        "experiment": run_dir.name,
        "folder": str(run_dir),
        "state": status,
        "step": train[-1][0] if train else None,
        "loss": train[-1][1] if train else None,
        "eval_loss": evals[-1][1] if evals else None,
        "last_checkpoint": str(newest) if newest else None,
        "last_checkpoint_step": state.get("global_step"),
        "final_model": str(final) if any(final.glob("*.safetensors")) else None,
        "mlflow_run": record.get("run_id"),
        "mlflow_uri": record.get("tracking_uri"),
        "loss_curve": charts.downsample(train, 60),
    }


def _data(run_dir: Path) -> dict[str, Any]:
    """The prepared dataset the experiment's runs read (its folder and the manifest's one-line summary)."""
    from app.data import manifest

    try:
        folder = Path(json.loads((run_dir / manifest.EXPERIMENT_RECORD).read_text())["prepared"])
    except (OSError, ValueError, KeyError, TypeError):
        return {"data": None, "data_summary": None}
    found = manifest.read_manifest(folder)
    return {"data": str(folder), "data_summary": manifest.summary(found) if found else "no longer there"}


def _finished(run_dir: Path) -> bool:
    from app import config, driver

    try:
        cfg = config.parse(json.loads((run_dir / tracking.CONFIG_RECORD).read_text()))
    except (OSError, ValueError, config.ConfigError):
        return False  # no recorded config (a run from before it was recorded): it cannot be told
    cfg.experiment.storage_path, cfg.experiment.name = str(run_dir.parent), run_dir.name  # where it is now
    return driver.finished_checkpoint(cfg) is not None


def render(info: dict[str, Any]) -> str:
    lines = [f"experiment {info['experiment']} in {info['folder']}: {info['state']}", ""]
    if info["step"] is not None:
        lines.append(f"  step         {info['step']}")
        eval_loss = f"   eval loss {info['eval_loss']:.4f}" if info["eval_loss"] is not None else ""
        lines.append(f"  loss         {info['loss']:.4f}{eval_loss}")
    if info["last_checkpoint"]:
        lines.append(f"  checkpoint   {info['last_checkpoint']} (step {info['last_checkpoint_step']})")
    if info["final_model"]:
        lines.append(f"  final model  {info['final_model']}")
    if info.get("data"):
        lines.append(f"  data         {info['data']} ({info['data_summary']})")
    if info["mlflow_run"]:
        lines.append(f"  mlflow       run {info['mlflow_run']} at {info['mlflow_uri']}")
    return "\n".join(lines + curve_lines(info["loss_curve"]))


def curve_lines(points: list) -> list[str]:
    """The loss curve under a heading, or nothing when there are fewer than two points."""
    curve = charts.terminal_curve([(int(s), float(v)) for s, v in points if v is not None])
    return ["", "  loss by step:"] + ["  " + line for line in curve] if curve else []
