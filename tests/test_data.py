"""Tokenization, masking, packing and the resumable sampler, on the bundled corpus."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import CORPUS
from transformers import AutoTokenizer

from app import data
from app.config import DataConfig


def tokenized(tiny_model, **kw):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.pad_token = tok.eos_token
    cfg = DataConfig(dataset=str(CORPUS), split="train[:200]", seq_length=48, **kw)
    return tok, cfg, data.tokenize(data.load_split(cfg, cfg.split), tok, cfg)


def test_packing_fills_every_sequence(tiny_model):
    tok, cfg, ds = tokenized(tiny_model, packing=True)
    loader = data.make_loader(ds, 8, 1, 0, True, 0, 0)
    for batch in loader:
        assert batch["input_ids"].shape == (8, cfg.seq_length)
        assert "attention_mask" not in batch  # no padding anywhere, so no mask to compute
        assert (batch["labels"] != -100).all()
        assert torch.equal(batch["labels"], batch["input_ids"])
    # Documents are joined with EOS between them, and nothing else is inserted.
    ids = ds[0]["input_ids"].tolist()
    first_doc = tok(data.load_split(cfg, cfg.split)[0]["text"], add_special_tokens=False)["input_ids"]
    assert ids[: len(first_doc) + 1] == first_doc + [tok.eos_token_id]


def test_padding_never_reaches_the_loss(tiny_model):
    tok, cfg, ds = tokenized(tiny_model, packing=False)
    padded = 0
    for row in ds:
        mask, labels, ids = row["attention_mask"], row["labels"], row["input_ids"]
        assert len(ids) == cfg.seq_length
        assert (labels[mask == 0] == -100).all()  # every padding position is ignored by the loss
        assert torch.equal(labels[mask == 1], ids[mask == 1])  # every real token is trained on
        padded += int((mask == 0).sum())
    assert padded > 0  # the corpus' short headlines really are padded


def test_padded_loss_equals_loss_over_real_tokens_only(tiny_model):
    from transformers import AutoModelForCausalLM

    tok, cfg, ds = tokenized(tiny_model, packing=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    row = ds[0]
    n = int(row["attention_mask"].sum())
    with torch.no_grad():
        padded = model(
            input_ids=row["input_ids"][None], attention_mask=row["attention_mask"][None], labels=row["labels"][None]
        ).loss
        alone = model(input_ids=row["input_ids"][None, :n], labels=row["input_ids"][None, :n]).loss
    assert torch.allclose(padded, alone, atol=1e-5)


def test_sampler_resumes_at_the_exact_sample(tiny_model):
    _, _, ds = tokenized(tiny_model, packing=True)
    for rank in (0, 1):
        full = data.ResumableSampler(ds, 2, rank, True, seed=7)
        full.set_position(epoch=3, samples_done=0)
        order = list(full)
        resumed = data.ResumableSampler(ds, 2, rank, True, seed=7)
        resumed.set_position(epoch=3, samples_done=5)
        assert list(resumed) == order[5:] and len(resumed) == len(order) - 5
    other_epoch = data.ResumableSampler(ds, 2, 0, True, seed=7)
    other_epoch.set_position(epoch=4, samples_done=0)
    assert list(other_epoch) != order


@pytest.mark.parametrize("n,world,micro", [(5, 2, 4), (3, 4, 2), (8, 2, 4), (0, 2, 4)])
def test_eval_covers_the_whole_split_once_with_as_many_batches_on_every_rank(n, world, micro):
    """Every eval sample's labels count exactly once over the ranks, every rank runs as many batches (ZeRO-3's
    gathers), and a split smaller than world x micro-batch still gives batches (drop_last gave it none: 5
    conversations on 2 workers of micro-batch 4 reported an eval loss of 0.0)."""
    rows = [{"input_ids": torch.full((4,), i), "labels": torch.full((4,), i)} for i in range(n)]
    loaders = [list(data.make_eval_loader(rows, micro, world, rank)) for rank in range(world)]
    assert len({len(batches) for batches in loaders}) == 1 and (n == 0 or len(loaders[0]) >= 1)
    counted = sorted(
        int(label) for batches in loaders for batch in batches for label in batch["labels"][:, 0] if label != -100
    )
    assert counted == list(range(n))


def test_cache_key_changes_with_what_shapes_the_data():
    a = DataConfig(dataset="x", seq_length=64)
    assert data.cache_key(a, "tok", "train", 1) == data.cache_key(
        DataConfig(dataset="x", seq_length=64), "tok", "train", 1
    )
    assert data.cache_key(a, "tok", "train", 1) != data.cache_key(
        DataConfig(dataset="x", seq_length=65), "tok", "train", 1
    )
    assert data.cache_key(a, "tok", "train", 1) != data.cache_key(
        DataConfig(dataset="x", seq_length=64, packing=False), "tok", "train", 1
    )


def test_local_sources(tmp_path):
    import datasets

    (tmp_path / "a.csv").write_text("text\nhello world\nsecond line\n")
    cfg = DataConfig(dataset=str(tmp_path / "*.csv"), split="train")
    assert data.check_source(cfg) == []
    assert len(data.load_split(cfg, "train")) == 2
    (tmp_path / "t.txt").write_text("one\ntwo\nthree\n")
    assert "mixes kinds" in str(data.check_source(DataConfig(dataset=str(tmp_path), split="train"))[0])
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(10)]})}).save_to_disk(
        str(saved)
    )
    assert len(data.load_split(DataConfig(dataset=str(saved)), "train[:30%]")) == 3
    assert "no json" in str(data.check_source(DataConfig(dataset=str(tmp_path / "nothing-*.json")))[0])


# Folder layouts (paths of data files, plus files that are not data) and the splits datasets makes of them.
LAYOUTS = {
    "flat": ["a.jsonl", "b.jsonl", "README.md"],
    "split files": ["train.jsonl", "validation.jsonl", "test.jsonl", "dataset_info.json"],
    "keywords inside names": ["my_train.jsonl", "my-dev.jsonl", "eval.jsonl", "train2.jsonl"],
    "no keyword standing alone": ["retrain.jsonl", "trainval.jsonl", "Train.jsonl"],
    "split folders": ["train/a.jsonl", "train/b.jsonl", "test/c.jsonl", "notes/train.jsonl"],
    "keyword folders": ["training_set/x.jsonl", "set-val/y.jsonl", "other/z.jsonl"],
    "hub shards": [
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "data/test-00000-of-00001.parquet",
        "data/other.parquet",
        "README.md",
    ],
    "hidden and special": ["a.jsonl", ".hidden/test.jsonl", "__pycache__/test.jsonl", ".test.jsonl"],
    "compressed": ["train.jsonl.gz", "test.jsonl.xz", "validation.jsonl.bz2"],
    "a folder's keyword wins over names": ["foo/bar_test/x.jsonl", "foo/y_train.jsonl"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_folder_splits_as_datasets_splits_it(tmp_path, layout):
    """app.data.files' rule against datasets' own (load_dataset(folder) resolves its files this way): a folder's
    test split is never trained on as part of train."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    from app.data import files as data_files

    for name in LAYOUTS[layout]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('{"text": "x"}\n')
    theirs = DataFilesDict.from_patterns(get_data_patterns(str(tmp_path)), base_path=str(tmp_path))
    expected = {split: sorted(str(f) for f in files) for split, files in theirs.items()}
    assert data_files.split_files(str(tmp_path)) == expected
    assert list(data_files.split_files(str(tmp_path))) == list(expected)  # train, validation, test, others


CARD = """---
license: mit
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
- config_name: by_folder
  data_dir: sub
- config_name: one_pattern
  data_files: "*/test-*.jsonl"
---
# A card as `hf download` leaves it
"""


@pytest.mark.parametrize("config", ["main", "socratic", "by_folder", "one_pattern"])
def test_a_downloaded_hub_folder_reads_its_cards_config_as_datasets_does(tmp_path, config):
    """A hub dataset downloaded with its card: each config's files are those datasets.load_dataset(folder, config)
    reads (gsm8k's main and socratic configs, in one folder, are never mixed)."""
    import datasets

    from app.data import files as data_files

    for name in [
        "main/train-00000-of-00001.jsonl",
        "main/test-00000-of-00001.jsonl",
        "socratic/train-0.jsonl",
        "sub/train.jsonl",
        "sub/validation.jsonl",
        "sub/other/test.jsonl",
    ]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('{"text": "x"}\n')
    (tmp_path / "README.md").write_text(CARD)
    theirs = datasets.load_dataset_builder(str(tmp_path), config).config.data_files
    expected = {split: sorted(str(f) for f in files) for split, files in theirs.items()}
    assert data_files.split_files(str(tmp_path), config) == expected


def test_a_config_the_folder_does_not_have_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "main").mkdir()
    (tmp_path / "main" / "train-0.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "README.md").write_text(CARD)
    wrong = data.check_source(DataConfig(dataset=str(tmp_path), config_name="mian"))
    assert [(p.field, p.fix) for p in wrong] == [("data.config_name", "did you mean 'main'?")]
    several = data.check_source(DataConfig(dataset=str(tmp_path)))
    assert [p.field for p in several] == ["data.config_name"] and "marks none default" in str(several[0])
    (tmp_path / "README.md").unlink()
    none = data.check_source(DataConfig(dataset=str(tmp_path), config_name="main"))
    assert [(p.field, p.fix) for p in none] == [("data.config_name", "remove data.config_name")]


def test_a_folder_trains_on_its_train_split_only(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(f'{{"text": "train row {i}"}}\n' for i in range(6)))
    (tmp_path / "test.jsonl").write_text("".join(f'{{"text": "test row {i}"}}\n' for i in range(4)))
    cfg = DataConfig(dataset=str(tmp_path), split="train", eval_split="test", eval_fraction=0)
    assert data.check_source(cfg) == []
    assert data.load_split(cfg, "train")["text"] == [f"train row {i}" for i in range(6)]
    assert data.load_split(cfg, "test")["text"] == [f"test row {i}" for i in range(4)]
    assert len(data.load_split(cfg, "train[:50%]+test")) == 7
    assert data.row_location(str(tmp_path), "test", 2) == f"{tmp_path / 'test.jsonl'} line 3"
    from app.data.files import folder_splits  # the run's summary line says what it reads

    assert folder_splits(str(tmp_path), None, "train[:50%]") == "train: 1 file; also in the folder: test"
    assert folder_splits(str(tmp_path), None, "train+test") == "train+test: 2 files"
    assert folder_splits(str(tmp_path / "train.jsonl"), None, "train") is None


def test_compressed_and_byte_order_marked_files_read_as_datasets_reads_them(tmp_path):
    import bz2
    import gzip

    from app.preflight import count_rows

    rows = "".join(f'{{"text": "row {i}"}}\n' for i in range(5))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    (tmp_path / "b.csv.bz2").write_bytes(bz2.compress(b"text\none\ntwo\n"))
    (tmp_path / "c.jsonl").write_bytes(b"\xef\xbb\xbf" + rows.encode())  # a Windows editor's byte-order mark
    (tmp_path / "d.json").write_bytes(b"\xef\xbb\xbf[" + b",".join(b'{"text": "x"}' for _ in range(3)) + b"]")
    for name, kind, n in [
        ("a.jsonl.gz", "json", 5),
        ("b.csv.bz2", "csv", 2),
        ("c.jsonl", "json", 5),
        ("d.json", "json", 3),
    ]:
        cfg = DataConfig(dataset=str(tmp_path / name), split="train")
        assert data.check_source(cfg) == [], name
        assert len(data.load_split(cfg, "train")) == n == count_rows(str(tmp_path / name), kind), name
    (tmp_path / "e.jsonl.gz").write_bytes(b"not gzip at all")
    problem = data.check_source(DataConfig(dataset=str(tmp_path / "e.jsonl.gz")))[0]
    assert problem.field == "data.dataset" and "cannot be decompressed" in str(problem)
    (tmp_path / "h.tsv").write_text("text\tlabel\nfirst, with a comma\t1\nsecond\t0\n")
    (tmp_path / "i.ndjson").write_text(rows)
    for name, n in [("h.tsv", 2), ("i.ndjson", 5)]:
        cfg = DataConfig(dataset=str(tmp_path / name), split="train")
        assert data.check_source(cfg) == [], name
        assert len(data.load_split(cfg, "train")) == n, name
    assert data.load_split(DataConfig(dataset=str(tmp_path / "h.tsv")), "train")["text"][0] == "first, with a comma"
    problem = data.check_source(DataConfig(dataset=str(tmp_path / "*.?sv*")))[0]  # b.csv.bz2 and h.tsv
    assert "mixes kinds of files (csv, tsv)" in str(problem)
    os.mkfifo(tmp_path / "g.jsonl")  # reading one would wait for a writer for ever
    problem = data.check_source(DataConfig(dataset=str(tmp_path / "g.jsonl")))[0]
    assert "g.jsonl is not a file" in str(problem)
    (tmp_path / "f.parquet.gz").write_bytes(b"x")
    problem = data.check_source(DataConfig(dataset=str(tmp_path / "*.gz")))[0]
    assert "f.parquet.gz is not a data file" in str(problem)


@pytest.mark.parametrize("source", ["folder", "random-init"])
def test_model_dropout_overrides_every_dropout_rate_of_the_config(tiny_model, source):
    from app.config import ModelConfig
    from app.model import load_model

    name = str(tiny_model) if source == "folder" else f"random-init:{tiny_model}"
    model = load_model(ModelConfig(name_or_path=name, dropout=0.25), {})
    rates = {k: v for k, v in model.config.to_dict().items() if "dropout" in k or k.endswith("pdrop")}
    assert rates and set(rates.values()) == {0.25}, rates
    assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {0.25}
    assert {
        m.p for m in load_model(ModelConfig(name_or_path=name), {}).modules() if isinstance(m, torch.nn.Dropout)
    } == {0.1}


def test_random_init_builds_the_shape_without_its_weights(tiny_model, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    from app.cli import main
    from app.config import ModelConfig
    from app.model import load_model

    fresh = load_model(ModelConfig(name_or_path=f"random-init:{tiny_model}"), {})
    saved = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert fresh.config.n_embd == saved.config.n_embd
    assert not torch.equal(fresh.transformer.h[0].mlp.c_fc.weight, saved.transformer.h[0].mlp.c_fc.weight)
    args = [
        "--set",
        f"model.name_or_path=random-init:{tiny_model}",
        "--set",
        f"experiment.storage_path={tmp_path}",
        "--set",
        "data.seq_length=64",
        "--ds-config-only",
    ]
    assert main(["validate", *args]) == 0
    assert '"stage3_param_persistence_threshold": 640' in capsys.readouterr().out  # 10 x the hidden size, read offline


def test_loader_clock_counts_only_the_time_blocked_on_the_loader():
    import time

    from app.data import LoaderClock

    def slow_loader():
        for i in range(4):
            time.sleep(0.05)
            yield i

    clock = LoaderClock()
    seen = []
    for batch in clock.timed(slow_loader()):
        time.sleep(0.05)  # the training step: not counted
        seen.append(batch)
    waited = clock.take()
    assert seen == [0, 1, 2, 3]
    assert 0.19 <= waited < 0.35, waited  # 4 x 50 ms of loader, not the 4 x 50 ms of steps
    assert clock.take() == 0.0
