"""A split read by row range: the driver counts each file's rows (a Ray task a file: parquet's metadata, a JSON
Lines or text file's lines, an Arrow file's record batches) and plans units as (file, rows) descriptors; the actor
that encodes a unit reads its own rows, so no row passes through the driver or the object store.

Read this way: local JSON Lines (.json, .jsonl, .ndjson), plain-text (.txt, app.data.textrows), parquet and csv/tsv
files, the JSON Lines, text and csv/tsv ones compressed (.gz, .bz2, .xz) or not, split and sliced as `datasets` does
(`train[:10%]+validation`, by datasets' own ReadInstruction); save_to_disk folders (app.data.saved); and any of them
with data.eval_fraction held out and a mixture's choice applied to the planned row numbers (app.data.pipeline). The
rows are the values `datasets` gives: parquet is cast to its first file's features, JSON Lines parsed against the
schema `datasets` infers from the split's first chunk (10 MB of its first file) and cast as datasets casts later
chunks, text is a `text` column of strings, csv/tsv are parsed by pandas in datasets' chunks and cast to the split's
first chunk's types. A csv/tsv file cannot be parsed a unit at a time (a row's values depend on the first chunk's
types, which only parsing from the file's start gives): its count is one Ray task that parses it whole as `datasets`
does and writes it as an Arrow file in the preparation's temporary folder (app.data.csvrows), whose rows the units
read (plan's scratch; without one, csv/tsv is left to `datasets`). A compressed file cannot be seeked: its count is
one Ray task that decompresses it whole, and each unit decompresses it up to its own rows (skipping what comes
before unparsed), so a unit's rows, and so its bytes, are those of the uncompressed file whatever the parallelism;
an actor keeps the file open where its last unit ended (app.data.files.lines_from), so the run of consecutive units
Ray Data gives it decompresses the file once, and only a unit behind the handle starts from the file's start again.
(Whole-file units would have cut the split elsewhere than every 4,096 rows: other packing groups, other bytes.)
Left to `datasets` in the driver (app.data.sources.load_split), each for a reason: hub names (no local files to
count: the hub's download and cache are `datasets`' own), a save_to_disk folder saved with a format or read with
several splits, a file that is one JSON document or whose first chunk `datasets` would re-encode as JSON strings
(mixed struct types), csv/tsv splits read together whose first chunks' types differ.
"""

from __future__ import annotations

import codecs
import io
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.config import DataConfig
from app.data import chat, csvrows, saved, textrows
from app.data.files import (
    CSV_SEPARATORS,
    is_local,
    kind_of,
    lines_from,
    open_data,
    saved_dataset,
    split_files,
    split_names,
)
from app.errors import Problem

STRIDE = 1024  # a JSON Lines or text file's rows between two anchors (row, byte offset, line) its count records
PARQUET_BATCH = 1024  # rows decoded at a time from a parquet row group, up to a unit's last row
JSON_CHUNK = 10 << 20  # datasets' json chunksize: its first chunk's schema is the split's


@dataclass
class FileRows:
    """A data file's row count and, for JSON Lines and text, an anchor every STRIDE rows: (row, byte offset, line
    number) of a line at or before that row (byte offsets of the uncompressed bytes)."""

    file: str
    kind: str
    rows: int
    anchors: list[tuple[int, int, int]]
    origin: str = ""  # a csv/tsv file's own path (`file` is its rows converted to Arrow: app.data.csvrows)


def count(file: str, kind: str) -> FileRows:
    if kind == "parquet":
        import pyarrow.parquet as pq

        return FileRows(file, kind, pq.ParquetFile(file).metadata.num_rows, [])
    if kind == "arrow":
        return FileRows(file, kind, saved.count(file), [])
    if kind == "text":
        return FileRows(file, kind, *textrows.count(file, STRIDE))
    rows, offset, anchors = 0, 0, []
    with open_data(file) as f:
        for number, line in enumerate(f, 1):
            if line.strip():  # pyarrow (so datasets) skips blank lines: they are no row
                if rows % STRIDE == 0:
                    anchors.append((rows, offset, number))
                rows += 1
            offset += len(line)
    return FileRows(file, kind, rows, anchors)


def schema_of(first: str, kind: str):
    """The split's Arrow schema as `datasets` makes it, or None where datasets would read the file another way."""
    import pyarrow as pa
    from datasets import Features

    if kind == "parquet":
        import pyarrow.parquet as pq

        return Features.from_arrow_schema(pq.read_schema(first)).arrow_schema
    if kind == "arrow":
        return saved.schema_of(first)
    if kind == "text":
        return pa.schema([("text", pa.string())])  # the text builder's one column, without features
    import pyarrow.json as paj
    from datasets.utils.json import find_mixed_struct_types_field_paths

    with open_data(first) as f:  # datasets' first batch: a chunk, then the rest of its last line
        batch = f.read(JSON_CHUNK)
        batch = batch.removeprefix(codecs.BOM_UTF8) + f.readline()
    if batch.lstrip().startswith(b"["):
        return None
    try:  # datasets' check for mixed struct types, skipped as it skips it (a blank line makes it raise)
        examples = [json.loads(line) for line in batch.splitlines()]
    except ValueError:
        examples = []
    if find_mixed_struct_types_field_paths(examples):
        return None  # datasets would read those fields as JSON text
    block = max(JSON_CHUNK // 32, 16 << 10)
    block = len(batch) if len(batch) // 8 > block else block  # datasets' block size, which the inference sees
    while True:
        try:
            table = paj.read_json(io.BytesIO(batch), read_options=paj.ReadOptions(block_size=block))
            break
        except pa.ArrowInvalid as exc:
            if "straddling" not in str(exc) or block >= len(batch):
                return None  # datasets' own reading says what is wrong with it
            block *= 2
    return Features.from_arrow_schema(table.schema).arrow_schema


def survey(file: str, kind: str, first: bool) -> tuple[FileRows | None, Any]:
    """A file's count and, for the split's first file, the split's schema (one Ray task a file); (None, None) for a
    file it cannot read (damaged, not the compression its name says), which `datasets` then reads and names."""
    import lzma
    import zlib

    import pyarrow as pa

    try:
        return count(file, kind), schema_of(file, kind) if first else None
    except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error, pa.ArrowException):
        return None, None


def _remote(fn, calls: list[tuple]) -> list:
    """fn over calls: Ray tasks on the cluster when one is up (the files are read there, not in the driver), else
    here."""
    try:
        import ray
    except ImportError:
        ray = None
    if ray is None or not ray.is_initialized():
        return [fn(*call) for call in calls]
    task = ray.remote(num_cpus=1)(fn)
    return ray.get([task.remote(*call) for call in calls])


def plan(d: DataConfig, expression: str, scratch: Path | None = None) -> Ranged | None:
    """The split `expression` of a source as a Ranged, counted by Ray tasks; None for what `datasets` reads. csv/tsv
    files are converted to Arrow files under `scratch` (the preparation's temporary folder), read by datasets
    without one."""
    if not is_local(d.dataset):
        return None
    path = Path(os.path.expanduser(d.dataset))
    if saved_dataset(path):
        return _plan_saved(path, expression)
    by_split = split_files(d.dataset, d.config_name)
    names = split_names(expression)
    if any(name not in by_split for name in names):
        return None  # datasets' own reading names what is missing
    given = {name: by_split[name] for name in names}
    files = [f for fs in given.values() for f in fs]
    kinds = {kind_of(f) for f in files}
    if not files or len(kinds) != 1 or kinds - {"json", "parquet", "text", *CSV_SEPARATORS}:
        return None
    kind = kinds.pop()
    if kind in CSV_SEPARATORS:
        return _plan_csv(given, kind, expression, scratch) if scratch is not None else None
    surveyed = _remote(survey, [(f, kind, n == 0) for n, f in enumerate(files)])
    counted, schema = [c for c, _ in surveyed], surveyed[0][1]
    if schema is None or None in counted:
        return None
    return _ranged(given, dict(zip(files, counted)), schema, expression)


def _ranged(given: dict[str, list[str]], by_file: dict[str, FileRows], schema, expression: str) -> Ranged | None:
    """The split expression over these splits' counted files (by_file: each file's count, by its name)."""
    from datasets.arrow_reader import ReadInstruction

    sizes = {name: sum(by_file[f].rows for f in fs) for name, fs in given.items()}
    try:
        instructions = ReadInstruction.from_spec(expression).to_absolute(sizes)
    except (ValueError, KeyError):
        return None  # datasets' own reading refuses it with its message
    spans = []  # (file, first row, end row) in the split's order
    for ins in instructions:
        spans += _spans([by_file[f] for f in given[ins.splitname]], ins.from_, ins.to)
    return Ranged(list(by_file.values()), schema, spans)


def _plan_csv(given: dict[str, list[str]], kind: str, expression: str, scratch: Path) -> Ranged | None:
    """csv/tsv files (app.data.csvrows): each split's schema from its first chunk (one Ray task a split; splits of
    other schemas are left to `datasets`), then each file converted to an Arrow file under `scratch` by a Ray task;
    a file that cannot be read ends the preparation with its name."""
    opts = csvrows.options(kind)
    firsts = _remote(csvrows.first_schema, [(fs, opts) for fs in given.values()])
    for _, file, reason in firsts:
        if file is not None:
            raise Problem("data.dataset", file, f"cannot be read: {reason}", "fix the file")
    schema = firsts[0][0]
    if schema is None or any(s is None or not s.equals(schema) for s, _, _ in firsts):
        return None  # no row at all, or splits read together whose schemas differ: datasets' own reading
    files = list(dict.fromkeys(f for fs in given.values() for f in fs))
    outs = [str(scratch / f"{uuid.uuid4().hex[:12]}-{n}.arrow") for n in range(len(files))]
    converted = _remote(csvrows.convert, [(f, opts, schema, out) for f, out in zip(files, outs)])
    for file, (_, reason) in zip(files, converted):
        if reason is not None:
            raise Problem("data.dataset", file, f"cannot be read: {reason}", "fix the file")
    by_file = {f: FileRows(out, "csv", rows, [], f) for f, out, (rows, _) in zip(files, outs, converted)}
    return _ranged(given, by_file, schema, expression)


def _spans(files: list[FileRows], lo: int, hi: int) -> list[tuple[str, int, int]]:
    """(file, first row, end row) of the rows lo..hi of these files one after the other."""
    spans, start = [], 0
    for f in files:
        if min(hi, start + f.rows) > max(lo, start):
            spans.append((f.file, max(lo, start) - start, min(hi, start + f.rows) - start))
        start += f.rows
    return spans


def _plan_saved(path: Path, expression: str) -> Ranged | None:
    """A save_to_disk folder's split (app.data.saved): its Arrow files counted by Ray tasks, sliced as
    app.data.sources.load_split slices a saved DatasetDict's split."""
    found = saved.folder_of(path, expression)
    if found is None:
        return None
    folder, rest = found
    files = saved.files_of(folder)
    surveyed = _remote(survey, [(f, "arrow", n == 0) for n, f in enumerate(files)])
    counted, schema = [c for c, _ in surveyed], surveyed[0][1]
    if schema is None or None in counted:
        return None
    from app.data.sources import slice_of

    total = sum(c.rows for c in counted)
    rows = slice_of(total, rest) if rest else range(total)
    return Ranged(counted, schema, _spans(counted, rows.start, rows.stop))


class Ranged:
    """A split's rows as spans of files (`datasets`' order), and which of them a unit takes (index: split indices,
    ascending, or all); len, select and column_names as a `datasets` Dataset has them for app.data.pipeline."""

    def __init__(self, files: list[FileRows], schema, spans: list[tuple[str, int, int]], index=None):
        self.files, self.schema, self.spans, self.index = files, schema, spans, index
        self.starts = np.cumsum([0] + [hi - lo for _, lo, hi in spans])
        self.numbered = False  # chat.ROW (the split index) added to each row, as pipeline.read_source adds it

    def __len__(self) -> int:
        return int(self.starts[-1]) if self.index is None else len(self.index)

    @property
    def column_names(self) -> list[str]:
        return list(self.schema.names) + ([chat.ROW] if self.numbered else [])

    def select(self, indices) -> Ranged:
        chosen = np.asarray(indices, dtype=np.int64)
        out = Ranged(self.files, self.schema, self.spans, chosen if self.index is None else self.index[chosen])
        out.numbered = self.numbered
        return out

    def unit(self, rows: slice) -> dict[str, Any]:
        """These rows of this selection as a descriptor: {numbers: split indices, parts: [{file, kind, rows,
        anchor}]}, each part rows of one file."""
        numbers = np.arange(len(self))[rows] if self.index is None else self.index[rows]
        span = np.searchsorted(self.starts, numbers, side="right") - 1
        parts: list[dict[str, Any]] = []
        counted = {f.file: f for f in self.files}
        # Runs of rows from one span (vectorized: a split of millions of rows is planned in the driver).
        for run in np.split(np.arange(len(numbers)), np.flatnonzero(np.diff(span)) + 1) if len(numbers) else []:
            s = int(span[run[0]])
            file, first, _ = self.spans[s]
            found = first + numbers[run] - int(self.starts[s])
            anchors = counted[file].anchors
            parts.append(
                {
                    "file": file,
                    "kind": counted[file].kind,
                    "rows": compact(found),
                    "anchor": anchors[int(found[0]) // STRIDE] if anchors else None,
                    "origin": counted[file].origin,
                }
            )
        return {"numbers": compact(numbers), "numbered": self.numbered, "parts": parts}

    def row(self, i: int) -> dict[str, Any]:
        """Row i of this selection, read from its file (the driver's one row, for app.data.encode.first_row_problem)."""
        rows, _ = read(self.unit(slice(i, i + 1)), self.schema)
        return {name: values[0] for name, values in rows.items()}


def compact(rows: np.ndarray) -> dict[str, int] | list[int]:
    """Ascending row numbers as {first, end} when they are consecutive (a unit of a whole split: a descriptor of a
    few bytes), else each of them (a mixture's choice)."""
    if len(rows) and int(rows[-1]) - int(rows[0]) == len(rows) - 1:
        return {"first": int(rows[0]), "end": int(rows[-1]) + 1}
    return rows.tolist()


def expand(rows: dict[str, int] | list[int]) -> list[int]:
    return list(range(rows["first"], rows["end"])) if isinstance(rows, dict) else rows


def read(unit: dict[str, Any], schema) -> tuple[dict[str, list], list[str]]:
    """A unit's rows (columns of Python values, chat.ROW added where numbered) and where each came from."""
    import pyarrow as pa

    tables, places = [], []
    for part in unit["parts"]:
        table, where = READERS[part["kind"]](part, schema)
        tables.append(table)
        places += where
    rows = pa.concat_tables(tables).to_pydict() if tables else {name: [] for name in schema.names}
    if unit["numbered"]:
        rows[chat.ROW] = expand(unit["numbers"])
    return rows, places


def _parquet(part: dict[str, Any], schema):
    """The part's rows of a parquet file, decoded batch by batch from the first row group that holds one, up to the
    last (a row group may hold many units' rows: this unit decodes no further than its own)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.table import table_cast

    wanted, found = expand(part["rows"]), pq.ParquetFile(part["file"])
    groups, base, start = [], None, 0
    for g in range(found.metadata.num_row_groups):
        n = found.metadata.row_group(g).num_rows
        if start + n > wanted[0] and start <= wanted[-1]:
            groups.append(g)
            base = start if base is None else base
        start += n
    batches, end = [], base
    for batch in found.iter_batches(batch_size=PARQUET_BATCH, row_groups=groups):
        batches.append(batch)
        end += batch.num_rows
        if end > wanted[-1]:
            break
    table = pa.Table.from_batches(batches, schema=found.schema_arrow).take(np.asarray(wanted) - base)
    return table_cast(table, schema), [f"{part['file']} row {r + 1}" for r in wanted]


def _json(part: dict[str, Any], schema):
    wanted, lines, numbers = expand(part["rows"]), [], []
    take = set(wanted)
    with lines_from(part["file"], part["anchor"], wanted[0]) as (f, position):
        row, number = position[0], position[1] - 1
        for line in f:
            number += 1
            if not line.strip():
                continue
            if row in take:  # the BOM datasets strips (and pyarrow skips) would be mid-data once lines are joined
                lines.append((line.removeprefix(codecs.BOM_UTF8) if number == 1 else line).rstrip(b"\r\n"))
                numbers.append(number)
            row += 1
            if row > wanted[-1]:
                break
        position[:] = [row, number + 1]  # where the next line starts, for the next unit of a compressed file
    return _parse(part["file"], lines, numbers, schema), [f"{part['file']} line {n}" for n in numbers]


def _parse(file: str, lines: list[bytes], numbers: list[int], schema):
    """The lines as a table of the split's schema; a line that is no JSON object is named by its file and line."""
    import pyarrow as pa
    import pyarrow.json as paj

    data = b"\n".join(lines) + b"\n"
    options = paj.ReadOptions(block_size=len(data) + 1, use_threads=False)
    try:
        return paj.read_json(
            io.BytesIO(data),
            read_options=options,
            parse_options=paj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error"),
        )
    except pa.ArrowInvalid:
        pass  # types the schema does not parse directly: infer, then cast as datasets casts a later chunk
    for line, number in zip(lines, numbers):  # app.data.sources.unreadable_data's words
        try:
            reason = None if isinstance(json.loads(line), dict) else "not a JSON object"
        except ValueError as err:
            reason = f"not JSON: {err}"
        if reason is not None:
            raise Problem("data.dataset", file, f"line {number} is {reason}", "fix or remove that line")
    from datasets.table import table_cast  # here, not above: an actor that never gets here does not import datasets

    try:
        return table_cast(paj.read_json(io.BytesIO(data), read_options=options), schema)
    except (pa.ArrowInvalid, TypeError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise Problem("data.dataset", file, f"cannot be read: {reason}", "fix the file") from None


def _text(part: dict[str, Any], schema):
    import pyarrow as pa

    values, places = textrows.read(part, expand(part["rows"]))
    return pa.table([pa.array(values, pa.string())], schema=schema), places


def _arrow(part: dict[str, Any], schema):
    return saved.read(part, schema, expand(part["rows"]))


def _csv(part: dict[str, Any], schema):
    """A csv/tsv file's rows from its Arrow conversion, named by the csv file and its row (header not counted)."""
    wanted = expand(part["rows"])
    table, _ = saved.read(part, schema, wanted)
    return table, [f"{part['origin']} row {r + 1}" for r in wanted]


READERS = {"parquet": _parquet, "json": _json, "text": _text, "arrow": _arrow, "csv": _csv}  # a part's kind: its reader


class Where:
    """Where a row of a source's unit came from, by its split index: the file and line its actor read it from
    (known, per source: the unit being encoded), else app.data.sources.row_location's answer (fallback)."""

    def __init__(self):
        self.known: dict[int, dict[int, str]] = {}
        self.fallback: dict[int, Any] = {}

    def __call__(self, source: int, index: int) -> str:
        found = self.known.get(source, {}).get(index)
        return found if found is not None else self.fallback[source](index)
