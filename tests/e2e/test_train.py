"""The job trains through the real operator, on the real node (tests/e2e/node.py: the kubelet runs every pod from
the image `make image` built, as uid 1000 under the chart's securityContext): `helm install`
of examples/values-cpu.yaml and `kubectl apply -k` of examples/k8s-cpu-overlay (KubeRay's RayCluster with a
head and two CPU workers, its submitter running `finetune train` on the head with Ray's token; the RayJob ends
Succeeded, the final model loads, `finetune status` shows the finished job and its progress), in a namespace
that enforces Pod Security "restricted"; a redeploy resumes at the checkpoint; a worker pod lost at once recovers
from the last checkpoint; a worker pod deleted gracefully (a preemption) saves its step in flight and the retry
redoes nothing."""

from __future__ import annotations

import base64
import http.client
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import k8s_support
import pytest
import yaml

from e2e import support
from e2e.controlplane import REPO

pytestmark = pytest.mark.e2e

CPU_VALUES = [REPO / "examples" / "values-cpu.yaml"]
TRAIN_TIMEOUT_S = 600
FINETUNE = str(Path(sys.executable).with_name("finetune"))


def put_model(node, ns: str, claim: str, tiny_model: Path) -> Path:
    """The user's one-time step of values-cpu.yaml: the model onto the claim. Returns the claim's folder."""
    folder = node.claim_dir(ns, claim)
    shutil.copytree(tiny_model, folder / "tiny-gpt2")
    return folder


def wait_job_end(cluster, node, ns: str, job: str, timeout: float = TRAIN_TIMEOUT_S) -> dict:
    """The RayJob's status once it is Complete or Failed; on a timeout, fails with the pods' logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = support.job_status(cluster, ns, job)
        if status.get("jobDeploymentStatus") in ("Complete", "Failed"):
            return status
        time.sleep(2)
    raise AssertionError(f"RayJob {ns}/{job} did not end within {timeout:.0f} s: {status}\n{node.logs(ns)[-30000:]}")


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
    return subprocess.run(
        [FINETUNE, "status", experiment, "-n", ns], capture_output=True, text=True, env=cluster.env(), timeout=60
    )


def test_helm_install_trains_the_tiny_model(cluster, namespace, node, tiny_model):
    ns, t0 = namespace, time.monotonic()
    claim = put_model(node, ns, "ft", tiny_model)
    support.install(cluster, "ft", ns, CPU_VALUES, sets=node.image_sets())
    ray_cluster = support.wait_for(
        lambda: support.job_status(cluster, ns, "ft").get("rayClusterName"), "rayClusterName on the RayJob"
    )
    pods = running_pods(cluster, ns, f"ray.io/cluster={ray_cluster}", 3)
    assert sorted(support.group_of(p) for p in pods) == ["head", "worker/cpu", "worker/cpu"]

    assert_trained(cluster, node, ns, "ft", claim)
    submitter = support.get(cluster, "job", ns, "ft")
    command = json.dumps(submitter["spec"]["template"]["spec"]["containers"])
    assert "ray job submit" in command and "finetune train" in command, command
    check_logs_through_the_kubelet(cluster, ns, "ft")
    peaks = [f"{support.group_of(p)} {node.memory_peak(p['metadata']['uid']) / 2**30:.2f}" for p in pods]
    print(f"\nmemory peaks (GiB) of the pods, limits 3 GiB each: {peaks}")
    print(f"\nhelm install -> RayJob Succeeded, model loaded, status shown: {time.monotonic() - t0:.0f} s")
    check_token_auth(cluster, ns, ray_cluster)


def check_logs_through_the_kubelet(cluster, ns: str, experiment: str) -> None:
    """`finetune logs` and `kubectl logs` of the submitter read the run's log from the kubelet: the driver's
    progress lines and its last line, the final model's path."""
    out = subprocess.run(
        [FINETUNE, "logs", experiment, "-n", ns], capture_output=True, text=True, env=cluster.env(), timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    final = f"final model: /mnt/cluster_storage/{experiment}/final"
    assert final in out.stdout and "step" in out.stdout, out.stdout[-5000:]
    assert "submitter" in out.stderr, out.stderr  # its header names the pod and container it read
    raw = cluster.kubectl("logs", "-n", ns, f"job/{experiment}").stdout
    assert final in raw, raw[-5000:]


def dashboard_get(ip: str, path: str, token: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(ip, 8265, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def head_and_token(cluster, ns: str, ray_cluster: str) -> tuple[str, str]:
    """The head pod's IP and the Ray token KubeRay generated for the cluster (its Secret, as the pods get it)."""
    head = support.get(cluster, "pods", ns, selector=f"ray.io/cluster={ray_cluster},ray.io/node-type=head")["items"][0]
    env = {e["name"]: e for e in support.ray_container(head)["env"]}
    ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = support.get(cluster, "secret", ns, ref["name"])
    return head["status"]["podIP"], base64.b64decode(secret["data"][ref["key"]]).decode()


def check_token_auth(cluster, ns: str, ray_cluster: str) -> None:
    """Ray token auth on the finished cluster (kept ttlSecondsAfterFinished): the head's dashboard refuses a
    request without the token KubeRay generated, and with it lists the job the submitter sent it."""
    ip, token = head_and_token(cluster, ns, ray_cluster)
    status, body = dashboard_get(ip, "/api/jobs/")
    assert status in (401, 403), (status, body[:300])
    assert dashboard_get(ip, "/api/jobs/", "not-the-token")[0] in (401, 403)
    status, body = dashboard_get(ip, "/api/jobs/", token)
    assert status == 200, (status, body[:300])
    jobs = json.loads(body)
    assert any("finetune train" in j.get("entrypoint", "") and j.get("status") == "SUCCEEDED" for j in jobs), jobs


def assert_trained(cluster, node, ns: str, experiment: str, claim: Path, total: int | None = None) -> None:
    """The RayJob ends Succeeded, metrics reach the last step (`total`; None: values-cpu.yaml's), final/ loads with
    from_pretrained, and `finetune status` shows the job succeeded with its progress at the last step."""
    status = wait_job_end(cluster, node, ns, experiment)
    assert (status["jobDeploymentStatus"], status.get("jobStatus")) == ("Complete", "SUCCEEDED"), (
        f"{status}\n{node.logs(ns)[-30000:]}"
    )
    run = claim / experiment
    steps = runs(run)[-1]  # the last attempt's
    assert steps[-1] == (total or total_steps(CPU_VALUES[0])) and steps == sorted(set(steps)), runs(run)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert sum(p.numel() for p in model.parameters()) > 0

    out = finetune_status(cluster, ns, experiment)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"experiment {experiment} in namespace {ns}: succeeded" in out.stdout, out.stdout
    assert f"step         {steps[-1]}/{steps[-1]} (100%)" in out.stdout, out.stdout + node.logs(ns)[-30000:]


def test_kubectl_apply_k_of_the_cpu_overlay_trains(cluster, namespace, node, tiny_model, tmp_path):
    """examples/k8s-cpu-overlay (k8s/ made the CPU smoke run), under an overlay that moves it into the test's
    namespace, applied with `kubectl apply -k`: the job trains like the Helm install."""
    ns = namespace
    shutil.copytree(k8s_support.K8S, tmp_path / "k8s")
    shutil.copytree(REPO / "examples" / "k8s-cpu-overlay", tmp_path / "examples" / "k8s-cpu-overlay")
    (tmp_path / "here").mkdir()
    repository, digest = node.app_ref.split("@")
    shipped = yaml.safe_load((support.CHART / "values.yaml").read_text())["image"]["repository"]  # k8s/'s image
    here = {
        "resources": ["../examples/k8s-cpu-overlay"],
        "namespace": ns,
        "images": [{"name": shipped, "newName": repository, "digest": digest}],
    }
    (tmp_path / "here" / "kustomization.yaml").write_text(yaml.safe_dump(here))
    claim = put_model(node, ns, "gpt2-agnews", tiny_model)
    cluster.kubectl("apply", "-k", str(tmp_path / "here"))
    assert_trained(cluster, node, ns, "gpt2-agnews", claim)


def fault_env(**env: str) -> list[str]:
    """--set-json of the chart's `env` (every Ray container; the driver passes FINETUNE_FAULT_* to the workers)."""
    return [f"env={json.dumps([{'name': k, 'value': v} for k, v in env.items()])}"]


def install(cluster, node, ns: str, set_json: list[str] = (), verb: str = "install", values=CPU_VALUES) -> None:
    """helm install (or upgrade) of release ft: `values`, the node's image, and --set-json of `set_json`."""
    args = support.values_args(values, node.image_sets()) + [a for s in set_json for a in ("--set-json", s)]
    cluster.helm(verb, "ft", str(support.CHART), "-n", ns, "--server-side=true", *args)


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


def rank_worker(cluster, node, ns: str, ray_cluster: str) -> dict:
    """A worker pod that runs a Ray Train rank (values-cpu.yaml gives the head no CPU for one)."""
    workers = running_pods(cluster, ns, f"ray.io/cluster={ray_cluster},ray.io/node-type=worker", 2)
    ranked = node.pods_running(ns, "ray::RayTrainWorker")
    return next((p for p in workers if p["metadata"]["name"] in ranked), None) or pytest.fail(
        f"no worker pod runs a rank: {ranked}"
    )


def log_every() -> int:
    return yaml.safe_load(CPU_VALUES[0].read_text())["training"]["train"]["log_every_steps"]


# Run in a training pod (kubectl exec): what the kernel says of each Ray Train worker process in it.
RANK_STATUS = """
import pathlib
for proc in pathlib.Path("/proc").glob("[0-9]*"):
    try:
        if proc.joinpath("cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
            keep = ("Uid", "Gid", "Groups", "CapPrm", "CapEff", "CapBnd", "NoNewPrivs", "Seccomp")
            lines = [l for l in proc.joinpath("status").read_text().splitlines() if l.split(":")[0] in keep]
            print(proc.name, "|".join(" ".join(l.split()) for l in lines))
    except OSError:
        pass
"""


def assert_ranks_confined(cluster, ns: str, pod: str) -> None:
    """The training processes of `pod`, read from inside it: uid 1000, gid 100 (the image's user; fsGroup 100
    among the groups), no capabilities at all, no_new_privs, and a seccomp filter (the chart's RuntimeDefault)."""
    out = cluster.kubectl("exec", "-n", ns, pod, "-c", "ray-worker", "--", "python", "-c", RANK_STATUS).stdout
    assert out.strip(), f"no Ray Train worker process in pod {pod}"
    for line in out.strip().splitlines():
        status = dict(field.split(" ", 1) for field in line.split(" ", 1)[1].split("|"))
        assert status["Uid:"].split() == ["1000"] * 4 and status["Gid:"].split() == ["100"] * 4, line
        assert "100" in status["Groups:"].split(), line
        assert {status[k] for k in ("CapPrm:", "CapEff:", "CapBnd:")} == {"0000000000000000"}, line
        assert (status["NoNewPrivs:"], status["Seccomp:"]) == ("1", "2"), line


def assert_claim_on_its_volume(cluster, ns: str, claim: str, folder: Path) -> str:
    """The claim is Bound to its PersistentVolume on `folder`, and what the run wrote there belongs to uid 1000,
    group 100; returns the volume's uid."""
    pvc = support.get(cluster, "pvc", ns, claim)
    assert pvc["status"]["phase"] == "Bound", pvc["status"]
    pv = support.get(cluster, "pv", "", pvc["spec"]["volumeName"])
    assert pv["spec"]["hostPath"]["path"] == str(folder), pv["spec"]
    written = [p for p in (folder / claim).rglob("*") if p.is_file()]
    assert written and {(p.stat().st_uid, p.stat().st_gid) for p in written} == {(1000, 100)}, written[:5]
    return pv["metadata"]["uid"]


def test_redeploy_resumes_at_the_checkpoint(cluster, namespace, node, tiny_model):
    """The RayJob is deleted while it trains, after the checkpoint of step 10 (rank 0 held at the start of step
    15's save); `helm uninstall` and `helm install` under the same name start a new cluster whose run resumes
    at step 10 and finishes: no step before it is redone, none after it is skipped. While it is held, the ranks'
    processes are read from inside their pods (uid 1000, no capabilities, seccomp); the claim is a real
    PersistentVolume, written by uid 1000 through group 100, and the redeploy finds the same volume."""
    ns = namespace
    folder = put_model(node, ns, "ft", tiny_model)
    run = folder / "ft"
    install(cluster, node, ns, fault_env(FINETUNE_FAULT_SAVE_PAUSE="before_shards:600:15"))
    paused(run, "before_shards", 15)
    registered(run, 10)
    first = support.job_status(cluster, ns, "ft")["rayClusterName"]
    assert_ranks_confined(cluster, ns, rank_worker(cluster, node, ns, first)["metadata"]["name"])
    volume = assert_claim_on_its_volume(cluster, ns, "ft", folder)
    t0 = time.monotonic()
    cluster.kubectl("delete", "rayjob", "ft", "-n", ns)
    cluster.helm("uninstall", "ft", "-n", ns)
    support.wait_for(
        lambda: not support.get(cluster, "pods", ns, selector=f"ray.io/cluster={first}")["items"],
        "the first cluster's pods gone",
        timeout=300,
    )
    print(f"\nRayJob deleted -> the first cluster's pods gone: {time.monotonic() - t0:.0f} s")

    install(cluster, node, ns)  # the same release name, without the fault
    status = wait_job_end(cluster, node, ns, "ft")
    assert (status["jobDeploymentStatus"], status.get("jobStatus")) == ("Complete", "SUCCEEDED"), (
        f"{status}\n{node.logs(ns)[-30000:]}"
    )
    attempts = runs(run)
    assert len(attempts) == 2, attempts
    before, after = attempts
    assert 10 <= before[-1] < 15, before
    assert 10 < after[0] <= 10 + log_every() and after == sorted(set(after)), after
    assert after[-1] == total_steps(CPU_VALUES[0]), after
    out = finetune_status(cluster, ns, "ft")
    assert "resumed from" in out.stdout and "step-00000010" in out.stdout, out.stdout
    assert assert_claim_on_its_volume(cluster, ns, "ft", folder) == volume


def test_a_deleted_worker_pod_recovers(cluster, namespace, node, tiny_model):
    """A worker pod that runs a rank lost at once (force-deleted, as its node's loss ends it: the kubelet's 1 s
    floor, too short for the preStop hook to save anything) while the job trains (rank 0 held at the start of step
    15's save, after the checkpoint of step 10, until the pod's processes are gone): the operator replaces the
    pod; the run recovers from step 10 (Ray Train restarts its worker group in the same job when `ray start`'s
    SIGTERM handler drains the node; otherwise the RayJob's retry starts a new cluster) and finishes; no complete
    checkpoint is lost. Prints deletion -> training again."""
    ns = namespace
    run = put_model(node, ns, "ft", tiny_model) / "ft"
    install(cluster, node, ns, fault_env(FINETUNE_FAULT_SAVE_PAUSE="before_shards:600:15"))
    paused(run, "before_shards", 15)
    registered(run, 10)
    complete = sorted(p.name for p in run.glob("checkpoints/*") if (p / "trainer_state.json").exists())
    ray_cluster = support.job_status(cluster, ns, "ft")["rayClusterName"]
    worker = rank_worker(cluster, node, ns, ray_cluster)
    name, uid = worker["metadata"]["name"], worker["metadata"]["uid"]
    t_delete = time.monotonic()
    cluster.kubectl("delete", "pod", name, "-n", ns, "--grace-period=0", "--force")
    support.wait_for(lambda: not node.pod_pids(uid), f"pod {name}'s processes gone")
    (run / ".fault-continue-before_shards-15").touch()  # the next attempt passes step 15 without a pause
    support.wait_for(
        lambda: len(runs(run)) > 1, "a training step after the worker pod was lost", timeout=TRAIN_TIMEOUT_S
    )
    print(f"\nworker pod deleted -> training again: {time.monotonic() - t_delete:.0f} s")

    status = wait_job_end(cluster, node, ns, "ft")
    assert (status["jobDeploymentStatus"], status.get("jobStatus")) == ("Complete", "SUCCEEDED"), (
        f"{status}\n{node.logs(ns)[-30000:]}"
    )
    before, after = runs(run)[0], runs(run)[-1]
    assert 10 <= before[-1] < 15 and 10 < after[0] <= 10 + log_every(), runs(run)
    assert after[-1] == total_steps(CPU_VALUES[0]) and after == sorted(set(after)), runs(run)
    print(f"recovered by: {status.get('failed') or 0} KubeRay retries, {len(runs(run))} training attempts")
    still = {p.name for p in run.glob("checkpoints/*") if (p / "trainer_state.json").exists()}
    keep = yaml.safe_load(CPU_VALUES[0].read_text())["training"]["checkpoint"]["keep"]
    # Kept checkpoints rotate (keep N), so an old one may go: but only for newer complete ones.
    assert len(still) >= min(keep, len(complete)) and max(still) >= max(complete), (complete, sorted(still))


def test_a_gracefully_deleted_worker_pod_saves_its_step_and_the_retry_redoes_nothing(
    cluster, namespace, node, tiny_model
):
    """`kubectl delete pod` of a worker while the job trains, with the chart's grace period (a preemption: a
    node drain, a spot reclaim). The kubelet runs the pod's preStop hook, `finetune preempt`, which asks the run
    to stop; rank 0 is held at the start of step 10's save (in the loop, before the state is copied for the
    background write) until that notice is there, so the step in flight is 11, not a
    periodic checkpoint step. Every rank finishes step 11, the run writes its checkpoint, releases the lease and
    exits 4 ("preempted at step 11"); the hook returns and the kubelet's SIGTERM ends the pod long before its
    grace period; the RayJob's retry (backoffLimit) starts a new cluster whose run resumes at step 12 and
    finishes: no step redone, none skipped, no complete checkpoint lost."""
    ns = namespace
    run = put_model(node, ns, "ft", tiny_model) / "ft"
    install(
        cluster,
        node,
        ns,
        fault_env(FINETUNE_FAULT_SAVE_PAUSE="before_shards:600:10") + ["training.train.log_every_steps=1"],
    )  # every step in metrics.jsonl: which ran, in which attempt
    paused(run, "before_shards", 10)
    complete = sorted(p.name for p in run.glob("checkpoints/*") if (p / "trainer_state.json").exists())
    ray_cluster = support.job_status(cluster, ns, "ft")["rayClusterName"]
    worker = rank_worker(cluster, node, ns, ray_cluster)
    name, grace = worker["metadata"]["name"], worker["spec"]["terminationGracePeriodSeconds"]
    t_delete = time.monotonic()
    cluster.kubectl("delete", "pod", name, "-n", ns, "--wait=false")  # the default: the pod's grace period

    notice = run / ".preempt"
    support.wait_for(notice.exists, f"the notice of {name}'s preStop hook ({notice})", timeout=120)
    assert name in json.loads(notice.read_text())["by"]
    (run / ".fault-continue-before_shards-10").touch()

    def gone():
        pods = support.get(cluster, "pods", ns)
        return pods is not None and name not in {p["metadata"]["name"] for p in pods["items"]}

    support.wait_for(gone, f"worker pod {name} gone", timeout=grace)
    t_gone = time.monotonic() - t_delete

    status = wait_job_end(cluster, node, ns, "ft")
    logs = node.logs(ns)
    assert (status["jobDeploymentStatus"], status.get("jobStatus")) == ("Complete", "SUCCEEDED"), (
        f"{status}\n{logs[-30000:]}"
    )
    # The steps first (metrics.jsonl on the volume), then what the user reads: a failure of the one then says
    # whether the run or only its log went wrong, in the few lines that matter of the pods' long logs.
    assert runs(run) == [list(range(1, 12)), list(range(12, total_steps(CPU_VALUES[0]) + 1))], runs(run)
    told = [line for line in logs.splitlines() if any(w in line for w in ("=== pod", "preempt", "resum", "Job '"))]
    assert "preempted at step 11, checkpoint written in" in logs and "to resume at step 12" in logs, "\n".join(told)
    assert status.get("failed") == 1, status  # one KubeRay retry: the preempted attempt
    still = {p.name for p in run.glob("checkpoints/*") if (p / "trainer_state.json").exists()}
    keep = yaml.safe_load(CPU_VALUES[0].read_text())["training"]["checkpoint"]["keep"]
    assert "step-00000011" in still and len(still) == keep and max(still) > max(complete), (complete, sorted(still))
    assert t_gone < grace / 2, f"pod {name} took {t_gone:.0f} s of its {grace} s grace period to end"
    print(
        f"\nworker pod deleted (grace {grace} s) -> pod gone {t_gone:.0f} s -> job complete "
        f"{time.monotonic() - t_delete:.0f} s; preempted at step 11, resumed at 12 after 1 KubeRay retry"
    )


def test_restricted_namespace_trains(cluster, namespace, node, tiny_model):
    """Pod Security "restricted" enforced by the real admission plugin: the head, workers and submitter are
    admitted and the job trains to the end."""
    ns = namespace
    cluster.kubectl(
        "label",
        "namespace",
        ns,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    )
    claim = put_model(node, ns, "ft", tiny_model)
    install(cluster, node, ns)
    assert_trained(cluster, node, ns, "ft", claim)
    events = cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    assert "violates PodSecurity" not in events


def test_persistent_cluster_runs_two_jobs_in_sequence(cluster, namespace, node, tiny_model):
    """examples/values-persistent.yaml over values-cpu.yaml: a RayCluster that outlives its jobs, the RayJob
    submitted by the operator over HTTP. The first job is deleted after the checkpoint of step 10 (rank 0 held
    at step 15's save); `helm upgrade` creates the RayJob again, and the second job, on the same cluster and
    pods, resumes the experiment at step 10 and finishes."""
    ns = namespace
    values = [*CPU_VALUES, REPO / "examples" / "values-persistent.yaml"]
    claim = put_model(node, ns, "ft", tiny_model)
    run = claim / "ft"
    pause = fault_env(FINETUNE_FAULT_SAVE_PAUSE="before_shards:600:15")
    install(cluster, node, ns, pause, values=values)
    paused(run, "before_shards", 15)
    registered(run, 10)
    pods = {p["metadata"]["uid"] for p in running_pods(cluster, ns, "ray.io/cluster=ft", 3)}
    cluster.kubectl("delete", "rayjob", "ft", "-n", ns)  # the operator stops the Ray job; the cluster stays
    ip, token = head_and_token(cluster, ns, "ft")

    def stopped():
        jobs = json.loads(dashboard_get(ip, "/api/jobs/", token)[1])
        return jobs and all(j["status"] in ("STOPPED", "FAILED", "SUCCEEDED") for j in jobs)

    support.wait_for(stopped, "the first Ray job stopped on the persistent cluster")
    # The cluster's pods keep the fault's env: let the second job pass step 15 without a pause.
    (run / ".fault-continue-before_shards-15").touch()
    install(cluster, node, ns, pause, verb="upgrade", values=values)
    assert_trained(cluster, node, ns, "ft", claim)
    assert {p["metadata"]["uid"] for p in running_pods(cluster, ns, "ray.io/cluster=ft", 3)} == pods, (
        "the second job did not run on the same cluster's pods"
    )
    first, second = runs(run)
    assert 10 <= first[-1] < 15 and 10 < second[0] <= 10 + log_every(), (first, second)


def test_chat_sft_with_lora_trains_and_exports_the_adapter(cluster, namespace, node, tiny_model):
    """examples/values-cpu.yaml made a chat SFT with LoRA (the bundled chat dataset, zephyr template): the job
    succeeds, final/ is the merged model and final/adapter/ the PEFT adapter, which agree."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ns = namespace
    claim = put_model(node, ns, "ft", tiny_model)
    # One key each: a whole `training` map would replace the values file's (its CPU scaling among it).
    chat = {
        "training.data.dataset": "examples/data/tiny-chat.jsonl",
        "training.data.chat_template": "zephyr",
        "training.data.seq_length": 128,
        "training.model.lora": {"r": 8, "alpha": 16},
    }
    install(cluster, node, ns, [f"{key}={json.dumps(value)}" for key, value in chat.items()])
    assert_trained(cluster, node, ns, "ft", claim)
    final = claim / "ft" / "final"
    base = AutoModelForCausalLM.from_pretrained(claim / "tiny-gpt2")
    adapted = PeftModel.from_pretrained(base, final / "adapter").eval()
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(final).eval()(ids).logits.float()
        assert torch.allclose(merged, adapted(ids).logits.float(), atol=5e-2)
