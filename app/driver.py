"""The driver: checks a config end to end, then builds and runs the TorchTrainer.

With no RAY_ADDRESS, Ray starts a local cluster inside this process (the laptop / CI case); on KubeRay the
RayJob's entrypoint runs this on the head and Ray connects to the cluster.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from app import data, ds_config
from app.config import ConfigError, Problem, TrainingConfig
from app.lease import Lease
from app.model import check_seq_length, hidden_size, load_model_config, model_source

log = logging.getLogger("finetune")

# Environment the workers need to see, whether Ray started here or runs on a cluster.
PASSTHROUGH_PREFIXES = ("HF_", "HUGGING_FACE", "TRANSFORMERS_", "NCCL_", "TORCH_", "CUDA_", "DS_", "OMP_",
                        "FINETUNE_")  # progress reporting (FINETUNE_RAYJOB_*) and test-only hooks


def storage_problems(storage_path: str) -> list[Problem]:
    """Is the storage path (or its nearest existing parent) a writable folder? Leaves nothing behind."""
    path = Path(storage_path).expanduser()
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    field = "experiment.storage_path"
    if not probe.is_dir():
        return [Problem(field, storage_path, f"{probe} is not a folder", "point it at a folder (a mounted volume on Kubernetes)")]
    try:
        # O_TMPFILE: an unnamed file, so the check never leaves an entry in the folder.
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        reason = "read-only" if exc.errno == errno.EROFS else exc.strerror
        return [Problem(field, storage_path, f"{probe} is not writable ({reason})", "mount it read-write or choose another path")]
    return []


def model_facts(cfg: TrainingConfig, offline: bool) -> tuple[int | None, list[Problem], str | None]:
    """Hidden size and context checks from the model config; (hidden, problems, note when unreadable)."""
    source, _ = model_source(cfg.model.name_or_path)
    local = data.is_local(source)
    try:
        if offline and not local:
            from transformers import AutoConfig

            mc = AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=cfg.model.trust_remote_code)
        else:
            mc = load_model_config(cfg.model)
    except Exception as exc:  # noqa: BLE001 - any failure here means "cannot read it now"
        if local:
            return None, [Problem("model.name_or_path", cfg.model.name_or_path, f"not a model folder ({type(exc).__name__})",
                                  "point it at a from_pretrained folder")], None
        return None, [], (f"model config of '{cfg.model.name_or_path}' is not available offline: seq_length and the "
                          "hidden-size 'auto' values are checked at run start")
    return hidden_size(mc), check_seq_length(cfg.data.seq_length, mc), None


def resume_problems(cfg: TrainingConfig) -> list[Problem]:
    """A resume must run with the world size its checkpoints were written with (DeepSpeed shards per rank)."""
    from app import checkpoint

    latest = checkpoint.latest_complete(cfg.experiment_dir)
    if latest is None:
        return []
    saved = checkpoint.read_state(latest).get("world_size")
    if saved and saved != cfg.scaling.num_workers:
        return [Problem("scaling.num_workers", cfg.scaling.num_workers,
                        f"the experiment's last checkpoint ({latest.name}) was written by {saved} workers, and "
                        "resuming on another number of workers is not supported yet",
                        f"set scaling.num_workers={saved} (and GPUs to match), or start a new experiment name")]
    return []


def check(cfg: TrainingConfig, offline: bool = True) -> tuple[dict[str, Any], str | None]:
    """Every check that can run before the workers start; raises ConfigError with all problems found."""
    problems = ds_config.check(cfg) + data.check_source(cfg.data) + storage_problems(cfg.experiment.storage_path)
    problems += resume_problems(cfg)
    hidden, model_problems, note = model_facts(cfg, offline)
    problems += model_problems
    if problems:
        raise ConfigError(problems)
    return ds_config.build(cfg, hidden), note


def worker_env(cfg: TrainingConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(PASSTHROUGH_PREFIXES)}
    if not cfg.scaling.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def run(cfg: TrainingConfig, ds: dict[str, Any]):
    """Run (or resume) the experiment under its lease; returns Ray's Result."""
    # Nothing is written to the experiment folder before this run holds its lease.
    with Lease(cfg.experiment_dir, cfg.experiment.lease_timeout_s).acquire(wait=cfg.experiment.on_conflict == "wait"):
        return _fit(cfg, ds)


def _fit(cfg: TrainingConfig, ds: dict[str, Any]):
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from app.train_loop import train_loop

    env = worker_env(cfg)
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()  # a cluster (KubeRay's head, or `ray start`); workers get `env` through worker_runtime_env
        else:
            os.environ.update(env)  # the local cluster's workers inherit this process's environment
            needed = int(cfg.scaling.num_workers * cfg.scaling.cpus_per_worker) + 1
            ray.init(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False)
    s = cfg.scaling
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"config": cfg.model_dump(mode="json"), "ds_config": ds},
        torch_config=TorchConfig(backend="nccl" if s.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=s.num_workers, use_gpu=s.use_gpu,
                                     resources_per_worker={"CPU": s.cpus_per_worker, **({"GPU": 1} if s.use_gpu else {})}),
        run_config=RunConfig(
            name=cfg.experiment.name,
            storage_path=str(Path(cfg.experiment.storage_path).expanduser().resolve()),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            failure_config=FailureConfig(max_failures=s.max_failures),
            worker_runtime_env={"env_vars": env},
        ),
    )
    return trainer.fit()
