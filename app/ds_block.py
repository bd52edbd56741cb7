"""The `deepspeed` block's typed model and the rules within it: a config model, below `app.config` which holds it.

The block is a DeepSpeed config passed through as is. The parts the app reasons about are typed here (the ZeRO
stage, the offload sections, the leaf modules, the precision sections, the batch fields, optimizer and
scheduler); every other key passes through untouched. The rules within the block are validators of the models
below: they fail `app.config.parse`, and reach `helm install` through the JSON schema pydantic generates, plus
`zero_schema_rules` for the cross-field one. The rules against the other sections and the builder that fills
"auto" values are `app.ds_config`'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WrapValidator,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

AUTO = "auto"
RULE = "deepspeed_rule"  # pydantic error type of the rules below; its ctx carries the fix (and a sub-field)
LEAF_FIX = "write e.g. leaf_module: {classes: auto} or {classes: [LlamaDecoderLayer]}, or remove it"


def rule(message: str, fix: str, field: str = "", value: Any = None) -> PydanticCustomError:
    """A rule's failure, as pydantic carries it; `app.config` turns it into a Problem naming `field` (below the
    validated model's location) and `value`."""
    # The message goes through str.format with ctx: no braces in it (the fix may hold any).
    return PydanticCustomError(
        RULE, message.replace("{", "(").replace("}", ")"), {"fix": fix, "field": field, "value": value}
    )


def one_error(message: str, fix: str, exact_int: bool = False):
    """One clear error for a union/literal type instead of one per branch; ints must be ints, not bools or 3.0."""

    def validate(value: Any, handler):
        if exact_int and type(value) is not int and value != AUTO:
            raise rule(message, fix)
        try:
            return handler(value)
        except ValidationError:
            raise rule(message, fix) from None

    return WrapValidator(validate)


Auto = Literal["auto"]
ZeroStage = Annotated[
    Literal[0, 1, 2, 3, "auto"],
    one_error("ZeRO stage must be 0, 1, 2, 3 or auto", "set 0-3, or auto", exact_int=True),
]
AutoBool = Annotated[
    Annotated[bool, Field(strict=True)] | Auto, one_error("must be true, false or 'auto'", "use 'auto'")
]
AutoCount = Annotated[
    Auto | Annotated[int, Field(ge=1, strict=True)],
    one_error("must be a whole number >= 1 or 'auto'", "use 'auto'", exact_int=True),
]
AutoNumber = Annotated[Auto | Annotated[float, Field(ge=0)], one_error("must be a number >= 0 or 'auto'", "use 'auto'")]
Names = Annotated[list[str] | str, one_error("must be a list of names", LEAF_FIX)]


class Block(BaseModel):
    """A DeepSpeed section: typed keys are checked, every other key passes through untouched."""

    model_config = ConfigDict(extra="allow")

    @model_serializer(mode="wrap")
    def _as_given(self, handler) -> dict[str, Any]:
        # Only the keys the user (or the tutorial's block) gave: DeepSpeed's defaults stay DeepSpeed's, and a
        # dumped config validates back to the same block.
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}

    def to_dict(self) -> dict[str, Any]:
        """The section as the user wrote it (merged over the tutorial's), for DeepSpeed's JSON config."""
        return self.model_dump(mode="json", exclude_unset=True)


def _mapping(kind: str, fix: str):
    def check(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            raise rule(f"must be a mapping{kind}", fix)
        return value

    return model_validator(mode="before")(classmethod(check))


class Offload(Block):
    device: Literal["none", "cpu", "nvme"] | None = "none"

    _shape = _mapping(" with a device", "write e.g. {device: cpu}")

    @property
    def on(self) -> bool:
        return self.device not in ("none", None)


class LeafModule(Block):
    """ZeRO-3 leaf modules, fetched whole; classes 'auto': the model's decoder layer (`app.model.model_facts`)."""

    model_config = ConfigDict(extra="forbid")  # DeepSpeed knows these three only
    classes: Annotated[Auto | list[str] | str | None, one_error("must be 'auto' or a list of names", LEAF_FIX)] = None
    names: Annotated[Names | None, Field(json_schema_extra={"not": {"const": AUTO}})] = None
    name_suffixes: Annotated[Names | None, Field(json_schema_extra={"not": {"const": AUTO}})] = None

    _shape = _mapping("", LEAF_FIX)

    @field_validator("names", "name_suffixes")
    @classmethod
    def _auto_only_for_classes(cls, value: Any) -> Any:
        if value == AUTO:
            raise rule("'auto' is only for classes", LEAF_FIX)
        return value


class ZeroOptimization(Block):
    stage: ZeroStage = Field(
        0,
        description="ZeRO stage: 0 keeps a whole copy of weights, gradients and optimizer states on each GPU, 1 "
        "partitions the optimizer states over the GPUs, 2 the gradients too, 3 the weights too. auto (the app's "
        "default): chosen before any cluster starts from the GPUs, their memory, the model, LoRA or full and "
        "seq_length (0 on one GPU; 2 or 3 for full fine-tuning on several; 0 or 3 for LoRA), the reason logged; "
        "3 on CPU workers; offload_param makes it 3, offload_optimizer 2 or 3.",
    )
    offload_param: Offload | None = None
    offload_optimizer: Offload | None = None
    leaf_module: LeafModule | None = None

    _shape = _mapping("", "see DeepSpeed's zero_optimization docs")

    @model_validator(mode="after")
    def _offload_needs_stage(self) -> ZeroOptimization:
        if self.stage == AUTO:  # chosen to suit the offload (app.resolve)
            return self
        if self.offload_param and self.offload_param.on and self.stage < 3:
            raise rule(
                f"parameter offload needs ZeRO stage 3, the stage is {self.stage}",
                "set deepspeed.zero_optimization.stage=3 or remove offload_param",
                "offload_param",
                self.offload_param.to_dict(),
            )
        if self.offload_optimizer and self.offload_optimizer.on and self.stage == 0:
            raise rule(
                "optimizer offload needs ZeRO stage 1, 2 or 3",
                "raise deepspeed.zero_optimization.stage or remove offload_optimizer",
                "offload_optimizer",
                self.offload_optimizer.to_dict(),
            )
        return self


class Precision(Block):
    enabled: AutoBool = False

    _shape = _mapping(" with enabled", "write e.g. {enabled: auto}")


class Component(Block):
    """`optimizer` or `scheduler`: DeepSpeed's own instead of the app's AdamW / schedule."""

    type: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    _shape = _mapping(" with 'type' and 'params'", "see DeepSpeed's config docs, or remove it to use the app's")


def _top_level_offload(key: str):
    def refuse(cls, value: Any) -> Any:
        if value is None:  # a dumped config's placeholder, not the user's
            return value
        raise rule(
            "offload settings at the top level of the DeepSpeed config are ignored by DeepSpeed",
            f"move it to deepspeed.zero_optimization.{key}",
        )

    return field_validator(key, mode="before")(classmethod(refuse))


class DeepSpeedConfig(Block):
    """The `deepspeed` block. Its defaults are DeepSpeed's; the app's defaults are `tutorial_ds_config()`, over
    which a user's block is merged (`app.config.parse`)."""

    train_micro_batch_size_per_gpu: AutoCount = AUTO
    gradient_accumulation_steps: AutoCount = AUTO
    train_batch_size: AutoCount = AUTO
    gradient_clipping: AutoNumber = AUTO
    bf16: Precision | None = None
    fp16: Precision | None = None
    zero_optimization: ZeroOptimization = Field(default_factory=ZeroOptimization)
    optimizer: Component | None = None
    scheduler: Component | None = None
    # Where DeepSpeed silently ignores them; refused so that nobody believes they offload.
    offload_param: Annotated[Any, Field(json_schema_extra={"not": {}})] = None
    offload_optimizer: Annotated[Any, Field(json_schema_extra={"not": {}})] = None

    _no_top_offload_param = _top_level_offload("offload_param")
    _no_top_offload_optimizer = _top_level_offload("offload_optimizer")

    @model_validator(mode="after")
    def _one_precision(self) -> DeepSpeedConfig:
        if self.enabled("bf16") is True and self.enabled("fp16") is True:
            raise rule(
                "bf16 and fp16 are both enabled",
                "enable one: set the other to false, or both to 'auto' and choose train.precision",
                "bf16.enabled",
                True,
            )
        return self

    def enabled(self, key: Literal["bf16", "fp16"]) -> bool | str:
        section = getattr(self, key)
        return section.enabled if section else False

    @property
    def zero_stage(self) -> int | str:
        """0-3, or "auto" before app.autoset has chosen it (never after)."""
        return self.zero_optimization.stage

    @property
    def zero3(self) -> bool:
        return self.zero_stage == 3

    @property
    def optimizer_offloaded(self) -> bool:
        return bool(self.zero_optimization.offload_optimizer and self.zero_optimization.offload_optimizer.on)

    @property
    def auto_leaf_classes(self) -> bool:
        """ZeRO-3 (or a stage not chosen yet) with `leaf_module.classes: auto`: the model's decoder layer is fetched
        whole."""
        leaf = self.zero_optimization.leaf_module
        return self.zero_stage in (3, AUTO) and leaf is not None and leaf.classes == AUTO


def tutorial_ds_config() -> dict[str, Any]:
    """The tutorial's DeepSpeed config, with the values it hard-codes turned into "auto"."""
    return {
        "train_micro_batch_size_per_gpu": AUTO,
        "gradient_accumulation_steps": AUTO,
        "train_batch_size": AUTO,
        "gradient_clipping": AUTO,
        "bf16": {"enabled": AUTO},
        "fp16": {"enabled": AUTO},
        "grad_accum_dtype": "bf16",
        "zero_optimization": {
            # Not the tutorial's 3: chosen from the GPUs, the model and the method (app/resolve.py).
            "stage": AUTO,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": AUTO,
            "stage3_prefetch_bucket_size": AUTO,
            "stage3_param_persistence_threshold": AUTO,
            # Not the tutorial's: ZeRO-3 fetches each decoder layer whole (see `build`).
            "leaf_module": {"classes": AUTO},
        },
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def zero_schema_rules() -> list[dict[str, Any]]:
    """ZeroOptimization's offload rule as JSON schema. A missing stage means the app's default ("auto", which
    suits the offload): the chart's values hold the user's block before `parse` merges it over the app's."""
    tutorial_stage = tutorial_ds_config()["zero_optimization"]["stage"]

    def offloaded(key: str) -> dict[str, Any]:
        return {
            "required": [key],
            "properties": {key: {"required": ["device"], "properties": {"device": {"enum": ["cpu", "nvme"]}}}},
        }

    def stage(allowed: list[int]) -> dict[str, Any]:
        allowed = [*allowed, AUTO]
        out: dict[str, Any] = {"properties": {"stage": {"enum": allowed}}}
        return out if tutorial_stage in allowed else {**out, "required": ["stage"]}

    return [
        {"if": offloaded("offload_param"), "then": stage([3])},
        {"if": offloaded("offload_optimizer"), "then": stage([1, 2, 3])},
    ]
