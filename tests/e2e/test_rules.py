"""The chart's own checks (validate.yaml) for what the real operator or API server would reject: helm refuses
the values with a message naming them, and the same objects, rendered without the check, are rejected by the
real KubeRay operator or API server (so each rule guards against something real)."""

from __future__ import annotations

import json

import k8s_support
import pytest

from e2e import support

pytestmark = pytest.mark.e2e
PERSISTENT = k8s_support.REPO / "examples" / "values-persistent.yaml"


def apply(cluster, ns: str, objects: list[dict], check: bool = True):
    return cluster.kubectl(
        "apply", "--server-side", "-n", ns, "-f", "-", check=check, stdin="\n---\n".join(json.dumps(o) for o in objects)
    )


def test_persistent_mode_backoff_limit(cluster, namespace):
    out = support.install(cluster, "ft", namespace, [PERSISTENT], sets=["rayJob.backoffLimit=2"], check=False)
    assert out.returncode != 0 and "rayJob.backoffLimit: 2 with rayJob.clusterMode=persistent" in out.stderr, out.stderr

    objects = support.rendered("ft", namespace, [PERSISTENT])
    job = k8s_support.one(objects, "RayJob")
    job["spec"]["backoffLimit"] = 2  # what the chart rendered before the check
    apply(cluster, namespace, objects)
    status = support.wait_for(
        lambda: support.job_status(cluster, namespace, "ft").get("jobDeploymentStatus"), "a deployment status"
    )
    assert status == "ValidationFailed", status
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=RayJob").stdout
    assert "BackoffLimit is incompatible with ClusterSelector mode" in events, events


@pytest.mark.parametrize("path", ["/etc/finetune", "/dev/shm"])
def test_claim_on_one_of_the_charts_mounts(cluster, namespace, path):
    out = support.install(cluster, "ft", namespace, sets=[f"storage.mountPath={path}"], check=False)
    assert out.returncode != 0 and f'storage.mountPath: "{path}" collides' in out.stderr, out.stderr

    # Rendered without the check: the API server refuses the RayJob under server-side apply (Helm 4's way),
    # since volumeMounts are a map keyed by mountPath.
    objects = support.rendered("ft", namespace)
    job = k8s_support.one(objects, "RayJob")
    for tpl in k8s_support.pod_templates_of(job).values():
        for c in tpl["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] == "storage":
                    m["mountPath"] = path
    out = apply(cluster, namespace, [job], check=False)
    assert out.returncode != 0 and f'duplicate entries for key [mountPath="{path}"]' in out.stderr, out.stderr
    assert not support.get(cluster, "rayjob", namespace, "ft")
