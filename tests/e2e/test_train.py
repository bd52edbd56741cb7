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


def fault_env(**env: str) -> list[str]:
    """--set-json of the chart's `env` (every Ray container; the driver passes FINETUNE_FAULT_* to the workers)."""
    return [f"env={json.dumps([{'name': k, 'value': v} for k, v in env.items()])}"]


def install(cluster, ns: str, set_json: list[str] = ()) -> None:
    args = ["-f", str(CPU_VALUES[0])] + [a for s in set_json for a in ("--set-json", s)]
    cluster.helm("install", "ft", str(support.CHART), "-n", ns, "--server-side=true", *args)


def paused(run: Path, phase: str, step: int, timeout: float = TRAIN_TIMEOUT_S) -> Path:
    """Waits for the fault hook's marker: rank 0 is paused at `phase` of step `step`'s checkpoint save."""
    marker = run / f".fault-paused-{phase}-{step}"
    support.wait_for(marker.exists, f"training paused at {phase} of step {step} ({marker})", timeout=timeout)
    return marker


def registered(run: Path, step: int, timeout: float = 60) -> None:
    """Waits until Ray Train has registered step `step`'s checkpoint (its checkpoint_manager_snapshot.json, which
    its controller writes a few seconds after the ranks report). A resume trusts that record: a checkpoint that
    is complete on disk but not registered yet is removed at resume (app/checkpoint.py remove_newer)."""
    snapshot = run / "checkpoint_manager_snapshot.json"
    name = f"step-{step:08d}"

    def done():
        try:
            latest = json.loads(snapshot.read_text()).get("latest_checkpoint_result") or {}
        except (OSError, ValueError):
            return False
        return latest.get("checkpoint_dir_name", "").endswith(name)
    support.wait_for(done, f"Ray's record of checkpoint {name} in {snapshot}", timeout=timeout)


def runs(run: Path) -> list[list[int]]:
    """The logged training steps of each attempt in metrics.jsonl (an attempt begins with its start-up record)."""
    out: list[list[int]] = []
    for m in metrics(run):
        if m.get("kind") == "startup":
            out.append([])
        elif m.get("kind") == "train" and out:
            out[-1].append(m["step"])
    return [r for r in out if r]


def log_every() -> int:
    return yaml.safe_load(CPU_VALUES[0].read_text())["training"]["train"]["log_every_steps"]


def test_redeploy_resumes_at_the_checkpoint(cluster, namespace, pod_runner, tiny_model):
    """The RayJob is deleted while it trains, after the checkpoint of step 10 (rank 0 held at the start of step
    15's save); `helm uninstall` and `helm install` under the same name start a new cluster whose run resumes
    at step 10 and finishes: no step before it is redone, none after it is skipped."""
    ns = namespace
    run = put_model(pod_runner, ns, "ft", tiny_model) / "ft"
    install(cluster, ns, fault_env(FINETUNE_FAULT_SAVE_PAUSE="before_shards:600:15"))
    paused(run, "before_shards", 15)
    registered(run, 10)
    first = support.job_status(cluster, ns, "ft")["rayClusterName"]
    cluster.kubectl("delete", "rayjob", "ft", "-n", ns)
    cluster.helm("uninstall", "ft", "-n", ns)
    support.wait_for(lambda: not (support.get(cluster, "pods", ns, selector=f"ray.io/cluster={first}") or {}).get("items"),
                     "the first cluster's pods gone")

    install(cluster, ns)  # the same release name, without the fault
    status = wait_job_end(cluster, pod_runner, ns, "ft")
    assert (status["jobDeploymentStatus"], status.get("jobStatus")) == ("Complete", "SUCCEEDED"), \
        f"{status}\n{pod_runner.logs(ns)[-30000:]}"
    attempts = runs(run)
    assert len(attempts) == 2, attempts
    before, after = attempts
    assert 10 <= before[-1] < 15, before
    assert 10 < after[0] <= 10 + log_every() and after == sorted(set(after)), after
    assert after[-1] == total_steps(CPU_VALUES[0]), after
    out = finetune_status(cluster, ns, "ft")
    assert "resumed from" in out.stdout and "step-00000010" in out.stdout, out.stdout


def test_a_deleted_worker_pod_recovers(cluster, namespace, pod_runner, tiny_model):
    """A worker pod deleted while the job trains (rank 0 held at the start of step 15's save, after the
    checkpoint of step 10): the operator replaces the pod, the run recovers (a KubeRay retry: a new cluster
    that resumes from step 10) and finishes; no complete checkpoint is lost. Prints deletion -> training again."""
    ns = namespace
    run = put_model(pod_runner, ns, "ft", tiny_model) / "ft"
    install(cluster, ns, fault_env(FINETUNE_FAULT_SAVE_PAUSE="before_shards:600:15"))
    paused(run, "before_shards", 15)
    registered(run, 10)
    complete = sorted(p.name for p in run.glob("checkpoints/*") if (p / "trainer_state.json").exists())
    ray_cluster = support.job_status(cluster, ns, "ft")["rayClusterName"]
    worker = running_pods(cluster, ns, f"ray.io/cluster={ray_cluster},ray.io/node-type=worker", 2)[0]
    logged = sum(1 for m in metrics(run) if m.get("kind") == "train")
    t_delete = time.monotonic()
    cluster.kubectl("delete", "pod", worker["metadata"]["name"], "-n", ns, "--wait=false")
    (run / ".fault-continue-before_shards-15").touch()  # the retried attempt passes step 15 without a pause

    def training_again():
        return sum(1 for m in metrics(run) if m.get("kind") == "train") > logged
    support.wait_for(training_again, "a training step after the worker pod was deleted", timeout=TRAIN_TIMEOUT_S)
    print(f"\nworker pod deleted -> training again: {time.monotonic() - t_delete:.0f} s")

    status = wait_job_end(cluster, pod_runner, ns, "ft")
    assert (status["jobDeploymentStatus"], status.get("jobStatus")) == ("Complete", "SUCCEEDED"), \
        f"{status}\n{pod_runner.logs(ns)[-30000:]}"
    after = runs(run)[-1]
    assert after[-1] == total_steps(CPU_VALUES[0]), runs(run)
    still = {p.name for p in run.glob("checkpoints/*") if (p / "trainer_state.json").exists()}
    keep = yaml.safe_load(CPU_VALUES[0].read_text())["training"]["checkpoint"]["keep"]
    # Kept checkpoints rotate (keep N), so an old one may go: but only for newer complete ones.
    assert len(still) >= min(keep, len(complete)) and max(still) >= max(complete), (complete, sorted(still))


def test_restricted_namespace_trains(cluster, namespace, pod_runner, tiny_model):
    """Pod Security "restricted" enforced by the real admission plugin: the head, workers and submitter are
    admitted and the job trains to the end."""
    ns = namespace
    cluster.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/enforce-version=latest")
    put_model(pod_runner, ns, "ft", tiny_model)
    install(cluster, ns)
    status = wait_job_end(cluster, pod_runner, ns, "ft")
    assert (status["jobDeploymentStatus"], status.get("jobStatus")) == ("Complete", "SUCCEEDED"), \
        f"{status}\n{pod_runner.logs(ns)[-30000:]}"
    events = cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    assert "violates PodSecurity" not in events
