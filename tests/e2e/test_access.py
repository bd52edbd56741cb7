"""`finetune status / logs / resume` and the progress annotation against the real API server, with the token of
the chart's own ServiceAccount (TokenRequest) and with an admin's credentials."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from app import kube, lease
from app.exit_codes import Exit
from app.progress import ProgressPublisher
from e2e import support
from e2e.controlplane import kubeconfig

pytestmark = pytest.mark.e2e


def sa_kubeconfig(cluster, ns: str, sa: str, path):
    token = cluster.kubectl("create", "token", sa, "-n", ns, "--duration", "1h").stdout.strip()
    cfg = kubeconfig(path, cluster.server, cluster.pki / "ca.crt", token=token)
    data = json.loads(cfg.read_text())
    data["contexts"][0]["context"]["namespace"] = ns
    cfg.write_text(json.dumps(data))
    return cfg


def progress_of(cluster, ns: str, job: str) -> dict | None:
    annotations = (support.get(cluster, "rayjob", ns, job) or {}).get("metadata", {}).get("annotations") or {}
    value = annotations.get(kube.PROGRESS_ANNOTATION)
    return json.loads(value) if value else None


def test_the_charts_serviceaccount_may_publish_progress_and_nothing_else(cluster, namespace, tmp_path, monkeypatch):
    ns = namespace
    support.install(cluster, "ft", ns, sets=["training.experiment.name=exp-a"])
    support.install(cluster, "other", ns, sets=["training.experiment.name=exp-b"])
    support.assert_not_validation_failed(cluster, ns, "exp-a")
    cfg = sa_kubeconfig(cluster, ns, "exp-a", tmp_path / "sa.kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(cfg))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    # Allowed: the app's own publisher patches its experiment's RayJob.
    pub = ProgressPublisher("exp-a", ns, interval_s=0.1)
    pub.update({"step": 7, "loss": 1.5, "total_steps": 20}, force=True)
    pub.close()
    assert pub.published >= 1
    assert progress_of(cluster, ns, "exp-a")["step"] == 7

    # Not allowed: another experiment's RayJob (the publisher warns and keeps training), and anything else.
    other = ProgressPublisher("exp-b", ns, interval_s=0.1)
    other.update({"step": 1}, force=True)
    other.close()
    assert other.published == 0 and progress_of(cluster, ns, "exp-b") is None
    for args in (
        ["get", "rayjob", "exp-b"],
        ["delete", "rayjob", "exp-a"],
        ["get", "rayjobs"],
        ["get", "secrets"],
        ["get", "pods"],
        ["get", "pod", "exp-a-head"],
    ):
        out = cluster.kubectl(*args, "-n", ns, kubeconfig=cfg, check=False)
        assert out.returncode != 0 and "Forbidden" in out.stderr, (args, out.stderr)
    # Allowed: the driver's lease records its own RayJob's uid, read by name with this account.
    monkeypatch.setenv("FINETUNE_RAYJOB_NAME", "exp-a")
    monkeypatch.setenv("FINETUNE_RAYJOB_NAMESPACE", ns)
    uid = support.get(cluster, "rayjob", ns, "exp-a")["metadata"]["uid"]
    assert lease.own_rayjob() == {"namespace": ns, "name": "exp-a", "uid": uid}
    monkeypatch.setenv("FINETUNE_RAYJOB_NAME", "exp-b")
    assert lease.own_rayjob() is None  # another experiment's RayJob: forbidden, so no early takeover

    # The operations commands say so, in one line naming the action, and exit 6 (the API cannot be asked).
    for cmd in (["status", "exp-a"], ["logs", "exp-a"], ["resume", "exp-a", "--force"]):
        out = run_cli(*cmd, "-n", ns, env={"KUBECONFIG": str(cfg)}, timeout=60)
        assert out.returncode == Exit.API_UNREACHABLE, (cmd, out.returncode, out.stderr)
        assert "forbidden (403" in out.stderr and "rayjobs" in out.stderr, (cmd, out.stderr)
        assert "Traceback" not in out.stderr
    assert support.get(cluster, "rayjob", ns, "exp-a"), "the forbidden resume deleted the RayJob"


def test_status_and_resume_with_an_admin(cluster, namespace, tmp_path):
    ns = namespace
    support.install(cluster, "ft", ns)
    support.assert_not_validation_failed(cluster, ns, "ft")
    first = support.wait_for(lambda: support.job_status(cluster, ns, "ft").get("rayClusterName"), "RayCluster")
    cluster.kubectl(
        "annotate",
        "rayjob",
        "ft",
        "-n",
        ns,
        f"{kube.PROGRESS_ANNOTATION}={json.dumps({'step': 3, 'total_steps': 10, 'loss': 2.25})}",
    )
    env = {"KUBECONFIG": str(cluster.admin_kubeconfig)}

    out = run_cli("status", "ft", "-n", ns, "-o", "json", env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    jobs = json.loads(out.stdout)["rayjobs"]
    assert any(j.get("name") == "ft" and (j.get("progress") or {}).get("step") == 3 for j in jobs), out.stdout

    # Pending (no kubelet here): resume refuses without --force, and with it re-creates the job (the old
    # RayCluster goes through the real garbage collector; the claim stays).
    out = run_cli("resume", "ft", "-n", ns, env=env, timeout=60)
    assert out.returncode != 0 and "--force" in out.stderr, out.stderr
    old = support.get(cluster, "rayjob", ns, "ft")["metadata"]["uid"]
    out = run_cli("resume", "ft", "-n", ns, "--force", "--wait", "90", env=env, timeout=150)
    assert out.returncode == 0, out.stderr
    new = support.get(cluster, "rayjob", ns, "ft")
    assert new["metadata"]["uid"] != old
    assert kube.PROGRESS_ANNOTATION not in (new["metadata"].get("annotations") or {})
    assert not support.get(cluster, "raycluster", ns, first), "the old RayCluster survived the resume"
    second = support.wait_for(lambda: support.job_status(cluster, ns, "ft").get("rayClusterName"), "new RayCluster")
    assert second != first
    assert support.get(cluster, "pvc", ns, "ft"), "resume removed the claim"
