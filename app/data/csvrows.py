"""csv/tsv files read by row range (app.data.ranges): each file parsed once, whole, by a Ray task, exactly as
`datasets`' csv builder parses it, and written as an Arrow IPC stream file that units then read as app.data.saved
reads a save_to_disk file.

`datasets` reads a csv file with pandas in chunks (CsvConfig's chunksize, 10,000 rows), each chunk's column types
inferred by pandas on its own (pa.Table.from_pandas), and its writer fixes the split's schema from the first table it
gets (the first chunk of the split's first file) and casts every later table to it (table_cast): a row's value
depends on that first chunk, so no unit of rows can be parsed on its own. Here one task reads that first chunk (the
split's schema), then a task a file parses the file chunk by chunk with the same pandas options, casts each chunk to
the schema as the writer does, and writes it under the preparation's temporary folder (removed before the prepared
dataset is published, or with it on failure); it returns the file's rows, or why the file cannot be read.
"""

from __future__ import annotations

import os
from typing import Any

from app.data.files import CSV_SEPARATORS


def options(kind: str) -> dict[str, Any]:
    """pandas.read_csv's options as `datasets`' csv builder passes them for this kind (app.data.files.reader's sep),
    its chunksize included."""
    from datasets.packaged_modules.csv.csv import CsvConfig

    return dict(CsvConfig(sep=CSV_SEPARATORS[kind]).pd_read_csv_kwargs)


def _reason(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def first_schema(files: list[str], opts: dict[str, Any]) -> tuple[Any, str | None, str | None]:
    """(the split's Arrow schema as `datasets`' writer fixes it: the first chunk's, None for no chunk at all; the file
    that cannot be read and why, or None, None)."""
    import pandas as pd
    import pyarrow as pa
    from datasets import Features

    for file in files:
        try:
            with pd.read_csv(file, iterator=True, **opts) as chunks:
                for df in chunks:
                    return Features.from_arrow_schema(pa.Table.from_pandas(df).schema).arrow_schema, None, None
        except Exception as exc:  # noqa: BLE001 - pandas', pyarrow's, a decompressor's: the file is named with it
            return None, file, _reason(exc)
    return None, None, None


def convert(file: str, opts: dict[str, Any], schema, out: str) -> tuple[int | None, str | None]:
    """(the file's rows, None) once its chunks, cast to the split's schema, are written to `out` as an Arrow stream;
    (None, why) where `datasets` would fail on it (pandas cannot parse it, a chunk cannot be cast to the schema)."""
    import pandas as pd
    import pyarrow as pa
    from datasets.table import table_cast

    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows = 0
    try:
        with pa.OSFile(out, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            with pd.read_csv(file, iterator=True, **opts) as chunks:
                for df in chunks:
                    table = pa.Table.from_pandas(df).combine_chunks()
                    for field in schema:  # datasets' writer refuses values in a column the first chunk left null
                        if pa.types.is_null(field.type) and field.name in table.column_names:
                            if table[field.name].null_count < table.num_rows:
                                raise TypeError(f"column {field.name!r} is empty in the first rows, not later")
                    try:
                        table = table_cast(table, schema)
                    except (pa.ArrowException, TypeError, ValueError) as exc:
                        raise ValueError(f"rows {rows + 1}-{rows + len(df)}: {_reason(exc)}") from None
                    writer.write_table(table)
                    rows += table.num_rows
    except Exception as exc:  # noqa: BLE001 - pandas', pyarrow's, datasets' cast's: the file is named with it
        return None, _reason(exc)
    return rows, None
