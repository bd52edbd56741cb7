"""Multi-node wiring as KubeRay builds it, on CPUs: a head that does no training (num-cpus 0, as the chart's
head has num-gpus 0) and two worker "pods", each a `ray start` joined to the head with room for one Ray Train
worker, sharing one storage path (the PVC). One TorchTrainer spans both nodes and checkpoints from both;
then one node goes away and the experiment resumes on the other alone (a world-size change, 2 -> 1)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from conftest import CLI_ENV, run_cli, tiny_overrides

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_ports() -> list[str]:
    # Every port of its own: several raylets share this host, as pods would share none.
    return [
        f"--{flag}={free_port()}"
        for flag in (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "metrics-export-port",
            "runtime-env-agent-port",
        )
    ]


class Node:
    def __init__(self, args: list[str], log: Path, env: dict):
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1", *args, *own_ports()],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        self.proc.terminate()  # `ray start --block` stops what it started
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def start_head(stack: ExitStack, port: int, cpus: int, temp: Path, tmp_path: Path, env: dict) -> Node:
    """The head node (KubeRay's head pod), stopped and its temp folder removed when `stack` closes."""
    head = Node(
        ["--head", f"--port={port}", f"--num-cpus={cpus}", "--include-dashboard=false", f"--temp-dir={temp}"],
        tmp_path / "head.log",
        env,
    )
    stack.callback(shutil.rmtree, temp, ignore_errors=True)
    stack.callback(head.stop)
    return head


def wait_for_cpus(address: str, cpus: int, env: dict, nodes: list[Node]) -> None:
    deadline = time.time() + 180
    probe = (
        f"import ray; ray.init(address='{address}', log_to_driver=False); "
        f"print(int(ray.cluster_resources().get('CPU', 0)))"
    )
    while True:
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1] == str(cpus):
            return
        assert time.time() < deadline and all(n.proc.poll() is None for n in nodes), out.stderr[-2000:]
        time.sleep(2)


@pytest.mark.slow  # three raylets on a 2-core CI machine: about 2 minutes, and sensitive to a loaded host
def test_two_nodes_checkpoint_then_resume_on_one(tiny_model, tmp_path):
    # Token auth on, as the chart's RayCluster has it (KubeRay injects these into every Ray container).
    env = {**os.environ, **CLI_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    address = f"127.0.0.1:{port}"
    temp = Path(tempfile.mkdtemp(prefix="rmn-", dir="/tmp"))  # Ray's socket paths must stay short
    storage = tmp_path / "pvc"
    sets = {
        "train.epochs": 1,
        "train.max_steps_per_epoch": 8,
        "checkpoint.every_steps": 2,
        "train.log_every_steps": 1,
        "deepspeed.zero_optimization.stage": 3,
    }
    with ExitStack() as stack:
        head = start_head(stack, port, 0, temp, tmp_path, env)
        wait_for_cpus(address, 0, env, [head])
        pods = []
        for name in ("pod-a", "pod-b"):
            pod = Node(
                [f"--address={address}", "--num-cpus=1", f'--resources={{"{name}": 1}}'], tmp_path / f"{name}.log", env
            )
            stack.callback(pod.stop)
            pods.append(pod)
        wait_for_cpus(address, 2, env, [head, *pods])

        # 2 workers of 1 CPU each, the head has none: one worker per node, by construction.
        first = run_cli(
            "train",
            *tiny_overrides(storage, "multinode", tiny_model, **sets, **{"train.stop_after_steps": 4}),
            env={**env, "RAY_ADDRESS": address},
        )
        log1 = first.stdout + first.stderr
        assert first.returncode == 0, log1[-6000:]
        assert "from scratch" in log1
        ckpt = storage / "multinode" / "checkpoints" / "step-00000004"
        # Both ranks wrote their shards (and RNG states) into the one shared folder.
        assert {p.name for p in ckpt.glob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}
        assert len(list((ckpt / "ds").glob("*optim_states.pt"))) == 2

        pods[1].stop()  # one "pod" is gone: the redeploy has one node of capacity
        wait_for_cpus(address, 1, env, [head, pods[0]])
        second = run_cli(
            "train",
            *tiny_overrides(storage, "multinode", tiny_model, **sets, **{"scaling.num_workers": 1}),
            env={**env, "RAY_ADDRESS": address},
        )
        log2 = second.stdout + second.stderr
        assert second.returncode == 0, log2[-6000:]
        assert "written by 2 workers" in log2 and "gradient_accumulation_steps 1 -> 2" in log2, log2[-4000:]
        assert "resumed from" in log2 and "global step 4" in log2, log2[-4000:]
        assert "done: multinode at global step 8" in log2, log2[-3000:]


@pytest.mark.slow  # two raylets and a CLI run on a 2-core CI machine: about 100 s (`make test-all`)
def test_preparation_runs_on_every_node_of_the_cluster(tiny_model, tmp_path):
    """`finetune prepare` against a cluster of two nodes of one CPU each (a head and a worker "pod", as KubeRay's
    CPU group would be): the data's three units are encoded by Ray Data actors on both nodes, the manifest says
    so, and the bytes equal those this process prepares alone."""
    import json

    from conftest import CORPUS

    env = {**os.environ, **CLI_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    address = f"127.0.0.1:{port}"
    temp = Path(tempfile.mkdtemp(prefix="rmp-", dir="/tmp"))
    corpus = tmp_path / "news.jsonl"
    corpus.write_text(CORPUS.read_text() * 5)  # 10,000 rows: 3 units of 4,096
    sets = {"data.dataset": str(corpus), "data.eval_fraction": 0}
    args = ("prepare", *tiny_overrides(tmp_path / "pvc", "prep", tiny_model, **sets))
    with ExitStack() as stack:
        head = start_head(stack, port, 1, temp, tmp_path, env)
        pod = Node([f"--address={address}", "--num-cpus=1"], tmp_path / "pod.log", env)
        stack.callback(pod.stop)
        wait_for_cpus(address, 2, env, [head, pod])
        done = run_cli(*args, env={**env, "RAY_ADDRESS": address})
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    folder = Path(next(line for line in done.stdout.splitlines() if line.startswith("prepared: ")).split(": ", 1)[1])
    manifest = json.loads((folder / "manifest.json").read_text())
    assert len(manifest["nodes"]) == 2 and sum(manifest["nodes"].values()) == 3, manifest["nodes"]
    assert "on up to 2 CPUs (Ray Data)" in log

    alone = run_cli(*args, "--set", f"experiment.storage_path={tmp_path / 'alone'}", env=env)  # a local cluster
    assert alone.returncode == 0, (alone.stdout + alone.stderr)[-4000:]
    again = Path(next(line for line in alone.stdout.splitlines() if line.startswith("prepared: ")).split(": ", 1)[1])
    assert again.name == folder.name
    for file in sorted((folder / "train").iterdir()):
        assert (again / "train" / file.name).read_bytes() == file.read_bytes(), file.name
