"""model.fp8: the decoder layers' linear layers run FP8 matmuls (torchao; emulated on CPUs) and train as bf16 does."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from app.config import ModelConfig, Problem, load
from app.model import load_model


def tiny_llama(tmp_path, fp8: bool, seed: int = 0):
    LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ).save_pretrained(tmp_path)
    torch.manual_seed(seed)
    return load_model(ModelConfig(name_or_path=f"random-init:{tmp_path}", fp8=fp8), {}).to(torch.bfloat16)


def losses(model, steps: int) -> list[float]:
    """Plain AdamW on a fixed set of batches: the loss curve of the model's own matmuls."""
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(1, 96, (4, 48), generator=gen) for _ in range(4)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    out = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_fp8_converts_the_decoder_linears_only(tmp_path):
    from torchao.float8.float8_linear import Float8Linear

    model = tiny_llama(tmp_path, fp8=True)
    converted = sorted(name for name, m in model.named_modules() if isinstance(m, Float8Linear))
    per_layer = [
        "mlp.down_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "self_attn.k_proj",
        "self_attn.o_proj",
        "self_attn.q_proj",
        "self_attn.v_proj",
    ]
    assert converted == [f"model.layers.{i}.{p}" for i in range(2) for p in per_layer]
    assert type(model.lm_head) is torch.nn.Linear  # the head stays bf16 (Liger's fused loss reads its weight)
    # Same parameters, same names: checkpoints, resume and export see the model they would see without FP8.
    assert sorted(model.state_dict()) == sorted(tiny_llama(tmp_path, fp8=False).state_dict())


def test_fp8_trains_like_bf16(tmp_path):
    fp8, bf16 = losses(tiny_llama(tmp_path, fp8=True), 30), losses(tiny_llama(tmp_path, fp8=False), 30)
    assert fp8[-1] < 0.7 * fp8[0]  # it learns
    for step, (a, b) in enumerate(zip(fp8, bf16)):  # step for step, closer early (the curves drift apart slowly)
        assert abs(a - b) <= (0.01 if step < 10 else 0.06) * b, (step, a, b)
    late = slice(-8, None)
    assert abs(sum(fp8[late]) - sum(bf16[late])) <= 0.02 * sum(bf16[late])
    assert fp8 != bf16  # not vacuous: the matmuls did run in FP8


def _loss_and_grads(model, ids):
    model(input_ids=ids, labels=ids).loss.backward()
    return model(input_ids=ids, labels=ids).loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def liger_swiglu(mlp, x):
    """What Liger's SwiGLU MLP computes on GPUs (silu(gate) * up in fp32, rounded once), through the modules."""
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    return mlp.down_proj((torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype))


def test_fused_mlps_compute_what_their_layers_compute(tmp_path, monkeypatch):
    """Each MLP of FP8 projections runs as one function (one host call, the input's cast shared): the same loss and
    gradients, to the bit, as its three FP8 layers and Liger's activation one by one (eager on the CPU)."""
    ids = torch.randint(1, 96, (2, 32), generator=torch.Generator().manual_seed(2))
    fused = tiny_llama(tmp_path, fp8=True)
    assert all("forward" in vars(layer.mlp) for layer in fused.model.layers)
    monkeypatch.setattr("app.model.fuse_fp8_mlps", lambda model, compiled: 0)  # the projections one by one
    separate = tiny_llama(tmp_path, fp8=True)
    assert not any("forward" in vars(layer.mlp) for layer in separate.model.layers)
    for layer in separate.model.layers:
        layer.mlp.forward = functools.partial(liger_swiglu, layer.mlp)
    (loss_a, grads_a), (loss_b, grads_b) = _loss_and_grads(fused, ids), _loss_and_grads(separate, ids)
    assert torch.equal(loss_a, loss_b)
    for name, grad in grads_b.items():
        assert torch.equal(grads_a[name], grad), name


def test_a_fused_mlp_whose_projections_lora_wraps_runs_its_own_forward(tmp_path):
    """LoRA wraps the projections after the MLPs were fused: the adapters must be in the computation (the fused
    function would read the base weights alone), so the MLP runs its own forward, and the adapters get gradients."""
    from app import lora
    from app.config import LoraConfig

    model = lora.wrap(tiny_llama(tmp_path, fp8=True), LoraConfig(r=4, alpha=8, dropout=0.0), str(tmp_path))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # PEFT starts B at zero: the adapters' effect (and A's gradient) would be zero
    ids = torch.randint(1, 96, (2, 32), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    mlp_adapters = {n: p.grad for n, p in model.named_parameters() if "mlp" in n and "lora_A" in n}
    assert len(mlp_adapters) == 2 * 3 and all(g is not None and g.abs().sum() > 0 for g in mlp_adapters.values())


def test_fp8_refuses_a_model_with_nothing_to_convert(tiny_model):
    # GPT-2's projections are Conv1D, not Linear: FP8 would change nothing, so say so rather than run bf16.
    with pytest.raises(Problem, match="model.fp8.*Conv1D.*set model.fp8=false"):
        load_model(ModelConfig(name_or_path=str(tiny_model), fp8=True), {})


def test_fp8_check_before_the_cluster_passes_what_the_workers_convert(tmp_path, tiny_model):
    """The checks before a run look for layers to convert on the meta-device model: a Llama passes (the same layers as
    test_fp8_converts_the_decoder_linears_only), GPT-2 is refused (tests/test_config.py: exit 2, nothing written)."""
    from app.model import fp8_linears, fp8_model_problems, load_model_config, meta_model

    tiny_llama(tmp_path, fp8=False)  # writes its config
    sets = [f"experiment.storage_path={tmp_path}", "scaling.use_gpu=false", "model.fp8=true"]
    llama = load(None, [*sets, f"model.name_or_path={tmp_path}"])
    assert fp8_model_problems(llama, load_model_config(llama.model)) == []
    assert len(fp8_linears(meta_model(load_model_config(llama.model)))) == 2 * 7
    gpt2 = load(None, [*sets, f"model.name_or_path={tiny_model}"])
    assert [p.field for p in fp8_model_problems(gpt2, load_model_config(gpt2.model))] == ["model.fp8"]


@pytest.mark.slow  # torch.compile builds C++ kernels on the CPU: about 25 s on 2 cores
def test_compiled_casts_compute_what_eager_casts_compute(tmp_path):
    from app.model import _apply_fp8

    eager, compiled = tiny_llama(tmp_path, fp8=True), tiny_llama(tmp_path, fp8=False)
    _apply_fp8(compiled, compiled=True)
    ids = torch.randint(1, 96, (2, 32), generator=torch.Generator().manual_seed(2))
    for model in (eager, compiled):
        model(input_ids=ids, labels=ids).loss.backward()
    torch.testing.assert_close(compiled(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss)
    # Not to the bit: the compiled MLP's activation backward rounds differently from eager autograd's, and the
    # gradients' FP8 casts (3 bits of mantissa) turn a one-ulp difference into a step of the FP8 grid. A wrong
    # cast, scale or transposition would leave the gradients unrelated (cosine near 0), not this close.
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        a, b = a.grad.float().flatten(), b.grad.float().flatten()
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99, name
        assert abs(b.norm() / a.norm() - 1) < 0.02, name


def test_the_compiled_path_keeps_the_layers_biases(monkeypatch):
    """The app replaces Float8Linear.forward to compile only the cast-and-matmul; Qwen2's q/k/v projections have
    biases, which that forward must add as torchao's own does. torch.compile is left out (identity) to keep this
    fast: test_compiled_casts_compute_what_eager_casts_compute covers the compilation."""
    from app.model import convert_to_fp8

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=True), torch.nn.Linear(48, 16, bias=False))
    with torch.no_grad():
        eager[0].bias.uniform_(1.0, 2.0)  # large enough that a dropped bias shows
    replaced = copy.deepcopy(eager)
    convert_to_fp8(eager, list(eager), compiled=False)
    monkeypatch.setattr(torch, "compile", lambda fn=None, **_: fn or (lambda f: f))
    convert_to_fp8(replaced, list(replaced), compiled=True)
    assert all("forward" in vars(layer) for layer in replaced)  # the app's forward is the one running
    x = torch.randn(8, 32)
    torch.testing.assert_close(replaced(x), eager(x))


RECORDS = sorted((Path(__file__).parent.parent / "benchmarks" / "results").glob("*-fp8-shapes.json"))


@pytest.mark.parametrize("record", RECORDS, ids=lambda p: p.name[:10])
def test_the_fp8_rule_agrees_with_every_measured_shape(record):
    """app.model.fp8_pays against each of benchmarks/fp8_shapes.py's records (one H200): every projection the rule
    converts ran faster in FP8 on the GPU (its kernel time where the record has it, else the wall clock), and
    every projection it leaves bf16 was no faster in FP8 by the wall clock, at the tokens a micro-batch they were
    timed with."""
    from app.model import fp8_pays

    rows = json.loads(record.read_text())["rows"]
    assert {r["model"] for r in rows} == {"qwen2-0.5b", "llama-1.1b", "llama-8b"}
    for r in rows:
        layer = torch.nn.Linear(r["in"], r["out"], device="meta")
        if fp8_pays(layer, r["tokens"]):
            gain = r["bf16_gpu_ms"] / r["fp8_gpu_ms"] if "fp8_gpu_ms" in r else r["fp8_speedup"]
            assert gain > 1.0, r
        else:
            assert r["fp8_speedup"] <= 1.0, r


def test_there_are_two_records_of_the_shapes():
    assert len(RECORDS) >= 2 and any("fp8_gpu_ms" in r for r in json.loads(RECORDS[-1].read_text())["rows"])


@pytest.mark.parametrize(
    "shape, tokens, fp8",
    [
        ("qwen2-0.5b", 16 * 2048, set()),  # nothing gains: FP8 on is the bf16 model
        ("llama-1.1b", 8 * 2048, {"gate_proj", "up_proj", "down_proj"}),
        ("llama-1.1b", 16 * 2048, {"gate_proj", "up_proj", "down_proj"}),
        ("llama-8b", 4 * 2048, {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    ],
)
def test_fp8_converts_the_layers_that_gain_at_the_micro_batch(shape, tokens, fp8, caplog):
    """The choice on the real shapes (meta device: no memory), and the line the log gets."""
    from torchao.float8.float8_linear import Float8Linear

    from app.model import _apply_fp8, meta_model
    from benchmarks.assets import SHAPES

    model = meta_model(SHAPES[shape].hf_config())
    with caplog.at_level("INFO", logger="finetune"):
        _apply_fp8(model, compiled=False, tokens=tokens)
    converted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == fp8
    line = caplog.messages[-1]
    assert line.startswith(f"model.fp8: {len(fp8) * SHAPES[shape].layers} of {7 * SHAPES[shape].layers} linear")
    assert ("stay bf16" in line) == (len(fp8) < 7)
