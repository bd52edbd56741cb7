"""k8s/: the chart rendered with its defaults (kept in sync by `make manifests`), valid as the chart's output
is, renderable by `kubectl kustomize`, and patchable by the example overlay in examples/k8s-overlay/."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from k8s_support import (
    K8S,
    REPO,
    by_kind,
    cluster_spec,
    container,
    env_of,
    one,
    parse,
    pod_templates,
    render,
    tool,
    validate_all,
)

sys.path.insert(0, str(REPO / "tools"))
import manifests  # noqa: E402  (tools/manifests.py: what `make manifests` runs)

OVERLAY = REPO / "examples" / "k8s-overlay"


def kustomize(folder: Path) -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return parse(out.stdout)


def test_k8s_is_the_chart_rendered_with_defaults():
    problems = manifests.differences(K8S)
    assert not problems, "k8s/ differs from a fresh render (run `make manifests`):\n" + "\n".join(problems)
    assert (K8S / "pvc.yaml").exists() and [o["kind"] for o in parse((K8S / "pvc.yaml").read_text())] == [
        "PersistentVolumeClaim"
    ], "the PVC has a file of its own, so deleting the job never touches it"
    assert {"configmap.yaml", "rayjob.yaml", "Kustomization"} <= {p.name for p in K8S.iterdir()}


def test_sync_check_catches_a_hand_edit(tmp_path):
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    job = copy / "rayjob.yaml"
    job.write_text(job.read_text().replace("replicas: 2", "replicas: 3", 1))
    (copy / "configmap.yaml").unlink()
    (copy / "extra.yaml").write_text("kind: ConfigMap\n")
    problems = "\n".join(manifests.differences(copy))
    assert "-        replicas: 3" in problems and "+        replicas: 2" in problems
    assert "configmap.yaml: missing" in problems and "extra.yaml: not rendered" in problems
    assert manifests.main(["--check", "--out", str(copy)]) == 1
    assert manifests.main(["--check"]) == 0


def test_kustomize_renders_k8s_and_every_object_validates(tmp_path):
    objects = kustomize(K8S)
    assert sorted(o["kind"] for o in objects) == sorted(o["kind"] for o in render())
    validate_all(objects, tmp_path)
    # kubernetes-validate --strict straight on the committed core files, as a user would run it.
    files = [str(K8S / f) for f in ("pvc.yaml", "configmap.yaml", "rbac.yaml", "networkpolicy.yaml")]
    out = subprocess.run([tool("kubernetes-validate"), "--strict", *files], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_example_overlay_changes_name_image_gpus_and_storage_class(tmp_path):
    objects = kustomize(OVERLAY)
    validate_all(objects, tmp_path)
    job = one(objects, "RayJob")
    name = job["metadata"]["name"]
    assert name == "gpt2-agnews-4gpu"
    # The old name is gone everywhere: names, labels, references, the entrypoint, the progress env.
    text = "\n".join(str(o) for o in objects)
    assert not re.search(r"gpt2-agnews(?!-4gpu)", text), re.findall(r".{40}gpt2-agnews(?!-4gpu).{20}", text)
    for o in objects:
        assert o["metadata"]["name"] == name and o["metadata"]["labels"]["ray-finetune/experiment"] == name
    head = pod_templates(objects)["head"]
    assert env_of(container(head))["FINETUNE_RAYJOB_NAME"] == name
    assert job["spec"]["entrypoint"].endswith(f"--set experiment.name={name}")
    # GPUs and workers agree; the image and the storage class are the overlay's.
    gpus = sum(
        g["replicas"] * g["numOfHosts"] * int(g["rayStartParams"]["num-gpus"])
        for g in cluster_spec(objects)["workerGroupSpecs"]
    )
    assert gpus == 4 and f"--set scaling.num_workers={gpus} " in job["spec"]["entrypoint"]
    for role, tpl in pod_templates(objects).items():
        assert container(tpl)["image"] == "registry.example.com/ml/ray-finetune:0.1.0", role
    assert one(objects, "PersistentVolumeClaim")["spec"]["storageClassName"] == "nfs-rwx"
    binding = one(objects, "RoleBinding")
    assert binding["roleRef"]["name"] == name and binding["subjects"][0]["name"] == name
    assert by_kind(objects, "ConfigMap")[0]["metadata"]["name"] == name


def test_an_overlay_namespace_moves_the_rolebinding_subject(tmp_path):
    """k8s/ is rendered for "default"; an overlay that sets `namespace:` (the documented way to deploy elsewhere)
    moves every object and the RoleBinding's subject, so the pods' account keeps its Role."""
    overlay = tmp_path / "ns"
    overlay.mkdir()
    shutil.copytree(K8S, tmp_path / "k8s")
    (overlay / "kustomization.yaml").write_text("resources: [../k8s]\nnamespace: ml-team\n")
    objects = kustomize(overlay)
    assert {o["metadata"]["namespace"] for o in objects} == {"ml-team"}
    subject = one(objects, "RoleBinding")["subjects"][0]
    assert subject == {
        "kind": "ServiceAccount",
        "name": one(objects, "ServiceAccount")["metadata"]["name"],
        "namespace": "ml-team",
    }
    assert "namespace: default" in (K8S / "rbac.yaml").read_text(), "the committed file names default (see above)"


CPU_OVERLAY = REPO / "examples" / "k8s-cpu-overlay"


def test_cpu_overlay_is_the_chart_with_values_cpu(tmp_path):
    """examples/k8s-cpu-overlay patches k8s/ by hand: what it sets must be what the chart renders for
    examples/values-cpu.yaml (its training.yaml, the head's and workers' resources, Ray's start parameters and
    volume sizes), with no GPU left anywhere."""
    objects = kustomize(CPU_OVERLAY)
    validate_all(objects, tmp_path)
    chart = render([REPO / "examples" / "values-cpu.yaml"])
    ours = one(objects, "ConfigMap")["data"]["training.yaml"]
    theirs = one(chart, "ConfigMap")["data"]["training.yaml"]
    # kustomize writes a literal block without its final newline: the same YAML
    assert ours.rstrip("\n") == theirs.rstrip("\n"), (
        "the overlay's training.yaml differs from the chart's for values-cpu.yaml"
    )
    assert "nvidia.com/gpu" not in str(objects)
    want, got = cluster_spec(chart), cluster_spec(objects)
    assert got["headGroupSpec"]["rayStartParams"] == want["headGroupSpec"]["rayStartParams"]
    assert [(g["groupName"], g["replicas"], g["rayStartParams"]) for g in got["workerGroupSpecs"]] == [
        (g["groupName"], g["replicas"], g["rayStartParams"]) for g in want["workerGroupSpecs"]
    ]
    ours_t, theirs_t = pod_templates(objects), pod_templates(chart)
    assert set(ours_t) == set(theirs_t)
    for role in theirs_t:
        assert container(ours_t[role])["resources"] == container(theirs_t[role])["resources"], role
        sizes = {v["name"]: v.get("emptyDir") for v in ours_t[role]["spec"].get("volumes", []) if "emptyDir" in v}
        assert sizes == {
            v["name"]: v.get("emptyDir") for v in theirs_t[role]["spec"].get("volumes", []) if "emptyDir" in v
        }, role
        assert ours_t[role]["spec"].get("tolerations") == theirs_t[role]["spec"].get("tolerations"), role
    job = one(objects, "RayJob")
    assert job["spec"]["entrypoint"] == one(chart, "RayJob")["spec"]["entrypoint"]
    assert {o["metadata"]["namespace"] for o in objects} == {"finetune-cpu"}
