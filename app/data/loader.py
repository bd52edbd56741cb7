"""What training reads: a sampler whose position can be restored mid-epoch, the packed-documents collator (each
document its own positions, no attention across them), the train and eval loaders and their clock.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler

from app.config import DataConfig

log = logging.getLogger("finetune")


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, at the exact sample where a run stopped.

    The order depends only on (seed, epoch), so a resumed run sees the same batches as an uninterrupted
    one; `skip` drops the samples this rank already consumed in that epoch.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, shuffle: bool, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.skip = 0

    def set_position(self, epoch: int, samples_done: int) -> None:
        self.set_epoch(epoch)
        self.skip = samples_done

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def document_starts(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """True where a document begins in a packed block: the block's first token and every token after an EOS
    (a document cut by the block's end continues in the next block as a document of its own)."""
    starts = torch.ones_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    return starts


def packed_batch(
    input_ids: torch.Tensor, labels: torch.Tensor, eos_id: int, starts: torch.Tensor | None = None
) -> dict[str, Any]:
    """A batch of packed blocks whose documents stay apart: per-document `position_ids` (0 at each document's
    first token), no loss on a document's first token (it would be predicted from the previous document's
    EOS), and the flattened batch's document boundaries for variable-length attention (`cu_seq_lens_*`,
    `max_length_*`: the names transformers' FlashAttention path reads; app.attention uses them on GPUs).
    `starts`: where documents begin, when not after each EOS (packed conversations, whose turns end with EOS)."""
    rows, seq = input_ids.shape
    starts = document_starts(input_ids, eos_id) if starts is None else starts
    index = torch.arange(seq).expand(rows, seq)
    position_ids = index - torch.where(starts, index, 0).cummax(dim=1).values
    bounds = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([rows * seq])]).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return {
        "input_ids": input_ids,
        "labels": labels.masked_fill(starts, -100),
        "position_ids": position_ids,
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": longest,
        "max_length_k": longest,
    }


class PackedCollator:
    """DataLoader collate_fn for packed blocks (a class, not a closure: loader worker processes pickle it)."""

    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        # Packed conversations (app.data.chat) carry their position ids: each conversation starts at 0.
        starts = torch.stack([r["position_ids"] for r in rows]) == 0 if "position_ids" in rows[0] else None
        return packed_batch(
            torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows]), self.eos_id, starts
        )


class PairCollator:
    """collate_fn for preference pairs (app.data.store's pair_blocks and pair_rows): packed blocks as PackedCollator
    makes them, or each pair's two rows one after the other (chosen, rejected, chosen, ...); and `sequences`, each
    token's answer numbered across the micro-batch, 2k the chosen and 2k + 1 the rejected answer of its k-th pair
    (-1 on padding), for the loop's per-answer sums; `reference`, the stored reference log-probabilities of those
    answers in the same order, when the split carries them."""

    def __init__(self, eos_id: int, packed: bool):
        self.eos_id, self.packed = eos_id, packed

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        if self.packed:
            documents = torch.stack([r["documents"] for r in rows])
            starts = torch.stack([r["position_ids"] for r in rows]) == 0
            batch = packed_batch(
                torch.stack([r["input_ids"] for r in rows]),
                torch.stack([r["labels"] for r in rows]),
                self.eos_id,
                starts,
            )
            per_row = documents.max(dim=1).values + 1  # each block's answers: whole pairs, so an even count
            offsets = per_row.cumsum(0) - per_row
            batch["sequences"] = torch.where(documents >= 0, documents + offsets[:, None], -1)
        else:
            batch = {key: torch.cat([r[key] for r in rows]) for key in ("input_ids", "attention_mask", "labels")}
            documents = torch.cat([r["documents"] for r in rows])
            batch["sequences"] = torch.where(documents >= 0, torch.arange(len(documents))[:, None], -1)
        if "reference" in rows[0]:
            batch["reference"] = torch.cat([r["reference"] for r in rows])
        return batch


def keeps_documents_apart(cfg: DataConfig) -> bool:
    """Whether batches are packed blocks whose documents attention keeps apart (the collator says where each
    begins): what the model's attention is chosen for, known before any data is opened."""
    return cfg.packing and cfg.separate_documents


def collator(cfg: DataConfig, tokenizer) -> PackedCollator | None:
    """The collate_fn for this data config: None (torch's default) unless packed documents are kept apart."""
    return PackedCollator(tokenizer.eos_token_id) if keeps_documents_apart(cfg) else None


def make_loader(
    dataset, micro_batch: int, world: int, rank: int, shuffle: bool, seed: int, workers: int, collate_fn=None
) -> DataLoader:
    sampler = ResumableSampler(dataset, world, rank, shuffle, seed)
    return DataLoader(
        dataset,
        batch_size=micro_batch,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
        # Its own generator: otherwise each new iterator draws from the global RNG and a resumed run's
        # dropout masks would differ from an uninterrupted run's.
        generator=torch.Generator().manual_seed(seed),
    )


class EvalShard(torch.utils.data.Dataset):
    """This rank's share of the whole eval split: ceil(n / world) samples on every rank, so that all ranks run as
    many forward passes (ZeRO-3 gathers parameters in lockstep). The few samples that wrap around to fill the last
    shares carry no labels, so no sample counts twice; a split smaller than world x micro-batch is still
    evaluated (the training loader's drop_last would give it no batch at all). `multiple`: each rank's share is
    padded so, to whole micro-batches (sequence parallelism's attention is built for one batch shape)."""

    def __init__(self, dataset, world: int, rank: int, multiple: int = 1):
        self.dataset, self.n = dataset, len(dataset)
        self.positions = list(range(rank, -(-self.n // (world * multiple)) * world * multiple, world))

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i: int) -> dict[str, Any]:
        position = self.positions[i]
        sample = self.dataset[position % self.n]
        if position >= self.n:
            sample = {**sample, "labels": torch.full_like(sample["labels"], -100)}
        return sample


def make_eval_loader(
    dataset, micro_batch: int, world: int, rank: int, collate_fn=None, full_batches: bool = False
) -> DataLoader:
    shard = EvalShard(dataset, world, rank, micro_batch if full_batches else 1)
    pin = torch.cuda.is_available()
    return DataLoader(shard, batch_size=micro_batch, shuffle=False, collate_fn=collate_fn, pin_memory=pin)


class LoaderClock:
    """Host time spent blocked on the data loader: an upper bound on how long the GPU waited for data."""

    def __init__(self) -> None:
        self.waited = 0.0

    def timed(self, loader) -> Iterator[Any]:
        batches = iter(loader)
        while True:
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.waited += time.perf_counter() - started
            yield batch

    def take(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited


def batches_per_epoch(dataset_len: int, micro_batch: int, world: int) -> int:
    return (dataset_len // world) // micro_batch
