"""Hostile configs and messy data, as a new user hands them over: each fails `finetune validate` and `finetune
train` with exit 2 within seconds, before any Ray cluster starts, with one line naming the field, the value and
the fix, and writes nothing; rows without text are skipped and counted, never a crash (issue 14)."""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

import pytest
from conftest import CORPUS

from app.cli import main


def _bomb(levels: int = 10) -> str:
    lines = ["deepspeed:", "  lol:", "    a: &a [x, x, x, x, x, x, x, x, x, x]"]
    prev = "a"
    for name in "bcdefghijk"[: levels - 1]:
        lines.append(f"    {name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")
        prev = name
    return "\n".join(lines) + "\n"


def _parquet(path: Path, columns: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def _saved(path: Path, columns: dict) -> None:
    import datasets

    datasets.Dataset.from_dict(columns).save_to_disk(str(path))


ASK = {"role": "user", "content": "What is 2 and 2?"}


def jsonl(*rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


# name: (config file bytes or None, --set overrides, files to create {name: bytes or callable(path)},
#        text expected in the error line: the field, then the fix)
CASES = {
    # -- the config file itself
    "alias bomb": (_bomb().encode(), [], {}, ("deepspeed.lol", "fewer nested aliases")),
    "alias bomb in --set": (
        None,
        [
            "deepspeed.x=[&a [1,1,1,1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], "
            "&c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]]"
        ],
        {},
        ("deepspeed.x", "fewer nested aliases"),
    ),
    "self-referencing anchor": (b"deepspeed: &a\n  x: *a\n", [], {}, ("deepspeed.x", "self-referencing")),
    "duplicate key": (
        b"train:\n  learning_rate: 1.0e-4\n  learning_rate: 2.0e-4\n",
        [],
        {},
        ("train.learning_rate", "remove one of them"),
    ),
    "duplicate section": (
        b"train:\n  epochs: 1\ndata:\n  seq_length: 64\ntrain:\n  epochs: 2\n",
        [],
        {},
        ("train", "lines 1 and 5"),
    ),
    "latin-1 file": (
        "train:\n  epochs: 1\n# caf\u00e9 r\u00e9sum\u00e9\n".encode("latin-1"),
        [],
        {},
        ("CONFIG", "save it as UTF-8"),
    ),
    "empty file": (b"", [], {}, ("CONFIG", "leave out the file argument")),
    "only comments": (b"# todo\n\n", [], {}, ("CONFIG", "leave out the file argument")),
    "huge file": (b"train:\n  epochs: 1\n" + b"#" * (1 << 20) + b"\n", [], {}, ("CONFIG", "not a data or model file")),
    "binary file": (bytes(range(256)) * 4, [], {}, ("CONFIG", "UTF-8")),
    "control character": (b"train:\n  epochs: \x1f\n", [], {}, ("CONFIG", "fix the syntax")),
    # -- numbers no run means
    "learning_rate .inf": (b"train:\n  learning_rate: .inf\n", [], {}, ("train.learning_rate", "finite number")),
    "learning_rate .nan": (None, ["train.learning_rate=.nan"], {}, ("train.learning_rate", "finite number")),
    "learning_rate 50": (None, ["train.learning_rate=50"], {}, ("train.learning_rate", "within that bound")),
    "max_grad_norm .inf": (None, ["train.max_grad_norm=.inf"], {}, ("train.max_grad_norm", "finite number")),
    "lease_timeout_s .inf": (None, ["experiment.lease_timeout_s=.inf"], {}, ("experiment.lease_timeout_s", "finite")),
    "micro_batch_size 1e12": (
        b"train:\n  micro_batch_size: 1e12\n",
        [],
        {},
        ("train.micro_batch_size", "whole number"),
    ),
    "micro_batch_size 1.0e+12": (
        None,
        ["train.micro_batch_size=1.0e+12"],
        {},
        ("train.micro_batch_size", "from 1 to 65536"),
    ),
    "gradient_accumulation 10^12": (
        None,
        ["train.gradient_accumulation_steps=1000000000000"],
        {},
        ("train.gradient_accumulation_steps", "bound"),
    ),
    "seq_length 10^9": (None, ["data.seq_length=1000000000"], {}, ("data.seq_length", "bound")),
    "num_workers 10^9": (None, ["scaling.num_workers=1000000000"], {}, ("scaling.num_workers", "bound")),
    "seed 10^30": (None, ["train.seed=1000000000000000000000000000000"], {}, ("train.seed", "bound")),
    "adam beta 1.5": (None, ["train.adam_betas=[0.9, 1.5]"], {}, ("train.adam_betas.1", "")),
    # -- the data source
    "relative path without ./": (None, ["data.dataset=data/missing.jsonl"], {}, ("data.dataset", "check the path")),
    "glob matching nothing": (None, ["data.dataset=data/*.jsonl"], {}, ("data.dataset", "check the path")),
    "nested relative path": (None, ["data.dataset=corpora/news/train"], {}, ("data.dataset", "check the path")),
    "missing text_field": (
        None,
        ["data.dataset={tmp}/d.jsonl"],
        {"d.jsonl": jsonl({"txt": "hello"})},
        ("data.text_field", "did you mean 'txt'"),
    ),
    "numeric text column (jsonl)": (
        None,
        ["data.dataset={tmp}/d.jsonl"],
        {"d.jsonl": jsonl({"text": 3}, {"text": 4})},
        ("data.text_field", "column that holds the text"),
    ),
    "numeric text column (csv)": (
        None,
        ["data.dataset={tmp}/d.csv"],
        {"d.csv": b"text,label\n1,a\n2,b\n"},
        ("data.text_field", "column that holds the text"),
    ),
    "list text column": (
        None,
        ["data.dataset={tmp}/d.jsonl"],
        {"d.jsonl": jsonl({"text": ["a", "b"]})},
        ("data.text_field", "column that holds the text"),
    ),
    "empty jsonl": (None, ["data.dataset={tmp}/d.jsonl"], {"d.jsonl": b""}, ("data.dataset", "point it at your data")),
    "empty csv": (None, ["data.dataset={tmp}/d.csv"], {"d.csv": b""}, ("data.dataset", "point it at your data")),
    "folder of empty files": (
        None,
        ["data.dataset={tmp}/shards"],
        {"shards/a.jsonl": b"", "shards/b.jsonl": b""},
        ("data.dataset", "point it at your data"),
    ),
    "csv header only": (
        None,
        ["data.dataset={tmp}/d.csv"],
        {"d.csv": b"text,label\n"},
        ("data.text_field", "with text"),
    ),
    "every text empty": (
        None,
        ["data.dataset={tmp}/d.jsonl"],
        {"d.jsonl": jsonl({"text": ""}, {"text": "  "})},
        ("data.text_field", "with text"),
    ),
    "every text null": (
        None,
        ["data.dataset={tmp}/d.jsonl"],
        {"d.jsonl": jsonl({"text": None}, {"text": None})},
        ("data.text_field", "with text"),
    ),
    "csv with every cell empty": (
        None,
        ["data.dataset={tmp}/d.csv"],
        {"d.csv": b"text,label\n,1\n,2\n"},
        ("data.text_field", "with text"),
    ),
    "broken json line": (
        None,
        ["data.dataset={tmp}/d.jsonl"],
        {"d.jsonl": jsonl({"text": "ok"}) + b"{oops\n"},
        ("data.dataset", "fix the file"),
    ),
    "json array without the field": (
        None,
        ["data.dataset={tmp}/d.json"],
        {"d.json": b'[{"body": "x"}]'},
        ("data.text_field", "did you mean 'body'"),
    ),
    "data not UTF-8": (
        None,
        ["data.dataset={tmp}/d.jsonl"],
        {"d.jsonl": '{"text": "caf\u00e9"}\n'.encode("latin-1")},
        ("data.dataset", "fix the file"),
    ),
    "txt with another text_field": (
        None,
        ["data.dataset={tmp}/d.txt", "data.text_field=body"],
        {"d.txt": b"a\nb\n"},
        ("data.text_field", "did you mean 'text'"),
    ),
    "parquet without the column": (
        None,
        ["data.dataset={tmp}/d.parquet"],
        {"d.parquet": lambda p: _parquet(p, {"content": ["a", "b"]})},
        ("data.text_field", "did you mean 'content'"),
    ),
    "parquet numeric column": (
        None,
        ["data.dataset={tmp}/d.parquet"],
        {"d.parquet": lambda p: _parquet(p, {"text": [1.5, 2.5]})},
        ("data.text_field", "column that holds the text"),
    ),
    "damaged parquet": (
        None,
        ["data.dataset={tmp}/d.parquet"],
        {"d.parquet": b"PAR1 not really"},
        ("data.dataset", "fix the file"),
    ),
    "save_to_disk without the column": (
        None,
        ["data.dataset={tmp}/saved"],
        {"saved": lambda p: _saved(p, {"body": ["a"]})},
        ("data.text_field", ""),
    ),
    "save_to_disk numeric column": (
        None,
        ["data.dataset={tmp}/saved"],
        {"saved": lambda p: _saved(p, {"text": [1, 2]})},
        ("data.text_field", "column that holds the text"),
    ),
    # -- data with nothing to train on: every answer empty (its only target would be its end-of-turn token)
    "every assistant answer empty": (
        None,
        ["data.dataset={tmp}/d.jsonl", "data.chat_template=zephyr"],
        {"d.jsonl": jsonl(*[{"messages": [ASK, {"role": "assistant", "content": ""}]}] * 3)},
        ("data.dataset: every assistant answer in all 3 rows is empty", "data.train_on_prompt=true"),
    ),
    "every assistant answer blank": (
        None,
        ["data.dataset={tmp}/d.jsonl.gz", "data.chat_template=zephyr", "data.packing=false"],
        {"d.jsonl.gz": gzip.compress(jsonl(*[{"messages": [ASK, {"role": "assistant", "content": " \n "}]}] * 2))},
        ("data.dataset: every assistant answer in all 2 rows is empty", "fill in the answers"),
    ),
    "every completion's answer empty": (
        None,
        ["data.dataset={tmp}/d.parquet", "data.chat_template=zephyr"],
        {
            "d.parquet": lambda p: _parquet(
                p, {"prompt": [[ASK]] * 2, "completion": [[{"role": "assistant", "content": ""}]] * 2}
            )
        },
        ("data.dataset: every assistant answer in all 2 rows is empty", "data.train_on_prompt=true"),
    ),
    "every alpaca output empty": (
        None,
        ["data.dataset={tmp}/saved", "data.chat_template=zephyr"],
        {"saved": lambda p: _saved(p, {"instruction": ["Add 2 and 2.", "Say hi."], "output": ["", " "]})},
        ("data.dataset: every assistant answer in all 2 rows is empty", "data.train_on_prompt=true"),
    ),
}


def _write(folder: Path, files: dict) -> None:
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(path)
        else:
            path.write_bytes(content)


def tree(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*"))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_hostile_input_exits_2_early_with_one_line(case, tmp_path, tiny_model, capsys, monkeypatch):
    text, sets, files, (field, fix) = CASES[case]
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    _write(inputs, files)
    storage = tmp_path / "storage"
    storage.mkdir()
    args = []
    if text is not None:
        (inputs / "config.yaml").write_bytes(text)
        args.append(str(inputs / "config.yaml"))
    base = [
        f"experiment.storage_path={storage}",
        "experiment.name=hostile",
        f"model.name_or_path={tiny_model}",
        "scaling.use_gpu=false",
        "data.seq_length=32",
        f"data.dataset={CORPUS}",
        "data.split=train",
    ]
    for s in base + [s.replace("{tmp}", str(inputs)) for s in sets]:
        args += ["--set", s]
    monkeypatch.chdir(tmp_path)  # relative data paths are judged from here
    before = tree(tmp_path)
    refused_in_one_line(args, field, fix, capsys)
    assert tree(tmp_path) == before  # nothing written: not to storage, not beside the inputs


def refused_in_one_line(args: list[str], field: str, fix: str, capsys, commands=("validate", "train")) -> None:
    """Each command exits 2 within seconds with one error line, starting with `field` and holding `fix`, and no
    Ray cluster started."""
    for command in commands:
        started = time.monotonic()
        assert main([command, *args]) == 2, command
        elapsed = time.monotonic() - started
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1, err
        assert lines[0].startswith(f"error: {field}"), lines[0]
        assert fix in lines[0] and "Fix: " in lines[0], lines[0]
        assert "Traceback" not in err
        assert elapsed < 20, f"{command} took {elapsed:.1f}s"
        ray = sys.modules.get("ray")
        assert ray is None or not ray.is_initialized(), "a Ray cluster was started"


def test_at_least_thirty_hostile_cases():
    assert len(CASES) >= 30


def test_rows_without_text_are_skipped_and_counted(tmp_path, caplog, tiny_model):
    """A CSV with empty cells and JSON Lines with null, blank and missing texts: those rows are dropped before
    tokenization, with one log line that counts them; the rest is kept in order."""
    from transformers import AutoTokenizer

    from app import data
    from app.config import DataConfig

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.pad_token = tok.eos_token

    (tmp_path / "d.csv").write_text('text,label\n"first one",1\n,2\n"  ",3\n"second, with comma",4\n,5\n')
    rows = jsonl({"text": "a b"}, {"text": None}, {"other": 1}, {"text": ""}, {"text": "c d"})
    (tmp_path / "d.jsonl").write_bytes(rows)
    for name, kept, skipped in (("d.csv", ["first one", "second, with comma"], 3), ("d.jsonl", ["a b", "c d"], 3)):
        cfg = DataConfig(dataset=str(tmp_path / name), split="train", packing=False)
        assert data.check_source(cfg) == []
        caplog.clear()
        with caplog.at_level("WARNING", logger="finetune"):
            rows = data.tokenize(data.load_split(cfg, "train"), tok, cfg)
        assert [tok.decode(row["input_ids"][row["attention_mask"] == 1]) for row in rows] == kept
        counted = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
        assert counted == [f"skipped {skipped} of {skipped + len(kept)} training rows whose 'text' is empty or null"]


def _docs(tmp_path: Path) -> Path:
    """Documents of 1 and 2 tokens, one of 50,000 characters, an empty one, and ordinary ones."""
    path = tmp_path / "docs.jsonl"
    rows = [
        {"text": "a"},
        {"text": "hi"},
        {"text": "x" * 50_000},
        {"text": ""},
        {"text": " ".join(["word"] * 12_000)[:50_000]},
        {"text": "The central bank raised rates today."},
    ]
    path.write_bytes(jsonl(*rows))
    return path


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_short_and_very_long_documents_give_finite_losses(packing, tmp_path, tiny_model):
    """Every sequence the data step produces from tiny and huge documents trains with a finite loss, one at a
    time (micro-batch 1, where a sequence with nothing to predict would give 0/0)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app import data
    from app.config import DataConfig

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    cfg = DataConfig(dataset=str(_docs(tmp_path)), split="train", seq_length=32, packing=packing)
    ds = data.tokenize(data.load_split(cfg, "train"), tok, cfg)
    assert len(ds) >= (50_000 // 32 if packing else 4)
    with torch.no_grad():
        for row in (ds[i] for i in range(0, len(ds), max(1, len(ds) // 64))):
            loss = model(**{k: v[None] for k, v in row.items()}).loss
            assert math.isfinite(loss.item())


def test_every_problem_is_reported_at_once(tmp_path, tiny_model, capsys, monkeypatch):
    """An invalid value does not hide the problems of the rest: a bad learning rate, a missing data file and a
    missing model folder come out together, one line each, from validate and train."""
    monkeypatch.chdir(tmp_path)
    args = []
    for s in [
        f"experiment.storage_path={tmp_path / 'storage'}",
        "experiment.name=many",
        "scaling.use_gpu=false",
        "train.learning_rate=-1",
        "data.dataset=data/missing.jsonl",
        f"model.name_or_path={tmp_path / 'nomodel'}",
        "data.seq_length=32",
    ]:
        args += ["--set", s]
    for command in ("validate", "train"):
        assert main([command, *args]) == 2, command
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        fields = [line.split()[1].rstrip(":") for line in lines]
        assert fields[0] == "train.learning_rate" and {"data.dataset", "model.name_or_path"} <= set(fields), lines
        assert len(lines) == len(set(fields)) == 3, lines
    assert not (tmp_path / "storage").exists()
