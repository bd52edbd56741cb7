"""The training config: one YAML document, validated by typed models.

Every constant of the Ray/DeepSpeed tutorial is a field here with the tutorial's value as its default, so
an empty config reproduces the tutorial. The `deepspeed` section is a DeepSpeed config passed through as
is (typed in `app.ds_block`); its "auto" values are filled by `app.ds_config`.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import secrets
import typing
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.ds_block import RULE, DeepSpeedConfig, one_error, tutorial_ds_config
from app.errors import ConfigError, Problem
from app.preference import PreferenceConfig
from app.resolve import parse_memory

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_EXPERIMENT_NAME = 40  # leaves room for "-head-xxxxx"-style suffixes in a 47-char RayJob name
NAME_PREFIX = "deepspeed-sample"
# Bounds far above any real run, so that a typo (1e12) fails validation instead of an allocation or a hang.
MAX_STEPS = 10**9
MAX_BATCH = 65_536
MAX_SEQ_LENGTH = 1 << 20
MAX_WORKERS = 65_536
# The settings app/resolve.py chooses when they are "auto" (app/autoset.py applies its choice before any cluster).
AUTO_FIX = "write true, false or auto (chosen from the GPUs, the model and the method; docs/training.md)"
# scaling.gpu_memory as app.resolve.parse_memory reads it, for helm: 80GiB, 141G, 80GB, or a number of bytes.
MEMORY_PATTERN = r"^ *[0-9]+([.][0-9]*)? *([KkMmGgTt]([Ii]?[Bb])?)? *$"
AutoSwitch = Annotated[bool | Literal["auto"], one_error("must be true, false or auto", AUTO_FIX)]


class Section(BaseModel):
    # inf and NaN are never meant: `learning_rate: .inf` would "train" to NaN and report success.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_switch_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic takes true/false as 1/0 where a number goes, and YAML reads yes, no, on and off as true/false:
        `epochs: yes` would train one epoch."""
        if isinstance(value, bool) and _number_only(cls.model_fields[info.field_name].annotation):
            raise PydanticCustomError(SWITCH_FOR_NUMBER, "is a switch (true/false), not a number")
        return value


SWITCH_FOR_NUMBER = "switch_for_number"


def _number_only(annotation: Any) -> bool:
    """Whether a field takes numbers and no switch (int, float, int | None, ...)."""
    kinds = set(typing.get_args(annotation)) if typing.get_args(annotation) else {annotation}
    return bool(kinds & {int, float}) and bool not in kinds and Any not in kinds


class ExperimentConfig(Section):
    name: str | None = Field(
        None,
        description="Identity of the run: its folder under storage_path, the Kubernetes object names and the key "
        "to resume. A DNS-1035 label of at most 40 characters. Default: deepspeed-sample-<8 hex>.",
    )
    storage_path: str = Field(
        "/mnt/cluster_storage/",
        description="Shared folder (a ReadWriteMany volume on Kubernetes) for checkpoints, logs and the final model.",
    )

    on_conflict: Literal["fail", "wait"] = Field(
        "fail", description="When another live run holds this experiment: fail at once, or wait for it to end."
    )
    lease_timeout_s: float = Field(
        120,
        gt=0,
        le=86_400,
        description="A run whose lease heartbeat is older than this is dead; the next deploy takes over (at once when "
        "its process or pod is provably gone).",
    )

    @field_validator("name")
    @classmethod
    def _dns_label(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if len(v) > MAX_EXPERIMENT_NAME or not DNS1035.match(v):
            raise ValueError(
                f"must be a DNS-1035 label of at most {MAX_EXPERIMENT_NAME} characters (lowercase letters, digits "
                "and '-', starting with a letter, not ending with '-'), because it also names Kubernetes objects"
            )
        return v

    @field_validator("storage_path")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a folder path")
        return _usable_path(v)


def _usable_path(v: str | None) -> str | None:
    """Reject what no file system accepts (NUL bytes, over-long names) before anything touches the path."""
    if v is not None and ("\x00" in v or len(v) > 4096 or any(len(part.encode()) > 255 for part in v.split("/"))):
        raise ValueError("is not a usable path or name (NUL byte, a component over 255 bytes or over 4096 in all)")
    return v


UsablePath = Annotated[str, AfterValidator(_usable_path)]


class LoraConfig(Section):
    r: int = Field(16, ge=1, le=4096, description="Rank of each adapter's low-rank update.")
    alpha: float = Field(32, gt=0, le=1e6, description="Scale of the update (alpha / r multiplies it).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: Literal["auto"] | Annotated[list[str], Field(min_length=1)] = Field(
        "auto",
        description="Module names (or name suffixes) that get adapters; auto: the attention and MLP projections "
        "of the model type (q/k/v/o, gate/up/down for Llama-style models, c_attn/c_proj/c_fc for GPT-2), or for "
        "other models every linear layer but the output head and MoE routers.",
    )


class LongSequenceConfig(Section):
    tiled_mlp: AutoSwitch = Field(
        "auto",
        description="Compute each decoder layer's MLP in tiles of 8,192 tokens along the sequence, each tile's "
        "forward recomputed in backward, so that the MLP's intermediates (the 8B's: 14,336 x tokens x 2 bytes each "
        "of gate, up and their product) exist for one tile at a time; the outputs and gradients are those of the "
        "untiled MLP. Costs one more MLP forward a step. auto: on when the run would not fit the GPU without it.",
    )
    tiled_loss: AutoSwitch = Field(
        "auto",
        description="Compute the output head and cross-entropy in tiles of at most 2^28 logits, the gradients of "
        "the hidden states (and of the head) computed tile by tile in the forward, so that the full [tokens, "
        "vocabulary] logits never exist. Replaces Liger's fused loss where on. auto: on when the run would not fit "
        "the GPU without it.",
    )
    offload_checkpoints: bool | Literal["auto"] | Annotated[int, Field(ge=0, le=4096)] = Field(
        "auto",
        description="Keep the checkpointed inputs (hidden states, 2 x hidden size bytes a token: 256 KiB a token "
        "for the 8B's 32 layers) of the first N decoder layers in pinned host memory instead of the GPU's, copied "
        "out on a side stream in the forward and back before the layer's recomputation. A number: that many "
        "layers; true: every layer; false or 0: none. auto: the fewest layers that make the run fit the GPU "
        "(app/resolve.py's memory model), refused before start when they do not fit scaling.host_memory. Needs "
        "model.gradient_checkpointing (auto turns it on). On CPUs the copy is a plain one (the same code path).",
    )


class ModelConfig(Section):
    name_or_path: UsablePath = Field("gpt2", description="Hugging Face hub name or a local from_pretrained folder.")
    tokenizer: UsablePath | None = Field(None, description="Tokenizer name or folder; default: name_or_path.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa",
        description="Attention kernel passed to from_pretrained. sdpa: PyTorch's, or the model's eager attention "
        "where transformers has none (Gemma 2, gpt-oss); packed documents kept apart take variable-length "
        "FlashAttention on GPUs instead.",
    )
    gradient_checkpointing: AutoSwitch = Field(
        "auto",
        description="Recompute each decoder layer's activations in backward instead of keeping them: less memory, "
        "about a third more compute. auto: on when the activations of the micro-batch would not fit the GPUs' "
        "memory (app/resolve.py's memory model; the choice and its reason are logged); off on CPUs.",
    )
    long_sequence: Literal["auto"] | LongSequenceConfig = Field(
        "auto",
        description="Long sequences on few GPUs: the tiled MLP, the tiled loss and checkpoints offloaded to host "
        "memory (each described under model.long_sequence.*). auto: each switch auto, i.e. off while the run fits "
        "the GPU without it (so short sequences run as fast as before) and on, in that order, as seq_length needs: "
        "the Llama-3-8B shape's LoRA on one 141 GB H200 takes the tiles from 262,144 tokens and offloads 23 of its "
        "32 layers' checkpoints (92 GiB) at 524,288. `finetune validate` prints each switch with its reason. On "
        "CPU workers auto turns them off.",
    )
    dropout: float | None = Field(
        None, ge=0, le=1, description="Override every dropout probability of the model config (null: keep)."
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off unless you trust it).")
    liger_kernels: bool | Literal["auto"] = Field(
        "auto",
        description="Patch supported models (Llama, Mistral, Qwen, Gemma, ...) with Liger's fused kernels: "
        "RMSNorm, SwiGLU, RoPE and a cross-entropy that never materialises the logits. auto: on GPUs when "
        "liger-kernel is installed (it is in the image); true: required; false: off.",
    )
    compile: bool = Field(
        False,
        description="torch.compile the model through DeepSpeed's engine.compile() (DeepCompile when the "
        "deepspeed block sets compile.deepcompile: true). Costs compile time at start.",
    )
    fp8: bool = Field(
        False,
        description="FP8 matmuls in the decoder layers' linear layers (torchao's float8 training: dynamic "
        "per-tensor scales; weights, gradients, optimizer and output head stay in bf16/fp32). Only layers whose "
        "shape gains from FP8 at micro_batch_size x seq_length tokens are converted (measured on H200: the "
        "MLP projections of a 1.1B Llama, those and q/o of an 8B, none of a Qwen2-0.5B); the log names them. "
        "Needs GPUs with FP8 tensor cores (compute capability 8.9+: L40S, H100, H200, B200); each cast is "
        "compiled: on H200 the 8B's first step took 16 s longer. 2 x H200, Llama-3-8B: 1.20x the bf16 step, "
        "losses equal to 0.1% (docs/benchmarks.md). On CPUs the FP8 matmuls are emulated, for tests.",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters (PEFT) instead of every weight: only the adapters are trainable and in the "
        "optimizer; checkpoints hold the adapters and their optimizer state; final/ holds the merged model and "
        "final/adapter/ the PEFT adapter. null: full fine-tuning.",
    )

    @model_validator(mode="after")
    def _offload_needs_checkpoints(self) -> ModelConfig:
        """Only checkpointed layer inputs can be offloaded: without checkpointing there are none."""
        long = self.long_sequence
        offload = long.offload_checkpoints if isinstance(long, LongSequenceConfig) else "auto"
        if offload not in ("auto", False, 0) and self.gradient_checkpointing is False:
            raise ValueError(
                f"long_sequence.offload_checkpoints: {offload} offloads checkpointed layer inputs, and "
                "gradient_checkpointing is false (set it true or auto, or offload_checkpoints false)"
            )
        return self


FORMATS = Literal["auto", "text", "chat", "prompt_completion", "preference"]
SOURCE_KEYS = ("dataset", "split", "config_name", "format", "text_field", "chat_template")


class SourceConfig(Section):
    """One source of a mixture (data.datasets); a key left out takes the data section's value."""

    dataset: UsablePath = Field(
        ..., description="As data.dataset: a hub dataset, local files or a save_to_disk folder."
    )
    split: str | None = Field(None, description="As data.split; null: data.split.")
    config_name: str | None = Field(None, description="As data.config_name; null: data.config_name.")
    format: FORMATS | None = Field(None, description="As data.format; null: data.format.")
    text_field: str | None = Field(None, description="As data.text_field; null: data.text_field.")
    chat_template: str | None = Field(None, description="As data.chat_template; null: data.chat_template.")
    weight: float = Field(
        1.0,
        gt=0,
        le=1e6,
        description="This source's share of the training rows, against the other sources' weights (LLaMA-Factory's "
        "interleave_probs): each source gives weight/sum(weights) of the rows, as many in all as the first source "
        "to run out allows; which rows, by train.seed.",
    )


class DataConfig(Section):
    # _one_eval_source, for helm: values.schema.json carries it to `helm install`.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"required": ["eval_split"], "properties": {"eval_split": {"type": "string", "minLength": 1}}},
            "then": {"properties": {"eval_fraction": {"maximum": 0}}},
        }
    )

    dataset: UsablePath = Field(
        "ag_news",
        description="Hub dataset name, a local file/folder/glob of json, jsonl, ndjson, csv, tsv, parquet or txt "
        "(.gz, .bz2, .xz compressed or not), or a save_to_disk folder. A folder's splits are its files' names as "
        "`datasets` reads them (train.jsonl, test.jsonl; data/train-00000-of-00001.parquet) or its dataset card's "
        "configs; a file or glob is split train.",
    )
    config_name: str | None = Field(
        None, description="A hub dataset's config, or one that a local folder's dataset card (README.md) lists."
    )
    split: str = Field("train[:1%]", description="Split with the `datasets` slicing syntax.")
    text_field: str = Field("text", description="Column holding the text to train on (format text).")
    format: FORMATS = Field(
        "auto",
        description="text: raw text, every token a target; chat: a 'messages' column of {role, content} lists "
        "(roles system, user, assistant, tool; an assistant turn may carry tool_calls, and an optional 'tools' "
        "column holds the function schemas; ShareGPT's 'conversations' of {from, value} turns are read as "
        "messages) rendered with the chat template; prompt_completion: 'prompt' and "
        "'completion' columns, both text or both lists of messages (rendered as one conversation, the "
        "completion's assistant turns the targets); preference: 'prompt', 'chosen' and 'rejected' columns, all "
        "text or all lists of messages (without 'prompt': chosen and rejected conversations sharing their prompt "
        "turns), for `preference` training, the answers the targets; auto: preference when 'chosen' and "
        "'rejected' columns exist, else chat when a 'messages' or 'conversations' column does, else "
        "prompt_completion when both 'prompt' and 'completion' do, else text (the choice is logged).",
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template, or the name of one shipped with the app (chatml, zephyr, qwen3) for base "
        "models whose tokenizer has none; null: the tokenizer's own.",
    )
    train_on_prompt: bool = Field(
        False,
        description="false: the loss covers only the assistant turns (or the completion), each ending with its "
        "end-of-turn or EOS token; true: every token of the conversation.",
    )
    eval_split: str | None = Field(None, description="Evaluation split (same syntax); excludes eval_fraction.")
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="Hold out this fraction of the train split for eval.")
    seq_length: int = Field(512, gt=0, le=MAX_SEQ_LENGTH, description="Tokens per sequence (block size when packing).")
    packing: bool = Field(
        True,
        description="Concatenate documents with EOS between them into full seq_length blocks (no padding). "
        "false: the tutorial's pad-to-seq_length, with padding excluded from the loss.",
    )
    separate_documents: bool = Field(
        True,
        description="With packing: each document gets its own position ids (from 0) and attends only to itself "
        "(variable-length FlashAttention on GPUs, a block-diagonal mask on CPUs), and no token is predicted "
        "from the previous document. false: documents in a block attend to the ones before them (slightly "
        "faster, but they leak into each other).",
    )
    shuffle: bool = Field(True, description="Shuffle each epoch (seeded by train.seed, resumable).")
    num_proc: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Most Ray Data actors (one CPU each) that prepare the data (finetune prepare, or train before its "
        "workers start); null: every CPU of the Ray cluster. Not part of the prepared data's key.",
    )
    loader_workers: int = Field(1, ge=0, le=64, description="DataLoader worker processes per training worker.")
    datasets: list[SourceConfig] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="A mixture: a list of sources, each {dataset, split, config_name, format, text_field, "
        "chat_template, weight}, prepared each with its own format and template and mixed by weight (see weight); "
        "null: the one source of data.dataset and the keys above. Each source's eval split (data.eval_split, or "
        "data.eval_fraction of its rows) joins the eval split whole.",
    )

    def sources(self) -> list[tuple[DataConfig, float]]:
        """Each source as a data section of its own (the keys it leaves out from this one) and its weight; the
        single source of data.dataset when data.datasets is null."""
        if not self.datasets:
            return [(self, 1.0)]
        out = []
        for source in self.datasets:
            own = {k: getattr(source, k) for k in SOURCE_KEYS if getattr(source, k) is not None}
            out.append((self.model_copy(update={**own, "datasets": None}), source.weight))
        return out

    @model_validator(mode="after")
    def _one_eval_source(self) -> DataConfig:
        if self.eval_split and self.eval_fraction:
            raise ValueError("set eval_split or eval_fraction, not both")
        return self


class TrainConfig(Section):
    epochs: int = Field(1, ge=1, le=MAX_STEPS, description="Passes over the training split.")
    max_steps_per_epoch: int | None = Field(
        30, ge=1, le=MAX_STEPS, description="Optimizer steps per epoch (the tutorial's 30); null: the whole epoch."
    )
    max_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="Total optimizer steps; null: all epochs.")
    micro_batch_size: Annotated[
        Annotated[int, Field(ge=1, le=MAX_BATCH)] | Literal["auto"],
        one_error(f"must be a whole number from 1 to {MAX_BATCH}, or auto", "write e.g. 4, or auto", exact_int=True),
    ] = Field(
        1,
        description="Sequences per worker per forward pass. auto: the largest power of two (up to 32,768 tokens a "
        "micro-batch) that fits the GPUs' memory, preferring activation checkpointing with a larger micro-batch "
        "to a micro-batch under 8,192 tokens without it; 1 on CPUs.",
    )
    gradient_accumulation_steps: int = Field(1, ge=1, le=MAX_BATCH, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(1e-6, gt=0, le=1, description="Peak learning rate (above 1 is never meant).")
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="constant (the tutorial's), or linear/cosine decay after warmup."
    )
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping; 0 turns it off.")
    nonfinite_steps_limit: int = Field(
        3,
        ge=1,
        le=1000,
        description="Stop the run (exit 1, keeping the last good checkpoint) after this many consecutive optimizer "
        "steps with a non-finite loss or gradient norm. fp16's loss scaler skips overflowed steps by itself: for "
        "fp16 only the loss counts.",
    )
    precision: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="Fills deepspeed bf16/fp16 'auto'.")
    pure_bf16: AutoSwitch = Field(
        "auto",
        description="Weights, gradients and AdamW states all in bf16, no fp32 master copy (needs precision bf16; "
        "under ZeRO 1-3 DeepSpeed's bf16_master_weights_and_grads and bf16_optimizer_states, at stage 0 DeepSpeed's "
        "mixed precision off and torch's AdamW stepping the bf16 model, the fastest on one GPU): 6 bytes less per "
        "trained parameter and less optimizer traffic, but an update smaller than bf16's resolution of its weight "
        "(about 1/256 of it) is lost, where the fp32 master copy keeps it. A numerics choice: compare losses. "
        "auto: true on GPUs with precision bf16 and a learning rate of at least 1e-5 (the fastest measured), else "
        "false unless only pure bf16 fits the GPUs' memory; false on CPUs; a resumed experiment keeps the choice "
        "its checkpoints were trained with.",
    )
    seed: int = Field(42, ge=0, le=2**31 - 1, description="Seeds model init, data order and dropout on every rank.")
    log_every_steps: int = Field(
        1, ge=1, le=MAX_STEPS, description="Progress line and TensorBoard scalars every N steps."
    )
    eval_every_steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="Evaluate every N steps (and at the end)."
    )
    eval_max_batches: int | None = Field(None, ge=1, le=MAX_STEPS, description="Cap on eval batches per evaluation.")
    stop_after_steps: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description="Stop the run (as a preemption would) after this global step, once its checkpoint is "
        "saved; the next deploy resumes. For drills and tests.",
    )


class CheckpointConfig(Section):
    every_steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="Save every N optimizer steps, in addition to each epoch's end."
    )
    keep: int = Field(3, ge=1, le=1000, description="Checkpoints kept (Ray's CheckpointConfig.num_to_keep).")
    export_final: bool = Field(True, description="Write <storage>/<experiment>/final/ as a Hugging Face folder.")
    async_save: bool = Field(
        True,
        description="Write periodic checkpoints in the background: training waits only while each rank's state is "
        "copied to host memory (one more copy of it there). false: training waits for the whole write.",
    )


class ScalingConfig(Section):
    num_workers: int = Field(2, ge=1, le=MAX_WORKERS, description="Ray Train workers (one per GPU when use_gpu).")
    use_gpu: bool = Field(True, description="One GPU per worker, NCCL; false: CPU workers, gloo, DS_ACCELERATOR=cpu.")
    sequence_parallel: int = Field(
        1,
        ge=1,
        le=MAX_WORKERS,
        description="Workers (GPUs) that share one sequence: DeepSpeed's Ulysses sequence parallelism splits each "
        "sequence into this many shards and exchanges attention heads between them, so a sequence too long for one "
        "GPU's activations trains across several. It must divide num_workers (the data-parallel degree is "
        "num_workers / sequence_parallel) and the model's attention heads. 1: off.",
    )
    cpus_per_worker: float = Field(1, gt=0, le=1024, description="CPUs Ray reserves for each worker.")
    gpu_memory: str | None = Field(
        None,
        json_schema_extra={"pattern": MEMORY_PATTERN},
        description="Memory of each worker's GPU as nvidia-smi counts it, e.g. 80GiB (H100), 140GiB (H200: "
        "143771MiB); G and GiB are binary, GB decimal. What the auto settings (ZeRO stage, pure bf16, "
        "checkpointing, micro-batch) are chosen for. null: the GPU visible to the driver when the run starts its "
        "own Ray cluster, else the memory of the joined cluster's GPU type (Ray's accelerator_type); a GPU run "
        "with auto settings and neither is refused. The chart sets it from workers.<group>.gpuMemory.",
    )
    host_memory: str | None = Field(
        None,
        json_schema_extra={"pattern": MEMORY_PATTERN},
        description="Host memory each GPU worker may fill, e.g. 120GiB: its node's memory (or its pod's memory "
        "limit) divided by the GPU workers there. What model.long_sequence may fill with offloaded checkpoints, "
        "after 16 GiB kept for the worker itself. null: where the run starts its own Ray cluster (and for `finetune "
        "validate`), this machine's memory (or its cgroup's limit) divided by scaling.num_workers; on a joined "
        "cluster, unknown, and offloading is then refused until it is set.",
    )
    max_failures: int = Field(
        0,
        ge=-1,
        le=1000,
        description="Restarts after a worker fails within one run (Ray's FailureConfig; -1: unlimited). A worker "
        "group that cannot be placed is not retried: see placement_timeout_s.",
    )
    placement_timeout_s: float = Field(
        600,
        gt=0,
        le=86_400,
        description="On a cluster the run joins (RAY_ADDRESS), how long to wait for room for every worker (nodes "
        "an autoscaler is still starting) before the run ends with what the cluster offers. A local cluster is "
        "checked against this machine before it starts.",
    )
    collective_timeout_s: int = Field(
        1800,
        ge=10,
        le=86_400,
        description="How long a collective (an all-reduce, a barrier, a parameter gather) waits for every worker "
        "before the run fails: torch's process-group timeout (NCCL's and gloo's default, 30 minutes). No worker "
        "waits in one for data: it is prepared before they start.",
    )

    @property
    def data_parallel(self) -> int:
        """Replicas of the model that each see their own batches: the workers divided among the sequences they share
        (at least 1; a sequence_parallel that does not divide num_workers is refused by app.sequence_parallel)."""
        return max(1, self.num_workers // self.sequence_parallel)

    @field_validator("gpu_memory", "host_memory")
    @classmethod
    def _memory_size(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_memory(v)
            except ValueError:
                raise ValueError("is not a memory size (a number and a unit, at least 1 MiB)") from None
        return v


MLFLOW_SCHEMES = ("http", "https", "file", "databricks")
# The validator's rule for helm (values.schema.json): empty, "databricks", or a scheme above whose host part
# holds no "user:password@".
MLFLOW_URI_PATTERN = r"^$|^databricks$|^(https?|file|databricks)://[^/@]*(/.*)?$|^file:/[^/].*$"


class MlflowConfig(Section):
    uri: str | None = Field(
        None,
        json_schema_extra={"pattern": MLFLOW_URI_PATTERN},
        description="MLflow tracking server, e.g. http://mlflow.mlops:5000: rank 0 logs params, metrics and "
        "checkpoints to one run per experiment (kept across resumes). null: the MLFLOW_TRACKING_URI environment "
        'variable where it is set, else off; "" turns it off. Credentials come from MLflow\'s own variables '
        "(MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD), never from here.",
    )
    experiment: str | None = Field(
        None, max_length=500, description="MLflow experiment to log into; default: experiment.name."
    )

    @field_validator("uri")
    @classmethod
    def _tracking_uri(cls, v: str | None) -> str | None:
        if not v or v == "databricks":  # MLflow's name for the Databricks workspace of the CLI profile
            return v
        parts = urllib.parse.urlsplit(v)
        if parts.scheme not in MLFLOW_SCHEMES:
            raise ValueError(f"must be a tracking server URI ({', '.join(s + ':' for s in MLFLOW_SCHEMES)})")
        if parts.username or parts.password:
            raise ValueError("must not carry credentials (anyone who may read the config would read them)")
        return v


class TrackingConfig(Section):
    mlflow: MlflowConfig = MlflowConfig()


class TrainingConfig(Section):
    """The whole training config file."""

    experiment: ExperimentConfig = ExperimentConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    preference: PreferenceConfig | None = Field(
        None,
        description="Preference tuning (DPO and its reference-free cousins) on pairs of a prompt, a chosen and a "
        "rejected answer (data.format preference): {loss, beta, label_smoothing, reference, ...}; null: supervised "
        "fine-tuning.",
    )
    checkpoint: CheckpointConfig = CheckpointConfig()
    scaling: ScalingConfig = ScalingConfig()
    tracking: TrackingConfig = TrackingConfig()
    deepspeed: DeepSpeedConfig = Field(
        default_factory=lambda: DeepSpeedConfig.model_validate(tutorial_ds_config()),
        description='A DeepSpeed config passed through as is; "auto" values are filled from the other sections.',
    )

    @property
    def experiment_dir(self) -> Path:
        assert self.experiment.name, "resolve() names the experiment"
        return Path(self.experiment.storage_path) / self.experiment.name

    @property
    def zero_stage(self) -> int:
        return self.deepspeed.zero_stage


# --- loading --------------------------------------------------------------------------------------------


def set_override(doc: dict[str, Any], assignment: str) -> None:
    """Apply one `--set a.b=c` override (value parsed as YAML, like helm's --set)."""
    if "=" not in assignment:
        raise ConfigError([Problem("--set", assignment, "expected KEY=VALUE", "write e.g. --set train.epochs=2")])
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError([Problem("--set", assignment, "empty key segment", "write dotted keys like a.b.c")])
    try:
        value = read_yaml(raw, f"--set {key}", key.strip()) if raw != "" else ""
    except ConfigError as exc:
        if "not valid YAML" not in exc.problems[0].message:
            raise
        value = raw  # like helm: what does not parse is a string
    node = doc
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def load_document(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    if path is not None:
        loaded = read_yaml(_read_text(Path(path)), str(path))
        if loaded is None:
            # A truncated ConfigMap or a wrong file, not a wish for the defaults (those need no file at all).
            raise ConfigError(
                [
                    Problem(
                        "CONFIG",
                        str(path),
                        "is empty (or only comments)",
                        "write the config's sections (see examples/), or leave out the file "
                        "argument to run the tutorial's defaults",
                    )
                ]
            )
        if not isinstance(loaded, dict):
            raise ConfigError([Problem("CONFIG", str(path), "must be a YAML mapping of sections", "see examples/")])
        doc = loaded
    for assignment in overrides:
        set_override(doc, assignment)
    return doc


# A training config is a few kilobytes and a few hundred YAML values; far beyond that is a mistake or an attack
# (a "billion laughs" of nested aliases expands to 10^10 values from a few lines).
MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_VALUES = 10_000


def _read_text(path: Path) -> str:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([Problem("CONFIG", str(path), f"cannot read: {exc.strerror}", "pass a YAML file")]) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            [
                Problem(
                    "CONFIG",
                    str(path),
                    f"is larger than {MAX_CONFIG_BYTES >> 20} MiB, which no training config is",
                    "pass the training config YAML, not a data or model file",
                )
            ]
        )
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        byte = f"0x{raw[exc.start]:02x}"
        raise ConfigError(
            [
                Problem(
                    "CONFIG",
                    str(path),
                    f"is not UTF-8 text (byte {byte} on line {line})",
                    "save it as UTF-8, e.g. iconv -f latin1 -t utf-8",
                )
            ]
        ) from None


def read_yaml(text: str, where: str, root: str = "") -> Any:
    """safe_load that refuses duplicate keys (YAML would keep the last one silently) and aliases that expand
    beyond MAX_YAML_VALUES values, both judged on the node graph before any value is built."""
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # its reader already refuses control characters
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, root, {}, set())
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        message = f"not valid YAML: {exc}".replace("\n", " ")
        raise ConfigError([Problem("CONFIG", where, message, "fix the syntax")]) from None
    except RecursionError:
        raise ConfigError([Problem("CONFIG", where, "is nested too deeply", "flatten the YAML")]) from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_nodes(node: yaml.Node, path: str, sizes: dict[int, int], open_: set[int]) -> int:
    """How many values `node` expands to (each shared alias target counted once per use, computed once)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_:
        line = f"line {node.start_mark.line + 1}"
        raise ConfigError(
            [
                Problem(
                    path or "CONFIG",
                    line,
                    "a YAML anchor contains itself",
                    "remove the self-referencing alias (&a ... *a)",
                )
            ]
        )
    open_.add(id(node))
    total = 1
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if (key.tag, key.value) in lines:
                    raise ConfigError(
                        [
                            Problem(
                                _join(path, key.value),
                                key.value,
                                f"is given twice (lines "
                                f"{lines[key.tag, key.value]} and {line}); YAML would silently keep "
                                "the last",
                                "remove one of them",
                            )
                        ]
                    )
                lines[key.tag, key.value] = line
            total += _check_nodes(key, path, sizes, open_)
            total += _check_nodes(value, _join(path, getattr(key, "value", "?")), sizes, open_)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            total += _check_nodes(item, _join(path, str(i)), sizes, open_)
    open_.discard(id(node))
    sizes[id(node)] = total
    if total > MAX_YAML_VALUES:
        raise ConfigError(
            [
                Problem(
                    path or "CONFIG",
                    f"more than {MAX_YAML_VALUES:,} values",
                    "YAML aliases (*name) expand to far more values than any config has (an alias bomb?)",
                    "write the values out, or use fewer nested aliases",
                )
            ]
        )
    return total


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def parse(doc: dict[str, Any]) -> TrainingConfig:
    """Validate a document's shape and types; every problem becomes a `Problem` naming the field."""
    doc = copy.deepcopy(doc)
    if isinstance(doc.get("deepspeed"), dict):
        # The user's deepspeed block is merged over the tutorial's, so setting one key keeps the rest.
        doc["deepspeed"] = deep_merge(tutorial_ds_config(), doc["deepspeed"])
    try:
        return TrainingConfig.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError([_problem_from_pydantic(err) for err in exc.errors()]) from None
    except (ValueError, RecursionError) as exc:  # e.g. a YAML anchor that contains itself
        raise ConfigError(
            [
                Problem(
                    "CONFIG",
                    type(exc).__name__,
                    f"cannot be validated: {exc}",
                    "remove self-referencing YAML anchors (&a ... *a)",
                )
            ]
        ) from None


def without_invalid(doc: dict[str, Any], error: ConfigError) -> TrainingConfig | None:
    """The config with every key that `error` names left at its default, or None when that does not validate
    either: what the checks that need a whole config (data, storage, model) still look at, so that one run of
    `validate` reports every problem at once rather than in stages."""
    doc = copy.deepcopy(doc)
    for problem in error.problems:
        *parents, leaf = problem.field.split(".")
        node = doc
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            return None  # a problem of the document's shape, or of a rule across keys: nothing to leave out
        del node[leaf]
    try:
        return parse(doc)
    except ConfigError:
        return None


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _problem_from_pydantic(err: dict[str, Any]) -> Problem:
    loc = [str(p) for p in err["loc"]]
    field = ".".join(loc) or "CONFIG"
    value = _without_password(err.get("input"))
    if err["type"] == RULE:  # a rule of app.ds_block: its own fix, maybe about a key below this location
        ctx = err["ctx"]
        if ctx["field"]:
            field, value = f"{field}.{ctx['field']}", ctx["value"]
        return Problem(field, value, err["msg"], ctx["fix"])
    if err["type"] == "extra_forbidden":
        known = _known_keys(loc[:-1])
        guess = difflib.get_close_matches(loc[-1], known, n=1)
        fix = f"did you mean '{guess[0]}'?" if guess else f"known keys here: {', '.join(sorted(known))}"
        return Problem(field, value, "unknown key", fix)
    msg = err["msg"].removeprefix("Value error, ")
    fix = {
        "literal_error": "use one of the listed values",
        "int_parsing": "use a whole number",
        "float_parsing": "use a number",
        "bool_parsing": "use true or false",
        "bool_type": "use true or false",  # e.g. null, or a list, where a switch goes
        "int_type": "use a whole number",
        SWITCH_FOR_NUMBER: "use a number",
        "float_type": "use a number",
        "string_type": "use text (quoted in YAML when it looks like a number or a date)",
        "list_type": "use a list, e.g. [a, b]",
        "tuple_type": "use a list, e.g. [a, b]",
        "model_type": "use a mapping of keys",
        "dict_type": "use a mapping of keys",
        "finite_number": "use a finite number (not .inf or .nan)",
        "less_than_equal": "use a value within that bound (see the field's description in docs/configuration.md)",
        "less_than": "use a value within that bound (see the field's description in docs/configuration.md)",
    }.get(err["type"], "see the field's description in docs/configuration.md")
    if loc and loc[-1] == "name":
        fix = "rename it, e.g. 'gpt2-agnews-1'"
    if loc == ["scaling", "gpu_memory"]:
        fix = "write each GPU's memory, e.g. 80GiB (H100) or 140GiB (H200), or null to take it from the cluster"
    if loc == ["tracking", "mlflow", "uri"]:
        fix = (
            "write the server's URL, e.g. http://mlflow.mlops:5000; credentials go in MLFLOW_TRACKING_TOKEN or "
            "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD (chart: tracking.mlflow.credentialsSecret)"
        )
    return Problem(field, value, msg, fix)


def _without_password(value: Any) -> Any:
    """A URL's password is never echoed in an error line (terminals and CI logs keep them)."""
    if isinstance(value, str) and "://" in value and "@" in value:
        parts = urllib.parse.urlsplit(value)
        if parts.password:
            return value.replace(f":{parts.password}@", ":***@", 1)
    return value


def _known_keys(loc: list[str]) -> list[str]:
    model: type[BaseModel] = TrainingConfig
    for part in loc:
        field = model.model_fields.get(part)
        found = _model_in(getattr(field, "annotation", None))
        if found is None:
            return []
        model = found
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model class of a field annotated `Model` or `Model | None`."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def resolve(cfg: TrainingConfig) -> TrainingConfig:
    """Fill what the config leaves open; the generated experiment name is the key to resume."""
    if cfg.experiment.name is None:
        cfg.experiment.name = f"{NAME_PREFIX}-{secrets.token_hex(4)}"
    mlflow = cfg.tracking.mlflow
    if mlflow.uri is None:
        mlflow.uri = os.environ.get("MLFLOW_TRACKING_URI") or ""  # "" (off) from here on: resolved once
    if mlflow.experiment is None:
        mlflow.experiment = cfg.experiment.name
    return cfg


# The settings app/autoset.py chooses when they are "auto", and the values they had before "auto" existed: what CPU
# workers take, and what a config that never went through app.autoset (a test's, a benchmark peer's) is built and
# trained with (`stand_ins`).
AUTO_FIELDS = ("deepspeed.zero_optimization.stage", "train.pure_bf16", "model.gradient_checkpointing")
AUTO_FIELDS += ("train.micro_batch_size",)
BEFORE_AUTO = dict(zip(AUTO_FIELDS, (3, False, False, 1)))


def value_at(cfg: TrainingConfig, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


def with_values(cfg: TrainingConfig, values: dict[str, Any]) -> TrainingConfig:
    """A copy of `cfg` with each dotted path set (each section validates its assignment)."""
    out = cfg.model_copy(deep=True)
    for path, new in values.items():
        *parents, leaf = path.split(".")
        setattr(value_at(out, ".".join(parents)) if parents else out, leaf, new)
    return out


def stand_ins(cfg: TrainingConfig) -> TrainingConfig:
    """`cfg`, or a copy with BEFORE_AUTO where a setting is still "auto"."""
    left = {path: BEFORE_AUTO[path] for path in AUTO_FIELDS if value_at(cfg, path) == "auto"}
    return with_values(cfg, left) if left else cfg


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainingConfig:
    return parse(load_document(path, overrides))


def to_yaml(cfg: TrainingConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
