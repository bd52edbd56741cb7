"""Ray's and DeepSpeed's private formats that app/checkpoint/formats.py relies on, checked against the installed
(pinned) versions: a version bump that changes them fails here rather than in a user's resume."""

from __future__ import annotations

import inspect
import json
import re
import sys
import tomllib

from k8s_support import REPO

from app.checkpoint import formats

PINS = dict(
    re.match(r"^([a-z]+)(?:\[\w+\])?==(.+)$", dep).groups()
    for dep in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    if "==" in dep
)


def test_the_pinned_versions_are_installed():
    import deepspeed
    import ray

    assert (ray.__version__, deepspeed.__version__) == (PINS["ray"], PINS["deepspeed"])


def test_ray_snapshot_repair_gives_a_snapshot_ray_loads(tmp_path):
    """A snapshot as Ray 2.60 writes it, naming a folder that is gone: after the repair it still parses as
    Ray's own state model, without that folder and with the latest result moved to the one that is left."""
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        _CheckpointManagerState,
        _TrainingResultState,
    )

    assert CHECKPOINT_MANAGER_SNAPSHOT_FILENAME == formats.RAY_SNAPSHOT
    kept, gone = "checkpoints/step-00000002", "checkpoints/step-00000004"
    results = [
        _TrainingResultState(checkpoint_dir_name=name, metrics={"step": i}) for i, name in enumerate([kept, gone])
    ]
    state = _CheckpointManagerState(
        checkpoint_results=results,
        checkpoint_report_indices=[0, 1],
        latest_checkpoint_result=results[1],
        pending_training_results=[results[1]],
        pending_validation_specs=[False],
        current_report_index=2,
        validated_checkpoint_dir_names=[kept, gone],
        timed_out_validation_checkpoint_dir_names=[gone],
        failed_validation_checkpoint_dir_names=[],
    )
    (tmp_path / kept).mkdir(parents=True)
    (tmp_path / formats.RAY_SNAPSHOT).write_text(state.model_dump_json())  # what Ray writes (its .json())
    assert "step-00000004" in formats.repair_ray_snapshot(tmp_path)[0]
    repaired = _CheckpointManagerState.model_validate(json.loads((tmp_path / formats.RAY_SNAPSHOT).read_text()))
    assert [r.checkpoint_dir_name for r in repaired.checkpoint_results] == [kept]
    assert repaired.checkpoint_report_indices == [0]
    assert repaired.latest_checkpoint_result.checkpoint_dir_name == kept
    assert repaired.pending_training_results == [] and repaired.pending_validation_specs == []
    assert repaired.validated_checkpoint_dir_names == [kept]
    assert repaired.timed_out_validation_checkpoint_dir_names == []
    assert set(formats.RAY_NAME_LISTS) <= set(_CheckpointManagerState.model_fields)


def test_deepspeed_universal_conversion_takes_our_arguments(monkeypatch, tmp_path):
    from deepspeed.checkpoint import ds_to_universal

    monkeypatch.setattr(sys, "argv", ["ds_to_universal", "--input_folder", "in", "--output_folder", "out"])
    theirs = vars(ds_to_universal.parse_arguments())
    ours = vars(formats.universal_args(tmp_path / "in", tmp_path / "out"))
    assert set(ours) == set(theirs), "ds_to_universal's command line changed"
    assert list(inspect.signature(ds_to_universal.main).parameters) == ["args"]


def test_deepspeed_engine_reads_the_universal_flag_from_its_config():
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert "self._config.load_universal_checkpoint" in inspect.getsource(DeepSpeedEngine.load_universal_checkpoint)
    assert "self.load_universal_checkpoint =" in inspect.getsource(DeepSpeedConfig)

    class Engine:  # formats.loading_universal sets the flag for one load and always clears it
        _config = type("Config", (), {"load_universal_checkpoint": False})()

    engine = Engine()
    try:
        with formats.loading_universal(engine, True):
            assert engine._config.load_universal_checkpoint is True
            raise RuntimeError("load failed")
    except RuntimeError:
        pass
    assert engine._config.load_universal_checkpoint is False


# --- the driver's resume plan: pure, applied before the checks ---------------------------------------------


def test_resume_plan_keeps_the_global_batch_and_mutates_nothing():
    from app.checkpoint import ResumePlan
    from app.config import parse

    cfg = parse({"scaling": {"num_workers": 4}, "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 3}})
    state = {"world_size": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 4}  # 16 sequences a step
    before = cfg.model_dump()
    plan = ResumePlan.decide("step-00000004", state, cfg)
    assert (plan.gradient_accumulation_steps, plan.problems) == (2, ())
    assert "gradient_accumulation_steps 3 -> 2 keeps the global batch of 16" in plan.note
    assert cfg.model_dump() == before, "deciding changed the config"
    applied = plan.apply(cfg)
    assert applied.train.gradient_accumulation_steps == 2 and cfg.train.gradient_accumulation_steps == 3
    assert ResumePlan.decide("step-00000004", {**state, "world_size": 4}, cfg) == ResumePlan("step-00000004")
    assert ResumePlan("step-00000004").apply(cfg) is cfg


def test_resume_plan_problems_name_the_workers():
    from app.checkpoint import ResumePlan
    from app.config import parse

    state = {"world_size": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 4}
    odd = ResumePlan.decide(
        "step-00000004", state, parse({"scaling": {"num_workers": 3}, "train": {"micro_batch_size": 2}})
    )
    assert [p.field for p in odd.problems] == ["scaling.num_workers"] and "16 is not a multiple" in odd.problems[
        0
    ].message
    stage0 = parse({"scaling": {"num_workers": 4}, "deepspeed": {"zero_optimization": {"stage": 0}}})
    plan = ResumePlan.decide("step-00000004", state, stage0)
    assert plan.gradient_accumulation_steps is None and "needs ZeRO stage 1, 2 or 3" in plan.problems[0].message


# --- the loop's pieces ----------------------------------------------------------------------------------------


def test_optimizer_steps_take_whole_accumulations():
    from app.train_loop import optimizer_steps

    assert list(optimizer_steps(range(7), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(optimizer_steps(range(2), 1)) == [[0], [1]]


def test_save_policy_is_the_one_place_that_decides_saves():
    from app.train_loop import SavePolicy

    policy = SavePolicy(steps_per_epoch=5, total_steps=12, every=4, stop_after=None)
    assert [s for s in range(1, 13) if policy.due(s, (s - 1) % 5 + 1)] == [4, 5, 8, 10, 12]
    assert policy.position(0, 5) == (1, 0) and policy.position(1, 3) == (1, 3)
    preempted = SavePolicy(steps_per_epoch=5, total_steps=12, every=None, stop_after=7)
    assert [s for s in range(1, 13) if preempted.due(s, (s - 1) % 5 + 1)] == [5, 7, 8, 9, 10, 11, 12]
    assert not preempted.stop(6) and preempted.stop(7)
