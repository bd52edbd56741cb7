"""`finetune status / logs / resume` through the real `kubernetes` client against tests/fake_k8s.py.

No Kubernetes API server can run here: the fake serves the REST paths these commands use with the API's
semantics and checks every RayJob body it receives against the KubeRay CRD schema
(k8s_support.crds_dir()).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import threading

import pytest
from conftest import run_cli
from fake_k8s import FakeKube
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from app import cli, kube, ops
from app.exit_codes import Exit

NS = "ml"
SERVER_FIELDS = (
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "finalizers",
)
PROGRESS = {
    "step": 40,
    "total_steps": 100,
    "epoch": 0,
    "loss": 2.3141,
    "eval_loss": 2.41,
    "tokens_per_s_per_gpu": 1234.5,
    "eta_s": 310.0,
    "last_checkpoint": "/mnt/checkpoints/exp1/checkpoints/step-00000040",
    "last_checkpoint_step": 40,
    "world_size": 4,
    "resumed_from": None,
    "updated_at": "2026-11-30T03:00:00Z",
}
RUNNING = {
    "jobStatus": "RUNNING",
    "jobDeploymentStatus": "Running",
    "rayClusterName": "exp1-raycluster-x7k2p",
    "jobId": "exp1-abcde",
    "startTime": "2026-11-30T02:00:00Z",
    "failed": 1,
    "succeeded": 0,
}
FAILED = {
    "jobStatus": "FAILED",
    "jobDeploymentStatus": "Failed",
    "rayClusterName": "exp1-raycluster-x7k2p",
    "startTime": "2026-11-30T02:00:00Z",
    "endTime": "2026-11-30T03:00:00Z",
    "failed": 3,
    "succeeded": 0,
    "reason": "AppFailed",
    "message": "Job entrypoint command failed with exit code 1",
}
SUCCEEDED = {
    "jobStatus": "SUCCEEDED",
    "jobDeploymentStatus": "Complete",
    "rayClusterName": "exp1-raycluster-x7k2p",
    "startTime": "2026-11-30T02:00:00Z",
    "endTime": "2026-11-30T04:00:00Z",
    "succeeded": 1,
    "failed": 0,
}


def rayjob(name: str = "exp1", experiment: str = "exp1", progress: dict | None = None) -> dict:
    """A RayJob shaped like the chart's: own RayCluster, GPU workers, checkpoint PVC, experiment label."""
    pod_volumes = [
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": f"{experiment}-checkpoints"}},
        {"name": "config", "configMap": {"name": f"{experiment}-config"}},
    ]
    mounts = [{"name": "checkpoints", "mountPath": "/mnt/checkpoints"}, {"name": "config", "mountPath": "/config"}]
    env = [
        {"name": "FINETUNE_RAYJOB_NAME", "value": name},
        {"name": "FINETUNE_RAYJOB_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    annotations = {"meta.helm.sh/release-name": experiment, "meta.helm.sh/release-namespace": NS}
    if progress:
        annotations[kube.PROGRESS_ANNOTATION] = json.dumps(progress)
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {
            "name": name,
            "namespace": NS,
            "annotations": annotations,
            "labels": {
                kube.EXPERIMENT_LABEL: experiment,
                "app.kubernetes.io/name": "ray-deepspeed-finetune",
                "app.kubernetes.io/instance": experiment,
                "app.kubernetes.io/managed-by": "Helm",
            },
        },
        "spec": {
            "entrypoint": "finetune train /config/training.yaml",
            "backoffLimit": 2,
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "rayClusterSpec": {
                "rayVersion": "2.60.0",
                "headGroupSpec": {
                    "rayStartParams": {"num-gpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {
                        "metadata": {"labels": {kube.EXPERIMENT_LABEL: experiment}},
                        "spec": {
                            "serviceAccountName": f"{experiment}-progress",
                            "containers": [
                                {
                                    "name": "ray-head",
                                    "image": "ghcr.io/example/finetune:0.1.0",
                                    "env": env,
                                    "resources": {"limits": {"cpu": "4", "memory": "16Gi"}},
                                    "volumeMounts": mounts,
                                    "ports": [{"containerPort": 8265, "name": "dashboard"}],
                                }
                            ],
                            "volumes": pod_volumes,
                        },
                    },
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "gpu",
                        "replicas": 2,
                        "minReplicas": 2,
                        "maxReplicas": 2,
                        "rayStartParams": {},
                        "template": {
                            "spec": {
                                "containers": [
                                    {
                                        "name": "ray-worker",
                                        "image": "ghcr.io/example/finetune:0.1.0",
                                        "resources": {"limits": {"nvidia.com/gpu": 1, "cpu": "8", "memory": "64Gi"}},
                                        "volumeMounts": mounts,
                                    }
                                ],
                                "tolerations": [
                                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                                ],
                                "nodeSelector": {"nvidia.com/gpu.present": "true"},
                                "volumes": pod_volumes,
                            }
                        },
                    }
                ],
            },
        },
    }


@pytest.fixture
def fake(tmp_path, monkeypatch):
    server = FakeKube(finalize_delay_s=0.3).start()
    monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # resume saves the spec here
    yield server
    server.stop()
    assert server.schema_errors == [], "a command sent a RayJob the KubeRay CRD schema rejects"


def finetune(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the real CLI in-process; (exit code, stdout, stderr)."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# status
def test_status_running_shows_state_and_progress(fake, capsys):
    fake.add_rayjob(rayjob(progress=PROGRESS), status=RUNNING, finalizers=["ray.io/rayjob-finalizer"])
    code, out, _ = finetune(capsys, "status", "exp1")
    assert code == 0
    assert "experiment exp1 in namespace ml: running" in out
    assert "exp1-raycluster-x7k2p" in out and "RUNNING" in out
    assert "step         40/100 (40%)" in out and "2.3141" in out and "1,234 tokens/s per GPU" in out
    assert "step-00000040 (step 40)" in out and "5m10s" in out

    code, out, _ = finetune(capsys, "status", "exp1", "-o", "json")
    doc = json.loads(out)
    assert code == 0 and doc["state"] == "running" and doc["namespace"] == NS
    (job,) = doc["rayjobs"]
    assert job["progress"] == PROGRESS
    assert (job["jobStatus"], job["jobDeploymentStatus"], job["failed"], job["backoffLimit"]) == (
        "RUNNING",
        "Running",
        1,
        2,
    )
    lists = [r for r in fake.requests if r["method"] == "GET" and r["path"].endswith("/rayjobs")]
    assert lists[-1]["query"]["labelSelector"] == [f"{kube.EXPERIMENT_LABEL}=exp1"]


def test_status_failed_exits_1_with_reason(fake, capsys):
    fake.add_rayjob(rayjob(), status=FAILED)
    code, out, _ = finetune(capsys, "status", "exp1")
    assert code == 1
    assert "failed" in out and "AppFailed: Job entrypoint command failed" in out
    assert "progress of exp1: none published yet" in out


def test_status_succeeded_and_newest_of_several_decides(fake, capsys):
    fake.add_rayjob(rayjob("exp1-old"), status=FAILED, created="2026-11-29T00:00:00Z")
    fake.add_rayjob(rayjob("exp1-new"), status=SUCCEEDED, created="2026-11-30T00:00:00Z")
    fake.add_rayjob(rayjob("other", experiment="other"), status=FAILED)
    code, out, _ = finetune(capsys, "status", "exp1", "-o", "json")
    doc = json.loads(out)
    assert code == 0 and doc["state"] == "succeeded"
    assert [j["name"] for j in doc["rayjobs"]] == ["exp1-old", "exp1-new"]


def test_status_missing_exits_2(fake, capsys):
    fake.add_rayjob(rayjob("other", experiment="other"), status=RUNNING)
    code, out, err = finetune(capsys, "status", "exp1")
    assert code == Exit.NOT_FOUND and out == ""
    assert f"no RayJob labelled {kube.EXPERIMENT_LABEL}=exp1 in namespace ml" in one_line(err)
    code, out, err = finetune(capsys, "status", "exp1", "-n", "elsewhere", "-o", "json")
    assert code == Exit.NOT_FOUND and json.loads(out)["rayjobs"] == [] and "namespace elsewhere" in one_line(err)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("forbidden", "forbidden (403"),
        ("unauthorized", "rejected the credentials (401"),
        ("no-crd", "KubeRay operator and its CRDs"),
        ("down", "connection refused"),
        ("silent", "did not answer in time"),
    ],
)
def test_status_api_errors_are_one_line(fake, capsys, monkeypatch, tmp_path, case, expected):
    if case in ("forbidden", "unauthorized", "no-crd"):
        fake.mode = case
    elif case == "down":
        fake.stop()
    else:  # a server that accepts connections and never answers
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        monkeypatch.setattr(ops, "TIMEOUT", (0.5, 0.5))
        fake.write_kubeconfig(tmp_path / "kubeconfig", NS, server=f"http://127.0.0.1:{silent.getsockname()[1]}")
    code, out, err = finetune(capsys, "status", "exp1")
    line = one_line(err)
    assert code == Exit.API_UNREACHABLE and out == "" and expected in line, line
    if case == "forbidden":
        assert "kubectl auth can-i list rayjobs.ray.io -n ml" in line


def test_bad_input_is_one_line(fake, capsys):
    for argv in (["status", "Exp 1!"], ["resume", "x" * 64], ["logs", "exp1", "-n", "Bad_NS"]):
        code, out, err = finetune(capsys, *argv)
        assert code == Exit.INVALID and "is not a valid" in one_line(err)
    assert fake.requests == []


def test_no_credentials_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    code, _, err = finetune(capsys, "status", "exp1")
    assert code == Exit.API_UNREACHABLE and "no Kubernetes credentials" in one_line(err)


def test_console_script_help_and_errors():
    r = run_cli("status", "--help")
    assert r.returncode == 0 and "Exit 0 when running" in r.stdout and "-o {table,json}" in r.stdout
    r = run_cli("resume", "exp1", env={"KUBECONFIG": "/nonexistent", "KUBERNETES_SERVICE_HOST": ""})
    assert r.returncode == Exit.API_UNREACHABLE and "Traceback" not in r.stderr and r.stderr.count("\n") == 1


# resume
def stripped(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    obj.pop("status", None)
    for key in SERVER_FIELDS:
        obj["metadata"].pop(key, None)
    obj["metadata"].get("annotations", {}).pop(kube.PROGRESS_ANNOTATION, None)
    return obj


def test_resume_recreates_the_same_spec(fake, capsys, tmp_path):
    before = fake.add_rayjob(rayjob(progress=PROGRESS), status=FAILED, finalizers=["ray.io/rayjob-finalizer"])
    code, out, err = finetune(capsys, "resume", "exp1")
    assert code == 0, err
    after = fake.rayjob(NS, "exp1")
    assert after["metadata"]["uid"] != before["metadata"]["uid"]
    assert after["spec"] == before["spec"]  # the same spec, defaults included
    assert stripped(after) == stripped(before)  # labels, helm annotations kept; server fields, status, progress not
    assert kube.PROGRESS_ANNOTATION not in after["metadata"]["annotations"]
    assert "status" not in after
    assert "last published checkpoint /mnt/checkpoints/exp1/checkpoints/step-00000040 (step 40)" in out
    assert "created RayJob ml/exp1 again" in out

    delete = next(r for r in fake.requests if r["method"] == "DELETE")
    options = json.loads(delete["body"])
    assert options["propagationPolicy"] == "Foreground"  # its RayCluster goes before it
    assert options["preconditions"] == {
        "uid": before["metadata"]["uid"],
        "resourceVersion": before["metadata"]["resourceVersion"],
    }
    post = next(r for r in fake.requests if r["method"] == "POST")
    assert post["code"] == 201 and post["time"] > delete["time"] + 0.25  # waited for the finalizers
    assert not any(r["code"] == 409 for r in fake.requests)
    saved = next(tmp_path.glob("finetune-resume-ml-exp1-*.json"))
    assert json.loads(saved.read_text()) == stripped(before)


def test_resume_refuses_running_job_without_force(fake, capsys):
    before = fake.add_rayjob(rayjob(), status=RUNNING)
    code, out, err = finetune(capsys, "resume", "exp1")
    assert code == 1 and "is running" in one_line(err) and "--force" in err
    assert fake.rayjob(NS, "exp1")["metadata"]["uid"] == before["metadata"]["uid"]
    assert not any(r["method"] in ("DELETE", "POST") for r in fake.requests)

    code, out, err = finetune(capsys, "resume", "exp1", "--force")
    assert code == 0, err
    assert fake.rayjob(NS, "exp1")["spec"] == before["spec"]
    assert fake.rayjob(NS, "exp1")["metadata"]["uid"] != before["metadata"]["uid"]


def test_resume_missing_and_ambiguous(fake, capsys):
    code, _, err = finetune(capsys, "resume", "exp1")
    assert code == Exit.NOT_FOUND and "no RayJob labelled" in one_line(err)
    fake.add_rayjob(rayjob("exp1-a"), status=FAILED)
    fake.add_rayjob(rayjob("exp1-b"), status=FAILED)
    code, _, err = finetune(capsys, "resume", "exp1")
    assert code == 1 and "2 RayJobs carry" in one_line(err)
    assert not any(r["method"] == "DELETE" for r in fake.requests)


def test_resume_conflict_when_changed_meanwhile(fake, capsys):
    fake.add_rayjob(rayjob(), status=FAILED)
    # The operator writes status between our list and our delete: the precondition fails with 409.
    fake.before = lambda method, path: method == "DELETE" and fake.set_status(NS, "exp1", {**FAILED, "failed": 4})
    code, _, err = finetune(capsys, "resume", "exp1")
    assert code == Exit.API_UNREACHABLE and "conflict (409" in one_line(err)
    assert fake.rayjob(NS, "exp1") is not None


def test_resume_when_create_is_refused_keeps_the_spec(fake, capsys, tmp_path):
    before = fake.add_rayjob(rayjob(), status=FAILED)
    fake.forbidden_verbs = {"create"}
    code, _, err = finetune(capsys, "resume", "exp1")
    line = one_line(err)
    assert code == 1 and "deleted RayJob ml/exp1 but could not create it again" in line and "kubectl create -f" in line
    saved = next(tmp_path.glob("finetune-resume-ml-exp1-*.json"))
    assert str(saved) in line
    fake.forbidden_verbs = set()
    recreated = fake.add_rayjob(json.loads(saved.read_text()))  # what `kubectl create -f` would send
    assert recreated["spec"] == before["spec"]


# logs
def test_logs_of_submitter_head_and_follow(fake, capsys):
    fake.add_rayjob(rayjob(), status=RUNNING)
    fake.add_pod(
        NS,
        "exp1-old",
        {"batch.kubernetes.io/job-name": "exp1"},
        ["ray-job-submitter"],
        {"ray-job-submitter": "old attempt\n"},
        created="2026-11-30T01:00:00Z",
    )
    fake.add_pod(
        NS,
        "exp1-new",
        {"batch.kubernetes.io/job-name": "exp1"},
        ["ray-job-submitter"],
        {"ray-job-submitter": "".join(f"step {i}/100 loss 2.0\n" for i in range(1, 6))},
        created="2026-11-30T02:00:00Z",
    )
    fake.add_pod(
        NS,
        "exp1-raycluster-x7k2p-head-abc",
        {"ray.io/cluster": "exp1-raycluster-x7k2p", "ray.io/node-type": "head"},
        ["ray-head", "autoscaler"],
        {"ray-head": "Ray runtime started.\n"},
    )
    code, out, err = finetune(capsys, "logs", "exp1")
    assert code == 0 and out.startswith("step 1/100") and "old attempt" not in out and "pod exp1-new" in err
    code, out, _ = finetune(capsys, "logs", "exp1", "-f", "--tail", "2")
    assert code == 0 and out == "step 4/100 loss 2.0\nstep 5/100 loss 2.0\n"
    follow = [r for r in fake.requests if r["path"].endswith("/log")][-1]
    assert follow["query"]["follow"] == ["true"] and follow["query"]["container"] == ["ray-job-submitter"]
    code, out, err = finetune(capsys, "logs", "exp1", "--head")
    assert code == 0 and out == "Ray runtime started.\n" and "container ray-head" in err


def test_logs_sidecar_mode_and_not_ready(fake, capsys):
    job = rayjob()
    job["spec"]["submissionMode"] = "SidecarMode"
    fake.add_rayjob(job, status=RUNNING)
    head = {"ray.io/cluster": "exp1-raycluster-x7k2p", "ray.io/node-type": "head"}
    fake.add_pod(NS, "exp1-head", head, ["ray-head", "ray-job-submitter"], {"ray-job-submitter": "driver says hi\n"})
    code, out, _ = finetune(capsys, "logs", "exp1")
    assert code == 0 and out == "driver says hi\n"
    fake.add_pod(NS, "exp1-head", head, ["ray-head", "ray-job-submitter"], {}, phase="Pending")
    code, out, err = finetune(capsys, "logs", "exp1")
    assert code == Exit.API_UNREACHABLE and "waiting to start" in one_line(err)


def test_logs_before_the_cluster_exists(fake, capsys):
    fake.add_rayjob(rayjob(), status={"jobDeploymentStatus": "Initializing"})
    code, _, err = finetune(capsys, "logs", "exp1")
    assert code == Exit.NOT_FOUND and "no submitter pod and no RayCluster yet" in one_line(err)


# The fake behaves as the API server does, so the tests above mean something.
def test_fake_server_semantics(fake):
    cfg = client.Configuration()
    config.load_kube_config(config_file=os.environ["KUBECONFIG"], client_configuration=cfg)
    api = client.CustomObjectsApi(client.ApiClient(cfg))
    args = ("ray.io", "v1", NS, "rayjobs")
    created = api.create_namespaced_custom_object(*args, rayjob())
    assert created["spec"]["submissionMode"] == "K8sJobMode"  # CRD default filled in
    assert created["metadata"]["generation"] == 1
    with pytest.raises(ApiException) as exc:
        api.create_namespaced_custom_object(*args, rayjob())
    assert exc.value.status == 409 and json.loads(exc.value.body)["reason"] == "AlreadyExists"

    bad = rayjob("bad")
    bad["spec"]["backoffLimit"] = "two"
    bad["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = (
        "8265"
    )
    bad["spec"]["entryPoint"] = "typo"
    with pytest.raises(ApiException) as exc:
        api.create_namespaced_custom_object(*args, bad)
    status = json.loads(exc.value.body)
    assert exc.value.status == 422 and status["kind"] == "Status" and status["reason"] == "Invalid"
    assert "spec.backoffLimit" in status["message"] and "ports.0.containerPort" in status["message"]
    assert 'unknown field "spec.entryPoint"' in status["message"]
    fake.schema_errors.clear()

    stale = dict(created)
    patched = api.patch_namespaced_custom_object(*args, "exp1", {"metadata": {"annotations": {"a": "b"}}})
    assert int(patched["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    assert patched["metadata"]["generation"] == 1  # metadata-only change
    with pytest.raises(ApiException) as exc:
        api.replace_namespaced_custom_object(*args, "exp1", stale)
    assert exc.value.status == 409 and json.loads(exc.value.body)["reason"] == "Conflict"
    fresh = api.get_namespaced_custom_object(*args, "exp1")
    fresh["spec"]["backoffLimit"] = 5
    fresh["status"] = {"jobStatus": "SUCCEEDED"}
    replaced = api.replace_namespaced_custom_object(*args, "exp1", fresh)
    assert replaced["metadata"]["generation"] == 2 and "status" not in replaced  # status subresource
    with pytest.raises(ApiException) as exc:
        api.get_namespaced_custom_object(*args, "nope")
    assert exc.value.status == 404 and json.loads(exc.value.body)["message"] == 'rayjobs.ray.io "nope" not found'

    api.delete_namespaced_custom_object(*args, "exp1", propagation_policy="Foreground")
    terminating = api.get_namespaced_custom_object(*args, "exp1")
    assert (
        terminating["metadata"]["deletionTimestamp"] and "foregroundDeletion" in terminating["metadata"]["finalizers"]
    )
    with pytest.raises(ApiException) as exc:
        api.create_namespaced_custom_object(*args, rayjob())
    assert exc.value.status == 409 and "being deleted" in json.loads(exc.value.body)["message"]
    done = threading.Event()
    threading.Timer(0.6, done.set).start()
    done.wait()
    with pytest.raises(ApiException) as exc:
        api.get_namespaced_custom_object(*args, "exp1")
    assert exc.value.status == 404


def test_chart_rendered_rayjob_is_found_and_resumed(fake, capsys):
    """The contract with the chart: k8s/rayjob.yaml (the chart with its defaults) carries the experiment label
    these commands select on, passes the CRD schema, and survives resume unchanged."""
    import yaml
    from conftest import REPO

    manifest = REPO / "k8s" / "rayjob.yaml"
    if not manifest.is_file():
        pytest.skip("k8s/rayjob.yaml is not rendered yet")
    job = next(d for d in yaml.safe_load_all(manifest.read_text()) if d and d.get("kind") == "RayJob")
    experiment = (job["metadata"].get("labels") or {}).get(kube.EXPERIMENT_LABEL)
    assert experiment, (
        f"k8s/rayjob.yaml has no {kube.EXPERIMENT_LABEL} label (labels: {job['metadata'].get('labels')}): "
        "`finetune status/logs/resume` would not find it; the chart and app/kube.py must agree"
    )
    job["metadata"]["namespace"] = NS
    before = fake.add_rayjob(job, status=FAILED)
    code, out, _ = finetune(capsys, "status", experiment)
    assert code == 1 and job["metadata"]["name"] in out
    code, _, err = finetune(capsys, "resume", experiment)
    assert code == 0, err
    assert fake.rayjob(NS, job["metadata"]["name"])["spec"] == before["spec"]
