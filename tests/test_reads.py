"""What app.data.ranges reads beyond plain JSON Lines and parquet (plain-text and compressed files, save_to_disk
folders, csv/tsv files, data.eval_fraction): planned by row range, the driver reading no row with `datasets`, and
prepared to the bytes the driver's `datasets` reading gives, at any parallelism; a bad row named by its file and
line."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
from pathlib import Path

import numpy as np
import pytest
from conftest import CORPUS
from test_prepare import CHAT, by_datasets, chat_config, config, hashes

from app.config import Problem
from app.data import checks, files, pipeline, store
from app.data.files import open_data


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def no_driver_reading(monkeypatch) -> None:
    """The driver may not read a split with `datasets` (load_dataset / load_from_disk, app.data.sources.load_split)."""

    def refused(*args, **kwargs):
        raise AssertionError("the driver read a split with datasets")

    monkeypatch.setattr(pipeline, "load_split", refused)


def text_files(folder: Path) -> Path:
    """The news texts as two .txt files, one gzip-compressed: a BOM, every line ending (\\n, \\r\\n, a lone \\r),
    empty lines and a last line without an ending."""
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:700]]
    endings = ["\n", "\r\n", "\r", "\n\n"]
    body = "".join(t + endings[n % 4] for n, t in enumerate(texts))
    folder.mkdir()
    (folder / "train-1.txt").write_bytes(b"\xef\xbb\xbf" + body[: len(body) // 2].encode())
    (folder / "train-2.txt.gz").write_bytes(gzip.compress(body[len(body) // 2 :].rstrip().encode()))
    return folder


def compressed_chat(folder: Path) -> Path:
    """The conversations as JSON Lines in a .gz, a .bz2 and an .xz file (blank lines and CRLF in one)."""
    lines = CHAT.read_bytes().splitlines()
    folder.mkdir()
    (folder / "train-1.jsonl.gz").write_bytes(gzip.compress(b"\n".join(lines[:250]) + b"\n\n"))
    (folder / "train-2.jsonl.bz2").write_bytes(bz2.compress(b"\r\n".join(lines[250:400]) + b"\r\n"))
    (folder / "train-3.jsonl.xz").write_bytes(lzma.compress(b"\n".join(lines[400:])))
    return folder


def saved_chat(folder: Path) -> Path:
    """The conversations as a DatasetDict saved to disk, its train split in three Arrow files."""
    import datasets

    rows = datasets.load_dataset("json", data_files=str(CHAT), split="train")
    splits = datasets.DatasetDict({"train": rows.select(range(520)), "test": rows.select(range(520, 600))})
    splits.save_to_disk(str(folder), num_shards={"train": 3, "test": 1})
    return folder


def prepared_alike(monkeypatch, make, check) -> None:
    """1 and 2 Ray Data actors, with no split read by the driver, write the files that the driver's `datasets`
    reading writes, with the same manifest counts; `check` looks at each prepared folder before it is removed."""
    found, manifests = [], []
    with monkeypatch.context() as m:
        no_driver_reading(m)
        for cpus in (1, 2):
            folder, manifest = pipeline.ensure(make(num_proc=cpus))
            check(folder)
            found.append(hashes(folder))
            manifests.append(manifest)
            store.remove_tree(folder)
    assert len(manifests[0]["splits"]["train"]["units"]) > 2 and len(found[0]) > 3
    folder, old = by_datasets(monkeypatch, make(num_proc=2))
    assert found[0] == found[1] == hashes(folder)
    assert old["sources"] == manifests[0]["sources"]
    for name, split in manifests[0]["splits"].items():
        assert {k: v for k, v in split.items() if k != "units"} == {
            k: v for k, v in old["splits"][name].items() if k != "units"
        }


def not_kept(folder: Path) -> None:
    assert not files._kept  # the driver closed the compressed files it read (the first row)


def no_scratch(folder: Path) -> None:
    assert not (folder / pipeline.SCRATCH).exists()  # the csv files' Arrow copies are not published


# compressed JSON Lines with a holdout in make test; plain text and a saved folder (whose Arrow reader the csv case
# below also takes) under make test-all, for the unit suite's time.
@pytest.mark.parametrize(
    "case",
    [
        pytest.param("text", marks=pytest.mark.slow),
        "compressed_eval_fraction",
        pytest.param("saved", marks=pytest.mark.slow),
    ],
)
def test_read_by_range_at_any_parallelism_gives_the_bytes_datasets_reads(
    tiny_model, tmp_path, monkeypatch, ray_cluster, case
):
    """Units of 150 rows, several a file and some across two: 1 and 2 Ray Data actors, with no split read by the
    driver, write the files that the driver's `datasets` reading writes, with the same manifest counts."""
    monkeypatch.setattr(pipeline, "UNIT_ROWS", 150)
    if case == "text":
        data = str(text_files(tmp_path / "txt"))
        make = lambda **f: config(tmp_path, tiny_model, dataset=data, **f)  # noqa: E731
    elif case == "saved":
        data = str(saved_chat(tmp_path / "saved"))
        make = lambda **f: chat_config(tmp_path, tiny_model, dataset=data, split="train[10:]", eval_split="test", **f)  # noqa: E731
    else:
        data = str(compressed_chat(tmp_path / "gz"))
        make = lambda **f: chat_config(tmp_path, tiny_model, dataset=data, eval_fraction=0.1, **f)  # noqa: E731
    assert pipeline.ranges.plan(make().data, "train") is not None
    prepared_alike(monkeypatch, make, not_kept)


CSV_CHUNK = 40  # pandas' chunk of rows, for datasets' reading and app.data.csvrows' alike (datasets': 10,000)


def small_csv_chunks(monkeypatch) -> None:
    """datasets' csv options with chunks of CSV_CHUNK rows, in this process (app.data.csvrows passes the driver's
    options to its Ray tasks)."""
    from datasets.packaged_modules.csv import csv as builder

    real = builder.CsvConfig.pd_read_csv_kwargs
    chunked = property(lambda self: {**real.fget(self), "chunksize": CSV_CHUNK})
    monkeypatch.setattr(builder.CsvConfig, "pd_read_csv_kwargs", chunked)


def csv_files(folder: Path, kind: str) -> Path:
    """The news texts with a number column as two csv (or tsv) files of 300 rows, whose later chunks pandas types
    otherwise than the first one, so that datasets' cast to the first chunk's schema changes their values: a chunk
    of the first file and the second file's first chunk have only numbers as texts ('007', '1.50': ints and floats,
    read back as '7' and '1.5'), and the second file has blank numbers (floats, NaN: nulls in an int column); a .gz
    and texts spanning lines (quoted) too."""
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:600]]
    for n in [*range(2 * CSV_CHUNK, 3 * CSV_CHUNK), *range(300, 300 + CSV_CHUNK)]:
        texts[n] = f"{n:04d}" if n % 2 else f"{n}.50"
    texts[7] = texts[7][:40] + "\n" + texts[7][40:]
    folder.mkdir()
    sep = "," if kind == "csv" else "\t"
    for part, rows in ((1, range(300)), (2, range(300, 600))):
        out = io.StringIO()
        writer = csv.writer(out, delimiter=sep, lineterminator="\n")
        writer.writerow(["text", "n"])
        writer.writerows([texts[n], "" if part == 2 and n % 3 == 0 else n] for n in rows)
        body = out.getvalue().encode()
        if part == 2:
            (folder / f"train-2.{kind}.gz").write_bytes(gzip.compress(body))
        else:
            (folder / f"train-1.{kind}").write_bytes(body)
    return folder


@pytest.mark.parametrize("kind", ["csv", "tsv"])
def test_csv_read_by_range_at_any_parallelism_gives_the_bytes_datasets_reads(
    tiny_model, tmp_path, monkeypatch, ray_cluster, kind
):
    """csv/tsv files converted to Arrow by Ray tasks as datasets parses and casts them: 1 and 2 Ray Data actors,
    with no split read by the driver, write the files the driver's `datasets` reading writes, and the prepared
    dataset holds no converted file."""
    monkeypatch.setattr(pipeline, "UNIT_ROWS", 150)
    small_csv_chunks(monkeypatch)
    data = str(csv_files(tmp_path / kind, kind))
    fields = {"eval_fraction": 0.1} if kind == "csv" else {"split": "train[10:]"}
    make = lambda **f: config(tmp_path, tiny_model, dataset=data, **fields, **f)  # noqa: E731
    assert pipeline.ranges.plan(make().data, "train") is None  # without a temporary folder: left to datasets
    prepared_alike(monkeypatch, make, no_scratch)
    scratch = tmp_path / "scratch"
    split = pipeline.ranges.plan(make().data, "train", scratch)
    rows, places = pipeline.ranges.read(split.unit(slice(295, 305)), split.schema)
    assert rows["text"][5:] == ["300.5", "301", "302.5", "303", "304.5"]  # '300.50', '0301'... in the file
    assert rows["n"][5:] == [None, 301, 302, None, 304]
    assert places[0] == f"{data}/train-1.{kind} row 296" and places[5] == f"{data}/train-2.{kind}.gz row 1"


@pytest.mark.parametrize("case", ["fields", "cast"])
def test_a_csv_file_that_cannot_be_read_is_named(tiny_model, tmp_path, monkeypatch, ray_cluster, case):
    """A line of too many fields (pandas names it), a later chunk whose numbers are words (no cast to the first
    chunk's ints): the preparation ends naming the file, and no prepared dataset is left."""
    small_csv_chunks(monkeypatch)
    no_driver_reading(monkeypatch)
    folder = tmp_path / "data"
    folder.mkdir()
    rows = [f"row {n},{n}" for n in range(200)]
    (folder / "train-1.csv").write_text("text,n\n" + "\n".join(rows[:100]) + "\n")
    if case == "fields":
        rows[150] = "row 150,150,extra"
    else:
        rows[160:] = [f"row {n},n{n}" for n in range(160, 200)]
    bad = folder / "train-2.csv"
    bad.write_text("text,n\n" + "\n".join(rows[100:]) + "\n")
    cfg = config(tmp_path, tiny_model, dataset=str(folder), num_proc=2)
    with pytest.raises(Problem) as caught:
        pipeline.ensure(cfg)
    assert caught.value.value == str(bad) and caught.value.message.startswith("cannot be read"), caught.value
    if case == "fields":
        assert "line 52" in caught.value.message, caught.value
    assert list((tmp_path / "storage" / "prepared").iterdir()) == []


@pytest.mark.parametrize("kind", ["text", "compressed", "saved"])
def test_a_bad_row_beyond_the_sample_is_named_by_its_file_and_line(
    tiny_model, tmp_path, monkeypatch, ray_cluster, kind
):
    """Row 434 (beyond the checks' 50) is not UTF-8 (text, in a .gz), has no assistant turn (JSON Lines in a .bz2
    after blank lines; a saved dataset's third Arrow file): the preparation ends with its file and line or row."""
    monkeypatch.setattr(pipeline, "UNIT_ROWS", 100)
    monkeypatch.setattr(checks, "SAMPLE_ROWS", 50)
    no_driver_reading(monkeypatch)
    folder = tmp_path / "data"
    folder.mkdir()
    if kind == "text":
        lines = [json.loads(line)["text"].encode() for line in CORPUS.read_text().splitlines()[:600]]
        lines[433] = b"caf\xe9"  # Latin-1
        (folder / "train-1.txt").write_bytes(b"\n".join(lines[:300]) + b"\n")
        bad = folder / "train-2.txt.gz"
        bad.write_bytes(gzip.compress(b"\r\n".join(lines[300:])))
        cfg = config(tmp_path, tiny_model, dataset=str(folder), num_proc=2)
        value, message = str(bad), "line 134 is not UTF-8"
    else:
        rows = CHAT.read_text().splitlines()
        rows[433] = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        (folder / "train-1.jsonl").write_text("\n".join(rows[:300]) + "\n")
        bad = folder / "train-2.jsonl.bz2"
        bad.write_bytes(bz2.compress(("\n\n" + "\n".join(rows[300:]) + "\n").encode()))
        value, message = f"{bad} line {433 - 300 + 3}", "has no assistant turn"
        if kind == "saved":
            from app.data import saved

            dataset = saved_chat_from(folder, tmp_path / "saved")
            files = saved.files_of(dataset / "train")
            starts = np.cumsum([0] + [saved.count(f) for f in files])
            at = int(np.searchsorted(starts, 433, side="right")) - 1
            folder, value = dataset, f"{files[at]} row {433 - starts[at] + 1}"
        cfg = chat_config(tmp_path, tiny_model, dataset=str(folder), num_proc=2)
    assert pipeline.ranges.plan(cfg.data, "train") is not None
    with pytest.raises(Problem) as caught:
        pipeline.ensure(cfg)
    if kind == "text":
        assert caught.value.value == value and caught.value.message.startswith(message), caught.value
    else:
        assert caught.value.value == value and message in caught.value.message, caught.value
    assert list((tmp_path / "storage" / "prepared").iterdir()) == []


def saved_chat_from(folder: Path, to: Path) -> Path:
    import datasets

    rows = datasets.load_dataset(str(folder), split="train")
    datasets.DatasetDict({"train": rows}).save_to_disk(str(to), num_shards={"train": 3})
    return to


def test_the_held_out_rows_depend_on_the_seed_and_the_rows_only(tiny_model, tmp_path):
    """data.eval_fraction's rows: datasets' count (ceil), both parts in the split's order, the same for a seed
    every time, others for another seed; the rule is in the key of a config that holds rows out, and only there."""
    kept, held = pipeline.holdout(600, 0.1, 42)
    assert len(held) == 60 and len(kept) == 540 and sorted({*kept, *held}) == list(range(600))
    assert list(held) == sorted(held) and list(kept) == sorted(kept)
    again, other = pipeline.holdout(600, 0.1, 42)[1], pipeline.holdout(600, 0.1, 7)[1]
    assert np.array_equal(again, held) and not np.array_equal(other, held)
    assert len(pipeline.holdout(7, 0.25, 0)[1]) == 2
    fraction = chat_config(tmp_path, tiny_model, eval_fraction=0.1)
    assert pipeline.key_fields(fraction)["holdout"] == pipeline.HOLDOUT
    assert "holdout" not in pipeline.key_fields(chat_config(tmp_path, tiny_model))
    monkey = pipeline.key_of(fraction)
    pipeline.HOLDOUT, rule = "another-rule", pipeline.HOLDOUT
    try:
        assert pipeline.key_of(fraction) != monkey
    finally:
        pipeline.HOLDOUT = rule


def test_a_file_the_count_cannot_read_is_left_to_datasets(tmp_path):
    """A .gz that is not gzip, an Arrow file cut short: not planned, so `datasets` reads them and names the error."""
    from app.config import DataConfig

    bad = tmp_path / "train.jsonl.gz"
    bad.write_bytes(b'{"text": "not gzip"}\n')
    assert pipeline.ranges.plan(DataConfig(dataset=str(bad)), "train") is None
    saved = saved_chat(tmp_path / "saved")
    arrow = next((saved / "train").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:300])
    assert pipeline.ranges.plan(DataConfig(dataset=str(saved), format="chat"), "train") is None


@pytest.mark.parametrize("name", ["chat.jsonl", "news.txt"])
def test_units_of_a_compressed_file_read_in_any_order_are_its_rows(tmp_path, monkeypatch, name):
    """Units of a .gz read one after the other open it once (each goes on where the last stopped), and in any order
    (as actors get them, with holes where rows are held out) read the rows and lines of the uncompressed file."""
    from app.config import DataConfig
    from app.data import ranges

    monkeypatch.setattr(ranges, "STRIDE", 7)  # counted here, not by Ray tasks (whose STRIDE is the module's)
    monkeypatch.setattr(ranges, "_remote", lambda fn, calls: [fn(*call) for call in calls])
    if name == "news.txt":
        body = text_files(tmp_path / "txt").joinpath("train-1.txt").read_bytes()
    else:
        body = b"".join(
            line + b"\n\n" * (n % 5 == 0) + b"\r\n" for n, line in enumerate(CHAT.read_bytes().splitlines())
        )
    plain, packed = tmp_path / name, tmp_path / f"{name}.gz"
    plain.write_bytes(body)
    packed.write_bytes(gzip.compress(body))
    fmt = "text" if name == "news.txt" else "chat"
    a, b = (ranges.plan(DataConfig(dataset=str(f), format=fmt), "train") for f in (plain, packed))
    opened = []
    monkeypatch.setattr(files, "open_data", lambda f: opened.append(f) or open_data(f))
    in_order = [ranges.read(b.unit(slice(lo, lo + 40)), b.schema)[0] for lo in range(0, len(b), 40)]
    assert opened == [str(packed)] and in_order == [
        ranges.read(a.unit(slice(lo, lo + 40)), a.schema)[0] for lo in range(0, len(a), 40)
    ]
    rng = np.random.default_rng(0)
    for trial in range(40):
        picked = np.sort(rng.choice(len(a), int(rng.integers(1, 80)), replace=False))
        lo = int(rng.integers(0, len(picked)))
        rows, places = ranges.read(b.select(picked).unit(slice(lo, lo + 25)), b.schema)
        want, where = ranges.read(a.select(picked).unit(slice(lo, lo + 25)), a.schema)
        assert rows == want and places == [p.replace(str(plain), str(packed)) for p in where], trial


def test_an_experiment_that_started_before_the_holdout_rule_resumes_on_its_prepared_dataset(tiny_model, tmp_path):
    """Its record names the key its config had without the rule (train_test_split's rows): its runs read that one,
    nothing is prepared; an experiment without such a record prepares the current key."""
    from app import driver
    from app.data.manifest import EXPERIMENT_RECORD

    cfg = chat_config(tmp_path, tiny_model, eval_fraction=0.1, split="train[:200]")
    folder, _ = pipeline.ensure(cfg)
    fields = pipeline.key_fields(cfg)
    del fields["holdout"]
    earlier = folder.rename(folder.with_name(pipeline.hash_of(fields)))  # as the earlier code named it
    cfg.experiment_dir.mkdir(parents=True)
    (cfg.experiment_dir / EXPERIMENT_RECORD).write_text(json.dumps({"prepared": str(earlier)}))
    assert driver.data_for(cfg) == {"prepared": str(earlier)} and not folder.exists()
    (cfg.experiment_dir / EXPERIMENT_RECORD).unlink()
    assert driver.data_for(cfg) == {"prepared": str(folder)} and folder.exists()
    assert json.loads((cfg.experiment_dir / EXPERIMENT_RECORD).read_text()) == {"prepared": str(folder)}
