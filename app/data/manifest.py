"""A prepared dataset's manifest (`<storage>/prepared/<key>/manifest.json`): written last, so a folder that has one
is complete; what it says in one line. Plain JSON, no heavy imports: `finetune status` reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
EXPERIMENT_RECORD = "data.json"  # in an experiment's folder: which prepared dataset its runs read


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a complete prepared dataset; None where there is none (absent, or not yet complete)."""
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None


def summary(manifest: dict[str, Any]) -> str:
    train = manifest["splits"]["train"]
    text = (
        f"{manifest['format']}, train: {train['rows']:,} rows, {train['documents']:,} documents, "
        f"{train['tokens']:,} tokens, {train['blocks']:,} blocks of {manifest['seq_length']}"
    )
    if "eval" in manifest["splits"]:
        text += f"; eval: {manifest['splits']['eval']['blocks']:,} blocks"
    size = sum(s["bytes"] for s in manifest["splits"].values())
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    return text + f"; {size / max(tokens, 1):.2f} bytes a token, prepared in {manifest['seconds']:.1f} s"


def render(folder: Path, manifest: dict[str, Any]) -> str:
    """`finetune status` of a prepared dataset: the summary, its sources, what was left out and where it ran."""
    lines = [f"prepared dataset {folder}: {summary(manifest)}", ""]
    sources = manifest.get("sources", [])
    for source in sources:
        mixed = f", {source['taken']:,} in the mixture (weight {source['weight']:g})" if len(sources) > 1 else ""
        lines.append(
            f"  source       {source['dataset']} ({source['split']}, {source['format']}): "
            f"{source['rows']:,} rows read{mixed}"
        )
    for name, split in manifest["splits"].items():
        left = {k: split[k] for k in ("empty", "too_long", "single_token") if split.get(k)}
        shown = ", ".join(f"{k} {v:,}" for k, v in left.items()) or "none"
        cut = f"; cut at a turn boundary: {split['truncated']:,}" if split.get("truncated") else ""
        lines.append(
            f"  {name:<12} {split['blocks']:,} blocks, {split['targets']:,} target tokens; left out: {shown}{cut}"
        )
    nodes = ", ".join(f"{node}: {units}" for node, units in manifest.get("nodes", {}).items())
    lines.append(f"  prepared by  {nodes} (units per Ray node), {manifest['created']}")
    return "\n".join(lines)
