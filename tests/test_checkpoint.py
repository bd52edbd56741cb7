"""Ray's and DeepSpeed's private formats that app/checkpoint/formats.py relies on, checked against the installed
(pinned) versions: a version bump that changes them fails here rather than in a user's resume."""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import tomllib
from pathlib import Path

import torch
from k8s_support import REPO

from app.checkpoint import formats

PINS = dict(
    re.match(r"^([A-Za-z0-9_.-]+)(?:\[\w+\])?==(.+)$", dep).groups()
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


def test_a_universal_folder_is_made_loadable_at_any_stage(tmp_path):
    """DeepSpeed's engine looks for `zero_pp_rank_0_mp_rank_NN_model_states.pt` at stage 3 and
    `mp_rank_NN_model_states.pt` below it (its private _get_ckpt_name), and stages 0-2 assert the optimizer state's
    DeepSpeed version, which the converter leaves out of a stage-3 checkpoint's; the converter keeps the file's own."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert "sd.get(DS_VERSION, False)" in inspect.getsource(DeepSpeedZeroOptimizer._load_global_state)
    source = inspect.getsource(DeepSpeedEngine._get_ckpt_name)
    assert '"zero_pp_rank_{}".format(pp_rank)' in source and '"mp_rank_" + mp_rank_str + "_model_states.pt"' in source
    torch.save({"ds_version": "0.19.8", "global_steps": 4}, tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    (tmp_path / "zero" / "w").mkdir(parents=True)  # a stage-3 checkpoint's, converted: bare tensors, step inside
    groups = [{"lr": 0.1, "params": [0]}]
    torch.save(
        {"optimizer_state_dict": {"state": {0: {"step": 4}}}, "param_groups": groups},
        tmp_path / "zero" / "optimizer_state.pt",
    )
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        torch.save(torch.ones(3), tmp_path / "zero" / "w" / f"{key}.pt")
    added = formats.complete_universal(tmp_path, groups=2)  # the loading optimizer has 2 groups, the saved one 1
    assert added[0] == "mp_rank_00_model_states.pt" and "3 parameter states" in added[1], added
    assert torch.load(tmp_path / "zero" / "optimizer_state.pt")["param_groups"] == groups * 2
    assert torch.load(tmp_path / "mp_rank_00_model_states.pt")["global_steps"] == 4
    assert torch.equal(torch.load(tmp_path / "zero" / "w" / "fp32.pt")["param"], torch.ones(3))
    assert torch.load(tmp_path / "zero" / "w" / "step.pt") == 4
    assert torch.load(tmp_path / "zero" / "optimizer_state.pt")["ds_version"] == "0.19.8"
    assert formats.complete_universal(tmp_path, groups=2) == []  # once
    # A stage 0-2 checkpoint's, converted: states in dicts, step.pt beside them; stage 3 wants the step inside.
    torch.save({"ds_version": "0.19.8", "param_groups": groups * 2}, tmp_path / "zero" / "optimizer_state.pt")
    assert formats.complete_universal(tmp_path, groups=2) == ["the step in zero/optimizer_state.pt"]
    inner = torch.load(tmp_path / "zero" / "optimizer_state.pt")["optimizer_state_dict"]
    assert inner == {"state": {0: {"step": 4}}, "param_groups": groups * 2}
    assert formats.complete_universal(tmp_path / "missing") == []


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


def test_a_resume_at_another_zero_stage_converts_between_any_stages():
    """A change of stage goes through DeepSpeed's universal checkpoint (tests/test_reliability.py runs 3 -> 2;
    tests/test_stage0.py to and from stage 0, whose optimizer the app converts); the note says so, and says when the
    master weights change precision (train.pure_bf16 changed). Checkpoints that predate the record pass."""
    from app.checkpoint import ResumePlan
    from app.config import parse

    def cfg(stage: int, workers: int = 2, pure: bool = False):
        zero = {"zero_optimization": {"stage": stage}}
        return parse({"scaling": {"num_workers": workers}, "deepspeed": zero, "train": {"pure_bf16": pure}})

    state = {"world_size": 2, "micro_batch_size": 1, "gradient_accumulation_steps": 1, "zero_stage": 2}
    for stage in (1, 3, 0):
        plan = ResumePlan.decide("step-00000004", state, cfg(stage))
        assert not plan.problems and plan.gradient_accumulation_steps is None, plan
        assert f"written at ZeRO stage 2, this run has stage {stage}" in plan.note and "universal" in plan.note
        assert ("stage 0 saves its optimizer whole" in plan.note) == (stage == 0), plan.note
    both = ResumePlan.decide("step-00000004", state, cfg(3, workers=1))  # stage and workers: one note, both said
    assert both.gradient_accumulation_steps == 2 and "stage 3" in both.note and "written by 2 workers" in both.note
    pure = ResumePlan.decide("step-00000004", {**state, "zero_stage": 0, "pure_bf16": True}, cfg(3))
    assert "written at ZeRO stage 0" in pure.note and "change precision, bf16 -> fp32" in pure.note, pure.note
    assert "precision" not in ResumePlan.decide("step-00000004", {**state, "pure_bf16": True}, cfg(0, pure=True)).note
    (problem,) = ResumePlan.decide("step-00000004", state, cfg(0, workers=1)).problems  # stage 0: the same workers
    assert problem.field == "scaling.num_workers" and "needs ZeRO stage 1, 2 or 3" in problem.message, problem
    assert ResumePlan.decide("step-00000004", state, cfg(2)) == ResumePlan("step-00000004")
    older = {k: v for k, v in state.items() if k != "zero_stage"}
    assert ResumePlan.decide("step-00000004", older, cfg(3)) == ResumePlan("step-00000004")


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


# --- background saves: ordering, one in flight, a crash mid-write ---------------------------------------------


def test_deepspeed_writes_every_checkpoint_file_through_its_checkpoint_engine():
    """A background save relies on this (formats.checkpoint_engine): each file of engine.save_checkpoint goes
    through `self.checkpoint_engine.save`, never straight to torch.save."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    for method in (DeepSpeedEngine._save_checkpoint, DeepSpeedEngine._save_zero_checkpoint):
        source = inspect.getsource(method)
        assert "self.checkpoint_engine.save(" in source and "torch.save(" not in source, method.__name__


class _Engine:
    """What a Saver uses of a DeepSpeed engine: `save_checkpoint` routes its files through `checkpoint_engine`
    (checked against DeepSpeed itself above); one optimizer shard of a weight the 'training' changes."""

    class TorchEngine:  # the shape of DeepSpeed's TorchCheckpointEngine
        zipfile_serialization = True

        def makedirs(self, path, exist_ok=False):
            os.makedirs(path, exist_ok=exist_ok)

        def save(self, state_dict, path):
            torch.save(state_dict, path)

    def __init__(self):
        self.checkpoint_engine = self.TorchEngine()
        self.weight = torch.zeros(256)
        self.weight.ds_id = "fp32-group-0"  # DeepSpeed sets attributes on its tensors; torch.save pickles them
        self.module = torch.nn.Linear(2, 2)
        self.optimizer = type("Optimizer", (), {"state_dict": lambda _: {"fp32": self.weight}})()

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        folder = Path(save_dir) / tag
        self.checkpoint_engine.makedirs(folder, exist_ok=True)
        self.checkpoint_engine.save(
            {"module": self.module.state_dict(), **client_state}, str(folder / "mp_rank_00_model_states.pt")
        )
        self.checkpoint_engine.save(
            {"fp32": self.weight, "view": self.weight[3:7]}, str(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        )


def _saver(engine, background=True):
    from app.checkpoint import Saver

    return Saver(
        engine,
        0,
        1,
        lambda: None,
        lambda p: (p.mkdir(), (p / "config.json").write_text("{}")),
        None,
        background=background,
    )


def _state(step):
    return {"global_step": step, "epoch": 0, "step_in_epoch": step, "world_size": 1}


def test_background_save_is_complete_only_once_its_files_are_on_disk(tmp_path):
    """The loop gets control back while the write is held; no completion mark exists until every file is
    written, and the files hold the state as it was at the save even though training changed it since."""
    import threading

    from app import checkpoint
    from app.checkpoint.saving import IDLE, WRITING

    engine, gate = _Engine(), threading.Event()
    saver = _saver(engine)
    saver.prepare()  # host buffers for the optimizer's state, allocated ahead by the writer thread
    saver.writer.wait()
    assert saver.copier.reserved[0] == engine.weight.untyped_storage().nbytes()
    saver.writer.before_write = lambda path: gate.wait(10)
    path = checkpoint.checkpoint_dir(tmp_path, 2)
    engine.weight.fill_(2.0)
    assert saver.save(path, _state(2), {"loss": 1.0}) == []
    engine.weight.fill_(3.0)  # the next step changes the weights while the write is held
    assert saver.copier.allocated < engine.weight.untyped_storage().nbytes()  # the save used the reserved buffer
    assert saver.status() == WRITING and saver.settle(WRITING) == []
    assert not (path / checkpoint.STATE_FILE).exists() and "never finished" in checkpoint.problem(path)
    gate.set()
    saver.writer.wait()
    assert saver.status() == IDLE
    [done] = saver.settle(IDLE)
    assert done.path == path and done.background and done.extra == {"loss": 1.0}
    assert checkpoint.problem(path) is None and not list(path.rglob("*.tmp"))
    shard = torch.load(path / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert (shard["fp32"] == 2.0).all() and shard["view"].storage_offset() == 3  # a view of the same storage


def test_one_background_save_in_flight_and_same_bytes_as_a_synchronous_one(tmp_path):
    """The next save first completes the one in flight (returned for its report before the new one starts); the
    files are byte for byte those of a synchronous save of the same state."""
    from app import checkpoint

    engine = _Engine()
    saver = _saver(engine)
    engine.weight.fill_(1.0)
    saver.save(checkpoint.checkpoint_dir(tmp_path / "bg", 2), _state(2), {})
    done = saver.save(checkpoint.checkpoint_dir(tmp_path / "bg", 4), _state(4), {}, wait=True)
    assert [d.state["global_step"] for d in done] == [2, 4]
    assert saver.pending is None and checkpoint.problem(checkpoint.checkpoint_dir(tmp_path / "bg", 4)) is None
    engine.weight.fill_(1.0)
    [sync] = _saver(engine, background=False).save(checkpoint.checkpoint_dir(tmp_path / "fg", 2), _state(2), {})
    assert not sync.background
    bg, fg = (checkpoint.checkpoint_dir(tmp_path / d, 2) / "ds" for d in ("bg", "fg"))
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        assert (bg / name).read_bytes() == (fg / name).read_bytes(), name


def test_copies_in_pinned_chunks_give_the_same_files(tmp_path, monkeypatch):
    """A storage larger than a pinned chunk is copied chunk by chunk (each GPU copy lands in one registration):
    the files are still byte for byte a synchronous save's."""
    from app import checkpoint
    from app.checkpoint import background

    monkeypatch.setattr(background, "PIN_CHUNK", 100)  # the 256-float weight spans 11 chunks
    engine = _Engine()
    engine.weight.copy_(torch.arange(256.0))
    saver = _saver(engine)
    saver.prepare()
    saver.save(checkpoint.checkpoint_dir(tmp_path / "bg", 2), _state(2), {}, wait=True)
    [_] = _saver(engine, background=False).save(checkpoint.checkpoint_dir(tmp_path / "fg", 2), _state(2), {})
    bg, fg = (checkpoint.checkpoint_dir(tmp_path / d, 2) / "ds" for d in ("bg", "fg"))
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        assert (bg / name).read_bytes() == (fg / name).read_bytes(), name


def test_host_buffers_for_gpu_copies_are_pinned_chunk_by_chunk(monkeypatch):
    """Buffers for GPU storages are registered with CUDA one page-aligned chunk at a time (no page in two
    registrations, every byte in one), and unregistered when the buffer goes. CUDA's runtime is recorded here:
    there is no GPU on this machine; the GPU figures are benchmarks/pin_stall.py's."""
    import gc
    import mmap

    from app.checkpoint import background

    calls = []

    class Runtime:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    monkeypatch.setattr(background, "PIN_CHUNK", 4 * mmap.PAGESIZE)
    buf = background.host_buffer(10 * mmap.PAGESIZE + 5, pinned=True)
    assert buf.numel() == 10 * mmap.PAGESIZE + 5 and not buf.any()  # touched before registering
    regs = [c for c in calls if c[0] == "register"]
    assert [size for _, _, size in regs] == [4 * mmap.PAGESIZE, 4 * mmap.PAGESIZE, 2 * mmap.PAGESIZE + 5]
    assert [ptr - buf.data_ptr() for _, ptr, _ in regs] == [0, 4 * mmap.PAGESIZE, 8 * mmap.PAGESIZE]
    assert buf.data_ptr() % mmap.PAGESIZE == 0
    del buf
    gc.collect()
    assert sorted(c[1] for c in calls if c[0] == "unregister") == sorted(ptr for _, ptr, _ in regs)
    assert background.host_buffer(3, pinned=False).numel() == 3 and len(calls) == 6  # CPU storages: not pinned


def test_a_failed_background_write_stops_the_run_with_the_storage_message(tmp_path):
    import errno

    import pytest

    from app import checkpoint
    from app.checkpoint.saving import FAILED

    saver = _saver(_Engine())

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    saver.writer.before_write = full
    path = checkpoint.checkpoint_dir(tmp_path, 2)
    saver.save(path, _state(2), {})
    saver.writer.wait()
    assert saver.status() == FAILED
    with pytest.raises(checkpoint.CheckpointError, match=f"cannot write checkpoint {path}"):
        saver.settle(FAILED)
    assert checkpoint.problem(path) is not None and checkpoint.newest_usable(tmp_path) is None


CRASH = r"""
import os, signal, sys, threading
from pathlib import Path
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from test_checkpoint import _Engine, _saver, _state
from app import checkpoint
run = Path(sys.argv[1])
engine = _Engine()
saver = _saver(engine)
saver.save(checkpoint.checkpoint_dir(run, 2), _state(2), {}, wait=True)
saver.writer.before_write = lambda path: (print("writing", flush=True), threading.Event().wait())
saver.save(checkpoint.checkpoint_dir(run, 4), _state(4), {})
print("training goes on", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as a node loss mid-write would
"""


def test_a_crash_during_a_background_write_leaves_a_folder_resume_skips(tmp_path):
    """A process killed while its background write runs: the folder of that save has no completion mark, so a
    resume takes the previous complete checkpoint and removes the partial one."""
    import subprocess

    from app import checkpoint

    done = subprocess.run(
        [sys.executable, "-c", CRASH, str(tmp_path), str(REPO), str(REPO / "tests")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -9 and "training goes on" in done.stdout, done.stderr[-3000:]
    partial = checkpoint.checkpoint_dir(tmp_path, 4)
    assert partial.is_dir() and "never finished" in checkpoint.problem(partial)
    assert checkpoint.newest_usable(tmp_path) == checkpoint.checkpoint_dir(tmp_path, 2)
    assert any("removed step-00000004" in line for line in checkpoint.remove_newer(tmp_path, 2))
