"""Model, tokenizer, optimizer and learning-rate schedule, and the checks of the model's settings against the model
and the workers that app.preflight runs before any cluster starts (seq_length, packing, compile, attention, FP8,
LoRA).

`model.name_or_path` may be `random-init:<folder>`: the model is then built from the folder's config.json with
freshly initialised weights (no weight files needed), as for pre-training from scratch or for benchmarks of a
model shape; the folder's tokenizer is used unless `model.tokenizer` names another.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import os
from typing import Any

import torch

from app.config import DataConfig, ModelConfig, Problem, TrainConfig, TrainingConfig

log = logging.getLogger("finetune")

RANDOM_INIT = "random-init:"


def model_source(name_or_path: str) -> tuple[str, bool]:
    """(what from_pretrained reads, whether the weights are freshly initialised instead of loaded)."""
    if name_or_path.startswith(RANDOM_INIT):
        return name_or_path[len(RANDOM_INIT) :], True
    return name_or_path, False


def load_model_config(cfg: ModelConfig):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_source(cfg.name_or_path)[0], trust_remote_code=cfg.trust_remote_code)


def hidden_size(model_config) -> int | None:
    return getattr(model_config, "hidden_size", None) or getattr(model_config, "n_embd", None)


# DeepSpeed's own cap on the size of a ZeRO-3 leaf module (one that is fetched whole).
MAX_LEAF_PARAMS = 1_000_000_000


def meta_model(model_config, trust_remote_code: bool = False):
    """The model built on the meta device (shapes only, nothing allocated), or None for an architecture that
    transformers cannot build."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - whatever the architecture's code raises: the caller has no model to count
        return None


def zero3_leaf_layers(model_config, trust_remote_code: bool = False) -> tuple[list[str], int]:
    """The model's repeated decoder layer (transformers' `_no_split_modules`, e.g. LlamaDecoderLayer), for
    DeepSpeed's ZeRO-3 leaf modules: parameters are fetched once per layer instead of once per linear layer,
    which removes most of ZeRO-3's per-module hook overhead. Returns (class names, parameters of the largest
    such layer); ([], 0) when the model names no layer class or a layer holds more than DeepSpeed's leaf cap
    (a huge MoE layer is better fetched piece by piece). Counted on the meta device: nothing is allocated."""
    model = meta_model(model_config, trust_remote_code)
    if model is None:
        return [], 0
    names = set(getattr(model, "_no_split_modules", None) or [])
    sizes = {
        type(m).__name__: sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in names
    }
    fit = {name: size for name, size in sizes.items() if 0 < size <= MAX_LEAF_PARAMS}
    return sorted(fit), max(fit.values(), default=0)


def model_facts(cfg: TrainingConfig, model_config) -> dict[str, Any]:
    """What `app.ds_config.build` needs from a transformers model config, as its keyword arguments."""
    wanted = cfg.deepspeed.auto_leaf_classes
    classes, params = zero3_leaf_layers(model_config, cfg.model.trust_remote_code) if wanted else ([], 0)
    return {"hidden_size": hidden_size(model_config), "layer_classes": classes, "layer_params": params}


def context_length(model_config) -> int | None:
    for attr in ("max_position_embeddings", "n_positions", "seq_length"):
        value = getattr(model_config, attr, None)
        if isinstance(value, int):
            return value
    return None


def check_seq_length(seq_length: int, model_config) -> list[Problem]:
    limit = context_length(model_config)
    if limit is not None and seq_length > limit:
        return [
            Problem(
                "data.seq_length",
                seq_length,
                f"above the model's context of {limit} tokens",
                f"set data.seq_length <= {limit}",
            )
        ]
    return []


# transformers' `layer_types` of layers with a recurrent state (Mamba, Mamba-2, gated delta-rule linear attention);
# "mamba" is the name older configs used.
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "hybrid", "mamba"})


def packed_documents_problems(data_cfg: DataConfig, model_config) -> list[Problem]:
    """Packed documents are kept apart in attention layers only. Recurrent layers carry their state from one
    document into the next: measured on CPUs, Bamba, Falcon-H1, Nemotron-H, Granite 4's hybrid and Jamba leak across
    documents, and transformers refuses such a batch at the first step for Qwen3.5 and Qwen3-Next."""
    if not (data_cfg.packing and data_cfg.separate_documents):
        return []
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    recurrent = sorted(set(getattr(text, "layer_types", None) or ()) & RECURRENT_LAYER_TYPES)
    if not recurrent:
        return []
    return [
        Problem(
            "data.packing",
            True,
            f"{model_config.model_type} has recurrent layers ({', '.join(recurrent)}), which carry their state from "
            "one packed document into the next; packed documents are kept apart in attention layers only",
            "set data.packing=false (each example padded on its own)",
        )
    ]


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    name = cfg.tokenizer or model_source(cfg.name_or_path)[0]
    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # the tutorial's choice; padding never reaches the loss (labels -100)
    return tok


def attention_kernel(cfg: ModelConfig, separate_documents: bool, model_config) -> str:
    """The attn_implementation to build with: for packed batches whose documents are kept apart, with "sdpa" asked
    for and a model whose layers call transformers' attention functions, app.attention's (variable-length
    FlashAttention on GPUs, SDPA over the documents' mask on CPUs); else as configured, but "eager" where "sdpa" is
    asked for a model that transformers has no SDPA for. Packed documents through any other attention are checked
    once the engine is up (app.train_loop.refuse_leaking_attention)."""
    from app import attention

    if separate_documents and cfg.attn_implementation == "sdpa" and calls_attention_functions(model_config):
        return attention.register()
    if cfg.attn_implementation == "sdpa" and _declares(model_config, "_supports_sdpa") is False:
        # transformers refuses SDPA for these (Gemma 2's soft-capping, gpt-oss' sinks, Bloom) and picks eager itself
        # when asked for nothing.
        log.info(f"attention: {model_config.model_type} has no SDPA attention in transformers; its eager one is used")
        return "eager"
    return cfg.attn_implementation


def calls_attention_functions(model_config) -> bool:
    """Whether the model's layers call the attention function transformers is given, as its class declares
    (`_supports_attention_backend`). Falcon, Bloom and MPT compute their own (Falcon fails on any other name), and so
    may a remote-code model that transformers' auto classes do not list: those keep transformers' SDPA."""
    return bool(_declares(model_config, "_supports_attention_backend"))


def _declares(model_config, flag: str) -> bool | None:
    """A flag of the causal-LM class transformers builds for `model_config`; None when no auto class lists it (a
    remote-code model)."""
    from transformers import AutoModelForCausalLM

    if model_config is None:
        return None
    model_class = AutoModelForCausalLM._model_mapping.get(type(model_config), None)
    return None if model_class is None else bool(getattr(model_class, flag, False))


def attention_problems(cfg: TrainingConfig) -> list[Problem]:
    """transformers' flash_attention_2 needs GPUs and the flash-attn package, which the image does not ship (the
    app's own attention, the default `sdpa`, runs FlashAttention through PyTorch): refused here, on the workers'
    side of the config (scaling.use_gpu) and with the packages of this image, not after the cluster is up."""
    if cfg.model.attn_implementation != "flash_attention_2":
        return []
    if not cfg.scaling.use_gpu:
        reason, fix = "needs GPU workers, and scaling.use_gpu is false", "use sdpa (the default) on CPU workers"
    elif importlib.util.find_spec("flash_attn") is None:
        reason = (
            "needs the flash-attn package, which this image (the workers' too) does not have; it depends on the "
            "workers' hardware and image"
        )
        fix = (
            "use sdpa (the default: FlashAttention through PyTorch, packed documents kept apart), or install flash-attn"
        )
    else:
        return []
    return [Problem("model.attn_implementation", "flash_attention_2", reason, fix)]


def load_model(
    cfg: ModelConfig, ds_config: dict[str, Any], separate_documents: bool = False, tokens: int | None = None
):
    """The model, built partitioned under ZeRO-3 (HfDeepSpeedConfig makes from_pretrained use zero.Init).
    `separate_documents`: batches are packed blocks from app.data.PackedCollator. `tokens`: per micro-batch, for
    model.fp8's choice of layers (fp8_pays); None converts every layer FP8 can take."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    # Must stay alive while the model is built: transformers holds it through a weak reference.
    keep_alive = HfDeepSpeedConfig(ds_config) if ds_config.get("zero_optimization", {}).get("stage") == 3 else None
    mc = load_model_config(cfg)  # read once: the dropout override, the attention choice and the build share it
    if cfg.dropout is not None:
        for key in [k for k in mc.to_dict() if "dropout" in k or k.endswith("pdrop")]:
            setattr(mc, key, cfg.dropout)
    path, random_init = model_source(cfg.name_or_path)
    attn = attention_kernel(cfg, separate_documents, mc)
    if random_init:
        # Built under zero.Init too (transformers checks the live HfDeepSpeedConfig), so a ZeRO-3 model of
        # any size is created already partitioned, on the GPUs.
        with random_init_device(zero3=keep_alive is not None):
            model = AutoModelForCausalLM.from_config(
                mc, attn_implementation=attn, trust_remote_code=cfg.trust_remote_code
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, config=mc, attn_implementation=attn, trust_remote_code=cfg.trust_remote_code
        )
    del keep_alive
    if use_liger(cfg):
        _apply_liger(model, required=cfg.liger_kernels is True)
    if cfg.fp8:
        _apply_fp8(model, compiled=torch.cuda.is_available(), tokens=tokens)
    if cfg.gradient_checkpointing is True:  # "auto" is chosen before a run (app.autoset); left, it means off
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.long_sequence != "auto":  # settled by app.autoset; switches still "auto" (never settled) are off
        from app import long_sequence

        for line in long_sequence.apply(model, cfg.long_sequence, checkpointing=cfg.gradient_checkpointing is True):
            log.info(f"model.long_sequence: {line}")
    model.config.use_cache = False
    if cfg.lora is not None:
        from app import lora

        model = lora.wrap(model, cfg.lora, path)
    return model


LOSS_CHUNK_ELEMENTS = 2**27  # logits of one chunk of Liger's fused loss: 256 MiB in bf16, at most twice that


def loss_options(model, tokens: int) -> dict[str, int]:
    """Keyword arguments for the training forward. Where the loss is Liger's fused linear cross-entropy: how many
    logits a chunk of rows may hold, as a multiple of the hidden states' size (tokens x hidden size), which is
    Liger's own bound. With a large vocabulary on a small model that bound makes many small chunks, each adding a
    product into the whole head weight's gradient: the Qwen2-0.5B shape at 8 x 2048 tokens (vocabulary 151,936,
    hidden size 896) ran 128 chunks of 128 rows, 25.7 ms of such products in a 192 ms step; in chunks of up to
    LOSS_CHUNK_ELEMENTS logits (16 of 1024 rows) its step ran 1.15-1.21x faster for 0.19 GiB more memory, the loss
    the same and the gradients as close to fp32's (docs/benchmarks.md). `tokens`: a micro-batch's."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA, the wrapped model
    if not (getattr(base.forward, "__module__", None) or "").startswith("liger_kernel.transformers.model."):
        return {}  # also where app.long_sequence's tiled loss replaced Liger's forward
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return {}
    takes = "chunk_mem_const" in inspect.signature(liger_fused_linear_cross_entropy).parameters
    passes = getattr(LigerFusedLinearCrossEntropyFunction, "supports_inner_impl_dispatch", False)
    hidden = hidden_size(base.config)
    if not (takes and passes and hidden):
        return {}
    return {"chunk_mem_const": max(1, LOSS_CHUNK_ELEMENTS // (tokens * hidden))}


def random_init_device(zero3: bool):
    """Where a random-init model is built: on this worker's GPU (LOCAL_RANK, as DeepSpeed picks it), where the
    engine would move it anyway. Initialised on the CPU of a Ray worker, the 1.1B took
    35.5 s at ZeRO-2. Under ZeRO-3, zero.Init already builds it partitioned on the GPUs; without a GPU, on the CPU."""
    if zero3 or not torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def use_liger(cfg: ModelConfig) -> bool:
    """Whether to patch in Liger's kernels: "auto" means on a GPU with liger-kernel installed."""
    if cfg.liger_kernels != "auto":
        return cfg.liger_kernels
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def compile_problems(cfg: TrainingConfig) -> list[Problem]:
    """torch.compile of a ZeRO-3 model with Liger's kernels fails at the first step (docs/benchmarks-history.md;
    DeepCompile too): refuse it here rather than after the cluster and the model are up. FP8 compiles its
    own casts and needs torchao (a dependency, so installed wherever this runs). Liger's kernels, when required,
    need GPUs; whether liger-kernel (the `gpu` extra) is installed is left to the workers: `validate` of a GPU
    config on a laptop without it is fine."""
    liger = cfg.model.liger_kernels is True or (cfg.model.liger_kernels == "auto" and cfg.scaling.use_gpu)
    if cfg.model.compile and liger and cfg.deepspeed.zero3:
        return [
            Problem(
                "model.compile",
                True,
                "torch.compile of a ZeRO-3 model with Liger's kernels fails at the "
                "first step (Liger's fused loss is traced with the partitioned lm_head weight)",
                "set model.compile=false (the default), or model.liger_kernels=false",
            )
        ]
    if cfg.model.fp8 and cfg.model.compile:
        return [
            Problem(
                "model.fp8",
                True,
                "FP8 compiles its own casts; inside model.compile's whole-model graph it is untried",
                "set model.compile=false, or model.fp8=false",
            )
        ]
    if cfg.model.fp8 and importlib.util.find_spec("torchao") is None:
        return [
            Problem(
                "model.fp8",
                True,
                "torchao is not installed here (the image has it)",
                "pip install torchao, or set model.fp8=false",
            )
        ]
    if cfg.model.liger_kernels is True and not cfg.scaling.use_gpu:
        return [
            Problem(
                "model.liger_kernels",
                True,
                "Liger's kernels run on GPUs only (Triton) and scaling.use_gpu is false",
                "set model.liger_kernels=auto (GPUs only) or false",
            )
        ]
    return []


def _apply_liger(model, required: bool) -> None:
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise Problem(
            "model.liger_kernels",
            True,
            f"liger-kernel is not importable ({exc})",
            "pip install liger-kernel, or set it false",
        ) from None
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        if required:
            raise Problem(
                "model.liger_kernels",
                True,
                f"Liger has no kernels for model type {model_type!r}",
                "set model.liger_kernels to auto or false",
            )
        return
    _apply_liger_kernel_to_instance(model=model)


FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores


def fp8_linears(model) -> list[torch.nn.Module]:
    """The layers model.fp8 converts: every torch.nn.Linear but the output head (Liger's fused loss reads its
    weight directly) whose sizes FP8 matmuls take (multiples of 16)."""
    head = model.get_output_embeddings()
    return [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not head and m.in_features % 16 == 0 and m.out_features % 16 == 0
    ]


# FP8 pays for a linear layer when its matmul does enough work per element it casts. With t tokens, a layer of
# i inputs and o outputs does 6*t*i*o FLOPs forward and backward and casts about 2*(t*i + i*o + t*o) elements, a
# ratio of 3/(1/t + 1/i + 1/o). benchmarks/fp8_shapes.py on one H200 (docs/benchmarks.md, 2026-12-01 and -02):
# every projection of the Qwen2-0.5B, Llama 1.1B and Llama-3-8B shapes with 1/(1/t + 1/i + 1/o) of 1,376 or more
# ran 1.10-1.58x faster in FP8 on the GPU, every one of 993 or less 0.20-1.00x by the wall clock (torchao's casts
# and their host-side dispatch cost about a millisecond a layer whatever its size): the threshold sits between.
FP8_MIN_INTENSITY = 1200


def fp8_pays(layer: torch.nn.Linear, tokens: int) -> bool:
    """Whether FP8 makes `layer`'s forward and backward faster at `tokens` tokens per micro-batch (the rule above)."""
    return 1 / (1 / tokens + 1 / layer.in_features + 1 / layer.out_features) >= FP8_MIN_INTENSITY


def fp8_problems(model) -> list[Problem]:
    """model.fp8 on a model with nothing to convert would train in bf16 while saying FP8: refused. Checked on
    the meta-device model before any cluster starts (app.preflight) and again on the real one."""
    if fp8_linears(model):
        return []
    return [
        Problem(
            "model.fp8",
            True,
            f"this {model.config.model_type} model has no torch.nn.Linear layer with sizes "
            "divisible by 16 besides its output head (GPT-2's are Conv1D)",
            "set model.fp8=false",
        )
    ]


def fp8_model_problems(cfg: TrainingConfig, model_config) -> list[Problem]:
    """model.fp8 on a model with no layer to convert (GPT-2's Conv1D), found on the meta-device model: seconds of
    transformers' modelling import before Ray starts, for FP8 runs only, instead of a failure at every worker."""
    model = meta_model(model_config, cfg.model.trust_remote_code)
    return [] if model is None else fp8_problems(model)


def _apply_fp8(model, compiled: bool, tokens: int | None = None) -> None:
    """FP8 matmuls for the decoder layers' linear layers through torchao's float8 training (dynamic tensorwise
    scales; the weights, gradients and optimizer stay bf16/fp32, only each matmul's inputs are cast). The output
    head stays bf16: Liger's fused loss reads its weight directly. `compiled`: the cast-and-matmul function (not
    the module, whose hooks ZeRO-3 owns) goes through torch.compile, which fuses each cast into one kernel (eager,
    the casts made steps 1.8-2.4x slower than bf16: docs/benchmarks.md); the modules share one matmul config so
    that a compiled graph serves every layer of the same shape. Only layers that gain from FP8 at `tokens` per
    micro-batch are converted (fp8_pays); the others stay bf16, so that model.fp8 is never slower than bf16."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability()
        raise Problem(
            "model.fp8",
            True,
            f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no FP8 tensor cores",
            "set model.fp8=false, or run on GPUs of compute capability 8.9 or newer",
        )
    if problems := fp8_problems(model):
        raise problems[0]
    candidates = fp8_linears(model)
    chosen = candidates if tokens is None else [m for m in candidates if fp8_pays(m, tokens)]
    if tokens is not None:
        log.info(fp8_choice(model, chosen, candidates, tokens))
    convert_to_fp8(model, chosen, compiled)
    fuse_fp8_mlps(model, compiled)


def fp8_choice(model, chosen: list, candidates: list, tokens: int) -> str:
    """One line: which projections run in FP8 at this micro-batch size and which stay bf16."""
    names = {id(m): name.rsplit(".", 1)[-1] for name, m in model.named_modules()}
    fp8 = sorted({names[id(m)] for m in chosen})
    kept = sorted({names[id(m)] for m in candidates} - set(fp8))
    head = f"model.fp8: {len(chosen)} of {len(candidates)} linear layers run FP8 matmuls at {tokens:,} tokens"
    head += " a micro-batch"
    return (
        head
        + (f" ({', '.join(fp8)})" if fp8 else "")
        + (f"; {', '.join(kept)} stay bf16: their shape gains nothing from FP8 (docs/benchmarks.md)" if kept else "")
    )


def convert_to_fp8(root: torch.nn.Module, linears: list[torch.nn.Module], compiled: bool) -> None:
    """Swap `linears` (modules under `root`) for torchao's Float8Linear, in place, their cast-and-matmul compiled
    when `compiled`. benchmarks/fp8_shapes.py times single layers through this same path."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    targets = {id(m) for m in linears}
    convert_to_float8_training(root, module_filter_fn=lambda mod, _: id(mod) in targets)
    layers = [m for m in root.modules() if isinstance(m, Float8Linear)]
    if not compiled or not layers:
        return
    # One graph per (input, weight) shape, for training and for evaluation (no grad): about 10 for a Llama.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)

    @torch.compile(dynamic=False)
    def fp8_matmul(x, weight, mm_config, config):
        return matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)

    def forward(self, x):
        out = fp8_matmul(x, self.weight, self.linear_mm_config, self.config)
        return out if self.bias is None else out + self.bias.to(out.dtype)  # Qwen2's q/k/v have biases

    for layer in layers:
        layer.linear_mm_config, layer.config = layers[0].linear_mm_config, layers[0].config
        layer.forward = forward.__get__(layer)


def fuse_fp8_mlps(model: torch.nn.Module, compiled: bool) -> int:
    """Each SwiGLU MLP (Llama, Qwen2, Mistral: down(silu(gate(x)) * up(x)), no biases) whose three projections are
    FP8 runs as one function, compiled when `compiled`: one call from the host instead of three FP8 matmuls and the
    activation, the input's cast shared by gate and up, the activation fused with the casts around it. The
    parameters stay the modules' own (checkpoints unchanged). The MLP falls back to its own forward wherever the
    projections are no longer plain FP8 layers with whole weights (wrapped by LoRA, partitioned by ZeRO-3, whose
    hooks gather them only through the modules' forward). Always on: against the projections one by one, the 1.1B's
    FP8 step ran 0.1909 s for 0.1950 s and 22.55 GiB for 24.70 at its peak (docs/benchmarks-history.md, `fusedmlp`).
    Returns how many MLPs it fused."""
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    def swiglu(x, gate, up, down, mm_config, config):
        g = matmul_with_hp_or_float8_args.apply(x, gate.t(), mm_config, config)
        u = matmul_with_hp_or_float8_args.apply(x, up.t(), mm_config, config)
        h = (torch.nn.functional.silu(g.float()) * u.float()).to(g.dtype)  # as Liger's SwiGLU: fp32, one rounding
        return matmul_with_hp_or_float8_args.apply(h, down.t(), mm_config, config)

    fused_swiglu = torch.compile(swiglu, dynamic=False) if compiled else swiglu

    def plain_fp8(mlp) -> bool:
        parts = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        return all(type(p) is Float8Linear and p.bias is None and not hasattr(p.weight, "ds_id") for p in parts)

    def forward(self, x, own_forward):
        if not plain_fp8(self):
            return own_forward(x)
        gate = self.gate_proj
        return fused_swiglu(
            x, gate.weight, self.up_proj.weight, self.down_proj.weight, gate.linear_mm_config, gate.config
        )

    fused = 0
    for mlp in model.modules():
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")) or not plain_fp8(mlp):
            continue
        if getattr(getattr(mlp, "config", None), "hidden_act", None) not in ("silu", "swish"):
            continue
        mlp.forward = functools.partial(forward.__get__(mlp), own_forward=mlp.forward)
        fused += 1
    return fused


# How `build_optimizer` groups the parameters, recorded in each checkpoint's trainer state ("decay_groups"). 2:
# `decay_groups` by each parameter's whole shape, at every ZeRO stage. Checkpoints without the record were written by
# layout 1, by the shape of each parameter's own tensor: the same at stages 0-2, but at stage 3 (every tensor a
# partitioned placeholder) all in the no-decay group, and the empty decay group dropped by DeepSpeed: one group. Such a
# checkpoint resumes at stage 3 through DeepSpeed's universal checkpoint (app.checkpoint.resuming.restore).
DECAY_GROUPS_LAYOUT = 2


def build_optimizer(model, cfg: TrainConfig, offloaded: bool, clips: bool = False):
    """AdamW; DeepSpeed's CPU Adam when the optimizer lives on the CPU (a torch AdamW crashes there), its moments
    in bf16 with train.pure_bf16 (torch's AdamW keeps them in the dtype of the bf16 partitions it is given).
    `clips`: the optimizer clips to train.max_grad_norm itself (ClippingAdamW: DeepSpeed's mixed precision is off)."""
    decay, no_decay = ([param for _, param in group] for group in decay_groups(model))
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=cfg.learning_rate, betas=cfg.adam_betas, eps=cfg.adam_eps)
    if offloaded:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, fp32_optimizer_states=cfg.pure_bf16 is not True, **kwargs)
    if torch.cuda.is_available():
        kwargs["fused"] = True  # torch's own fused kernel: no DeepSpeed op build at start
    if clips:
        return ClippingAdamW(groups, max_norm=cfg.max_grad_norm, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def decay_groups(model) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The trained (name, parameter) pairs AdamW decays and those it does not (norms, biases: fewer than 2
    dimensions, or "norm" in the name), in the model's order: `build_optimizer`'s two groups, the same at every ZeRO
    stage. Judged by each parameter's whole shape: under ZeRO-3 the model is built partitioned (zero.Init), each
    parameter's own tensor an empty placeholder of 1 dimension and its shape in `ds_shape`; grouped by that
    placeholder, every weight went undecayed at stage 3 (`DECAY_GROUPS_LAYOUT`)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            ndim = len(getattr(param, "ds_shape", param.shape))
            (no_decay if ndim < 2 or "norm" in name.lower() else decay).append((name, param))
    return decay, no_decay


class ClippingAdamW(torch.optim.AdamW):
    """torch's fused AdamW that first clips the gradients to a global norm of `max_norm` (0: measures it only),
    with torch's multi-tensor kernels, keeps the norm where DeepSpeed's engine reads it (`_global_grad_norm`), and
    skips the update of a step whose norm is not finite, as DeepSpeed's own bf16 optimizers do. For ZeRO stage 0
    without DeepSpeed's mixed precision, where the engine would clip tensor by tensor and report no norm."""

    def __init__(self, params, max_norm: float, **kwargs):
        super().__init__(params, **{**kwargs, "fused": True})  # fused on CPUs too: `found_inf` needs it
        self.max_norm, self._global_grad_norm = max_norm, None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        self._global_grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        # Read by the fused kernel, as under GradScaler: set, it leaves weights, moments and step count as they
        # were, with no host sync here (the loop's NonFiniteGuard counts the step).
        self.found_inf = (~torch.isfinite(self._global_grad_norm)).float()
        if self.max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, self._global_grad_norm, foreach=True)
        return super().step(closure)


def build_scheduler(optimizer, cfg: TrainConfig, total_steps: int):
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup"}.get(cfg.lr_scheduler, cfg.lr_scheduler)
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_steps)


def lora_problems(cfg: ModelConfig, model_config) -> list[Problem]:
    """model.lora's problems before any cluster starts: adapters over random weights (nothing to export them onto),
    and target_modules the model does not have (found on the meta-device model)."""
    from app import lora

    if cfg.name_or_path.startswith(RANDOM_INIT):
        return [
            Problem(
                "model.lora",
                cfg.lora.model_dump(),
                f"adapters over the random weights of {cfg.name_or_path}: no base model to merge or resume them on",
                "set model.lora: null, or name_or_path a pretrained model",
            )
        ]
    model = meta_model(model_config, cfg.trust_remote_code)
    try:
        if model is not None:
            lora.target_modules(model, cfg.lora.target_modules)
    except Problem as problem:
        return [problem]
    return []
