"""The resume contract (app/contract.py), with real Ray and DeepSpeed on CPU workers: a redeploy that changes what
the checkpoints depend on is refused before any cluster starts, naming each field with its old and new value;
safe changes pass with one line; --accept-changed continues and is recorded."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, tiny_overrides

from app import contract


@pytest.fixture(scope="module")
def started(tiny_model, tmp_path_factory):
    """An experiment whose first deploy saved step 2 (of 4) and stopped."""
    storage = tmp_path_factory.mktemp("contract")
    base = {"train.max_steps_per_epoch": 4, "checkpoint.every_steps": 2, "train.stop_after_steps": 2}
    done = run_cli("train", *tiny_overrides(storage, "c", tiny_model, **base))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (storage / "c" / contract.RECORD).exists()
    return storage, base


def redeploy(command: str, started, tiny_model, *extra: str, **sets):
    storage, base = started
    return run_cli(command, *tiny_overrides(storage, "c", tiny_model, **{**base, **sets}), *extra)


def test_a_changed_dependency_is_refused_with_its_old_and_new_value(started, tiny_model):
    refused = redeploy("validate", started, tiny_model, **{"data.seq_length": 64, "model.lora": "{r: 8}"})
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert any(e.startswith("error: data.seq_length: was 32 when c started") and "(got 64)" in e for e in errors)
    assert any(e.startswith("error: model.lora: was full fine-tuning") for e in errors), errors
    assert all("--accept-changed" in e for e in errors if "when c started" in e)
    # A train refused the same way starts no cluster and writes nothing.
    before = json.loads((started[0] / "c" / contract.RECORD).read_text())
    train = redeploy("train", started, tiny_model, **{"data.seq_length": 64})
    assert train.returncode == 2 and "local Ray cluster" not in train.stderr, train.stderr[-3000:]
    assert json.loads((started[0] / "c" / contract.RECORD).read_text()) == before


def test_safe_changes_pass_and_are_named(started, tiny_model):
    ok = redeploy("validate", started, tiny_model, **{"train.learning_rate": 1e-3, "checkpoint.keep": 5})
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "changed since c started" in ok.stderr and "train.learning_rate 0.003 -> 0.001" in ok.stderr


def test_an_accepted_change_continues_and_is_recorded(started, tiny_model):
    wrong = redeploy("validate", started, tiny_model, "--accept-changed", "model.lora.r")
    assert wrong.returncode == 2 and "--accept-changed: names no changed field" in wrong.stderr
    done = redeploy("train", started, tiny_model, "--accept-changed", "data.seq_length", **{"data.seq_length": 48})
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "continuing c's checkpoints with changed data.seq_length" in log and "resumed from" in log
    recorded = json.loads((started[0] / "c" / contract.RECORD).read_text())
    assert recorded["depends_on"]["data.seq_length"] == 48 and recorded["accepted"] == [["data.seq_length"]]


def test_a_template_name_the_app_does_not_ship_is_refused_with_the_names(tmp_path, tiny_model):
    from app import preflight
    from app.config import DataConfig, TrainingConfig
    from app.data import chat

    assert "did you mean 'zephyr'?" in str(chat.template_name_problem(DataConfig(chat_template="zephir")))
    assert chat.template_name_problem(DataConfig(chat_template="zephyr")) is None
    assert chat.template_name_problem(DataConfig(chat_template="{{ messages[0]['content'] }}")) is None
    cfg = TrainingConfig.model_validate(
        {
            "experiment": {"name": "t", "storage_path": str(tmp_path)},
            "model": {"name_or_path": str(tiny_model)},
            "data": {"dataset": str(tmp_path / "none.jsonl"), "chat_template": "llama3", "split": "train"},
        }
    )
    found = [p for p in preflight.data_problems(cfg) if p.field == "data.chat_template"]
    assert len(found) == 1 and "chatml, zephyr, qwen3" in str(found[0])


def test_what_the_sample_shows_is_refused_before_the_cluster(tmp_path, tiny_model):
    """Every sampled conversation too long even cut after its first answer; a template that marks no target."""
    from app import data
    from app.config import DataConfig, ModelConfig

    long = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}
    path = tmp_path / "long.jsonl"
    path.write_text((json.dumps(long) + "\n") * 5)
    model = ModelConfig(name_or_path=str(tiny_model))
    problems = data.check_source(
        DataConfig(dataset=str(path), split="train", chat_template="zephyr", seq_length=64), model
    )
    assert [p.field for p in problems] == ["data.seq_length"] and "set data.seq_length to at least" in problems[0].fix
    plain = "{{ 'the same text for every conversation' }}{{ eos_token }}"  # renders no assistant turn
    short = tmp_path / "short.jsonl"
    short.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
    )
    problems = data.check_source(DataConfig(dataset=str(short), split="train", chat_template=plain), model)
    assert [p.field for p in problems] == ["data.chat_template"] and "no token" in problems[0].message


def test_a_run_without_a_finite_loss_never_ends_as_a_success():
    import torch

    from app.nonfinite import NonFiniteError, NonFiniteGuard

    guard = NonFiniteGuard(limit=10, precision="bf16", learning_rate=1e-5)
    for step in (1, 2, 3):
        guard.check(step, torch.tensor(float("nan")), None)
    with pytest.raises(NonFiniteError, match="none of the 3 steps of this run had a finite loss"):
        guard.finish()
    fine = NonFiniteGuard(limit=10, precision="bf16", learning_rate=1e-5)
    fine.check(1, torch.tensor(float("nan")), None)
    fine.check(2, torch.tensor(1.0), None)
    assert fine.finish() is True


def test_the_memory_hint_suggests_only_what_the_run_has_not_set():
    from app import driver
    from app.config import TrainingConfig

    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    plain = TrainingConfig.model_validate({"train": {"micro_batch_size": 4}})
    assert "gradient_checkpointing=true" in driver.failure_fix(oom, 0, plain)
    assert "micro_batch_size (now 4)" in driver.failure_fix(oom, 0, plain)
    done = TrainingConfig.model_validate({"train": {"micro_batch_size": 1}, "model": {"gradient_checkpointing": True}})
    hint = driver.failure_fix(oom, 0, done)
    assert "gradient_checkpointing" not in hint and "micro_batch_size" not in hint and "offload_optimizer" in hint


def test_an_attention_the_workers_cannot_run_is_refused_before_the_cluster():
    from app.config import TrainingConfig
    from app.model import attention_problems

    cpu = TrainingConfig.model_validate(
        {"model": {"attn_implementation": "flash_attention_2"}, "scaling": {"use_gpu": False}}
    )
    assert [p.field for p in attention_problems(cpu)] == ["model.attn_implementation"]
    assert "GPU workers" in attention_problems(cpu)[0].message
    assert attention_problems(TrainingConfig.model_validate({"scaling": {"use_gpu": False}})) == []
