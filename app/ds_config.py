"""The DeepSpeed config builder: fills "auto" values the way the Hugging Face integration does.

The `deepspeed` section is passed through unchanged except for "auto" values, which come from the other
sections (batch sizes, clipping, precision), from the model's hidden size (ZeRO-3 bucket sizes) and from its
layer class (`zero_optimization.leaf_module.classes`: ZeRO-3 fetches each decoder layer whole), and
the mistakes DeepSpeed would silently accept (offload keys at the top level) are rejected here.
"""

from __future__ import annotations

import copy
from typing import Any

from app.config import ConfigError, Problem, TrainingConfig

AUTO = "auto"
OFFLOAD_KEYS = ("offload_param", "offload_optimizer")


def check(cfg: TrainingConfig) -> list[Problem]:
    """Problems in the deepspeed block that can be seen without the model."""
    ds, problems = cfg.deepspeed, []
    for key in OFFLOAD_KEYS:
        if key in ds:
            problems.append(
                Problem(
                    f"deepspeed.{key}",
                    ds[key],
                    "offload settings at the top level of the DeepSpeed config are ignored by DeepSpeed",
                    f"move it to deepspeed.zero_optimization.{key}",
                )
            )
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        return problems + [Problem("deepspeed.zero_optimization", zero, "must be a mapping", "see DeepSpeed docs")]
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        problems.append(Problem("deepspeed.zero_optimization.stage", stage, "ZeRO stage must be 0, 1, 2 or 3", "set 0-3"))
        stage = 3
    if _offload_device(zero.get("offload_param")) and stage < 3:
        problems.append(
            Problem(
                "deepspeed.zero_optimization.offload_param",
                zero["offload_param"],
                f"parameter offload needs ZeRO stage 3, the stage is {stage}",
                "set deepspeed.zero_optimization.stage=3 or remove offload_param",
            )
        )
    if _offload_device(zero.get("offload_optimizer")) and stage == 0:
        problems.append(
            Problem(
                "deepspeed.zero_optimization.offload_optimizer",
                zero["offload_optimizer"],
                "optimizer offload needs ZeRO stage 1, 2 or 3",
                "raise deepspeed.zero_optimization.stage or remove offload_optimizer",
            )
        )
    leaf = zero.get("leaf_module")
    if leaf is not None:
        fix = "write e.g. leaf_module: {classes: auto} or {classes: [LlamaDecoderLayer]}, or remove it"
        if not isinstance(leaf, dict):
            problems.append(Problem("deepspeed.zero_optimization.leaf_module", leaf, "must be a mapping", fix))
        else:
            for key, value in leaf.items():
                listed = isinstance(value, (str, list)) and all(isinstance(v, str) for v in (value if isinstance(value, list) else [value]))
                if key not in ("classes", "names", "name_suffixes") or not listed or (value == AUTO and key != "classes"):
                    problems.append(Problem(f"deepspeed.zero_optimization.leaf_module.{key}", value,
                                            "DeepSpeed takes classes, names or name_suffixes, each a list of names "
                                            "('auto' only for classes)", fix))
    wanted = {"bf16": cfg.train.precision == "bf16", "fp16": cfg.train.precision == "fp16"}
    enabled = {}
    for key in ("bf16", "fp16"):
        value = ds.get(key, {}).get("enabled", False) if isinstance(ds.get(key), dict) else False
        enabled[key] = wanted[key] if value == AUTO else bool(value)
        if value not in (AUTO, True, False):
            problems.append(Problem(f"deepspeed.{key}.enabled", value, "must be true, false or 'auto'", "use 'auto'"))
    if enabled["bf16"] and enabled["fp16"]:
        problems.append(
            Problem("deepspeed.bf16.enabled", True, "bf16 and fp16 are both enabled", "enable one: set the other to false, or both to 'auto' and choose train.precision")
        )
    for key in ("bf16", "fp16"):
        if enabled[key] and not wanted[key] and not (enabled["bf16"] and enabled["fp16"]):
            problems.append(
                Problem(f"deepspeed.{key}.enabled", True, f"contradicts train.precision={cfg.train.precision}", f"set train.precision={key} or deepspeed.{key}.enabled='auto'")
            )
    problems += _check_batch(cfg)
    return problems


def _check_batch(cfg: TrainingConfig) -> list[Problem]:
    ds, t, world = cfg.deepspeed, cfg.train, cfg.scaling.num_workers
    problems = []
    for key, ours, field in (
        ("train_micro_batch_size_per_gpu", t.micro_batch_size, "train.micro_batch_size"),
        ("gradient_accumulation_steps", t.gradient_accumulation_steps, "train.gradient_accumulation_steps"),
    ):
        value = ds.get(key, AUTO)
        if value != AUTO and value != ours:
            problems.append(Problem(f"deepspeed.{key}", value, f"differs from {field}={ours}", f"set it to 'auto' (or to {ours})"))
    total = ds.get("train_batch_size", AUTO)
    expected = t.micro_batch_size * t.gradient_accumulation_steps * world
    if total != AUTO and total != expected:
        problems.append(
            Problem(
                "deepspeed.train_batch_size",
                total,
                f"must equal micro-batch x accumulation x workers = {t.micro_batch_size} x "
                f"{t.gradient_accumulation_steps} x {world} = {expected}",
                "set it to 'auto', or change train.micro_batch_size / gradient_accumulation_steps / scaling.num_workers",
            )
        )
    return problems


def _offload_device(section: Any) -> bool:
    return isinstance(section, dict) and section.get("device", "none") not in ("none", None)


def optimizer_offloaded(cfg: TrainingConfig) -> bool:
    return _offload_device(cfg.deepspeed.get("zero_optimization", {}).get("offload_optimizer"))


def zero3(cfg: TrainingConfig) -> bool:
    """ZeRO stage 3, read safely from a deepspeed block that may still be invalid (check() reports that)."""
    zero = cfg.deepspeed.get("zero_optimization")
    return isinstance(zero, dict) and zero.get("stage") == 3


def model_facts(cfg: TrainingConfig, model_config) -> dict[str, Any]:
    """What `build` needs from a transformers model config, as its keyword arguments."""
    from app.model import hidden_size, zero3_leaf_layers

    leaf = cfg.deepspeed.get("zero_optimization", {}).get("leaf_module") if zero3(cfg) else None
    wanted = isinstance(leaf, dict) and leaf.get("classes") == AUTO
    classes, params = zero3_leaf_layers(model_config, cfg.model.trust_remote_code) if wanted else ([], 0)
    return {"hidden_size": hidden_size(model_config), "layer_classes": classes, "layer_params": params}


def build(cfg: TrainingConfig, hidden_size: int | None = None, world_size: int | None = None,
          layer_classes: list[str] | None = None, layer_params: int = 0) -> dict[str, Any]:
    """The final DeepSpeed config: the user's block with every "auto" filled. `hidden_size`, `layer_classes`
    and `layer_params` come from the model config (`model_facts`); None when it cannot be read yet (validate
    offline), and then the values derived from them stay "auto" until the run starts."""
    problems = check(cfg)
    if problems:
        raise ConfigError(problems)
    t = cfg.train
    world = world_size or cfg.scaling.num_workers
    ds = copy.deepcopy(cfg.deepspeed)
    fill = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "train_batch_size": t.micro_batch_size * t.gradient_accumulation_steps * world,
        "gradient_clipping": t.max_grad_norm,
    }
    for key, value in fill.items():
        if ds.get(key, AUTO) == AUTO:
            ds[key] = value
    for key in ("bf16", "fp16"):
        if isinstance(ds.get(key), dict) and ds[key].get("enabled") == AUTO:
            ds[key]["enabled"] = t.precision == key
    if ds.get("grad_accum_dtype") == AUTO:
        ds["grad_accum_dtype"] = {"bf16": "bf16", "fp16": "fp16"}.get(t.precision, "fp32")
    if t.precision != "bf16" and ds.get("grad_accum_dtype") == "bf16":
        # The tutorial's bf16 accumulation only makes sense when training in bf16.
        ds["grad_accum_dtype"] = "fp32" if t.precision == "fp32" else "fp16"
    zero = ds.setdefault("zero_optimization", {})
    h = hidden_size or 0
    leaf = zero.get("leaf_module")
    auto_leaf = isinstance(leaf, dict) and leaf.get("classes") == AUTO
    whole_layers = auto_leaf and bool(layer_classes)
    # Hugging Face's rules from the hidden size; with whole decoder layers fetched, the prefetch bucket holds at
    # least one layer: DeepSpeed prefetches whole parameters up to the bucket, so a bucket smaller than a layer
    # fetches nothing ahead, and one layer's worth lets the next layer's all-gather overlap this layer's compute.
    prefetch = max(int(0.9 * h * h), layer_params if whole_layers else 0)
    derived = {
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": prefetch,
        "prefetch_bucket_size": prefetch,
        "stage3_param_persistence_threshold": 10 * h,
        "param_persistence_threshold": 10 * h,
    }
    for key, value in derived.items():
        if zero.get(key) == AUTO and hidden_size:
            zero[key] = value
    if auto_leaf and layer_classes is not None:
        if layer_classes:
            leaf["classes"] = list(layer_classes)
        else:
            leaf.pop("classes")  # DeepSpeed's own defaults (its MoE blocks)
    if zero.get("stage", 0) < 3:
        # Stage-3-only knobs make DeepSpeed warn on lower stages; they mean nothing there.
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            zero.pop(key, None)
        if auto_leaf:
            leaf.pop("classes", None)
    if leaf == {}:
        del zero["leaf_module"]
    if "optimizer" in ds:
        params = ds["optimizer"].setdefault("params", {})
        for key, value in {
            "lr": t.learning_rate,
            "betas": list(t.adam_betas),
            "eps": t.adam_eps,
            "weight_decay": t.weight_decay,
        }.items():
            if params.get(key) == AUTO:
                params[key] = value
    # Without the model (validate before it is downloaded) the model-shape values stay "auto" until run start.
    model_derived = [*derived, "leaf_module.classes"]
    leftover = [p for p in _find_auto(ds)
                if (hidden_size and layer_classes is not None) or p.removeprefix("zero_optimization.") not in model_derived]
    if leftover:
        raise ConfigError(
            [Problem(f"deepspeed.{path}", AUTO, "no rule fills this 'auto' value", "set a concrete value") for path in leftover]
        )
    return ds


def _find_auto(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _find_auto(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if node == AUTO else []
