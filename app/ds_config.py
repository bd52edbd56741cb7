"""The DeepSpeed config a run uses: the `deepspeed` block's rules against the other sections, and the builder
that fills its "auto" values.

The block's typed model and the rules within it are `app.ds_block`'s (a config model, below `app.config`). The
rules against the other sections (precision, batch sizes, the worker count) live here and only here: `check`,
and `schema_rules`, the same rules as JSON schema for `helm install`. `build` fills "auto" the way the Hugging
Face integration does: from the other sections (batch sizes, clipping, precision) and from facts about the model
that the caller passes in (`app.model.model_facts`: the hidden size for bucket sizes, the layer class for ZeRO-3
leaf modules).
"""

from __future__ import annotations

from typing import Any

from app.config import TrainingConfig, stand_ins
from app.ds_block import AUTO
from app.errors import ConfigError, Problem

# --- rules against the other sections -----------------------------------------------------------------------


def check(cfg: TrainingConfig, world_size: int | None = None) -> list[Problem]:
    """Problems of the block against the other sections: precision, batch sizes and the number of workers (of the
    settings app.autoset chose; where one is still auto, of its stand-in)."""
    cfg = stand_ins(cfg)
    return _check_precision(cfg) + _check_batch(cfg, data_parallel(cfg, world_size))


def _check_precision(cfg: TrainingConfig) -> list[Problem]:
    problems = []
    for key in ("bf16", "fp16"):
        if cfg.deepspeed.enabled(key) is True and cfg.train.precision != key:
            problems.append(
                Problem(
                    f"deepspeed.{key}.enabled",
                    True,
                    f"contradicts train.precision={cfg.train.precision}",
                    f"set train.precision={key} or deepspeed.{key}.enabled='auto'",
                )
            )
    return problems + _check_pure_bf16(cfg)


def _check_pure_bf16(cfg: TrainingConfig) -> list[Problem]:
    if cfg.train.pure_bf16 is True and cfg.train.precision != "bf16":
        return [
            Problem(
                "train.pure_bf16",
                True,
                f"keeps bf16 weights without an fp32 copy, but train.precision is {cfg.train.precision}",
                "set train.precision: bf16, or train.pure_bf16: false",
            )
        ]
    return []


def plain_bf16(cfg: TrainingConfig) -> bool:
    """train.pure_bf16 under ZeRO stage 0: DeepSpeed's mixed precision is off (it has no bf16 master weights at stage
    0) and the model, cast to bf16, is updated directly by the client AdamW, which also clips: the step plain
    PyTorch takes, with DeepSpeed's engine (gradient averaging, checkpoints) around it. Under ZeRO 1-3 DeepSpeed's
    own bf16_master_weights_and_grads and bf16_optimizer_states do it instead."""
    return cfg.train.pure_bf16 is True and cfg.deepspeed.zero_stage == 0


def data_parallel(cfg: TrainingConfig, world_size: int | None = None) -> int:
    """The data-parallel degree of `world_size` workers (default: scaling.num_workers): the workers of one sequence
    (scaling.sequence_parallel) share its batch, so a global batch counts each group once."""
    return max(1, (world_size or cfg.scaling.num_workers) // cfg.scaling.sequence_parallel)


def global_batch(micro_batch_size: int, accumulation: int, world: int) -> int:
    """Sequences per optimizer step: the rule DeepSpeed enforces on train_batch_size."""
    return micro_batch_size * accumulation * world


def _check_batch(cfg: TrainingConfig, world: int) -> list[Problem]:
    ds, t = cfg.deepspeed, cfg.train
    problems = []
    for key, ours, field in (
        ("train_micro_batch_size_per_gpu", t.micro_batch_size, "train.micro_batch_size"),
        ("gradient_accumulation_steps", t.gradient_accumulation_steps, "train.gradient_accumulation_steps"),
    ):
        value = getattr(ds, key)
        if value != AUTO and value != ours:
            problems.append(
                Problem(f"deepspeed.{key}", value, f"differs from {field}={ours}", f"set it to 'auto' (or to {ours})")
            )
    expected = global_batch(t.micro_batch_size, t.gradient_accumulation_steps, world)
    sp = cfg.scaling.sequence_parallel
    workers = "workers" if sp == 1 else f"data-parallel workers (num_workers / sequence_parallel {sp})"
    if ds.train_batch_size != AUTO and ds.train_batch_size != expected:
        problems.append(
            Problem(
                "deepspeed.train_batch_size",
                ds.train_batch_size,
                f"must equal micro-batch x accumulation x {workers} = {t.micro_batch_size} x "
                f"{t.gradient_accumulation_steps} x {world} = {expected}",
                "set it to 'auto', or change train.micro_batch_size / gradient_accumulation_steps / "
                "scaling.num_workers",
            )
        )
    return problems


def schema_rules(precision_default: str) -> list[dict[str, Any]]:
    """The cross-field rules above as JSON schema (for the `training` object of the chart's values), so that
    `helm install` rejects them too. Written against the values as given: a missing key means the app's default
    (train.precision `precision_default`). The batch rule needs the worker count: the chart's validate.yaml."""

    def enabled_true(key: str) -> dict[str, Any]:
        return {
            "required": ["deepspeed"],
            "properties": {
                "deepspeed": {
                    "required": [key],
                    "properties": {key: {"required": ["enabled"], "properties": {"enabled": {"const": True}}}},
                }
            },
        }

    def not_enabled(key: str) -> dict[str, Any]:
        return {
            "properties": {"deepspeed": {"properties": {key: {"properties": {"enabled": {"not": {"const": True}}}}}}}
        }

    def precision(value: str, equal: bool) -> dict[str, Any]:
        test = {"const": value} if equal else {"not": {"const": value}}
        return {
            "required": ["train"],
            "properties": {"train": {"required": ["precision"], "properties": {"precision": test}}},
        }

    rules = []
    for key in ("bf16", "fp16"):
        if key == precision_default:  # a contradiction only when precision is set to something else
            rules.append({"if": precision(key, equal=False), "then": not_enabled(key)})
        else:  # a contradiction unless precision is set to it
            rules.append({"if": {"not": precision(key, equal=True)}, "then": not_enabled(key)})
    rules.append({"if": enabled_true("bf16"), "then": not_enabled("fp16")})
    return rules


# --- the builder ------------------------------------------------------------------------------------------


def build(
    cfg: TrainingConfig,
    hidden_size: int | None = None,
    world_size: int | None = None,
    layer_classes: list[str] | None = None,
    layer_params: int = 0,
) -> dict[str, Any]:
    """The final DeepSpeed config: the user's block with every "auto" filled. `hidden_size`, `layer_classes`
    and `layer_params` come from the model config (`app.model.model_facts`); None when it cannot be read yet (validate
    offline), and then the values derived from them stay "auto" until the run starts. For a config `check` passed:
    app.preflight runs it once, before this. Settings left to auto (a config that never went through app.autoset)
    are built as they were before auto existed (config.BEFORE_AUTO)."""
    cfg = stand_ins(cfg)  # a run's config has its auto settings chosen (app.autoset); a test's may not
    t = cfg.train
    world = data_parallel(cfg, world_size)
    ds = cfg.deepspeed.to_dict()
    fill = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "train_batch_size": global_batch(t.micro_batch_size, t.gradient_accumulation_steps, world),
        "gradient_clipping": t.max_grad_norm,
    }
    for key, value in fill.items():
        if ds.get(key, AUTO) == AUTO:
            ds[key] = value
    for key in ("bf16", "fp16"):
        if isinstance(ds.get(key), dict) and ds[key].get("enabled") == AUTO:
            ds[key]["enabled"] = t.precision == key
    if plain_bf16(cfg):  # the model is bf16 already; the app's AdamW clips (DeepSpeed's clipping is per tensor)
        ds.setdefault("bf16", {}).update(enabled=False)
        ds["gradient_clipping"] = ds["gradient_clipping"] if "optimizer" in ds else 0.0
    elif t.pure_bf16:  # the user's block may already name them; true here either way (_check_pure_bf16)
        ds.setdefault("bf16", {}).update(enabled=True, bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    # DeepSpeed's throughput timer synchronises the GPU at every forward pass and optimizer step (its `synchronized`
    # default) for a figure nothing reads (the loop times its own steps): a host sync that drains the GPU's queue
    # every step. Off unless the block configures it.
    ds.setdefault("timers", {"throughput": {"enabled": False}})
    if cfg.scaling.sequence_parallel > 1:
        # Read where DeepSpeed builds its config without the engine's parallel state (ZeRO-3's zero.Init under
        # transformers' HfDeepSpeedConfig): its batch check then counts data-parallel replicas, not workers.
        ds["sequence_parallel_size"] = cfg.scaling.sequence_parallel
    if ds.get("grad_accum_dtype") == AUTO:
        ds["grad_accum_dtype"] = {"bf16": "bf16", "fp16": "fp16"}.get(t.precision, "fp32")
    if t.precision != "bf16" and ds.get("grad_accum_dtype") == "bf16":
        # The tutorial's bf16 accumulation only makes sense when training in bf16.
        ds["grad_accum_dtype"] = "fp32" if t.precision == "fp32" else "fp16"
    _fill_zero(
        ds.setdefault("zero_optimization", {}), cfg.deepspeed.zero_stage, hidden_size, layer_classes, layer_params
    )
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
    model_derived = [*_ZERO_DERIVED, "leaf_module.classes"]
    leftover = [
        p
        for p in _find_auto(ds)
        if (hidden_size and layer_classes is not None) or p.removeprefix("zero_optimization.") not in model_derived
    ]
    if leftover:
        raise ConfigError(
            [
                Problem(f"deepspeed.{path}", AUTO, "no rule fills this 'auto' value", "set a concrete value")
                for path in leftover
            ]
        )
    return ds


_ZERO_DERIVED = (
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "param_persistence_threshold",
)


def _fill_zero(
    zero: dict[str, Any], stage: int, hidden_size: int | None, layer_classes: list[str] | None, layer_params: int
) -> None:
    h = hidden_size or 0
    leaf = zero.get("leaf_module")
    auto_leaf = isinstance(leaf, dict) and leaf.get("classes") == AUTO
    whole_layers = auto_leaf and bool(layer_classes)
    # Hugging Face's rules from the hidden size; with whole decoder layers fetched, the prefetch bucket holds
    # about two layers: DeepSpeed prefetches whole parameters up to the bucket, so a bucket smaller than a layer
    # fetches nothing ahead, and more lets the next layers' all-gathers overlap this layer's compute; the
    # gradient reduction bucket holds about four layers (fewer, larger reductions). Measured against one layer
    # and h^2 on Llama 1.1B ZeRO-3, 2 x H200: 5% faster, same losses (docs/benchmarks-history.md).
    ahead = int(2.25 * layer_params) if whole_layers else 0
    prefetch = max(int(0.9 * h * h), ahead)
    derived = dict(zip(_ZERO_DERIVED, (max(h * h, 2 * ahead), prefetch, prefetch, 10 * h, 10 * h)))
    for key, value in derived.items():
        if zero.get(key) == AUTO and hidden_size:
            zero[key] = value
    if auto_leaf and layer_classes is not None:
        if layer_classes:
            leaf["classes"] = list(layer_classes)
        else:
            leaf.pop("classes")  # DeepSpeed's own defaults (its MoE blocks)
    if stage < 3:
        # Stage-3-only knobs make DeepSpeed warn on lower stages; they mean nothing there.
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            zero.pop(key, None)
        if auto_leaf:
            leaf.pop("classes", None)
    if leaf == {}:
        del zero["leaf_module"]


def _find_auto(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _find_auto(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if node == AUTO else []
