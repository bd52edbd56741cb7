"""The driver: checks a config end to end (app.preflight's one pass), then builds and runs the TorchTrainer.

With no RAY_ADDRESS, Ray starts a local cluster inside this process (the laptop / CI case); on KubeRay the
RayJob's entrypoint runs this on the head and Ray connects to the cluster.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from app import autoset, contract, ds_config, logs, preemption, preflight, prestart
from app.config import ConfigError, Problem, TrainingConfig, stand_ins
from app.lease import Lease
from app.model import model_facts

log = logging.getLogger("finetune")
DS_CONFIG_RECORD = "ds_config.json"
COMPILE_CACHE = ".compile-cache"  # under experiment.storage_path, beside the experiments' folders

# Environment the workers need to see, whether Ray started here or runs on a cluster.
PASSTHROUGH_PREFIXES = (
    "HF_",
    "HUGGING_FACE",
    "TRANSFORMERS_",
    "NCCL_",
    "TORCH_",
    "CUDA_",
    "DS_",
    "OMP_",
    "FINETUNE_",
    "PYTORCH_",
    "TRITON_",
    "TORCHINDUCTOR_",
)  # progress reporting (FINETUNE_RAYJOB_*) and test-only hooks
# Never passed on: Ray's runtime environment is readable by anyone who reaches the dashboard (`ray list
# runtime-envs`). Workers get such variables from their own environment (on KubeRay: the Secret, via the chart).
SECRET_NAME = re.compile(r"(^|_)(TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIALS?)(_|$)", re.IGNORECASE)


class Prepared(NamedTuple):
    config: TrainingConfig
    ds: dict[str, Any]
    note: str | None
    auto: autoset.Settled  # what the auto settings became and why


def prepare(
    cfg: TrainingConfig, offline: bool = True, with_ray: bool = False, accepted: tuple[str, ...] = ()
) -> Prepared:
    """The config this run uses, its DeepSpeed config and a note; raises ConfigError with every problem found.
    First the auto settings are chosen (app.autoset: `finetune train` asks the cluster for its GPUs' memory where
    scaling.gpu_memory does not say it, and refuses when neither can), then the resume plan applies (a changed
    number of workers may change gradient accumulation) and the contract compares, both on the chosen values.
    `with_ray` (`finetune train`): Ray starts while the model config is checked (see `check`)."""
    from app.checkpoint import ResumePlan

    # Unknown GPU memory refuses `train`, unless its local cluster could not run on GPUs anyway (the checks say so).
    gpus_here = bool(os.environ.get("RAY_ADDRESS")) or not cfg.scaling.use_gpu or preflight.local_gpus() > 0
    hardware = autoset.Hardware(detect=lambda: cluster_gpu_memory(cfg), strict=gpus_here) if with_ray else None
    settled = autoset.settle(cfg, offline, accepted, hardware)
    cfg = settled.config
    plan = ResumePlan.read(cfg)
    cfg = plan.apply(cfg)
    if plan.note:
        log.warning(plan.note)
    meanwhile = (lambda: _start_ray_unless_finished(cfg)) if with_ray else None
    before = settled.problems + list(plan.problems) + contract.plan(cfg, accepted)
    ds, note = check(cfg, offline, before, meanwhile=meanwhile, model=settled.model)
    return Prepared(cfg, ds, note, settled)


def _start_ray_unless_finished(cfg: TrainingConfig) -> None:
    """A finished experiment deployed again trains nothing and starts no cluster (cli.finish_again)."""
    if finished_checkpoint(cfg) is None:
        start_ray(cfg)


def check(
    cfg: TrainingConfig,
    offline: bool = True,
    problems: list[Problem] | None = None,
    meanwhile: Callable[[], None] | None = None,
    model: tuple[Any, list[Problem], str | None] | None = None,
) -> tuple[dict[str, Any], str | None]:
    """Every check that can run before the workers start (`preflight.problems`: one pass, each check once), after
    `problems` already found; raises ConfigError with all of them. Reads `cfg`, never changes it: a config whose
    auto settings are not chosen yet (`prepare` chooses them) is checked with what app.autoset chooses without
    asking the cluster (CPU workers' fixed values, scaling.gpu_memory's choice, else stand-ins). `meanwhile`
    (starting Ray) runs once every check has passed, while the model is counted on the meta device in a thread (the
    layer sizes of the "auto" ZeRO-3 values): that imports transformers' modelling code, seconds of the start-up
    that then overlap Ray's (docs/benchmarks.md, "Start-up"). An invalid config never starts Ray. `model`: the
    model config as app.autoset read it."""
    if autoset.auto_fields(cfg):
        settled = autoset.settle(cfg, offline)
        cfg, problems, model = settled.config, [*(problems or []), *settled.problems], settled.model
    # `finetune train` (meanwhile): a local cluster starts here unless RAY_ADDRESS names one
    found = preflight.problems(cfg, offline, local_cluster=meanwhile is not None, before=problems or [], model=model)
    if found.problems:
        raise ConfigError(found.problems)
    mc, note = found.model_config, found.note
    if mc is None:
        facts = {}
    elif meanwhile is None:
        facts = model_facts(cfg, mc)
    else:
        with ThreadPoolExecutor(1, thread_name_prefix="model-facts") as pool:
            counting = pool.submit(model_facts, cfg, mc)
            meanwhile()
            facts = counting.result()
    return ds_config.build(cfg, **facts), note


def worker_env(cfg: TrainingConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(PASSTHROUGH_PREFIXES) and not SECRET_NAME.search(k)}
    if not cfg.scaling.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    else:
        for name, folder in compile_cache_env(cfg.experiment.storage_path).items():
            env.setdefault(name, folder)  # the user's own cache folders win
    return env


def compile_cache_env(storage_path: str) -> dict[str, str]:
    """Where GPU workers keep the kernels they compile: Triton's (Liger's kernels, and another variant whenever an
    integer argument such as the step's target-token count meets a new specialization) and torch.compile's. A
    pod's own disk starts empty at every deployment, so each one compiled them all again (measured on one H200:
    the 1.1B's first step 4.1 s cold against 1.5 s cached, 9.2 s against 2.4 s with FP8); under the storage root a
    redeployed or resumed run, and the next experiment on the same model, finds them. Both caches key entries by
    source, GPU and versions, and write each file to a temporary name first, so one folder serves every
    experiment and worker at once."""
    root = Path(storage_path).expanduser().resolve() / COMPILE_CACHE
    return {"TRITON_CACHE_DIR": str(root / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}


def run(cfg: TrainingConfig, ds: dict[str, Any], accepted: tuple[str, ...] = ()):
    """Run (or resume) the experiment under its lease; returns Ray's Result."""
    # Nothing is written to the experiment folder before this run holds its lease.
    with Lease(cfg.experiment_dir, cfg.experiment.lease_timeout_s).acquire(
        wait=cfg.experiment.on_conflict == "wait"
    ) as lease:
        from app.checkpoint import repair_ray_snapshot

        for warning in repair_ray_snapshot(cfg.experiment_dir):
            log.warning(f"WARNING: {warning}")
        preemption.clear(cfg.experiment_dir)  # a notice left by the run before is not for this one
        record_ds_config(cfg, ds)
        contract.record(cfg, accepted)  # what its checkpoints depend on, for the next deploy's comparison
        return _fit(cfg, ds, lease.token)


def record_ds_config(cfg: TrainingConfig, ds: dict[str, Any]) -> None:
    """The DeepSpeed config this run resolved, in the log and beside its checkpoints: the one place to read it
    (the chart does not compute it; `finetune validate` prints it before a run); the resolved training config
    beside it."""
    from app.checkpoint import write_atomic
    from app.tracking import CONFIG_RECORD

    path = cfg.experiment_dir / DS_CONFIG_RECORD
    write_atomic(path, json.dumps(ds, indent=2) + "\n")
    # The training config as resolved, beside it: what rank 0 logs to MLflow as params (app/tracking.py).
    write_atomic(cfg.experiment_dir / CONFIG_RECORD, json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")
    # One line in the (quiet) log; the whole config is in the file.
    log.info(
        f"DeepSpeed config: ZeRO-{cfg.zero_stage}, {ds['train_batch_size']} sequences a step "
        f"({ds['train_micro_batch_size_per_gpu']} x {ds['gradient_accumulation_steps']} accumulation x "
        f"{cfg.scaling.data_parallel} {'workers' if cfg.scaling.sequence_parallel == 1 else 'data-parallel groups'}), "
        f"{cfg.train.precision}; every value in {path}"
    )


_ray_marks: dict[str, float] = {}  # wall-clock "driver" (Ray asked for) and "ray_started", for the breakdown
# A cluster this process starts is this machine's alone, for this run: nothing drains its node, so Ray Train's
# PreemptionWatcher (an actor process that waits for node drains, about 2 CPU-s of a tiny run's 50 on 2 cores) has
# nothing to watch. The app's own preemption (SIGTERM, the notice file) is not Ray's and stays. The user's value wins.
LOCAL_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def start_ray(cfg: TrainingConfig) -> None:
    """Connect to the Ray cluster (RAY_ADDRESS: KubeRay's head, or `ray start`) or start a local one; once per
    process. `finetune train` calls it while the model config is checked (`prepare(with_ray=True)`)."""
    import ray

    if ray.is_initialized():
        return
    _ray_marks["driver"] = time.time()
    train_env_settings(cfg)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**logs.before_ray_init())  # workers get their environment through worker_runtime_env
    else:
        os.environ.update(worker_env(cfg))  # the local cluster's workers inherit this process's environment
        for name, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)
        needed = int(cfg.scaling.num_workers * cfg.scaling.cpus_per_worker) + 1
        log.info("starting a local Ray cluster (about 10-20 s)")
        _init_local_ray(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False, **logs.before_ray_init())
    logs.after_ray_init()
    _create_autoscaling_coordinator()
    _ray_marks["ray_started"] = time.time()
    prestart_for(cfg)


def train_env_settings(cfg: TrainingConfig) -> None:
    """Variables Ray Train reads in its controller (it propagates them there from the driver's environment), set
    before Ray starts: the processes started ahead for the controller (app.prestart) have them too."""
    # A worker group that cannot be placed ends the run after this wait instead of waiting 60 s again and again
    # (controller_failure_limit=0).
    os.environ[preflight.START_TIMEOUT_ENV] = preflight.start_timeout_s(cfg)
    # Ray Train's controller acts on what the workers did (a checkpoint reported, the loop ended, a worker died)
    # only when it polls them, every 2 s by default: the end of a run reached the driver 4 s after the loop's
    # (two polls). A poll is one small task per worker, and a worker that misses one is judged dead only after
    # RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S (10 min), so polling 4x as often costs nothing. The user's value wins.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


_prestarted = prestart.Prestarted()  # processes started ahead for Ray Train's actors


def prestart_for(cfg: TrainingConfig) -> None:
    """Processes for the run's controller and the workers the driver's node holds, started ahead (app.prestart),
    or again when the environments changed or the first ones may have exited unused."""
    _prestarted.ensure(prestart.worker_runtime_env(worker_env(cfg)), lambda: workers_on_this_node(cfg))


def workers_on_this_node(cfg: TrainingConfig) -> int:
    """How many of the run's workers Ray can place on the driver's node: all of them on a cluster this process
    started; on one it joined, as many as the node's free CPUs and GPUs hold (a KubeRay head usually holds none)."""
    import ray

    s = cfg.scaling
    if not os.environ.get("RAY_ADDRESS"):
        return s.num_workers
    here = ray.get_runtime_context().get_node_id()
    free = next((n.get("Resources") or {} for n in ray.nodes() if n.get("NodeID") == here and n.get("Alive")), {})
    fits = [free.get("CPU", 0) // s.cpus_per_worker if s.cpus_per_worker else s.num_workers]
    if s.use_gpu:
        fits.append(free.get("GPU", 0))
    return int(min(s.num_workers, *fits))


# Ray gives a local node a fixed 30 s to register with its GCS (ray/_private/node.py, not configurable); on a machine
# whose cores are all busy it can take longer, and ray.init then fails though nothing is wrong (seen on 2 loaded cores).
RAY_START_ATTEMPTS = 3
RAY_START_TIMEOUT = "timed out during startup"


def _init_local_ray(**kwargs) -> None:
    """ray.init for a local cluster, tried again (up to RAY_START_ATTEMPTS) when the node did not register in Ray's
    30 s; the processes a failed attempt started are stopped first, so that they take no CPU from the next."""
    import psutil
    import ray

    me = psutil.Process()
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            ray.init(**kwargs)
            return
        except Exception as err:  # noqa: BLE001 - Ray raises a bare Exception for this
            if RAY_START_TIMEOUT not in str(err) or attempt == RAY_START_ATTEMPTS:
                raise
        started = [p for p in me.children(recursive=True) if p.pid not in before and _is_ray_process(p)]
        for p in started:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(started, timeout=10)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        log.warning(
            f"the local Ray cluster did not start within Ray's 30 s (this machine is busy: load average {load}); "
            f"stopped it and starting it again ({attempt + 1} of {RAY_START_ATTEMPTS})"
        )


def _is_ray_process(p) -> bool:
    """A process of Ray's local node (GCS, raylet, its agents and workers), not one another thread of the driver
    started meanwhile."""
    import psutil

    with contextlib.suppress(psutil.Error):
        return "ray" in " ".join([p.name(), *p.cmdline()])
    return False


def cluster_gpu_memory(cfg: TrainingConfig) -> tuple[int, str] | None:
    """Each training worker's GPU memory as `finetune train` learns it where scaling.gpu_memory does not say it, and
    where it came from; None when it cannot tell. A run that starts its own Ray cluster gets this machine's GPUs: the
    smallest that torch sees (it counts CUDA_VISIBLE_DEVICES, as Ray does). A run that joins a cluster (RAY_ADDRESS)
    connects to it, which starts nothing, and reads its GPU nodes' type (Ray's accelerator_type) against the sizes
    app.autoset knows, waiting for a GPU node up to scaling.placement_timeout_s, as the workers would."""
    if not os.environ.get("RAY_ADDRESS"):
        import torch

        if not torch.cuda.is_available():
            return None
        sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
        name = torch.cuda.get_device_name(0)
        return min(sizes), f"the {name} this machine's workers get"
    import ray

    start_ray(cfg)
    deadline = time.monotonic() + cfg.scaling.placement_timeout_s
    types = gpu_node_types(ray.nodes())
    if not types:
        log.info("waiting for the cluster's GPU nodes: their type tells the auto settings each GPU's memory")
    while not types and time.monotonic() < deadline:
        time.sleep(5)
        types = gpu_node_types(ray.nodes())
    return autoset.memory_of_types(types) if types else None


def gpu_node_types(nodes: list[dict[str, Any]]) -> list[str]:
    """The accelerator type of each live node with GPUs (ray.nodes()); "?" for a GPU node without one."""
    out = []
    for node in nodes:
        resources = node.get("Resources") or {}
        if node.get("Alive") and resources.get("GPU"):
            kinds = [key.split(":", 1)[1] for key in resources if key.startswith("accelerator_type:")]
            out.append(kinds[0] if kinds else "?")
    return out


def _create_autoscaling_coordinator() -> None:
    """Ray Train's controller registers the workers' resources with Ray Data's autoscaling coordinator, a
    detached actor it creates on first use, and waits up to 5 s for the answer before it starts the workers; on
    a fresh cluster that actor is not up in time (3.2 s lost, measured on one H200). Created here, as soon as Ray
    is up, it starts while the driver and the controller do (0.4 s). Ray internals: if they change shape, the
    controller creates it itself, as before."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        get_or_create_autoscaling_coordinator()
    except Exception as exc:  # noqa: BLE001 - only an optimisation
        log.debug(f"autoscaling coordinator not created ahead: {exc}")


def _fit(cfg: TrainingConfig, ds: dict[str, Any], lease_token: str):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from app.ray_backend import ProcessGroupConfig
    from app.train_loop import train_loop

    start_ray(cfg)
    preemption.on_driver_sigterm(cfg.experiment_dir, lease_token)  # after ray.init, which sets its own handler
    where = data_for(cfg)  # prepared now, on the cluster's CPUs, unless it was: no training worker waits for it
    train_env_settings(cfg)  # this config's, where Ray started for an earlier one (cluster_gpu_memory)
    prestart_for(cfg)  # again only where the ones started with Ray may have exited unused, or were for other values
    now = time.time()  # start-up breakdown: the loop adds its own marks and logs the whole
    marks = {"driver": _ray_marks.get("driver", now), "ray_started": _ray_marks.get("ray_started", now)}
    s = cfg.scaling
    log.info(f"starting {s.num_workers} training workers (about 30 s: each loads torch, DeepSpeed, the model and data)")
    # The driver's own part once Ray is up (its records, imports, the data's key) ends here; Ray Train's begins.
    marks["trainer"] = time.time()
    trainer = TorchTrainer(
        train_loop,
        # The lease token: the workers check it before completing a checkpoint (app/checkpoint/saving.py).
        train_loop_config={
            "config": cfg.model_dump(mode="json"),
            "ds_config": ds,
            "startup": marks,
            "lease_token": lease_token,
            "data": where,
        },
        # Ray's TorchConfig, less its import of torch in Ray Train's controller process (app/ray_backend.py).
        torch_config=ProcessGroupConfig(backend="nccl" if s.use_gpu else "gloo", timeout_s=s.collective_timeout_s),
        scaling_config=ScalingConfig(
            num_workers=s.num_workers,
            use_gpu=s.use_gpu,
            resources_per_worker={"CPU": s.cpus_per_worker, **({"GPU": 1} if s.use_gpu else {})},
        ),
        run_config=RunConfig(
            name=cfg.experiment.name,
            storage_path=str(Path(cfg.experiment.storage_path).expanduser().resolve()),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            failure_config=FailureConfig(max_failures=s.max_failures, controller_failure_limit=0),
            worker_runtime_env=prestart.worker_runtime_env(worker_env(cfg)),
        ),
    )
    try:
        return trainer.fit()
    except Exception as exc:
        placement = preflight.placement_failure(exc, cfg)
        failed = worker_error(exc, s.max_failures, cfg) or controller_error(exc, s.max_failures, cfg)
        error = WorkerProblem(placement) if placement else failed
        if error is None:
            raise
        raise error from exc


def data_for(cfg: TrainingConfig) -> dict[str, str]:
    """Where the workers read their data: the experiment's own tokenized cache when it started on one (written
    there before prepared datasets; its resume then sees its blocks), else the prepared dataset of its key,
    prepared now unless it is on the volume already."""
    from app.data import cache_folder, pipeline

    tokenizer_name = cfg.model.tokenizer or cfg.model.name_or_path
    own = cache_folder(cfg.data, tokenizer_name, cfg.experiment_dir / "cache", cfg.train.seed)
    if (own / "done").exists():
        log.info(f"data: {own}, the tokenized cache this experiment started on")
        return {"cache": str(own)}
    from app.checkpoint import write_atomic
    from app.data.manifest import EXPERIMENT_RECORD

    folder = pipeline.started_on(cfg)
    if folder is not None:
        log.info(f"data: {folder}, the prepared dataset this experiment started on (its eval_fraction rule)")
    else:
        folder, _ = pipeline.ensure(cfg)
    # Which prepared dataset this experiment reads, for `finetune status` (the key's folder is shared).
    write_atomic(cfg.experiment_dir / EXPERIMENT_RECORD, json.dumps({"prepared": str(folder)}) + "\n")
    return {"prepared": str(folder)}


class WorkerProblem(RuntimeError):
    """A setting only the workers could judge (their GPU, the model as built there) is wrong: deploying again
    unchanged would fail the same way."""


def worker_error(exc: BaseException, max_failures: int = 0, cfg: TrainingConfig | None = None) -> RuntimeError | None:
    """Ray's error for failed workers (its message starts with "Training failed due to worker errors") as the
    failing rank's own exception in one line, which the CLI shows first (Ray logs every worker's traceback above
    it); None when no worker failed."""
    failures = sorted((getattr(exc, "worker_failures", None) or {}).items())
    causes = [(rank, _root_cause(failure)) for rank, failure in failures]
    # A rank that fails because another one died (a closed or reset connection in a collective) is not the cause.
    causes.sort(key=lambda rc: type(rc[1]).__name__ == "DistBackendError" or _lost_peer(str(rc[1])))
    if not causes:
        return None
    rank, cause = causes[0]
    advice = failure_fix(cause, max_failures, cfg)
    line = f"{_one_line(cause)} [rank {rank}]" + (f". {advice}" if advice else "")
    return (WorkerProblem if isinstance(cause, Problem) else RuntimeError)(line)


def controller_error(
    exc: BaseException, max_failures: int = 0, cfg: TrainingConfig | None = None
) -> RuntimeError | None:
    """Ray Train's ControllerError (the controller failed, e.g. Ray's memory monitor killed the workers it was
    starting), whose own message is a bare "Training failed due to controller error:" line, as its cause in one
    line with the fix; None for other errors."""
    cause = getattr(exc, "controller_failure", None)
    if not isinstance(cause, BaseException):
        return None
    advice = failure_fix(cause, max_failures, cfg)
    return RuntimeError(f"Ray Train's controller failed: {_one_line(cause)}" + (f". {advice}" if advice else ""))


def _lost_peer(text: str) -> bool:
    return "Connection closed" in text or "Connection reset by peer" in text


def failure_fix(cause: BaseException, max_failures: int, cfg: TrainingConfig | None = None) -> str | None:
    """What to change after the failures a run meets most (memory, a dead worker, a collective that timed out),
    so that nobody has to read Ray's or torch's traceback to learn it; None for the others."""
    import ray.exceptions

    name, text = type(cause).__name__, str(cause).lower()
    if isinstance(cause, ray.exceptions.OutOfMemoryError) or "low on memory" in text:
        return (  # Ray's memory monitor: the pod's (or machine's) memory, not the GPU's
            "Fix: a node ran out of host memory and Ray killed its workers; give the pods more memory "
            "(resources.limits.memory of the head or the worker group in the chart's values), or lower "
            "train.micro_batch_size or data.seq_length"
        )
    if "outofmemory" in name.lower() or "out of memory" in text:
        return "Fix: out of memory; " + ", or ".join(memory_levers(cfg))
    if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError)) or name.startswith(
        "WorkerHealthCheck"
    ):
        used = "no restart is allowed" if max_failures == 0 else f"its {max_failures} restart(s) are used up"
        return (
            f"Fix: a worker process died (killed, or out of host memory: see the node's events) and {used} "
            "(scaling.max_failures); raise scaling.max_failures to restart from the last checkpoint, or deploy again"
        )
    if ("timed out" in text or "timeout" in text) and ("gloo" in text or "nccl" in text or "DistBackend" in name):
        return (
            "Fix: a collective (NCCL/gloo) timed out: one rank stopped or fell far behind (see its log above); on "
            "several nodes check the network between them (NCCL_SOCKET_IFNAME), then deploy again"
        )
    return None


def memory_levers(cfg: TrainingConfig | None) -> list[str]:
    """What a run that ran out of GPU memory can still change, in the order to try, leaving out what its config
    already has: a smaller micro-batch, activation checkpointing, shorter sequences, then offload."""
    cfg = stand_ins(cfg) if cfg else None  # a run's settings are chosen; a config that never was, as before auto
    t = cfg.train if cfg else None
    levers = []
    if t is None or t.micro_batch_size > 1:
        levers.append(
            "lower train.micro_batch_size"
            + (f" (now {t.micro_batch_size})" if t else "")
            + " and raise train.gradient_accumulation_steps to keep the batch"
        )
    if cfg is None or not cfg.model.gradient_checkpointing:
        levers.append("set model.gradient_checkpointing=true")
    if cfg is not None and cfg.data.seq_length > 1024:
        levers.append(f"lower data.seq_length (now {cfg.data.seq_length})")
    if cfg is None or not cfg.deepspeed.optimizer_offloaded:
        levers.append("offload: deepspeed.zero_optimization.offload_optimizer={device: cpu}")
    return levers or ["use GPUs with more memory, or more of them (scaling.num_workers)"]


def _root_cause(failure: BaseException) -> BaseException:
    """The worker's own exception, under the wrappers Ray adds (a cause chain of a few links)."""
    cause = failure
    for _ in range(8):
        # Ray's WorkerHealthCheckFailedError carries the dead worker's error as health_check_failure.
        inner = cause.__cause__ or getattr(cause, "cause", None) or getattr(cause, "health_check_failure", None)
        if not isinstance(inner, BaseException) or inner is cause:
            break
        cause = inner
    return cause


def _one_line(cause: BaseException) -> str:
    from app.checkpoint import CheckpointError
    from app.nonfinite import NonFiniteError

    text = (str(cause).strip().splitlines() or [""])[0]
    # The app's own errors are worded for the user; anything else shows its type, as a traceback would.
    return text if isinstance(cause, (CheckpointError, NonFiniteError, Problem)) else f"{type(cause).__name__}: {text}"


def finished_checkpoint(cfg: TrainingConfig) -> tuple[Path, dict[str, Any]] | None:
    """The experiment's newest complete checkpoint and its state when it already ends the training this config
    asks for (the loop would do nothing), else None."""
    from app import checkpoint

    latest = checkpoint.newest_usable(cfg.experiment_dir)
    if latest is None:
        return None
    try:
        state = checkpoint.read_state(latest)
    except (OSError, ValueError):
        return None  # judged again, with fallbacks, when the run starts
    t = cfg.train
    done = state.get("epoch", 0) >= t.epochs or (t.max_steps is not None and state.get("global_step", 0) >= t.max_steps)
    return (latest, state) if done else None


def export_final(cfg: TrainingConfig, path: Path) -> Path:
    """final/ from a checkpoint, in this process (no cluster), under the experiment's lease."""
    from app.checkpoint import export

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with Lease(cfg.experiment_dir, cfg.experiment.lease_timeout_s).acquire(wait=cfg.experiment.on_conflict == "wait"):
        return export(path, cfg.experiment_dir / "final", cfg.train.precision)
