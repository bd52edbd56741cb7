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
- rows (unpacked): the document, then padding, with attention_mask; labels are its targets, -100 on padding;
- pair_blocks, pair_rows (preference pairs): as blocks, and as two rows (chosen, rejected) of a pair, with
  `documents`, each token's document (2k chosen, 2k + 1 rejected answer of the k-th pair; -1 on padding), and
  `reference`, the reference model's log-probability of each of the block's answers, once a reference pass has
  stored them (`PreparedSplit.reference`: its folder, laid out as the data's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.data.manifest import MANIFEST, read_manifest
from app.data.units import remove_tree, unit_path, write_unit  # noqa: F401 - the store's names too

REFERENCE = "reference"  # a unit's reference log-probability of each answer (float32), stored beside the data


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
        self.split: str | None = None  # its name in a prepared dataset's folder (None: units in memory)
        self.reference: Path | None = None  # where each answer's reference log-probability is (pairs only)

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

        opened = cls(manifest["layout"], manifest["seq_length"], manifest["pad_id"], units, load, manifest["eos_id"])
        opened.split = split
        return opened

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
        unit, local = self.locate(i)
        arrays, layout = self._arrays(unit), self.layouts[unit]
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
        if layout == "pair_blocks":
            return self._pair_block(arrays, local)
        if layout == "pair_rows":
            return self._pair_rows(arrays, local)
        return self._row(arrays, local)

    def locate(self, i: int) -> tuple[int, int]:
        """(the unit, the block's index in it) of block i."""
        i %= len(self)
        unit = int(np.searchsorted(self.starts, i, side="right")) - 1
        return unit, i - int(self.starts[unit])

    def _arrays(self, unit: int) -> dict[str, np.ndarray]:
        if unit not in self._open:
            self._open[unit] = self._load(unit)
            if self.reference is not None:
                path = unit_path(self.reference, self.split, self.units[unit]["unit"], REFERENCE)
                self._open[unit] = {**self._open[unit], REFERENCE: np.load(path, mmap_mode="r")}
        return self._open[unit]

    def use_reference(self, folder: Path | None) -> None:
        """Blocks read from now on carry the reference log-probabilities stored in `folder`."""
        self.reference, self._open = folder, {}

    def document_count(self, unit: int) -> int:
        return len(self._arrays(unit)["docs"]) - 1

    def documents_of(self, i: int) -> tuple[int, int, int]:
        """(unit, first document, end) of a pair layout's block i: its answers, in order."""
        unit, local = self.locate(i)
        if self.layouts[unit] == "pair_rows":
            return unit, 2 * local, 2 * local + 2
        blocks = self._arrays(unit)["blocks"]
        return unit, int(blocks[local]), int(blocks[local + 1])

    def _with_reference(self, item: dict[str, torch.Tensor], arrays, lo: int, hi: int) -> dict[str, torch.Tensor]:
        if REFERENCE in arrays:
            item[REFERENCE] = torch.from_numpy(np.array(arrays[REFERENCE][lo:hi], dtype=np.float32))
        return item

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

    def _pair_block(self, arrays, b: int) -> dict[str, torch.Tensor]:
        """A block of whole pairs, with `documents`: each token's document in the block (2k the chosen answer of
        its k-th pair, 2k + 1 the rejected one; -1 on padding)."""
        block = self._block(arrays, b)
        lo, hi = int(arrays["blocks"][b]), int(arrays["blocks"][b + 1])
        lengths = np.diff(arrays["docs"][lo : hi + 1])
        documents = np.full(self.seq, -1, dtype=np.int64)
        documents[: int(lengths.sum())] = np.repeat(np.arange(hi - lo), lengths)
        return self._with_reference({**block, "documents": torch.from_numpy(documents)}, arrays, lo, hi)

    def _pair_rows(self, arrays, p: int) -> dict[str, torch.Tensor]:
        """Pair p unpacked: its chosen and rejected answers as two padded rows, and `documents` (0, 1; -1 on
        padding)."""
        rows = [self._row(arrays, 2 * p), self._row(arrays, 2 * p + 1)]
        out = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
        out["documents"] = torch.where(out["attention_mask"] == 1, torch.arange(2)[:, None], -1)
        return self._with_reference(out, arrays, 2 * p, 2 * p + 2)

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
