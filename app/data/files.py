"""Local data files as `datasets` reads them: which files a path or glob names, their kind (json, csv, parquet,
text; compressed with gzip, bzip2 or xz or not), and which split each file belongs to.

A folder is split the way `datasets.load_dataset(folder, config_name)` splits it. A dataset card (README.md)
whose YAML header lists `configs`, as every hub dataset downloaded with `hf download` has, names each config's
files by split (`data_files`) or its folder (`data_dir`); data.config_name picks one, else the card's default
(`default: true`, the one named `default`, or the only one). Without those (datasets' `get_data_patterns`):
the hub's shard names (`data/train-00000-of-00002.parquet`) give the splits; else split keywords in directory
names, then in file names (train/training; validation/valid/dev/val; test/testing/eval/evaluation, each standing
alone between `-._ 0-9` or the path's ends); else every file is `train`. A single file or a glob is `train`.
Hidden files and folders, `__special__` folders and a dataset's own metadata files (README.md, dataset_info.json)
are not data. tests/test_data.py checks the rule against datasets' own on a range of layouts.
"""

from __future__ import annotations

import bz2
import contextlib
import glob
import gzip
import lzma
import os
import re
from pathlib import Path
from typing import IO, Iterator

import yaml

from app.errors import Problem

# A data file's kind by its suffix, as datasets' _EXTENSION_TO_MODULE has it; each kind is read by one builder.
LOCAL_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".txt": "text",
}
# The separator of each kind that `datasets` reads with its csv builder (and pandas, as it does).
CSV_SEPARATORS = {"csv": ",", "tsv": "\t"}
# Compression `datasets` undoes on reading (by the suffix), for the kinds that are a stream of bytes.
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
# datasets' FILES_TO_IGNORE: a dataset folder's metadata, never rows.
NOT_DATA = frozenset({"README.md", "config.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json"})
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SEP = "[-._ 0-9]"  # datasets' NON_WORDS_CHARS, around a keyword
_SPLIT_NAME = re.compile(r"\w+(\.\w+)*")  # datasets' rule for a split's name
_SHARD = re.compile(r"data/([^/]+)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*")  # datasets' SPLIT_PATTERN_SHARDED

# A dataset folder with more entries than this is a mistake (e.g. data.dataset=/), not a dataset: stop walking.
MAX_FOLDER_ENTRIES = 200_000


class TooManyFiles(Exception):
    """args: (the limit,)."""


class UnknownConfig(ValueError):
    """args: (the config asked for or None, the configs the folder's card lists)."""


def is_local(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or bool(glob.glob(os.path.expanduser(spec)))


def url_problem(field: str, value: str, source: str, what: str) -> Problem | None:
    """A Problem when `source` (the path part of `value`) is a URL (s3://bucket/data): remote storage, which the
    app does not read (the workers read local paths); `what` is copied onto the shared volume instead."""
    found = re.match(r"([a-zA-Z][a-zA-Z0-9+.-]*)://", source)
    if found is None:
        return None
    return Problem(
        field,
        value,
        f"is a URL ({found.group(1)}://), which the app does not read",
        f"copy {what} onto the shared volume and point {field} at it, or give a hub name (owner/name)",
    )


def kind_of(file: str) -> str | None:
    """The `datasets` builder that reads `file` (json for data.jsonl.gz), or None for a file that is no data."""
    path = Path(file)
    if path.suffix in COMPRESSIONS:
        kind = LOCAL_BUILDERS.get(Path(path.stem).suffix)
        return None if kind == "parquet" else kind  # parquet compresses inside; datasets reads no .parquet.gz
    return LOCAL_BUILDERS.get(path.suffix)


def reader(kind: str) -> tuple[str, dict]:
    """The `datasets` builder and its options for a kind of file."""
    return ("csv", {"sep": CSV_SEPARATORS[kind]}) if kind in CSV_SEPARATORS else (kind, {})


def open_data(file: str) -> IO[bytes]:
    """The file's bytes, decompressed as `datasets` decompresses them."""
    return COMPRESSIONS.get(Path(file).suffix, open)(file, "rb")


# Compressed files this process read last, each left where its read ended (app.data.ranges' units): at most this many.
KEPT_OPEN = 4
_kept: dict[str, tuple[IO[bytes], tuple[int, int]]] = {}


@contextlib.contextmanager
def lines_from(file: str, anchor: tuple[int, int, int], first: int) -> Iterator[tuple[IO[bytes], list[int]]]:
    """(the file's uncompressed bytes from a line start, [its row, its line number]): the anchor's (row, byte offset,
    line), or where this process's last read of the file ended when that is further on and not past row `first`.
    The caller sets the list to where its own read ended. A compressed file has no seek but decompressing up to the
    offset: its handle stays open here, so that the next unit of the file a Ray Data actor encodes decompresses only
    what lies between (an offset before it starts from the file's start again). The bytes read are the same either
    way; only the work done to reach them differs."""
    row, offset, number = anchor
    if Path(file).suffix not in COMPRESSIONS:
        with open(file, "rb") as f:
            f.seek(offset)
            yield f, [row, number]
        return
    f, at = _kept.pop(file, (None, (0, 0)))
    if f is not None and at[0] <= first and f.tell() >= offset:
        row, number = at  # already past the anchor and not past the rows wanted: read on from here
    else:
        if f is not None and f.tell() > offset:
            f.close()
            f = None
        f = f or open_data(file)
        f.seek(offset)
    position = [row, number]
    try:
        yield f, position
    except BaseException:
        f.close()
        raise
    _kept[file] = (f, (position[0], position[1]))
    while len(_kept) > KEPT_OPEN:
        _kept.pop(next(iter(_kept)))[0].close()


def close_kept() -> None:
    """Closes the compressed files lines_from keeps open (the driver's, once a preparation is done: a decompressor
    holds its window, up to tens of MB for xz, and the driver goes on to train)."""
    while _kept:
        _kept.popitem()[1][0].close()


def saved_dataset(path: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (a Dataset or a DatasetDict), which is read whole, not by file."""
    return path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists())


def split_files(spec: str, config: str | None = None) -> dict[str, list[str]]:
    """{split: files} of a local path, in datasets' order of splits (train, validation, test, then by name), for
    the folder's `config` (data.config_name); UnknownConfig when the folder's card does not list that config, or
    lists several and marks none default."""
    path = Path(os.path.expanduser(spec))
    if not path.is_dir():
        if config is not None:
            raise UnknownConfig(config, [])
        return {"train": sorted(glob.glob(os.path.expanduser(spec)))}
    configs = card_configs(path)
    if not configs and config is not None:
        raise UnknownConfig(config, [])
    if configs:
        chosen = _chosen(configs, config)
        if chosen.get("data_files") is not None:
            return _ordered(path, _card_data_files(path, chosen["data_files"]))
        path = path / str(chosen.get("data_dir") or "")
    return _ordered(path, _by_names(path))


def _by_names(path: Path) -> dict[str, list[str]]:
    """A folder's files by split, from their names (the module's docstring)."""
    files = _folder_data_files(path)
    by_split = _by_shard_name(files) or _by_keyword(files, _in_folder_name) or _by_keyword(files, _in_file_name)
    return by_split or {"train": files}


def _ordered(path: Path, by_split: dict[str, list[str]]) -> dict[str, list[str]]:
    named = [s for s in SPLIT_KEYWORDS if s in by_split] + sorted(set(by_split) - set(SPLIT_KEYWORDS))
    return {split: [str(path / f) for f in sorted(by_split[split])] for split in named}


def card_configs(folder: Path) -> dict[str, dict]:
    """{name: params} of the `configs` in the YAML header of the folder's dataset card (README.md); {} without."""
    try:
        lines = (folder / "README.md").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return {}
    if not lines or lines[0] != "---" or "---" not in lines[1:]:
        return {}
    try:
        header = yaml.safe_load("\n".join(lines[1 : lines.index("---", 1)]))
    except yaml.YAMLError:
        return {}  # datasets refuses such a card itself; its files are then read by their names
    configs = header.get("configs") if isinstance(header, dict) else None
    if not isinstance(configs, list):
        return {}
    return {c["config_name"]: c for c in configs if isinstance(c, dict) and isinstance(c.get("config_name"), str)}


def _chosen(configs: dict[str, dict], name: str | None) -> dict:
    """datasets' choice: the config asked for, else the only one, the one named `default` or marked `default`."""
    if name is None:
        defaults = [n for n, c in configs.items() if len(configs) == 1 or n == "default" or c.get("default") is True]
        name = defaults[0] if len(defaults) == 1 else None
    if name not in configs:
        raise UnknownConfig(name, sorted(configs))
    return configs[name]


def _card_data_files(folder: Path, data_files) -> dict[str, list[str]]:
    """A card config's `data_files` (a pattern, a list of them, or a list of {split, path}) resolved under the
    folder, data files only."""
    if isinstance(data_files, (str, list)) and not any(isinstance(d, dict) for d in data_files):
        by_split = {"train": [data_files] if isinstance(data_files, str) else data_files}
    elif isinstance(data_files, list):
        by_split = {d.get("split"): d.get("path") for d in data_files if isinstance(d, dict)}
    else:
        by_split = dict(data_files) if isinstance(data_files, dict) else {}
    out = {}
    for split, patterns in by_split.items():
        patterns = [patterns] if isinstance(patterns, str) else patterns if isinstance(patterns, list) else []
        files = {
            f
            for p in patterns
            if isinstance(p, str)
            for f in glob.glob(p, root_dir=folder, recursive=True)
            if kind_of(f) is not None and Path(f).name not in NOT_DATA and (folder / f).is_file()
        }
        if isinstance(split, str) and files:
            out[split] = sorted(files)
    return out


def _folder_data_files(folder: Path) -> list[str]:
    """Data files under `folder`, relative to it with '/', skipping what datasets' resolver skips."""
    found, seen = [], 0
    for where, dirs, names in os.walk(folder):
        seen += len(names) + 1
        if seen > MAX_FOLDER_ENTRIES:
            raise TooManyFiles(MAX_FOLDER_ENTRIES)
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        rel = Path(where).relative_to(folder)
        found += [
            (rel / n).as_posix()
            for n in names
            if not n.startswith(".") and n not in NOT_DATA and kind_of(n) is not None and os.path.isfile(Path(where, n))
        ]
    return found


def _by_shard_name(files: list[str]) -> dict[str, list[str]]:
    shards: dict[str, list[str]] = {}
    for f in files:
        if (m := _SHARD.fullmatch(f)) and _SPLIT_NAME.fullmatch(m.group(1)):
            shards.setdefault(m.group(1), []).append(f)
    return shards


def _by_keyword(files: list[str], named) -> dict[str, list[str]]:
    """{split: files whose path names it by `named`}; a file may name two splits, as in datasets."""
    found = {split: [f for f in files if any(named(f, k) for k in words)] for split, words in SPLIT_KEYWORDS.items()}
    return {split: fs for split, fs in found.items() if fs}


def _in_folder_name(file: str, keyword: str) -> bool:
    return any(re.fullmatch(f"(.*{_SEP})?{keyword}({_SEP}.*)?", d) for d in file.split("/")[:-1])


def _in_file_name(file: str, keyword: str) -> bool:
    return re.fullmatch(f"(.*{_SEP})?{keyword}{_SEP}.*", file.rsplit("/", 1)[-1]) is not None


def split_names(expression: str) -> list[str]:
    """The splits a split expression reads ('train[:90%]+validation' -> ['train', 'validation'])."""
    return [part.partition("[")[0].strip() for part in expression.split("+")]


def folder_splits(spec: str, config: str | None, expression: str) -> str | None:
    """For the run's summary, a folder's files as this run reads them ('train: 3 files; also in the folder:
    validation, test'), or None for anything but a folder of data files."""
    path = Path(os.path.expanduser(spec))
    if not path.is_dir() or saved_dataset(path):
        return None
    try:
        by_split = split_files(spec, config)
    except (UnknownConfig, TooManyFiles, OSError):
        return None
    read = [name for name in split_names(expression) if name in by_split]
    files = sum(len(by_split[name]) for name in read)
    others = [name for name in by_split if name not in read]
    return f"{'+'.join(read) or expression}: {files} file{'s' * (files != 1)}" + (
        f"; also in the folder: {', '.join(others)}" if others else ""
    )
