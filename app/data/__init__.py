"""Data, one concern a module (as app.checkpoint is):

- `files`: which files a local source's splits are (a folder split the Hub's way, a dataset card's configs);
- `checks`: a source's files, splits, columns and a sample of its rows, checked before any cluster starts;
- `sources`: a split's rows as `datasets` reads them, where a row came from, the format its columns mean;
- `chat`: formats, chat templates, rendering and masking (which tokens are targets), fitting to seq_length, packing;
- `pairs`: preference pairs (a prompt, a chosen and a rejected answer): their forms, checks, encoding and fitting;
- `encode`: one unit of rows to compact arrays (render, mask, tokenize, pack);
- `pipeline`: the prepared dataset's key, and its preparation by Ray Data over every CPU of the cluster;
- `store`: the prepared dataset on the volume, read memory-mapped as a map-style dataset;
- `units`: a unit's files in it (their names and writing; no torch, for the actors that write them);
- `tokens`: the tokenizer as the Ray Data actors hold it (the driver's backend: no transformers to import);
- `manifest`: what a prepared dataset holds, for the log and `finetune status`;
- `loader`: what training reads: the resumable sampler, the packed collator, the loaders;
- `legacy`: the per-experiment cache of experiments started before prepared datasets.

The names below are reachable as `app.data.NAME` and are imported on first use, so that importing this package
(`finetune status`, `--help`) loads neither torch nor `datasets`.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "checks": ("check_source", "config_problem", "looks_like_path", "SAMPLE_ROWS"),
    "sources": ("load_split", "unreadable_data", "row_location", "format_of"),
    "encode": ("UNIT_ROWS",),
    "pipeline": ("tokenize",),
    "legacy": ("cache_key", "cache_folder", "load_cache"),
    "loader": (
        "ResumableSampler",
        "document_starts",
        "packed_batch",
        "PackedCollator",
        "PairCollator",
        "keeps_documents_apart",
        "collator",
        "make_loader",
        "EvalShard",
        "make_eval_loader",
        "LoaderClock",
        "batches_per_epoch",
    ),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
_MODULES = (
    "files",
    "checks",
    "sources",
    "chat",
    "pairs",
    "encode",
    "pipeline",
    "store",
    "units",
    "tokens",
    "manifest",
    "loader",
    "legacy",
)


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"app.data.{name}")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'app.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"app.data.{module}"), name)
