"""train.pure_bf16: the config refuses it without bf16 precision and fills DeepSpeed's own two switches (ZeRO 1-3) or
turns DeepSpeed's mixed precision off (stage 0, where the app's clipping AdamW updates the bf16 model), and a real
engine (CPU, one process; ZeRO-0, ZeRO-2, ZeRO-3, and ZeRO-3 with the optimizer offloaded) then holds its weights
and AdamW moments in bf16, learns, resumes from its checkpoint at the exact loss, and exports; without the option
the same engine keeps them in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import losses, run_cli, run_engine_script, tiny_overrides

from app.config import parse
from app.ds_config import build, check

ENGINE = r"""
import os, sys, json, torch, torch.distributed as dist
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from app.config import parse
from app.ds_config import build
from app.train_loop import build_engine
dist.init_process_group("gloo")
deepspeed.init_distributed(dist_backend="gloo")
ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
out = {}

def engine(stage, pure, offload=False):
    torch.manual_seed(0)
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    cfg = parse({"model": {"name_or_path": sys.argv[1]}, "scaling": {"num_workers": 1},
                 "train": {"learning_rate": 1e-2, "pure_bf16": pure}, "deepspeed": {"zero_optimization": zero}})
    return build_engine(cfg, build(cfg, hidden_size=64, world_size=1), 10, False, {})[1]

def steps(e, n):
    losses = []
    for _ in range(n):
        loss = e(input_ids=ids, labels=ids).loss
        e.backward(loss); e.step(); losses.append(loss.item())
    return losses

def dtypes(e):
    opt = e.optimizer
    master = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat", None)
    master = master or [p for g in opt.param_groups for p in g["params"]]  # stage 0: the optimizer updates the model
    state = getattr(opt, "optimizer", opt).state
    moments = {str(v.dtype) for s in state.values() for k, v in s.items() if k.startswith("exp_avg")}
    norm = e.get_global_grad_norm()
    return {"master": sorted({str(t.dtype) for t in master}), "moments": sorted(moments),
            "grad_norm": None if norm is None else float(norm)}

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
        with torch.no_grad():  # what the checkpoint's export must reproduce
            torch.save(e3.module(input_ids=ids).logits.float(), os.path.join(sys.argv[3], key, "logits.pt"))
        out[key]["resumed"] = steps(e3, 2)
print("RESULT " + json.dumps(out))
"""


# (stage, optimizer offloaded, pure, resumed too): a pure and a mixed engine for each layout of the optimizer (ZeRO-3
# builds its partitions as ZeRO-2 does: its mixed twin adds nothing but time), the resume on both stages; the
# offloaded pair (DeepSpeed's CPU Adam, about 25 s more) in make test-all.
# Stage 0: DeepSpeed's mixed precision off, the bf16 model updated by the app's clipping AdamW (ds_config.plain_bf16).
GPU_SIDE = [(2, False, True, True), (2, False, False, False), (3, False, True, True), (0, False, True, True)]
OFFLOADED = [(3, True, True, False), (3, True, False, False)]


def run_engines(model: Path, folder: Path, plan: list[tuple]) -> dict:
    return run_engine_script(ENGINE, model, folder, plan)


@pytest.fixture(scope="module")
def engine_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def engines(tiny_model, engine_folder):
    return run_engines(tiny_model, engine_folder, GPU_SIDE)


def assert_bf16_only_when_asked(pure: dict, mixed: dict) -> None:
    assert pure["master"] == ["torch.bfloat16"] and pure["moments"] == ["torch.bfloat16"], pure
    assert mixed["master"] == ["torch.float32"] and mixed["moments"] == ["torch.float32"], mixed
    assert pure["losses"][-1] < 0.9 * pure["losses"][0], pure["losses"]
    assert abs(pure["losses"][-1] - mixed["losses"][-1]) < 0.1 * mixed["losses"][-1], (pure, mixed)


def test_master_weights_and_moments_are_bf16_only_when_asked(engines):
    assert_bf16_only_when_asked(engines["z2-pure"], engines["z2-mixed"])
    assert engines["z3-pure"]["master"] == engines["z3-pure"]["moments"] == ["torch.bfloat16"]


def test_stage_0_trains_the_bf16_model_itself_and_reports_the_norm(engines):
    plain, mixed = engines["z0-pure"], engines["z2-mixed"]
    assert plain["master"] == plain["moments"] == ["torch.bfloat16"], plain
    assert plain["losses"][-1] < 0.9 * plain["losses"][0], plain["losses"]
    assert abs(plain["losses"][-1] - mixed["losses"][-1]) < 0.1 * mixed["losses"][-1], (plain, mixed)
    assert plain["grad_norm"] > 0 and abs(plain["grad_norm"] - mixed["grad_norm"]) < 0.5 * mixed["grad_norm"]


def test_a_stage_0_checkpoint_exports_the_weights_it_holds(engines, engine_folder, tiny_model, tmp_path):
    """Stage 0 saves no ZeRO partitions: the export reads the module the engine saved."""
    from transformers import AutoModelForCausalLM

    from app.checkpoint import export

    saved = engine_folder / "z0-pure"
    out = export(saved, tmp_path / "hf", "bf16", model_source=tiny_model)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    assert torch.allclose(logits, torch.load(saved / "logits.pt"), atol=1e-3), "the export is not the saved model"


def test_the_clipping_adamw_clips_to_the_global_norm():
    from app.model import ClippingAdamW

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad, params[1].grad = torch.full((3,), 3.0), torch.full((4,), 4.0)  # global norm sqrt(27 + 64)
    opt = ClippingAdamW([{"params": params}], max_norm=1.0, lr=0.0)
    opt.step()
    assert abs(float(opt._global_grad_norm) - 91**0.5) < 1e-4
    clipped = torch.cat([p.grad for p in params]).norm()
    assert abs(float(clipped) - 1.0) < 1e-4, clipped
    measuring = ClippingAdamW([{"params": params}], max_norm=0.0, lr=0.0)
    measuring.step()  # max_norm 0: measures, leaves the gradients as they are
    assert abs(float(measuring._global_grad_norm) - 1.0) < 1e-4
    assert torch.equal(torch.cat([p.grad for p in params]).norm(), clipped)
    # A non-finite gradient: the norm says so, and the update is skipped (weights, moments, step count).
    before = [p.detach().clone() for p in params]
    params[1].grad[0] = float("inf")
    opt.param_groups[0]["lr"] = 0.1  # an update would move the weights
    opt.step()
    assert not torch.isfinite(opt._global_grad_norm)
    assert all(torch.equal(p, b) for p, b in zip(params, before)), "a non-finite step changed the weights"
    assert all(float(opt.state[p]["step"]) == 1 for p in params), [opt.state[p]["step"] for p in params]


@pytest.mark.slow
def test_an_offloaded_optimizer_keeps_bf16_moments_only_when_asked(tiny_model, tmp_path):
    found = run_engines(tiny_model, tmp_path, OFFLOADED)
    assert_bf16_only_when_asked(found["z3-offload-pure"], found["z3-offload-mixed"])


@pytest.mark.parametrize("stage", ["z2", "z3", "z0"])
def test_pure_bf16_resumes_at_the_exact_loss(engines, stage):
    pure = engines[f"{stage}-pure"]
    assert pure["resumed"] == pure["losses"][3:], (pure["resumed"], pure["losses"])


def test_the_config_fills_deepspeeds_switches():
    ds = build(parse({"train": {"pure_bf16": True}, "scaling": {"num_workers": 1}}), hidden_size=64, world_size=1)
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    mixed = build(parse({"scaling": {"num_workers": 1}}), hidden_size=64, world_size=1)
    assert "bf16_master_weights_and_grads" not in mixed["bf16"] and mixed["gradient_clipping"] == 1.0
    # Stage 0: no DeepSpeed mixed precision and no clipping by DeepSpeed (the app's AdamW clips).
    values = {"train": {"pure_bf16": True}, "deepspeed": {"zero_optimization": {"stage": 0}}}
    plain = build(parse({**values, "scaling": {"num_workers": 1}}), hidden_size=64, world_size=1)
    assert plain["bf16"]["enabled"] is False and plain["gradient_clipping"] == 0.0, plain


@pytest.mark.parametrize(
    "values, says",
    [
        ({"train": {"pure_bf16": True, "precision": "fp16"}}, "train.precision is fp16"),
    ],
)
def test_what_deepspeed_cannot_do_is_refused_with_the_fix(values, says):
    (problem,) = check(parse(values))
    assert problem.field == "train.pure_bf16" and says in str(problem) and "pure_bf16: false" in str(problem)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 0])
def test_a_pure_bf16_run_resumes_exactly_and_exports(tmp_path, tiny_model, stage):
    """The CLI on real Ray (2 CPU workers, ZeRO-2, or stage 0 with its gradients averaged by DeepSpeed's engine):
    stopped at step 3, resumed by a new driver at the exact loss, and its final/ loads as a bf16 Hugging Face
    model."""
    from transformers import AutoModelForCausalLM

    values = {"train.pure_bf16": True, "deepspeed.zero_optimization.stage": stage, "train.max_steps_per_epoch": 6}
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
    if stage:
        assert ds["bf16"]["bf16_master_weights_and_grads"] and ds["bf16"]["bf16_optimizer_states"]
    else:
        assert ds["bf16"]["enabled"] is False and ds["gradient_clipping"] == 0.0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "final").dtype == torch.bfloat16
