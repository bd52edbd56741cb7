"""The chart's prepare job on the real node (docs/kubernetes.md, "Preparing the data before asking for GPUs"):
`helm install` of examples/values-cpu.yaml with examples/values-prepare.yaml runs `finetune prepare` from the image
as the RayJob <experiment>-prepare, on a head and a CPU worker group with no GPU anywhere, and succeeds with the
prepared dataset (its manifest.json) on the claim; a training release over the same data on that claim
(storage.existingClaim) then trains and says "prepared data: reusing" that folder, which it leaves as it was."""

from __future__ import annotations

import json
import time

import pytest

from e2e import support
from e2e.controlplane import REPO
from e2e.test_train import CPU_VALUES, put_model, wait_job_end

pytestmark = pytest.mark.e2e

PREPARE_VALUES = [*CPU_VALUES, REPO / "examples" / "values-prepare.yaml"]
STEPS = 4  # a couple of training steps: what is checked is where the data came from


def succeeded(cluster, node, ns: str, job: str) -> dict:
    status = wait_job_end(cluster, node, ns, job)
    assert (status["jobDeploymentStatus"], status.get("jobStatus")) == ("Complete", "SUCCEEDED"), (
        f"{status}\n{node.logs(ns)[-30000:]}"
    )
    return status


def test_prepare_job_then_training_reuses_what_it_prepared(cluster, namespace, node, tiny_model):
    ns, t0 = namespace, time.monotonic()
    claim = put_model(node, ns, "data", tiny_model)  # the prepare release "data" creates claim "data"
    support.install(cluster, "data", ns, PREPARE_VALUES, sets=node.image_sets())
    status = succeeded(cluster, node, ns, "data-prepare")
    t_prepared = time.monotonic() - t0

    pods = support.get(cluster, "pods", ns, selector=f"ray.io/cluster={status['rayClusterName']}")["items"]
    assert sorted(support.group_of(p) for p in pods) == ["head", "worker/cpu"], [p["metadata"]["name"] for p in pods]
    for pod in pods:  # the pods as the operator made them: no GPU requested or limited
        for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            resources = c.get("resources", {})
            assert not [r for kind in ("requests", "limits") for r in resources.get(kind, {}) if "gpu" in r], c
    manifests = list((claim / "prepared").glob("*/manifest.json"))
    assert len(manifests) == 1, sorted(p.name for p in (claim / "prepared").iterdir())
    folder = f"/mnt/cluster_storage/prepared/{manifests[0].parent.name}"
    manifest = json.loads(manifests[0].read_text())
    written = manifests[0].stat().st_mtime_ns
    assert f"prepared: {folder}" in node.logs(ns), node.logs(ns)[-30000:]

    cluster.helm("uninstall", "data", "-n", ns)  # the claim stays (helm.sh/resource-policy: keep)
    t1 = time.monotonic()
    sets = ["storage.create=false", "storage.existingClaim=data", "training.train.epochs=1"]
    sets.append(f"training.train.max_steps_per_epoch={STEPS}")
    support.install(cluster, "ft", ns, CPU_VALUES, sets=node.image_sets() + sets)
    succeeded(cluster, node, ns, "ft")
    logs = node.logs(ns)
    assert f"prepared data: reusing {folder}" in logs, logs[-30000:]
    assert (claim / "ft" / "final" / "config.json").exists()
    assert list((claim / "prepared").glob("*/manifest.json")) == manifests
    assert manifests[0].stat().st_mtime_ns == written and json.loads(manifests[0].read_text()) == manifest
    print(
        f"\nhelm install of the prepare job -> SUCCEEDED, data on the claim: {t_prepared:.0f} s; "
        f"training release -> SUCCEEDED on that data: {time.monotonic() - t1:.0f} s"
    )
