"""Preference tuning end to end on real Ray Train and DeepSpeed (CPU), a tiny Llama (issue #51, Done-when 2-4): on
pairs whose chosen answers follow a pattern the rejected ones break (app.tiny.preference_rows), reward accuracy rises
towards 1 and the margin grows, with LoRA (the reference: the adapters switched off) and with full fine-tuning (the
reference: a pass before training, stored beside the prepared data and read, not recomputed, on resume); bad data
exits 2 with one line before any cluster starts.

The guarantees SFT gives (tests/test_reliability.py, docs/reliability.md), for DPO with LoRA and with full
fine-tuning (Done-when 3): a SIGTERM to one rank mid-epoch saves the step in flight and the redeploy continues at the
exact batch (per-step losses equal to an uninterrupted run's); a redeploy on one worker instead of two keeps the
global batch and continues the losses; periodic checkpoints are written in the background while training goes on;
final/ (and final/adapter/ with LoRA) are exported."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from conftest import check_world_change, losses, preempted_line, resumed_line, run_cli, tiny_overrides

from app.tiny import preference_rows, write_rows

STEPS = 12
STOP = 4  # the first deploy of a resumed experiment: the last rank gets a SIGTERM after this step (a node drain)
HELD = 6  # seconds the last rank's background write of step STOP's checkpoint is held in the uninterrupted LoRA run


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tiny_model) -> Path:
    """A 2-layer Llama with random weights and the tiny GPT-2's tokenizer, a from_pretrained folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    return write_rows(tmp_path_factory.mktemp("data") / "pairs.jsonl", preference_rows(240, seed=1))


def train(storage: Path, name: str, model: Path, pairs: Path, env: dict | None = None, expect: int = 0, **extra) -> str:
    values = {
        "data.dataset": str(pairs),
        "data.seq_length": 160,
        "data.chat_template": "zephyr",
        "train.micro_batch_size": 2,
        "train.max_steps_per_epoch": STEPS,
        "train.log_every_steps": 1,
        "preference.loss": "sigmoid",
        **extra,
    }
    result = run_cli("train", *tiny_overrides(storage, name, model, **values), env=env)
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


def preempted(storage: Path, name: str, model: Path, pairs: Path, **extra) -> str:
    """A deploy preempted mid-epoch: a real SIGTERM to the last rank after step STOP; every rank saves that step,
    the run exits 4 with the preempted line, and no later step ran."""
    out = train(storage, name, model, pairs, env={"FINETUNE_FAULT_SIGTERM_AT_STEP": str(STOP)}, expect=4, **extra)
    assert f"sends itself 1 SIGTERM after step {STOP}" in out and int(preempted_line(out)[1]) == STOP, out[-3000:]
    assert max(losses(storage / name)) == STOP and not (storage / name / ".lease").exists()
    return out


def records(run_dir: Path, kind: str = "train") -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == kind:
            out[rec["step"]] = rec
    return out


def assert_learns(run_dir: Path) -> tuple[float, float]:
    """The first step's loss is log 2 (the policy is its reference); the reward accuracy ends near 1 and the margin
    grows. Returns the margins at the start and the end."""
    steps = records(run_dir)
    first, last = steps[1], [steps[s] for s in range(STEPS - 2, STEPS + 1)]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4) and first["rewards/accuracies"] == 0, first
    assert all(r["rewards/accuracies"] >= 0.9 for r in last), last
    start, end = first["rewards/margins"], sum(r["rewards/margins"] for r in last) / len(last)
    assert end > start + 0.2, (start, end)
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"} <= set(first)
    return start, end


def assert_resumed_exactly(storage: Path, resumed: str, stopped_at: int = STOP) -> None:
    """The redeploy continued from the preempted step's checkpoint at the next batch, redoing nothing, and every
    later step's loss is the uninterrupted run's."""
    m = resumed_line(resumed)
    assert Path(m[1]).name == f"step-{stopped_at:08d}" and m[4].startswith("no step is redone"), m[0]
    assert f"at global step {stopped_at} (epoch 0, step {stopped_at} of the epoch)" in resumed, resumed[-3000:]
    full, part = losses(storage / "full"), losses(storage / "resumed")
    assert sorted(part) == list(range(1, STEPS + 1)), part
    worst = max(abs(full[s] - part[s]) for s in range(stopped_at + 1, STEPS + 1))
    assert worst <= 1e-5, {s: (full[s], part[s]) for s in range(stopped_at + 1, STEPS + 1)}


@pytest.fixture(scope="module")
def lora(tmp_path_factory, tiny_llama, pairs_file):
    """DPO with LoRA under ZeRO-3, packed pairs, an eval split: one uninterrupted run (a checkpoint every STOP steps,
    the background write of step STOP's held for HELD seconds), and one preempted after step STOP and redeployed,
    which exports final/."""
    storage = tmp_path_factory.mktemp("storage")
    extra = {
        "model.lora": "{r: 8, alpha: 16}",
        "data.eval_fraction": 0.05,
        "train.eval_every_steps": 6,
    }
    held = {"FINETUNE_FAULT_SAVE_PAUSE": f"mid_shards:{HELD}:{STOP}"}
    full = train(storage, "full", tiny_llama, pairs_file, env=held, **extra, **{"checkpoint.every_steps": STOP})
    preempted(storage, "resumed", tiny_llama, pairs_file, **extra)
    resumed = train(storage, "resumed", tiny_llama, pairs_file, **extra, **{"checkpoint.export_final": True})
    return storage, full, resumed


def test_lora_learns_the_preference_against_its_base_model(lora):
    storage, full, _ = lora
    start, end = assert_learns(storage / "full")
    assert "data format: preference (data.format auto, from the columns)" in full
    assert "reference log-probabilities" not in full  # the adapters switched off are the reference: no pass
    assert "rewards/accuracies" in full and "rewards/margins" in full  # the progress line shows them
    evals = records(storage / "full", "eval")
    assert sorted(evals) == [6, 12] and "eval_rewards/accuracies" in evals[12] and "eval_perplexity" not in evals[12]
    print(f"LoRA ZeRO-3: margin {start:.3f} -> {end:.3f}")


def test_lora_checkpoints_are_written_in_the_background(lora):
    """Step STOP's checkpoint was written while training went on: the loop waited only for the copy, steps after
    it were logged before the held write completed, and it is complete."""
    storage, full, _ = lora
    run_dir = storage / "full"
    saves = records(run_dir, "checkpoint")
    assert sorted(saves) == list(range(STOP, STEPS + 1, STOP)), saves
    save = saves[STOP]
    assert save["background"] and save["total_s"] >= HELD and save["stall_s"] < HELD, save
    steps = records(run_dir)
    assert steps[STOP + 1]["time"] < save["time"], (steps[STOP + 1], save)
    assert "written in the background in" in full and (run_dir / "checkpoints" / f"step-{STOP:08d}").is_dir()


def test_lora_resumes_exactly_after_a_sigterm_and_exports_the_adapter(lora, tiny_llama):
    """final/ is the merged model and final/adapter/ the adapter: on the base model it gives final/'s logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    storage, _, resumed = lora
    assert_resumed_exactly(storage, resumed)
    final = storage / "resumed" / "final"
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), final / "adapter").eval()
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(final).eval()(ids).logits.float()
        assert torch.allclose(merged, adapted(ids).logits.float(), atol=5e-2)


def reference_files(storage: Path) -> dict[str, tuple[int, int]]:
    """The stored reference as the file system sees it: (inode, mtime) of its prepared data's folder (where a pass
    writes its values into a temporary folder, renamed into place or removed: either changes the folder's mtime)
    and of every file the pass stored."""
    (folder,) = (storage / "prepared").glob("*/reference-*")
    paths = [folder.parent, *sorted(p for p in folder.rglob("*") if p.is_file())]
    return {str(p.relative_to(storage)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


@pytest.fixture(scope="module")
def full_zero2(tmp_path_factory, tiny_llama, pairs_file):
    """DPO full fine-tuning under ZeRO-2, unpacked pairs: preempted after step STOP (its reference pass stored);
    a copy of that storage redeployed on one worker; the experiment redeployed (exporting final/); an uninterrupted
    run of another experiment over the same data and model. The reference's files are taken before each redeploy."""
    storage, copy = tmp_path_factory.mktemp("storage"), tmp_path_factory.mktemp("one-worker")
    extra = {"deepspeed.zero_optimization.stage": 2, "data.packing": False, "train.learning_rate": 1e-3}
    stopped = preempted(storage, "resumed", tiny_llama, pairs_file, **extra)
    shutil.copytree(storage, copy, symlinks=True, dirs_exist_ok=True)
    stored = {"storage": reference_files(storage), "copy": reference_files(copy)}
    resumed = train(storage, "resumed", tiny_llama, pairs_file, **extra, **{"checkpoint.export_final": True})
    full = train(storage, "full", tiny_llama, pairs_file, **extra)
    return storage, stopped, resumed, full, extra, stored, copy


@pytest.fixture(scope="module")
def one_worker(full_zero2, tiny_llama, pairs_file):
    """The copy of the preempted experiment redeployed on one worker instead of two."""
    extra, copy = full_zero2[4], full_zero2[6]
    return train(copy, "resumed", tiny_llama, pairs_file, **extra, **{"scaling.num_workers": 1})


def test_full_fine_tuning_learns_against_the_stored_reference(full_zero2):
    storage, stopped, _, full, *_ = full_zero2
    assert "reference log-probabilities of 480 answers (" in stopped, stopped[-3000:]  # 240 pairs, 2 answers each
    (folder,) = (storage / "prepared").glob("*/reference-*")
    record = json.loads((folder / "reference.json").read_text())
    assert record["answers"] == 480 and record["precision"] == "bf16"
    assert f"reference log-probabilities: reusing {folder}" in full  # another experiment, the same model and data
    start, end = assert_learns(storage / "full")
    print(f"full fine-tuning ZeRO-2: margin {start:.3f} -> {end:.3f}")


def assert_reference_reused(out: str, storage: Path, before: dict) -> None:
    """The run read the stored reference: no pass logged, and no file of it, nor its folder, written again."""
    assert "reference log-probabilities: reusing" in out and "reference log-probabilities of" not in out, out[-3000:]
    assert reference_files(storage) == before


def test_full_fine_tuning_resumes_exactly_after_a_sigterm_without_recomputing_the_reference(full_zero2):
    storage, _, resumed, _, _, stored, _ = full_zero2
    assert_reference_reused(resumed, storage, stored["storage"])
    assert_resumed_exactly(storage, resumed)
    from transformers import AutoModelForCausalLM

    final = storage / "resumed" / "final"
    assert not (final / "adapter").exists() and (final / "model.safetensors").exists()
    assert AutoModelForCausalLM.from_pretrained(final).config.num_hidden_layers == 2


# Per-step loss of the redeploy on one worker vs the uninterrupted two-worker run: the first step after the resume
# scores the same pairs with the checkpoint's weights (seen: bit-identical); later steps follow gradients reduced in
# another order in bf16 (seen: <= 1.5e-4). Weights not carried over would be log 2 at that first step, 0.2 off.
WORLD_TOL = 2e-3


@pytest.mark.slow  # one more run (the unit suite's 20 minutes); the SFT world change is in test_reliability.py
def test_full_fine_tuning_resumes_on_another_number_of_workers(full_zero2, one_worker):
    """Two workers preempted after step STOP, redeployed on one: accumulation 1 -> 2 keeps the global batch of 4
    pairs, the checkpoint goes through DeepSpeed's universal format, the stored reference is read, and every later
    step's loss is the uninterrupted run's."""
    storage, _, _, _, _, stored, copy = full_zero2
    one = one_worker
    check_world_change(one, STOP, 2, 1, "train.gradient_accumulation_steps 1 -> 2 keeps the global batch of 4")
    assert_reference_reused(one, copy, stored["copy"])
    full, got = losses(storage / "full"), losses(copy / "resumed")
    assert sorted(got) == list(range(1, STEPS + 1)), got
    assert abs(full[STOP + 1] - got[STOP + 1]) <= 1e-6, (full[STOP + 1], got[STOP + 1])
    worst = max(abs(full[s] - got[s]) for s in range(STOP + 2, STEPS + 1))
    assert worst <= WORLD_TOL, {s: (full[s], got[s]) for s in range(STOP + 2, STEPS + 1)}


@pytest.mark.slow  # one more run of full fine-tuning, under ZeRO-3
def test_full_fine_tuning_learns_under_zero3(tmp_path, tiny_llama, pairs_file):
    out = train(tmp_path, "full", tiny_llama, pairs_file, **{"train.learning_rate": 1e-3})
    assert "ZeRO-3" in out and "reference log-probabilities of 480 answers" in out
    start, end = assert_learns(tmp_path / "full")
    print(f"full fine-tuning ZeRO-3: margin {start:.3f} -> {end:.3f}")


@pytest.mark.slow  # a run per loss
@pytest.mark.parametrize("loss", ["ipo", "simpo", "orpo"])
def test_the_other_losses_learn_the_preference(tmp_path, tiny_llama, pairs_file, loss):
    extra = {"preference.loss": loss, "model.lora": "{r: 8, alpha: 16}", "deepspeed.zero_optimization.stage": 2}
    out = train(tmp_path, "full", tiny_llama, pairs_file, **extra)
    steps = records(tmp_path / "full")
    last = [steps[s] for s in range(STEPS - 2, STEPS + 1)]
    assert all(r["rewards/accuracies"] >= 0.9 for r in last), (out[-2000:], last)
    assert sum(r["rewards/margins"] for r in last) / 3 > steps[1]["rewards/margins"], last
    if loss == "orpo":
        assert "nll_loss" in steps[1] and "log_odds_ratio" in steps[1]


@pytest.mark.slow  # two more runs
def test_a_reference_model_path_gives_what_the_adapters_switched_off_give(tmp_path, tiny_llama, pairs_file):
    """The base weights as LoRA's own reference (the adapters off, at each step) and loaded from another folder for
    a pass before training (partitioned under ZeRO-3, then freed): the same per-step losses."""
    import shutil

    copy = shutil.copytree(tiny_llama, tmp_path / "reference-model")
    extra = {"model.lora": "{r: 8, alpha: 16}", "train.max_steps_per_epoch": 6}
    train(tmp_path, "auto", tiny_llama, pairs_file, **extra)
    out = train(tmp_path, "path", tiny_llama, pairs_file, **extra, **{"preference.reference": str(copy)})
    assert f"reference log-probabilities of 480 answers ({copy})" in out, out[-3000:]
    auto, path = losses(tmp_path / "auto"), losses(tmp_path / "path")
    assert sorted(auto) == sorted(path) == list(range(1, 7))
    assert max(abs(auto[s] - path[s]) for s in auto) <= 1e-5, (auto, path)


def bad_rows(tmp_path: Path, row: dict) -> Path:
    rows = preference_rows(3, seed=2)
    return write_rows(tmp_path / "bad.jsonl", [rows[0], row, rows[2]])


@pytest.mark.parametrize(
    "row, message",
    [
        pytest.param({"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "assistant", "content": "A"}]},
                     "has no 'rejected'", id="no-rejected"),
        pytest.param({**preference_rows(1)[0], "rejected": preference_rows(1)[0]["chosen"]},
                     "has the same 'chosen' and 'rejected' answer", id="identical"),
    ],
)  # fmt: skip
def test_bad_pairs_exit_2_with_one_line_before_any_cluster(tmp_path, tiny_llama, row, message):
    path = bad_rows(tmp_path, row)
    args = tiny_overrides(tmp_path, "bad", tiny_llama, **{"data.dataset": str(path), "preference.loss": "sigmoid"})
    result = run_cli("train", *args, "--set", "data.chat_template=zephyr", "--set", "data.seq_length=160")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert message in errors[0] and f"{path} line 2" in errors[0] and "Fix:" in errors[0], errors
    assert "Ray cluster" not in result.stdout + result.stderr and not (tmp_path / "bad").exists()


def test_the_config_and_the_data_must_agree(tmp_path, tiny_llama, pairs_file):
    """A preference config on SFT data, and preference pairs without one: exit 2, one line, nothing started."""
    from conftest import REPO

    sft = tiny_overrides(tmp_path, "sft", tiny_llama, **{"data.dataset": str(REPO / "examples/data/tiny-chat.jsonl")})
    result = run_cli("validate", *sft, "--set", "preference.loss=simpo", "--set", "data.chat_template=zephyr")
    assert result.returncode == 2 and "is chat data, not preference pairs" in result.stderr, result.stderr[-2000:]
    pairs = tiny_overrides(tmp_path, "pairs", tiny_llama, **{"data.dataset": str(pairs_file)})
    result = run_cli("train", *pairs, "--set", "data.chat_template=zephyr", "--set", "data.seq_length=160")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "holds preference pairs" in errors[0], result.stderr
    assert "set `preference`" in errors[0] and "Ray cluster" not in result.stdout + result.stderr


def test_preference_training_turns_the_models_dropout_off(tiny_model):
    """The tiny GPT-2 (the e2e job's model) has dropout in its config: under `preference` the model training loads has
    every dropout at 0 (TRL's disable_dropout), so the reference scores as the policy does; model.dropout, when set,
    still decides; supervised fine-tuning keeps the model's own."""
    from app.config import parse
    from app.model import load_model
    from app.preference_train import policy_model

    def dropouts(**doc) -> set[float]:
        model = {"name_or_path": str(tiny_model), **doc.pop("model", {})}
        cfg = parse({"model": model, "scaling": {"num_workers": 1, "use_gpu": False}, **doc})
        config = load_model(policy_model(cfg), {}).config.to_dict()
        return {value for key, value in config.items() if key.endswith("pdrop") or key.endswith("dropout")}

    assert dropouts() == {0.1}
    assert dropouts(preference={"loss": "sigmoid"}) == {0.0}
    assert dropouts(preference={"loss": "sigmoid"}, model={"dropout": 0.2}) == {0.2}
