"""The workers' torch process group, set up by Ray Train as its `TorchConfig` does, from a module without torch.

Ray Train's controller runs in a process of its own and unpickles the trainer's backend config there. Ray's
`TorchConfig` lives in a module that imports torch, so the controller imported torch (2-3 s) before it could
start a worker. The backend here does what Ray's torch backend does for this app (one process group over the
workers, `MASTER_ADDR`/`RANK`/... set, each worker's CUDA device chosen, the group torn down at the end), calling
Ray's own worker-side functions, but it imports them, and torch with them, only in the workers.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.util import TrainingFramework


@dataclass
class ProcessGroupConfig(BackendConfig):
    """`nccl` on GPUs, `gloo` on CPUs; `timeout_s` for the group's collectives, as Ray's `TorchConfig`."""

    backend: str = "nccl"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return ProcessGroupBackend

    @property
    def train_func_context(self):
        return CudaDevice

    @property
    def framework(self):
        return TrainingFramework.TORCH

    def to_dict(self):
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class CudaDevice:
    """Around the training function in each worker: its CUDA device made the current one (Ray's own context)."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        self.inner = TorchConfigContextManager()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class ProcessGroupBackend(Backend):
    share_cuda_visible_devices: bool = True  # every worker of a node sees the node's GPUs, as under TorchConfig

    def on_start(self, worker_group, backend_config: ProcessGroupConfig):
        addr, port = worker_group.execute_single(0, _reserve_port)
        worker_group.execute(_set_env, addr=addr, port=port)
        ray.get(
            [
                worker_group.execute_single_async(
                    rank,
                    _init_group,
                    backend=backend_config.backend,
                    world_rank=rank,
                    world_size=len(worker_group),
                    timeout_s=backend_config.timeout_s,
                )
                for rank in range(len(worker_group))
            ]
        )

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig):
        from ray.train.constants import (
            DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        )

        timeout = float(
            os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        )
        futures = worker_group.execute_async(_shutdown, destroy=len(worker_group) > 1)
        try:
            ray.get(futures, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            pass  # the workers' processes end with the group anyway


# Run in the workers (pickled by reference to this module): torch and Ray's torch helpers are imported there.
_reserved: socket.socket | None = None  # rank 0's: the group's port, held until the group's store listens on it


def _reserve_port() -> tuple[str, int]:
    """Rank 0: this node's address and a free port, kept bound until _init_group. Ray's own helper releases the
    port at once, and until rank 0's store listened on it, seconds later, any process of the node could take it
    (seen in the unit suite: EADDRINUSE, the run failed)."""
    global _reserved
    addr = ray.util.get_node_ip_address()
    _reserved = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    _reserved.bind(("", 0))
    return addr, _reserved.getsockname()[1]


def _set_env(addr: str, port: int) -> None:
    from ray.train.torch.config import _set_torch_distributed_env_vars

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    _set_torch_distributed_env_vars()


def _init_group(backend: str, world_rank: int, world_size: int, timeout_s: int) -> None:
    from ray.train.torch.config import _setup_torch_process_group

    global _reserved
    if _reserved is not None:  # rank 0: the store binds the port next
        _reserved.close()
        _reserved = None
    _setup_torch_process_group(backend, world_rank, world_size, "env://", timeout_s)


def _shutdown(destroy: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy)
