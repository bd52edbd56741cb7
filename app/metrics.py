"""Metrics: progress lines with ETA, throughput and MFU, TensorBoard events, a metrics.jsonl file, MLflow (when
tracking.mlflow is set: app/tracking.py) and loss.png at each checkpoint (app/charts.py)."""

from __future__ import annotations

import json
import logging
import resource
import threading
import time
from pathlib import Path
from typing import Any

import torch

from app import charts, profiling
from app.progress import duration
from app.tracking import MlflowSender

log = logging.getLogger("finetune")

# Dense bf16 peak FLOP/s per GPU used as the MFU denominator (H100/H200 SXM: 989 TFLOP/s).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def peak_host_gib() -> float:
    """This process's peak resident memory (ru_maxrss, KiB on Linux): pinned host buffers, such as offloaded
    checkpoints (model.long_sequence), count once touched."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token: 6N for the dense part plus 12*L*H*S for attention (PaLM appendix B)."""
    return 6 * n_params + 12 * n_layers * hidden * seq


CURVE_POINTS = 48  # points of the loss curve on the RayJob's progress record
# Of an objective's own metrics, those the progress line shows (all are in metrics.jsonl, TensorBoard and MLflow).
SHOWN = ("rewards/accuracies", "rewards/margins")


class MetricsLogger:
    """Lives on rank 0 only; other ranks never construct one."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        flops_per_tok: float | None,
        world_size: int = 1,
        resumed_from: str | None = None,
    ):
        from torch.utils.tensorboard import SummaryWriter

        from app.progress import ProgressPublisher

        self.total, self.start_step, self.run_dir, self.world_size = total_steps, start_step, run_dir, world_size
        self.flops_per_tok, self.peak = flops_per_tok, peak_flops()
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)
        self.jsonl = (run_dir / "metrics.jsonl").open("a")
        self.t0 = time.perf_counter()
        self.mlflow = MlflowSender.for_experiment(run_dir)
        if self.mlflow and resumed_from:
            self.mlflow.set_tags({"resumed_from": resumed_from})
        self.drawing: threading.Thread | None = None  # loss.png, drawn off the training thread
        # Live progress on the RayJob, when running under one (None elsewhere), with the loss curve that
        # `finetune status` draws: this experiment's, across resumes.
        self.progress = ProgressPublisher.from_env(interval_s=30.0)
        history = charts.read_curves(run_dir / "metrics.jsonl")[0] if self.progress else []
        self.curve = charts.downsample(history, CURVE_POINTS)
        if self.progress:
            self.progress.update(
                {
                    "step": start_step,
                    "total_steps": total_steps,
                    "world_size": world_size,
                    "resumed_from": resumed_from,
                },
                force=True,
            )

    def step(
        self,
        step: int,
        epoch: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
        tokens_per_s_per_gpu: float,
        step_time: float,
        data_wait: float = 0.0,
        extra: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """One progress line; `extra`: the objective's own metrics under their names (preference tuning's, TRL's:
        rewards/accuracies, ...), written, tracked and shown like the loss."""
        done = step - self.start_step
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step)
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
            "step_time_s": step_time,
            "eta_s": eta,
            "data_wait_s": data_wait,
            **(extra or {}),
        }
        if self.flops_per_tok and self.peak:
            record["mfu"] = tokens_per_s_per_gpu * self.flops_per_tok / self.peak
        if torch.cuda.is_available():
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        record["peak_host_gib"] = peak_host_gib()
        self._write(step, record, "train")
        self._track(step, record)
        if self.progress:
            self.progress.update({k: record[k] for k in ("step", "epoch", "loss", "tokens_per_s_per_gpu", "eta_s")})
            self.curve = charts.downsample([p for p in self.curve if p[0] < step] + [(step, loss)], CURVE_POINTS)
            self.progress.update({"loss_curve": [[s, round(v, 4)] for s, v in self.curve]})
        mfu = f" mfu {record['mfu']:.1%}" if "mfu" in record else ""
        gn = f" gnorm {grad_norm:.3f}" if grad_norm is not None else ""
        # Shown only when it matters: a loader that cannot keep up (raise data.loader_workers).
        starved = f" data wait {data_wait / step_time:.0%}" if step_time and data_wait > 0.05 * step_time else ""
        shown = "".join(f" {name} {record[name]:.4f}" for name in SHOWN if name in record)
        log.info(
            f"step {step}/{self.total} epoch {epoch} loss {loss:.4f}{shown} lr {lr:.3g}{gn} "
            f"tok/s/gpu {tokens_per_s_per_gpu:,.0f}{mfu} step {step_time * 1000:.0f}ms{starved} eta {duration(eta)}"
        )
        return record

    def startup(self, marks: dict[str, float], process: dict[str, Any] | None = None) -> dict[str, Any]:
        """How long each start-up phase took: `marks` are wall-clock times, in order, each ending the phase of
        its name (driver: the driver began starting Ray; ray_started; trainer: the driver handed Ray Train the
        trainer; worker: the loop began on its worker; imports; model: loaded, the data opened meanwhile; data: the
        rest of the data's wait; engine). The first step's record ends the start-up. `process`: how this worker's
        process began (app.prestart.this_process)."""
        names = list(marks)
        phases = {b: round(marks[b] - marks[a], 2) for a, b in zip(names[:-1], names[1:])}
        record = {"marks": marks, "phases_s": phases, **({"worker_process": process} if process else {})}
        self.jsonl.write(json.dumps({"kind": "startup", "time": time.time(), **record}) + "\n")
        self.jsonl.flush()
        began = ""
        if process and process.get("started_ahead"):
            preloaded = process.get("preloaded_s")
            began = " (the worker's process started ahead" + (f", imports in {preloaded:.1f}s)" if preloaded else ")")
        log.info("start-up: " + ", ".join(f"{name} {sec:.1f}s" for name, sec in phases.items()) + began)
        if self.mlflow:
            self.mlflow.metrics(self.start_step, {f"startup_{name}_s": sec for name, sec in phases.items()})
        return record

    def profile(self, step: int, summary: dict[str, Any]) -> None:
        """Where step `step`'s time went (app/profiling.py), as a `profile` record and one log line."""
        self.jsonl.write(json.dumps({"kind": "profile", "time": time.time(), "step": step, **summary}) + "\n")
        self.jsonl.flush()
        log.info(f"profile of step {step}: {profiling.headline(summary)}")

    def _track(self, step: int, record: dict[str, Any]) -> None:
        """One step's record to MLflow, under the names a dashboard expects."""
        if not self.mlflow:
            return
        names = {"loss": "loss", "lr": "learning_rate", "grad_norm": "grad_norm", "mfu": "mfu"}
        names.update({k: k for k in ("tokens_per_s_per_gpu", "step_time_s", "data_wait_s", "epoch", "peak_mem_gib")})
        names.update({k: k for k in record if "/" in k})  # an objective's own (TRL's rewards/accuracies, ...)
        values = {name: record[key] for key, name in names.items() if record.get(key) is not None}
        values["tokens_per_s"] = record["tokens_per_s_per_gpu"] * self.world_size
        self.mlflow.metrics(step, values)

    def eval(self, step: int, loss: float, extra: dict[str, float] | None = None) -> dict[str, Any]:
        """`extra`: the objective's own metrics (preference tuning's), logged as eval_<name> as TRL does, in place of
        the perplexity, which a preference loss has none of."""
        record: dict[str, Any] = {"step": step, "eval_loss": loss}
        if extra is None:
            record["eval_perplexity"] = float(torch.exp(torch.tensor(min(loss, 50.0))))
        record.update({f"eval_{name}": value for name, value in (extra or {}).items()})
        self._write(step, record, "eval")
        if self.mlflow:
            self.mlflow.metrics(step, {k: v for k, v in record.items() if k != "step"})
        if self.progress:
            self.progress.update({"eval_loss": loss})
        shown = "".join(f" {name} {record['eval_' + name]:.4f}" for name in SHOWN if "eval_" + name in record)
        plex = f" perplexity {record['eval_perplexity']:.2f}" if "eval_perplexity" in record else ""
        log.info(f"eval at step {step}: loss {loss:.4f}{plex}{shown}")
        return record

    def _write(self, step: int, record: dict[str, Any], prefix: str) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)
        self.jsonl.write(json.dumps({"kind": prefix, "time": time.time(), **record}) + "\n")
        self.jsonl.flush()

    def checkpoint(self, path: Path, step: int, stall_s: float, total_s: float, background: bool) -> None:
        how = f"written in {total_s:.2f} s"
        if background and stall_s < total_s:  # else the loop waited for all of it: the last save, a preemption's
            how = f"training waited {stall_s:.2f} s, written in the background in {total_s:.2f} s"
        log.info(f"checkpoint saved: {path} ({how})")
        self.jsonl.write(
            json.dumps(
                {
                    "kind": "checkpoint",
                    "time": time.time(),
                    "step": step,
                    "path": str(path),
                    "stall_s": round(stall_s, 3),
                    "total_s": round(total_s, 3),
                    "background": background,
                }
            )
            + "\n"
        )
        self.jsonl.flush()
        if self.progress:
            self.progress.update({"last_checkpoint": str(path), "last_checkpoint_step": step}, force=True)
        if self.mlflow:
            saved = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.mlflow.metrics(step, {"checkpoint_save_s": total_s, "checkpoint_stall_s": stall_s})
            self.mlflow.set_tags(
                {
                    f"checkpoint.{path.name}": f"{path} (step {step}, saved {saved}, written in {total_s:.2f} s)",
                    "last_checkpoint": str(path),
                    "last_checkpoint_step": str(step),
                }
            )
        self._draw()

    def _draw(self) -> None:
        """loss.png from metrics.jsonl in a thread; skipped while the last drawing is still going (close() draws
        the final one)."""
        if self.drawing is None or not self.drawing.is_alive():
            self.drawing = threading.Thread(target=self._draw_safely, name="loss-png", daemon=True)
            self.drawing.start()

    def _draw_safely(self) -> None:
        try:
            charts.write_loss_png(self.run_dir)
        except Exception as exc:  # noqa: BLE001 - a picture never fails a run
            log.warning(f"WARNING: could not draw {self.run_dir / charts.LOSS_PNG}: {exc}")

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()
        if self.drawing is not None:
            self.drawing.join(30)
            self._draw_safely()  # the last evaluation comes after the last checkpoint
        if self.mlflow:
            self.mlflow.close()
        if self.progress:
            self.progress.close()  # one last flush, bounded
