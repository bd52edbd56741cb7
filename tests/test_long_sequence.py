"""model.long_sequence (issue #52, item 1): the memory model's choice of the tiled MLP, the tiled loss and offloaded
checkpoints on a grid of sequence lengths and GPUs, the refusals with their figures, `finetune validate`'s lines,
and the numerics of each switch on a tiny Llama in fp32 (the same loss and gradients with and without it)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_autoset import LLAMA_8B, chat_args, chosen, model_folder, validate

from app import resolve as rs
from app.config import parse
from app.errors import ConfigError, Problem

GIB = rs.GIB
H200, H100, HOST = rs.parse_memory("141GB"), rs.parse_memory("80GiB"), 128 * GIB


def resolved(seq: int, gpu: int, host: int | None = HOST, **ask) -> rs.Resolved:
    """The 8B's chat LoRA (r=16, every projection) on one GPU of `gpu` bytes, model.long_sequence auto unless
    `ask` sets a switch."""
    request = rs.Request(seq_length=seq, lora=rs.Lora(), learning_rate=2e-4, long=rs.LongAsk(**ask), host_memory=host)
    return rs.resolve(LLAMA_8B, 1, gpu, request)


# --- auto's choice ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq, gpu, switches, layers",
    [
        (4096, H200, False, 0),
        (32_768, H200, False, 0),  # the short case runs exactly as before: the 10% rule holds by auto
        (131_072, H200, False, 0),
        (262_144, H200, True, 0),
        (524_288, H200, True, 23),
        (4096, H100, False, 0),
        (32_768, H100, False, 0),
        (131_072, H100, True, 0),
        (262_144, H100, True, 22),
    ],
)
def test_auto_turns_the_switches_on_only_where_the_sequence_needs_them(seq, gpu, switches, layers):
    r = resolved(seq, gpu)
    assert r.fits and not r.problems, r.problems
    plan = r.plan
    assert (plan.tiled_mlp, plan.tiled_loss, plan.offload_layers) == (switches, switches, layers)
    assert r.memory.offloaded == layers * rs.host_block(seq * 2 * 4096)
    if layers:  # the fewest layers: one fewer would not fit the GPU
        fewer = rs.predict(rs.shape_from_config(LLAMA_8B), 1, r_request(seq), replace(plan, offload_layers=layers - 1))
        assert fewer.needed > gpu >= r.memory.needed
        assert r.host_needed == layers * seq * 8192 + rs.HOST_RESERVED <= HOST


def r_request(seq: int) -> rs.Request:
    return rs.Request(seq_length=seq, lora=rs.Lora(), learning_rate=2e-4, long=rs.LongAsk(), host_memory=HOST)


def test_512k_on_an_h200_offloads_92_gib_of_its_128_gib_of_checkpoints():
    """Issue #52's target: 524,288 tokens of the 8B's LoRA on one H200 within a 128 GiB host. 256 KiB a token of
    checkpoints is 128 GiB: 9 layers' stay on the GPU, 23 layers' (92 GiB) go to the host; the margin holds two 4 GiB
    blocks of one layer's input (the allocator's slack the GPU run showed)."""
    r = resolved(524_288, H200)
    assert r.memory.offloaded == 92 * GIB and r.host_needed == 108 * GIB
    assert r.memory.margin >= 8 * GIB
    assert r.memory.needed <= H200 and r.memory.logits < 8 * GIB  # the loss never holds [tokens, vocabulary] logits
    untiled = rs.predict(rs.shape_from_config(LLAMA_8B), 1, r_request(524_288), replace(r.plan, tiled_loss=False))
    assert untiled.logits > 3 * r.memory.logits


def test_tiling_bounds_the_mlp_and_the_loss_by_the_tile_not_the_sequence():
    shape, request = rs.shape_from_config(LLAMA_8B), r_request(524_288)
    plain = rs.Plan(0, True, True, 1)
    tiled = replace(plain, tiled_mlp=True, tiled_loss=True)
    untiled, both = rs.predict(shape, 1, request, plain), rs.predict(shape, 1, request, tiled)
    # The MLP's intermediates (gate, up: 14,336 x 2 bytes a token each) of one layer are a tile's, not 512k tokens'.
    assert untiled.activations - both.activations > 524_288 * 4 * 14336 * 0.9
    assert both.workspace < untiled.workspace
    assert both.logits == 10 * rs.LOSS_TILE_ELEMENTS + 2 * 524_288 * 4096


def test_an_explicit_switch_is_kept_and_said():
    r = resolved(32_768, H200, tiled_mlp=True, tiled_loss=False, offload=4)
    assert (r.plan.tiled_mlp, r.plan.tiled_loss, r.plan.offload_layers) == (True, False, 4)
    assert r.long_reasons["tiled_mlp"] == "set in the config"
    assert r.memory.offloaded == 4 * rs.host_block(32_768 * 8192)
    every = resolved(32_768, H200, offload=True)
    assert every.plan.offload_layers == 32


# --- refusals with the figures ------------------------------------------------------------------------------


def test_a_host_too_small_for_the_offload_is_refused_with_the_figures():
    r = resolved(524_288, H200, host=64 * GIB)
    assert not r.fits
    (problem,) = r.problems
    assert problem.field == "scaling.host_memory"
    assert "92.0 GiB of pinned host memory + 16.0 GiB" in problem.message and "has 64.0 GiB" in problem.message
    assert "hosts of at least 108.0 GiB" in problem.fix


def test_an_unknown_host_allows_no_offload():
    r = resolved(524_288, H200, host=None)
    assert not r.fits and r.problems[0].field == "scaling.host_memory"
    assert "set scaling.host_memory" in r.problems[0].fix


def test_what_no_offload_makes_fit_is_refused_with_the_gpu_figures():
    r = resolved(524_288, H100)  # all 32 layers offloaded, and one layer's recomputation still over 80 GiB
    assert not r.fits and r.plan.offload_layers == 32
    (problem,) = r.problems
    assert problem.field == "GPU memory (GiB)" and "checkpoints offloaded to host memory 128.0" in problem.message
    assert "a shorter data.seq_length (262144 fits)" in problem.fix


def test_switches_set_off_where_only_they_would_fit_name_auto_as_the_fix():
    r = resolved(524_288, H200, tiled_mlp=False, tiled_loss=False, offload=False)
    assert not r.fits and r.problems[0].field == "GPU memory (GiB)"
    assert "leave model.long_sequence to auto" in r.problems[0].fix


def test_offload_without_checkpointing_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="offload_checkpoints"):
        parse({"model": {"gradient_checkpointing": False, "long_sequence": {"offload_checkpoints": 8}}})
    cfg = parse({"model": {"long_sequence": {"offload_checkpoints": 8, "tiled_mlp": True}}})
    assert rs.long_ask(cfg.model.long_sequence) == rs.LongAsk(True, None, 8)
    assert rs.long_ask(parse({}).model.long_sequence) == rs.LongAsk()


# --- finetune validate ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory, tiny_model):
    # The 8B's shape with a context of 2^20 positions (the benchmark's weights: RoPE extends to it untrained).
    return model_folder(tmp_path_factory.mktemp("long"), {**LLAMA_8B, "max_position_embeddings": 1 << 20}, tiny_model)


def long_args(tmp_path, model, seq: int, *sets: str) -> list[str]:
    return chat_args(tmp_path, model, f"data.seq_length={seq}", "scaling.host_memory=128GiB", *sets)


def test_validate_prints_each_switch_and_why(capsys, tmp_path, llama8b):
    code, cfg, _, lines, err = validate(
        capsys, *long_args(tmp_path, llama8b, 524_288), "--gpus", "1", "--gpu-memory", "141GB"
    )
    assert code == 0, err
    assert chosen(lines, "tiled MLP") == "on (auto)" and chosen(lines, "tiled loss") == "on (auto)"
    assert chosen(lines, "offloaded checkpoints") == "23 layers (auto)"
    offload = next(line for line in lines if line.strip().startswith("offloaded checkpoints"))
    assert "the fewest that fit: 22 would need" in offload and "host memory 108.0 GiB of 128.0 GiB" in offload
    # The printed config is the one the workers read: the switches concrete.
    assert cfg["model"]["long_sequence"] == {"tiled_mlp": True, "tiled_loss": True, "offload_checkpoints": 23}

    code, cfg, _, lines, err = validate(
        capsys, *long_args(tmp_path, llama8b, 32_768), "--gpus", "1", "--gpu-memory", "141GB"
    )
    assert code == 0, err
    for name in ("tiled MLP", "tiled loss", "offloaded checkpoints"):
        assert chosen(lines, name) == "off (auto)", lines
    assert "tiling would only add work" in next(line for line in lines if "tiled MLP" in line)
    assert cfg["model"]["long_sequence"] == {"tiled_mlp": False, "tiled_loss": False, "offload_checkpoints": 0}


def test_validate_refuses_a_host_that_cannot_hold_the_offload(capsys, tmp_path, llama8b):
    args = long_args(tmp_path, llama8b, 524_288, "scaling.host_memory=64GiB")
    code, *_, err = validate(capsys, *args, "--gpus", "1", "--gpu-memory", "141GB")
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and "scaling.host_memory" in line and "92.0 GiB of pinned host memory" in line, err


def test_cpu_workers_turn_auto_off_and_keep_explicit_switches(tmp_path, tiny_model):
    from app import autoset

    cfg = parse({"model": {"name_or_path": str(tiny_model)}, "scaling": {"use_gpu": False}})
    assert autoset.settle(cfg).config.model.long_sequence.model_dump() == {
        "tiled_mlp": False,
        "tiled_loss": False,
        "offload_checkpoints": 0,
    }
    asked = {"tiled_mlp": True, "tiled_loss": "auto", "offload_checkpoints": 2}
    cfg = parse(
        {
            "model": {"name_or_path": str(tiny_model), "long_sequence": asked, "gradient_checkpointing": True},
            "scaling": {"use_gpu": False},
        }
    )
    assert autoset.settle(cfg).config.model.long_sequence.model_dump() == {
        "tiled_mlp": True,
        "tiled_loss": False,
        "offload_checkpoints": 2,
    }


# --- numerics: each switch computes what it replaces (a tiny Llama, fp32, CPU) --------------------------------


def tiny_llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).float().train()


def loss_and_grads(model, batch: dict) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def a_batch(tokens: int = 40, seed: int = 1) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, tokens), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100  # a prompt left out of the loss
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize(
    "switches",
    [
        {"tiled_mlp": True},
        {"tiled_loss": True},
        {"offload_checkpoints": 2},
        {"tiled_mlp": True, "tiled_loss": True, "offload_checkpoints": True},
    ],
)
def test_each_switch_gives_the_same_loss_and_gradients(switches, monkeypatch):
    from app import long_sequence
    from app.config import LongSequenceConfig

    # Tiles small enough that a 2 x 40-token batch takes several (the real ones hold 8,192 tokens, 2^28 logits).
    monkeypatch.setattr(long_sequence, "MLP_TILE_TOKENS", 16)
    monkeypatch.setattr(long_sequence, "LOSS_TILE_ELEMENTS", 97 * 7)
    plain = tiny_llama()
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = loss_and_grads(plain, a_batch())
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    said = long_sequence.apply(model, LongSequenceConfig(**switches), checkpointing=True)
    assert len(said) == len(switches)
    loss, grads = loss_and_grads(model, a_batch())
    assert loss == pytest.approx(reference[0], abs=1e-6)
    assert grads.keys() == reference[1].keys()
    for name, grad in grads.items():
        assert (grad - reference[1][name]).abs().max().item() < 1e-6, name
    # A second step reuses the host buffers and gives the same again.
    assert loss_and_grads(model, a_batch())[0] == pytest.approx(loss, abs=1e-7)


def test_the_tiled_mlp_matches_the_mlp_alone_in_fp32():
    import torch

    from app import long_sequence

    model = tiny_llama()
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 50, 32, requires_grad=True)
    out = mlp(x)
    out.backward(torch.ones_like(out))
    want = (out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in mlp.named_parameters()})
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    long_sequence.tile_mlp(mlp, tile=16)  # 100 tokens: tiles of 16, the last of 4
    out = mlp(x)
    out.backward(torch.ones_like(out))
    assert (out.detach() - want[0]).abs().max() < 1e-6 and (x.grad - want[1]).abs().max() < 1e-6
    for name, param in mlp.named_parameters():
        assert (param.grad - want[2][name]).abs().max() < 1e-6, name


def test_a_recomputed_tile_draws_the_forwards_dropout_masks():
    """With dropout the tiled MLP's backward must recompute the masks its forward drew, or the gradient is that of
    another function: it equals autograd's over the same tiles, the random state the same."""
    import torch

    from app import long_sequence

    class Dropped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(8, 16)

        def forward(self, x):
            return torch.nn.functional.dropout(self.up(x), 0.5, training=True).sum(-1, keepdim=True).expand(-1, 8)

    torch.manual_seed(3)
    module, x = Dropped(), torch.randn(40, 8)
    torch.manual_seed(7)
    reference = torch.cat([module.forward(part) for part in x.split(16)])
    reference.sum().backward()
    want = module.up.weight.grad.clone()
    module.zero_grad(set_to_none=True)
    long_sequence.tile_mlp(module, tile=16)
    torch.manual_seed(7)
    out = module(x.requires_grad_(True))
    out.sum().backward()
    assert torch.equal(out.detach(), reference.detach())
    # Summed over tiles in another order: equal to float32's rounding (the gradients here are in the hundreds).
    assert torch.allclose(module.up.weight.grad, want, rtol=1e-6, atol=1e-6)


def test_the_tiled_loss_never_builds_the_logits_and_counts_targets_like_transformers():
    import torch

    from app import long_sequence

    hidden = torch.randn(3, 30, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 30))
    labels[0, :10] = -100
    logits = hidden @ weight.T
    want = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    got = long_sequence.tiled_cross_entropy(hidden, weight, labels)
    assert abs(got.item() - want.item()) < 1e-6
    (2 * got).backward()
    h, w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (2 * want).backward()
    assert (h - hidden.grad).abs().max() < 1e-6 and (w - weight.grad).abs().max() < 1e-6
    with torch.no_grad():  # an evaluation: the same loss, no gradient computed
        assert abs(long_sequence.tiled_cross_entropy(hidden, weight, labels).item() - want.item()) < 1e-6
    summed = long_sequence.tiled_cross_entropy(hidden, weight, labels, num_items_in_batch=100)
    assert abs(summed.item() * 100 - want.item() * (labels[:, 1:] != -100).sum().item()) < 1e-3
    # A sequence-parallel shard passes its labels shifted already (shift_labels): not shifted again.
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    by_shift = long_sequence.tiled_cross_entropy(hidden, weight, None, shift_labels=shifted)
    assert abs(by_shift.item() - want.item()) < 1e-6


def test_offload_needs_checkpointing_on_the_workers_too():
    from app import long_sequence
    from app.config import LongSequenceConfig

    with pytest.raises(Problem, match="activation checkpointing is off"):
        long_sequence.apply(tiny_llama(), LongSequenceConfig(offload_checkpoints=1), checkpointing=False)


# --- the benchmark suite ----------------------------------------------------------------------------------------


def test_the_long_suite_builds_each_case_and_auto_chooses_as_predicted(tmp_path, monkeypatch):
    """benchmarks' `long` suite: every case a valid config, the app's long_sequence what the memory model says for
    one H200 (143,771 MiB) and a 128 GiB host (the device machine's; its memory taken as this machine's otherwise)."""
    from test_bench import _configs

    from app import autoset
    from benchmarks import bench

    monkeypatch.setattr(autoset, "host_memory", lambda cfg: (HOST, "test"))
    knobs = {case.name: k for case, k in _configs(tmp_path, bench.SUITES["long"], gpu_memory=143_771 * 2**20)}
    assert not [k for k in knobs.values() if isinstance(k, Exception)], knobs
    assert {k["seq"] for k in knobs.values()} == {32_768, 131_072, 262_144, 327_680, 524_288}
    for name, k in knobs.items():
        assert (k["micro_batch"], k["stage"], k["act_ckpt"], k["pure_bf16"], k["packing"]) == (1, 0, True, True, True)
        assert k["format"] == "chat" and (k["lora"] is None if "-full" in name else k["lora"]["r"] == 16), name
    off, on = knobs["long-l8b-32k-off"]["long_sequence"], knobs["long-l8b-32k-on"]["long_sequence"]
    assert off == {"tiled_mlp": False, "tiled_loss": False, "offload_checkpoints": False}
    assert on == {"tiled_mlp": True, "tiled_loss": True, "offload_checkpoints": True}
    assert knobs["long-l8b-512k"]["long_sequence"] == {"tiled_mlp": True, "tiled_loss": True, "offload_checkpoints": 21}
    assert knobs["long-l8b-128k"]["long_sequence"]["offload_checkpoints"] == 0
    # Full-parameter (weights and bf16 AdamW states on the GPU): the tiles at 256k, and at 512k more layers offloaded
    # than LoRA's, within the host.
    full256, full512 = knobs["long-l8b-256k-full"]["long_sequence"], knobs["long-l8b-512k-full"]["long_sequence"]
    assert full256["tiled_mlp"] and full256["tiled_loss"] and full512["tiled_mlp"] and full512["tiled_loss"]
    assert 0 < full256["offload_checkpoints"] < full512["offload_checkpoints"] <= 32
    lora512 = knobs["long-l8b-512k"]["long_sequence"]
    assert full512["offload_checkpoints"] > lora512["offload_checkpoints"], (full256, full512)
    assert {name for name, k in knobs.items() if "trl" in k["command"]} == {"trl-long-l8b-128k", "trl-long-l8b-256k"}
    # The H100's case: the longest the memory model allows on 80 GiB with this host, some layers kept on the GPU.
    (h100,) = [k for _, k in _configs(tmp_path, [c for c in bench.LONG if c.name == "long-l8b-320k"], gpu_memory=H100)]
    assert h100["long_sequence"]["tiled_mlp"] and 20 < h100["long_sequence"]["offload_checkpoints"] < 32, h100
