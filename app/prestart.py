"""Ray worker processes for Ray Train's controller and training workers, started while the driver still checks,
writes its records and prepares the data, instead of one after another once `fit` asks for them.

Ray Train gives its controller and its workers runtime environments of their own (the variables it passes on; the
app's `worker_runtime_env`), and Ray starts a fresh process for an actor whose environment no idle process has: the
controller, its synchronization and placement-group helpers, then each training worker, each a process that
starts and imports Ray while the run waits (the worker group's 4.5 s of a 23 s start-up on one H100). A raylet can
start processes for a runtime environment and job before any actor asks (its PrestartWorkers call, which Ray's
Python API does not offer in this version: asked here through the raylet's gRPC service, as Ray's own tools ask
it), and an actor of that environment and job then takes one that is ready. The training workers' processes also
import the loop's modules while they wait (`preload`, Ray's worker setup hook), never CUDA: Ray sets each worker's
CUDA_VISIBLE_DEVICES only when its actor lands there.

Only an optimisation, on the driver's node: where Ray's internals change shape or the environments are not the ones
Ray Train builds, actors start processes of their own as before (tests/test_prestart.py then fails).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("finetune")

# The controller and the actors it creates with no runtime environment of their own, which inherit its: Ray Train's
# PlacementGroupCleaner, SynchronizationActor and DatasetManager (made with or without datasets).
CONTROLLER_ENV_ACTORS = 4
# Long enough for a driver that prepares a small dataset in between; `Prestarted.refresh` starts them again after
# a longer preparation. A process no actor took exits when it ends.
KEEP_ALIVE_S = 120
PRELOADED_ENV = "FINETUNE_PRELOADED_S"  # set by `preload` in the process it ran in
# What a training worker imports before its first step that counts no CUDA devices (seconds on the 2-core CPU
# machine): the loop (torch, the app: 2.1) and Ray Train's torch helpers (its process group: 1.2). Not transformers'
# model code (3.0): it imports torchao, which asks CUDA whether it runs on ROCm.
PRELOAD = ("app.train_loop", "ray.train.torch")


def worker_runtime_env(env: dict[str, str]) -> dict[str, Any]:
    """The training workers' runtime environment (Ray Train's `worker_runtime_env`): `env`, and `preload` as the
    processes' setup hook. Ray reads the hook from this variable in every worker process it starts (its own
    `worker_process_setup_hook` sets it only for a job's whole environment)."""
    from ray._private import ray_constants

    return {"env_vars": {**env, ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR: f"{__name__}.preload"}}


def preload() -> None:
    """Ray's setup hook in a training worker's process: the loop's imports, before any actor lands. Never raises
    (Ray ends a process whose hook fails); imports nothing that counts CUDA devices (tests/test_prestart.py)."""
    started = time.perf_counter()
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - the loop imports it again (or not at all) and says what is wrong
            log.debug(f"preload of {module} failed: {exc}")
    os.environ[PRELOADED_ENV] = f"{time.perf_counter() - started:.2f}"


def this_process(trainer_mark: float) -> dict[str, Any]:
    """For the start-up record: whether this worker's process was started ahead (before the driver handed Ray Train
    the trainer) and how long its preload took (None: it had none)."""
    import psutil

    preloaded = os.environ.get(PRELOADED_ENV)
    return {
        "started_ahead": psutil.Process().create_time() < trainer_mark,
        "preloaded_s": float(preloaded) if preloaded else None,
    }


def train_runtime_envs(worker_env: dict[str, Any]) -> tuple[str, str]:
    """(the controller's runtime environment, the workers'), serialized exactly as the raylet receives them for
    this driver's environment: the controller's as DataParallelTrainer creates it, from the driver (Python's
    serialization); the workers' as WorkerGroup._get_worker_runtime_env builds it in the controller, where Ray's
    core worker merges the controller's own variables into it (the child's win) and writes it compact, keys sorted."""
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray._private.utils import parse_runtime_env_for_task_or_actor
    from ray.train.v2._internal.constants import (
        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
        get_env_vars_to_propagate,
    )
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    controller = get_env_vars_to_propagate()
    controller.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
    # Computed in the controller from its own environment: the driver's propagated variables, as here.
    workers = dict(WorkerGroup._get_worker_runtime_env(custom_runtime_env=worker_env))
    workers["env_vars"] = {**controller, **workers["env_vars"]}
    return (
        parse_runtime_env_for_task_or_actor({"env_vars": controller}).serialize(),
        json.dumps(workers, separators=(",", ":"), sort_keys=True, ensure_ascii=False),
    )


class Prestarted:
    """Processes started ahead on the driver's node for a run's controller and, where that node can hold them,
    its training workers; `ensure` starts them again when the environments changed or the first ones may have
    exited unused (a long data preparation in between)."""

    def __init__(self) -> None:
        self.envs: tuple[str, str] | None = None
        self.at = 0.0

    def ensure(self, worker_env: dict[str, Any], workers_here: Callable[[], int]) -> None:
        import ray

        try:
            envs = train_runtime_envs(worker_env)
            if envs == self.envs and time.monotonic() - self.at < KEEP_ALIVE_S / 2:
                return
            if ray.get_runtime_context().runtime_env:
                return  # the job's own environment is merged into the actors': not the ones computed here
            start(envs[0], CONTROLLER_ENV_ACTORS)
            if count := workers_here():
                start(envs[1], count)
        except Exception as exc:  # noqa: BLE001 - only an optimisation: Train's actors start their own processes
            log.debug(f"no processes started ahead for Ray Train: {exc}")
            return
        self.envs, self.at = envs, time.monotonic()


def start(serialized_env: str, count: int, keep_alive_s: int = KEEP_ALIVE_S) -> None:
    """`count` Python worker processes of this job and runtime environment (as the raylet receives an actor's) on
    the driver's node; the raylet returns at once and starts them in the background."""
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray._private.utils import get_runtime_env_info, parse_runtime_env_for_task_or_actor
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

    info = get_runtime_env_info(parse_runtime_env_for_task_or_actor(json.loads(serialized_env)))
    info.serialized_runtime_env = serialized_env
    request = node_manager_pb2.PrestartWorkersRequest(
        language=common_pb2.PYTHON,
        job_id=bytes.fromhex(ray.get_runtime_context().get_job_id()),
        runtime_env_info=info,
        keep_alive_duration_secs=keep_alive_s,
        num_workers=count,
    )
    node = ray._private.worker.global_worker.node
    channel = init_grpc_channel(f"{node.node_ip_address}:{node.node_manager_port}")
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
    finally:
        channel.close()
