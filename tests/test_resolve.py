"""app.resolve: the memory model against every GPU peak the repository records, the choices on a grid of models, GPU
counts and memories, and the rules around them (an explicit value wins, what does not fit is refused with its
figures and a fix). CPU only; no hub: the shapes are transformers configs built here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from transformers import GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

from app import resolve as rs
from app.errors import Problem
from app.resolve import GIB, Lora, Plan, Request

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "resolve-table.md"

# The shapes the benchmark harness runs (benchmarks/assets.py: SHAPES), Qwen3-1.7B (issue #50) and Llama-3-70B.
SHAPES = {
    "gpt2": GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
    "qwen2-0.5b": Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "llama-1.1b": LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "qwen3-1.7b": Qwen3Config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "llama-8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "llama-70b": LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
}
# Published parameter counts (model cards / the hub's safetensors totals).
PARAMS = {
    "gpt2": 124_439_808,
    "qwen2-0.5b": 494_032_768,
    "llama-1.1b": 1_100_048_384,
    "llama-8b": 8_030_261_248,
    "llama-70b": 70_553_706_496,
}
H200 = 143_771 * 2**20  # what nvidia-smi reports for one H200 of the benchmark machines
LORA = Lora(r=16, target_modules="auto", dropout=0.05)  # the benchmarks' LoRA: every projection


@dataclass(frozen=True)
class Case:
    """One measured GPU peak of the app (rank 0's max_memory_allocated, GiB): the largest of the records of that
    config. `source`: the record, benchmarks/results/<source>.jsonl unless said."""

    name: str
    source: str
    shape: str
    gpus: int
    stage: int
    precision: str  # "pure" (pure bf16) or "mixed" (fp32 master weights)
    micro_batch: int
    seq: int
    measured: float
    ckpt: bool = False
    liger: bool = True
    lora: Lora | None = None
    extra: dict = field(default_factory=dict)  # more Request fields

    def predicted(self) -> rs.Memory:
        request = Request(
            seq_length=self.seq, micro_batch_size=self.micro_batch, lora=self.lora, liger=self.liger, **self.extra
        )
        plan = Plan(self.stage, self.precision == "pure", self.ckpt, self.micro_batch)
        return rs.predict(rs.shape_from_config(SHAPES[self.shape]), self.gpus, request, plan)


OFFLOAD = {"offload_optimizer": True, "gradient_accumulation_steps": 8}
OLD = {"reduce_bucket_elements": 500_000_000}  # DeepSpeed's default bucket, which the oldest baseline ran with
README = "shared/README 2026-12-05"
BASELINE = "shared/README baseline"
# Left out: model.fp8 cases (not modelled; each ran below its bf16 twin, which the prediction covers) and the seed
# tutorial's 2.7 GiB in shared/README's baseline (older code whose config no record keeps; the same case on current
# code is the first row, 1.84 GiB).
CASES = [
    Case(
        "GPT-2, the tutorial's padded text", "2026-11-30-l-start-ab", "gpt2", 2, 3, "mixed", 1, 512, 1.84, liger=False
    ),
    Case("GPT-2 packed", "2026-11-30-a-explore", "gpt2", 2, 2, "mixed", 16, 1024, 18.43, liger=False),
    Case("GPT-2 packed, one GPU", "2026-12-04-features", "gpt2", 1, 2, "mixed", 16, 1024, 19.12, liger=False),
    Case("Llama 1.1B", "2026-12-04-warm2", "llama-1.1b", 1, 3, "mixed", 16, 2048, 57.54),
    Case("Llama 1.1B", "2026-12-02-start3", "llama-1.1b", 1, 2, "mixed", 16, 2048, 56.94),
    Case("Llama 1.1B", "2026-11-30-o-deepcompile", "llama-1.1b", 2, 3, "mixed", 16, 2048, 51.28),
    Case("Llama 1.1B", "2026-11-30-b-gpu", "llama-1.1b", 2, 3, "mixed", 32, 2048, 91.21),
    Case("Llama 1.1B", "2026-11-30-a-explore", "llama-1.1b", 2, 2, "mixed", 16, 2048, 48.85),
    Case("Llama 1.1B, no Liger", "2026-11-30-a-explore", "llama-1.1b", 2, 2, "mixed", 8, 2048, 43.63, liger=False),
    Case("Llama-3-8B", "2026-11-30-q-fp8", "llama-8b", 2, 3, "mixed", 4, 2048, 100.97),
    Case(
        "Llama-3-8B, 8 accumulation",
        "2026-11-30-d-final",
        "llama-8b",
        1,
        3,
        "mixed",
        4,
        2048,
        21.03,
        ckpt=True,
        extra=OFFLOAD,
    ),
    Case("Llama 1.1B chat", "2026-12-04-losschunk", "llama-1.1b", 1, 0, "pure", 8, 2048, 26.75),
    Case("Llama 1.1B chat", "2026-12-01-chat-pure", "llama-1.1b", 1, 2, "pure", 8, 2048, 30.57),
    Case("Llama 1.1B chat", "2026-12-01-chat-pure", "llama-1.1b", 1, 2, "mixed", 8, 2048, 36.71),
    Case("Llama 1.1B chat", "2026-12-01-chat", "llama-1.1b", 1, 3, "mixed", 8, 2048, 37.18),
    Case("Llama 1.1B chat LoRA", "2026-12-01-plain", "llama-1.1b", 1, 0, "pure", 8, 2048, 34.18, lora=LORA),
    Case("Llama 1.1B chat LoRA", "2026-12-01-chat-pure", "llama-1.1b", 1, 2, "mixed", 8, 2048, 34.28, lora=LORA),
    Case("Llama 1.1B chat LoRA", "2026-12-01-chat-pure", "llama-1.1b", 1, 2, "pure", 8, 2048, 34.21, lora=LORA),
    Case("Llama 1.1B chat LoRA", "2026-12-01-chat", "llama-1.1b", 1, 3, "mixed", 8, 2048, 53.57, lora=LORA),
    Case("Llama-3-8B chat", "2026-12-04-chunk8b", "llama-8b", 1, 0, "pure", 4, 2048, 60.09, ckpt=True),
    Case("Llama-3-8B chat LoRA", "2026-12-01-plain2", "llama-8b", 1, 0, "pure", 4, 2048, 67.32, lora=LORA),
    Case("Llama-3-8B chat LoRA", "2026-12-01-chat", "llama-8b", 1, 3, "mixed", 4, 2048, 100.08, lora=LORA),
    Case("Qwen2-0.5B chat", "2026-12-04-losschunk", "qwen2-0.5b", 1, 0, "pure", 8, 2048, 18.30),
    Case("Qwen2-0.5B", "2026-12-02-start3", "qwen2-0.5b", 1, 3, "mixed", 16, 2048, 37.85),
    Case("Qwen3-1.7B chat", "issue #50", "qwen3-1.7b", 1, 3, "mixed", 8, 2048, 57.9),
    Case("Qwen3-1.7B chat", "issue #50", "qwen3-1.7b", 1, 0, "pure", 8, 2048, 41.4),
    Case("Qwen3-1.7B chat LoRA", "issue #50", "qwen3-1.7b", 1, 3, "mixed", 8, 2048, 75.2, lora=LORA),
    Case("Qwen3-1.7B chat LoRA", "issue #50", "qwen3-1.7b", 1, 0, "pure", 8, 2048, 49.5, lora=LORA),
    Case("Llama-3-8B chat LoRA, 64k tokens", README, "llama-8b", 1, 0, "pure", 1, 65536, 47.4, ckpt=True, lora=LORA),
    Case("Llama-3-8B chat LoRA, 128k tokens", README, "llama-8b", 1, 0, "pure", 1, 131072, 79.6, ckpt=True, lora=LORA),
    Case("GPT-2 packed (older)", BASELINE, "gpt2", 2, 3, "mixed", 8, 1024, 10.9, liger=False, extra=OLD),
    Case("Llama 1.1B, no Liger (older)", BASELINE, "llama-1.1b", 2, 3, "mixed", 4, 2048, 28.8, liger=False, extra=OLD),
    Case("Llama 1.1B, no Liger (older)", BASELINE, "llama-1.1b", 2, 2, "mixed", 4, 2048, 26.0, liger=False, extra=OLD),
    Case("Llama 1.1B, no Liger (older)", BASELINE, "llama-1.1b", 2, 3, "mixed", 8, 2048, 46.4, liger=False, extra=OLD),
    Case("Llama 1.1B (older)", BASELINE, "llama-1.1b", 2, 3, "mixed", 8, 2048, 31.5, extra=OLD),
    Case("Llama-3-8B (older)", BASELINE, "llama-8b", 2, 3, "mixed", 2, 2048, 72.3, ckpt=True, extra=OLD),
]
MOST_ABOVE = 1.35


@pytest.mark.parametrize("case", CASES, ids=[f"{c.name}-{c.gpus}gpu-z{c.stage}-{c.micro_batch}x{c.seq}" for c in CASES])
def test_the_prediction_is_at_or_above_each_measured_peak_and_not_far_above(case):
    peak = case.predicted().peak / GIB
    assert 1.0 <= peak / case.measured <= MOST_ABOVE, f"{case.name}: predicted {peak:.2f} GiB, measured {case.measured}"


def markdown_table() -> str:
    """The predicted-against-measured table of docs/resolve-table.md."""
    lines = [
        "| case | record | GPUs | ZeRO | precision | checkpointing | micro-batch | measured GiB | predicted GiB | "
        "predicted / measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in CASES:
        offload = ", optimizer offloaded" if c.extra.get("offload_optimizer") else ""
        peak = c.predicted().peak / GIB
        lines.append(
            f"| {c.name} | {c.source} | {c.gpus} | {c.stage}{offload} | "
            f"{'pure bf16' if c.precision == 'pure' else 'mixed'} | {'on' if c.ckpt else 'off'} | "
            f"{c.micro_batch} x {c.seq} | {c.measured:.2f} | {peak:.2f} | {peak / c.measured:.2f} |"
        )
    return "\n".join(lines) + "\n"


def test_the_docs_table_is_the_tests_table():
    assert markdown_table() in DOC.read_text(), "regenerate: python tests/test_resolve.py (prints the table)"


def test_256k_tokens_of_the_8b_lora_case_do_not_fit_an_h200():
    """shared/README: at 256k tokens the same case ran out of memory on an H200."""
    request = Request(seq_length=262_144, micro_batch_size=1, lora=LORA)
    memory = rs.predict(rs.shape_from_config(SHAPES["llama-8b"]), 1, request, Plan(0, True, True, 1))
    assert memory.needed > H200


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_counts_match_the_published_ones(name):
    assert rs.shape_from_config(SHAPES[name]).params() == PARAMS[name]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_parameter_counts_match_transformers_models(name):
    """Built on the meta device: shapes only. Covers Qwen3's q/k norms and Qwen2's q/k/v biases."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(SHAPES[name])
    shape = rs.shape_from_config(SHAPES[name])
    assert shape.params() == sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0] if hasattr(model, "model") else model.transformer.h[0]
    assert shape.layer_params() == sum(p.numel() for p in layer.parameters())


# --- the grid: stage and checkpointing by model, GPU count and memory -----------------------------------------

MEMORIES = (24, 40, 80, 141)
# Expected "<stage><+ checkpointing on | - off>", or "x" where nothing fits, for 24, 40, 80 and 141 GiB GPUs; "a|b"
# where the estimate below lies within 5% of the card, so either is right. Workload: 8,192 tokens a micro-batch
# (4 x 2048; GPT-2 8 x 1024, its context), Liger (not for GPT-2), pure bf16 (learning rate 2e-5).
#
# How the expectations were reasoned, with rounded figures (GiB), and the rules: full fine-tuning takes stage 0 on
# one GPU, else stage 2, then stage 3, then the same two with checkpointing; LoRA stage 0, with checkpointing, then
# stage 3 (one GPU: stage 0 only). What must fit, before a 6% margin and 1.5 GiB outside torch: 21.0 of 24, 36.1
# of 40, 73.8 of 80, 131.4 of 141.
# - Bytes a parameter: full, stage 0: 2 weights + 4 bf16 moments (the 2 of the gradients exist after the
#   activations are freed); stage 2: 2 + 10/N; stage 3: 12/N. LoRA: the frozen base's 2 (2/N at stage 3).
# - Activations of 8,192 tokens without checkpointing (full / LoRA): Qwen2-0.5B 7.4 / 10.6, 1.1B 10 / 15.7,
#   Qwen3-1.7B 15.3 / 22.8, 8B 34 / 51.5 (81.5 for LoRA at stage 3, whose adapters run in float32), 70B 168 / 255;
#   with checkpointing each layer's input plus one layer: 1.1B 1.1, Qwen3 1.4-1.8, 8B 3.1-3.6, 70B 12-15.
#   The loss about 2 (Liger's chunks, the head's gradient); GPT-2 without Liger 5.4 of logits plus 4.1.
# - ZeRO-3's buffers: about 15.5 x a layer's parameters + the embedding, in bytes: 8B 4.7, 70B 15.4 (8.6 LoRA).
# So: GPT-2, Qwen2-0.5B and the 1.1B fit everywhere without help (the 1.1B on 24 GiB: 18.2 full, 19.4 LoRA).
# Qwen3-1.7B on one 24 GiB GPU: 3.2 + 6.4 + 15.3 + 2.1 = 27 > 21: checkpointing (14); LoRA 28 -> checkpointing;
# on 2 x 24 stage 2 (28.6) and stage 3 (28.6) do not fit: stage 2 with checkpointing; on 8 x 24 stage 2 is 22.9,
# stage 3 21.35 (within 5%: stage 3 or stage 2 with checkpointing); on 64 x 24 stage 2 is 21.2 (within 5%: stage
# 2 or stage 3, 19.3). 8B full on one GPU: 15 + 30 + 34 + 2.5 = 82: fits 141; 80 needs checkpointing (15 + 30 +
# 15 gradients = 60); 40 and 24 never (45 of states alone). On 2 GPUs stage 2: 15 + 37 + 34 + 2.5 = 89 (141 only);
# on 80 stage 3 is 86, stage 2 with checkpointing 58.6; nothing at 40. On 8: stage 2 61.5 (80, 141), 40 needs
# checkpointing (30.6), 24 stage 3 with checkpointing 21.5 (within 5%). On 64: stage 2 53 (80, 141); 40: stage 3
# 42.6 is too much, stage 2 with checkpointing 22.4; 24: that is 7% over, stage 3 with checkpointing 11.7.
# 8B LoRA: 15 + 51.5 + 1.6 = 68.7 fits 80; 40 needs checkpointing (20.8), which is within 5% of 24: there
# stage 0 with checkpointing, or on several GPUs stage 3 with checkpointing (18.4 on 2), or on one GPU nothing.
# 70B full: 6 bytes a parameter are 394 GiB on one GPU (stage 0), 394 / 2 at stage 3 on 2; on 8 stage 3 with
# checkpointing 98.6 + 12 + 3.5 + 15.4 = 129.6 (within 5% of 141's 131.4); on 64 12.3 + 31 = 43.3: fits 80 and 141.
# 70B LoRA: the base alone (131.5) fills one GPU; stage 3 with checkpointing: 65.7 + 25 = 91 on 2 (141 only), 16.4 +
# 25 = 41.7 on 8 (80 and 141; 40 is 15% over), 2 + 25 = 27.4 on 64 (40 and up).
GRID = {
    ("gpt2", "full"): {1: "0- 0- 0- 0-", 2: "2- 2- 2- 2-", 8: "2- 2- 2- 2-", 64: "2- 2- 2- 2-"},
    ("gpt2", "lora"): {1: "0- 0- 0- 0-", 2: "0- 0- 0- 0-", 8: "0- 0- 0- 0-", 64: "0- 0- 0- 0-"},
    ("qwen2-0.5b", "full"): {1: "0- 0- 0- 0-", 2: "2- 2- 2- 2-", 8: "2- 2- 2- 2-", 64: "2- 2- 2- 2-"},
    ("qwen2-0.5b", "lora"): {1: "0- 0- 0- 0-", 2: "0- 0- 0- 0-", 8: "0- 0- 0- 0-", 64: "0- 0- 0- 0-"},
    ("llama-1.1b", "full"): {1: "0- 0- 0- 0-", 2: "2- 2- 2- 2-", 8: "2- 2- 2- 2-", 64: "2- 2- 2- 2-"},
    ("llama-1.1b", "lora"): {1: "0- 0- 0- 0-", 2: "0- 0- 0- 0-", 8: "0- 0- 0- 0-", 64: "0- 0- 0- 0-"},
    ("qwen3-1.7b", "full"): {1: "0+ 0- 0- 0-", 2: "2+ 2- 2- 2-", 8: "3-|2+ 2- 2- 2-", 64: "2-|3- 2- 2- 2-"},
    ("qwen3-1.7b", "lora"): {1: "0+ 0- 0- 0-", 2: "0+ 0- 0- 0-", 8: "0+ 0- 0- 0-", 64: "0+ 0- 0- 0-"},
    ("llama-8b", "full"): {1: "x x 0+ 0-", 2: "x x 2+ 2-", 8: "x|3+ 2+ 2- 2-", 64: "3+ 2+ 2- 2-"},
    ("llama-8b", "lora"): {1: "0+|x 0+ 0- 0-", 2: "0+|3+ 0+ 0- 0-", 8: "0+|3+ 0+ 0- 0-", 64: "0+|3+ 0+ 0- 0-"},
    ("llama-70b", "full"): {1: "x x x x", 2: "x x x x", 8: "x x x 3+|x", 64: "x x 3+ 3+"},
    ("llama-70b", "lora"): {1: "x x x x", 2: "x x x 3+", 8: "x x 3+ 3+", 64: "x 3+ 3+ 3+"},
}
GRID_CASES = [
    (model, method, gpus, memory, expected)
    for (model, method), rows in GRID.items()
    for gpus, row in rows.items()
    for memory, expected in zip(MEMORIES, row.split(), strict=True)
]


@pytest.mark.parametrize("model,method,gpus,memory,expected", GRID_CASES)
def test_the_grid(model, method, gpus, memory, expected):
    seq, micro_batch = (1024, 8) if model == "gpt2" else (2048, 4)
    request = Request(
        seq_length=seq,
        micro_batch_size=micro_batch,
        lora=LORA if method == "lora" else None,
        liger=model != "gpt2",  # Liger has no GPT-2 kernels
        learning_rate=2e-5,
    )
    r = rs.resolve(SHAPES[model], gpus, memory * GIB, request)
    got = f"{r.zero_stage.value}{'+' if r.gradient_checkpointing.value else '-'}" if r.fits else "x"
    assert got in expected.split("|"), "\n".join(rs.describe(r))
    assert r.pure_bf16.value is True and r.micro_batch_size.value == micro_batch
    assert bool(r.problems) == (not r.fits)


def test_the_grid_covers_every_model_count_memory_and_method():
    assert len(GRID_CASES) == 6 * 4 * 4 * 2


# --- the micro-batch ------------------------------------------------------------------------------------------


def test_auto_micro_batch_is_the_largest_power_of_two_that_fits_up_to_the_cap():
    r = rs.resolve(SHAPES["llama-1.1b"], 1, 80 * GIB, Request(seq_length=2048, learning_rate=2e-4))
    assert (r.zero_stage.value, r.gradient_checkpointing.value, r.micro_batch_size.value) == (0, False, 16)
    assert "32768 tokens" in r.micro_batch_size.reason
    r = rs.resolve(SHAPES["llama-8b"], 1, H200, Request(seq_length=2048, learning_rate=2e-5))
    # 4 x 2048 without checkpointing: 82 GiB; 8: 15 + 30 + 68 + 3.5 = 117 of 131; 16: 185.
    assert (r.gradient_checkpointing.value, r.micro_batch_size.value) == (False, 8)
    assert "16 would need" in r.micro_batch_size.reason


def test_checkpointing_with_a_full_micro_batch_beats_a_thin_one_without():
    """The 8B on one 80 GiB GPU fits 2 x 2048 without checkpointing, under MIN_TOKENS: with it, 16 x 2048 fit."""
    r = rs.resolve(SHAPES["llama-8b"], 1, 80 * GIB, Request(seq_length=2048, learning_rate=2e-5))
    assert (r.zero_stage.value, r.gradient_checkpointing.value, r.micro_batch_size.value) == (0, True, 16)
    assert "only 2 x 2048 tokens fit" in r.gradient_checkpointing.reason


def test_a_sequence_longer_than_the_cap_takes_one_sequence():
    r = rs.resolve(SHAPES["llama-8b"], 1, H200, Request(seq_length=131_072, lora=LORA, learning_rate=2e-4))
    assert (r.zero_stage.value, r.gradient_checkpointing.value, r.micro_batch_size.value) == (0, True, 1)
    assert rs.micro_batch_bounds(131_072) == (1, 1) and rs.micro_batch_bounds(2048) == (16, 4)
    assert rs.micro_batch_bounds(100) == (64, 64)  # 327 sequences would be 32,700 tokens: capped at 64


# --- explicit values win --------------------------------------------------------------------------------------


def test_explicit_values_are_kept_and_marked_set():
    request = Request(seq_length=2048, micro_batch_size=2, zero_stage=3, pure_bf16=False, gradient_checkpointing=True)
    r = rs.resolve(SHAPES["llama-1.1b"], 1, 80 * GIB, request)
    assert r.plan == Plan(3, False, True, 2) and r.fits and not r.problems
    assert all(
        c.explicit and c.reason.startswith("set in the config")
        for c in (r.zero_stage, r.pure_bf16, r.gradient_checkpointing, r.micro_batch_size)
    )
    assert rs.overrides(r) == {}


def test_an_explicit_choice_that_does_not_fit_is_refused_with_figures_and_fixes():
    request = Request(seq_length=2048, micro_batch_size=16, gradient_checkpointing=False, learning_rate=2e-5)
    r = rs.resolve(SHAPES["llama-8b"], 1, 80 * GIB, request)
    assert r.plan.micro_batch == 16 and not r.plan.checkpointing and not r.fits
    [problem] = r.problems
    assert isinstance(problem, Problem) and problem.value == 80.0
    text = str(problem)
    needed = r.memory.needed / GIB
    assert f"{needed:.1f} GiB a GPU" in text and "predicted peak" in text and "activations" in text
    assert "leave model.gradient_checkpointing, train.micro_batch_size to auto" in problem.fix
    assert "a shorter data.seq_length" in problem.fix
    # 16 x 2048 tokens without checkpointing keep 136 GiB of activations on every GPU, however many: no GPU count
    # or LoRA helps while those two stay as set.
    assert "GPUs of this memory" not in problem.fix and "LoRA" not in problem.fix
    assert text in rs.describe(r)


def test_what_fits_nowhere_names_the_figures_and_each_way_out():
    """The 8B, full-parameter, on one 24 GiB GPU: 45 GiB of weights and moments alone."""
    r = rs.resolve(SHAPES["llama-8b"], 1, 24 * GIB, Request(seq_length=2048, learning_rate=2e-5))
    assert not r.fits and r.plan == Plan(0, True, True, 1)  # the most frugal option, reported
    fix = r.problems[0].fix
    assert "8 GPUs of this memory (scaling.num_workers: 8)" in fix
    assert "LoRA" in fix and "offload_optimizer" in fix and "CPU memory" in fix
    assert "seq_length" not in fix  # no sequence length makes 45 GiB of states fit 24
    for way_out in (
        rs.resolve(SHAPES["llama-8b"], 8, 24 * GIB, Request(seq_length=2048, learning_rate=2e-5)),
        rs.resolve(SHAPES["llama-8b"], 1, 24 * GIB, Request(seq_length=2048, lora=LORA, learning_rate=2e-5)),
        rs.resolve(SHAPES["llama-8b"], 1, 24 * GIB, Request(seq_length=2048, offload_optimizer=True)),
    ):
        assert way_out.fits, "\n".join(rs.describe(way_out))


def test_a_70b_on_too_few_gpus_says_how_many():
    """70B full on 40 GiB GPUs, 4096 tokens: stage 3 with checkpointing holds 6.5 GiB of activations, 3.6 of loss
    and 15 of ZeRO-3 buffers (app.ds_config's buckets for an 856M-parameter layer: 2.25 layers prefetched, a
    4.5-layer gradient bucket), so the 12 bytes a parameter must share 11 GiB: 789 / 11 = 72 GPUs, 128 as a power of
    two. LoRA fits on 8 (the base's 2 bytes a parameter)."""
    r = rs.resolve(SHAPES["llama-70b"], 8, 40 * GIB, Request(seq_length=4096, learning_rate=2e-5))
    assert not r.fits and "128 GPUs of this memory (scaling.num_workers: 128)" in r.problems[0].fix
    assert "LoRA" in r.problems[0].fix


def test_parameter_offload_forces_stage_3():
    r = rs.resolve(
        SHAPES["llama-8b"], 1, 24 * GIB, Request(seq_length=2048, offload_param=True, offload_optimizer=True)
    )
    assert r.zero_stage.value == 3 and r.memory.weights == 0 and r.memory.optimizer == 0


# --- precision ------------------------------------------------------------------------------------------------


def test_pure_bf16_is_the_default_and_its_reason_states_the_numerics():
    r = rs.resolve(SHAPES["qwen3-1.7b"], 1, H200, Request(seq_length=2048, learning_rate=2e-5))
    assert r.pure_bf16.value is True and not r.pure_bf16.explicit
    assert "bf16 master weights" in r.pure_bf16.reason and "lost" in r.pure_bf16.reason
    assert "pure bf16" in rs.describe(r)[1]


def test_a_learning_rate_too_small_for_bf16_keeps_fp32_master_weights_unless_memory_forbids():
    r = rs.resolve(SHAPES["llama-1.1b"], 1, 80 * GIB, Request(seq_length=2048, learning_rate=1e-6))
    assert r.pure_bf16.value is False and "fp32 master weights" in r.pure_bf16.reason
    assert "mixed bf16 (fp32 master weights)" in rs.describe(r)[1]
    # The 8B's mixed precision needs 16 bytes a parameter on one GPU (120 GiB of states): only pure bf16 fits.
    r = rs.resolve(SHAPES["llama-8b"], 1, 80 * GIB, Request(seq_length=2048, learning_rate=1e-6))
    assert r.fits and r.pure_bf16.value is True
    assert "does not fit" in r.pure_bf16.reason and "bf16 master weights" in r.pure_bf16.reason


def test_fp16_and_fp32_are_never_pure():
    for precision in ("fp16", "fp32"):
        r = rs.resolve(SHAPES["llama-1.1b"], 2, 80 * GIB, Request(seq_length=2048, precision=precision))
        assert r.pure_bf16.value is False and precision in r.pure_bf16.reason


# --- LoRA and the stage ---------------------------------------------------------------------------------------


def test_lora_keeps_the_base_whole_until_it_cannot():
    r = rs.resolve(SHAPES["llama-8b"], 8, 80 * GIB, Request(seq_length=2048, lora=LORA, learning_rate=2e-4))
    assert r.zero_stage.value == 0 and "frozen base stays whole" in r.zero_stage.reason
    r = rs.resolve(SHAPES["llama-70b"], 8, 80 * GIB, Request(seq_length=2048, lora=LORA, learning_rate=2e-4))
    assert r.zero_stage.value == 3 and "does not fit whole" in r.zero_stage.reason


def test_full_fine_tuning_partitions_the_weights_only_when_stage_2_does_not_fit():
    r = rs.resolve(SHAPES["llama-8b"], 64, 80 * GIB, Request(seq_length=2048, learning_rate=2e-5))
    assert r.zero_stage.value == 2 and "keeps the weights whole" in r.zero_stage.reason
    r = rs.resolve(SHAPES["llama-70b"], 64, 80 * GIB, Request(seq_length=2048, learning_rate=2e-5))
    assert r.zero_stage.value == 3 and "stage 2 would need" in r.zero_stage.reason


def test_lora_targets_count_their_modules_and_unknown_names_count_every_one():
    llama = rs.shape_from_config(SHAPES["llama-1.1b"])
    assert rs.adapters(llama, Lora(target_modules=("q_proj", "v_proj"))) == [(2048, 2048), (2048, 256)]
    assert len(rs.adapters(llama, Lora())) == 7
    # Another family's names (GPT-NeoX's): every linear layer, the upper bound; app.lora checks names on the model.
    assert rs.adapters(llama, Lora(target_modules=("query_key_value",))) == rs.adapters(llama, Lora())
    assert len(rs.adapters(rs.shape_from_config(SHAPES["gpt2"]), Lora(target_modules=("c_proj",)))) == 2


# --- shapes ---------------------------------------------------------------------------------------------------


def test_shapes_read_from_dicts_and_gpt2_names():
    shape = rs.shape_from_config(SHAPES["gpt2"].to_dict())
    assert (shape.hidden, shape.layers, shape.heads, shape.intermediate, shape.positions) == (768, 12, 12, 3072, 1024)
    qwen3 = rs.shape_from_config(SHAPES["qwen3-1.7b"])
    assert qwen3.qk_norm and qwen3.head_dim == 128 and qwen3.tied and not qwen3.qkv_bias
    assert rs.shape_from_config(SHAPES["qwen2-0.5b"]).qkv_bias
    untied = {k: v for k, v in SHAPES["qwen3-1.7b"].to_dict().items() if k != "tie_word_embeddings"}
    assert rs.shape_from_config(untied).params() == qwen3.params() + 151936 * 2048  # a dict without it: untied


@pytest.mark.parametrize(
    "config,match",
    [
        ({"model_type": "mixtral", "hidden_size": 4096, "num_local_experts": 8}, "mixture-of-experts"),
        ({"model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128}, "mixture-of-experts"),
        ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}, "recurrent"),
        ({"model_type": "mystery"}, "names no hidden_size"),
    ],
)
def test_models_the_memory_model_does_not_cover_are_refused(config, match):
    with pytest.raises(Problem, match=match) as refused:
        rs.shape_from_config(config)
    assert "explicitly" in refused.value.fix or "yourself" in refused.value.fix


# --- the product's side -------------------------------------------------------------------------------------


def test_describe_gives_one_line_a_choice_then_the_memory():
    r = rs.resolve(SHAPES["qwen3-1.7b"], 1, 80 * GIB, Request(seq_length=2048, lora=LORA, learning_rate=2e-4))
    lines = rs.describe(r)
    assert [line.split(":")[0] for line in lines] == [
        "ZeRO stage",
        "precision",
        "activation checkpointing",
        "micro-batch",
        "tiled MLP",
        "tiled loss",
        "offloaded checkpoints",
        "memory per GPU",
    ]
    assert all("(auto) - " in line for line in lines[:4]) and "fits" in lines[7]
    assert rs.overrides(r) == {
        "deepspeed.zero_optimization.stage": 0,
        "train.pure_bf16": True,
        "model.gradient_checkpointing": r.gradient_checkpointing.value,
        "train.micro_batch_size": r.micro_batch_size.value,
    }


def test_request_from_the_products_config():
    from app.config import TrainingConfig

    cfg = TrainingConfig.model_validate(
        {
            "model": {"lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}, "gradient_checkpointing": True},
            "data": {"seq_length": 4096},
            "train": {"micro_batch_size": 2, "learning_rate": 2e-4, "pure_bf16": True},
            "deepspeed": {
                "zero_optimization": {
                    "stage": 2,
                    "reduce_bucket_size": 50_000_000,
                    "offload_optimizer": {"device": "cpu"},
                }
            },
        }
    )
    request = rs.request_from_config(cfg, liger=True)
    assert request == Request(
        seq_length=4096,
        micro_batch_size=2,
        zero_stage=2,
        pure_bf16=True,
        gradient_checkpointing=True,
        lora=Lora(8, ("q_proj", "v_proj"), 0.05),
        liger=True,
        learning_rate=2e-4,
        offload_optimizer=True,
        reduce_bucket_elements=50_000_000,
        long=rs.LongAsk(),  # model.long_sequence: auto
    )
    # Every choice explicit today: the resolver only predicts and checks.
    r = rs.resolve(SHAPES["llama-8b"], 4, 80 * GIB, request)
    assert rs.overrides(r) == {} and r.fits


def test_the_loss_chunk_is_the_models():
    from app.model import LOSS_CHUNK_ELEMENTS

    assert rs.LOSS_CHUNK_ELEMENTS == LOSS_CHUNK_ELEMENTS


@pytest.mark.parametrize(
    "text,size",
    [("80GiB", 80 * GIB), ("141G", 141 * GIB), ("80GB", 80 * 10**9), ("80 GiB", 80 * GIB), ("81559MiB", 81559 << 20)],
)
def test_gpu_memory_sizes(text, size):
    assert rs.parse_memory(text) == size


@pytest.mark.parametrize("text", ["", "80 apples", "-1G", "0G", "nan", "1e9"])
def test_gpu_memory_sizes_refused(text):
    with pytest.raises(ValueError):
        rs.parse_memory(text)


def test_the_gib_figures_are_binary():
    assert GIB == 2**30 and math.isclose(rs.OUTSIDE_TORCH / GIB, 1.5)


if __name__ == "__main__":
    print(markdown_table(), end="")
