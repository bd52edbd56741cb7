"""train.pure_bf16: the config refuses what DeepSpeed cannot do with it, fills DeepSpeed's own two switches, and a
real engine (CPU, one process; ZeRO-2, ZeRO-3, and ZeRO-3 with the optimizer offloaded) then holds its master
weights and AdamW moments in bf16, learns, and resumes from its checkpoint at the exact loss; without the option the
same engine keeps them in fp32."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import losses, run_cli, tiny_overrides

from app.config import parse
from app.ds_config import build, check

ENGINE = r"""
import os, sys, json, torch, torch.distributed as dist
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from app.config import parse
from app.ds_config import build
from app.model import build_optimizer, build_scheduler, load_model
dist.init_process_group("gloo")
deepspeed.init_distributed(dist_backend="gloo")
ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
out = {}

def engine(stage, pure, offload=False):
    torch.manual_seed(0)
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    cfg = parse({"model": {"name_or_path": sys.argv[1]}, "scaling": {"num_workers": 1},
                 "train": {"learning_rate": 1e-2, "pure_bf16": pure}, "deepspeed": {"zero_optimization": zero}})
    ds = build(cfg, hidden_size=64, world_size=1)
    model = load_model(cfg.model, ds)
    e, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg.train, offload), config=ds,
                                 lr_scheduler=lambda o: build_scheduler(o, cfg.train, 10))
    return e

def steps(e, n):
    losses = []
    for _ in range(n):
        loss = e(input_ids=ids, labels=ids).loss
        e.backward(loss); e.step(); losses.append(loss.item())
    return losses

def dtypes(e):
    opt = e.optimizer
    master = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_partitioned_groups_flat
    moments = {str(v.dtype) for s in opt.optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg")}
    return {"master": sorted({str(t.dtype) for t in master}), "moments": sorted(moments)}

for stage, offload, pure, resume in json.loads(sys.argv[4]):
    e = engine(stage, pure, offload)
    key = f"z{stage}{'-offload' if offload else ''}-{'pure' if pure else 'mixed'}"
    out[key] = {"losses": steps(e, 5), **dtypes(e)}
    if resume:
        e2 = engine(stage, pure, offload)
        steps(e2, 3)
        e2.save_checkpoint(os.path.join(sys.argv[3], key))
        e3 = engine(stage, pure, offload)
        e3.load_checkpoint(os.path.join(sys.argv[3], key))
        out[key]["resumed"] = steps(e3, 2)
print("RESULT " + json.dumps(out))
"""


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


# (stage, optimizer offloaded, pure, resumed too): a pure and a mixed engine for each layout of the optimizer (ZeRO-3
# builds its partitions as ZeRO-2 does: its mixed twin adds nothing but time), the resume on both stages; the
# offloaded pair (DeepSpeed's CPU Adam, about 25 s more) in make test-all.
GPU_SIDE = [(2, False, True, True), (2, False, False, False), (3, False, True, True)]
OFFLOADED = [(3, True, True, False), (3, True, False, False)]


def run_engines(model: Path, folder: Path, plan: list[tuple]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", ENGINE, str(model), free_port(), str(folder), json.dumps(plan)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    return run_engines(tiny_model, tmp_path_factory.mktemp("ckpt"), GPU_SIDE)


def assert_bf16_only_when_asked(pure: dict, mixed: dict) -> None:
    assert pure["master"] == ["torch.bfloat16"] and pure["moments"] == ["torch.bfloat16"], pure
    assert mixed["master"] == ["torch.float32"] and mixed["moments"] == ["torch.float32"], mixed
    assert pure["losses"][-1] < 0.9 * pure["losses"][0], pure["losses"]
    assert abs(pure["losses"][-1] - mixed["losses"][-1]) < 0.1 * mixed["losses"][-1], (pure, mixed)


def test_master_weights_and_moments_are_bf16_only_when_asked(engines):
    assert_bf16_only_when_asked(engines["z2-pure"], engines["z2-mixed"])
    assert engines["z3-pure"]["master"] == engines["z3-pure"]["moments"] == ["torch.bfloat16"]


@pytest.mark.slow
def test_an_offloaded_optimizer_keeps_bf16_moments_only_when_asked(tiny_model, tmp_path):
    found = run_engines(tiny_model, tmp_path, OFFLOADED)
    assert_bf16_only_when_asked(found["z3-offload-pure"], found["z3-offload-mixed"])


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_pure_bf16_resumes_at_the_exact_loss(engines, stage):
    pure = engines[f"{stage}-pure"]
    assert pure["resumed"] == pure["losses"][3:], (pure["resumed"], pure["losses"])


def test_the_config_fills_deepspeeds_switches():
    ds = build(parse({"train": {"pure_bf16": True}, "scaling": {"num_workers": 1}}), hidden_size=64, world_size=1)
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    plain = build(parse({"scaling": {"num_workers": 1}}), hidden_size=64, world_size=1)
    assert "bf16_master_weights_and_grads" not in plain["bf16"]


@pytest.mark.parametrize(
    "values, says",
    [
        ({"train": {"pure_bf16": True, "precision": "fp16"}}, "train.precision is fp16"),
        ({"train": {"pure_bf16": True}, "deepspeed": {"zero_optimization": {"stage": 0}}}, "ZeRO stage 1, 2 or 3"),
    ],
)
def test_what_deepspeed_cannot_do_is_refused_with_the_fix(values, says):
    (problem,) = check(parse(values))
    assert problem.field == "train.pure_bf16" and says in str(problem) and "pure_bf16: false" in str(problem)


@pytest.mark.slow
def test_a_pure_bf16_run_resumes_exactly_and_exports(tmp_path, tiny_model):
    """The CLI on real Ray (2 CPU workers, ZeRO-2): stopped at step 3, resumed by a new driver at the exact loss, and
    its final/ loads as a bf16 Hugging Face model."""
    from transformers import AutoModelForCausalLM

    values = {"train.pure_bf16": True, "deepspeed.zero_optimization.stage": 2, "train.max_steps_per_epoch": 6}
    values["train.log_every_steps"] = 1

    def train(name: str, **extra) -> str:
        result = run_cli("train", *tiny_overrides(tmp_path, name, tiny_model, **values, **extra))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        return result.stdout + result.stderr

    train("full")
    train("resumed", **{"train.stop_after_steps": 3})
    resumed = train("resumed", **{"checkpoint.export_final": True})
    assert "at global step 3 (epoch 0, step 3 of the epoch)" in resumed, resumed[-3000:]
    full, part = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(part) == list(range(1, 7)) and full[6] < full[1], (full, part)
    assert max(abs(full[s] - part[s]) for s in range(4, 7)) <= 1e-5, (full, part)
    ds = json.loads((tmp_path / "resumed" / "ds_config.json").read_text())
    assert ds["bf16"]["bf16_master_weights_and_grads"] and ds["bf16"]["bf16_optimizer_states"]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "final").dtype == torch.bfloat16
