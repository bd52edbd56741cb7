"""Preference tuning through the chart on the real cluster (issue #51, Done-when 5): examples/values-cpu.yaml made a
DPO job with LoRA on the image's bundled preference pairs (examples/data/tiny-preference.jsonl, zephyr template), a
few steps: the RayJob succeeds, metrics.jsonl has TRL's preference metrics at every step (the first step's loss log 2
and no pair ranked right: the reference is the policy with its adapters switched off) and in the evaluation, and
final/ is the merged model with final/adapter/ the PEFT adapter."""

from __future__ import annotations

import json
import math

import pytest

from e2e.test_train import assert_trained, install, metrics, put_model

pytestmark = pytest.mark.e2e

STEPS = 6
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
PREFERENCE_METRICS += ("logps/chosen", "logps/rejected")


def test_dpo_with_lora_trains_and_exports_the_adapter(cluster, namespace, node, tiny_model):
    ns = namespace
    claim = put_model(node, ns, "ft", tiny_model)
    # One key each: a whole `training` map would replace the values file's (its CPU scaling among it).
    dpo = {
        "training.data.dataset": "examples/data/tiny-preference.jsonl",
        "training.data.chat_template": "zephyr",
        "training.data.seq_length": 160,
        "training.model.lora": {"r": 8, "alpha": 16},
        "training.preference": {"loss": "sigmoid", "beta": 0.1},
        "training.train.epochs": 1,
        "training.train.max_steps_per_epoch": STEPS,
        "training.train.log_every_steps": 1,
    }
    install(cluster, node, ns, [f"{key}={json.dumps(value)}" for key, value in dpo.items()])
    assert_trained(cluster, node, ns, "ft", claim, total=STEPS)

    records = metrics(claim / "ft")
    steps = {r["step"]: r for r in records if r.get("kind") == "train"}
    assert sorted(steps) == list(range(1, STEPS + 1)), sorted(steps)
    assert all(math.isfinite(steps[s][name]) for s in steps for name in PREFERENCE_METRICS), steps
    first = steps[1]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-3) and first["rewards/accuracies"] == 0, first
    evals = [r for r in records if r.get("kind") == "eval"]
    assert evals and "eval_rewards/accuracies" in evals[-1] and evals[-1]["step"] == STEPS, evals
    final = claim / "ft" / "final"
    assert (final / "adapter" / "adapter_config.json").exists() and (final / "tokenizer.json").exists()
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16, config
