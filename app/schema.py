"""The Helm chart's values.schema.json: `training` from the app's config models, the rest declared here.

`helm install/template/lint` validate values against it, so the chart rejects what `finetune validate` would
reject (types, ranges, unknown keys) before anything is created. The `training` part is generated from
`TrainingConfig` (pydantic), plus the checks its validators make in code (the experiment name's DNS-1035
form); tests/test_chart.py fails when the committed file differs from what this module generates.

    python -m app.schema            # print the schema
    python -m app.schema --write    # write helm/ray-finetune/values.schema.json and templates/_app_defaults.tpl
                                    # (make schema)
    python -m app.schema --check    # exit 1 when the committed file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from app import ds_block, ds_config
from app.config import DNS1035, MAX_EXPERIMENT_NAME, TrainingConfig

CHART_SCHEMA = Path(__file__).resolve().parents[1] / "helm" / "ray-finetune" / "values.schema.json"
CHART_DEFAULTS = CHART_SCHEMA.parent / "templates" / "_app_defaults.tpl"
DRAFT = "https://json-schema.org/draft/2020-12/schema"
QUANTITY = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
# A worker group's gpuMemory: empty, or scaling.gpu_memory's form without spaces (it goes on the entrypoint).
GPU_MEMORY = r"^$|^[0-9]+([.][0-9]*)?([KkMmGgTt]([Ii]?[Bb])?)?$"


def training_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema of the `training` key, its $defs), from the pydantic models."""
    schema = _simplify(TrainingConfig.model_json_schema(mode="validation"))
    defs = schema.pop("$defs")
    name = defs["ExperimentConfig"]["properties"]["name"]
    assert name["type"] == ["string", "null"], name
    # ExperimentConfig checks this in a validator; the schema states it so helm rejects it too.
    name["pattern"] = DNS1035.pattern
    name["maxLength"] = MAX_EXPERIMENT_NAME
    # The rules that span fields (app.ds_config's, app.ds_block's, DataConfig's), written as JSON schema conditions.
    schema["allOf"] = ds_config.schema_rules(TrainingConfig.model_fields["train"].default.precision)
    defs["ZeroOptimization"]["allOf"] = ds_block.zero_schema_rules()
    schema["description"] = (
        "The app's training config file (see `finetune validate`); generated from "
        "app.config.TrainingConfig by `make schema`."
    )
    return schema, defs


def _simplify(node: Any) -> Any:
    """Drop pydantic's titles, and write `X | None` as one schema typed [X, "null"], so that helm's
    message names the broken constraint instead of listing every failed anyOf branch."""
    if isinstance(node, list):
        return [_simplify(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _simplify(v) for k, v in node.items() if not (k == "title" and isinstance(v, str))}
    branches = node.get("anyOf")
    if isinstance(branches, list) and len(branches) == 2 and {"type": "null"} in branches:
        other = next(b for b in branches if b != {"type": "null"})
        if isinstance(other.get("type"), str) and other["type"] not in ("object", "array"):
            node.pop("anyOf")
            node = {**other, **node, "type": [other["type"], "null"]}
    return node


# --- the Kubernetes half of the values -------------------------------------------------------------------


def _obj(props: dict[str, Any], description: str = "", **extra) -> dict[str, Any]:
    out = {"type": "object", "additionalProperties": False, "properties": props, **extra}
    if description:
        out["description"] = description
    return out


def _int(minimum: int = 0) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum}


STR = {"type": "string"}
BOOL = {"type": "boolean"}
FREE_OBJECT = {"type": "object"}  # a Kubernetes structure (affinity, resources, ...) checked on the output
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
SCALAR_MAP = {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}}
QTY = {"type": "string", "pattern": QUANTITY}
ENV_LIST = {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {"name": STR}}}
LIST_OF_OBJECTS = {"type": "array", "items": {"type": "object"}}
RESOURCES = _obj({"requests": {"type": "object"}, "limits": {"type": "object"}, "claims": {"type": "array"}})
DIGEST = {"type": "string", "pattern": "^(sha256:[a-f0-9]{64})?$", "description": "sha256:<64 hex digits>, or empty"}
IMAGE_OVERRIDE = _obj({"repository": STR, "tag": {"type": ["string", "number"]}, "digest": DIGEST})
SCHEDULING = {
    "nodeSelector": STRING_MAP,
    "tolerations": LIST_OF_OBJECTS,
    "affinity": FREE_OBJECT,
    "priorityClassName": STR,
}
SECURITY = {"podSecurityContext": FREE_OBJECT, "securityContext": FREE_OBJECT}  # the pod's and its containers'


def _pod_group(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "rayStartParams": SCALAR_MAP,
        "resources": RESOURCES,
        "shmSize": QTY,
        "tmpSize": QTY,
        **SCHEDULING,
        "env": ENV_LIST,
        "extraVolumes": LIST_OF_OBJECTS,
        "extraVolumeMounts": LIST_OF_OBJECTS,
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        "image": IMAGE_OVERRIDE,
        **SECURITY,
        **extra,
    }


def _worker_group() -> dict[str, Any]:
    return _obj(
        _pod_group(
            {
                "enabled": BOOL,
                "replicas": _int(0),
                "minReplicas": _int(0),
                "maxReplicas": _int(0),
                "numOfHosts": _int(1),
                "gpus": {**_int(0), "description": "GPUs per pod (requests = limits)."},
                "gpuResource": {"type": "string", "minLength": 1},
                "gpuMemory": {
                    "type": "string",
                    "pattern": GPU_MEMORY,
                    "description": "Each GPU's memory (e.g. 80GiB): training.scaling.gpu_memory, unless that is set.",
                },
            }
        ),
        "One worker group.",
    )


def _ray_job() -> dict[str, Any]:
    return _obj(
        {
            "clusterMode": {"enum": ["ephemeral", "persistent"]},
            "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "SidecarMode"]},
            "shutdownAfterJobFinishes": BOOL,
            "ttlSecondsAfterFinished": _int(0),
            "backoffLimit": _int(0),
            "activeDeadlineSeconds": _int(0),
            "suspend": BOOL,
            "queueName": STR,
            "labels": STRING_MAP,
            "annotations": STRING_MAP,
            "submitter": _obj(
                {
                    "backoffLimit": _int(0),
                    "resources": RESOURCES,
                    "nodeSelector": STRING_MAP,
                    "tolerations": LIST_OF_OBJECTS,
                    **SECURITY,
                }
            ),
        }
    )


def _storage() -> dict[str, Any]:
    return _obj(
        {
            "mountPath": {"type": "string", "pattern": "^/"},
            "create": BOOL,
            "existingClaim": STR,
            "storageClassName": STR,
            "size": QTY,
            "accessModes": {
                "type": "array",
                "minItems": 1,
                "items": {"enum": ["ReadWriteMany", "ReadWriteOnce", "ReadOnlyMany", "ReadWriteOncePod"]},
            },
            "annotations": STRING_MAP,
            "huggingfaceCache": BOOL,
        }
    )


def _preemption() -> dict[str, Any]:
    return _obj(
        {
            "enabled": BOOL,
            "gracePeriodSeconds": {
                "type": "integer",
                "minimum": 30,
                "maximum": 86400,
                "description": "The Ray pods' terminationGracePeriodSeconds: one optimizer step plus one "
                "checkpoint write, with a margin.",
            },
        }
    )


def _prepare() -> dict[str, Any]:
    """`prepare`: `finetune prepare` as a RayJob of its own, with one CPU worker group (no gpus key: no GPU)."""
    return _obj(
        {
            "enabled": BOOL,
            "worker": _obj(
                _pod_group({"replicas": _int(0)}),
                "The CPU worker group of the prepare job's RayCluster (group name cpu).",
            ),
        },
        "true: the release runs `finetune prepare` as the RayJob <experiment>-prepare (a head and a CPU worker "
        "group, no GPU) instead of training.",
    )


def kubernetes_properties() -> dict[str, Any]:
    """The chart's values besides `training`: what only Kubernetes knows."""
    return {
        "image": _obj(
            {
                "repository": {"type": "string", "minLength": 1},
                "tag": {"type": ["string", "number"]},
                "digest": DIGEST,
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            }
        ),
        "imagePullSecrets": {"type": "array", "items": _obj({"name": STR}, required=["name"])},
        "rayVersion": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+\.[0-9]+"},
        "commonLabels": STRING_MAP,
        "rayJob": _ray_job(),
        "auth": _obj({"mode": {"enum": ["token", "disabled"]}, "secretName": STR, "allowDisabled": BOOL}),
        "networkPolicy": _obj(
            {"enabled": BOOL, "operatorNamespace": STR, "extraIngress": LIST_OF_OBJECTS, "egress": LIST_OF_OBJECTS}
        ),
        "autoscaling": _obj({"enabled": BOOL}),
        "head": _obj(_pod_group({"serviceAccountName": STR})),
        "workers": {
            "type": "object",
            "description": "Worker groups keyed by group name; null or enabled: false leaves a group out.",
            "additionalProperties": {**_worker_group(), "type": ["object", "null"]},
        },
        "storage": _storage(),
        "huggingface": _obj(
            {
                "tokenSecret": _obj(
                    {"name": STR, "key": {"type": "string", "minLength": 1}},
                    "An existing Secret holding the token; the token itself never goes in values.",
                ),
            }
        ),
        "tracking": _obj(
            {
                "mlflow": _obj(
                    {
                        "credentialsSecret": STR,
                        "egressTo": LIST_OF_OBJECTS,
                    },
                    "An existing Secret with MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD, and where "
                    "the server is for the NetworkPolicy; the server's URI is training.tracking.mlflow.uri.",
                )
            }
        ),
        "ncclEnv": {**SCALAR_MAP, "description": "NCCL_* variables (validate.yaml rejects other names)."},
        "env": ENV_LIST,
        **SECURITY,
        "progressReporting": _obj({"enabled": BOOL, "rbac": _obj({"create": BOOL})}),
        "preemption": _preemption(),
        "prepare": _prepare(),
    }


def chart_schema() -> dict[str, Any]:
    training, defs = training_schema()
    return {
        "$schema": DRAFT,
        "$comment": "Generated by `python -m app.schema --write` (make schema); do not edit.",
        "type": "object",
        "additionalProperties": False,
        "properties": {**kubernetes_properties(), "training": training},
        "$defs": defs,
    }


def render() -> str:
    return json.dumps(chart_schema(), indent=2) + "\n"


# The app defaults that the chart reads (the worker count, the CPUs per worker pod, the batch rule in
# validate.yaml, NOTES.txt): values.yaml leaves training.* to the app, so the chart takes them from the models too.
CHART_READS = (
    "scaling.use_gpu",
    "scaling.cpus_per_worker",
    "train.micro_batch_size",
    "train.gradient_accumulation_steps",
    "checkpoint.keep",
)


def render_defaults() -> str:
    defaults = TrainingConfig().model_dump(mode="json")
    picked: dict[str, dict[str, Any]] = {}
    for path in CHART_READS:
        section, key = path.split(".")
        picked.setdefault(section, {})[key] = defaults[section][key]
    return (
        "{{/* Generated by `make schema` from app.config.TrainingConfig; do not edit. The app's defaults of the\n"
        'training values the chart\'s own checks read: merged under .Values.training by "ray-finetune.training". */}}\n'
        '{{- define "ray-finetune.appDefaults" -}}\n'
        f"{json.dumps(picked, sort_keys=True)}\n"
        "{{- end }}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.schema", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the chart's values.schema.json and app defaults")
    parser.add_argument("--check", action="store_true", help="exit 1 when the files differ from the models")
    parser.add_argument("--out", type=Path, default=CHART_SCHEMA, help="schema file (default: the chart's)")
    parser.add_argument("--defaults-out", type=Path, default=CHART_DEFAULTS, help="app defaults template")
    args = parser.parse_args(argv)
    files = {args.out: render(), args.defaults_out: render_defaults()}
    if args.check:
        stale = [path for path, text in files.items() if (path.read_text() if path.exists() else "") != text]
        for path in stale:
            print(f"{path} is stale: run `make schema`", file=sys.stderr)
        return 1 if stale else 0
    if args.write:
        for path, text in files.items():
            path.write_text(text)
            print(f"wrote {path}")
        return 0
    sys.stdout.write(files[args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
