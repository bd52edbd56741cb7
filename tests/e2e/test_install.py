"""The chart, k8s/ and the overlay applied to a real API server; the real KubeRay operator turns each RayJob
into a RayCluster whose pods carry what the chart intends."""

from __future__ import annotations

import k8s_support
import pytest

from e2e import support

pytestmark = pytest.mark.e2e

VALUE_SETS = {"defaults": []} | {p.stem: [p] for p in k8s_support.EXAMPLE_VALUES}


def check_reconciled(cluster, ns: str, objects: list[dict]) -> None:
    """The RayJob passes the operator's validation; its RayCluster (its own, or the persistent one it selects)
    gets head and worker pods as the chart intends, with the token Secret the operator made."""
    job = k8s_support.one(objects, "RayJob")
    status = support.assert_not_validation_failed(cluster, ns, job["metadata"]["name"])
    if "rayClusterSpec" in job["spec"]:
        name = support.wait_for(
            lambda: support.job_status(cluster, ns, job["metadata"]["name"]).get("rayClusterName"),
            "rayClusterName on the RayJob",
        )
    else:
        name = job["spec"]["clusterSelector"]["ray.io/cluster"]
    assert status["jobDeploymentStatus"] in {"Initializing", "Waiting", "Running"}, status
    spec = k8s_support.cluster_spec(objects)
    pods = support.cluster_pods(cluster, ns, name, support.expected_pod_count(spec))
    support.check_pods(pods, objects, ns)
    if (spec.get("authOptions") or {}).get("mode") == "token":
        for pod in pods:
            env = {e["name"]: e for e in support.ray_container(pod).get("env", [])}
            ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
            assert ref, (
                f"pod {pod['metadata']['name']}: RAY_AUTH_TOKEN does not come from a Secret: "
                f"{env.get('RAY_AUTH_TOKEN')}"
            )
            secret = support.get(cluster, "secret", ns, ref["name"])
            assert secret and ref["key"] in secret.get("data", {}), (
                f"token Secret {ns}/{ref['name']} missing or without {ref['key']}"
            )


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_install_is_reconciled(cluster, namespace, values):
    support.install(cluster, "ft", namespace, values)
    check_reconciled(cluster, namespace, support.rendered("ft", namespace, values))


def kustomized(cluster, path) -> list[dict]:
    return k8s_support.parse(cluster.kubectl("kustomize", str(path)).stdout)


def test_kubectl_apply_f_k8s_in_default(cluster):
    """k8s/ as the README deploys it: `kubectl apply -f k8s/` into "default" (the namespace it is rendered for)."""
    cluster.kubectl("apply", "-f", str(k8s_support.K8S))
    try:
        check_reconciled(cluster, "default", kustomized(cluster, k8s_support.K8S))
    finally:
        cluster.kubectl("delete", "-f", str(k8s_support.K8S), "--wait=false", check=False)


@pytest.mark.parametrize(
    "path", [k8s_support.K8S, k8s_support.REPO / "examples" / "k8s-overlay"], ids=["k8s", "k8s-overlay"]
)
def test_kubectl_apply_k(cluster, namespace, path):
    cluster.kubectl("apply", "-k", str(path), "-n", namespace)
    check_reconciled(cluster, namespace, kustomized(cluster, path))
