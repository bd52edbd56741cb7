"""LoRA through PEFT: the adapters wrapped around the model's projections (the only trainable parameters, so the only
ones in the optimizer and in checkpoints), and the export of a LoRA checkpoint as a merged Hugging Face model plus
the PEFT adapter (`adapter/`), on any machine that can read the base model.

A checkpoint of a LoRA run holds the adapters and their optimizer state only (DeepSpeed's exclude_frozen_parameters);
the base weights are the model's own, read again from `model.name_or_path` on resume and at export, which its
`hf/adapter_config.json` names (`base_model_name_or_path`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from app.errors import Problem

log = logging.getLogger("finetune")
ADAPTER_CONFIG = "adapter_config.json"
# `target_modules: auto`: the attention and MLP projections, by the names the model types give them; a model with
# none of these families complete (MoE models, whose experts transformers fuses into tensors, DeepSeek's latent
# attention, Phi-2, StarCoder2, GLM-4, hybrids) gets every linear layer but the output head: PEFT's "all-linear".
PROJECTIONS = (
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),  # Llama, Mistral, Qwen, Gemma
    ("c_attn", "c_proj", "c_fc"),  # GPT-2
    ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),  # GPT-NeoX, Falcon
    ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),  # Phi-3
    ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),  # OPT, Phi
)

ADAPTER_KEY = "lora_"  # in the name of every adapter weight PEFT adds (lora_A, lora_B)


def target_modules(model, spec) -> list[str]:
    """The module names that get adapters: `spec`, or for "auto" the first PROJECTIONS family the model has, else
    the names of all its linear layers but the output head."""
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if not list(module.children())}
    wanted = None if spec == "auto" else list(spec)
    if wanted is None:
        wanted = next(([n for n in family if n in names] for family in PROJECTIONS if set(family) <= names), None)
        wanted = wanted or all_linear(model)
    missing = [n for n in wanted or [] if n not in names]
    if not wanted or missing:
        kind = getattr(model.config, "model_type", "?")
        raise Problem(
            "model.lora.target_modules",
            spec,
            f"this {kind} model has no module named {missing[0]!r}"
            if missing
            else f"this {kind} model has no linear layers",
            f"list the module names to adapt (its linear layers include {sorted(names)[:12]})",
        )
    return wanted


# Mixture-of-experts routers (transformers' names): an adapter there would move tokens between experts that the
# base model balanced, so they stay frozen, as in full fine-tuning recipes that freeze the router.
ROUTERS = frozenset({"router", "gate", "shared_expert_gate"})


def all_linear(model) -> list[str]:
    """PEFT's "all-linear" without the routers: the names of every linear layer except the output head's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }
    return sorted(found - ROUTERS - {"lm_head"})


def transposed_weights(model, targets: list[str]) -> bool:
    """Whether every targeted layer keeps its weight transposed (transformers' Conv1D: GPT-2, GPT-BigCode), which
    PEFT calls fan_in_fan_out; it would find that out itself, with a warning in the run's log for each layer."""
    from transformers.pytorch_utils import Conv1D

    layers = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in targets]
    return bool(layers) and all(isinstance(m, Conv1D) for m in layers)


def wrap(model, cfg, base: str):
    """The PeftModel of `model` with LoRA adapters per `cfg` (model.lora); logs how many parameters train."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules(model, cfg.target_modules)
    config = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        fan_in_fan_out=transposed_weights(model, targets),
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )
    model = get_peft_model(model, config)
    # The frozen embeddings' output must require grad: ZeRO-3 gathers a leaf module's (a whole decoder layer's)
    # parameters again for backward through a hook that fires only on inputs that require grad.
    model.enable_input_require_grads()
    trainable, total = count(model)
    log.info(
        f"LoRA r={cfg.r} on {', '.join(config.target_modules)}: {trainable:,} of {total:,} parameters train "
        f"({100 * trainable / max(total, 1):.2f}%)"
    )
    return model


def count(model) -> tuple[int, int]:
    """(trainable, all) parameters; ZeRO-3-partitioned ones counted whole."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return sum(n for n, grad in sizes if grad), sum(n for n, _ in sizes)


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def save_files(model, tokenizer, folder: Path) -> None:
    """A checkpoint's hf/ folder: the base model's config, the tokenizer, and for LoRA the adapter config."""
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if is_lora(model):
        model.peft_config["default"].save_pretrained(folder)


def is_lora_checkpoint(hf: Path) -> bool:
    return (Path(hf) / ADAPTER_CONFIG).exists()


def export(weights: dict[str, torch.Tensor], hf: Path, out: Path, dtype, base: str | None = None) -> None:
    """`out`: the merged model (safetensors) and the tokenizer; `out/adapter`: the PEFT adapter. `weights` are
    the checkpoint's adapters (PeftModel names); the base weights are read from `base` (default: the base model
    that hf/adapter_config.json names)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig.from_pretrained(str(hf))
    base = base or config.base_model_name_or_path
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    result = model.load_state_dict(weights, strict=False)
    adapters = [k for k, _ in model.named_parameters() if ADAPTER_KEY in k]
    if result.unexpected_keys or any(k in result.missing_keys for k in adapters):
        raise RuntimeError(
            f"the checkpoint's adapters do not fit {base}: missing "
            f"{[k for k in adapters if k in result.missing_keys][:3]}, unexpected {result.unexpected_keys[:3]}"
        )
    model.save_pretrained(out / "adapter")  # fp32, as PEFT keeps adapters
    merged = model.merge_and_unload()  # in fp32, then cast once
    assert not isinstance(merged, PeftModel)
    merged.to(dtype).save_pretrained(out, safe_serialization=True)
