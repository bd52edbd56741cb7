"""The job trains through the real operator: `helm install` of examples/values-cpu.yaml, KubeRay's RayCluster
(head and two CPU workers) and submitter run on the pod runner's Node (tests/e2e/podrunner.py), the submitter
runs `finetune train` on the head, the RayJob ends Succeeded, the final model loads, and `finetune status`
shows the finished job with its progress."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from e2e import support
from e2e.controlplane import REPO

pytestmark = pytest.mark.e2e

CPU_VALUES = [REPO / "examples" / "values-cpu.yaml"]
TRAIN_TIMEOUT_S = 600
FINETUNE = str(Path(sys.executable).with_name("finetune"))


def put_model(runner, ns: str, claim: str, tiny_model: Path) -> Path:
    """The user's one-time step of values-cpu.yaml: the model onto the claim. Returns the claim's folder."""
    folder = runner.claim_dir(ns, claim)
    shutil.copytree(tiny_model, folder / "tiny-gpt2")
    return folder


def wait_job_end(cluster, runner, ns: str, job: str, timeout: float = TRAIN_TIMEOUT_S) -> dict:
    """The RayJob's status once it is Complete or Failed; on a timeout, fails with the pods' logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = support.job_status(cluster, ns, job)
        if status.get("jobDeploymentStatus") in ("Complete", "Failed"):
            return status
        time.sleep(2)
    raise AssertionError(f"RayJob {ns}/{job} did not end within {timeout:.0f} s: {status}\n{runner.logs(ns)[-30000:]}")


def running_pods(cluster, ns: str, selector: str, count: int) -> list[dict]:
    def pods():
        items = (support.get(cluster, "pods", ns, selector=selector) or {}).get("items", [])
        running = [p for p in items if p.get("status", {}).get("phase") == "Running"]
        return running if len(running) >= count else None
    return support.wait_for(pods, f"{count} running pods with {selector}", timeout=180)


def total_steps(values: Path) -> int:
    train = yaml.safe_load(values.read_text())["training"]["train"]
    return train["epochs"] * train["max_steps_per_epoch"]


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def finetune_status(cluster, ns: str, experiment: str) -> subprocess.CompletedProcess:
    return subprocess.run([FINETUNE, "status", experiment, "-n", ns], capture_output=True, text=True,
                          env=cluster.env(), timeout=60)


def test_helm_install_trains_the_tiny_model(cluster, namespace, pod_runner, tiny_model):
    ns, t0 = namespace, time.monotonic()
    claim = put_model(pod_runner, ns, "ft", tiny_model)
    support.install(cluster, "ft", ns, CPU_VALUES)
    ray_cluster = support.wait_for(lambda: support.job_status(cluster, ns, "ft").get("rayClusterName"),
                                   "rayClusterName on the RayJob")
    pods = running_pods(cluster, ns, f"ray.io/cluster={ray_cluster}", 3)
    assert sorted(support.group_of(p) for p in pods) == ["head", "worker/cpu", "worker/cpu"]

    status = wait_job_end(cluster, pod_runner, ns, "ft")
    assert (status["jobDeploymentStatus"], status.get("jobStatus")) == ("Complete", "SUCCEEDED"), \
        f"{status}\n{pod_runner.logs(ns)[-30000:]}"
    submitter = support.get(cluster, "job", ns, "ft")
    assert "finetune train" in json.dumps(submitter["spec"]["template"]["spec"]["containers"]), "the submitter's command"
    print(f"\nhelm install -> RayJob Succeeded: {time.monotonic() - t0:.0f} s")

    run = claim / "ft"
    steps = [m["step"] for m in metrics(run) if "loss" in m and "step" in m]
    assert steps and steps[-1] == total_steps(CPU_VALUES[0]) and steps == sorted(set(steps)), steps

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert sum(p.numel() for p in model.parameters()) > 0

    out = finetune_status(cluster, ns, "ft")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "experiment ft in namespace" in out.stdout and ": succeeded" in out.stdout, out.stdout
    assert f"step         {steps[-1]}/{steps[-1]} (100%)" in out.stdout, out.stdout
