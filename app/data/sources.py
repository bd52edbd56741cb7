"""A source's rows as `datasets` reads them (local files, a folder split the Hub's way, a save_to_disk folder, a
Hub name), where a row came from (file and line, for messages), and the format its columns mean. Preparation reads
here, in the driver, only what app.data.ranges does not plan by row range (hub names, a saved dataset with a
format...); the checks and the in-memory path (app.data.pipeline.tokenize) read here.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from app.config import DataConfig
from app.data import chat
from app.data.files import (
    is_local,
    kind_of,
    open_data,
    reader,
    saved_dataset,
    split_files,
    split_names,
)
from app.errors import Problem

log = logging.getLogger("finetune")


def load_split(cfg: DataConfig, split: str):
    import datasets

    if is_local(cfg.dataset):
        path = Path(os.path.expanduser(cfg.dataset))
        if saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                name, _, rest = split.partition("[")
                base = loaded[name]
                return base if not rest else datasets.concatenate_datasets([base]).select(slice_of(len(base), rest))
            return loaded
        by_split = split_files(cfg.dataset, cfg.config_name)
        # Only the splits read: datasets converts every split it is given (a folder's test split too).
        given = {name: by_split[name] for name in split_names(split) if name in by_split} or by_split
        files = [f for fs in given.values() for f in fs]
        builder, options = reader(kind_of(files[0]))
        try:
            with _errors_restated():
                return datasets.load_dataset(builder, data_files=given, split=split, **options)
        except Exception as exc:  # noqa: BLE001 - a bad row beyond the sample validate read: say where it is
            raise unreadable_data(files, builder, exc) from None
    return datasets.load_dataset(cfg.dataset, cfg.config_name, split=split)


@contextlib.contextmanager
def _errors_restated() -> Iterator[None]:
    """datasets' JSON reader logs each error it then raises ("Failed to load JSON from file ... in row 2501", through
    a handler of its own as well as the app's); load_split restates it as one line with the file and line, so it is
    not logged twice more."""
    reader_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = reader_log.level
    reader_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        reader_log.setLevel(level)


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


def slice_of(n: int, spec: str) -> range:
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
    index += slice_of(len(places), rest).start if rest else 0
    return f"{places[index][0]} {places[index][1]}" if index < len(places) else fallback


def _row_places(file: str) -> list[str]:
    if file.endswith(".parquet"):
        import pyarrow.parquet as pq

        return [f"row {n + 1}" for n in range(pq.ParquetFile(file).metadata.num_rows)]
    with open_data(file) as f:
        return [f"line {n + 1}" for n, line in enumerate(f) if line.strip()]


def format_of(cfg: DataConfig, columns: list[str]) -> str:
    """The format data.format means for rows with these columns (app.data.chat.resolve_format); text rows without
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
