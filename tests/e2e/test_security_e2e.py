"""Pod Security "restricted" enforced by the real API server (its PodSecurity admission) in the job's namespace:
each pod template as KubeRay completes it (tests/test_security.py's as_created), created with a server-side
dry run, so the submitter's is checked even where no head becomes ready, and the pods the real operator
creates from the installed RayJob. The chart's RBAC on the real authorizer: tests/e2e/test_access.py."""

from __future__ import annotations

import json
import re

import k8s_support
import pytest
from test_security import as_created

from e2e import support

pytestmark = pytest.mark.e2e


def dry_run_pod(cluster, ns: str, name: str, template: dict):
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template.get("metadata", {}), "name": name},
        "spec": template["spec"],
    }
    return cluster.kubectl("create", "-n", ns, "--dry-run=server", "-f", "-", stdin=json.dumps(pod), check=False)


@pytest.mark.parametrize(
    "values",
    [[]] + [[p] for p in k8s_support.EXAMPLE_VALUES],
    ids=["defaults"] + [p.stem for p in k8s_support.EXAMPLE_VALUES],
)
def test_restricted_namespace_admits_every_pod(cluster, namespace, values):
    cluster.kubectl(
        "label",
        "namespace",
        namespace,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    )
    objects = support.rendered("ft", namespace, values)
    support.install(cluster, "ft", namespace, values)  # the ServiceAccount the pods name must exist
    templates = as_created(objects)
    # The namespace really enforces: a pod that allows privilege escalation is refused.
    bad = json.loads(json.dumps(templates["head"]))
    bad["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    refused = dry_run_pod(cluster, namespace, "escalating", bad)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr
    for role, tpl in templates.items():
        out = dry_run_pod(cluster, namespace, re.sub(r"[^a-z0-9-]", "-", f"ft-{role}"), tpl)
        assert out.returncode == 0, f"{role}: {out.stderr}"
    # And the pods the real operator creates from the installed RayJob.
    job = k8s_support.one(objects, "RayJob")
    support.assert_not_validation_failed(cluster, namespace, job["metadata"]["name"])
    if "rayClusterSpec" in job["spec"]:
        name = support.wait_for(
            lambda: support.job_status(cluster, namespace, job["metadata"]["name"]).get("rayClusterName"),
            "rayClusterName on the RayJob",
        )
    else:
        name = job["spec"]["clusterSelector"]["ray.io/cluster"]
    spec = k8s_support.cluster_spec(objects)
    pods = support.cluster_pods(cluster, namespace, name, support.expected_pod_count(spec))
    workers = [p for p in pods if support.group_of(p) != "head"]
    assert workers and all(p["spec"].get("initContainers") for p in workers), "KubeRay's init container is there"
