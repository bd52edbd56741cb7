"""Data: the checks of a source before any cluster starts, its loading as `datasets` reads it, and what training
reads: a sampler whose position can be restored mid-epoch, the packed-documents collator, the loaders.

Preparation (render, mask, tokenize, pack) is app.data.pipeline's, on Ray Data, into app.data.store's prepared
dataset; `tokenize` runs the same unit encoder (app.data.encode) in this process, for tests and tools.
"""

from __future__ import annotations

import codecs
import difflib
import functools
import hashlib
import json
import logging
import lzma
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler

from app import chat
from app.config import DataConfig
from app.data.encode import UNIT_ROWS, UnitEncoder, first_row_problem, layout_of, report
from app.data.store import PreparedSplit
from app.data_files import (
    CSV_SEPARATORS,
    LOCAL_BUILDERS,
    TooManyFiles,
    UnknownConfig,
    is_local,
    kind_of,
    open_data,
    reader,
    saved_dataset,
    split_files,
    split_names,
    url_problem,
)
from app.errors import Problem, _short

log = logging.getLogger("finetune")


def check_source(cfg: DataConfig, model=None) -> list[Problem]:
    """What can be checked about the data source before any worker starts: that it exists, and, for local data,
    its columns and a sample of its rows (chat rows rendered with the tokenizer of `model`, a ModelConfig)."""
    if not is_local(cfg.dataset):
        if remote := url_problem("data.dataset", cfg.dataset, cfg.dataset, "the data files"):
            return [remote]
        if looks_like_path(cfg.dataset):
            return [
                Problem(
                    "data.dataset",
                    cfg.dataset,
                    f"no such file or folder (relative paths start at "
                    f"{os.getcwd()}; a hub dataset name has no file suffix and at most one '/')",
                    "check the path",
                )
            ]
        return []  # a hub name: only the run can reach the hub
    if saved_dataset(Path(os.path.expanduser(cfg.dataset))):
        return _saved_problems(cfg, model)
    try:
        by_split = split_files(cfg.dataset, cfg.config_name)
    except UnknownConfig as exc:
        return [config_problem(cfg, *exc.args)]
    except TooManyFiles as exc:
        return [
            Problem(
                "data.dataset",
                cfg.dataset,
                f"the folder holds more than {exc.args[0]:,} files and folders: that is not one dataset",
                "point it at the dataset's own folder, or at a glob of its files",
            )
        ]
    everything = sorted({f for fs in by_split.values() for f in fs})
    if not everything:
        return [
            Problem(
                "data.dataset",
                cfg.dataset,
                f"no {'/'.join(suffix.lstrip('.') for suffix in LOCAL_BUILDERS)} files found there (.gz, .bz2 or .xz "
                "compressed or not)",
                "check the path or glob",
            )
        ]
    if special := [f for f in everything if not os.path.isfile(f)]:  # a FIFO would block the reads for ever
        return [Problem("data.dataset", cfg.dataset, f"{special[0]} is not a file", "point it at data files only")]
    if unknown := [f for f in everything if kind_of(f) is None]:
        return [
            Problem(
                "data.dataset",
                cfg.dataset,
                f"{unknown[0]} is not a data file ({', '.join(LOCAL_BUILDERS)}; .gz, .bz2 or .xz compressed or not)",
                "point it at data files only",
            )
        ]
    if len(kinds := {kind_of(f) for f in everything}) > 1:
        return [
            Problem(
                "data.dataset",
                cfg.dataset,
                f"mixes kinds of files ({', '.join(sorted(map(str, kinds)))}), which `datasets` reads with one reader",
                "point it at files of one kind",
            )
        ]
    kind = kinds.pop()
    # The files of the splits this run reads (a folder's test split is not sampled for its training split).
    files = [f for name in _splits_read(cfg) for f in by_split.get(name, [])] or everything
    chat_problems = _chat_sample_problems(cfg, files, kind, model)
    return _sample_problems(cfg, files, kind) if chat_problems is None else chat_problems


def config_problem(cfg: DataConfig, asked: str | None, listed: list[str]) -> Problem:
    if not listed:
        return Problem(
            "data.config_name",
            asked,
            f"names a config of a hub dataset or of a folder's dataset card (README.md); {cfg.dataset} has none",
            "remove data.config_name",
        )
    card = Path(os.path.expanduser(cfg.dataset)) / "README.md"
    if asked is None:
        return Problem(
            "data.config_name",
            None,
            f"{card} lists configs {listed} and marks none default",
            "set data.config_name to one of them",
        )
    guess = difflib.get_close_matches(asked, listed, n=1)
    fix = f"did you mean '{guess[0]}'?" if guess else f"use one of {listed}"
    return Problem("data.config_name", asked, f"no such config in {card}; it lists {listed}", fix)


def _splits_read(cfg: DataConfig) -> list[str]:
    return split_names(cfg.split) + (split_names(cfg.eval_split) if cfg.eval_split else [])


def _tokenizer_of(model):
    from app.model import load_tokenizer

    return lambda: load_tokenizer(model)


def _chat_sample_problems(cfg: DataConfig, files: list[str], kind: str, model) -> list[Problem] | None:
    """The chat or prompt/completion checks of the sampled rows (app.chat); None when the data is text."""
    first = next((f for f in files[:SAMPLE_FILES] if os.path.getsize(f)), None)
    if first is None or kind == "text":
        return None
    try:
        columns = _read_sample(first, kind, "messages")[0]
    except ValueError:
        return None  # the text checks name the unreadable file
    fmt = chat.resolve_format(cfg.format, columns or [], cfg.text_field)
    if fmt == "text" or columns is None:
        return None
    rows = []
    for file in files[:SAMPLE_FILES]:
        if not os.path.getsize(file):
            continue
        try:
            columns, *_ = _read_sample(file, kind, "messages")
            values = {c: _read_sample(file, kind, c)[1] for c in (*chat.columns_read(fmt), chat.TOOLS) if c in columns}
        except ValueError as exc:
            return [Problem("data.dataset", file, f"cannot be read as {kind}: {str(exc)[:200]}", "fix the file")]
        turns = chat.COLUMNS[fmt] + ((chat.INSTRUCTION,) if fmt == "chat" else ())
        if not set(values) & set(turns):
            return [
                Problem(
                    "data.format",
                    cfg.format,
                    f"{file} has no column {' or '.join(map(repr, turns))}; its columns are {columns}",
                    "set data.format to the format of the data (text reads data.text_field)",
                )
            ]
        places = _row_places(file) if kind in ("json", "parquet") else []
        count = max(len(v) for v in values.values())
        for n in range(count):
            where = f"{file} {places[n]}" if n < len(places) else f"{file} row {n + 1}"
            rows.append((where, {c: v[n] if n < len(v) else None for c, v in values.items()}))
    return chat.sample_problems(cfg, fmt, rows, _tokenizer_of(model))


def looks_like_path(spec: str) -> bool:
    """A hub dataset is 'name' or 'owner/name': a data file's suffix, a glob character or a second '/' make a path."""
    return kind_of(spec) is not None or any(c in spec for c in "*?[") or spec.count("/") > 1


# --- what a sample of local data shows ---------------------------------------------------------------------
SAMPLE_ROWS = 1000
SAMPLE_BYTES = 8 << 20
SAMPLE_FILES = 16


def _sample_problems(cfg: DataConfig, files: list[str], kind: str) -> list[Problem]:
    """Columns and text of the first rows of (up to SAMPLE_FILES of) the files, read as `datasets` will read them."""
    field, usable, whole, sampled, looked = cfg.text_field, 0, len(files) <= SAMPLE_FILES, 0, 0
    for file in files[:SAMPLE_FILES]:
        if os.path.getsize(file) == 0:
            continue  # `datasets` reads an empty file among others as no rows; all of them empty is refused below
        try:
            columns, values, complete = _read_sample(file, kind, field)
        except ValueError as exc:
            return [
                Problem(
                    "data.dataset",
                    file,
                    f"cannot be read as {kind}: {str(exc).splitlines()[0][:200]}",
                    f"fix the file, or point data.dataset at {kind} files",
                )
            ]
        if columns is None:  # a large JSON array: no cheap sample
            whole = False
            continue
        sampled += 1
        if field not in columns:
            names = [str(c) for c in columns]
            guess = difflib.get_close_matches(field, names, n=1) or names[: len(names) == 1]
            fix = f"did you mean '{guess[0]}'?" if guess else "set data.text_field to the column with the text"
            return [Problem("data.text_field", field, f"no such column in {file}; its columns are {names}", fix)]
        wrong = next((v for v in values if v is not None and not isinstance(v, str)), None)
        if wrong is not None:
            return [
                Problem(
                    "data.text_field",
                    field,
                    f"column '{field}' of {file} holds {type(wrong).__name__} values (e.g. {_short(wrong)}), not text",
                    "set data.text_field to the column that holds the text",
                )
            ]
        usable += sum(1 for v in values if v is not None and v.strip())
        looked += len(values)
        whole = whole and complete
    if sampled == 0 and whole:
        return [
            Problem(
                "data.dataset",
                cfg.dataset,
                "is empty" if len(files) == 1 else "every file is empty",
                "point it at your data",
            )
        ]
    if usable == 0 and (whole or looked):
        where = "no row of" if whole else f"none of the first {looked:,} rows read (of {sampled} file(s)) of"
        return [
            Problem(
                "data.text_field",
                field,
                f"{where} {cfg.dataset} has text in column '{field}' (every value is empty or null)",
                "point data.dataset at data with text, or set data.text_field"
                + ("" if whole else "; when text comes only further down, shuffle the file so that it comes early"),
            )
        ]
    return []


def _read_sample(file: str, kind: str, field: str) -> tuple[list | None, list, bool]:
    """(columns, the text field's values in the first rows, whether that is the whole file)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(file)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises its own types for a damaged file
            raise ValueError(str(exc)) from None
        columns = pf.schema_arrow.names
        batch = next(pf.iter_batches(batch_size=SAMPLE_ROWS, columns=[field]), None) if field in columns else None
        values = batch.column(0).to_pylist() if batch is not None else []
        return columns, values, pf.metadata.num_rows <= SAMPLE_ROWS
    if kind in CSV_SEPARATORS:
        import pandas as pd

        try:
            frame = pd.read_csv(file, nrows=SAMPLE_ROWS, sep=CSV_SEPARATORS[kind])  # what `datasets`' csv builder uses
        except pd.errors.EmptyDataError:
            return [], [], True
        except (pd.errors.ParserError, UnicodeDecodeError) as exc:
            raise ValueError(str(exc)) from None
        values = [None if pd.isna(v) else v for v in frame[field]] if field in frame.columns else []
        values = [v.item() if hasattr(v, "item") else v for v in values]  # numpy scalars: report the plain type
        return list(frame.columns), values, len(frame) < SAMPLE_ROWS
    raw = _head(file)
    complete = len(raw) < SAMPLE_BYTES
    mark = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0  # Windows editors write one; no text
    try:
        text = raw[mark:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = mark + exc.start
        if complete or at < len(raw) - 4:  # not just a character cut by the sample's end
            raise ValueError(f"not UTF-8 text (byte 0x{raw[at]:02x} at offset {at})") from None
        text = raw[mark:at].decode("utf-8")
    lines = text.splitlines() if complete else text.splitlines()[:-1]
    if kind == "text":
        return ["text"], lines[:SAMPLE_ROWS], complete and len(lines) <= SAMPLE_ROWS
    return _json_sample(text, lines, complete, field)


def _head(file: str) -> bytes:
    """The first SAMPLE_BYTES of the file's data, decompressed."""
    try:
        with open_data(file) as f:
            return f.read(SAMPLE_BYTES)
    except (EOFError, OSError, lzma.LZMAError) as exc:  # gzip's BadGzipFile is an OSError
        raise ValueError(f"cannot be decompressed ({exc})") from None


def _json_sample(text: str, lines: list[str], complete: bool, field: str) -> tuple[list | None, list, bool]:
    rows = [line for line in lines if line.strip()]
    if not rows:
        return [], [], complete
    try:
        first = json.loads(rows[0])
    except ValueError:
        first = None
    if isinstance(first, dict):  # JSON Lines
        records = []
        for n, line in enumerate(rows[:SAMPLE_ROWS]):
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"line {n + 1} is not JSON ({exc})") from None
            if not isinstance(record, dict):
                raise ValueError(f"line {n + 1} is not a JSON object")
            records.append(record)
        columns = list(dict.fromkeys(k for r in records for k in r))
        return columns, [r.get(field) for r in records], complete and len(rows) <= SAMPLE_ROWS
    if not complete:
        return None, [], False
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"neither JSON Lines nor one JSON document ({exc})") from None
    if isinstance(doc, list) and all(isinstance(r, dict) for r in doc):
        columns = list(dict.fromkeys(k for r in doc for k in r))
        return columns, [r.get(field) for r in doc[:SAMPLE_ROWS]], len(doc) <= SAMPLE_ROWS
    if isinstance(doc, dict) and all(isinstance(v, list) for v in doc.values()):  # columns
        return list(doc), list(doc.get(field, []))[:SAMPLE_ROWS], True
    raise ValueError("a JSON document must be a list of objects or an object of column lists")


def _saved_problems(cfg: DataConfig, model=None) -> list[Problem]:
    import datasets

    try:
        loaded = datasets.load_from_disk(os.path.expanduser(cfg.dataset))
    except Exception as exc:  # noqa: BLE001 - a damaged folder raises many types
        return [
            Problem(
                "data.dataset",
                cfg.dataset,
                f"cannot be loaded ({type(exc).__name__})",
                "point it at a save_to_disk folder",
            )
        ]
    if isinstance(loaded, datasets.DatasetDict):
        name = cfg.split.partition("[")[0]
        if name not in loaded:
            return [Problem("data.split", cfg.split, f"no split '{name}'; it has {list(loaded)}", "use one of them")]
        loaded = loaded[name]
    if (fmt := chat.resolve_format(cfg.format, loaded.column_names, cfg.text_field)) != "text":
        sample = loaded.select(range(min(len(loaded), SAMPLE_ROWS))).to_list()
        rows = [(f"row {n + 1} of {cfg.dataset}", row) for n, row in enumerate(sample)]
        return chat.sample_problems(cfg, fmt, rows, _tokenizer_of(model))
    field = cfg.text_field
    if field not in loaded.column_names:
        return [
            Problem(
                "data.text_field",
                field,
                f"no such column; the columns are {loaded.column_names}",
                "set data.text_field to the column with the text",
            )
        ]
    if getattr(loaded.features[field], "dtype", None) not in ("string", "large_string"):
        return [
            Problem(
                "data.text_field",
                field,
                f"column '{field}' holds {loaded.features[field]}, not text",
                "set data.text_field to the column that holds the text",
            )
        ]
    if len(loaded) <= SAMPLE_ROWS and not any(v and v.strip() for v in loaded[field]):
        return [
            Problem(
                "data.text_field", field, f"no row has text in column '{field}'", "point data.dataset at data with text"
            )
        ]
    return []


def load_split(cfg: DataConfig, split: str):
    import datasets

    if is_local(cfg.dataset):
        path = Path(os.path.expanduser(cfg.dataset))
        if saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                name, _, rest = split.partition("[")
                base = loaded[name]
                return base if not rest else datasets.concatenate_datasets([base]).select(_slice(len(base), rest))
            return loaded
        by_split = split_files(cfg.dataset, cfg.config_name)
        # Only the splits read: datasets converts every split it is given (a folder's test split too).
        given = {name: by_split[name] for name in split_names(split) if name in by_split} or by_split
        files = [f for fs in given.values() for f in fs]
        builder, options = reader(kind_of(files[0]))
        try:
            return datasets.load_dataset(builder, data_files=given, split=split, **options)
        except Exception as exc:  # noqa: BLE001 - a bad row beyond the sample validate read: say where it is
            raise unreadable_data(files, builder, exc) from None
    return datasets.load_dataset(cfg.dataset, cfg.config_name, split=split)


def unreadable_data(files: list[str], builder: str, exc: BaseException) -> Problem:
    """The file and line that `datasets` could not read, as one Problem (its own error names a row of a batch)."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    reason = (str(root).strip().splitlines() or [type(root).__name__])[0][:200]
    if builder == "json":
        for file in files:
            with open_data(file) as f:
                for number, line in enumerate(f, 1):
                    line = line.removeprefix(codecs.BOM_UTF8)
                    if not line.strip():
                        continue
                    try:
                        if isinstance(json.loads(line), dict):
                            continue
                        reason = "not a JSON object"
                    except ValueError as err:
                        reason = f"not JSON: {err}"
                    if number == 1 and line.lstrip().startswith(b"["):
                        break  # one JSON document, not JSON Lines: `datasets`' own reason stands
                    return Problem("data.dataset", file, f"line {number} is {reason}", "fix or remove that line")
    return Problem("data.dataset", files[0] if len(files) == 1 else files, f"cannot be read: {reason}", "fix the file")


def _slice(n: int, spec: str) -> range:
    """`train[a:b]` on a save_to_disk DatasetDict, with the same % syntax as `datasets`."""
    lo, _, hi = spec.rstrip("]").partition(":")

    def pos(text: str, default: int) -> int:
        if not text:
            return default
        return int(n * float(text[:-1]) / 100) if text.endswith("%") else int(text)

    return range(pos(lo, 0), min(pos(hi, n), n))


def row_location(dataset: str, split: str | None, index: int, config: str | None = None) -> str:
    """Where row `index` of a split comes from, for error messages: 'FILE line N' (JSON Lines) or 'FILE row N'
    (parquet) for local files, else its place in the split. Read only when a row is refused."""
    fallback = f"row {index + 1} of split {split}" if split else f"row {index + 1}"
    if split is None or not is_local(dataset) or saved_dataset(Path(os.path.expanduser(dataset))):
        return fallback
    files = split_files(dataset, config).get(split_names(split)[0], [])
    if not files or kind_of(files[0]) not in ("json", "parquet"):
        return fallback
    places = [(file, place) for file in files for place in _row_places(file)]
    rest = split.split("+")[0].partition("[")[2]
    index += _slice(len(places), rest).start if rest else 0
    return f"{places[index][0]} {places[index][1]}" if index < len(places) else fallback


def _row_places(file: str) -> list[str]:
    if file.endswith(".parquet"):
        import pyarrow.parquet as pq

        return [f"row {n + 1}" for n in range(pq.ParquetFile(file).metadata.num_rows)]
    with open_data(file) as f:
        return [f"line {n + 1}" for n, line in enumerate(f) if line.strip()]


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


def format_of(cfg: DataConfig, columns: list[str]) -> str:
    """The format data.format means for rows with these columns (app.chat.resolve_format); text rows without
    data.text_field are refused."""
    fmt = chat.resolve_format(cfg.format, columns, cfg.text_field)
    if fmt == "text" and cfg.text_field not in columns:
        raise Problem(
            "data.text_field",
            cfg.text_field,
            f"no such column in {cfg.dataset}; the columns are {columns}",
            "set data.text_field",
        )
    return fmt


def tokenize(raw, tokenizer, cfg: DataConfig) -> PreparedSplit:
    """The blocks of `raw` (rows as `datasets` loaded them) in this process, as preparation makes them (app.data.encode,
    unit by unit): packed text in full seq_length blocks; padded rows with labels -100 on padding; chat and
    prompt/completion rows with labels on the assistant turns or the completion."""
    fmt = format_of(cfg, raw.column_names)
    if fmt != "text" and chat.ROW not in raw.column_names:
        raw = raw.add_column(chat.ROW, list(range(len(raw))))
    locate = functools.partial(row_location, cfg.dataset, cfg.split, config=cfg.config_name)
    if len(raw) and (problem := first_row_problem(cfg, fmt, raw[0], tokenizer, locate)):
        raise problem
    encoder = UnitEncoder(cfg, fmt, tokenizer, locate)
    units = [encoder(raw[lo : lo + UNIT_ROWS]) for lo in range(0, len(raw), UNIT_ROWS)]
    report({c: sum(u.counts.get(c, 0) for u in units) for c in units[0].counts} if units else {}, "training", cfg)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    layout = layout_of(fmt, cfg.packing)
    return PreparedSplit.in_memory(
        layout, cfg.seq_length, pad, [u.arrays() for u in units], [u.counts["blocks"] for u in units]
    )


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
        # Packed conversations (app.chat) carry their position ids: each conversation starts at 0.
        starts = torch.stack([r["position_ids"] for r in rows]) == 0 if "position_ids" in rows[0] else None
        return packed_batch(
            torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows]), self.eos_id, starts
        )


def collator(cfg: DataConfig, tokenizer) -> PackedCollator | None:
    """The collate_fn for this data config: None (torch's default) unless packed documents are kept apart."""
    return PackedCollator(tokenizer.eos_token_id) if cfg.packing and cfg.separate_documents else None


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
    evaluated (the training loader's drop_last would give it no batch at all)."""

    def __init__(self, dataset, world: int, rank: int):
        self.dataset, self.n = dataset, len(dataset)
        self.positions = list(range(rank, -(-self.n // world) * world, world))

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i: int) -> dict[str, Any]:
        position = self.positions[i]
        sample = self.dataset[position % self.n]
        if position >= self.n:
            sample = {**sample, "labels": torch.full_like(sample["labels"], -100)}
        return sample


def make_eval_loader(dataset, micro_batch: int, world: int, rank: int, collate_fn=None) -> DataLoader:
    shard = EvalShard(dataset, world, rank)
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
