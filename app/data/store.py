"""The prepared dataset on the volume, and the map-style torch dataset that training reads from it.

`<storage>/prepared/<key>/` holds `manifest.json` (written last: a folder without it is not a prepared dataset)
and, per split, one set of .npy files per unit (app.data.encode.Unit): `train/unit-000000.tokens.npy`, ...
They are opened memory-mapped, so a worker reads only the blocks its sampler asks for, and the exact-batch resume
(app.data.ResumableSampler) indexes blocks as it did the tokenized cache before: block i of a split is the same
tensors in every run over the same key.

What a block becomes (`PreparedSplit[i]`), per layout (app.data.encode.layout_of):
- stream (packed text): input_ids = labels = the block's tokens;
- blocks (packed conversations): the documents, then padding; position ids restart at 0 at each document (and
  at the padding); labels are the target tokens, except each document's first token and the padding (-100);
- rows (unpacked): the document, then padding, with attention_mask; labels are its targets, -100 on padding.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.data.manifest import MANIFEST, read_manifest


def unit_path(folder: Path, split: str, unit: int, name: str) -> Path:
    return folder / split / f"unit-{unit:06d}.{name}.npy"


def write_unit(folder: Path, split: str, unit: int, arrays: dict[str, np.ndarray]) -> int:
    """The unit's arrays into `folder` (a prepared dataset's temporary folder); returns the bytes written."""
    written = 0
    (folder / split).mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        path = unit_path(folder, split, unit, name)
        np.save(path, array, allow_pickle=False)
        written += path.stat().st_size
    return written


class PreparedSplit(torch.utils.data.Dataset):
    """One split of a prepared dataset, block by block, from memory-mapped files (or from units in memory)."""

    def __init__(self, layout: str, seq_length: int, pad_id: int, units: list[dict[str, Any]], load, eos_id=None):
        self.seq, self.pad, self.eos = seq_length, pad_id, eos_id
        self.units, self._load = units, load
        self.layouts = [u.get("layout", layout) for u in units]
        # A mixture of packed text and packed conversations: text blocks carry position ids too, so that every
        # block of a batch tells the collator where its documents start the same way.
        self.positions_everywhere = len(set(self.layouts)) > 1
        self.starts = np.cumsum([0] + [u["blocks"] for u in units], dtype=np.int64)
        self._open: dict[int, dict[str, np.ndarray]] = {}

    @classmethod
    def open(cls, folder: Path, split: str) -> PreparedSplit:
        folder = Path(folder)
        manifest = read_manifest(folder)
        if manifest is None:
            raise FileNotFoundError(f"{folder} is not a complete prepared dataset (no {MANIFEST})")
        units = manifest["splits"][split]["units"]

        def load(unit: int) -> dict[str, np.ndarray]:
            names = units[unit]["arrays"]
            return {n: np.load(unit_path(folder, split, units[unit]["unit"], n), mmap_mode="r") for n in names}

        return cls(manifest["layout"], manifest["seq_length"], manifest["pad_id"], units, load, manifest["eos_id"])

    @classmethod
    def in_memory(cls, layout: str, seq_length: int, pad_id: int, arrays: list[dict[str, np.ndarray]], blocks):
        units = [{"unit": n, "blocks": b, "arrays": list(a)} for n, (a, b) in enumerate(zip(arrays, blocks))]
        return cls(layout, seq_length, pad_id, units, lambda unit: arrays[unit])

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers open their own maps
        return {**self.__dict__, "_open": {}}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        unit = int(np.searchsorted(self.starts, i, side="right")) - 1
        if unit not in self._open:
            self._open[unit] = self._load(unit)
        arrays, local, layout = self._open[unit], i - int(self.starts[unit]), self.layouts[unit]
        if layout == "stream":
            ids = torch.from_numpy(arrays["tokens"][local * self.seq : (local + 1) * self.seq].astype(np.int64))
            block = {"input_ids": ids, "labels": ids.clone()}
            if self.positions_everywhere:
                starts = torch.ones_like(ids, dtype=torch.bool)
                starts[1:] = ids[:-1] == self.eos  # as app.data.document_starts finds them
                index = torch.arange(len(ids))
                block["position_ids"] = index - torch.where(starts, index, 0).cummax(dim=0).values
            return block
        if layout == "blocks":
            return self._block(arrays, local)
        return self._row(arrays, local)

    def _document(self, arrays, d: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = int(arrays["docs"][d]), int(arrays["docs"][d + 1])
        ids = arrays["tokens"][lo:hi].astype(np.int64)
        if "targets" not in arrays:
            return ids, np.ones(hi - lo, dtype=bool)
        bits = np.unpackbits(arrays["targets"][lo // 8 : (hi + 7) // 8])  # a bit a token (np.packbits)
        return ids, bits[lo % 8 : lo % 8 + hi - lo].astype(bool)

    def _block(self, arrays, b: int) -> dict[str, torch.Tensor]:
        ids, labels, positions = [], [], []
        for d in range(int(arrays["blocks"][b]), int(arrays["blocks"][b + 1])):
            doc, targets = self._document(arrays, d)
            label = np.where(targets, doc, -100)
            label[0] = -100  # a conversation's first token would be predicted from the one before it
            ids.append(doc), labels.append(label), positions.append(np.arange(len(doc)))
        gap = self.seq - sum(len(doc) for doc in ids)
        ids.append(np.full(gap, self.pad)), labels.append(np.full(gap, -100)), positions.append(np.arange(gap))
        return {
            "input_ids": torch.from_numpy(np.concatenate(ids).astype(np.int64)),
            "labels": torch.from_numpy(np.concatenate(labels).astype(np.int64)),
            "position_ids": torch.from_numpy(np.concatenate(positions).astype(np.int64)),
        }

    def _row(self, arrays, r: int) -> dict[str, torch.Tensor]:
        doc, targets = self._document(arrays, r)
        gap = self.seq - len(doc)
        return {
            "input_ids": torch.from_numpy(np.concatenate([doc, np.full(gap, self.pad)]).astype(np.int64)),
            "attention_mask": torch.from_numpy(np.concatenate([np.ones(len(doc)), np.zeros(gap)]).astype(np.int64)),
            "labels": torch.from_numpy(np.concatenate([np.where(targets, doc, -100), np.full(gap, -100)])),
        }


def open_splits(folder: Path) -> tuple[PreparedSplit, PreparedSplit | None]:
    """(train, eval or None) of a prepared dataset, memory-mapped."""
    manifest = read_manifest(folder) or {}
    evalset = PreparedSplit.open(folder, "eval") if "eval" in manifest.get("splits", {}) else None
    return PreparedSplit.open(folder, "train"), evalset


def remove_tree(folder: Path) -> None:
    """A temporary folder's removal that never fails the caller (what it could not remove, a later run ignores)."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    if os.path.lexists(folder) and not os.path.isdir(folder):
        os.unlink(folder)
