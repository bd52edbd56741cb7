"""Checkpointing, resume and export.

A checkpoint is `<experiment>/checkpoints/step-NNNNNNNN/`: DeepSpeed's shards under `ds/`, each rank's RNG
states, the model config and tokenizer under `hf/` (so it can be exported offline), and `trainer_state.json`,
written last. Every rank writes its shards straight into that folder on the shared volume (no temp copy),
then the folder is reported to Ray with NO_UPLOAD: Ray registers it only when every rank has reported, so
a checkpoint is either complete and registered, or ignored on resume.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

TAG = "ds"
STATE_FILE = "trainer_state.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, path: Path, state: dict[str, Any], rank: int, barrier, hf_files) -> None:
    """All ranks call this; on return `path` holds a complete checkpoint (not yet registered with Ray)."""
    if rank == 0 and path.exists():
        # Left by a run that died while saving this same step: never registered, safe to replace.
        shutil.rmtree(path)
    barrier()
    engine.save_checkpoint(str(path), tag=TAG, client_state=state, save_latest=True)
    torch.save(rng_state(), path / f"rng-rank{rank}.pt")
    if rank == 0:
        hf_files(path / "hf")
    barrier()
    if rank == 0:
        _write_atomic(path / STATE_FILE, json.dumps(state, indent=2))


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).exists() and (path / TAG).is_dir()


def latest_complete(run_dir: Path) -> Path | None:
    """The newest checkpoint folder whose state file was written (the last step of a save)."""
    folders = sorted((Path(run_dir) / "checkpoints").glob("step-*"), reverse=True)
    return next((f for f in folders if is_complete(f)), None)


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((path / STATE_FILE).read_text())


def restore(engine, path: Path, rank: int, world: int) -> dict[str, Any]:
    """Load engine, optimizer and scheduler states; return the trainer state saved with them."""
    state = read_state(path)
    load_path, _ = engine.load_checkpoint(str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint at {path}")
    rng_file = path / f"rng-rank{rank}.pt"
    if state.get("world_size") == world and rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def export(checkpoint: Path, out: Path, dtype: str | None = None, model_source: Path | str | None = None) -> Path:
    """A Hugging Face folder (safetensors + tokenizer) from a checkpoint, consolidated from ZeRO shards.

    `checkpoint` is one of this app's checkpoint folders, or any DeepSpeed save_dir (with a `latest` file or
    one tag folder); for the latter, `model_source` names the model folder or hub name that gives the config
    and tokenizer.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    checkpoint, out = Path(checkpoint), Path(out)
    ours = (checkpoint / TAG).is_dir()
    source = model_source or (checkpoint / "hf" if ours else None)
    if source is None or (ours and not model_source and not (checkpoint / "hf" / "config.json").exists()):
        raise FileNotFoundError(f"{checkpoint} has no hf/ folder with the model config: pass the model it was trained from")
    tag = TAG if ours else None
    if not ours and not (checkpoint / "latest").exists():
        tags = [p.name for p in checkpoint.iterdir() if p.is_dir()]
        if len(tags) != 1:
            raise FileNotFoundError(f"{checkpoint} has no 'latest' file and {len(tags)} tag folders: pass the tag folder's parent with one tag")
        tag = tags[0]
    state = read_state(checkpoint) if (checkpoint / STATE_FILE).exists() else {}
    dtype = dtype or state.get("precision", "bf16")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    weights = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag)
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [k for k, v in model.state_dict().items() if v.is_meta]
    if missing:
        raise RuntimeError(f"checkpoint {checkpoint} lacks weights for {missing[:5]}")
    model = model.to(torch_dtype)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
