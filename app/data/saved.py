"""A save_to_disk folder read by row range (app.data.ranges): its data-*.arrow files are Arrow IPC streams, counted
by Ray tasks (a file's record batches, memory-mapped: no row is decoded) and read by the actor that encodes a unit,
which maps its file and takes its rows from the record batches that hold them.

The rows are those `datasets.load_from_disk` gives (app.data.sources.load_split): the files in state.json's order,
cast to the features of dataset_info.json, a DatasetDict's split by its name and `[a:b]` slice (a Dataset's folder
is read whole, whatever the split says). A folder saved with a format (set_format: rows as tensors) is left to
`datasets`, whose first row the checks see formatted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def folder_of(path: Path, expression: str) -> tuple[Path, str] | None:
    """(the Dataset folder a split expression reads, its slice or ''), or None for what `datasets` reads: a split a
    DatasetDict has not, several splits (a saved DatasetDict is read by one name), a saved format."""
    rest = ""
    if (path / "dataset_dict.json").exists():
        name, _, rest = expression.partition("[")
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if "+" in expression or name.strip() not in splits:
            return None
        path = path / name.strip()
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        return None
    if state.get("_format_type") is not None or state.get("_indices") or not state.get("_data_files"):
        return None
    return path, rest


def files_of(folder: Path) -> list[str]:
    state = json.loads((folder / "state.json").read_text())
    return [str(folder / entry["filename"]) for entry in state["_data_files"]]


def count(file: str) -> int:
    """The rows of an Arrow stream file, from its record batches' lengths (memory-mapped: the data is not read)."""
    import pyarrow as pa

    with pa.memory_map(file) as source:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))


def schema_of(file: str):
    """The split's Arrow schema as load_from_disk makes it: dataset_info.json's features in the file's column order
    (Dataset casts its table to them), else the file's own; None where `datasets` would refuse the folder."""
    import pyarrow as pa
    from datasets import DatasetInfo, Features

    with pa.memory_map(file) as source:
        inferred = Features.from_arrow_schema(pa.ipc.open_stream(source).schema)
    try:
        info = DatasetInfo.from_dict(json.loads((Path(file).parent / "dataset_info.json").read_text()))
        features = inferred if info.features is None else info.features.reorder_fields_as(inferred)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return features.arrow_schema


def read(part: dict[str, Any], schema, wanted: list[int]):
    """The part's rows (ascending row numbers of its file) from the record batches that hold them, the batches
    before them skipped unread (the map keeps them on disk), and where each came from."""
    import pyarrow as pa
    from datasets.table import table_cast

    source = pa.memory_map(part["file"])
    stream = pa.ipc.open_stream(source)
    batches, start, base = [], 0, None
    for batch in stream:
        if start + batch.num_rows > wanted[0]:
            base = start if base is None else base
            batches.append(batch)
        start += batch.num_rows
        if start > wanted[-1]:
            break
    table = pa.Table.from_batches(batches, schema=stream.schema).take(np.asarray(wanted) - base)  # a copy
    source.close()
    return table_cast(table, schema), [f"{part['file']} row {r + 1}" for r in wanted]
