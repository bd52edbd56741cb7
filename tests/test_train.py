"""End-to-end CPU training with real Ray Train and real DeepSpeed: stages, exact resume, export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import losses, run_cli, tiny_overrides


def train(storage: Path, name: str, model: Path, env: dict | None = None, **extra) -> str:
    result = run_cli("train", *tiny_overrides(storage, name, model, **extra), env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


def assert_learns(run_dir: Path) -> None:
    seen = losses(run_dir)
    first, last = seen[min(seen)], seen[max(seen)]
    assert last < 0.8 * first, seen


RESUME = {
    "train.epochs": 2,
    "train.max_steps_per_epoch": 8,
    "train.log_every_steps": 1,
    "model.dropout": 0.1,
    "data.eval_fraction": 0.05,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    """An uninterrupted ZeRO-3 run of 16 steps (its step 3 profiled), which exports final/."""
    storage = tmp_path_factory.mktemp("storage")
    env = {"FINETUNE_PROFILE_STEP": "3"}
    return storage, train(storage, "full", tiny_model, env=env, **RESUME, **{"checkpoint.export_final": True})


def test_zero3_learns(runs):
    storage, out = runs
    assert_learns(storage / "full")
    # Start-up phases are timed in the log (what an operator reads when a restart is slow).
    assert re.search(r"model and DeepSpeed engine ready in \d+\.\ds", out), out[-3000:]
    # Every step record says how long the host waited for the loader, never more than the step took.
    records = [json.loads(line) for line in (storage / "full" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    assert steps and all(0 <= r["data_wait_s"] <= r["step_time_s"] for r in steps), steps[:3]
    # The start-up is broken down once, before the first step: Ray, the driver until it hands Ray Train the trainer,
    # the worker group, imports, data, model, engine.
    startup = [r for r in records if r["kind"] == "startup"]
    assert len(startup) == 1 and startup[0]["time"] <= steps[0]["time"], startup
    phases = ["ray_started", "trainer", "worker", "imports", "model", "data", "engine"]
    assert list(startup[0]["phases_s"]) == phases
    assert all(v >= 0 for v in startup[0]["phases_s"].values()), startup
    # Rank 0's process was started ahead for Ray Train's workers, the loop's modules imported there while it waited
    # (app.prestart): were the environments not Ray Train's own, its actors would have started processes of their own.
    assert startup[0]["worker_process"]["started_ahead"] and startup[0]["worker_process"]["preloaded_s"] > 0, startup
    # FINETUNE_PROFILE_STEP: that step's profile, once, from rank 0 (no GPU here: no kernels, all idle).
    profiles = [r for r in records if r["kind"] == "profile"]
    assert [p["step"] for p in profiles] == [3] and profiles[0]["wall_ms"] > 0, profiles
    assert profiles[0]["kernels"] == 0 and profiles[0]["gpu_idle_ms"] == profiles[0]["wall_ms"], profiles
    # The run records the DeepSpeed config it resolved (the chart does not compute one): every "auto" filled.
    ds = json.loads((storage / "full" / "ds_config.json").read_text())
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2
    assert "auto" not in json.dumps(ds) and ds["zero_optimization"]["leaf_module"] == {"classes": ["GPT2Block"]}


# slow: two more runs. In make test, ZeRO-3 runs with dropout resume at the exact batch in tests/test_reliability.py
# (from step 2, mid-epoch 0, across the epoch's end: test_deleted_registered_checkpoint_and_foreign_files; from a
# step of epoch 1: test_sigterm_to_a_rank_saves_the_step_in_flight..., which also asserts the "loaded in" time), a
# stop by train.stop_after_steps resumes exactly under sequence parallelism (tests/test_sequence_parallel.py), and an
# eval split resumes exactly in tests/test_preference_train.py (the `lora` experiment).
@pytest.mark.slow
def test_exact_mid_epoch_resume(runs, tiny_model, tmp_path):
    storage, _ = runs
    stopped = train(tmp_path, "resumed", tiny_model, **RESUME, **{"train.stop_after_steps": 5})
    resumed = train(tmp_path, "resumed", tiny_model, **RESUME)
    assert "stopped at step 5 of 16" in stopped
    assert "resumed from" in resumed and "at global step 5 (epoch 0, step 5 of the epoch)" in resumed
    assert re.search(r"of the epoch\), loaded in \d+\.\ds;", resumed), resumed[-3000:]
    full, part = losses(storage / "full"), losses(tmp_path / "resumed")
    assert sorted(part) == list(range(1, 17))  # the global step continued from 5, it did not restart
    worst = max(abs(full[s] - part[s]) for s in range(6, 17))
    assert worst <= 1e-5, {s: (full[s], part[s]) for s in range(6, 17)}


def test_final_and_export_match_the_trained_engine(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    storage, _ = runs
    run_dir = storage / "full"
    final = run_dir / "final"
    assert (final / "model.safetensors").exists() and (final / "tokenizer.json").exists()
    last = sorted((run_dir / "checkpoints").iterdir())[-1]
    out = tmp_path / "exported"
    result = run_cli("export", str(last), str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    a = AutoModelForCausalLM.from_pretrained(final)
    b = AutoModelForCausalLM.from_pretrained(out)
    assert a.dtype == torch.bfloat16  # the training precision
    ids = torch.arange(1, 33)[None]
    assert torch.equal(a(ids).logits, b(ids).logits)


ENGINE_VS_EXPORT = r"""
import os, sys, json, torch, torch.distributed as dist
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from pathlib import Path
from app import checkpoint
from app.config import parse
from app.ds_config import build
from app.model import build_optimizer, build_scheduler, load_model, load_tokenizer
dist.init_process_group("gloo")
deepspeed.init_distributed(dist_backend="gloo")
cfg = parse({"model": {"name_or_path": sys.argv[1]}, "train": {"learning_rate": 1e-2}, "scaling": {"num_workers": 1}})
ds = build(cfg, hidden_size=64, world_size=1)
model = load_model(cfg.model, ds)
engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg.train, False), config=ds,
                                  lr_scheduler=lambda o: build_scheduler(o, cfg.train, 10))
ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
for _ in range(3):
    engine.backward(engine(input_ids=ids, labels=ids).loss); engine.step()
engine.eval()
with torch.no_grad():
    logits = engine(input_ids=ids).logits.float()
out = Path(sys.argv[2])
tok = load_tokenizer(cfg.model)
checkpoint.save(engine, out / "ckpt", {"global_step": 3, "world_size": 1, "precision": "bf16"}, 0, dist.barrier,
                lambda p: (model.config.save_pretrained(p), tok.save_pretrained(p)))
checkpoint.export(out / "ckpt", out / "hf")
engine.save_checkpoint(str(out / "raw"))  # a plain DeepSpeed save_dir, as other tools write them
torch.save(logits, out / "engine_logits.pt"); torch.save(ids, out / "ids.pt")
"""


def assert_readable_by_all(folder: Path) -> None:
    """Model files as a plain write leaves them (umask 022 here): a reader of another uid on a shared volume
    (a serving pod) can open the weights, which safetensors alone writes 0600."""
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in folder.rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


def test_tiny_model_files_are_readable_by_all(tiny_model):
    assert_readable_by_all(tiny_model)


def test_export_gives_the_engines_logits(tiny_model, tmp_path):
    """A ZeRO-3 bf16 engine trained a few steps, saved and exported: the export's logits equal the engine's."""
    import socket
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_VS_EXPORT, str(tiny_model), str(tmp_path), port],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    engine_logits = torch.load(tmp_path / "engine_logits.pt")
    assert_readable_by_all(tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert exported.dtype == torch.bfloat16
    with torch.no_grad():
        logits = exported(torch.load(tmp_path / "ids.pt")).logits.float()
    original = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        untrained = original.to(torch.bfloat16)(torch.load(tmp_path / "ids.pt")).logits.float()
    assert not torch.allclose(untrained, engine_logits, atol=1e-2)  # training really changed the weights
    assert torch.allclose(logits, engine_logits, atol=2e-2, rtol=1e-2), (logits - engine_logits).abs().max()
    # `finetune export` of a DeepSpeed checkpoint this app did not write, with --model for config and tokenizer.
    assert run_cli("export", str(tmp_path / "raw"), str(tmp_path / "raw-hf")).returncode == 2
    done = run_cli("export", str(tmp_path / "raw"), str(tmp_path / "raw-hf"), "--model", str(tiny_model))
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        raw = AutoModelForCausalLM.from_pretrained(tmp_path / "raw-hf")(torch.load(tmp_path / "ids.pt")).logits.float()
    assert torch.equal(raw, logits)


@pytest.mark.parametrize(
    "stage",
    [
        # slow: stages 1 and 2 are one DeepSpeed optimizer (DeepSpeedZeroOptimizer) with one checkpoint layout, and
        # nothing in the app tells them apart; zero2 stands for both (`pytest -m slow tests/test_train.py` runs it).
        pytest.param({"deepspeed.zero_optimization.stage": 1}, id="zero1", marks=pytest.mark.slow),
        # slow: in the unit suite ZeRO-2 trains in two runs that check more than a falling loss: the killed ZeRO-3
        # run redeployed at stage 2 gives the uninterrupted run's losses to 1e-3 at steps 5-8
        # (tests/test_reliability.py::test_resume_at_another_zero_stage), and DPO's full fine-tuning builds its engine
        # at stage 2 from scratch, learns, and resumes at the exact batch (tests/test_preference_train.py, full_zero2).
        pytest.param({"deepspeed.zero_optimization.stage": 2}, id="zero2", marks=pytest.mark.slow),
        # slow: on a fresh machine it JIT-compiles DeepSpeed's CPU Adam first (about 2 minutes on 2 cores), and the
        # unit suite sits at its 20-minute budget; `pytest -m slow tests/test_train.py` runs it.
        pytest.param(
            {
                "deepspeed.zero_optimization.offload_optimizer": "{device: cpu}",
                "deepspeed.zero_optimization.offload_param": "{device: cpu}",
            },
            id="zero3-offload",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_stages_learn(stage, tmp_path, tiny_model):
    train(tmp_path, "stage", tiny_model, **{"train.max_steps_per_epoch": 10, "train.log_every_steps": 1}, **stage)
    assert_learns(tmp_path / "stage")


def test_a_random_init_model_is_built_on_the_workers_gpu_unless_zero3_partitions_it(monkeypatch):
    """Initialising the weights on the CPU of a Ray worker took 35.5 s for the 1.1B at ZeRO-2 (one H200 host);
    on the GPU the engine would move it to anyway it takes a second (docs/benchmarks.md, start-up)."""
    import contextlib

    from app.model import random_init_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert random_init_device(zero3=False) == torch.device("cuda", 1)
    assert isinstance(random_init_device(zero3=True), contextlib.nullcontext)  # zero.Init places it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(random_init_device(zero3=False), contextlib.nullcontext)


def test_ray_trains_controller_gets_a_backend_config_without_torch():
    """Ray Train's controller unpickles the backend config in a process of its own: the app's config and
    backend import no torch there (Ray's TorchConfig did, 2-3 s before the first worker could start); the
    process group itself is set up by the training runs above, on two workers."""
    import subprocess
    import sys

    probe = (
        "import pickle, sys; from app.ray_backend import ProcessGroupConfig; "
        "c = pickle.loads(pickle.dumps(ProcessGroupConfig(backend='gloo'))); c.backend_cls; c.train_func_context; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_groups_port_stays_taken_until_the_group_listens_on_it(monkeypatch):
    """Rank 0 keeps the port it hands the other workers bound until its process group's store takes it: no other
    process of the node can take it in between (Ray's helper released it at once: EADDRINUSE, seen in the suite)."""
    import ray.train.torch.config as torch_config

    from app import ray_backend

    addr, port = ray_backend._reserve_port()
    taken = []
    monkeypatch.setattr(torch_config, "_setup_torch_process_group", lambda *a: taken.append(_bind(port)))
    with pytest.raises(OSError):
        _bind(port)  # another process's socket: refused while reserved
    ray_backend._init_group("gloo", 0, 1, 10)
    assert taken == [True] and ray_backend._reserved is None and addr


def _bind(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))
        return True


def liger_stand_in(monkeypatch, takes_bound: bool = True) -> None:
    """Liger's modules as far as app.model.loss_options reads them (the CPU test venv has no Liger: it pulls
    Triton; benchmarks/check_loss_chunks.py runs the real one on a GPU)."""
    import sys
    import types

    functional = types.ModuleType("liger_kernel.transformers.functional")
    ops = types.ModuleType("liger_kernel.ops.fused_linear_cross_entropy")
    if takes_bound:
        functional.liger_fused_linear_cross_entropy = lambda input, weight, target, chunk_mem_const=1: None
    else:  # an older Liger, without the parameter
        functional.liger_fused_linear_cross_entropy = lambda input, weight, target: None
    ops.LigerFusedLinearCrossEntropyFunction = type("F", (), {"supports_inner_impl_dispatch": takes_bound})
    for name in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, functional.__name__, functional)
    monkeypatch.setitem(sys.modules, ops.__name__, ops)


def model_with_forward_of(module: str, hidden: int, lora: bool = False):
    def forward(self, **kwargs):
        return kwargs

    forward.__module__ = module
    config = type("Config", (), {"hidden_size": hidden})()
    model = type("Model", (), {"forward": forward, "config": config})()
    if lora:  # PEFT's wrapper: the forward that computes the loss is the wrapped model's
        return type("Peft", (), {"get_base_model": lambda self: model, "forward": lambda self, **kw: kw})()
    return model


def test_ligers_fused_loss_gets_chunks_of_a_bounded_size_not_many_small_ones(monkeypatch):
    from app.model import loss_options

    liger = "liger_kernel.transformers.model.qwen2"
    liger_stand_in(monkeypatch)
    # The Qwen2-0.5B shape at 8 x 2048 tokens: Liger's own bound (1) made 128 chunks of 128 rows; 9 makes 16 of 1024.
    assert loss_options(model_with_forward_of(liger, 896), 16384) == {"chunk_mem_const": 9}
    assert loss_options(model_with_forward_of(liger, 2048), 16384) == {"chunk_mem_const": 4}
    assert loss_options(model_with_forward_of(liger, 896, lora=True), 16384) == {"chunk_mem_const": 9}
    assert loss_options(model_with_forward_of(liger, 8192), 32768) == {"chunk_mem_const": 1}  # never below Liger's
    # Not Liger's loss, or a Liger without the bound: the forward gets nothing more.
    assert loss_options(model_with_forward_of("transformers.models.qwen2.modeling_qwen2", 896), 16384) == {}
    liger_stand_in(monkeypatch, takes_bound=False)
    assert loss_options(model_with_forward_of(liger, 896), 16384) == {}


def test_the_train_step_hands_the_loss_options_to_every_forward():
    from app.train_loop import train_step

    seen = []

    class Engine:
        device = torch.device("cpu")

        def __call__(self, **kwargs):
            seen.append(kwargs)
            return type("Out", (), {"loss": torch.tensor(1.0)})()

        def backward(self, loss):
            pass

        def step(self):
            pass

    labels = torch.tensor([[-100, 5, 6]])
    batches = [{"input_ids": labels.abs(), "labels": labels}] * 2
    loss, tokens = train_step(Engine(), batches, 1, options={"chunk_mem_const": 9})
    assert [s["chunk_mem_const"] for s in seen] == [9, 9] and loss.item() == 2.0 and tokens.item() == 4
