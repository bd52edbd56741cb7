"""Tokenization, masking, packing and the resumable sampler, on the bundled corpus."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS
from transformers import AutoTokenizer

from app import data
from app.config import DataConfig, Problem


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
    assert "mixed" in str(data.check_source(DataConfig(dataset=str(tmp_path), split="train"))[0])
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(10)]})}).save_to_disk(
        str(saved)
    )
    assert len(data.load_split(DataConfig(dataset=str(saved)), "train[:30%]")) == 3
    assert "no json" in str(data.check_source(DataConfig(dataset=str(tmp_path / "nothing-*.json")))[0])


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


def test_a_failed_cache_write_leaves_no_half_written_cache(tiny_model, tmp_path, monkeypatch):
    """A full volume (or a stop) in the middle of the tokenized cache's write: no folder is left that a later
    run could read, and the next run builds the cache from scratch."""
    import datasets

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.pad_token = tok.eos_token
    cfg = DataConfig(dataset=str(CORPUS), split="train[:200]", seq_length=48)
    real_save = datasets.DatasetDict.save_to_disk

    def save_then_fail(self, path, **kw):
        real_save(self, path, **kw)  # every shard on disk, then the volume fills before the marker
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(datasets.DatasetDict, "save_to_disk", save_then_fail)
    try:
        data.prepare(cfg, tok, str(tiny_model), tmp_path, 0, 0, barrier=lambda: None)
    except OSError as e:
        assert e.errno == 28
    else:
        raise AssertionError("the write's OSError did not reach the caller")
    assert list(tmp_path.iterdir()) == []  # neither the temporary folder nor a final one without its marker
    monkeypatch.setattr(datasets.DatasetDict, "save_to_disk", real_save)
    train, _ = data.prepare(cfg, tok, str(tiny_model), tmp_path, 0, 0, barrier=lambda: None)
    assert len(train) > 0 and [p.name for p in tmp_path.iterdir()] == [
        f"tokenized-{data.cache_key(cfg, str(tiny_model), cfg.split, 0)}"
    ]


def test_too_few_tokens_for_one_packed_block_is_named_not_a_traceback(tiny_model, tmp_path):
    """Packing keeps whole seq_length blocks only: data (or a tokenizer) that yields less than one block ends with
    the field and the fix, not datasets' "Columns [...] not in the dataset"."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.pad_token = tok.eos_token
    cfg = DataConfig(dataset=str(CORPUS), split="train[:3]", seq_length=1024, packing=True)
    with pytest.raises(Problem, match=r"data.seq_length: the split yields no training sequence \(packing keeps"):
        data.prepare(cfg, tok, str(tiny_model), tmp_path, 0, 0, barrier=lambda: None)
    assert list(tmp_path.iterdir()) == []  # nothing cached
