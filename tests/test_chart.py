"""The Helm chart, with the real helm binary: lint, render, validate every object, structural contracts,
bad values rejected with a message naming the value, the generated schema in sync with the app's models,
and the ConfigMap's training.yaml accepted by `finetune validate` (the chart computes no DeepSpeed config)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tomllib
import urllib.parse
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from k8s_support import (
    CHART,
    EXAMPLE_VALUES,
    REPO,
    by_kind,
    cluster_spec,
    config_files,
    container,
    env_of,
    helm,
    one,
    pod_templates,
    render,
    template_args,
    validate_all,
)

from app import schema as schema_mod
from app.config import TrainingConfig, _model_in

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
VALUE_SETS = [pytest.param([], id="defaults")] + [pytest.param([p], id=p.stem) for p in EXAMPLE_VALUES]


# --- schema and defaults follow the app --------------------------------------------------------------------


def test_values_schema_is_generated_from_the_app_models(tmp_path):
    committed = (CHART / "values.schema.json").read_text()
    assert committed == schema_mod.render(), "helm/ray-finetune/values.schema.json is stale: run `make schema`"
    assert schema_mod.main(["--check"]) == 0
    jsonschema.Draft202012Validator.check_schema(json.loads(committed))
    # A hand edit (or a model change without `make schema`) is caught:
    drifted = json.loads(committed)
    drifted["$defs"]["TrainConfig"]["properties"]["epochs"]["minimum"] = 0
    copy_path = tmp_path / "values.schema.json"
    copy_path.write_text(json.dumps(drifted, indent=2) + "\n")
    assert schema_mod.main(["--check", "--out", str(copy_path)]) == 1


def test_values_leave_training_defaults_to_the_app():
    """values.yaml states only the chart's own training choices; the schema documents every app default, and
    the defaults the chart's templates read come from the app's models (_app_defaults.tpl, generated)."""
    assert VALUES["training"] == {"experiment": {"name": None, "on_conflict": "wait"}}
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = TrainingConfig().model_dump(mode="json")
    for section, fields in defaults.items():
        if section == "deepspeed":
            continue
        model = _model_in(TrainingConfig.model_fields[section].annotation)
        if fields is None:  # an optional section, off by default (preference: null trains SFT): its model's defaults
            fields = model().model_dump(mode="json")
        documented = schema["$defs"][model.__name__]["properties"]
        for key, value in fields.items():
            expected = list(value) if isinstance(value, tuple) else value
            assert documented[key].get("default", None) == expected, f"{section}.{key}"
    assert (CHART / "templates" / "_app_defaults.tpl").read_text() == schema_mod.render_defaults()


def test_values_files_match_the_schema_in_python_too():
    """The same schema through Python's jsonschema: the defaults and every example are valid, with and
    without the chart's defaults merged in."""
    validator = jsonschema.Draft202012Validator(json.loads((CHART / "values.schema.json").read_text()))
    for path in [CHART / "values.yaml", *EXAMPLE_VALUES]:
        doc = yaml.safe_load(path.read_text())
        assert not list(validator.iter_errors(doc)), path
        assert not list(validator.iter_errors(merge(VALUES, doc))), path


# Each rule of the app that helm learns through the schema, once each way: (training values, rejected).
RULE_CASES = {
    "bf16-and-fp16": ({"deepspeed": {"bf16": {"enabled": True}, "fp16": {"enabled": True}}}, True),
    "fp16-against-default-precision": ({"deepspeed": {"fp16": {"enabled": True}}}, True),
    "fp16-with-fp16": ({"deepspeed": {"fp16": {"enabled": True}}, "train": {"precision": "fp16"}}, False),
    "bf16-against-fp32": ({"deepspeed": {"bf16": {"enabled": True}}, "train": {"precision": "fp32"}}, True),
    "bf16-with-default-precision": ({"deepspeed": {"bf16": {"enabled": True}}}, False),
    "enabled-not-bool": ({"deepspeed": {"bf16": {"enabled": "yes"}}}, True),
    "stage-out-of-range": ({"deepspeed": {"zero_optimization": {"stage": 4}}}, True),
    "stage-as-text": ({"deepspeed": {"zero_optimization": {"stage": "three"}}}, True),
    "offload-param-stage-2": (
        {"deepspeed": {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}},
        True,
    ),
    "offload-param-tutorial-stage": (
        {"deepspeed": {"zero_optimization": {"offload_param": {"device": "nvme"}}}},
        False,
    ),
    "offload-optimizer-stage-0": (
        {"deepspeed": {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}},
        True,
    ),
    "offload-optimizer-stage-1": (
        {"deepspeed": {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}},
        False,
    ),
    "offload-none-stage-0": (
        {"deepspeed": {"zero_optimization": {"stage": 0, "offload_param": {"device": "none"}}}},
        False,
    ),
    "top-level-offload": ({"deepspeed": {"offload_param": {"device": "cpu"}}}, True),
    "leaf-names-auto": ({"deepspeed": {"zero_optimization": {"leaf_module": {"names": "auto"}}}}, True),
    "leaf-unknown-key": ({"deepspeed": {"zero_optimization": {"leaf_module": {"class": ["X"]}}}}, True),
    "leaf-classes": ({"deepspeed": {"zero_optimization": {"leaf_module": {"classes": ["GPT2Block"]}}}}, False),
    "batch-not-a-number": ({"deepspeed": {"train_micro_batch_size_per_gpu": "two"}}, True),
    "extra-keys-pass": (
        {"deepspeed": {"zero_optimization": {"round_robin_gradients": True}, "comms_logger": {"enabled": True}}},
        False,
    ),
    "optimizer-not-a-mapping": ({"deepspeed": {"optimizer": "adam"}}, True),
    "eval-both": ({"data": {"eval_split": "test", "eval_fraction": 0.1}}, True),
    "eval-split-only": ({"data": {"eval_split": "test"}}, False),
}


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_schema_and_app_apply_the_same_rule(case):
    """One rule, two enforcers: the app's models (and ds_config.check) and the schema generated from them
    reject the same training values; neither is a hand-kept copy."""
    from app import ds_config
    from app.config import ConfigError, parse

    training, rejected = RULE_CASES[case]
    try:
        app_rejects = bool(ds_config.check(parse(training)))
    except ConfigError:
        app_rejects = True
    validator = jsonschema.Draft202012Validator(json.loads((CHART / "values.schema.json").read_text()))
    schema_rejects = bool(list(validator.iter_errors({"training": training})))
    assert (app_rejects, schema_rejects) == (rejected, rejected)


def test_versions_agree():
    assert CHART_META["appVersion"] == VERSION
    assert VALUES["image"]["tag"] == "", "empty tag: the chart's appVersion"
    assert VALUES["rayVersion"] == "2.60.0"


# --- render and validate ------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS)
def test_lint_render_validate(values, tmp_path):
    args = ["lint", "--strict", str(CHART)] + [a for v in values for a in ("-f", str(v))]
    out = helm(*args, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    objects = render(values)
    validate_all(objects, tmp_path)
    check_contracts(objects, merge(VALUES, *[yaml.safe_load(v.read_text()) for v in values]))


def check_contracts(objects: list[dict[str, Any]], values: dict[str, Any]) -> None:
    if values["prepare"]["enabled"]:
        check_prepare_contracts(objects, values)
        return
    job = one(objects, "RayJob")
    name = job["metadata"]["name"]
    files = config_files(objects)
    training = yaml.safe_load(files["training.yaml"])
    mount = values["storage"]["mountPath"]
    spec = cluster_spec(objects)
    templates = pod_templates(objects)

    # Every object is named and labelled after the experiment.
    for o in objects:
        assert (
            o["metadata"]["name"] == name or o["kind"] == "PersistentVolumeClaim" and values["storage"]["existingClaim"]
        )
        assert o["metadata"]["labels"]["ray-finetune/experiment"] == name
    assert f"--set experiment.name={name}" in job["spec"]["entrypoint"]
    assert job["spec"]["entrypoint"].startswith("finetune train /etc/finetune/training.yaml ")

    # The run folder is on the volume, which is mounted at the same path on the head and every worker.
    assert training["experiment"]["storage_path"] == mount
    claim = values["storage"]["existingClaim"] or name
    for role, tpl in templates.items():
        if role == "submitter":
            continue
        c = container(tpl)
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in tpl["spec"]["volumes"]}
        assert volumes[mounts[mount]["name"]]["persistentVolumeClaim"]["claimName"] == claim, role
        assert mounts["/etc/finetune"]["readOnly"] is True, role
        assert volumes[mounts["/etc/finetune"]["name"]]["configMap"]["name"] == name, role
        shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
        assert shm["medium"] == "Memory" and shm["sizeLimit"], role
        env = env_of(c)
        assert env["HF_HOME"].startswith(mount + "/"), role
        assert (
            tpl["metadata"]["annotations"]["checksum/config"]
            == templates["head"]["metadata"]["annotations"]["checksum/config"]
        )
        assert c["image"].endswith(":" + (values["image"]["tag"] or VERSION)), c["image"]

    # The head trains nothing and tells the driver which RayJob to report progress to.
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    head_env = env_of(container(templates["head"]))
    assert head_env["FINETUNE_RAYJOB_NAME"] == name
    assert head_env["FINETUNE_RAYJOB_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    if values["progressReporting"]["rbac"]["create"]:
        role = one(objects, "Role")  # its exact rules: tests/test_security.py
        assert role["rules"][0]["resourceNames"] == [name]
        assert templates["head"]["spec"]["serviceAccountName"] == one(objects, "ServiceAccount")["metadata"]["name"]
        binding = one(objects, "RoleBinding")
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"][0]["name"] == templates["head"]["spec"]["serviceAccountName"]
        # Ray Train's rank 0 (the progress publisher) runs on a worker pod: workers use the same account.
        for role, tpl in templates.items():
            if role.startswith("worker"):
                assert tpl["spec"]["serviceAccountName"] == templates["head"]["spec"]["serviceAccountName"], role

    # GPUs: requests = limits = Ray's num-gpus; the worker count follows the GPUs (CPU workers: the pods).
    gpus_total = pods_total = 0
    for group in spec["workerGroupSpecs"]:
        res = container(group["template"])["resources"]
        gv = values["workers"][group["groupName"]]
        gpu_res = gv.get("gpuResource", "nvidia.com/gpu")
        # Quantities as strings, as the operator writes them back (tests/e2e/test_lifecycle.py: upgrade).
        assert res["requests"].get(gpu_res) == res["limits"].get(gpu_res) == (str(gv["gpus"]) if gv["gpus"] else None)
        assert group["rayStartParams"]["num-gpus"] == str(gv["gpus"])
        gpus_total += gv["gpus"] * group["replicas"] * group["numOfHosts"]
        pods_total += group["replicas"] * group["numOfHosts"]
    scaling = values["training"].get("scaling", {})
    if scaling.get("num_workers") is None:
        workers = gpus_total if scaling.get("use_gpu", True) else pods_total
        assert f"--set scaling.num_workers={workers} " in job["spec"]["entrypoint"]

    # The checkpoint volume outlives `helm uninstall`.
    pvcs = by_kind(objects, "PersistentVolumeClaim")
    if values["storage"]["existingClaim"]:
        assert not pvcs
    else:
        assert pvcs[0]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert pvcs[0]["spec"]["accessModes"] == values["storage"]["accessModes"]

    check_tracking(objects, values, templates)

    # Ray token auth is configured for the cluster; KubeRay hands the token to the submitter.
    assert spec["authOptions"]["mode"] == values["auth"]["mode"]
    assert set(files) == {"training.yaml"}, "the app resolves the DeepSpeed config, not the chart"


def check_prepare_contracts(objects: list[dict[str, Any]], values: dict[str, Any]) -> None:
    """prepare.enabled: the release's one RayJob is `finetune prepare` of the training config, named
    <experiment>-prepare, on its own cluster of the head and one CPU group; no GPU is asked for anywhere; the same
    ConfigMap and claim, at the same paths, as the training job; nothing of training's (no RBAC, no token, no
    preStop hook, no persistent RayCluster)."""
    exp = one(objects, "ConfigMap")["metadata"]["name"]
    job = one(objects, "RayJob")
    spec = job["spec"]
    assert job["metadata"]["name"] == f"{exp}-prepare"
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "prepare"
    assert spec["entrypoint"].startswith("finetune prepare /etc/finetune/training.yaml --set scaling.num_workers=")
    assert spec["entrypoint"].endswith(f" --set experiment.name={exp}")
    assert spec["shutdownAfterJobFinishes"] is True and "clusterSelector" not in spec
    assert not by_kind(objects, "RayCluster") and not {"Role", "RoleBinding", "ServiceAccount"} & {
        o["kind"] for o in objects
    }
    assert "gpu" not in json.dumps(spec).replace("num-gpus", ""), "the prepare job asks for no GPU"
    cluster = spec["rayClusterSpec"]
    assert "enableInTreeAutoscaling" not in cluster
    groups = cluster["workerGroupSpecs"]
    prep = values["prepare"]["worker"]
    assert [(g["groupName"], g["replicas"], g["rayStartParams"]["num-gpus"]) for g in groups] == [
        ("cpu", prep["replicas"], "0")
    ]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    claim = values["storage"]["existingClaim"] or exp
    mount = values["storage"]["mountPath"]
    training = yaml.safe_load(config_files(objects)["training.yaml"])
    assert training["experiment"]["storage_path"] == mount
    for role, tpl in pod_templates(objects).items():
        assert tpl["spec"]["automountServiceAccountToken"] is False and "serviceAccountName" not in tpl["spec"], role
        if role == "submitter":
            continue
        c = container(tpl)
        assert "lifecycle" not in c and "FINETUNE_RAYJOB_NAME" not in env_of(c), role
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in tpl["spec"]["volumes"]}
        assert volumes[mounts[mount]]["persistentVolumeClaim"]["claimName"] == claim, role
        assert volumes[mounts["/etc/finetune"]]["configMap"]["name"] == exp, role
    for o in objects:
        assert o["metadata"]["labels"]["ray-finetune/experiment"] == exp


PREPARE = REPO / "examples" / "values-prepare.yaml"
CPU = REPO / "examples" / "values-cpu.yaml"


@pytest.mark.parametrize(
    "values", [[PREPARE], [CPU, PREPARE], [REPO / "examples" / "values-llama8b.yaml", PREPARE]], ids=str
)
def test_prepare_job_renders_without_gpus_and_on_the_training_volume(values, tmp_path):
    """examples/values-prepare.yaml over a training values file: the prepare RayJob validates against the KubeRay
    CRDs (and its pod templates against Kubernetes'), asks for no GPU, and reads the ConfigMap and writes the claim
    the training release of the same values would: the same training.yaml, byte for byte, and the same worker
    count on its entrypoint."""
    out = helm("lint", "--strict", str(CHART), *[a for v in values for a in ("-f", str(v))], check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    objects = render(values)
    validate_all(objects, tmp_path)
    merged = merge(VALUES, *[yaml.safe_load(v.read_text()) for v in values])
    check_prepare_contracts(objects, merged)
    training = render(values[:-1])
    assert config_files(objects) == config_files(training)
    train_args = one(training, "RayJob")["spec"]["entrypoint"].split()[2:]
    assert one(objects, "RayJob")["spec"]["entrypoint"].split()[2:] == train_args


def test_prepare_is_off_by_default_and_leaves_the_training_job_alone():
    """prepare.* changes nothing of the training release (k8s/ stays the default render: tests/test_manifests.py),
    not even the values checksum that guards upgrades."""
    default = render()
    assert [o["metadata"]["name"] for o in by_kind(default, "RayJob")] == ["gpt2-agnews"]
    resized = render(sets=["prepare.worker.replicas=7", "prepare.worker.shmSize=1Gi"])
    assert resized == default


def test_prepare_job_with_persistent_and_autoscaling_values_still_has_its_own_cpu_cluster():
    objects = render(
        [REPO / "examples" / "values-persistent.yaml", PREPARE],
        sets=["autoscaling.enabled=true", "workers.gpu.maxReplicas=4"],
    )
    check_prepare_contracts(objects, merge(VALUES, {"prepare": {"enabled": True}}))
    assert one(objects, "RayJob")["spec"]["backoffLimit"] == 0  # rayJob.* still applies


def test_notes_of_a_prepare_release_say_how_to_follow_it_and_train_on_it():
    out = helm("install", "data1", str(CHART), "--dry-run=client", "-f", str(PREPARE)).stdout
    notes = out.split("NOTES:", 1)[1]
    for text in (
        "RayJob default/data1-prepare",
        "logs -f job/data1-prepare",
        "/mnt/cluster_storage/prepared/<key>/",
        "--set storage.create=false --set storage.existingClaim=data1",
    ):
        assert text in notes, text


def test_training_yaml_keeps_floats_floats():
    """Go writes 1e-07 for small floats, which YAML 1.1 readers (PyYAML, so the app) take for a string;
    the chart writes 1.0e-07. Checked where no schema type would coerce it back: the deepspeed block."""
    objects = render(
        set_json=[
            'training.deepspeed.scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-7, '
            '"warmup_max_lr": 0.00002, "warmup_num_steps": 1000000}}',
            "training.train.learning_rate=5e-7",
        ]
    )
    training = yaml.safe_load(config_files(objects)["training.yaml"])
    assert training["deepspeed"]["scheduler"]["params"] == {
        "warmup_min_lr": 1e-7,
        "warmup_max_lr": 2e-5,
        "warmup_num_steps": 1000000,
    }
    assert all(isinstance(v, float) for v in training["deepspeed"]["scheduler"]["params"].values() if v < 1)
    assert training["train"]["learning_rate"] == 5e-7
    assert isinstance(training["train"]["learning_rate"], float)


def test_notes_say_how_to_follow_find_and_resume():
    out = helm(
        "install",
        "exp1",
        str(CHART),
        "--dry-run=client",
        "--set",
        "rayJob.clusterMode=persistent",
        "--set",
        "rayJob.backoffLimit=0",
    ).stdout
    notes = out.split("NOTES:", 1)[1]
    for text in (
        "kubectl -n default get rayjob exp1",
        "logs -f job/exp1",
        "port-forward",
        "/mnt/cluster_storage/exp1/final/",
        "helm uninstall exp1",
        "delete pvc exp1",
    ):
        assert text in notes, text


VARIANTS = {
    "existing-claim": (["storage.create=false", "storage.existingClaim=team-checkpoints"], {}),
    "persistent-http": (
        ["rayJob.clusterMode=persistent", "rayJob.submissionMode=HTTPMode", "rayJob.backoffLimit=0"],
        {},
    ),
    "sidecar-suspended-queue": (
        [
            "rayJob.submissionMode=SidecarMode",
            "rayJob.suspend=true",
            "rayJob.queueName=gpu-queue",
            "rayJob.activeDeadlineSeconds=3600",
        ],
        {},
    ),
    "no-rbac-no-auth": (
        [
            "progressReporting.rbac.create=false",
            "head.serviceAccountName=ml-runner",
            "auth.mode=disabled",
            "auth.allowDisabled=true",
        ],
        {},
    ),
    "mlflow-https-default-port": (
        ["training.tracking.mlflow.uri=https://mlflow.example.com/", "tracking.mlflow.credentialsSecret=mlflow"],
        {"tracking.mlflow.egressTo": [{"ipBlock": {"cidr": "10.20.0.0/16"}}]},
    ),
    "autoscaling-groups": (
        ["autoscaling.enabled=true", "workers.gpu.maxReplicas=4", "workers.gpu.minReplicas=1"],
        {
            "workers.big": {
                "replicas": 1,
                "maxReplicas": 1,
                "numOfHosts": 2,
                "gpus": 4,
                "gpuResource": "amd.com/gpu",
                "image": {"tag": "0.1.0-rocm"},
            },
            "ncclEnv": {"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": 1},
            "huggingface": {"tokenSecret": {"name": "hf", "key": "token"}},
            "storage.storageClassName": "nfs-rwx",
        },
    ),
}


def check_tracking(objects: list[dict[str, Any]], values: dict[str, Any], templates: dict[str, dict]) -> None:
    """MLflow: the credentials Secret by reference on head and workers (rank 0 logs, the driver ends the run), not
    on the submitter; the NetworkPolicy's rule to the server is its address and the URI's port, nothing more."""
    secret = values["tracking"]["mlflow"]["credentialsSecret"]
    keys = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    for role, tpl in templates.items():
        env = env_of(container(tpl))
        if secret and role != "submitter":
            for key in keys:
                assert env[key] == {"secretKeyRef": {"name": secret, "key": key, "optional": True}}, role
        else:
            assert not set(keys) & set(env), role
    uri = values["training"].get("tracking", {}).get("mlflow", {}).get("uri")
    to = values["tracking"]["mlflow"]["egressTo"]
    if values["networkPolicy"]["enabled"] and uri and to:
        parts = urllib.parse.urlsplit(uri)
        port = parts.port or {"https": 443, "http": 80}[parts.scheme]
        egress = one(objects, "NetworkPolicy")["spec"]["egress"]
        assert egress == values["networkPolicy"]["egress"] + [{"to": to, "ports": [{"protocol": "TCP", "port": port}]}]


@pytest.mark.parametrize("case", list(VARIANTS))
def test_variants_render_and_validate(case, tmp_path):
    sets, json_sets = VARIANTS[case]
    objects = render(sets=sets, set_json=[f"{k}={json.dumps(v)}" for k, v in json_sets.items()])
    validate_all(objects, tmp_path)
    job = one(objects, "RayJob")["spec"]
    templates = pod_templates(objects)
    if case == "existing-claim":
        assert not by_kind(objects, "PersistentVolumeClaim")
        for role, tpl in templates.items():
            claims = [
                v["persistentVolumeClaim"]["claimName"]
                for v in tpl["spec"].get("volumes", [])
                if "persistentVolumeClaim" in v
            ]
            assert claims == ([] if role == "submitter" else ["team-checkpoints"])
    elif case == "persistent-http":
        cluster = one(objects, "RayCluster")
        assert job["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
        assert "rayClusterSpec" not in job and "submitterPodTemplate" not in job
        assert job["shutdownAfterJobFinishes"] is False and "ttlSecondsAfterFinished" not in job
    elif case == "sidecar-suspended-queue":
        assert "submitterPodTemplate" not in job and "submitterConfig" not in job
        assert job["suspend"] is True and job["activeDeadlineSeconds"] == 3600
        assert one(objects, "RayJob")["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    elif case == "no-rbac-no-auth":
        assert not by_kind(objects, "Role") and not by_kind(objects, "ServiceAccount")
        assert templates["head"]["spec"]["serviceAccountName"] == "ml-runner"
        assert job["rayClusterSpec"]["authOptions"] == {"mode": "disabled"}
        for role, tpl in templates.items():
            assert env_of(container(tpl))["RAY_AUTH_MODE"] == "disabled", role
    elif case == "mlflow-https-default-port":
        values = merge(
            VALUES,
            {
                "tracking": {
                    "mlflow": {"credentialsSecret": "mlflow", "egressTo": json_sets["tracking.mlflow.egressTo"]}
                },
                "training": {"tracking": {"mlflow": {"uri": "https://mlflow.example.com/"}}},
            },
        )
        check_tracking(objects, values, templates)
        assert one(objects, "NetworkPolicy")["spec"]["egress"][-1]["ports"] == [{"protocol": "TCP", "port": 443}]
    elif case == "autoscaling-groups":
        spec = job["rayClusterSpec"]
        assert spec["enableInTreeAutoscaling"] is True
        groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
        assert (groups["gpu"]["minReplicas"], groups["gpu"]["replicas"], groups["gpu"]["maxReplicas"]) == (1, 2, 4)
        big = container(groups["big"]["template"])
        assert big["resources"]["limits"]["amd.com/gpu"] == big["resources"]["requests"]["amd.com/gpu"] == "4"
        assert big["image"].endswith(":0.1.0-rocm") and groups["big"]["rayStartParams"]["num-gpus"] == "4"
        # Workers follow the GPUs at most: gpu 4 pods x 1 + big 1 x 2 hosts x 4 = 12.
        assert "--set scaling.num_workers=12 " in job["entrypoint"]
        env = env_of(container(templates["head"]))
        assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_IB_DISABLE"] == "1"
        assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
        assert one(objects, "PersistentVolumeClaim")["spec"]["storageClassName"] == "nfs-rwx"


# --- bad values fail helm template, naming the value ------------------------------------------------------

BAD_VALUES = {
    "wrong-type": ({"training": {"train": {"epochs": "three"}}}, "/training/train/epochs"),
    "negative-gpus": ({"workers": {"gpu": {"gpus": -1}}}, "/workers/gpu/gpus"),
    "unknown-training-key": ({"training": {"train": {"epoch": 2}}}, "'epoch' not allowed"),
    "unknown-chart-key": ({"worker": {"gpu": {"replicas": 2}}}, "'worker' not allowed"),
    "bad-enum": ({"training": {"train": {"precision": "fp8"}}}, "/training/train/precision"),
    "name-too-long": ({"training": {"experiment": {"name": "x" * 41}}}, "/training/experiment/name"),
    "name-not-dns": ({"training": {"experiment": {"name": "GPT2_run"}}}, "/training/experiment/name"),
    "workers-over-gpus": ({"training": {"scaling": {"num_workers": 5}}}, "training.scaling.num_workers: 5"),
    "cpus-per-worker": ({"training": {"scaling": {"cpus_per_worker": 12.0}}}, "training.scaling.cpus_per_worker: 12"),
    "no-gpus": ({"workers": {"gpu": {"gpus": 0}}}, "workers: the worker groups provide no GPUs"),
    "bf16-and-fp16": (
        {"training": {"deepspeed": {"bf16": {"enabled": True}, "fp16": {"enabled": True}}}},
        "/training/deepspeed/fp16/enabled",
    ),
    "precision-contradiction": (
        {"training": {"deepspeed": {"bf16": {"enabled": False}, "fp16": {"enabled": True}}}},
        "/training/deepspeed/fp16/enabled",
    ),
    "batch-arithmetic": ({"training": {"deepspeed": {"train_batch_size": 8}}}, "training.deepspeed.train_batch_size"),
    "offload-at-top-level": (
        {"training": {"deepspeed": {"offload_optimizer": {"device": "cpu"}}}},
        "/training/deepspeed/offload_optimizer",
    ),
    "zero-stage": (
        {"training": {"deepspeed": {"zero_optimization": {"stage": 4}}}},
        "/training/deepspeed/zero_optimization/stage",
    ),
    "leaf-module-not-a-mapping": (
        {"training": {"deepspeed": {"zero_optimization": {"leaf_module": "LlamaDecoderLayer"}}}},
        "/training/deepspeed/zero_optimization/leaf_module",
    ),
    "claim-and-create": ({"storage": {"existingClaim": "shared"}}, "storage.existingClaim"),
    "no-storage": ({"storage": {"create": False}}, "storage.create"),
    "storage-path-off-volume": (
        {"training": {"experiment": {"storage_path": "/data"}}},
        "training.experiment.storage_path",
    ),
    "gpus-in-resources": (
        {"workers": {"gpu": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}},
        "workers.gpu.resources.limits.nvidia.com/gpu",
    ),
    "token-in-values": ({"huggingface": {"token": "hf_abc"}}, "'token' not allowed"),
    "ttl-without-shutdown": ({"rayJob": {"shutdownAfterJobFinishes": False}}, "rayJob.ttlSecondsAfterFinished"),
    "suspend-persistent": ({"rayJob": {"clusterMode": "persistent", "suspend": True}}, "rayJob.suspend"),
    "eval-both": ({"training": {"data": {"eval_split": "test", "eval_fraction": 0.1}}}, "/training/data/eval_fraction"),
    "backoff-persistent": (
        {"rayJob": {"clusterMode": "persistent", "submissionMode": "HTTPMode"}},
        "rayJob.backoffLimit: 2 with rayJob.clusterMode=persistent",
    ),
    "claim-on-config": ({"storage": {"mountPath": "/etc/finetune"}}, 'storage.mountPath: "/etc/finetune" collides'),
    "claim-on-shm": ({"storage": {"mountPath": "/dev/shm/"}}, 'storage.mountPath: "/dev/shm/" collides'),
    "claim-on-root": ({"storage": {"mountPath": "/"}}, 'storage.mountPath: "/" collides'),
    "claim-above-config": ({"storage": {"mountPath": "/etc"}}, 'storage.mountPath: "/etc" collides'),
    "claim-in-ray-logs": ({"storage": {"mountPath": "/tmp/ray/ckpt"}}, 'storage.mountPath: "/tmp/ray/ckpt" collides'),
    "bad-quantity": ({"storage": {"size": "lots"}}, "/storage/size"),
    "bad-nccl-env": ({"ncclEnv": {"DEBUG": "INFO"}}, "ncclEnv.DEBUG"),
    "rwo-many-pods": (
        {"storage": {"accessModes": ["ReadWriteOnce"]}},
        "storage.accessModes: [ReadWriteOnce], but the head and 2 worker pods (3 in all)",
    ),
    "rwop-many-pods": (
        {"storage": {"accessModes": ["ReadWriteOncePod"]}, "workers": {"gpu": {"replicas": 4}}},
        "the head and 4 worker pods (5 in all)",
    ),
    "auth-disabled-unacknowledged": ({"auth": {"mode": "disabled"}}, "auth.mode: disabled lets anything"),
    "digest-as-tag": ({"image": {"tag": "sha256:" + "ab" * 32}}, 'image.tag: "sha256:abab'),
    "group-digest-as-tag": (
        {"workers": {"gpu": {"image": {"tag": "sha256:" + "ab" * 32}}}},
        "Fix: --set workers.gpu.image.digest=sha256:",
    ),
    "tag-with-colon": ({"head": {"image": {"tag": "0.1:x"}}}, 'head.image.tag: "0.1:x" is not a valid image tag'),
    "short-digest": ({"image": {"digest": "sha256:abc"}}, "/image/digest"),
    "prepare-gpus": ({"prepare": {"enabled": True, "worker": {"gpus": 1}}}, "'gpus' not allowed"),
    "prepare-gpu-resource": (
        {"prepare": {"enabled": True, "worker": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}},
        "prepare.worker.resources.limits.nvidia.com/gpu: the prepare job prepares the data on CPUs",
    ),
    "prepare-name-too-long": (
        {"prepare": {"enabled": True}, "training": {"experiment": {"name": "x" * 40}}},
        "names the prepare job's RayJob",
    ),
    "prepare-literal-secret": (
        {"prepare": {"enabled": True, "worker": {"env": [{"name": "HF_TOKEN", "value": "hf_x"}]}}},
        "prepare.worker.env[0]: HF_TOKEN has a literal value",
    ),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_fail_naming_the_value(case, tmp_path):
    values, named = BAD_VALUES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text(yaml.safe_dump(values))
    out = helm(*template_args([path]), check=False)
    assert out.returncode != 0, f"{case}: helm template accepted {values}"
    assert named in out.stderr, out.stderr


def test_release_name_as_experiment_name_is_checked():
    out = helm(*template_args(release="a-release-name-much-longer-than-forty-chars"), check=False)
    assert out.returncode != 0 and "training.experiment.name: unset, so the release name" in out.stderr


# --- the app accepts what the chart renders ------------------------------------------------------------------

DS_CASES = {
    **{f"example-{p.stem}": ([p], [], []) for p in EXAMPLE_VALUES},
    "defaults": ([], [], []),
    "two-groups-arithmetic": (
        [],
        [
            "training.train.micro_batch_size=3",
            "training.train.gradient_accumulation_steps=5",
            "workers.gpu.replicas=2",
            "workers.gpu.gpus=4",
        ],
        ['workers.extra={"replicas": 1, "gpus": 2}'],
    ),
    "explicit-workers-fp16-stage2": (
        [],
        [
            "training.scaling.num_workers=3",
            "training.train.precision=fp16",
            "training.train.micro_batch_size=2",
            "workers.gpu.replicas=4",
            "training.deepspeed.zero_optimization.stage=2",
        ],
        [],
    ),
    "fp32-optimizer-autos": (
        [],
        [
            "training.train.precision=fp32",
            "training.train.gradient_accumulation_steps=4",
            "training.deepspeed.train_batch_size=8",
        ],
        [
            'training.deepspeed.optimizer={"type": "AdamW", "params": {"lr": "auto", '
            '"betas": "auto", "eps": "auto", "weight_decay": "auto"}}',
            "training.train.learning_rate=0.0003",
            "training.train.weight_decay=0.01",
            'training.deepspeed.grad_accum_dtype="auto"',
        ],
    ),
    "cpu-workers": (
        [],
        [
            "training.scaling.use_gpu=false",
            "workers.gpu.gpus=0",
            "workers.gpu.replicas=3",
            "training.deepspeed.zero_optimization.stage=1",
        ],
        [],
    ),
}


def on_the_volume(objects: list[dict], tmp_path: Path) -> list[str]:
    """What a config reads from the checkpoint volume is not on this machine; stand-ins take the volume's paths,
    moved under tmp_path: a model folder (examples/values-cpu.yaml, the SFT run's final/ in
    examples/values-llama8b-dpo-lora.yaml) with a small GPT-2 config.json, a weights file without tensors and a
    tokenizer file, and a dataset of conversations (examples/values-llama8b-chat-lora.yaml) or, for a config with
    `preference`, of preference pairs. validate reads no more of them than that they are there, whole, and give
    rows to train on."""
    training = yaml.safe_load(config_files(objects)["training.yaml"])
    mounts = [m["mountPath"] for m in container(pod_templates(objects)["head"])["volumeMounts"]]
    sets = []
    dataset = (training.get("data") or {}).get("dataset", "")
    if (mount := next((m for m in mounts if dataset.startswith(m + "/")), None)) is not None:
        data = tmp_path / "volume" / dataset.removeprefix(mount + "/")
        data = data.parent / data.name.replace("*", "part-0")
        data.parent.mkdir(parents=True, exist_ok=True)
        turns = [
            {"role": "user", "content": "Which section? Stocks rally."},
            {"role": "assistant", "content": "Business"},
        ]
        row = {"messages": turns}
        if training.get("preference"):
            row = {"prompt": turns[:1], "chosen": turns[1:], "rejected": [{"role": "assistant", "content": "Sports"}]}
        data.write_text("".join(json.dumps(row) + "\n" for _ in range(400)))
        sets = ["--set", f"data.dataset={data}"]
    model = (training.get("model") or {}).get("name_or_path", "")
    mount = next((m for m in mounts if model.startswith(m + "/")), None)
    if not mount:
        return sets
    folder = tmp_path / "volume" / model.removeprefix(mount + "/")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": 8192, "vocab_size": 1000}
        )
    )
    (folder / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    (folder / "tokenizer.json").write_text("{}")
    return [*sets, "--set", f"model.name_or_path={folder}"]


def test_app_resolves_what_the_chart_renders(tmp_path):
    """For each value set: the ConfigMap's training.yaml, with the entrypoint's --set arguments, through the
    real `finetune validate --ds-config-only` (model config not readable offline) is valid, and the DeepSpeed
    config the app resolves uses the worker count the chart decided. One Python process runs every case."""
    cases = []
    for case, (values, sets, set_json) in DS_CASES.items():
        objects = render(values, sets, set_json)
        config = tmp_path / f"{case}.yaml"
        config.write_text(config_files(objects)["training.yaml"])
        entry = one(objects, "RayJob")["spec"]["entrypoint"].split()
        # values-prepare.yaml: `finetune prepare` of the same config runs the same checks first.
        assert entry[:3] == ["finetune", "prepare" if "prepare" in case else "train", "/etc/finetune/training.yaml"]
        argv = ["validate", str(config), *entry[3:], "--set", f"experiment.storage_path={tmp_path}", "--ds-config-only"]
        cases.append((case, argv + on_the_volume(objects, tmp_path)))
    script = (
        "import contextlib, io, json, sys\n"
        "from app.cli import main\n"
        "out = {}\n"
        "for case, argv in json.loads(sys.argv[1]):\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf):\n"
        "        rc = main(argv)\n"
        "    out[case] = [rc, buf.getvalue()]\n"
        "print('RESULT' + json.dumps(out))\n"
    )
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "DS_ACCELERATOR": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.split("RESULT", 1)[1])
    resolved = {}
    for case, _ in cases:
        rc, printed = results[case]
        assert rc == 0, f"{case}: finetune validate failed:\n{proc.stderr[-3000:]}"
        resolved[case] = json.loads(printed)
    # micro x accumulation x the workers the chart derived from the groups (or was given).
    assert resolved["two-groups-arithmetic"]["train_batch_size"] == 3 * 5 * (2 * 4 + 2)
    assert resolved["explicit-workers-fp16-stage2"]["train_batch_size"] == 2 * 1 * 3
    assert "stage3_prefetch_bucket_size" not in resolved["explicit-workers-fp16-stage2"]["zero_optimization"]
    assert resolved["explicit-workers-fp16-stage2"]["grad_accum_dtype"] == "fp16"
    assert resolved["fp32-optimizer-autos"]["optimizer"]["params"]["lr"] == 0.0003
    assert resolved["cpu-workers"]["train_batch_size"] == 3


# --- helpers ------------------------------------------------------------------------------------------------


def merge(base: dict[str, Any], *tops: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of values files (maps merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for top in tops:
        for key, value in (top or {}).items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out
