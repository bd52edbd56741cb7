"""Prepared datasets (app.data.pipeline, app.data.store): made by Ray Data on a real local Ray cluster or in this
process, byte-identical however many CPUs made them, shared by experiments over the same data, compact, and never
left half-written."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from conftest import CORPUS

from app import data
from app.config import DataConfig, Problem, TrainingConfig
from app.data import checks, pipeline, store

CHAT = CORPUS.parent / "tiny-chat.jsonl"


def config(tmp_path: Path, model: Path, name: str = "exp", **data_fields) -> TrainingConfig:
    fields = {"dataset": str(CORPUS), "split": "train", "seq_length": 48, **data_fields}
    return TrainingConfig.model_validate(
        {
            "experiment": {"name": name, "storage_path": str(tmp_path / "storage")},
            "model": {"name_or_path": str(model)},
            "data": fields,
            "scaling": {"num_workers": 1, "use_gpu": False},
        }
    )


def chat_config(tmp_path: Path, model: Path, **fields) -> TrainingConfig:
    fields = {"dataset": str(CHAT), "format": "chat", "chat_template": "zephyr", "seq_length": 128, **fields}
    return config(tmp_path, model, **fields)


def hashes(folder: Path) -> dict[str, str]:
    """Every file of a prepared dataset but its manifest (which records times and nodes), by its path."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*.npy"))
    }


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def without_ray():
    import ray

    return not ray.is_initialized()


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_the_same_key_gives_the_same_bytes_on_any_number_of_cpus(tiny_model, tmp_path, monkeypatch, ray_cluster, kind):
    """Units of 150 rows: the bundled data is 4-14 units, encoded by 1 or 2 Ray Data actors, and by this process
    alone; every file is byte-identical, and the blocks equal those `data.tokenize` makes in memory."""
    monkeypatch.setattr(pipeline, "UNIT_ROWS", 150)
    make = chat_config if kind == "chat" else config
    folders = []
    for n, cpus in enumerate([1, 2]):
        cfg = make(tmp_path / f"run{n}", tiny_model, num_proc=cpus)
        folder, manifest = pipeline.ensure(cfg)
        assert len(manifest["splits"]["train"]["units"]) > 3
        folders.append(folder)
    assert folders[0].name == folders[1].name  # data.num_proc is not part of the key
    assert hashes(folders[0]) == hashes(folders[1]) and len(hashes(folders[0])) > 3
    ray_cluster.shutdown()  # the same preparation in this process alone
    try:
        assert without_ray()
        folder, _ = pipeline.ensure(make(tmp_path / "alone", tiny_model))
    finally:
        ray_cluster.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    assert hashes(folder) == hashes(folders[0])

    # What training reads equals the in-memory path's blocks (the same encoder, unit by unit).
    from app.model import load_tokenizer

    cfg = make(tmp_path / "mem", tiny_model)
    memory = data.tokenize(data.load_split(cfg.data, "train"), load_tokenizer(cfg.model), cfg.data)
    prepared = store.PreparedSplit.open(folders[0], "train")
    assert len(prepared) == len(memory) > 10
    for i in range(len(prepared)):
        a, b = prepared[i], memory[i]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), i


def by_datasets(monkeypatch, cfg: TrainingConfig) -> tuple[Path, dict]:
    """The preparation with every split read by `datasets` in the driver (the path before app.data.ranges)."""
    with monkeypatch.context() as m:
        m.setattr(pipeline.ranges, "plan", lambda d, expression, scratch=None: None)
        return pipeline.ensure(cfg)


def awkward_chat(folder: Path, optional_key: bool = False) -> Path:
    """The bundled conversations as two files, with what a reader by range must get as `datasets` does: a BOM, blank
    lines, CRLF endings, an integer column that is a float later on and, with `optional_key`, a message key (name)
    only a few rows have (null in the others: the blank line stops datasets' check for mixed struct types)."""
    rows = [json.loads(line) for line in CHAT.read_text().splitlines()]
    for n, row in enumerate(rows):
        row["score"] = float(n) if n > 450 else n
        if optional_key and n % 97 == 5:
            row["messages"][0]["name"] = f"speaker{n}"
    folder.mkdir()
    lines = [json.dumps(row) for row in rows]
    (folder / "train-a.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines[:280]).encode() + b"\n\n")
    (folder / "train-b.jsonl").write_bytes(b"\r\n".join(line.encode() for line in lines[280:]) + b"\r\n   \r\n")
    return folder


def as_parquet(source: Path, file: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in source.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), file, row_group_size=70)
    return file


# Each reader (JSON Lines, chat, parquet) in the unit suite; awkward files (BOM, CRLF, blank lines), the split
# expressions and a mixture, which change which bytes and row numbers a unit reads, with `make test-all` (the unit
# suite's 20 minutes).
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "case",
    [
        "text",
        "chat",
        pytest.param("awkward", marks=SLOW),
        "parquet",
        pytest.param("sliced", marks=SLOW),
        pytest.param("eval_split", marks=SLOW),
        pytest.param("mixture", marks=SLOW),
    ],
)
def test_rows_read_by_range_are_the_bytes_datasets_reads(tiny_model, tmp_path, monkeypatch, ray_cluster, case):
    """Units of 150 rows (several a file, some across two files) read by the Ray Data actors from their files give
    every file `datasets`' reading in the driver gives, and the same manifest counts."""
    monkeypatch.setattr(pipeline, "UNIT_ROWS", 150)
    split = {"sliced": "train[10%:85%]", "eval_split": "train[:450]"}.get(case, "train")
    fields = {"split": split, "num_proc": 2} | ({"eval_split": "train[450:]"} if case == "eval_split" else {})
    if case == "text":
        cfg = config(tmp_path, tiny_model, **fields)
    elif case == "mixture":
        cfg = mixture(tmp_path, tiny_model, num_proc=2)
    else:
        data = {
            "awkward": lambda: awkward_chat(tmp_path / "awkward", optional_key=True),
            "parquet": lambda: as_parquet(CHAT, tmp_path / "chat.parquet"),
        }.get(case, lambda: CHAT)()
        cfg = chat_config(tmp_path, tiny_model, dataset=str(data), **fields)
    planned = []
    real = pipeline.ranges.plan
    monkeypatch.setattr(pipeline.ranges, "plan", lambda d, e, s=None: planned.append(real(d, e, s)) or planned[-1])
    folder, manifest = pipeline.ensure(cfg)
    assert planned and all(p is not None for p in planned)  # every split was read by range
    if case == "awkward":  # without a blank line, datasets 5 reads such keys as JSON text: left to it
        mixed = tmp_path / "mixed.jsonl"
        rows = (tmp_path / "awkward" / "train-b.jsonl").read_text().splitlines()
        mixed.write_text("".join(row + "\n" for row in rows if row.strip()))
        assert pipeline.ranges.plan(DataConfig(dataset=str(mixed), format="chat"), "train") is None
    assert len(manifest["splits"]["train"]["units"]) > 2
    before = hashes(folder)
    store.remove_tree(folder)
    again, old = by_datasets(monkeypatch, cfg)
    assert hashes(again) == before and len(before) > 3
    assert old["sources"] == manifest["sources"]
    for name, found in manifest["splits"].items():
        assert {k: v for k, v in found.items() if k != "units"} == {
            k: v for k, v in old["splits"][name].items() if k != "units"
        }


def test_a_second_experiment_reuses_the_prepared_dataset(tiny_model, tmp_path, caplog):
    first = config(tmp_path, tiny_model, name="first")
    folder, manifest = pipeline.ensure(first)
    written = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    second = first.model_copy(deep=True)
    second.experiment.name, second.train.learning_rate, second.scaling.num_workers = "second", 1e-4, 2
    with caplog.at_level(logging.INFO, logger="finetune"):
        again, _ = pipeline.ensure(second)
    assert again == folder and "prepared data: reusing" in caplog.text
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == written  # nothing written again
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
    assert folder.parent == Path(first.experiment.storage_path) / "prepared"


def test_the_key_covers_what_changes_the_bytes_and_nothing_else(tiny_model, tmp_path):
    base = config(tmp_path, tiny_model)
    key = pipeline.key_of(base)
    same = base.model_copy(deep=True)
    same.experiment.name, same.train.learning_rate, same.train.epochs = "other", 1e-3, 3
    same.scaling.num_workers, same.data.shuffle, same.data.num_proc = 4, False, 3
    assert pipeline.key_of(same) == key
    for field, value in [("seq_length", 64), ("packing", False), ("format", "text"), ("chat_template", "chatml")]:
        changed = base.model_copy(deep=True)
        setattr(changed.data, field, value)
        assert pipeline.key_of(changed) != key, field
    copy = tmp_path / "copy.jsonl"  # the same rows in another file: other data as far as the key knows
    copy.write_bytes(CORPUS.read_bytes())
    other = base.model_copy(deep=True)
    other.data.dataset = str(copy)
    assert pipeline.key_of(other) != key
    tokenizer = tmp_path / "tok"  # the same tokenizer files elsewhere: the same key; another vocabulary: not
    tokenizer.mkdir()
    for name in pipeline.TOKENIZER_FILES:
        if (tiny_model / name).exists():
            (tokenizer / name).write_bytes((tiny_model / name).read_bytes())
    moved = base.model_copy(deep=True)
    moved.model.tokenizer = str(tokenizer)
    assert pipeline.key_of(moved) == key
    config_file = tokenizer / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_max_length": 7}))
    assert pipeline.key_of(moved) != key


def test_a_bad_row_beyond_the_sample_ends_preparation_with_its_file_and_line(
    tiny_model, tmp_path, monkeypatch, ray_cluster
):
    monkeypatch.setattr(pipeline, "UNIT_ROWS", 100)
    monkeypatch.setattr(checks, "SAMPLE_ROWS", 50)
    rows = CHAT.read_text().splitlines()
    rows[333] = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    bad = tmp_path / "chat.jsonl"
    bad.write_text("\n".join(rows) + "\n")
    cfg = chat_config(tmp_path, tiny_model, dataset=str(bad))
    assert data.check_source(cfg.data, cfg.model) == []  # the checks' sample (50 rows here) is fine
    with pytest.raises(Problem) as caught:
        pipeline.ensure(cfg)
    assert caught.value.value == f"{bad} line 334" and "has no assistant turn" in caught.value.message
    assert list((tmp_path / "storage" / "prepared").iterdir()) == []  # no temporary folder left behind


@pytest.mark.parametrize("bad", ["not_json", "after_blank_lines", "parquet"])
def test_a_bad_row_an_actor_reads_is_named_by_the_file_and_line_of_its_descriptor(
    tiny_model, tmp_path, monkeypatch, ray_cluster, bad
):
    """Rows read by range: the place of a bad row beyond the checks' sample comes from the unit's descriptor (the
    second file of two, after blank lines, or a parquet row), as the whole-split reading named it."""
    monkeypatch.setattr(pipeline, "UNIT_ROWS", 100)
    monkeypatch.setattr(checks, "SAMPLE_ROWS", 50)
    rows = CHAT.read_text().splitlines()
    rows[433] = "{not json" if bad == "not_json" else json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train-1.jsonl").write_text("\n".join(rows[:300]) + "\n")
    second = folder / "train-2.jsonl"
    second.write_text("\n\n" * (bad == "after_blank_lines") + "\n".join(rows[300:]) + "\n")
    dataset, where = folder, f"{second} line {433 - 300 + 1 + 2 * (bad == 'after_blank_lines')}"
    if bad == "parquet":
        (folder / "train-1.jsonl").unlink()
        dataset = as_parquet(second, tmp_path / "chat.parquet")
        second.unlink()
        where = f"{dataset} row {433 - 300 + 1}"
    cfg = chat_config(tmp_path, tiny_model, dataset=str(dataset), num_proc=2)
    assert pipeline.ranges.plan(cfg.data, "train") is not None
    with pytest.raises(Problem) as caught:
        pipeline.ensure(cfg)
    if bad == "not_json":
        assert caught.value.value == str(second) and caught.value.message.startswith("line 134 is not JSON")
    else:
        assert caught.value.value == where and "has no assistant turn" in caught.value.message
    assert list((tmp_path / "storage" / "prepared").iterdir()) == []


def test_a_failed_write_leaves_nothing_and_the_next_run_prepares_from_scratch(tiny_model, tmp_path, monkeypatch):
    real = store.write_unit
    calls = []

    def write_then_fail(*args):
        calls.append(real(*args))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline, "write_unit", write_then_fail)
    cfg = config(tmp_path, tiny_model)
    with pytest.raises(OSError, match="No space left"):
        pipeline.ensure(cfg)
    assert calls and list((tmp_path / "storage" / "prepared").iterdir()) == []
    monkeypatch.setattr(pipeline, "write_unit", real)
    folder, manifest = pipeline.ensure(cfg)
    assert manifest["splits"]["train"]["blocks"] > 0 and (folder / store.MANIFEST).exists()


def test_a_deleted_prepared_dataset_is_prepared_again_to_the_same_bytes(tiny_model, tmp_path):
    cfg = chat_config(tmp_path, tiny_model, eval_fraction=0.1)
    folder, manifest = pipeline.ensure(cfg)
    before = hashes(folder)
    store.remove_tree(folder)
    again, _ = pipeline.ensure(cfg)
    assert again == folder and hashes(again) == before
    assert manifest["splits"]["eval"]["rows"] == 60 and manifest["splits"]["train"]["rows"] == 540


def test_too_few_tokens_for_one_packed_block_is_named_and_nothing_is_kept(tiny_model, tmp_path):
    cfg = config(tmp_path, tiny_model, split="train[:3]", seq_length=1024)
    with pytest.raises(Problem, match=r"data.seq_length: the split yields no training sequence \(packing keeps"):
        pipeline.ensure(cfg)
    assert list((tmp_path / "storage" / "prepared").iterdir()) == []


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_a_split_of_empty_answers_is_named_once_prepared_and_nothing_is_kept(tiny_model, tmp_path, packing):
    """What the checks cannot read (a hub dataset, the rows a split's slice keeps) is judged once prepared: a
    split whose every answer is empty (each one's end-of-turn token its only target) is refused naming the data,
    not trained on (packed) nor reported as too short a seq_length (padded, where each is a single target); a
    split with some empty answers prepares and counts them."""
    ask = {"role": "user", "content": "Who won?"}
    empty = {"messages": [ask, {"role": "assistant", "content": " "}]}
    path = tmp_path / "chat.jsonl"
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in [empty] * 6 + [{"messages": [ask, {**ask, "role": "assistant"}]}])
    )
    cfg = chat_config(tmp_path, tiny_model, dataset=str(path), split="train[:6]", packing=packing)
    with pytest.raises(Problem, match=r"^data.dataset: every assistant answer in split train\[:6\] is empty") as e:
        pipeline.ensure(cfg)
    assert "data.train_on_prompt=true" in e.value.fix
    assert list((tmp_path / "storage" / "prepared").iterdir()) == []
    _, manifest = pipeline.ensure(chat_config(tmp_path, tiny_model, dataset=str(path), packing=packing))
    assert manifest["splits"]["train"]["unanswered"] == 6 and manifest["splits"]["train"]["rows"] == 7


def test_documents_of_a_single_token_unpacked_are_named_once_prepared(tiny_model, tmp_path):
    """Unpacked, a document of one token has nothing to predict and is dropped: a split of only such documents is
    refused naming the data and packing (not data.seq_length, which no length would help)."""
    path = tmp_path / "short.jsonl"
    path.write_text('{"text": "a"}\n' * 4)
    cfg = config(tmp_path, tiny_model, dataset=str(path), packing=False)
    with pytest.raises(Problem, match=r"^data.dataset: every document of split train is a single token") as e:
        pipeline.ensure(cfg)
    assert "data.packing=true" in e.value.fix
    assert list((tmp_path / "storage" / "prepared").iterdir()) == []


@pytest.mark.parametrize("kind,limit", [("text", 4.5), ("chat", 5.0)])
def test_prepared_data_is_compact(tiny_model, tmp_path, kind, limit):
    """Token ids as int32, text's labels and every position derived, chat's targets one byte a token."""
    cfg = chat_config(tmp_path, tiny_model) if kind == "chat" else config(tmp_path, tiny_model)
    folder, manifest = pipeline.ensure(cfg)
    split = manifest["splits"]["train"]
    on_disk = sum(p.stat().st_size for p in (folder / "train").iterdir())
    assert split["bytes"] == on_disk
    assert on_disk / split["tokens"] <= limit, (on_disk, split["tokens"])


def test_the_manifest_says_what_was_read_dropped_and_made(tiny_model, tmp_path):
    rows = CHAT.read_text().splitlines()
    long = {"messages": [{"role": "user", "content": "word " * 2000}, {"role": "assistant", "content": "ok"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join([*rows[:50], json.dumps(long)]) + "\n")
    cfg = chat_config(tmp_path, tiny_model, dataset=str(path), seq_length=512)
    folder, manifest = pipeline.ensure(cfg)
    train = manifest["splits"]["train"]
    assert (train["rows"], train["too_long"], train["documents"]) == (51, 1, 50)
    assert 0 < train["targets"] < train["tokens"] and train["blocks"] == len(store.PreparedSplit.open(folder, "train"))
    assert manifest["sources"] == [
        {"dataset": str(path), "split": "train", "format": "chat", "weight": 1.0, "rows": 51, "taken": 51}
    ]
    assert manifest["layout"] == "blocks" and manifest["format"] == "chat" and manifest["seconds"] >= 0
    assert list(manifest["nodes"].values()) == [1]
    assert os.path.basename(folder) == manifest["key"] == pipeline.key_of(cfg)


def mixture(tmp_path: Path, model: Path, **fields) -> TrainingConfig:
    sources = [
        {"dataset": str(CORPUS), "format": "text", "weight": 3},
        {"dataset": str(CHAT), "format": "chat", "chat_template": "zephyr", "weight": 1},
    ]
    return config(tmp_path, model, datasets=sources, seq_length=128, **fields)


def test_a_mixture_takes_each_source_by_its_weight_with_its_own_format(tiny_model, tmp_path):
    """2,000 news rows at weight 3 and 600 conversations at weight 1: the conversations run out first, at 2,400
    rows in all, so 1,800 news rows and 600 conversations; each source packed its own way, the blocks of both
    readable in one batch, and the same mixture again after the prepared dataset is gone."""
    cfg = mixture(tmp_path, tiny_model)
    folder, manifest = pipeline.ensure(cfg)
    assert [(s["format"], s["rows"], s["taken"]) for s in manifest["sources"]] == [
        ("text", 2000, 1800),
        ("chat", 600, 600),
    ]
    units = manifest["splits"]["train"]["units"]
    assert {(u["source"], u["layout"]) for u in units} == {(0, "stream"), (1, "blocks")}
    assert manifest["format"] == "mixture" and manifest["layout"] == "mixed"
    train = store.PreparedSplit.open(folder, "train")
    text_block, chat_block = train[0], train[len(train) - 1]
    assert set(text_block) == set(chat_block) == {"input_ids", "labels", "position_ids"}
    batch = data.PackedCollator(manifest["eos_id"])([text_block, chat_block])
    assert batch["input_ids"].shape == (2, 128) and (batch["labels"][1] == -100).any()
    before = hashes(folder)
    store.remove_tree(folder)
    assert hashes(pipeline.ensure(cfg)[0]) == before
    other = cfg.model_copy(deep=True)
    other.data.datasets[0].weight = 1
    assert pipeline.key_of(other) != pipeline.key_of(cfg)
    seeded = cfg.model_copy(deep=True)
    seeded.train.seed = 7  # another draw of the rows
    assert pipeline.key_of(seeded) != pipeline.key_of(cfg)


def test_a_mixture_from_the_command_line_and_a_bad_source_named_by_its_index(tiny_model, tmp_path):
    from conftest import run_cli, tiny_overrides

    sources = json.dumps(
        [
            {"dataset": str(CORPUS), "weight": 1},
            {"dataset": str(CHAT), "format": "chat", "chat_template": "zephyr", "weight": 1},
        ]
    )
    args = tiny_overrides(tmp_path, "mix", tiny_model, **{"data.datasets": sources, "data.seq_length": 128})
    done = run_cli("prepare", *args)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "mixture: 600 of 600 rows" in log and "prepared: " in done.stdout, log[-4000:]
    assert "starting a local Ray cluster" in log
    # Again: the dataset of its key is on the volume, found with no cluster started.
    again = run_cli("prepare", *args)
    assert again.returncode == 0 and "prepared data: reusing" in again.stdout + again.stderr, again.stderr[-3000:]
    assert [line for line in again.stdout.splitlines() if line.startswith("prepared: ")] == [
        line for line in done.stdout.splitlines() if line.startswith("prepared: ")
    ]
    assert "starting a local Ray cluster" not in again.stdout + again.stderr
    from app import cli

    assert "data: a mixture of 2 sources: " in cli.summary(mixture(tmp_path, tiny_model), {})
    bad = json.dumps([{"dataset": str(CORPUS)}, {"dataset": str(CHAT), "split": "test"}])
    refused = run_cli("validate", *tiny_overrides(tmp_path, "mix2", tiny_model, **{"data.datasets": bad}))
    assert refused.returncode == 2 and "data.datasets[1].split" in refused.stderr, refused.stderr[-2000:]


def test_status_shows_a_prepared_dataset_and_which_one_an_experiment_reads(tiny_model, tmp_path):
    from conftest import run_cli

    from app import experiment_folder
    from app.checkpoint import write_atomic
    from app.data.manifest import EXPERIMENT_RECORD

    cfg = chat_config(tmp_path, tiny_model, eval_fraction=0.1)
    folder, manifest = pipeline.ensure(cfg)
    shown = run_cli("status", str(folder))
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert f"prepared dataset {folder}: chat, train: 540 rows" in shown.stdout
    assert "left out: too_long" in shown.stdout and "prepared by" in shown.stdout
    as_json = run_cli("status", str(folder), "-o", "json")
    assert json.loads(as_json.stdout)["key"] == folder.name
    run_dir = tmp_path / "storage" / "exp"
    run_dir.mkdir()
    write_atomic(run_dir / EXPERIMENT_RECORD, json.dumps({"prepared": str(folder)}))
    info = experiment_folder.describe(run_dir)
    assert info["data"] == str(folder) and info["data_summary"].startswith("chat, train: 540 rows")
    assert f"data         {folder} (chat" in experiment_folder.render(info)


def test_no_worker_waits_in_a_collective_while_the_data_is_prepared(tiny_model, tmp_path):
    """Preparation that takes longer (30 s) than the process group's timeout (20 s): the workers start once it is
    done, so the run trains. When rank 0 tokenized while the other ranks waited at a barrier, this run died at it."""
    from conftest import run_cli, tiny_overrides

    sets = {"scaling.collective_timeout_s": 20, "train.max_steps_per_epoch": 2}
    done = run_cli(
        "train", *tiny_overrides(tmp_path, "slow", tiny_model, **sets), env={"FINETUNE_FAULT_SLOW_PREPARE": "30"}
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert log.index("prepared data: ") < log.index("starting 2 training workers") and "done: slow" in log


def test_a_descriptor_reads_its_rows_and_nothing_else(tmp_path):
    """Rows picked across anchors, row groups and blank lines read back as those rows, each named by its place."""
    import numpy as np

    from app.data import ranges

    lines = CHAT.read_text().splitlines()
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(line + "\n" * (n % 7 == 3) for n, line in enumerate(lines)) + "\n")
    at = [n + 1 + (n + 3) // 7 for n in range(len(lines))]  # each row's line: a blank one after rows 3, 10, 17...
    parquet = as_parquet(CHAT, tmp_path / "train.parquet")
    picked = np.sort(np.random.default_rng(0).choice(len(lines), 90, replace=False))
    for file, place in ((jsonl, "line"), (parquet, "row")):
        d = DataConfig(dataset=str(file), format="chat")
        split = ranges.plan(d, "train[5:]")
        assert len(split) == len(lines) - 5
        split.numbered = True
        rows, places = ranges.read(split.select(picked).unit(slice(0, 90)), split.schema)
        assert rows["messages"] == [json.loads(lines[n + 5])["messages"] for n in picked]
        assert rows[pipeline.chat.ROW] == picked.tolist()  # the index in the split, not in the file
        numbers = [at[n + 5] if place == "line" else n + 6 for n in picked]
        assert places == [f"{file} {place} {n}" for n in numbers]


def test_the_actors_tokenizer_encodes_as_the_model_tokenizer_and_imports_neither_torch_nor_transformers(
    tiny_model, tmp_path
):
    """app.data.tokens: the driver's backend, pickled to an actor, gives transformers' ids and offsets (special
    tokens in the text, with and without the tokenizer's own added); a conversation unit encoded with it equals
    the transformers tokenizer's, row by row as chat.Encoder encodes one; and a process that unpickles it and
    encodes a unit loads neither torch nor transformers."""
    import pickle
    import subprocess
    import sys

    from app.data import chat, encode, tokens
    from app.model import load_tokenizer

    cfg = chat_config(tmp_path, tiny_model)
    tok = load_tokenizer(cfg.model)
    light = pickle.loads(pickle.dumps(tokens.light(tok, cfg.model)))
    assert light is not None and light._full is None
    texts = [line for line in CORPUS.read_text().splitlines()[:50] if line] + [f"a{tok.eos_token} b\n\n c  "]
    for special in (False, True):
        want = tok(texts, add_special_tokens=special, return_offsets_mapping=True)
        got = light(texts, add_special_tokens=special, return_offsets_mapping=True)
        assert got["input_ids"] == want["input_ids"] and got["offset_mapping"] == want["offset_mapping"]
    rows = [json.loads(line) for line in CHAT.read_text().splitlines()[:40]]
    rows = [{**row, chat.ROW: n} for n, row in enumerate(rows)]
    one = chat.Encoder(cfg.data, "chat", tok, str)
    assert chat.Encoder(cfg.data, "chat", light, str).many(rows) == [one(row) for row in rows]

    columns = {"messages": [row["messages"] for row in rows], chat.ROW: list(range(len(rows)))}
    text = {"text": texts}
    (tmp_path / "tokens.pkl").write_bytes(pickle.dumps((tokens.light(tok, cfg.model), cfg.data, columns, text)))
    script = (
        "import pickle, sys; from app.data import encode; t, d, rows, text = pickle.load(open(sys.argv[1], 'rb')); "
        "plain = d.model_copy(update={'format': 'text'}); a = encode.UnitEncoder(plain, 'text', t, str)(text); "
        "print(a.counts['tokens'], sorted(m for m in ('torch', 'transformers') if m in sys.modules)); "
        "b = encode.UnitEncoder(d, 'chat', t, str)(rows); print(b.counts['tokens'], 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "tokens.pkl")], capture_output=True, text=True, check=True
    )
    plain = cfg.data.model_copy(update={"format": "text"})
    want = [encode.UnitEncoder(plain, "text", tok, str)(text), encode.UnitEncoder(cfg.data, "chat", tok, str)(columns)]
    # Rendering a conversation imports transformers' Jinja renderer (transformers.utils, not its models or torch).
    assert done.stdout.split() == [str(want[0].counts["tokens"]), "[]", str(want[1].counts["tokens"]), "False"], (
        done.stdout + done.stderr
    )
