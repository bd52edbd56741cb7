"""Plain-text files (.txt, compressed or not) read by row range (app.data.ranges), row for row as `datasets`' text
builder reads them: the file decoded as UTF-8 (a BOM stays in the first row, as it does there) in text mode, whose
universal newlines make each of \\r\\n, \\r and \\n end a row; every line is a row, an empty one too, and a last
line without an ending is one. Counting and reading go by binary lines (split at \\n, where a row always starts):
a \\r inside one ends a row of its own. UTF-8 never has \\r or \\n inside a character, so decoding row by row gives
the characters decoding the whole file gives.
"""

from __future__ import annotations

from typing import Any

from app.errors import Problem


def rows_of(line: bytes) -> list[bytes]:
    """The rows a binary line holds (up to and with its \\n, or the file's last bytes without one)."""
    ended = line.endswith(b"\n")
    body = line[:-1] if ended else line
    if ended and body.endswith(b"\r"):
        body = body[:-1]  # \r\n: one ending
    if b"\r" not in body:
        return [body]
    rows = body.split(b"\r")
    if not ended and rows[-1] == b"":
        rows.pop()  # the file ends with \r: it ended the last row
    return rows


def count(file: str, stride: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(rows, anchors): an anchor (row, byte offset, line) at the start of the binary line that holds row
    k * stride, for each k (its row is at most that one)."""
    from app.data.files import open_data

    rows, offset, anchors = 0, 0, []
    with open_data(file) as f:
        for line in f:
            found = 1 if b"\r" not in line else len(rows_of(line))
            while len(anchors) * stride < rows + found:
                anchors.append((rows, offset, rows + 1))
            rows += found
            offset += len(line)
    return rows, anchors


def read(part: dict[str, Any], wanted: list[int]) -> tuple[list[str], list[str]]:
    """The part's rows (ascending row numbers of its file), from its anchor on, and where each came from ('FILE line
    N': rows are lines); a row that is not UTF-8 ends the preparation with its file and line."""
    from app.data.files import lines_from

    file, take, values, places = part["file"], set(wanted), [], []
    with lines_from(file, part["anchor"], wanted[0]) as (f, position):  # a compressed file: app.data.files
        row = position[0]
        for line in f:
            for found in rows_of(line):
                if row in take:
                    try:
                        values.append(found.decode("utf-8"))
                    except UnicodeDecodeError as err:
                        why = f"line {row + 1} is not UTF-8 ({err.reason} at byte {err.start} of the line)"
                        raise Problem("data.dataset", file, why, "fix or remove that line") from None
                    places.append(f"{file} line {row + 1}")
                row += 1
            if row > wanted[-1]:
                break
        position[:] = [row, row + 1]
    return values, places
