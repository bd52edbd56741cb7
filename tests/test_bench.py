"""The benchmark harness (benchmarks/): every GPU case is a config the app accepts, with the ds_config the
workers would get; the CPU smoke suite runs every runner end to end (slow)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from benchmarks import bench


def _configs(tmp_path, cases):
    for case in cases:
        case = dataclasses.replace(case, corpus_tokens=5_000)
        doc, shape = bench.case_config(case, tmp_path)
        path = tmp_path / "configs" / f"{case.name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc))
        yield case, bench._knobs(doc, shape, path, case.runner)


def test_every_gpu_case_is_a_valid_config_with_the_defaults_ds_config(tmp_path):
    cases = {c.name + "/" + suite: c for suite in ("explore", "gpu", "tune", "final", "prefetch", "confirm")
             for c in bench.SUITES[suite]()}
    seen = 0
    for case, knobs in _configs(tmp_path, cases.values()):
        zero = knobs["ds_config"]["zero_optimization"]
        assert knobs["workers"] == case.sets.get("scaling.num_workers", 2)
        if knobs["stage"] == 3 and "deepspeed.zero_optimization.leaf_module" not in case.sets:
            leaf = zero.get("leaf_module", {}).get("classes")
            if case.shape.startswith("llama"):
                # The defaults: whole Llama layers, and a prefetch bucket of at least one of them.
                assert leaf == ["LlamaDecoderLayer"], (case.name, zero)
                assert zero["stage3_prefetch_bucket_size"] >= (44_044_288 if case.shape == "llama-1.1b" else 218_112_000)
        seen += 1
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
    ckpt = next(r["checkpoint"] for r in rows if r.get("checkpoint"))
    assert ckpt["bytes"] > 0 and ckpt["resumed_at_step"] == 5, ckpt
