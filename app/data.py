"""Data: load, tokenize, mask, pack, and a sampler whose position can be restored mid-epoch.

Tokenized data is cached under `<storage>/<experiment>/cache/` by a key of everything that shapes it, so a
restarted job does not tokenize again, and it is built once (by global rank 0) and read by every worker.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import time
from itertools import chain
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler

from app.config import DataConfig, Problem

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
COLUMNS_PACKED = ["input_ids", "labels"]
COLUMNS_PADDED = ["input_ids", "attention_mask", "labels"]


def is_local(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or bool(glob.glob(os.path.expanduser(spec)))


# A dataset folder with more entries than this is a mistake (e.g. data.dataset=/), not a dataset: stop walking.
MAX_FOLDER_ENTRIES = 200_000


class TooManyFiles(Exception):
    pass


def _local_files(spec: str) -> list[str]:
    path = Path(os.path.expanduser(spec))
    if not path.is_dir():
        return sorted(glob.glob(os.path.expanduser(spec)))
    found, seen = [], 0
    for folder, _, names in os.walk(path):
        seen += len(names) + 1
        if seen > MAX_FOLDER_ENTRIES:
            raise TooManyFiles(path)
        found += [os.path.join(folder, n) for n in names if Path(n).suffix in LOCAL_BUILDERS]
    return sorted(found)


def _saved_dataset(path: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists())


def check_source(cfg: DataConfig) -> list[Problem]:
    """What can be checked about the data source before any worker starts."""
    if not is_local(cfg.dataset):
        return []  # a hub name: only the run can reach the hub
    if _saved_dataset(Path(os.path.expanduser(cfg.dataset))):
        return []
    try:
        files = _local_files(cfg.dataset)
    except TooManyFiles:
        return [Problem("data.dataset", cfg.dataset, f"the folder holds more than {MAX_FOLDER_ENTRIES:,} files and "
                        "folders: that is not one dataset", "point it at the dataset's own folder, or at a glob of its files")]
    if not files:
        return [Problem("data.dataset", cfg.dataset, "no json/jsonl/csv/parquet/txt files found there", "check the path or glob")]
    kinds = {LOCAL_BUILDERS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) > 1:
        return [Problem("data.dataset", cfg.dataset, f"mixed or unknown file types {sorted(map(str, kinds))}", "point it at files of one type")]
    return []


def load_split(cfg: DataConfig, split: str):
    import datasets

    if is_local(cfg.dataset):
        path = Path(os.path.expanduser(cfg.dataset))
        if _saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                name, _, rest = split.partition("[")
                base = loaded[name]
                return base if not rest else datasets.concatenate_datasets([base]).select(_slice(len(base), rest))
            return loaded
        files = _local_files(cfg.dataset)
        builder = LOCAL_BUILDERS[Path(files[0]).suffix]
        return datasets.load_dataset(builder, data_files={"train": files}, split=split)
    return datasets.load_dataset(cfg.dataset, cfg.config_name, split=split)


def _slice(n: int, spec: str) -> range:
    """`train[a:b]` on a save_to_disk DatasetDict, with the same % syntax as `datasets`."""
    lo, _, hi = spec.rstrip("]").partition(":")

    def pos(text: str, default: int) -> int:
        if not text:
            return default
        return int(n * float(text[:-1]) / 100) if text.endswith("%") else int(text)

    return range(pos(lo, 0), min(pos(hi, n), n))


def cache_key(cfg: DataConfig, tokenizer_name: str, split: str, seed: int) -> str:
    fields = [cfg.dataset, cfg.config_name, split, cfg.text_field, cfg.seq_length, cfg.packing,
              cfg.eval_fraction, cfg.eval_split, tokenizer_name, seed, "v1"]
    return hashlib.sha256(json.dumps(fields, default=str).encode()).hexdigest()[:16]


def tokenize(raw, tokenizer, cfg: DataConfig, num_proc: int | None = None):
    """Token ids and labels. Packed: full seq_length blocks. Padded: labels are -100 on padding."""
    if cfg.text_field not in raw.column_names:
        raise Problem("data.text_field", cfg.text_field, f"no such column; the columns are {raw.column_names}", "set data.text_field")
    eos = tokenizer.eos_token_id
    seq = cfg.seq_length
    num_proc = num_proc or min(8, os.cpu_count() or 1)
    if len(raw) < 4 * num_proc * 1000:
        num_proc = None  # process start-up would cost more than it saves

    if cfg.packing:

        def pack(batch: dict[str, list]) -> dict[str, list]:
            ids = tokenizer(batch[cfg.text_field], add_special_tokens=False)["input_ids"]
            stream = list(chain.from_iterable(doc + [eos] for doc in ids))
            usable = len(stream) // seq * seq
            blocks = [stream[i : i + seq] for i in range(0, usable, seq)]
            return {"input_ids": blocks, "labels": blocks}

        # Large map batches keep the tail that each batch drops small.
        out = raw.map(pack, batched=True, batch_size=4096, remove_columns=raw.column_names, num_proc=num_proc,
                      desc="tokenize+pack")
        out.set_format("torch", columns=COLUMNS_PACKED)
        return out

    def pad(batch: dict[str, list]) -> dict[str, list]:
        enc = tokenizer(batch[cfg.text_field], padding="max_length", truncation=True, max_length=seq)
        enc["labels"] = [
            [tok if keep else -100 for tok, keep in zip(ids, mask)]
            for ids, mask in zip(enc["input_ids"], enc["attention_mask"])
        ]
        return dict(enc)

    out = raw.map(pad, batched=True, remove_columns=raw.column_names, num_proc=num_proc, desc="tokenize+pad")
    out.set_format("torch", columns=COLUMNS_PADDED)
    return out


def prepare(cfg: DataConfig, tokenizer, tokenizer_name: str, cache_dir: Path, seed: int, rank: int, barrier) -> tuple[Any, Any]:
    """(train, eval or None) tokenized datasets, built by global rank 0 into the shared cache."""
    import datasets

    key = cache_key(cfg, tokenizer_name, cfg.split, seed)
    final = cache_dir / f"tokenized-{key}"
    if rank == 0 and not (final / "done").exists():
        raw = load_split(cfg, cfg.split)
        evalset = load_split(cfg, cfg.eval_split) if cfg.eval_split else None
        if cfg.eval_fraction:
            parts = raw.train_test_split(test_size=cfg.eval_fraction, seed=seed)
            raw, evalset = parts["train"], parts["test"]
        parts = {"train": tokenize(raw, tokenizer, cfg, cfg.num_proc)}
        if evalset is not None:
            parts["eval"] = tokenize(evalset, tokenizer, cfg, cfg.num_proc)
        if len(parts["train"]) == 0:
            raise Problem("data.seq_length", cfg.seq_length, "the split yields no training sequence", "use more data or a shorter seq_length")
        tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        datasets.DatasetDict(parts).save_to_disk(str(tmp))
        (tmp / "done").write_text("ok\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    barrier()
    loaded = datasets.load_from_disk(str(final))
    columns = COLUMNS_PACKED if cfg.packing else COLUMNS_PADDED
    for split in loaded:
        loaded[split].set_format("torch", columns=columns)
    return loaded["train"], loaded.get("eval")


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


def make_loader(dataset, micro_batch: int, world: int, rank: int, shuffle: bool, seed: int, workers: int) -> DataLoader:
    sampler = ResumableSampler(dataset, world, rank, shuffle, seed)
    return DataLoader(
        dataset, batch_size=micro_batch, sampler=sampler, drop_last=True, num_workers=workers,
        pin_memory=torch.cuda.is_available(), persistent_workers=False,
        # Its own generator: otherwise each new iterator draws from the global RNG and a resumed run's
        # dropout masks would differ from an uninterrupted run's.
        generator=torch.Generator().manual_seed(seed),
    )


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
