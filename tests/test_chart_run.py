"""The rendered job runs: no Kubernetes API server can run here, so the chart's wiring is proven by running
what it renders. The RayJob's entrypoint runs locally, on CPU, with the head container's env, the ConfigMap's
files where the pods mount them and the PVC's mount path mapped to a temp folder (the same folder for both
runs, as the volume outlives the job). It trains and checkpoints; deploying again under the same experiment
name resumes from the checkpoint instead of starting over. The same holds for k8s/rayjob.yaml."""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CLI_ENV, CORPUS
from k8s_support import K8S, container, one, parse, pod_templates, render, tool

NAMESPACE = "default"


def tiny_training(model: Path, more: dict[str, Any], **train: Any) -> dict[str, Any]:
    """Values (training.*) for a short CPU run of the tiny model on the bundled corpus."""
    out = {
        "model": {"name_or_path": str(model)},
        "data": {"dataset": str(CORPUS), "split": "train", "seq_length": 32},
        "train": {"max_steps_per_epoch": 8, "micro_batch_size": 4, "learning_rate": 3.0e-3, **train},
        "checkpoint": {"export_final": False},
    }
    for section, values in more.items():
        out.setdefault(section, {}).update(values)
    return out


def tiny_sets(model: Path, more: dict[str, Any], **train: Any) -> list[str]:
    """The same as --set arguments for the app (for k8s/, whose ConfigMap holds the chart's defaults)."""
    out = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            out.extend(["--set", f"{prefix[:-1]}={node}"])

    walk("", tiny_training(model, more, **train))
    return out


class LocalHead:
    """What a head pod of the rendered RayJob would see, on this machine."""

    def __init__(self, objects: list[dict[str, Any]], root: Path, storage: Path):
        self.job = one(objects, "RayJob")
        self.head = pod_templates(objects)["head"]
        self.ray = container(self.head, "ray-head")
        self.paths: dict[str, Path] = {}
        volumes = {v["name"]: v for v in self.head["spec"]["volumes"]}
        config = root / "config"
        for mount in self.ray["volumeMounts"]:
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                self.paths[mount["mountPath"]] = config
            elif "persistentVolumeClaim" in volume:
                self.paths[mount["mountPath"]] = storage
                self.storage_mount = mount["mountPath"]
        config.mkdir(parents=True, exist_ok=True)
        for name, text in one(objects, "ConfigMap")["data"].items():
            if name.endswith(".yaml"):
                # The chart's contract: the app writes its run folder on the volume, at the mount path.
                storage_path = yaml.safe_load(text)["experiment"]["storage_path"]
                assert storage_path.rstrip("/") == self.storage_mount.rstrip("/"), storage_path
            (config / name).write_text(self.rewrite(text))

    def rewrite(self, text: str) -> str:
        for mount in sorted(self.paths, key=len, reverse=True):
            text = text.replace(mount, str(self.paths[mount]))
        return text

    def env(self, token: str) -> dict[str, str]:
        env = {**os.environ, **CLI_ENV}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.pop("RAY_ADDRESS", None)
        for item in self.ray.get("env", []):
            if "value" in item:
                env[item["name"]] = self.rewrite(item["value"])
            elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
                env[item["name"]] = NAMESPACE
        # KubeRay injects these into every Ray container when authOptions.mode is token.
        if (self.job["spec"].get("rayClusterSpec", {}).get("authOptions") or {}).get("mode") == "token":
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        return env

    def entrypoint(self, extra: list[str]) -> str:
        return self.rewrite(self.job["spec"]["entrypoint"]) + "".join(f" {shlex.quote(a)}" for a in extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(head: LocalHead, cwd: Path, cluster: str, extra: list[str] = ()) -> subprocess.CompletedProcess:
    """Run the entrypoint as KubeRay would on the head: through a shell, with the head's env; either on a
    cluster started like a head pod starts it (ray start, RAY_ADDRESS set for the driver), or on the local
    cluster the driver starts itself."""
    env = head.env(secrets.token_hex(16))
    command = head.entrypoint(list(extra))
    ray_proc, temp, log = None, None, None
    try:
        if cluster == "ray-start":
            port = free_port()
            # A short temp dir: Ray's unix socket paths must stay under 108 characters.
            temp = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))
            log = (cwd / "ray-start.log").open("w")
            ray_proc = subprocess.Popen(
                [
                    tool("ray"),
                    "start",
                    "--head",
                    "--block",
                    f"--port={port}",
                    "--num-cpus=4",
                    "--num-gpus=0",
                    "--include-dashboard=false",
                    f"--temp-dir={temp}",
                    "--disable-usage-stats",
                    # Every port of its own: other Ray clusters may run on this machine at the same time.
                    *(
                        f"--{flag}={free_port()}"
                        for flag in (
                            "ray-client-server-port",
                            "dashboard-port",
                            "dashboard-agent-listen-port",
                            "dashboard-agent-grpc-port",
                            "metrics-export-port",
                            "runtime-env-agent-port",
                        )
                    ),
                ],
                env=env,
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
            deadline = time.time() + 180
            while subprocess.run(
                [tool("ray"), "status", f"--address=127.0.0.1:{port}"], env=env, capture_output=True, timeout=120
            ).returncode:
                assert ray_proc.poll() is None and time.time() < deadline, (cwd / "ray-start.log").read_text()[-3000:]
                time.sleep(2)
        return subprocess.run(command, shell=True, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    finally:
        if ray_proc is not None:
            ray_proc.terminate()  # ray start --block stops the processes it started
            try:
                ray_proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                ray_proc.kill()
        if log is not None:
            log.close()
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def assert_trains_then_resumes(
    first: subprocess.CompletedProcess, second: subprocess.CompletedProcess, storage: Path, name: str
) -> None:
    log1 = first.stdout + first.stderr
    assert first.returncode == 0, log1[-6000:]
    assert "from scratch" in log1 and "resumed from" not in log1, log1[-4000:]
    assert (storage / name / "checkpoints" / "step-00000004").is_dir(), sorted(storage.rglob("step-*"))
    log2 = second.stdout + second.stderr
    assert second.returncode == 0, log2[-6000:]
    assert "resumed from" in log2 and "global step 4" in log2, log2[-4000:]
    assert "from scratch" not in log2, log2[-4000:]
    assert f"done: {name} at global step 8" in log2, log2[-3000:]


@pytest.mark.parametrize(
    "source, cluster, workers",
    [
        # The chart's RayJob training and resuming is what tests/e2e/test_train.py proves through the real
        # operator (helm install -> Succeeded, redeploy -> resumed at the checkpoint): kept out of the unit suite's
        # 20 minutes, run by `make test-all`.
        pytest.param("chart", "embedded", 1, marks=pytest.mark.slow),
        pytest.param("chart", "ray-start", 2, marks=pytest.mark.slow),
        pytest.param("k8s", "embedded", 2, marks=pytest.mark.slow),
    ],
)
def test_rendered_job_trains_and_resumes(source, cluster, workers, tiny_model, tmp_path):
    """chart: `helm template` with the tiny model in values; k8s: k8s/ as committed (kubectl kustomize),
    its entrypoint with the tiny model's --set overrides appended (its ConfigMap holds the chart defaults)."""
    storage = tmp_path / "pvc"
    storage.mkdir()
    tiny = {"scaling": {"use_gpu": False, "num_workers": workers}, "data": {"loader_workers": 0}}

    def deploy(**train) -> tuple[LocalHead, list[str]]:
        if source == "chart":
            values = tmp_path / "values.yaml"
            values.write_text(yaml.safe_dump({"training": tiny_training(tiny_model, tiny, **train)}))
            return LocalHead(render([values], release="chart-run"), tmp_path / "pod", storage), []
        out = subprocess.run([tool("kubectl"), "kustomize", str(K8S)], capture_output=True, text=True, check=True)
        return LocalHead(parse(out.stdout), tmp_path / "pod", storage), tiny_sets(tiny_model, tiny, **train)

    head, extra = deploy(stop_after_steps=4)  # stops after step 4's checkpoint, as a preemption would
    first = run_job(head, tmp_path, cluster, extra)
    head, extra = deploy()  # deployed again under the same name
    second = run_job(head, tmp_path, cluster, extra)
    assert_trains_then_resumes(first, second, storage, head.job["metadata"]["name"])
