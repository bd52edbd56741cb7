"""Helm's life cycle on the real API server, with the real garbage collector and KubeRay operator."""

from __future__ import annotations

import pytest

from e2e import support

pytestmark = pytest.mark.e2e


def uid(cluster, kind: str, ns: str, name: str) -> str | None:
    obj = support.get(cluster, kind, ns, name)
    return obj["metadata"]["uid"] if obj else None


def ray_cluster_of(cluster, ns: str, job: str) -> str:
    return support.wait_for(
        lambda: support.job_status(cluster, ns, job).get("rayClusterName"), f"RayCluster of RayJob {ns}/{job}"
    )


def gone(cluster, ns: str, ray_cluster: str) -> bool:
    pods = (support.get(cluster, "pods", ns, selector=f"ray.io/cluster={ray_cluster}") or {}).get("items", [])
    return (
        not support.get(cluster, "rayjob", ns, "ft")
        and not support.get(cluster, "raycluster", ns, ray_cluster)
        and not pods
    )


def refused_second_release(cluster, ns: str, kind: str) -> None:
    out = support.install(cluster, "other", ns, sets=["training.experiment.name=ft"], check=False)
    assert out.returncode != 0, "a second release of experiment ft was installed"
    assert 'training.experiment.name: "ft" is already taken' in out.stderr, out.stderr
    assert f'its {kind} belongs to Helm release "ft"' in out.stderr, out.stderr
    assert cluster.helm("status", "other", "-n", ns, check=False).returncode != 0, "release 'other' exists"


def test_uninstall_keeps_the_claim_and_reinstall_adopts_it(cluster, namespace):
    ns = namespace
    support.install(cluster, "ft", ns)
    first = ray_cluster_of(cluster, ns, "ft")
    support.cluster_pods(cluster, ns, first, 3)
    claim = uid(cluster, "pvc", ns, "ft")
    refused_second_release(cluster, ns, "RayJob")

    cluster.helm("uninstall", "ft", "-n", ns)
    # The chart deletes only the RayJob; its RayCluster and pods go through owner references (the real GC).
    support.wait_for(lambda: gone(cluster, ns, first), "RayJob, RayCluster and pods gone after helm uninstall")
    assert uid(cluster, "pvc", ns, "ft") == claim, "helm uninstall deleted (or replaced) the checkpoint claim"
    refused_second_release(cluster, ns, "PersistentVolumeClaim")

    support.install(cluster, "ft", ns)
    second = ray_cluster_of(cluster, ns, "ft")
    assert second != first
    assert uid(cluster, "pvc", ns, "ft") == claim, "reinstall did not adopt the kept claim"
    pods = support.cluster_pods(cluster, ns, second, 3)
    for pod in pods:
        claims = {
            v["persistentVolumeClaim"]["claimName"]
            for v in support.mounts(pod).values()
            if "persistentVolumeClaim" in v
        }
        assert claims == {"ft"}, f"pod {pod['metadata']['name']} mounts {claims}"


def test_upgrade_with_changed_values_recreates_the_job(cluster, namespace):
    """docs/kubernetes.md: an upgrade with the same values leaves the job alone; with changed values it is refused
    while the RayJob exists (KubeRay would ignore the change, and Helm's apply conflicts with the operator's fields);
    after `kubectl delete rayjob` the same upgrade creates the job again from the new values."""
    ns = namespace
    support.install(cluster, "ft", ns)
    first = ray_cluster_of(cluster, ns, "ft")
    job = uid(cluster, "rayjob", ns, "ft")
    support.install(cluster, "ft", ns, verb="upgrade")
    assert uid(cluster, "rayjob", ns, "ft") == job

    smaller = ["workers.gpu.replicas=1", "workers.gpu.maxReplicas=1"]
    out = support.install(cluster, "ft", ns, sets=smaller, verb="upgrade", check=False)
    assert (
        out.returncode != 0 and f"kubectl delete rayjob ft -n {ns}, then run this helm upgrade again" in out.stderr
    ), out.stderr
    assert uid(cluster, "rayjob", ns, "ft") == job

    cluster.kubectl("delete", "rayjob", "ft", "-n", ns)
    support.wait_for(lambda: gone(cluster, ns, first), "the deleted RayJob's RayCluster and pods gone")
    support.install(cluster, "ft", ns, sets=smaller, verb="upgrade")
    second = ray_cluster_of(cluster, ns, "ft")
    assert second != first
    pods = support.cluster_pods(cluster, ns, second, 2)
    assert sorted(support.group_of(p) for p in pods) == ["head", "worker/gpu"], "the new values did not take"
