"""The benchmark harness (benchmarks/): every GPU case is a config the app accepts, with the ds_config the
workers would get; the CPU smoke suite runs every runner end to end (slow)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import save_file

from app.config import ConfigError
from benchmarks import bench


def _configs(tmp_path, cases):
    for case in cases:
        case = dataclasses.replace(case, corpus_tokens=5_000)
        doc, shape = bench.case_config(case, tmp_path)
        path = tmp_path / "configs" / f"{case.name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc))
        if case.weights:  # the harness writes the weights (benchmarks/make_weights.py) before the app checks them
            save_file({}, Path(doc["model"]["name_or_path"]) / "model.safetensors")
        try:
            yield case, bench._knobs(doc, shape, path, case.runner)
        except ConfigError as exc:
            yield case, exc


def test_every_gpu_case_is_a_valid_config_with_the_defaults_ds_config(tmp_path):
    cases = {
        c.name + "/" + suite: c
        for suite in (
            "explore",
            "gpu",
            "tune",
            "final",
            "prefetch",
            "confirm",
            "peer",
            "peer1",
            "peer2",
            "start",
            "tutorial",
            "start-ab",
            "start-ab2",
            "ckpt",
        )
        for c in bench.SUITES[suite]()
    }
    seen = 0
    for case, knobs in _configs(tmp_path, cases.values()):
        seen += 1
        if case.sets.get("model.compile"):
            # Run C's compile cases failed on the GPUs; the app now refuses them before starting (a row with
            # the error, not a crash of the harness).
            assert isinstance(knobs, ConfigError) and "model.compile" in str(knobs), (case.name, knobs)
            continue
        assert not isinstance(knobs, ConfigError), (case.name, knobs)
        zero = knobs["ds_config"]["zero_optimization"]
        assert knobs["workers"] == case.sets.get("scaling.num_workers", 2)
        if (
            knobs["stage"] == 3
            and "deepspeed.zero_optimization.leaf_module" not in case.sets
            and case.shape.startswith("llama")
        ):
            # The defaults: whole Llama layers, and a prefetch bucket of at least one of them.
            assert zero["leaf_module"]["classes"] == ["LlamaDecoderLayer"], (case.name, zero)
            assert zero["stage3_prefetch_bucket_size"] >= (44_044_288 if case.shape == "llama-1.1b" else 218_112_000)
    assert seen == len(cases)


@pytest.mark.slow
def test_smoke_suite_runs_every_runner_on_cpu(tmp_path):
    """About 6 minutes on 2 cores: the tutorial, ZeRO-2, ZeRO-3 with checkpoint and resume, and HF Trainer."""
    out = tmp_path / "out"
    assert bench.main(["--suite", "smoke", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["case"] for r in rows] == [c.name for c in bench.suite_smoke()]
    for r in rows:
        assert not r.get("error"), r["error"]
        assert r["steps_timed"] >= 3 and r["tokens_per_s_per_gpu"] > 0, r
        if r["runner"] == "app":  # the start-up, phase by phase, from launch to the first step
            phases = r["startup"]
            assert list(phases)[:2] == ["launch_to_driver", "ray_started"] and list(phases)[-2:] == [
                "engine",
                "first_step",
            ]
            assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= r["time_to_first_step_s"] + 0.5, r
    ckpt = next(r["checkpoint"] for r in rows if r.get("checkpoint"))
    assert ckpt["bytes"] > 0 and ckpt["resumed_at_step"] == 5 and ckpt["load_s"] >= 0, ckpt  # tiny: 0.0 s
