"""The tokenized cache that experiments started before prepared datasets wrote into their own folder
(`<experiment>/cache/tokenized-<key>/`): found and read so that such an experiment resumes on its own blocks.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from app.config import DataConfig
from app.data import chat

log = logging.getLogger("finetune")


def cache_key(
    cfg: DataConfig, tokenizer_name: str, split: str, seed: int, chat_version: str = chat.CACHE_VERSION
) -> str:
    fields = [
        cfg.dataset,
        cfg.config_name,
        split,
        cfg.text_field,
        cfg.seq_length,
        cfg.packing,
        cfg.eval_fraction,
        cfg.eval_split,
        tokenizer_name,
        seed,
        "v1",
        *chat.cache_fields(cfg, chat_version),
    ]
    return hashlib.sha256(json.dumps(fields, default=str).encode()).hexdigest()[:16]


def cache_folder(cfg: DataConfig, tokenizer_name: str, cache_dir: Path, seed: int) -> Path:
    """The tokenized cache that an experiment started before prepared datasets wrote into its own folder
    (`<experiment>/cache/tokenized-<key>/`): the current key's folder, or an earlier chat packing's; an experiment
    that has a complete one keeps training on it (`load_cache`), so that its resume sees its blocks."""
    final = cache_dir / f"tokenized-{cache_key(cfg, tokenizer_name, cfg.split, seed)}"
    if chat.cache_fields(cfg) and not (final / "done").exists():
        for version in chat.EARLIER_CACHE_VERSIONS:
            earlier = cache_dir / f"tokenized-{cache_key(cfg, tokenizer_name, cfg.split, seed, version)}"
            if (earlier / "done").exists():
                return earlier
    return final


def load_cache(folder: Path) -> tuple[Any, Any]:
    """(train, eval or None) of an experiment's own tokenized cache (cache_folder)."""
    import datasets

    loaded = datasets.load_from_disk(str(folder))
    for split in loaded:
        loaded[split].set_format("torch", columns=loaded[split].column_names)
    return loaded["train"], loaded.get("eval")
