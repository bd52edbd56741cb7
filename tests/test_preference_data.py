"""Preference pairs as data (issue #51): TRL's forms (text, conversational, an implicit prompt) read, rendered and
masked to their answers; each pair two documents kept together, packed or not, and found again in every collated
batch; pairs too long cut or dropped and counted; bad rows refused before any cluster with the file, line and fix.
In this process, no Ray (tests/test_preference_train.py trains on them)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from app import data
from app.config import TrainingConfig
from app.data import chat, checks, pairs, pipeline, store
from app.model import load_tokenizer
from app.tiny import preference_rows, write_rows


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from app.config import ModelConfig

    return load_tokenizer(ModelConfig(name_or_path=str(tiny_model)))


def config(tmp_path: Path, model: Path, dataset: Path, preference: bool = True, **fields) -> TrainingConfig:
    fields = {"dataset": str(dataset), "split": "train", "chat_template": "zephyr", "seq_length": 160, **fields}
    return TrainingConfig.model_validate(
        {
            "experiment": {"name": "exp", "storage_path": str(tmp_path / "storage")},
            "model": {"name_or_path": str(model)},
            "data": fields,
            "preference": {} if preference else None,
            "scaling": {"num_workers": 1, "use_gpu": False},
        }
    )


def prepared(tmp_path, tiny_model, rows, **fields) -> tuple[store.PreparedSplit, dict]:
    dataset = write_rows(tmp_path / f"pairs-{len(list(tmp_path.iterdir()))}.jsonl", rows)
    folder, manifest = pipeline.ensure(config(tmp_path, tiny_model, dataset, **fields))
    return store.PreparedSplit.open(folder, "train"), manifest


def answers(batch, tokenizer) -> list[tuple[str, str]]:
    """(the whole sequence, its targets) of each answer of a collated batch, in its `sequences` order."""
    out = []
    flat = {k: batch[k].flatten() for k in ("input_ids", "labels", "sequences")}
    for s in range(int(flat["sequences"].max()) + 1):
        mine = flat["sequences"] == s
        labels = flat["labels"][mine]
        out.append((tokenizer.decode(flat["input_ids"][mine]), tokenizer.decode(labels[labels != -100])))
    return out


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
def test_each_pair_is_two_answers_kept_together_and_found_in_every_batch(tiny_model, tokenizer, tmp_path, packing):
    rows = preference_rows(40, seed=3)
    split, manifest = prepared(tmp_path, tiny_model, rows, packing=packing)
    assert manifest["format"] == "preference" and manifest["layout"] == ("pair_blocks" if packing else "pair_rows")
    train = manifest["splits"]["train"]
    assert train["pairs"] == 40 and train["documents"] == 80 and train["too_long"] == train["truncated"] == 0
    collate = data.PairCollator(tokenizer.eos_token_id, packed=packing)
    seen = []
    for lo in range(0, len(split), 3):
        batch = collate([split[i] for i in range(lo, min(lo + 3, len(split)))])
        found = answers(batch, tokenizer)
        assert len(found) % 2 == 0
        for (chosen, chosen_targets), (rejected, rejected_targets) in zip(found[0::2], found[1::2]):
            # The same prompt; the targets are the answers only, each ending with the template's EOS.
            prompt = chosen[: chosen.index("<|assistant|>")]
            assert rejected.startswith(prompt) and prompt.startswith("<|user|>\nWhich section")
            assert chosen_targets.endswith(".<|endoftext|>") and rejected_targets.endswith("!<|endoftext|>")
            assert "<|user|>" not in chosen_targets + rejected_targets
            seen.append(prompt)
        if packing:  # each block's documents start at position 0 and end where the next begins
            assert batch["cu_seq_lens_q"][-1] == batch["input_ids"].numel()
    assert len(seen) == 40 and len(set(seen)) > 30


def test_the_three_forms_encode_alike(tokenizer):
    """The implicit prompt (two whole conversations) is split off as TRL's maybe_extract_prompt does: the same tokens
    as the explicit conversational form; the text form is prompt (with the tokenizer's BOS), answer, EOS."""
    cfg = config(Path("/tmp"), Path("unused"), Path("/tmp/x.jsonl")).data
    template = lambda: chat.TEMPLATES["zephyr"]  # noqa: E731
    conversational, implicit, text = (
        preference_rows(5, seed=1, form=form) for form in ("conversational", "implicit", "text")
    )
    for a, b in zip(conversational, implicit):
        assert pairs.encode(a, template, tokenizer) == pairs.encode(b, template, tokenizer)
    (ids, labels), (r_ids, r_labels) = pairs.encode(text[0], template, tokenizer)
    prompt = tokenizer(text[0]["prompt"])["input_ids"]
    assert ids[: len(prompt)] == prompt == r_ids[: len(prompt)] and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode([t for t in labels if t != -100]) == text[0]["chosen"] + "<|endoftext|>"
    assert (
        cfg.format == "auto"
        and chat.resolve_format("auto", ["prompt", "chosen", "rejected", "messages"]) == "preference"
    )


def test_pairs_too_long_are_cut_from_the_answer_or_dropped_and_counted(tiny_model, tmp_path, caplog):
    rows = preference_rows(6, seed=2, form="text")
    rows[0]["chosen"] = " Sports." * 60  # a long answer: cut to what fits, more than half of it kept
    rows[1]["prompt"] = "Which section? " * 80  # a prompt that leaves no room for an answer: dropped
    caplog.set_level(logging.WARNING, logger="finetune")
    split, manifest = prepared(tmp_path, tiny_model, rows, seq_length=200, packing=False)
    train = manifest["splits"]["train"]
    assert (train["pairs"], train["truncated"], train["too_long"]) == (5, 1, 1), train
    assert "2 of 6 preference pairs are longer than data.seq_length=200: 1 truncated" in caplog.text
    assert len(split) == 5 and split[0]["input_ids"].shape == (2, 200)


def test_a_reference_pass_s_values_come_with_their_answers(tiny_model, tokenizer, tmp_path):
    split, _ = prepared(tmp_path, tiny_model, preference_rows(12, seed=4))
    folder = tmp_path / "reference"
    for u, unit in enumerate(split.units):
        path = store.unit_path(folder, "train", unit["unit"], store.REFERENCE)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, np.arange(split.document_count(u), dtype=np.float32))
    split.use_reference(folder)
    batch = data.PairCollator(tokenizer.eos_token_id, packed=True)([split[0], split[1]])
    (_, lo, hi), (_, lo1, hi1) = split.documents_of(0), split.documents_of(1)
    assert hi - lo >= 2 and (hi - lo) % 2 == 0
    assert torch.equal(batch["reference"], torch.tensor([*range(lo, hi), *range(lo1, hi1)], dtype=torch.float32))


def write(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = preference_rows(3, seed=5)


@pytest.mark.parametrize(
    "bad, message, fix",
    [
        (
            {"prompt": GOOD[0]["prompt"], "chosen": GOOD[0]["chosen"]},
            "has no 'rejected'",
            "give every row a 'chosen' and a 'rejected'",
        ),
        ({**GOOD[0], "rejected": GOOD[0]["chosen"]}, "the same 'chosen' and 'rejected'", "remove the row"),
        ({"prompt": "Q", "chosen": "A", "rejected": ""}, "has an empty 'rejected'", "fill it in"),
        (
            {
                "prompt": [{"role": "user", "content": "Q"}],
                "chosen": [{"role": "assistant", "content": ""}],
                "rejected": [{"role": "assistant", "content": " "}],
            },
            "'chosen' has only empty assistant turns",
            "fill it in",
        ),
        (
            {"prompt": "Q", "chosen": [{"role": "assistant", "content": "A"}], "rejected": "B"},
            "mixes text and lists",
            "all as text",
        ),
        ({"chosen": "A", "rejected": "B"}, "has no 'prompt'", "conversations that share their prompt turns"),
        (
            {
                "prompt": [{"role": "user", "content": "Q"}],
                "chosen": [{"role": "user", "content": "A"}],
                "rejected": GOOD[0]["rejected"],
            },
            "'chosen' has no assistant turn",
            "assistant turn",
        ),
    ],
)
def test_a_bad_row_is_named_with_its_line_and_fix(tiny_model, tmp_path, bad, message, fix):
    path = write(tmp_path, [GOOD[1], bad, GOOD[2]])
    (problem,) = checks.check_source(config(tmp_path, tiny_model, path).data, preference=True)
    assert problem.field == "data.dataset" and problem.value == f"{path} line 2", problem
    assert message in problem.message and fix in problem.fix, problem


def test_the_data_and_the_config_must_agree(tiny_model, tmp_path):
    sft = Path(__file__).resolve().parents[1] / "examples/data/tiny-chat.jsonl"
    (problem,) = checks.check_source(config(tmp_path, tiny_model, sft).data, preference=True)
    assert "is chat data, not preference pairs" in problem.message and "remove `preference`" in problem.fix
    path = write(tmp_path, GOOD)
    (problem,) = checks.check_source(config(tmp_path, tiny_model, path, preference=False).data, preference=False)
    assert "holds preference pairs" in problem.message and "set `preference`" in problem.fix
    both = checks.check_source(
        config(tmp_path, tiny_model, path, train_on_prompt=True, separate_documents=False).data, preference=True
    )
    assert [p.field for p in both] == ["data.train_on_prompt", "data.separate_documents"]
    assert checks.check_source(config(tmp_path, tiny_model, path).data, preference=True) == []
