"""What the e2e tests read back from the real API server: the operator's RayCluster and pods, compared with
what the chart rendered (helm template of the same values), never with hard-coded expectations."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import k8s_support

from e2e.controlplane import ControlPlane

CHART = k8s_support.CHART
RECONCILE_TIMEOUT_S = 90


def wait_for(fn: Callable[[], Any], what: str, timeout: float = RECONCILE_TIMEOUT_S, every: float = 1.0) -> Any:
    """fn() until it returns something truthy; fails naming what never happened."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"no {what} within {timeout:.0f} s (last: {last!r})")


def values_args(values: list[Path] = (), sets: list[str] = ()) -> list[str]:
    args = []
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return args


def install(
    cp: ControlPlane,
    release: str,
    ns: str,
    values: list[Path] = (),
    sets: list[str] = (),
    check: bool = True,
    verb: str = "install",
):
    """`helm install` (Helm 4: server-side apply) of the chart; returns the CompletedProcess."""
    return cp.helm(verb, release, str(CHART), "-n", ns, "--server-side=true", *values_args(values, sets), check=check)


def rendered(release: str, ns: str, values: list[Path] = (), sets: list[str] = ()) -> list[dict]:
    return k8s_support.parse(
        k8s_support.helm("template", release, str(CHART), "--namespace", ns, *values_args(values, sets)).stdout
    )


def get(cp: ControlPlane, kind: str, ns: str, name: str = "", selector: str = "") -> Any:
    args = ["get", kind, "-n", ns] + ([name] if name else []) + (["-l", selector] if selector else [])
    out = cp.kubectl(*args, "-o", "json", check=False)
    return None if out.returncode else json.loads(out.stdout)


def job_status(cp: ControlPlane, ns: str, job: str) -> dict:
    return (get(cp, "rayjob", ns, job) or {}).get("status") or {}


def assert_not_validation_failed(cp: ControlPlane, ns: str, job: str) -> dict:
    """The RayJob's deployment status once the operator has set one; ValidationFailed fails with its reason."""
    status = wait_for(
        lambda: job_status(cp, ns, job).get("jobDeploymentStatus") and job_status(cp, ns, job),
        f"jobDeploymentStatus on RayJob {ns}/{job}",
    )
    assert status["jobDeploymentStatus"] != "ValidationFailed", (
        f"KubeRay rejected RayJob {job}: {status.get('reason')} {status.get('message')}"
    )
    return status


def cluster_pods(cp: ControlPlane, ns: str, cluster: str, expected: int) -> list[dict]:
    """The head and worker pods the operator created for the RayCluster, once all `expected` exist."""

    def pods():
        items = (get(cp, "pods", ns, selector=f"ray.io/cluster={cluster}") or {}).get("items", [])
        return items if len(items) >= expected else None

    return wait_for(pods, f"{expected} pods of RayCluster {ns}/{cluster}")


def expected_pod_count(spec: dict) -> int:
    return 1 + sum(
        g.get("replicas", g.get("minReplicas", 0)) * g.get("numOfHosts", 1) for g in spec.get("workerGroupSpecs", [])
    )


def group_of(pod: dict) -> str:
    labels = pod["metadata"]["labels"]
    return "head" if labels.get("ray.io/node-type") == "head" else f"worker/{labels['ray.io/group']}"


def ray_container(pod: dict) -> dict:
    """The Ray container: KubeRay keeps it first in the pod (index 0 is what its templates mean too)."""
    return pod["spec"]["containers"][0]


def mounts(pod: dict) -> dict[str, dict]:
    """mountPath -> the volume mounted there, in the Ray container."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in ray_container(pod).get("volumeMounts", [])}


def check_pods(pods: list[dict], objects: list[dict], ns: str) -> None:
    """Each operator-made pod carries what the chart's template for its group intends."""
    templates = k8s_support.pod_templates(objects)
    config_maps = {o["metadata"]["name"] for o in k8s_support.by_kind(objects, "ConfigMap")}
    claims = set()
    for pod in pods:
        group, where = group_of(pod), f"pod {ns}/{pod['metadata']['name']}"
        tpl = templates[group]["spec"]
        want = k8s_support.container(templates[group])
        got = ray_container(pod)
        for kind in ("requests", "limits"):
            for res, qty in (want.get("resources", {}).get(kind) or {}).items():
                assert str(got["resources"].get(kind, {}).get(res)) == str(qty), (
                    f"{where}: {kind}.{res} {got['resources'].get(kind, {}).get(res)!r}, chart says {qty!r}"
                )
        m = mounts(pod)
        shm = m.get("/dev/shm", {})
        assert shm.get("emptyDir", {}).get("medium") == "Memory", f"{where}: /dev/shm is {shm}"
        assert any(v.get("configMap", {}).get("name") in config_maps for v in m.values()), (
            f"{where}: the chart's ConfigMap {config_maps} is not mounted"
        )
        claim = {p: v["persistentVolumeClaim"]["claimName"] for p, v in m.items() if "persistentVolumeClaim" in v}
        assert claim, f"{where}: no checkpoint claim mounted"
        claims |= set(claim.items())
        assert pod["spec"].get("serviceAccountName") == tpl.get("serviceAccountName", "default"), (
            f"{where}: service account {pod['spec'].get('serviceAccountName')!r}"
        )
    assert len(claims) == 1, f"the claim is not at one path with one name in every group: {sorted(claims)}"
