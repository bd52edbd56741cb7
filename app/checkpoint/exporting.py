"""A Hugging Face folder (safetensors + tokenizer) from a checkpoint, consolidated from ZeRO shards with
DeepSpeed's public zero_to_fp32 utility (at ZeRO stage 0, which has no shards, from the module state the engine
saved whole)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from app import lora
from app.checkpoint.layout import STATE_FILE, TAG, plain_modes, read_state

STAGE0_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's file of the whole module (and, at stage 0, optimizer)


def export(checkpoint: Path, out: Path, dtype: str | None = None, model_source: Path | str | None = None) -> Path:
    """A Hugging Face folder (safetensors + tokenizer) from a checkpoint, consolidated from ZeRO shards.

    `checkpoint` is one of this app's checkpoint folders, or any DeepSpeed save_dir (with a `latest` file or
    one tag folder); for the latter, `model_source` names the model folder or hub name that gives the config
    and tokenizer. A LoRA checkpoint (app.lora) gives the merged model and `adapter/`; its base weights are read
    where the run read them, or from `model_source`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint, out = Path(checkpoint), Path(out)
    ours = (checkpoint / TAG).is_dir()
    source = model_source or (checkpoint / "hf" if ours else None)
    if source is None or (ours and not model_source and not (checkpoint / "hf" / "config.json").exists()):
        raise FileNotFoundError(
            f"{checkpoint} has no hf/ folder with the model config: pass the model it was trained from"
        )
    tag = TAG if ours else None
    if not ours and not (checkpoint / "latest").exists():
        tags = [p.name for p in checkpoint.iterdir() if p.is_dir()]
        if len(tags) != 1:
            raise FileNotFoundError(
                f"{checkpoint} has no 'latest' file and {len(tags)} tag folders: pass the tag folder's parent "
                "with one tag"
            )
        tag = tags[0]
    state = read_state(checkpoint) if (checkpoint / STATE_FILE).exists() else {}
    dtype = dtype or state.get("precision", "bf16")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    if ours and lora.is_lora_checkpoint(checkpoint / "hf"):  # adapters only; `model_source`: another copy of the base
        weights = _weights(checkpoint, tag, adapters_only=True)
        hf = checkpoint / "hf"
        return _publish(out, lambda tmp: lora.export(weights, hf, tmp, torch_dtype, model_source), hf)
    weights = _weights(checkpoint, tag)
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [k for k, v in model.state_dict().items() if v.is_meta]
    if missing:
        raise RuntimeError(f"checkpoint {checkpoint} lacks weights for {missing[:5]}")
    model = model.to(torch_dtype)
    return _publish(out, lambda tmp: model.save_pretrained(tmp, safe_serialization=True), source)


def _weights(checkpoint: Path, tag: str | None, adapters_only: bool = False) -> dict[str, torch.Tensor]:
    """The trained weights in fp32 (with `adapters_only`, a LoRA run's adapters): consolidated from ZeRO's
    partitions, or, where the engine saved no partitions (ZeRO stage 0), its module state."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = checkpoint / (tag or (checkpoint / "latest").read_text().strip())
    if any(folder.glob("*optim_states.pt")) or not (folder / STAGE0_STATES).exists():
        return get_fp32_state_dict_from_zero_checkpoint(
            str(checkpoint), tag=tag, exclude_frozen_parameters=adapters_only
        )
    module = torch.load(folder / STAGE0_STATES, map_location="cpu", weights_only=False)["module"]
    return {k: v.float() for k, v in module.items() if not adapters_only or lora.ADAPTER_KEY in k}


def _publish(out: Path, write, source) -> Path:
    """`write(folder)` and the tokenizer into a temp folder, which then replaces `out` whole."""
    from transformers import AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    plain_modes(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
