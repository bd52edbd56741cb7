"""The settings a user leaves to the app (ZeRO stage, pure bf16, activation checkpointing, micro-batch), chosen from
the GPUs, the model's shape, the method and the sequence length, each with the reason a log line gives; and the
memory a GPU will need for them, predicted before any cluster starts, so that a choice that cannot fit is refused
with its figures instead of being found by an out-of-memory error (issue #50, item 1).

Pure: no torch, no Ray, no config models. The caller hands in a Hugging Face model config (or a dict of its fields),
the GPU count and memory, and a `Request` whose None / "auto" fields are the ones to choose; an explicit value is
never changed, only checked. `describe` gives the lines `finetune validate` prints.

The memory model counts what torch's caching allocator holds at the step's peak (`torch.cuda.max_memory_allocated`,
the figure the benchmark harness records), term by term: weights, gradients, optimizer states, saved activations,
the loss's logits, ZeRO's buffers and one layer's backward scratch, plus a fragmentation margin; what CUDA holds
outside torch's allocator (its context, NCCL's buffers) is added when deciding what fits. Bytes per parameter
follow DeepSpeed's and torch's layouts; bytes per token of each decoder layer follow what autograd saves for a
Llama-style layer (with and without Liger's kernels) and for GPT-2's. The terms were checked against every bf16 GPU
peak on record (tests/test_resolve.py: predicted at or above each measurement, at most 35% above it; the table and
the few cases left out are in docs/resolve-table.md); two of them come from those measurements rather than from
first principles, and say so.
Mixture-of-experts and recurrent (Mamba-style) layers are not modelled: such models are refused, and their
settings must be written out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from app.errors import Problem

GIB = 2**30
# Held by CUDA outside torch's allocator, so absent from max_memory_allocated but not free: the context (about
# 0.5 GiB on H100/H200), cuBLAS and NCCL buffers.
OUTSIDE_TORCH = int(1.5 * GIB)
# Fragmentation: torch's reserved memory runs a few percent above its allocated peak.
MARGIN_FRACTION = 0.06
MARGIN_BYTES = int(0.25 * GIB)
# app.model.LOSS_CHUNK_ELEMENTS: logits of one chunk of Liger's fused loss, at most twice that after rounding.
LOSS_CHUNK_ELEMENTS = 2**27
# micro_batch_size "auto": powers of two up to this many tokens a micro-batch (the 1.1B's fastest measured batch,
# 16 x 2048), and a candidate without checkpointing wins only when it reaches MIN_TOKENS (the 8B's 4 x 2048):
# below that the matmuls are too thin to pay for the recomputation they avoid.
MAX_TOKENS = 32_768
MIN_TOKENS = 8_192
MAX_MICRO_BATCH = 64
# Pure bf16 keeps 8 significant bits: a weight moves only when its update exceeds about 1/256 of it. AdamW's update
# is about the learning rate, so at rate lr only weights below about lr x 256 keep learning: 2.6e-3 at 1e-5 (a fair
# share of a trained model's weights, mostly around 1e-2 and below), 2.6e-4 at the tutorial's 1e-6 (almost none).
# Below this rate fp32 master weights are kept. A judgement from that arithmetic, not a measurement: compare losses.
PURE_MIN_LR = 1e-5
# model.long_sequence (app/long_sequence.py): the tiled MLP computes this many tokens of the intermediate at a time
# (8,192 x 14,336 x 2 bytes = 224 MiB a tile of the 8B's gate, up and product: matmuls wide enough to run at full
# speed); the tiled loss at most this many logits a tile (2,093 tokens of Llama 3's 128,256-token vocabulary).
MLP_TILE_TOKENS = 8_192
LOSS_TILE_ELEMENTS = 2**28
# Host memory a GPU worker holds besides offloaded checkpoints: torch, CUDA and Ray's libraries, the data loader,
# DeepSpeed's host buffers. A judgement (a worker of the 8B's LoRA run held about 9 GiB before any offload), kept
# wide because exceeding the node's memory kills the pod.
HOST_RESERVED = 16 * GIB

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
RECURRENT_LAYERS = frozenset({"linear_attention", "hybrid", "mamba"})
QK_NORM_TYPES = frozenset({"qwen3", "gemma3", "gemma3_text", "olmo2", "olmo3", "chameleon"})
QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_vl"})
# Two-matrix MLPs with a GELU, LayerNorms with biases and a fused qkv projection: GPT-2's layout. Other models are
# taken as Llama's (RMSNorm, separate q/k/v/o, a gated gate/up/down MLP): for a two-matrix MLP (GPT-NeoX, OPT, Phi)
# that counts a third matrix, erring towards fitting.
GPT2_TYPES = frozenset({"gpt2", "gpt_bigcode"})


@dataclass(frozen=True)
class Shape:
    """What memory depends on in a decoder-only model."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool = False
    qkv_bias: bool = False
    positions: int = 0  # learned position embeddings (GPT-2's wpe); 0 for rotary models

    @property
    def gpt2(self) -> bool:
        return self.model_type in GPT2_TYPES

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, list[tuple[int, int]]]:
        """Each decoder layer's linear layers by module name: (in, out) features of each module of that name."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        if self.gpt2:  # attn.c_proj and mlp.c_proj share a name, as PEFT's target_modules sees them
            return {"c_attn": [(h, 3 * h)], "c_proj": [(h, h), (i, h)], "c_fc": [(h, i)]}
        return {
            "q_proj": [(h, q)],
            "k_proj": [(h, kv)],
            "v_proj": [(h, kv)],
            "o_proj": [(q, h)],
            "gate_proj": [(h, i)],
            "up_proj": [(h, i)],
            "down_proj": [(i, h)],
        }

    def layer_params(self) -> int:
        matrices = sum(a * b for mods in self.linears().values() for a, b in mods)
        if self.gpt2:  # every linear has a bias; two LayerNorms of weight and bias
            return matrices + 3 * self.hidden + self.hidden + self.intermediate + self.hidden + 4 * self.hidden
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return matrices + bias + (2 * self.head_dim if self.qk_norm else 0) + 2 * self.hidden

    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2) + self.positions * self.hidden
        final_norm = (2 if self.gpt2 else 1) * self.hidden
        return embeddings + self.layers * self.layer_params() + final_norm


def shape_from_config(config: Any) -> Shape:
    """The Shape of a transformers config (PretrainedConfig or a dict of its fields; GPT-2's n_embd/n_layer/n_head
    names too). A dict without tie_word_embeddings counts an untied head: the larger, erring towards fitting."""
    d = dict(config) if isinstance(config, Mapping) else config.to_dict()
    if not _get(d, "hidden_size", "n_embd") and isinstance(d.get("text_config"), Mapping):
        d = {**d["text_config"], "model_type": d["text_config"].get("model_type", d.get("model_type", ""))}
    model_type = str(d.get("model_type", ""))
    _refuse_unmodelled(d, model_type)
    hidden, layers, heads = (
        _get(d, "hidden_size", "n_embd"),
        _get(d, "num_hidden_layers", "n_layer"),
        _get(d, "num_attention_heads", "n_head"),
    )
    if not (hidden and layers and heads and d.get("vocab_size")):
        raise Problem(
            "model",
            model_type or "?",
            "its config names no hidden_size, num_hidden_layers, num_attention_heads or vocab_size",
            "set the ZeRO stage, train.pure_bf16, model.gradient_checkpointing and train.micro_batch_size yourself",
        )
    return Shape(
        model_type=model_type,
        hidden=hidden,
        intermediate=_get(d, "intermediate_size", "n_inner") or 4 * hidden,
        layers=layers,
        heads=heads,
        kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads,
        vocab=d["vocab_size"],
        tied=bool(d.get("tie_word_embeddings", False)),
        qk_norm=model_type in QK_NORM_TYPES or bool(d.get("use_qk_norm") or d.get("qk_layernorm")),
        qkv_bias=model_type in QKV_BIAS_TYPES or bool(d.get("attention_bias")),
        positions=(_get(d, "n_positions", "max_position_embeddings") or 0) if model_type in GPT2_TYPES else 0,
    )


def _get(d: Mapping, *names: str) -> Any:
    return next((d[n] for n in names if d.get(n)), None)


def _refuse_unmodelled(d: Mapping, model_type: str) -> None:
    fix = "set deepspeed.zero_optimization.stage, train.pure_bf16, model.gradient_checkpointing and "
    fix += "train.micro_batch_size explicitly"
    if any((d.get(k) or 0) > 1 for k in MOE_KEYS):
        raise Problem("model", model_type, "a mixture-of-experts model: the memory model covers dense layers", fix)
    if RECURRENT_LAYERS & set(d.get("layer_types") or []):
        raise Problem("model", model_type, "has recurrent (Mamba-style) layers: the memory model covers attention", fix)


# --- what is asked, what is chosen --------------------------------------------------------------------------


@dataclass(frozen=True)
class Lora:
    r: int = 16
    target_modules: tuple[str, ...] | Literal["auto"] = "auto"
    dropout: float = 0.05


@dataclass(frozen=True)
class LongAsk:
    """model.long_sequence's switches: None where auto chooses; offload: None, True (every layer), False, or a
    number of layers."""

    tiled_mlp: bool | None = None
    tiled_loss: bool | None = None
    offload: bool | int | None = None

    @property
    def auto(self) -> bool:
        return None in (self.tiled_mlp, self.tiled_loss, self.offload)


@dataclass(frozen=True)
class Request:
    """The run's settings; None (micro_batch_size: "auto") where the resolver chooses."""

    seq_length: int
    micro_batch_size: int | Literal["auto"] = "auto"
    zero_stage: int | None = None
    pure_bf16: bool | None = None
    gradient_checkpointing: bool | None = None
    lora: Lora | None = None
    liger: bool = True  # Liger's kernels patch this model (RMSNorm, SwiGLU and the fused linear cross-entropy)
    attention: Literal["flash", "eager"] = "flash"  # eager keeps each layer's seq x seq attention weights
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    learning_rate: float | None = None
    gradient_accumulation_steps: int = 1
    offload_optimizer: bool = False
    offload_param: bool = False
    reduce_bucket_elements: int | None = None  # deepspeed.zero_optimization.reduce_bucket_size when a number
    # Off unless asked: a Request built by hand (tests, tools) predicts what it always did; request_from_config
    # passes model.long_sequence, whose default is auto.
    long: LongAsk = LongAsk(False, False, False)
    host_memory: int | None = None  # bytes of each GPU worker's host memory, for offloaded checkpoints
    sequence_parallel: int = 1  # scaling.sequence_parallel: each GPU holds that share of a sequence's tokens


@dataclass(frozen=True)
class Plan:
    """One concrete set of choices."""

    stage: int
    pure: bool
    checkpointing: bool
    micro_batch: int
    tiled_mlp: bool = False
    tiled_loss: bool = False
    offload_layers: int = 0  # decoder layers whose checkpointed input is kept in pinned host memory


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU at the step's peak. The transient gradients (held whole only during backward at stages 0-1)
    and the activations plus logits are never held together: the peak counts the larger."""

    weights: int
    gradients: int  # partitions that persist through the step
    transient_gradients: int
    optimizer: int
    activations: int
    logits: int
    workspace: int  # ZeRO's gathered layers and buckets, one layer's backward scratch
    offloaded: int = 0  # checkpointed activations moved to pinned host memory (not in the GPU's figures)
    # Long sequences allocate and free blocks of one layer's checkpointed input (4 GiB each for the 8B at 512k)
    # again and again: torch's reserved memory then runs that much above its allocated peak, twice over (the 512k
    # run that predicted 137.1 GiB allocated of the H200's 140.4 reached 132.6 and failed at a 4 GiB block with
    # 6.0 GiB reserved but free: benchmarks/results/2026-12-05-long-512k-oom.jsonl).
    blocks: int = 0

    @property
    def subtotal(self) -> int:
        core = max(self.transient_gradients, self.activations + self.logits)
        return self.weights + self.gradients + self.optimizer + core + self.workspace

    @property
    def margin(self) -> int:
        return int(MARGIN_FRACTION * self.subtotal) + MARGIN_BYTES + 2 * self.blocks

    @property
    def peak(self) -> int:
        """The predicted max_memory_allocated."""
        return self.subtotal + self.margin

    @property
    def needed(self) -> int:
        return self.peak + OUTSIDE_TORCH


@dataclass(frozen=True)
class Choice:
    value: Any
    reason: str
    explicit: bool = False


@dataclass(frozen=True)
class Resolved:
    zero_stage: Choice
    pure_bf16: Choice
    gradient_checkpointing: Choice
    micro_batch_size: Choice
    memory: Memory
    gpus: int
    gpu_memory: int
    precision: str = "bf16"
    problems: list[Problem] = field(default_factory=list)
    long_sequence: Choice = Choice({"tiled_mlp": False, "tiled_loss": False, "offload_checkpoints": 0}, "")
    long_reasons: dict[str, str] = field(default_factory=dict)  # model.long_sequence's switches: why each is so
    host_memory: int | None = None

    @property
    def fits(self) -> bool:
        return self.memory.needed <= self.gpu_memory and self.host_fits

    @property
    def host_needed(self) -> int:
        return self.memory.offloaded + HOST_RESERVED if self.memory.offloaded else 0

    @property
    def host_fits(self) -> bool:
        return not self.memory.offloaded or (self.host_memory is not None and self.host_needed <= self.host_memory)

    @property
    def plan(self) -> Plan:
        long = self.long_sequence.value
        return Plan(
            self.zero_stage.value,
            self.pure_bf16.value,
            self.gradient_checkpointing.value,
            self.micro_batch_size.value,
            long["tiled_mlp"],
            long["tiled_loss"],
            long["offload_checkpoints"],
        )


# --- the memory model -----------------------------------------------------------------------------------------


def adapters(shape: Shape, lora: Lora) -> list[tuple[int, int]]:
    """(in, out) features of each adapted module of one decoder layer: LoRA's target_modules ("auto": every
    attention and MLP projection, as app.lora picks them for these layouts). Names this layout does not know (another
    family's, such as GPT-NeoX's query_key_value) count every linear layer of the layer, an upper bound: app.lora
    checks the names against the real model."""
    found = shape.linears()
    names = list(lora.target_modules) if lora.target_modules != "auto" else list(found)
    if any(name not in found for name in names):
        names = list(found)
    return [pair for name in names for pair in found[name]]


def predict(shape: Shape, gpus: int, request: Request, plan: Plan) -> Memory:
    """The memory one GPU of `gpus` needs to train `shape` with `plan`."""
    lora = adapters(shape, request.lora) if request.lora else []
    trained = shape.layers * sum(request.lora.r * (a + b) for a, b in lora) if request.lora else shape.params()
    frozen = shape.params() if request.lora else 0
    weights, grads, transient, optimizer = _states(trained, frozen, gpus, request, plan)
    tokens = gpu_tokens(request, plan)
    return Memory(
        weights=weights,
        gradients=grads,
        transient_gradients=transient,
        optimizer=optimizer,
        activations=_activations(shape, request, plan, lora, tokens),
        logits=_loss(shape, request, plan, tokens),
        workspace=_workspace(shape, gpus, request, plan, tokens, trained),
        offloaded=plan.offload_layers * host_block(tokens * checkpoint_bytes(shape)),
        blocks=tokens * checkpoint_bytes(shape) if plan.tiled_mlp or plan.tiled_loss or plan.offload_layers else 0,
    )


def gpu_tokens(request: Request, plan: Plan) -> int:
    """The tokens of a micro-batch one GPU holds: under sequence parallelism, its shard of each sequence only."""
    return plan.micro_batch * request.seq_length // request.sequence_parallel


def checkpoint_bytes(shape: Shape) -> int:
    """Bytes per token of one decoder layer's checkpointed input (its bf16 hidden states)."""
    return 2 * shape.hidden


def host_block(size: int) -> int:
    """The pinned host bytes a buffer of `size` bytes takes: torch's caching host allocator rounds each block up to a
    power of two (app/long_sequence.py keeps one block a layer, reused every step)."""
    return 1 << max(0, size - 1).bit_length() if size else 0


def _states(trained: int, frozen: int, gpus: int, request: Request, plan: Plan) -> tuple[int, int, int, int]:
    """(weights, persistent gradients, transient gradients, optimizer states) in bytes per GPU.

    Per trained parameter: bf16 weights (2 bytes) and, with mixed precision, an fp32 master copy and AdamW's two fp32
    moments (12) and an fp32 gradient partition (4); pure bf16 keeps bf16 moments and, under ZeRO 1-3, DeepSpeed's
    bf16 master partition (6 at stages 1-3, 4 at stage 0 where the bf16 model itself is stepped). The measured
    difference between the two at ZeRO-2 is 6 bytes a parameter (Llama 1.1B: 36.71 against 30.57 GiB). Stages 1-3
    divide the optimizer states and gradient partitions by the GPU count, stage 3 the weights too; whole bf16
    gradients exist only from backward to the step at stages 0-1 (torch's zero_grad frees them), unless gradients
    accumulate over micro-batches. A frozen (LoRA) base costs its weights only."""
    stage, n = plan.stage, gpus
    shard = n if stage >= 1 else 1
    wide = request.precision == "fp32"
    weight_bytes = 4 if wide else 2
    if wide:
        optimizer, partition = 8.0, 4.0 if stage >= 1 else 0.0
    elif plan.pure:
        optimizer, partition = (4.0, 0.0) if stage == 0 else (6.0, 4.0)
    else:
        optimizer, partition = 12.0, 4.0
    if request.offload_optimizer:  # master weights, moments and gradient partitions live in CPU memory
        optimizer, partition = 0.0, 0.0
    whole = weight_bytes if stage <= 1 else 0
    weights = 0 if request.offload_param else (trained + frozen) * weight_bytes / (n if stage == 3 else 1)
    transient = trained * whole
    persistent = trained * partition / shard
    if request.gradient_accumulation_steps > 1:  # the whole gradients live through the next micro-batches
        persistent, transient = persistent + transient, 0
    return int(weights), int(persistent), int(transient), int(trained * optimizer / shard)


def _activations(shape: Shape, request: Request, plan: Plan, lora: list[tuple[int, int]], tokens: int) -> int:
    """What autograd keeps from the forward for the backward. With checkpointing each layer keeps its input only
    and one layer at a time is recomputed, whole."""
    layer = _layer_bytes(shape, request, plan, lora)
    if request.attention == "eager":  # the softmax's float32 output and its bf16 copy, heads x seq x seq a layer
        layer += 6 * shape.heads * request.seq_length
    tile = 0
    if plan.tiled_mlp:  # the MLP keeps its input only; one tile of its intermediates lives at a time
        mlp = _mlp_bytes(shape, request, plan, lora)
        layer += 2 * shape.hidden - mlp
        tile = min(tokens, MLP_TILE_TOKENS) * mlp
    if plan.checkpointing:  # offloaded layers' inputs live in host memory
        return tokens * ((shape.layers - plan.offload_layers) * checkpoint_bytes(shape) + layer) + tile
    return tokens * shape.layers * layer + tile


def _mlp_bytes(shape: Shape, request: Request, plan: Plan, lora: list[tuple[int, int]]) -> int:
    """The part of _layer_bytes that the MLP saves, per token: gate and up (and silu's output without Liger), the
    down projection's input where linear inputs are kept, and the MLP adapters' inputs."""
    h, i = shape.hidden, shape.intermediate
    keeps_inputs = request.lora is None or plan.stage == 3
    out = (4 if request.liger else 6) * i + (2 * h + 2 * i if keeps_inputs else 0)
    if request.lora:
        wide = plan.stage == 3
        kept = (5 if wide else 3) if request.lora.dropout > 0 else (4 if wide else 2)
        names = request.lora.target_modules
        mlp = (
            [(h, i), (h, i), (i, h)]
            if names == "auto"
            else [p for n in ("gate_proj", "up_proj", "down_proj") if n in names for p in shape.linears()[n]]
        )
        out += sum(kept * fan_in + (4 if wide else 2) * request.lora.r for fan_in, _ in mlp)
    return out


def _layer_bytes(shape: Shape, request: Request, plan: Plan, lora: list[tuple[int, int]]) -> int:
    """Bytes one decoder layer saves for backward, per token, bf16.

    Llama's layout: each RMSNorm keeps its input (Liger's in bf16, transformers' a float32 copy); FlashAttention
    keeps q, k, v and its output; the gated MLP keeps gate and up (and silu's output without Liger). A linear layer
    keeps its input only to compute its weight's gradient: under full fine-tuning, or under ZeRO-3, whose linear
    function keeps it whatever needs a gradient. GPT-2's layout: two LayerNorms' inputs, q/k/v and the attention's
    output, the dropout masks, and its tanh GELU's four intermediates (transformers' NewGELUActivation).
    A LoRA adapter keeps its dropped-out input and the mask (float32 under ZeRO-3, where DeepSpeed leaves the adapters
    added after zero.Init in float32: measured, Llama 1.1B 53.57 against 34.28 GiB at stage 2) and its rank-r middle."""
    h, i, q, kv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    keeps_inputs = request.lora is None or plan.stage == 3
    norm = 2 if request.liger and not shape.gpt2 else 4
    if shape.gpt2:
        out = 4 * h + 2 * (q + 2 * kv) + 2 * q + 2 * h + 8 * i + (4 * h + 2 * i if keeps_inputs else 0)
    else:
        out = 2 * norm * h + 2 * (q + 2 * kv) + 2 * q + (4 if request.liger else 6) * i
        out += norm * (q + kv) if shape.qk_norm else 0
        out += 4 * h + 2 * i if keeps_inputs else 0
    wide = plan.stage == 3
    for fan_in, _ in lora:
        kept = (5 if wide else 3) if request.lora.dropout > 0 else (4 if wide else 2)
        out += kept * fan_in + (4 if wide else 2) * request.lora.r
    return out


def _loss(shape: Shape, request: Request, plan: Plan, tokens: int) -> int:
    """The loss's memory. Liger's fused linear cross-entropy never holds the logits: chunks of up to twice
    LOSS_CHUNK_ELEMENTS (or tokens x hidden, Liger's own bound) bf16 logits and their float32 gradient, plus the
    gradient of the hidden states and, when the head trains, the head's gradient, both computed in the forward.
    Without it transformers' loss holds the bf16 logits, a float32 copy, the float32 log-softmax and its gradient
    (14 bytes a logit: Llama 1.1B on 2 GPUs without Liger, 43.63 GiB measured)."""
    if plan.tiled_loss:  # app/long_sequence.py: a tile's bf16 logits, their float32 softmax and gradient
        head_grad = 4 * shape.vocab * shape.hidden if request.lora is None else 0
        return 10 * min(tokens * shape.vocab, LOSS_TILE_ELEMENTS) + 2 * tokens * shape.hidden + head_grad
    if not (request.liger and not shape.gpt2):
        return 14 * tokens * shape.vocab
    chunk = min(tokens * shape.vocab, 2 * max(LOSS_CHUNK_ELEMENTS, tokens * shape.hidden))
    head_grad = 2 * shape.vocab * shape.hidden if request.lora is None else 0
    return 6 * chunk + 2 * tokens * shape.hidden + head_grad


def _workspace(shape: Shape, gpus: int, request: Request, plan: Plan, tokens: int, trained: int) -> int:
    """One layer's backward scratch (the gradients of its widest intermediates) and ZeRO's buffers. ZeRO-3 holds
    the layer being computed, the prefetched ones (app.ds_config: about 2.25 layers) and the largest parameter
    outside the layers (the embedding or head, gathered whole), in bf16, and a gradient bucket of twice the
    prefetch; stages 1-2 a bucket of hidden^2 elements; stage 0 on several GPUs DeepSpeed's all-reduce buffer
    (up to 5e8 elements)."""
    wide = min(tokens, MLP_TILE_TOKENS) if plan.tiled_mlp else tokens  # the tiled MLP's gradients are a tile's
    scratch = wide * 4 * shape.intermediate + tokens * 4 * shape.hidden
    h, layer = shape.hidden, shape.layer_params()
    ahead = max(0.9 * h * h, 2.25 * layer) if plan.stage == 3 else 0
    reduce = request.reduce_bucket_elements or max(h * h, 2 * ahead)
    if plan.stage == 3:
        gathered = 2 * (ahead + layer + shape.vocab * h)
        return int(scratch + gathered + 2 * min(reduce, max(trained, h * h)))
    if plan.stage in (1, 2):  # the bucket and its contiguous gradient buffer
        return int(scratch + 2 * 2 * min(reduce, trained))
    return int(scratch + (2 * min(trained, 500_000_000) if gpus > 1 else 0))


# --- the choice ---------------------------------------------------------------------------------------------


def resolve(model: Any, gpus: int, gpu_memory: int, request: Request) -> Resolved:
    """The fastest settings that fit `gpus` GPUs of `gpu_memory` bytes each, the user's explicit values kept, and
    the memory they need. When nothing fits: the most frugal settings, and a Problem with the figures and the fix.
    `model`: a transformers config, a dict of its fields, or a Shape."""
    shape = model if isinstance(model, Shape) else shape_from_config(model)
    if gpus < 1 or gpu_memory <= 0:
        raise Problem("gpus", (gpus, gpu_memory), "needs at least one GPU with memory", "pass --gpus N --gpu-memory M")
    plan, fits = _search(shape, gpus, gpu_memory, request)
    memory = predict(shape, gpus, request, plan)
    args = (shape, gpus, gpu_memory, request, plan)
    resolved = Resolved(
        zero_stage=Choice(plan.stage, _stage_reason(*args), request.zero_stage is not None),
        pure_bf16=Choice(plan.pure, _precision_reason(*args), request.pure_bf16 is not None),
        gradient_checkpointing=Choice(
            plan.checkpointing, _checkpointing_reason(*args), request.gradient_checkpointing is not None
        ),
        micro_batch_size=Choice(plan.micro_batch, _micro_batch_reason(*args), request.micro_batch_size != "auto"),
        memory=memory,
        gpus=gpus,
        gpu_memory=gpu_memory,
        precision=request.precision,
        long_sequence=Choice(
            {"tiled_mlp": plan.tiled_mlp, "tiled_loss": plan.tiled_loss, "offload_checkpoints": plan.offload_layers},
            "",
            not request.long.auto,
        ),
        long_reasons=_long_reasons(*args),
        host_memory=request.host_memory,
    )
    if not fits and memory.needed > gpu_memory:
        resolved.problems.append(_does_not_fit(shape, gpus, gpu_memory, request, resolved))
    elif not fits:
        resolved.problems.append(_host_does_not_fit(shape, request, resolved))
    return resolved


def _search(shape: Shape, gpus: int, gpu_memory: int, request: Request) -> tuple[Plan, bool]:
    """The fastest plan that fits (see _search_at), trying model.long_sequence's levels in turn: its switches off
    where auto (they cost time: the tiled MLP runs its forward once more, offloaded checkpoints cross PCIe), then the
    tiled MLP and loss on, then as few layers' checkpoints offloaded as make the GPU's figure fit. The last level's
    most frugal plan when none fits."""
    found: tuple[Plan, bool] | None = None
    levels = _levels(request.long)
    # Auto's switches are for sequences too long for the GPU, one at a time: a micro-batch of several that does not
    # fit takes a smaller one (or is refused when set), not tiles.
    several = request.micro_batch_size != "auto" and request.micro_batch_size > 1
    for n, level in enumerate(levels[:1] if several else levels):
        found = _search_at(shape, gpus, gpu_memory, request, level, one=n > 0)
        if found[1]:
            return found
    return found


# A Plan's offload_layers while still to be sized (_sized): the fewest that fit (auto), or every layer (true).
SIZE_OFFLOAD, ALL_LAYERS = -1, -2


def _levels(ask: LongAsk) -> list[tuple[bool, bool, int]]:
    """(tiled MLP, tiled loss, offloaded layers) to try, cheapest first; explicit switches are kept throughout."""
    offload = ALL_LAYERS if ask.offload is True else int(ask.offload or 0)
    first = (bool(ask.tiled_mlp), bool(ask.tiled_loss), offload)
    tiled = (ask.tiled_mlp is not False, ask.tiled_loss is not False, offload)
    levels = [first] + ([tiled] if tiled != first else [])
    if ask.offload is None:
        levels.append((tiled[0], tiled[1], SIZE_OFFLOAD))
    return levels


def _search_at(
    shape: Shape, gpus: int, gpu_memory: int, request: Request, level: tuple[bool, bool, int], one: bool = False
) -> tuple[Plan, bool]:
    """The first option, fastest first, that fits with a micro-batch of at least MIN_TOKENS (or the asked one);
    else the fitting option with the largest micro-batch; else the most frugal option (not fitting). `one`: a
    micro-batch of one sequence only."""
    options = _options(gpus, request)
    cap, floor = (1, 1) if one else micro_batch_bounds(request.seq_length)
    best = None
    for stage, pure, checkpointing in options:
        plan = _largest_fit(shape, gpus, gpu_memory, request, Plan(stage, pure, checkpointing, cap, *level))
        if plan is None:
            continue
        if request.micro_batch_size != "auto" or plan.micro_batch >= floor:
            return plan, True
        best = plan if best is None or plan.micro_batch > best.micro_batch else best
    if best is not None:
        return best, True
    stage, pure, checkpointing = options[-1]
    smallest = 1 if request.micro_batch_size == "auto" else request.micro_batch_size
    frugal = Plan(stage, pure, checkpointing, smallest, *level)
    return _sized(shape, gpus, gpu_memory, request, frugal), False


def _largest_fit(shape: Shape, gpus: int, gpu_memory: int, request: Request, plan: Plan) -> Plan | None:
    """`plan` at the asked micro-batch if it fits; for "auto", at the largest power of two up to its
    micro_batch that fits; None if none does."""
    sizes = [request.micro_batch_size] if request.micro_batch_size != "auto" else []
    sizes = sizes or [1 << k for k in range(plan.micro_batch.bit_length() - 1, -1, -1)]
    for size in sizes:
        candidate = _sized(shape, gpus, gpu_memory, request, replace(plan, micro_batch=size))
        if _fits(shape, gpus, gpu_memory, request, candidate):
            return candidate
    return None


def _sized(shape: Shape, gpus: int, gpu_memory: int, request: Request, plan: Plan) -> Plan:
    """`plan` with SIZE_OFFLOAD replaced: the fewest layers whose offloaded checkpoints make the GPU's figure fit
    (the others stay on the GPU, where they cost no transfer), every layer when none does; none without
    checkpointing (there is no checkpoint to offload)."""
    if not plan.checkpointing:
        return replace(plan, offload_layers=0) if plan.offload_layers else plan
    if plan.offload_layers == ALL_LAYERS or plan.offload_layers > shape.layers:
        return replace(plan, offload_layers=shape.layers)
    if plan.offload_layers != SIZE_OFFLOAD:
        return plan
    for layers in range(shape.layers + 1):
        candidate = replace(plan, offload_layers=layers)
        if predict(shape, gpus, request, candidate).needed <= gpu_memory:
            return candidate
    return replace(plan, offload_layers=shape.layers)


def _fits(shape: Shape, gpus: int, gpu_memory: int, request: Request, plan: Plan) -> bool:
    memory = predict(shape, gpus, request, plan)
    if memory.needed > gpu_memory:
        return False
    return not memory.offloaded or (
        request.host_memory is not None and memory.offloaded + HOST_RESERVED <= request.host_memory
    )


def micro_batch_bounds(seq_length: int) -> tuple[int, int]:
    """(cap, floor) of an "auto" micro-batch: powers of two of at most MAX_TOKENS tokens (one sequence at least),
    and the size below which checkpointing with a larger micro-batch is preferred."""
    cap = 1 << (max(1, min(MAX_MICRO_BATCH, MAX_TOKENS // seq_length)).bit_length() - 1)
    return cap, max(1, min(cap, MIN_TOKENS // seq_length))


def _options(gpus: int, request: Request) -> list[tuple[int, bool, bool]]:
    """(stage, pure bf16, checkpointing) in the order tried, fastest first, the explicit values fixed. Full
    fine-tuning takes ZeRO-3 before recomputation (Llama 1.1B on 2 x H200: stage 3 5% slower than stage 2,
    recomputation costs about a third more compute); LoRA the other way round (stage 3 ran the 1.1B's LoRA step
    2.1x slower than stage 0, and holds more activations)."""
    if request.zero_stage is not None:
        stages = [request.zero_stage]
    elif request.offload_param:
        stages = [3]
    elif request.offload_optimizer:
        stages = [2] if gpus == 1 else [2, 3]
    else:  # on one GPU stages 1-3 partition nothing: they only add buffers
        stages = [0] if gpus == 1 else [0, 3] if request.lora else [2, 3]
    ckpts = [request.gradient_checkpointing] if request.gradient_checkpointing is not None else [False, True]
    if request.long.offload not in (None, False, 0):  # offloading checkpoints, as asked, needs them
        ckpts = [True]
    if request.lora:
        order = [(stage, ckpt) for stage in stages for ckpt in ckpts]
    else:
        order = [(stage, ckpt) for ckpt in ckpts for stage in stages]
    return [(stage, pure, ckpt) for pure in _precisions(request) for stage, ckpt in order]


def _precisions(request: Request) -> list[bool]:
    """Pure bf16 first where it is allowed and the learning rate keeps its updates; mixed precision first below
    PURE_MIN_LR, pure bf16 then only as the way to fit."""
    if request.pure_bf16 is not None:
        return [request.pure_bf16]
    if request.precision != "bf16":
        return [False]
    if request.learning_rate is not None and request.learning_rate < PURE_MIN_LR:
        return [False, True]
    return [True]


# --- the reasons --------------------------------------------------------------------------------------------

NUMERICS = (
    "bf16 master weights: weights, gradients and AdamW states in bf16 with no fp32 copy, so an update smaller than "
    "about 1/256 of its weight is lost (the numerics change; train.pure_bf16: false keeps fp32 master weights)"
)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _stage_reason(shape: Shape, gpus: int, gpu_memory: int, request: Request, plan: Plan) -> str:
    if request.zero_stage is not None:
        return "set in the config"
    if request.offload_param:
        return "parameter offload needs stage 3"
    if request.offload_optimizer and plan.stage == 2:
        return "optimizer offload needs stage 1-3, and stage 2 keeps the weights whole"
    if gpus == 1:
        return (
            "one GPU: ZeRO has nothing to partition, and stage 0 runs without its wrapper, the fastest measured on "
            "one H200 (Llama 1.1B chat SFT: 0.222 s a step, median, against 0.271 s at stage 2)"
        )
    if request.lora and plan.stage == 0:
        return (
            f"LoRA: the frozen base stays whole on each of the {gpus} GPUs and only the adapters' gradients are "
            "averaged (Llama 1.1B chat LoRA, one H200: 0.245 s a step at stage 0, 0.519 s at stage 3)"
        )
    if request.lora:
        whole = predict(shape, gpus, request, replace(plan, stage=0, checkpointing=True, micro_batch=1))
        return (
            f"the frozen base does not fit whole on one GPU (stage 0 needs {_gib(whole.needed)} of "
            f"{_gib(gpu_memory)} even with checkpointing and one sequence): stage 3 partitions it over {gpus} GPUs"
        )
    if plan.stage == 2:
        return (
            f"{gpus} GPUs: stage 2 partitions gradients and optimizer states and keeps the weights whole (5% "
            "faster than stage 3: Llama 1.1B, 16 x 2048, 2 x H200)"
        )
    lower = predict(shape, gpus, request, replace(plan, stage=2))
    return (
        f"stage 2 would need {_gib(lower.needed)} of {_gib(gpu_memory)} at micro-batch {plan.micro_batch}: "
        f"stage 3 partitions the weights too, over {gpus} GPUs"
    )


def _precision_reason(shape: Shape, gpus: int, gpu_memory: int, request: Request, plan: Plan) -> str:
    if request.pure_bf16 is not None:
        return "set in the config" + (f"; {NUMERICS}" if plan.pure else "")
    if request.precision != "bf16":
        return f"train.precision is {request.precision}: pure bf16 needs bf16"
    low = request.learning_rate is not None and request.learning_rate < PURE_MIN_LR
    if not plan.pure:
        return (
            f"mixed precision (fp32 master weights): at learning rate {request.learning_rate:g}, below "
            f"{PURE_MIN_LR:g}, pure bf16 would round most updates away"
        )
    if low:
        mixed = predict(shape, gpus, request, replace(plan, pure=False))
        return (
            f"pure bf16 although the learning rate {request.learning_rate:g} is below {PURE_MIN_LR:g}: mixed "
            f"precision does not fit ({_gib(mixed.needed)} of {_gib(gpu_memory)}); {NUMERICS}"
        )
    return (
        "pure bf16: the fastest measured (Llama 1.1B chat SFT at ZeRO-2, one H200: 0.308 s a step against 0.360 s "
        f"with fp32 master weights) and 6 bytes less per trained parameter; {NUMERICS}"
    )


def _checkpointing_reason(shape: Shape, gpus: int, gpu_memory: int, request: Request, plan: Plan) -> str:
    if request.gradient_checkpointing is not None:
        return "set in the config"
    memory = predict(shape, gpus, request, plan)
    if not plan.checkpointing:
        return f"the activations fit without recomputation ({_gib(memory.activations)} of the {_gib(memory.peak)} peak)"
    without = predict(shape, gpus, request, replace(plan, checkpointing=False))
    reason = (
        f"without it micro-batch {plan.micro_batch} needs {_gib(without.needed)} of {_gib(gpu_memory)} "
        f"(activations {_gib(without.activations)}); with it each layer keeps its input only "
        f"({_gib(memory.activations)}) and is recomputed in backward, about a third more compute"
    )
    if request.micro_batch_size == "auto":
        cap, _ = micro_batch_bounds(request.seq_length)
        smaller = _largest_fit(shape, gpus, gpu_memory, request, replace(plan, checkpointing=False, micro_batch=cap))
        if smaller is not None:
            reason += f"; without it only {smaller.micro_batch} x {request.seq_length} tokens fit, below {MIN_TOKENS}"
    return reason


def _micro_batch_reason(shape: Shape, gpus: int, gpu_memory: int, request: Request, plan: Plan) -> str:
    if request.micro_batch_size != "auto":
        return "set in the config"
    cap, _ = micro_batch_bounds(request.seq_length)
    tokens = f"{plan.micro_batch} x {request.seq_length} = {plan.micro_batch * request.seq_length} tokens"
    if plan.micro_batch >= cap:
        return f"{tokens}, the most auto takes (up to {MAX_TOKENS} tokens, {MAX_MICRO_BATCH} sequences)"
    bigger = predict(shape, gpus, request, replace(plan, micro_batch=2 * plan.micro_batch))
    return (
        f"{tokens}, the largest power of two that fits: {2 * plan.micro_batch} would need {_gib(bigger.needed)} "
        f"of {_gib(gpu_memory)}"
    )


def _long_reasons(shape: Shape, gpus: int, gpu_memory: int, request: Request, plan: Plan) -> dict[str, str]:
    """Why each of model.long_sequence's switches is on or off: the figures with and without it."""
    ask, tokens = request.long, gpu_tokens(request, plan)
    memory = predict(shape, gpus, request, plan)
    fits = f"the run fits without it ({_gib(memory.needed)} of {_gib(gpu_memory)} a GPU)"
    out = {}
    for switch, name, asked in (
        ("tiled_mlp", "tiled MLP", ask.tiled_mlp),
        ("tiled_loss", "tiled loss", ask.tiled_loss),
    ):
        if asked is not None:
            out[switch] = "set in the config"
        elif not getattr(plan, switch):
            out[switch] = f"{fits}: tiling would only add work"
        else:
            without = predict(shape, gpus, request, replace(plan, **{switch: False}))
            what = "activations and scratch take" if switch == "tiled_mlp" else "loss takes"
            was, now = (
                (without.activations + without.workspace, memory.activations + memory.workspace)
                if switch == "tiled_mlp"
                else (without.logits, memory.logits)
            )
            out[switch] = (
                f"at {tokens} tokens the {what} {_gib(was)} untiled, {_gib(now)} in tiles; without it the run "
                f"needs {_gib(without.needed)} of {_gib(gpu_memory)} a GPU"
            )
    out["offload_checkpoints"] = _offload_reason(shape, gpus, gpu_memory, request, plan, memory)
    return out


def _offload_reason(shape: Shape, gpus: int, gpu_memory: int, request: Request, plan: Plan, memory: Memory) -> str:
    tokens = gpu_tokens(request, plan)
    layer = tokens * checkpoint_bytes(shape)
    host = _host_figure(request.host_memory)
    if request.long.offload is not None:
        return "set in the config" + (
            f"; pinned host memory {_gib(memory.offloaded)} of {host}" if plan.offload_layers else ""
        )
    if not plan.checkpointing:
        return "no checkpoints to offload (activation checkpointing is off)"
    if not plan.offload_layers:
        return (
            f"the {shape.layers} layers' checkpoints ({_gib(shape.layers * layer)}: {_gib(layer)} a layer) fit on "
            f"the GPU ({_gib(memory.needed)} of {_gib(gpu_memory)})"
        )
    fewer = predict(shape, gpus, request, replace(plan, offload_layers=plan.offload_layers - 1))
    return (
        f"{plan.offload_layers} of {shape.layers} layers' checkpointed inputs ({_gib(layer)} each) in pinned host "
        f"memory, the fewest that fit: {plan.offload_layers - 1} would need {_gib(fewer.needed)} of "
        f"{_gib(gpu_memory)} a GPU; host memory {_gib(memory.offloaded + HOST_RESERVED)} of {host} "
        f"({_gib(memory.offloaded)} offloaded + {_gib(HOST_RESERVED)} the worker's own)"
    )


def _host_figure(host_memory: int | None) -> str:
    return _gib(host_memory) if host_memory is not None else "an unknown amount (scaling.host_memory unset)"


def _host_does_not_fit(shape: Shape, request: Request, resolved: Resolved) -> Problem:
    memory, plan = resolved.memory, resolved.plan
    tokens = gpu_tokens(request, plan)
    layers = (
        (resolved.host_memory - HOST_RESERVED) // host_block(tokens * checkpoint_bytes(shape))
        if (resolved.host_memory)
        else 0
    )
    return Problem(
        "scaling.host_memory",
        _gib(resolved.host_memory) if resolved.host_memory is not None else None,
        f"{plan.offload_layers} layers' offloaded checkpoints at {tokens} tokens need {_gib(memory.offloaded)} of "
        f"pinned host memory + {_gib(HOST_RESERVED)} for the worker itself = {_gib(resolved.host_needed)} a GPU "
        f"worker's host, which has {_host_figure(resolved.host_memory)}; the GPU then needs {_gib(memory.needed)} "
        f"of {_gib(resolved.gpu_memory)}",
        "set scaling.host_memory to the GPU nodes' memory (e.g. 128GiB)"
        if resolved.host_memory is None
        else f"GPU workers on hosts of at least {_gib(resolved.host_needed)} (scaling.host_memory), a shorter "
        f"data.seq_length, or a GPU of more memory (this host holds {max(0, layers)} layers' checkpoints)",
    )


# --- what does not fit, and what would ----------------------------------------------------------------------


def _does_not_fit(shape: Shape, gpus: int, gpu_memory: int, request: Request, resolved: Resolved) -> Problem:
    memory, plan = resolved.memory, resolved.plan
    fixes = _fixes(shape, gpus, gpu_memory, request)
    return Problem(
        "GPU memory (GiB)",
        round(gpu_memory / GIB, 1),
        f"the run needs {_gib(memory.needed)} a GPU ({_gib(memory.peak)} predicted peak + {_gib(OUTSIDE_TORCH)} "
        f"outside torch's allocator) with ZeRO stage {plan.stage}, {_precision_name(plan.pure, request.precision)}, "
        f"checkpointing {'on' if plan.checkpointing else 'off'}, micro-batch {plan.micro_batch} x "
        f"{request.seq_length}, on {gpus} GPU(s): {_breakdown(memory)}",
        "; or ".join(fixes)
        if fixes
        else "none of more GPUs (up to 4096), LoRA, optimizer offload or a shorter "
        "seq_length fits: GPUs with more memory",
    )


def _fixes(shape: Shape, gpus: int, gpu_memory: int, request: Request) -> list[str]:
    """Each change that alone would make the run fit."""
    out = []
    explicit = _explicit_fields(request)
    relaxed = replace(request, zero_stage=None, pure_bf16=None, gradient_checkpointing=None, micro_batch_size="auto")
    if explicit and _search(shape, gpus, gpu_memory, relaxed)[1]:
        out.append(f"leave {', '.join(explicit)} to auto")
    long = replace(request, long=LongAsk())
    if request.long != LongAsk() and _search(shape, gpus, gpu_memory, long)[1]:
        out.append("leave model.long_sequence to auto (the tiled MLP and loss, checkpoints offloaded to host memory)")
    more = next((n for n in (2**k for k in range(13)) if n > gpus and _search(shape, n, gpu_memory, request)[1]), 0)
    if more:
        out.append(f"{more} GPUs of this memory (scaling.num_workers: {more})")
    if request.lora is None and _search(shape, gpus, gpu_memory, replace(request, lora=Lora()))[1]:
        out.append("LoRA (model.lora: {r: 16})")
    offload = replace(request, offload_optimizer=True, zero_stage=request.zero_stage or None)
    if not request.offload_optimizer and _search(shape, gpus, gpu_memory, offload)[1]:
        host = (shape.params() if request.lora is None else 0) * 16 / 1e9  # fp32 master, moments and gradients
        out.append(
            "the optimizer in CPU memory (deepspeed.zero_optimization.offload_optimizer: {device: cpu}; "
            f"about {max(host, 1):.0f} GB of CPU memory across the nodes)"
        )
    shorter = [s for s in (2**k for k in range(6, 21)) if s < request.seq_length]
    fitting = [s for s in shorter if _search(shape, gpus, gpu_memory, replace(request, seq_length=s))[1]]
    if fitting:
        out.append(f"a shorter data.seq_length ({max(fitting)} fits)")
    return out


def _explicit_fields(request: Request) -> list[str]:
    fields = {
        "deepspeed.zero_optimization.stage": request.zero_stage is not None,
        "train.pure_bf16": request.pure_bf16 is not None,
        "model.gradient_checkpointing": request.gradient_checkpointing is not None,
        "train.micro_batch_size": request.micro_batch_size != "auto",
    }
    return [name for name, set_ in fields.items() if set_]


def _precision_name(pure: bool, precision: str) -> str:
    if pure:
        return "pure bf16"
    return "fp32" if precision == "fp32" else f"mixed {precision} (fp32 master weights)"


def _breakdown(memory: Memory) -> str:
    parts = [
        ("weights", memory.weights),
        ("gradients", memory.gradients),
        ("optimizer states", memory.optimizer),
        ("activations", memory.activations),
        ("logits/loss", memory.logits),
        ("workspace", memory.workspace),
        ("margin", memory.margin),
    ]
    text = ", ".join(f"{name} {n / GIB:.1f}" for name, n in parts)
    if memory.offloaded:
        text += f"; checkpoints offloaded to host memory {memory.offloaded / GIB:.1f}, not on the GPU"
    if memory.transient_gradients >= GIB // 20:
        text += (
            f"; whole gradients {memory.transient_gradients / GIB:.1f} during backward only, counted where larger "
            "than the activations and logits"
        )
    return text + " (GiB)"


def describe(resolved: Resolved) -> list[str]:
    """The lines `finetune validate` prints: one a choice with its reason, the memory, then any problem."""

    def line(name: str, value: str, choice: Choice) -> str:
        return f"{name}: {value} ({'set' if choice.explicit else 'auto'}) - {choice.reason}"

    r, m = resolved, resolved.memory
    return [
        line("ZeRO stage", str(r.zero_stage.value), r.zero_stage),
        line("precision", _precision_name(r.pure_bf16.value, r.precision), r.pure_bf16),
        line("activation checkpointing", "on" if r.gradient_checkpointing.value else "off", r.gradient_checkpointing),
        line("micro-batch", str(r.micro_batch_size.value), r.micro_batch_size),
        *_long_lines(r),
        f"memory per GPU: {_gib(m.needed)} of {_gib(r.gpu_memory)} ({'fits' if r.fits else 'does not fit'}): "
        f"{_gib(m.peak)} predicted peak + {_gib(OUTSIDE_TORCH)} outside torch's allocator; {_breakdown(m)}",
        *(str(p) for p in r.problems),
    ]


def _long_lines(r: Resolved) -> list[str]:
    """model.long_sequence: one line a switch, with why."""
    value, reasons = r.long_sequence.value, r.long_reasons

    def line(name: str, key: str, shown: str) -> str:
        why = reasons.get(key, "")
        return f"{name}: {shown} ({'set' if why.startswith('set in the config') else 'auto'}) - {why}"

    layers = value["offload_checkpoints"]
    return [
        line("tiled MLP", "tiled_mlp", "on" if value["tiled_mlp"] else "off"),
        line("tiled loss", "tiled_loss", "on" if value["tiled_loss"] else "off"),
        line("offloaded checkpoints", "offload_checkpoints", f"{layers} layers" if layers else "off"),
    ]


def overrides(resolved: Resolved) -> dict[str, Any]:
    """The chosen values of what was left to auto, by config path (for app.config.set_override)."""
    choices = {
        "deepspeed.zero_optimization.stage": resolved.zero_stage,
        "train.pure_bf16": resolved.pure_bf16,
        "model.gradient_checkpointing": resolved.gradient_checkpointing,
        "train.micro_batch_size": resolved.micro_batch_size,
    }
    return {path: c.value for path, c in choices.items() if not c.explicit}


# --- from the product's config ------------------------------------------------------------------------------


def request_from_config(cfg: Any, liger: bool) -> Request:
    """The Request of a TrainingConfig (read by attribute, so that this module needs no config model): a field
    whose value is "auto" is the resolver's to choose, any other value is kept. `liger`: whether Liger's kernels
    will patch this model (app.model.use_liger and a model type Liger knows)."""

    def auto(value: Any) -> Any:
        return None if value == "auto" else value

    t, m, zero = cfg.train, cfg.model, cfg.deepspeed.zero_optimization
    lora = None
    if m.lora is not None:
        targets = m.lora.target_modules
        lora = Lora(m.lora.r, "auto" if targets == "auto" else tuple(targets), m.lora.dropout)
    bucket = zero.to_dict().get("reduce_bucket_size")  # "auto" (app.ds_config's rule) or a number
    bucket = int(bucket) if isinstance(bucket, (int, float)) and not isinstance(bucket, bool) else None
    return Request(
        sequence_parallel=cfg.scaling.sequence_parallel,
        seq_length=cfg.data.seq_length,
        micro_batch_size=t.micro_batch_size,
        zero_stage=auto(zero.stage),
        pure_bf16=auto(t.pure_bf16),
        gradient_checkpointing=auto(m.gradient_checkpointing),
        lora=lora,
        liger=liger,
        attention="eager" if m.attn_implementation == "eager" else "flash",
        precision=t.precision,
        learning_rate=t.learning_rate,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        offload_optimizer=bool(zero.offload_optimizer and zero.offload_optimizer.on),
        offload_param=bool(zero.offload_param and zero.offload_param.on),
        reduce_bucket_elements=bucket,
        long=long_ask(m.long_sequence),
        host_memory=parse_memory(cfg.scaling.host_memory) if cfg.scaling.host_memory else None,
    )


def long_ask(long: Any) -> LongAsk:
    """model.long_sequence ("auto", or its section read by attribute) as a LongAsk."""
    if long == "auto":
        return LongAsk()

    def auto(value: Any) -> Any:
        return None if value == "auto" else value

    return LongAsk(auto(long.tiled_mlp), auto(long.tiled_loss), auto(long.offload_checkpoints))


def long_values(resolved: Resolved) -> dict[str, Any]:
    """model.long_sequence as chosen: concrete switches and the number of offloaded layers."""
    value = resolved.long_sequence.value
    return {
        "tiled_mlp": value["tiled_mlp"],
        "tiled_loss": value["tiled_loss"],
        "offload_checkpoints": value["offload_checkpoints"],
    }


# --gpu-memory's units: G, M, K and GiB... binary (as nvidia-smi's MiB), GB, MB, KB decimal.
UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": GIB, "t": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS.update({"kib": 2**10, "mib": 2**20, "gib": GIB, "tib": 2**40})
MEMORY_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(text: str) -> int:
    """Bytes of a GPU memory size as `--gpu-memory` takes it: 80GiB, 141G, 80GB, or a number of bytes."""
    match = MEMORY_SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if unit not in UNITS:
        raise ValueError(f"{text!r} is not a memory size (e.g. 80GiB, 141G, 80GB)")
    size = float(match.group(1)) * UNITS[unit]
    if not math.isfinite(size) or size < 2**20:
        raise ValueError(f"{text!r}: a GPU has more memory than that")
    return int(size)
