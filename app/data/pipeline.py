"""Preparation: a training config's data read, rendered, masked, tokenized and packed into a prepared dataset
(app.data.store) once per key, by Ray Data over every CPU of the Ray cluster, before any training worker starts.

The key covers what changes the prepared bytes (the data files' identity, the tokenizer's files, the template,
format, seq_length, packing, train_on_prompt, the splits, the preparation code's version) and nothing else, so
every experiment over the same data and tokenizer shares one prepared dataset under `<storage>/prepared/<key>/`.
A split is cut into units of UNIT_ROWS consecutive rows (app.data.encode); each unit is one row of a Ray Data
dataset, encoded by an actor that loads the tokenizer once and writes the unit's arrays itself, so the bytes do not
depend on how many CPUs, nodes or Ray Data blocks did the work. Local JSON Lines and text files (compressed or not),
parquet and csv/tsv files and save_to_disk folders are not read here: Ray tasks count their rows, the driver plans
each unit as (file, rows) descriptors (the split expression, data.eval_fraction's holdout and a mixture's choice
applied to row numbers) and the actor reads its own rows (app.data.ranges), naming a bad row by the file and line of
its descriptor (csv/tsv files are parsed whole by a Ray task a file into Arrow files under the temporary folder,
app.data.csvrows, removed before it is published). What app.data.ranges leaves to `datasets` (hub names, a saved
dataset with a format...) is read here (app.data.sources.load_split) and each unit's rows are sent as Arrow.
The folder is written under a temporary name and renamed once its manifest is in: a preparation that fails or is
killed leaves nothing a later run reads.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app import faults
from app.config import DataConfig, ModelConfig, TrainingConfig
from app.data import chat, pairs, ranges, tokens
from app.data.encode import UNIT_ROWS, UnitEncoder, first_row_problem, layout_of, report
from app.data.files import close_kept, is_local, saved_dataset, split_files, split_names
from app.data.manifest import EXPERIMENT_RECORD, MANIFEST, read_manifest, summary
from app.data.sources import format_of, load_split, row_location
from app.data.units import remove_tree, write_unit
from app.errors import Problem

if TYPE_CHECKING:
    from app.data.store import PreparedSplit

PREPARED = "prepared"  # under experiment.storage_path, beside the experiments' folders
VERSION = "prepared-v1"  # the preparation code's version: a change to the bytes it writes changes it
# The rule that picks data.eval_fraction's rows (holdout): in the key where a fraction is held out, so that another
# rule (other rows) gets another key. v1 was datasets' train_test_split (its train rows shuffled); sorted-v2 picks
# the same number of rows by a seeded permutation of the row numbers and keeps both parts in the split's order.
HOLDOUT = "sorted-v2"
# What AutoTokenizer reads from a model folder: its identity is their contents, wherever the folder is.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
PROGRESS_EVERY_S = 10.0
SCRATCH = "csv-rows"  # in the temporary folder: csv/tsv files converted to Arrow (app.data.csvrows), removed before
# the folder is published
log = logging.getLogger("finetune")


def root_of(storage_path: str) -> Path:
    return Path(storage_path).expanduser().resolve() / PREPARED


def key_fields(cfg: TrainingConfig) -> dict[str, Any]:
    d = cfg.data
    sources = d.sources()
    held_out = {"holdout": HOLDOUT} if d.eval_fraction else {}  # the other keys stay as they were
    return {
        "version": VERSION,
        "unit_rows": UNIT_ROWS,  # the packing groups
        "sources": [
            {
                "data": data_identity(source),
                "config_name": source.config_name,
                "split": source.split,
                "text_field": source.text_field,
                "format": source.format,
                "template": chat.TEMPLATES.get(source.chat_template, source.chat_template),
                "weight": weight if len(sources) > 1 else None,
            }
            for source, weight in sources
        ],
        "eval_split": d.eval_split,
        "eval_fraction": d.eval_fraction,
        # The seed picks the held-out rows and a mixture's rows.
        "seed": cfg.train.seed if d.eval_fraction or len(sources) > 1 else None,
        "train_on_prompt": d.train_on_prompt,
        "seq_length": d.seq_length,
        "packing": d.packing,
        "tokenizer": tokenizer_identity(cfg.model),
        **held_out,
    }


def key_of(cfg: TrainingConfig) -> str:
    return hash_of(key_fields(cfg))


def hash_of(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def started_on(cfg: TrainingConfig) -> Path | None:
    """The prepared dataset this experiment's runs read under the key its config had before the holdout rule was in
    the key (data.eval_fraction's rows were then datasets' train_test_split's): its resume keeps reading it, so the
    exact-batch resume sees the blocks it started on. None for a config without a fraction, a new experiment, or
    one that reads the current key."""
    fields = key_fields(cfg)
    if "holdout" not in fields:
        return None
    del fields["holdout"]
    try:
        recorded = Path(json.loads((cfg.experiment_dir / EXPERIMENT_RECORD).read_text())["prepared"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return recorded if recorded.name == hash_of(fields) and read_manifest(recorded) is not None else None


def folder_of(cfg: TrainingConfig) -> Path:
    return root_of(cfg.experiment.storage_path) / key_of(cfg)


def data_identity(d: DataConfig) -> Any:
    """Local data: each file read, with its size and modification time (a file written again is new data); a hub
    dataset: its name (the hub's own cache keeps its revision)."""
    if not is_local(d.dataset):
        return {"hub": d.dataset}
    path = Path(os.path.expanduser(d.dataset))
    if saved_dataset(path):
        files = sorted(str(f) for f in path.rglob("*") if f.is_file())
    else:
        by_split = split_files(d.dataset, d.config_name)
        names = split_names(d.split) + (split_names(d.eval_split) if d.eval_split else [])
        files = sorted(
            {f for name in names for f in by_split.get(name, [])} or {f for fs in by_split.values() for f in fs}
        )
    out = []
    for file in files:
        stat = os.stat(file)
        out.append([str(Path(file).resolve()), stat.st_size, stat.st_mtime_ns])
    return out


def tokenizer_identity(m: ModelConfig) -> Any:
    from app.model import model_source

    name = m.tokenizer or model_source(m.name_or_path)[0]
    folder = Path(os.path.expanduser(name))
    if not folder.is_dir():
        return {"hub": name}
    digest = hashlib.sha256()
    for file in sorted(f for f in folder.iterdir() if f.name in TOKENIZER_FILES and f.is_file()):
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return {"files": digest.hexdigest()}


def ensure(cfg: TrainingConfig, before_preparing: Callable[[], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """The prepared dataset of this config and its manifest: the one already on the volume when its key matches
    (the log says so), else prepared now, `before_preparing` first (`finetune prepare` starts Ray there: a dataset
    that is on the volume already is found by its key and manifest alone, with no cluster started)."""
    folder = folder_of(cfg)
    manifest = read_manifest(folder)
    if manifest is not None:
        log.info(f"prepared data: reusing {folder} ({summary(manifest)})")
        return folder, manifest
    if before_preparing is not None:
        before_preparing()
    manifest = prepare(cfg, folder)
    log.info(f"prepared data: {folder} ({summary(manifest)})")
    return folder, manifest


@dataclass
class Source:
    """One source of the data, read or planned: its own data section, weight and format, and its rows per split (a
    `datasets` Dataset, or an app.data.ranges.Ranged whose rows the actors read) with the split their indices
    number (for error messages)."""

    data: DataConfig
    weight: float
    fmt: str
    splits: dict[str, tuple[Any, str]]
    read: int = 0

    def described(self) -> dict[str, Any]:
        train = self.splits["train"][0]
        return {
            "dataset": self.data.dataset,
            "split": self.data.split,
            "format": self.fmt,
            "weight": self.weight,
            "rows": self.read,
            "taken": len(train),
        }


def prepare(cfg: TrainingConfig, folder: Path) -> dict[str, Any]:
    """Prepares the data into `folder` (temporary name, then rename) and returns its manifest."""
    from app.model import load_tokenizer

    started = time.time()
    tokenizer = load_tokenizer(cfg.model)
    named = bool(cfg.data.datasets)  # a mixture's log lines say which source they are about
    tmp = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        sources = [read_source(d, weight, cfg.train.seed, named, tmp / SCRATCH) for d, weight in cfg.data.sources()]
        for source in sources:  # a hub dataset's columns are first seen here
            if found := pairs.format_problems(source.data, source.fmt, cfg.preference is not None):
                raise found[0]
        mix(sources, cfg.train.seed)
        for source in sources:
            train = source.splits["train"][0]
            if len(train) and (
                problem := first_row_problem(source.data, source.fmt, first_row(train), tokenizer, locator(source.data))
            ):
                raise problem
        names = ["train"] + (["eval"] if any("eval" in source.splits for source in sources) else [])
        results = {name: run_split(cfg, sources, name, tmp, tokenizer) for name in names}
        remove_tree(tmp / SCRATCH)  # csv/tsv rows as Arrow, read by the units: no part of the prepared dataset
        no_training_sequence(cfg.data, results["train"])
        layouts = {layout_of(source.fmt, cfg.data.packing) for source in sources}
        manifest = {
            "key": folder.name,
            "identity": key_fields(cfg),
            "format": sources[0].fmt if len(sources) == 1 else "mixture",
            "layout": layouts.pop() if len(layouts) == 1 else "mixed",
            "seq_length": cfg.data.seq_length,
            "pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            "eos_id": tokenizer.eos_token_id,
            "sources": [source.described() for source in sources],
            "splits": results,
            "nodes": nodes_of(results),
            "seconds": round(time.time() - started, 2),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")  # last: it makes the folder complete
        publish(tmp, folder)
    except BaseException:
        remove_tree(tmp)
        raise
    finally:
        close_kept()  # what this process read of compressed files (a first row, units prepared here)
    return read_manifest(folder) or manifest


def tokenize(raw, tokenizer, cfg: DataConfig) -> PreparedSplit:
    """The blocks of `raw` (rows as `datasets` loaded them) in this process, as preparation makes them (app.data.encode,
    unit by unit): packed text in full seq_length blocks; padded rows with labels -100 on padding; chat and
    prompt/completion rows with labels on the assistant turns or the completion."""
    from app.data.store import PreparedSplit

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


def publish(tmp: Path, folder: Path) -> None:
    """The temporary folder under its key's name; where another preparation of the same key finished first, its
    folder stays (the same bytes) and this one goes."""
    try:
        os.rename(tmp, folder)
    except OSError:
        if read_manifest(folder) is None:
            raise
        remove_tree(tmp)


def locator(d: DataConfig, split: str | None = None):
    """Where a row of a split comes from, by its index in the split (app.data.row_location), picklable."""
    return functools.partial(row_location, d.dataset, split or d.split, config=d.config_name)


def read_source(d: DataConfig, weight: float, seed: int, named: bool = False, scratch: Path | None = None) -> Source:
    """A source's splits, planned by row range (app.data.ranges: the actors read the rows; csv/tsv files converted
    to Arrow files under `scratch`) or else read by `datasets` here, its format, and its eval rows (data.eval_split,
    or data.eval_fraction of its split, picked by the seed)."""
    raw = split_of(d, d.split, scratch)
    evalset = split_of(d, d.eval_split, scratch) if d.eval_split else None
    fmt = format_of(d, raw.column_names)
    log.info(
        f"data format: {fmt}"
        + (" (data.format auto, from the columns)" if d.format == "auto" else "")
        + (f" for {d.dataset}" if named else "")
    )
    if fmt != "text":  # numbered before the eval split takes rows out, so that a bad row is named by its place
        raw, evalset = numbered(raw), numbered(evalset)
    read = len(raw)
    if d.eval_fraction:
        kept, held = holdout(len(raw), d.eval_fraction, seed)
        raw, evalset = raw.select(kept), raw.select(held)
    splits = {"train": (raw, d.split)}
    if evalset is not None:
        splits["eval"] = (evalset, d.eval_split or d.split)
    return Source(d, weight, fmt, splits, read)


def split_of(d: DataConfig, expression: str, scratch: Path | None = None):
    planned = ranges.plan(d, expression, scratch)
    return planned if planned is not None else load_split(d, expression)


def numbered(split):
    """The split with chat.ROW, each row's index in it (a Ranged split adds it as its actors read the rows)."""
    if isinstance(split, ranges.Ranged):
        split.numbered = True
        return split
    return split if split is None else split.add_column(chat.ROW, list(range(len(split))))


def first_row(split) -> dict[str, Any]:
    return split.row(0) if isinstance(split, ranges.Ranged) else split[0]


def holdout(rows: int, fraction: float, seed: int):
    """(the rows kept for training, the rows held out for eval) of a split of `rows` rows, each ascending: as many
    held out as datasets' train_test_split holds out (ceil), picked by a permutation of the row numbers that only
    the seed and the row count fix, so any number of CPUs, a resume and either reading (by range or `datasets`)
    hold out the same rows. In the split's order, a Ranged split's units read runs of rows, not the whole split."""
    import math

    import numpy as np

    held = np.zeros(rows, dtype=bool)
    held[np.random.default_rng(seed).permutation(rows)[: math.ceil(fraction * rows)]] = True
    return np.flatnonzero(~held), np.flatnonzero(held)


def mix(sources: list[Source], seed: int) -> None:
    """A mixture's training rows: each source gives weight/sum(weights) of them, as many in all as the first source
    to run out allows (LLaMA-Factory's interleave_probs, stopping at the first exhausted); which rows of a source,
    by the seed, kept in their order in the source. One source keeps all of its rows."""
    if len(sources) < 2:
        return
    import numpy as np

    total = sum(source.weight for source in sources)
    shares = [source.weight / total for source in sources]
    rows = min(len(source.splits["train"][0]) / share for source, share in zip(sources, shares))
    for n, (source, share) in enumerate(zip(sources, shares)):
        train, numbered_in = source.splits["train"]
        taken = min(len(train), int(round(share * rows)))
        chosen = np.sort(np.random.default_rng([seed, n]).permutation(len(train))[:taken])
        source.splits["train"] = (train.select(chosen), numbered_in)
        log.info(f"mixture: {taken:,} of {len(train):,} rows of {source.data.dataset} (weight {source.weight:g})")


def no_training_sequence(d: DataConfig, train: dict[str, Any]) -> None:
    if train["rows"] and train["empty"] == train["rows"]:
        raise Problem(
            "data.text_field",
            d.text_field,
            f"split {d.split} has no row with text",
            "point data.dataset at data with text",
        )
    if train["rows"] and train.get("unanswered") == train["rows"]:  # before blocks: unpacked, each such row is dropped
        raise chat.no_answer(d.dataset, f"split {d.split}")
    if train["blocks"] and not train["targets"]:
        raise Problem(
            "data.chat_template",
            d.chat_template,
            f"no token of split {d.split} is a target: the template marks no assistant turn as the answer "
            "(every loss would be 0/0)",
            "use a template that renders the assistant turns (a shipped name, or {% generation %} blocks), or set "
            "data.train_on_prompt=true",
        )
    if train["single_token"] and not train["documents"]:  # unpacked: not a matter of the sequence's length
        raise Problem(
            "data.dataset",
            d.dataset,
            f"every document of split {d.split} is a single token once tokenized: nothing to predict (each token is "
            "trained to predict the next one)",
            "use longer texts, or set data.packing=true to join the documents (each followed by EOS)",
        )
    if train["blocks"] == 0:
        raise Problem(
            "data.seq_length",
            d.seq_length,
            "the split yields no training sequence"
            + (
                f" (packing keeps whole {d.seq_length}-token blocks only, as the tokenizer counts tokens)"
                if d.packing
                else ""
            ),
            "use more data or a shorter seq_length, or check that model.tokenizer turns this text into tokens",
        )


COUNTS = (
    "rows",
    "empty",
    "too_long",
    "truncated",
    "unanswered",
    "single_token",
    "documents",
    "tokens",
    "targets",
    "blocks",
    "cut",
)


def run_split(cfg: TrainingConfig, sources: list[Source], name: str, tmp: Path, tokenizer) -> dict:
    """The split's units, source after source, encoded and written into `tmp` (by Ray Data when there is more than
    one unit and a Ray cluster, else here), and their totals."""
    units = []  # (source, its rows of one unit: a Ranged split's descriptor, else the rows as Arrow)
    for n, source in enumerate(sources):
        if name in source.splits:
            rows = source.splits[name][0]
            cut = rows.unit if isinstance(rows, ranges.Ranged) else rows.with_format("arrow").__getitem__
            units += [(n, cut(slice(lo, lo + UNIT_ROWS))) for lo in range(0, len(rows), UNIT_ROWS)]
    options = {
        "config": cfg.model_dump(mode="json"),
        "sources": [
            {
                "data": s.data.model_dump(mode="json"),
                "fmt": s.fmt,
                "numbered_in": s.splits[name][1] if name in s.splits else None,
                "schema": schema_bytes(s.splits[name][0]) if name in s.splits else None,
            }
            for s in sources
        ],
        "split": name,
        "folder": str(tmp),
    }
    light = tokens.light(tokenizer, cfg.model)  # the actors' tokenizer (None: they load the model's own)
    if len(units) <= 1 or not _ray_up():
        preparer = UnitPreparer(**options, tokenizer=light or tokenizer)
        done = []
        for n, (source, rows) in enumerate(units):
            sent = {"parts": rows, "rows": None} if isinstance(rows, dict) else {"rows": rows}
            done.append(preparer({"unit": n, "source": source, **sent}))
            _counts(done[-1])
    else:
        done = _on_ray(cfg, name, {**options, "tokenizer": light}, units)
    found = sorted((json.loads(row["result"]) for row in done), key=lambda u: u["unit"])
    totals = {c: sum(u["counts"].get(c, 0) for u in found) for c in COUNTS}
    if any("pairs" in u["counts"] for u in found):  # preference data: documents come in pairs
        totals["pairs"] = sum(u["counts"]["pairs"] for u in found)
    report(totals, "training" if name == "train" else "eval", cfg.data)
    return {
        **totals,
        "bytes": sum(u["bytes"] for u in found),
        "units": [
            {
                "unit": u["unit"],
                "source": u["source"],
                "layout": u["layout"],
                "blocks": u["counts"]["blocks"],
                "arrays": u["arrays"],
            }
            for u in found
        ],
        "nodes": [u["node"] for u in found],
    }


def _ray_up() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def _on_ray(cfg: TrainingConfig, name: str, options: dict, units: list) -> list[dict]:
    """Each unit one row of a Ray Data dataset, encoded by a pool of actors over the cluster's CPUs."""
    import pyarrow as pa
    import ray

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the app logs its own progress lines
    items = []  # the same columns for both kinds of unit, so that Ray Data sees one schema
    for n, (source, payload) in enumerate(units):
        if isinstance(payload, dict):
            items.append({"unit": n, "source": source, "rows": b"", "parts": json.dumps(payload)})
            continue
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, payload.schema) as writer:
            writer.write_table(payload)
        items.append({"unit": n, "source": source, "rows": sink.getvalue().to_pybytes(), "parts": ""})
    rows = sum(len(ranges.expand(p["numbers"])) if isinstance(p, dict) else p.num_rows for _, p in units)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    actors = max(1, min(len(units), cfg.data.num_proc or cpus, cpus))
    log.info(f"preparing {name}: {rows:,} rows in {len(units)} units on up to {actors} CPUs (Ray Data)")
    encoded = ray.data.from_items(items).map(
        UnitPreparer, fn_constructor_kwargs={**options, "threads": 1}, concurrency=actors, num_cpus=1
    )
    progress = Progress(name, rows)
    done = []
    for row in encoded.iter_rows():
        done.append(row)
        progress.add(_counts(row)["rows"])
    return done


def schema_bytes(split) -> bytes | None:
    """A Ranged split's Arrow schema, serialized for its actors (they parse and cast its rows to it)."""
    return split.schema.serialize().to_pybytes() if isinstance(split, ranges.Ranged) else None


def _counts(row: dict[str, Any]) -> dict[str, int]:
    """A unit's counts; a unit that found a bad row raises its Problem (the preparation stops there)."""
    result = json.loads(row["result"])
    if "problem" in result:
        raise Problem(*result["problem"])
    return result["counts"]


class Progress:
    """Rows done, rate and ETA, one line at most every PROGRESS_EVERY_S seconds and one at the end."""

    def __init__(self, name: str, rows: int):
        self.name, self.total, self.done = name, rows, 0
        self.started = self.last = time.time()

    def add(self, rows: int) -> None:
        self.done += rows
        now = time.time()
        if now - self.last < PROGRESS_EVERY_S and self.done < self.total:
            return
        self.last, rate = now, self.done / max(now - self.started, 1e-9)
        eta = (self.total - self.done) / rate if rate else 0.0
        log.info(f"prepare {self.name}: {self.done:,}/{self.total:,} rows, {rate:,.0f} rows/s, ETA {eta:.0f} s")


class UnitPreparer:
    """A Ray Data actor (or, for one unit, the driver): takes the driver's tokenizer (app.data.tokens) or else loads
    it once, then encodes units of any source (an encoder per source: its format and template) and writes their
    arrays into the temporary folder."""

    def __init__(self, config: dict, sources: list[dict], split: str, folder: str, tokenizer=None, threads=None):
        if threads:
            # An actor holds `threads` CPUs: the tokenizer's thread pool (rayon's, sized once, on first use) takes
            # no more, or 16 actors of 1 CPU would each start 16 threads on a 16-core node.
            os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
        cfg = TrainingConfig.model_validate(config)
        if tokenizer is None:
            from app.model import load_tokenizer

            tokenizer = load_tokenizer(cfg.model)
        self.tokenizer = tokenizer
        self.sources, self.encoders, self.schemas = sources, {}, {}
        self.where = ranges.Where()
        self.packing = cfg.data.packing
        self.split, self.folder = split, Path(folder)
        self.node = _node()

    def encoder(self, n: int) -> UnitEncoder:
        if n not in self.encoders:
            source = self.sources[n]
            d = DataConfig.model_validate(source["data"])
            self.where.fallback[n] = locator(d, source["numbered_in"])
            locate = functools.partial(self.where, n)
            self.encoders[n] = UnitEncoder(d, source["fmt"], self.tokenizer, locate)
        return self.encoders[n]

    def rows(self, item: dict[str, Any]) -> dict[str, list]:
        """The unit's rows: read from their files by its descriptor (noting where each came from), else sent."""
        rows, source = item["rows"], int(item["source"])
        parts = item.get("parts")
        if parts:
            import pyarrow as pa

            unit = json.loads(parts) if isinstance(parts, str) else parts
            if source not in self.schemas:
                self.schemas[source] = pa.ipc.read_schema(pa.py_buffer(self.sources[source]["schema"]))
            found, places = ranges.read(unit, self.schemas[source])
            self.where.known[source] = dict(zip(ranges.expand(unit["numbers"]), places))
            return found
        if isinstance(rows, (bytes, bytearray, memoryview)):
            import pyarrow as pa

            rows = pa.ipc.open_stream(rows).read_all()
        return rows.to_pydict()

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        source = int(item["source"])
        faults.maybe_slow_prepare()  # test-only: off unless FINETUNE_FAULT_SLOW_PREPARE
        try:
            unit = self.encoder(source)(self.rows(item))
        except Problem as exc:  # a bad row: the driver raises it as it is, not inside Ray's task error
            return {"result": json.dumps({"problem": [exc.field, exc.value, exc.message, exc.fix]})}
        written = write_unit(self.folder, self.split, int(item["unit"]), unit.arrays())
        layout = layout_of(self.sources[source]["fmt"], self.packing)
        result = {"unit": int(item["unit"]), "source": source, "layout": layout, "counts": unit.counts}
        result.update(arrays=list(unit.arrays()), bytes=written, node=self.node)
        return {"result": json.dumps(result)}


def _node() -> str:
    """This process's Ray node (its id's first 12 characters) and host, for the manifest."""
    host = socket.gethostname()
    if not _ray_up():
        return f"{host} (no Ray cluster)"
    import ray

    return f"{host} node {ray.get_runtime_context().get_node_id()[:12]}"


def nodes_of(results: dict[str, dict]) -> dict[str, int]:
    """{node: units it prepared} over every split."""
    out: dict[str, int] = {}
    for split in results.values():
        for node in split.pop("nodes"):
            out[node] = out.get(node, 0) + 1
    return dict(sorted(out.items()))
