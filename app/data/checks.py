"""The checks of a data source before any cluster starts: its files, splits and columns, and a sample of its rows
(the first SAMPLE_ROWS of each file) read and, for chat data, rendered and masked as preparation will, so that bad
input is one line naming the field, the value and the fix. Only where the sample has no answer to train on are the
rest of the rows read (every_row), up to the first that has one.
"""

from __future__ import annotations

import codecs
import difflib
import json
import logging
import lzma
import os
from pathlib import Path
from typing import Any, Iterator

from app.config import DataConfig
from app.data import chat, pairs
from app.data.files import (
    CSV_SEPARATORS,
    LOCAL_BUILDERS,
    TooManyFiles,
    UnknownConfig,
    is_local,
    kind_of,
    open_data,
    saved_dataset,
    split_files,
    split_names,
    url_problem,
)
from app.data.sources import _row_places
from app.errors import Problem, _short

log = logging.getLogger("finetune")


def check_source(cfg: DataConfig, model=None, preference: bool | None = None) -> list[Problem]:
    """What can be checked about the data source before any worker starts: that it exists, and, for local data,
    its columns and a sample of its rows (chat rows rendered with the tokenizer of `model`, a ModelConfig); with
    `preference` (whether the training config has one; None: not checked), that the data is what it trains on."""
    if preference is not None and not is_local(cfg.dataset) and cfg.format != "auto":
        if found := pairs.format_problems(cfg, cfg.format, preference):  # a hub dataset's own columns: in the run
            return found
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
        return _saved_problems(cfg, model, preference)
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
    chat_problems = _chat_sample_problems(cfg, files, kind, model, preference)
    if chat_problems is None and preference:  # text: no pairs
        return pairs.format_problems(cfg, "text", preference)
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


def _chat_sample_problems(
    cfg: DataConfig, files: list[str], kind: str, model, preference: bool | None = None
) -> list[Problem] | None:
    """The chat, prompt/completion or preference checks of the sampled rows (app.data.chat, app.data.pairs); None
    when the data is text."""
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
    if preference is not None and (found := pairs.format_problems(cfg, fmt, preference)):
        return found
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
    return rows_problems(cfg, fmt, rows, _tokenizer_of(model), lambda: every_row(files, kind))


def rows_problems(cfg: DataConfig, fmt: str, rows: list, tokenizer_of, every_row=None) -> list[Problem]:
    """The sampled rows' problems, by the format's own checks (`every_row()`: all the rows, for a check that must
    look past the sample)."""
    if fmt == "preference":
        return pairs.sample_problems(cfg, rows, tokenizer_of)
    return chat.sample_problems(cfg, fmt, rows, tokenizer_of, every_row)


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


def _saved_problems(cfg: DataConfig, model=None, preference: bool | None = None) -> list[Problem]:
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
    fmt = chat.resolve_format(cfg.format, loaded.column_names, cfg.text_field)
    if preference is not None and (found := pairs.format_problems(cfg, fmt, preference)):
        return found
    if fmt != "text":
        sample = loaded.select(range(min(len(loaded), SAMPLE_ROWS))).to_list()
        rows = [(f"row {n + 1} of {cfg.dataset}", row) for n, row in enumerate(sample)]
        return rows_problems(cfg, fmt, rows, _tokenizer_of(model), lambda: iter(loaded))
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


# --- past the sample, on a check's error path only ------------------------------------------------------------------
def every_row(files: list[str], kind: str) -> Iterator[dict[str, Any]]:
    """Every row of the files, in order, as plain records: for a check that the sample cannot settle (no sampled
    row has an answer), read lazily so that it stops at the first row that settles it. Read simply, not as
    `datasets` types it: only whether a value holds text matters here, and a line or file that cannot be read is
    skipped (the sample or the preparation names it)."""
    for file in files:
        if not os.path.getsize(file):
            continue
        try:
            yield from _records(file, kind)
        except Exception:  # noqa: BLE001 - a damaged file raises many types (pyarrow's, pandas', lzma's)
            continue


def _records(file: str, kind: str) -> Iterator[dict[str, Any]]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(file).iter_batches(batch_size=SAMPLE_ROWS):
            yield from batch.to_pylist()
    elif kind in CSV_SEPARATORS:
        import pandas as pd

        for frame in pd.read_csv(file, sep=CSV_SEPARATORS[kind], chunksize=10_000):
            yield from frame.astype(object).where(frame.notna(), None).to_dict("records")
    elif kind == "json":
        yield from _json_records(file)


def _json_records(file: str) -> Iterator[dict[str, Any]]:
    """JSON Lines' objects line by line; a file whose first line is no object (one JSON document: a list of
    objects, or an object of column lists), loaded whole."""
    lines = False
    with open_data(file) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                lines = True
                yield record
            elif not lines:
                break
    if lines:
        return
    with open_data(file) as f:
        doc = json.load(f)
    if isinstance(doc, list):
        yield from (r for r in doc if isinstance(r, dict))
    elif isinstance(doc, dict) and all(isinstance(c, list) for c in doc.values()):
        yield from (dict(zip(doc, values)) for values in zip(*doc.values()))
