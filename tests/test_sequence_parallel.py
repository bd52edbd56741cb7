"""Sequence parallelism (scaling.sequence_parallel): the same training as one worker with the whole sequence, exact
resume under it (at the same and at another number of workers), and the settings it cannot run refused before any
cluster starts. Real Ray Train and DeepSpeed on CPU workers (gloo's all-to-all), the tiny GPT-2, fp32, no dropout."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli, tiny_overrides
from transformers import BloomConfig, GPT2Config, LlamaConfig

from app import sequence_parallel
from app.checkpoint import ResumePlan
from app.config import TrainingConfig

# fp32 and no dropout: the two runs differ only in how the work is split (summation order, all-to-all).
EXACT = {"train.precision": "fp32", "model.dropout": 0, "train.log_every_steps": 1}
# Padded text rows (each row its own sequence, right padding), accumulation 2, an eval every 2 steps.
TEXT = {
    **EXACT,
    "data.packing": False,
    "train.gradient_accumulation_steps": 2,
    "train.max_steps_per_epoch": 4,
    "data.eval_fraction": 0.0505,  # about 101 rows: the last eval micro-batch is short unless filled
    "train.eval_every_steps": 2,
}
# Packed conversations (documents kept apart, loss on the assistant turns only), 8 steps, saved every 2.
CHAT = {
    **EXACT,
    "data.dataset": str(REPO / "examples" / "data" / "tiny-chat.jsonl"),
    "data.format": "chat",
    "data.chat_template": "zephyr",
    "data.seq_length": 128,
    "train.micro_batch_size": 2,
    "train.max_steps_per_epoch": 8,
    "checkpoint.every_steps": 2,
}
SP = {"scaling.num_workers": 2, "scaling.sequence_parallel": 2}
ONE = {"scaling.num_workers": 1}
# Relative, per step, on the loss and the gradient norm. Measured: at most 2e-6 (fp32; the sums run in another order).
# Averaging shard means instead of tokens moves the loss by ~1e-2; a gradient scaled by the group's size, by 2x.
TOL = 1e-4


def train(storage: Path, name: str, model: Path, **sets) -> str:
    result = run_cli("train", *tiny_overrides(storage, name, model, **sets))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-8000:]
    return out


def steps(run_dir: Path, kind: str = "train") -> dict[int, dict]:
    """metrics.jsonl's records of one kind by step (a step logged twice: the last)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == kind:
            out[record["step"]] = record
    return out


def assert_same(expected: dict[int, dict], got: dict[int, dict], keys: tuple[str, ...], which) -> float:
    """Every step of `which` agrees within TOL on `keys`; returns the largest relative difference."""
    worst = 0.0
    for step in which:
        for key in keys:
            a, b = expected[step][key], got[step][key]
            worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
    table = {s: [(expected[s][k], got.get(s, {}).get(k)) for k in keys] for s in which}
    assert worst <= TOL, table
    return worst


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory, tiny_model):
    storage = tmp_path_factory.mktemp("sp-text")
    one = train(storage, "one", tiny_model, **TEXT, **ONE)
    sp = train(storage, "sp", tiny_model, **TEXT, **SP)
    return storage, one, sp


@pytest.fixture(scope="module")
def chat_runs(tmp_path_factory, tiny_model):
    """One worker, and sequence parallel 2 on 2 workers stopped at step 3 (saved every 2, and at the stop) and
    redeployed: its steps 1-3 and 4-8 are the uninterrupted run's, and a copy of the stopped experiment is kept for
    a redeploy on 1 worker (`moved`)."""
    storage = tmp_path_factory.mktemp("sp-chat")
    train(storage, "one", tiny_model, **CHAT, **ONE)
    stopped = train(storage, "resumed", tiny_model, **CHAT, **SP, **{"train.stop_after_steps": 3})
    other = tmp_path_factory.mktemp("sp-chat-other")
    shutil.copytree(storage / "resumed", other / "resumed", symlinks=True)  # the same experiment, stopped at 3
    resumed = train(storage, "resumed", tiny_model, **CHAT, **SP)
    return storage, other, stopped, resumed


@pytest.fixture(scope="module")
def moved(chat_runs, tiny_model):
    """The copy of the experiment stopped at step 3 under sequence parallelism, redeployed on 1 worker without it."""
    other = chat_runs[1]
    return other, train(other, "resumed", tiny_model, **CHAT, **ONE)


# The unit suite keeps the packed chat runs (equal to one worker, and resumed at the exact batch: 3 runs); the
# padded text, the multi-query model and the move to 1 worker (item 2's other cases) run with `make test-all`.
@pytest.mark.slow
def test_padded_text_trains_as_one_worker_with_the_whole_sequence(text_runs):
    storage, one, sp = text_runs
    assert "sequence parallel 2 x data parallel 1" in sp, sp[-3000:]
    expected, got = steps(storage / "one"), steps(storage / "sp")
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    worst = assert_same(expected, got, ("loss", "grad_norm"), range(1, 5))
    print(f"padded text: largest relative difference {worst:.1e}")
    # The eval loss is the token mean over the whole split either way.
    assert_same(steps(storage / "one", "eval"), steps(storage / "sp", "eval"), ("eval_loss",), (2, 4))
    # The throughput counts every worker's shard: the same target tokens a step over twice the workers.
    ds = json.loads((storage / "sp" / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 4 * 2 and ds["sequence_parallel_size"] == 2, ds


def test_packed_chat_trains_as_one_worker_with_the_whole_sequence(chat_runs):
    storage, _, stopped, _ = chat_runs
    assert "sequence parallel 2 x data parallel 1" in stopped, stopped[-3000:]
    expected, got = steps(storage / "one"), steps(storage / "resumed")
    assert sorted(expected) == list(range(1, 9))
    worst = assert_same(expected, got, ("loss", "grad_norm"), range(1, 4))  # before the stop
    print(f"packed chat: largest relative difference {worst:.1e}")


def test_a_resume_under_sequence_parallelism_continues_at_the_exact_batch(chat_runs):
    storage, _, stopped, resumed = chat_runs
    assert "stopped at step 3 of 8" in stopped, stopped[-3000:]
    assert re.search(r"resumed from \S+step-00000003 .* at global step 3 \(epoch 0, step 3 of the epoch\)", resumed)
    expected, got = steps(storage / "one"), steps(storage / "resumed")
    assert sorted(got) == list(range(1, 9))
    assert_same(expected, got, ("loss", "grad_norm"), range(4, 9))


@pytest.mark.slow
def test_a_resume_on_one_worker_without_it_keeps_the_global_batch(chat_runs, moved):
    """2 workers sharing each sequence -> 1 worker: the same data-parallel degree (1), so the same accumulation and
    samples a step; the checkpoint goes through DeepSpeed's universal format (2 ranks' ZeRO partitions -> 1)."""
    storage = chat_runs[0]
    other, out = moved
    assert "written by 2 workers (1 data-parallel), this run has 1 (1 data-parallel)" in out, out[-6000:]
    assert "the global batch stays 2 sequences" in out
    # (the converted folder went with step 3 itself: checkpoint.keep 3 kept steps 4, 6 and 8)
    assert "step-00000003 was written by 2 workers and this run has 1: loaded it through DeepSpeed's universal" in out
    expected, got = steps(storage / "one"), steps(other / "resumed")
    assert sorted(got) == list(range(1, 9))
    assert_same(expected, got, ("loss", "grad_norm"), range(4, 9))


@pytest.mark.slow  # SIGTERM's save and redeploy are the unit suite's in test_reliability.py; under SP with test-all
def test_a_sigterm_to_one_worker_of_a_group_saves_the_step_and_the_redeploy_redoes_nothing(
    chat_runs, tmp_path, tiny_model
):
    """Preemption under it: rank 1 (the second shard of the one group) gets SIGTERM after step 5; every rank saves
    step 5 and the run exits 4; the redeploy resumes at step 5 with nothing redone, on the uninterrupted losses."""
    storage = chat_runs[0]
    first = run_cli(
        "train",
        *tiny_overrides(tmp_path, "pre", tiny_model, **CHAT, **SP),
        env={"FINETUNE_FAULT_SIGTERM_AT_STEP": "5:1"},
    )
    out = first.stdout + first.stderr
    assert first.returncode == 4 and "preempted at step 5, checkpoint written in" in out, out[-6000:]
    resumed = train(tmp_path, "pre", tiny_model, **CHAT, **SP)
    assert re.search(r"at global step 5 \(epoch 0, step 5 of the epoch\).*; no step is redone", resumed), resumed[
        -4000:
    ]
    got = steps(tmp_path / "pre")
    assert sorted(got) == list(range(1, 9))
    assert_same(steps(storage / "one"), got, ("loss", "grad_norm"), range(1, 9))


def tiny_llama(folder: Path, tokenizer_from: Path) -> Path:
    """A 2-layer Llama with one key/value head for 4 query heads (multi-query attention: under sequence parallel 2
    each worker repeats it) and rotary positions, random weights, the tiny GPT-2's tokenizer."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_multi_query_llama_trains_as_one_worker_with_the_whole_sequence(tmp_path, tiny_model):
    """Rotary positions from the gathered position ids, and the one key/value head repeated on both workers."""
    model = tiny_llama(tmp_path / "llama", tiny_model)
    sets = {**CHAT, "train.max_steps_per_epoch": 4, "checkpoint.every_steps": "null"}
    train(tmp_path, "one", model, **sets, **ONE)
    train(tmp_path, "sp", model, **sets, **SP)
    worst = assert_same(steps(tmp_path / "one"), steps(tmp_path / "sp"), ("loss", "grad_norm"), range(1, 5))
    print(f"multi-query llama, packed chat: largest relative difference {worst:.1e}")


# --- no cluster: the shards, the resume plan and the refusals ------------------------------------------------


def test_each_shard_keeps_its_targets_across_the_cut_and_the_whole_batchs_documents():
    from app import data

    ids = torch.arange(1, 9).view(1, 8)
    starts = torch.zeros(1, 8, dtype=torch.bool)
    starts[0, [0, 5]] = True  # two documents: tokens 1-5 and 6-8
    batch = data.packed_batch(ids, ids.clone(), 0, starts)
    cut = [sequence_parallel.Shards(2, rank, None).cut(batch) for rank in (0, 1)]
    assert [c["input_ids"].tolist() for c in cut] == [[[1, 2, 3, 4]], [[5, 6, 7, 8]]]
    # Shifted before the cut: token 4's target is token 5, the next shard's first; no target across documents.
    assert [c["labels"].tolist() for c in cut] == [[[2, 3, 4, 5]], [[-100, 7, 8, -100]]]
    assert [c["position_ids"].tolist() for c in cut] == [[[0, 1, 2, 3]], [[4, 0, 1, 2]]]
    assert all(c["cu_seq_lens_q"] is batch["cu_seq_lens_q"] and c["max_length_k"] == 5 for c in cut)
    left = {"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])}
    with pytest.raises(ValueError, match="right-padded"):
        sequence_parallel.Shards(2, 0, None).cut(left)


def test_the_resume_plan_counts_data_parallel_groups():
    def plan(saved_workers: int, saved_sp: int, saved_gas: int, workers: int, sp: int) -> ResumePlan:
        cfg = config(num_workers=workers, sequence_parallel=sp)
        state = {"world_size": saved_workers, "sequence_parallel": saved_sp, "micro_batch_size": 4}
        return ResumePlan.decide("step-00000003", {**state, "gradient_accumulation_steps": saved_gas}, cfg)

    # 2 workers in 1 group, accumulation 2 -> 2 groups of 1: half the accumulation; the same ranks' partitions.
    half = plan(2, 2, 2, 2, 1)
    assert half.gradient_accumulation_steps == 1 and not half.problems, half
    assert "(1 data-parallel), this run has 2 (2 data-parallel)" in half.note and "loaded as written" in half.note
    # 4 workers in 4 groups -> 2 groups of 2: twice the accumulation.
    assert plan(4, 1, 1, 4, 2).gradient_accumulation_steps == 2
    # 1 group of 4 sequences a step cannot become 2 groups of micro-batch 4.
    (refused,) = plan(2, 2, 1, 2, 1).problems
    assert refused.field == "scaling.num_workers" and "global batch of 4 sequences" in refused.message


def config(seq_length: int = 64, **scaling) -> TrainingConfig:
    return TrainingConfig.model_validate(
        {
            "experiment": {"name": "x"},
            "train": {"micro_batch_size": 4},
            "data": {"seq_length": seq_length},
            "scaling": {"use_gpu": False, **scaling},
        }
    )


def lines(problems) -> list[str]:
    return [str(p) for p in problems]


def test_a_degree_that_does_not_divide_the_workers_or_the_sequence_is_refused():
    found = lines(sequence_parallel.problems(config(num_workers=4, sequence_parallel=3), None))
    assert found == [
        "scaling.sequence_parallel: does not divide scaling.num_workers=4 (each group of sequence_parallel workers "
        "shares one sequence) (got 3). Fix: set it to one of 1, 2, 4, or scaling.num_workers to a multiple of 3",
        "scaling.sequence_parallel: does not divide data.seq_length=64 (each worker of a group takes an equal slice "
        "of the sequence) (got 3). Fix: set data.seq_length to a multiple of 3, e.g. 63",
    ]
    assert sequence_parallel.problems(config(num_workers=4, sequence_parallel=1), None) == []
    assert sequence_parallel.problems(config(num_workers=4, sequence_parallel=4), None) == []


def test_heads_the_degree_cannot_split_are_refused():
    sp4 = config(num_workers=4, sequence_parallel=4)
    gpt2 = GPT2Config(n_head=2)
    assert lines(sequence_parallel.problems(sp4, gpt2)) == [
        "scaling.sequence_parallel: does not divide gpt2's 2 attention heads (each worker of a group computes heads "
        "/ sequence_parallel of them) (got 4). Fix: set it to one of 1, 2 (and scaling.num_workers to a multiple of it)"
    ]
    # Grouped-query attention: 8 heads, 2 key/value heads; 4 repeats each key/value head on 2 workers.
    assert sequence_parallel.problems(sp4, LlamaConfig(num_attention_heads=8, num_key_value_heads=2)) == []
    sp3 = config(63, num_workers=3, sequence_parallel=3)
    gqa = LlamaConfig(hidden_size=768, num_attention_heads=12, num_key_value_heads=4)  # 3 query heads a kv head
    (found,) = sequence_parallel.problems(sp3, gqa)
    assert "neither divides nor is a multiple of llama's 4 key/value heads" in str(found)
    assert "set it to one of 1, 2, 4, 12 " in str(found)


def test_attention_the_adapter_cannot_wrap_is_refused():
    sp = config(num_workers=2, sequence_parallel=2)
    (own,) = sequence_parallel.problems(sp, BloomConfig(n_head=2))
    assert own.field == "scaling.sequence_parallel" and "bloom computes its own attention" in own.message
    eager = sp.model_copy(update={"model": sp.model.model_copy(update={"attn_implementation": "eager"})})
    (found,) = sequence_parallel.problems(eager, GPT2Config(n_head=2))
    assert found.field == "model.attn_implementation" and "use sdpa" in found.fix


def test_validate_refuses_before_any_cluster_with_one_line_and_says_the_degrees(tmp_path, tiny_model):
    bad = run_cli("validate", *tiny_overrides(tmp_path, "sp", tiny_model, **{"scaling.sequence_parallel": 3}))
    assert bad.returncode == 2, bad.stderr[-3000:]
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert errors and all("scaling.sequence_parallel" in e and "Fix:" in e for e in errors), bad.stderr[-3000:]
    assert any("does not divide scaling.num_workers=2" in e for e in errors), errors
    assert not (tmp_path / "sp").exists()  # nothing written to storage
    good = run_cli("validate", *tiny_overrides(tmp_path, "sp", tiny_model, **SP))
    assert good.returncode == 0, good.stderr[-3000:]
    assert "# sequence parallel 2 x data parallel 1 = 2 workers" in good.stdout
    assert '"sequence_parallel_size": 2' in good.stdout and '"train_batch_size": 4' in good.stdout


def test_the_memory_model_gives_each_gpu_its_shard_of_the_activations():
    """app.resolve (the auto settings' memory model): 8 GPUs sharing one 256k-token sequence keep a 32k share each."""
    from app import resolve as rs

    llama8b = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
    )
    shape, plan = rs.shape_from_config(llama8b), rs.Plan(3, True, True, 1)
    whole = rs.predict(shape, 8, rs.Request(seq_length=262_144, micro_batch_size=1), plan)
    shared = rs.predict(shape, 8, rs.Request(seq_length=262_144, micro_batch_size=1, sequence_parallel=8), plan)
    one_gpu = rs.predict(shape, 8, rs.Request(seq_length=32_768, micro_batch_size=1), plan)
    assert shared.activations == one_gpu.activations and whole.activations == 8 * shared.activations
    assert shared.weights == whole.weights  # ZeRO still partitions over all 8


def test_the_eval_split_comes_in_whole_micro_batches_each_sample_counted_once():
    """The adapter is built for one micro-batch shape: under sequence parallelism each rank's eval share is padded to
    whole micro-batches with label-less repeats, so no batch is short and no sample counts twice."""
    from app import data

    rows = [{"input_ids": torch.full((4,), i), "labels": torch.full((4,), i)} for i in range(10)]
    for world in (1, 2):
        batches = [b for rank in range(world) for b in data.make_eval_loader(rows, 4, world, rank, None, True)]
        assert all(len(b["input_ids"]) == 4 for b in batches)
        counted = [int(x) for b in batches for x in b["labels"][:, 0] if x != -100]
        assert sorted(counted) == list(range(10)), (world, counted)
    assert [len(b["input_ids"]) for b in data.make_eval_loader(rows, 4, 1, 0)] == [4, 4, 2]  # as before, without it
