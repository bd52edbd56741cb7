"""GPU throughput harness: the product's own training path, case by case, one JSON line per case.

    python -m benchmarks.bench --suite gpu --out OUT_DIR            # on a machine with 2 GPUs
    python -m benchmarks.bench --suite smoke --out /tmp/bench-smoke # CPU plumbing check (2 CPU workers)

Each case is a training config (generated for a model shape, or one of examples/*.yaml) run by
`python -m app.cli train` with random weights built from the shape's config (`random-init:`), on a synthetic
corpus with a chosen document-length distribution, then ended after its timed steps. Side by side in the same
invocation: the tutorial's configuration and Hugging Face Trainer on the same DeepSpeed config, model, data and
batch. See docs/benchmarks.md for the figures and how to read them.

Every JSON line has: case, runner, shape, config knobs, step_s (mean over the timed steps; median, min, max),
tokens_per_s_per_gpu (real, non-padding tokens), mfu, peak_mem_gib (rank 0, torch max allocated),
time_to_first_step_s (process launch to the end of step 1), losses, versions, and the ds_config the app used.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata as md
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from app import profiling
from app.config import ConfigError
from benchmarks import assets
from benchmarks.make_weights import weights_folder
from benchmarks.runner import PEERS, REPO, Case, bench_env, peer_command, run_app, run_hf

MFU_FORMULA = (
    "MFU = real tokens/s/GPU x (6 x parameters + 12 x layers x hidden x seq_length) / peak; "
    "peak = 989 TFLOP/s dense bf16 (H100/H200 SXM datasheet). Parameters include embeddings; "
    "recomputation (activation checkpointing) is not counted as useful work."
)


# ---- suites ----------------------------------------------------------------------------------------------


# The tutorial's ZeRO-3 section for GPT-2 (hidden h = 768): its "auto" values as Hugging Face fills them (reduce
# bucket h^2, prefetch 0.9 h^2, persistence 10 h), and hooks on every module. Set explicitly: the app's own
# "auto" rules (whole layers, larger buckets) are what the app adds, so the baseline must not get them.
TUTORIAL_ZERO3 = {
    "deepspeed.zero_optimization.stage": 3,
    "deepspeed.zero_optimization.leaf_module": {"classes": []},
    "deepspeed.zero_optimization.reduce_bucket_size": 768 * 768,
    "deepspeed.zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 768 * 768),
    "deepspeed.zero_optimization.stage3_param_persistence_threshold": 10 * 768,
}


def tutorial(name: str = "tutorial", **kw) -> Case:
    """The tutorial's configuration: GPT-2, micro-batch 1, short texts padded to 512, ZeRO-3, its ds_config."""
    return Case(
        name,
        "gpt2-124m",
        {"data.packing": False, "data.seq_length": 512, "train.micro_batch_size": 1, **TUTORIAL_ZERO3},
        lengths="news",
        corpus_tokens=2_000_000,
        warmup=3,
        steps=12,
        estimate=40,
        **kw,
    )


def gpt2(name: str, mb: int, stage: int, **kw) -> Case:
    """The tutorial's workload (the same short texts), packed into 1024-token blocks."""
    return Case(
        name,
        "gpt2-124m",
        {
            "data.packing": True,
            "data.seq_length": 1024,
            "train.micro_batch_size": mb,
            "deepspeed.zero_optimization.stage": stage,
            **kw.pop("sets", {}),
        },
        lengths="news",
        corpus_tokens=2_000_000,
        warmup=4,
        steps=15,
        estimate=40,
        **kw,
    )


def llama(
    name: str,
    shape: str,
    mb: int,
    stage: int,
    liger: bool,
    zero: dict | None = None,
    ckpt: bool = False,
    seq: int = 2048,
    **kw,
) -> Case:
    sets = {
        "data.seq_length": seq,
        "train.micro_batch_size": mb,
        "deepspeed.zero_optimization.stage": stage,
        "model.liger_kernels": liger,
        "model.gradient_checkpointing": ckpt,
    }
    sets.update({f"deepspeed.zero_optimization.{k}": v for k, v in (zero or {}).items()})
    sets.update(kw.pop("sets", {}))
    tokens = 2_500_000 if shape == "llama-1.1b" else 600_000
    return Case(name, shape, sets, corpus_tokens=tokens, **kw)


DS_DEFAULT_BUCKETS = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
}


def suite_explore() -> list[Case]:
    """First GPU pass: the baselines, then each candidate optimisation on its own (most important first)."""
    big2 = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000}
    persist = {"stage3_param_persistence_threshold": 10_000_000, "stage3_prefetch_bucket_size": 50_000_000}
    return [
        tutorial(),
        gpt2("gpt2-z2-mb16", 16, 2),
        llama("l1b-z2-mb8", "llama-1.1b", 8, 2, False),
        llama("l1b-z2-mb16-liger", "llama-1.1b", 16, 2, True, estimate=60),
        llama("l1b-z3-mb16-liger", "llama-1.1b", 16, 3, True),
        llama("l1b-z3-mb8-liger", "llama-1.1b", 8, 3, True),
        llama("hf-l1b-z3-mb16", "llama-1.1b", 16, 3, False, runner="hf", estimate=60),
        llama("l8b-z3-mb4-liger", "llama-8b", 4, 3, True, warmup=2, steps=5, estimate=90, timeout=240),
        llama("l1b-z2-mb16-liger-big", "llama-1.1b", 16, 2, True, big2),
        llama("l1b-z3-mb16-liger-dsdef", "llama-1.1b", 16, 3, True, DS_DEFAULT_BUCKETS),
        llama("l1b-z3-mb32-liger", "llama-1.1b", 32, 3, True),
        llama("l1b-z3-mb16-liger-persist", "llama-1.1b", 16, 3, True, persist),
        gpt2("gpt2-z2-mb32", 32, 2),
        llama("l1b-z2-mb8-liger", "llama-1.1b", 8, 2, True),
    ]


def suite_gpu() -> list[Case]:
    """Second GPU pass: ZeRO-3 with the chosen settings (and its checkpoint), HF Trainer beside it, Llama-8B."""
    return [
        llama("l1b-z3-mb16-liger", "llama-1.1b", 16, 3, True, checkpoint=True, estimate=200, timeout=360),
        llama("hf-l1b-z3-mb16", "llama-1.1b", 16, 3, False, runner="hf", estimate=75),
        llama("l8b-z3-mb4-liger", "llama-8b", 4, 3, True, warmup=2, steps=5, estimate=130, timeout=300),
        llama(
            "l8b-z3-mb8-liger-ckpt",
            "llama-8b",
            8,
            3,
            True,
            ckpt=True,
            warmup=2,
            steps=4,
            estimate=130,
            timeout=300,
            fallback_for="l8b-z3-mb4-liger",
        ),
        llama("l1b-z3-mb32-liger", "llama-1.1b", 32, 3, True, estimate=90),
        offload_8b(),
    ]


def offload_8b() -> Case:
    """Llama-3-8B on one GPU: ZeRO-3 with the optimizer (fp32 master weights and Adam moments) in CPU memory."""
    return llama(
        "l8b-offload-1gpu",
        "llama-8b",
        4,
        3,
        True,
        ckpt=True,
        warmup=1,
        steps=2,
        estimate=300,
        timeout=480,
        sets={
            "scaling.num_workers": 1,
            "scaling.cpus_per_worker": 30,
            # as examples/llama-8b-1gpu-offload.yaml: the CPU update once per 8 micro-batches
            "train.gradient_accumulation_steps": 8,
            "deepspeed.zero_optimization.offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
    )


LEAF_LAYERS = {"leaf_module": {"classes": ["LlamaDecoderLayer"]}}  # ZeRO-3 hooks per decoder layer only
NO_LEAF = {"leaf_module": {"classes": []}}  # ZeRO-3 hooks on every module (DeepSpeed's default for Llama)
COMPILE = {"model.compile": True}
DEEPCOMPILE = {"model.compile": True, "deepspeed.compile": {"deepcompile": True}}


def suite_tune() -> list[Case]:
    """Third GPU pass: against HF Trainer at the same batch, what ZeRO-3 hook granularity and torch.compile
    (plain, and DeepSpeed's DeepCompile) add to the Liger configuration. Same ds_config on both sides."""
    return [
        llama("l1b-z3-mb16-liger", "llama-1.1b", 16, 3, True, estimate=75),
        llama("hf-l1b-z3-mb16", "llama-1.1b", 16, 3, False, runner="hf", estimate=45),
        llama("l1b-z3-mb16-liger-leaf", "llama-1.1b", 16, 3, True, LEAF_LAYERS, estimate=75),
        llama("l1b-z3-mb16-liger-compile", "llama-1.1b", 16, 3, True, sets=COMPILE, estimate=110),
        llama("l1b-z3-mb16-liger-leaf-compile", "llama-1.1b", 16, 3, True, LEAF_LAYERS, sets=COMPILE, estimate=110),
        llama("hf-l1b-z3-mb16-leaf", "llama-1.1b", 16, 3, False, LEAF_LAYERS, runner="hf", estimate=45),
        llama("l1b-z3-mb16-liger-deepcompile", "llama-1.1b", 16, 3, True, sets=DEEPCOMPILE, estimate=120),
    ]


def suite_final() -> list[Case]:
    """Fourth GPU pass: the defaults after the tune pass (Liger and layer-wise ZeRO-3 fetches on), against HF
    Trainer with the same ds_config and with DeepSpeed's per-module default; Llama-3-8B on one and two GPUs."""
    return [
        offload_8b(),
        llama("l1b-z3-mb16-liger", "llama-1.1b", 16, 3, True, estimate=75),
        llama("hf-l1b-z3-mb16", "llama-1.1b", 16, 3, False, runner="hf", estimate=45),
        llama("hf-l1b-z3-mb16-noleaf", "llama-1.1b", 16, 3, False, NO_LEAF, runner="hf", estimate=45),
        llama("l8b-z3-mb4-liger", "llama-8b", 4, 3, True, warmup=2, steps=5, estimate=110, timeout=300),
    ]


def suite_prefetch() -> list[Case]:
    """Fifth GPU pass: with whole decoder layers fetched, a prefetch bucket of the "auto" 0.9 h^2 (3.8M
    parameters for the 1.1B shape) is smaller than one layer (44M), so nothing is fetched ahead; a bucket of
    one layer or more lets the next layer's all-gather overlap this layer's compute. Same ds_config on both sides."""
    ahead = {**LEAF_LAYERS, "stage3_prefetch_bucket_size": 50_000_000}
    return [
        llama("l1b-z3-mb16-liger-ahead", "llama-1.1b", 16, 3, True, ahead, estimate=80),
        llama("hf-l1b-z3-mb16-ahead", "llama-1.1b", 16, 3, False, ahead, runner="hf", estimate=40),
        llama("l1b-z3-mb16-liger", "llama-1.1b", 16, 3, True, estimate=80),
        llama("hf-l1b-z3-mb16", "llama-1.1b", 16, 3, False, runner="hf", estimate=40),
        llama("l1b-z3-mb16-liger-noleaf", "llama-1.1b", 16, 3, True, NO_LEAF, estimate=80),
    ]


def suite_confirm() -> list[Case]:
    """Last GPU pass: the app's defaults after the prefetch pass (whole-layer fetches, one layer prefetched,
    from the "auto" values) against HF Trainer with the same ds_config and with DeepSpeed's per-module hooks."""
    return [
        llama("l1b-z3-mb16-liger", "llama-1.1b", 16, 3, True, estimate=85),
        llama("hf-l1b-z3-mb16", "llama-1.1b", 16, 3, False, runner="hf", estimate=40),
        llama("hf-l1b-z3-mb16-noleaf", "llama-1.1b", 16, 3, False, NO_LEAF, runner="hf", estimate=40),
        llama("l8b-z3-mb4-liger", "llama-8b", 4, 3, True, warmup=2, steps=5, estimate=80, timeout=200),
    ]


ACROSS = {"data.separate_documents": False}  # the earlier packing: documents attend across EOS in a block
FEWER_SYNCS = {"train.log_every_steps": 4, "train.max_steps": 40}  # the loop's host syncs once per 4 steps
BIG_BUCKETS = {
    "reduce_bucket_size": 200_000_000,
    "stage3_prefetch_bucket_size": 100_000_000,
}  # about two layers fetched ahead; fewer, larger reductions


def suite_peer() -> list[Case]:
    """Against the strongest peer, Hugging Face Trainer with the same Liger-patched model, ds_config, data and
    batch (and the same packed batches: documents kept apart by default). Then the cost of keeping documents
    apart (against the earlier cross-document packing), and candidate levers each on its own."""
    first, levers = _peer_1b()[:4], _peer_1b()[4:]
    return [*first, *_peer_8b(), *levers]  # the peer comparisons first, levers last


def suite_peer2() -> list[Case]:
    """The 1.1B peer comparison again, in another order (cross-document packing first), with the bucket lever:
    a second sample of the same pairs, since cases of one run differ by a few percent from run order alone."""
    by_name = {c.name: c for c in _peer_1b()}
    order = [
        "l1b-z3-mb16-across",
        "hf-liger-l1b-z3-mb16",
        "l1b-z3-mb16",
        "hf-liger-l1b-z3-mb16-across",
        "l1b-z3-mb16-buckets",
    ]
    return [by_name[name] for name in order]


def suite_peer1() -> list[Case]:
    """The 1.1B part of the peer suite on one GPU (for when only one-GPU machines are lent): ZeRO-3 then
    partitions nothing, so this measures the model, kernels, packing and loop, not the communication."""
    one = {"scaling.num_workers": 1}
    cases = [c for c in _peer_1b() if c.name != "l1b-z3-mb16-buckets"]
    for c in cases:
        c.name, c.sets = f"{c.name}-1gpu", {**c.sets, **one}
    return cases


def suite_start1() -> list[Case]:
    """Launch to first step on one GPU, each side with the tokenized data in the state it found: the app first
    (it tokenizes the corpus into the cache the cases share), Trainer + Liger (finds it), the app again (finds it)."""
    text = {c.name: c for c in suite_peer1()}
    app = text["l1b-z3-mb16-1gpu"]
    return [app, text["hf-liger-l1b-z3-mb16-1gpu"], dataclasses.replace(app, name="l1b-z3-mb16-1gpu-again")]


def suite_start3() -> list[Case]:
    """Launch to first step for each one-GPU case of issue 29's table (1.1B ZeRO-3, 1.1B ZeRO-2, the Qwen2-0.5B
    shape), the app against Trainer + Liger; the first app case of each corpus tokenizes it, the cases after it find
    the cache (as suite start1)."""
    z2 = {c.name: c for c in suite_fp8rule2()}["l1b-z2-mb16-1gpu"]
    qwen = qwen_text("q05-z3-mb16-1gpu")
    return [
        *suite_start1(),
        z2,
        dataclasses.replace(z2, name="hf-liger-l1b-z2-mb16-1gpu", runner="hf", estimate=45),
        qwen,
        dataclasses.replace(qwen, name="hf-liger-q05-z3-mb16-1gpu", runner="hf", estimate=45),
        dataclasses.replace(qwen, name="q05-z3-mb16-1gpu-again"),
    ]


def _peer_1b() -> list[Case]:
    return [
        llama("l1b-z3-mb16", "llama-1.1b", 16, 3, True, estimate=75),
        llama("hf-liger-l1b-z3-mb16", "llama-1.1b", 16, 3, True, runner="hf", estimate=45),
        llama("l1b-z3-mb16-across", "llama-1.1b", 16, 3, True, sets=ACROSS, estimate=75),
        llama("hf-liger-l1b-z3-mb16-across", "llama-1.1b", 16, 3, True, runner="hf", sets=ACROSS, estimate=45),
        llama("l1b-z3-mb16-log4", "llama-1.1b", 16, 3, True, sets=FEWER_SYNCS, warmup=1, steps=3, estimate=80),
        llama("l1b-z3-mb16-buckets", "llama-1.1b", 16, 3, True, BIG_BUCKETS, estimate=75),
    ]


def _peer_8b() -> list[Case]:
    return [
        llama("l8b-z3-mb4", "llama-8b", 4, 3, True, warmup=2, steps=5, estimate=100, timeout=240),
        llama("hf-liger-l8b-z3-mb4", "llama-8b", 4, 3, True, runner="hf", warmup=2, steps=5, estimate=80, timeout=240),
    ]


def suite_full() -> list[Case]:
    """Everything in one invocation (about 15 minutes on 2 x H200; longer than one 10-minute device call)."""
    return [
        tutorial(),
        gpt2("gpt2-z2-mb16", 16, 2),
        llama("l1b-z2-mb8", "llama-1.1b", 8, 2, False),
        llama("l1b-z2-mb16-liger", "llama-1.1b", 16, 2, True, estimate=60),
        llama("hf-l1b-z2-mb16", "llama-1.1b", 16, 2, False, runner="hf", estimate=75),
        *suite_gpu(),
    ]


def suite_start() -> list[Case]:
    """Launch to first step, phase by phase (the 1.1B ZeRO-3 case of issue 16, first on a fresh machine, then
    again with warm caches), Trainer + Liger beside it, and the 8B loaded from a safetensors folder."""
    return [
        llama("l1b-z3-mb16", "llama-1.1b", 16, 3, True, estimate=75),
        llama("hf-liger-l1b-z3-mb16", "llama-1.1b", 16, 3, True, runner="hf", estimate=45),
        llama("l8b-z3-mb4-weights", "llama-8b", 4, 3, True, warmup=2, steps=3, weights=True, estimate=260, timeout=240),
        llama("l1b-z3-mb16-again", "llama-1.1b", 16, 3, True, estimate=60),
        llama(
            "l1b-z3-mb16-noprestart",
            "llama-1.1b",
            16,
            3,
            True,
            estimate=60,
            env={"RAY_prestart_worker_first_driver": "0"},
        ),
    ]


def suite_tutorial() -> list[Case]:
    """Issue 16's item 6: the tutorial's configuration and the same texts packed, in one run."""
    return [tutorial(), gpt2("gpt2-z2-mb16", 16, 2)]


BASE_TREE = "../base"  # device_run.sh puts main's files there (`git archive main`), beside this tree


def suite_start_ab() -> list[Case]:
    """The start-up change against main's code, interleaved (two samples each, same machine), plus Ray's
    worker prestart off; then the tutorial pair (item 6)."""

    def l1b(name: str, **kw) -> Case:
        return llama(name, "llama-1.1b", 16, 3, True, estimate=65, **kw)

    return [
        l1b("l1b-z3-mb16-main", tree=BASE_TREE),
        l1b("l1b-z3-mb16"),
        *[dataclasses.replace(c, estimate=85) for c in suite_tutorial()],
        l1b("l1b-z3-mb16-main-2", tree=BASE_TREE),
        l1b("l1b-z3-mb16-2"),
        l1b("l1b-z3-mb16-noprestart", env={"RAY_prestart_worker_first_driver": "0"}),
    ]


def suite_start_ab2() -> list[Case]:
    """A second sample of the start-up A/B (with Ray's worker prestart off as a third arm), Trainer + Liger
    beside it, and the tutorial pair with the tutorial's own ZeRO-3 section."""

    def l1b(name: str, **kw) -> Case:
        return llama(name, "llama-1.1b", 16, 3, True, estimate=65, **kw)

    return [
        *[dataclasses.replace(c, estimate=80) for c in suite_tutorial()],
        l1b("l1b-z3-mb16-main-3", tree=BASE_TREE),
        l1b("l1b-z3-mb16-3"),
        l1b("l1b-z3-mb16-noprestart", env={"RAY_prestart_worker_first_driver": "0"}),
        llama("hf-liger-l1b-z3-mb16", "llama-1.1b", 16, 3, True, runner="hf", estimate=45),
    ]


FA4 = {"FINETUNE_VARLEN_KERNEL": "fa4"}  # FlashAttention-4's varlen kernels (package flash-attn-4)
FA2 = {"FINETUNE_VARLEN_KERNEL": "aten"}  # PyTorch's FlashAttention-2 varlen kernel (what transformers' FA2 runs)


def suite_fa4() -> list[Case]:
    """Documents-apart attention through FlashAttention-4's Hopper kernels against FlashAttention-2's (the
    kernel Trainer + Liger runs with packed batches), 1.1B and 8B, Trainer + Liger beside each."""

    def hf(name: str, shape: str, mb: int, **kw) -> Case:
        return llama(name, shape, mb, 3, True, runner="hf", env=FA2, **kw)

    return [
        llama("l1b-z3-mb16-fa4", "llama-1.1b", 16, 3, True, estimate=75, env=FA4),
        hf("hf-liger-l1b-z3-mb16", "llama-1.1b", 16, estimate=45),
        llama("l1b-z3-mb16-fa2", "llama-1.1b", 16, 3, True, estimate=70, env=FA2),
        llama("l8b-z3-mb4-fa4", "llama-8b", 4, 3, True, warmup=2, steps=5, estimate=100, timeout=240, env=FA4),
        hf("hf-liger-l8b-z3-mb4", "llama-8b", 4, warmup=2, steps=5, estimate=80, timeout=240),
        llama("l1b-z3-mb16-fa4-2", "llama-1.1b", 16, 3, True, estimate=70, env=FA4),
    ]


FP8 = {"model.fp8": True}  # torchao's float8 matmuls in the decoder layers, casts compiled


def suite_fp8() -> list[Case]:
    """FP8 matmuls (`model.fp8`: torchao's float8 training, each cast compiled) against Trainer + Liger, then the
    app's bf16 matmuls where time is left; 8B then 1.1B. Same ds_config, data and batch."""
    return [
        llama("l8b-z3-mb4-fp8", "llama-8b", 4, 3, True, warmup=2, steps=5, estimate=130, timeout=240, sets=FP8),
        llama("hf-liger-l8b-z3-mb4", "llama-8b", 4, 3, True, runner="hf", warmup=2, steps=5, estimate=60, timeout=240),
        llama("l1b-z3-mb16-fp8", "llama-1.1b", 16, 3, True, estimate=90, sets=FP8),
        llama("hf-liger-l1b-z3-mb16", "llama-1.1b", 16, 3, True, runner="hf", estimate=35),
        llama("l8b-z3-mb4", "llama-8b", 4, 3, True, warmup=2, steps=5, estimate=100, timeout=240),
        llama("l1b-z3-mb16", "llama-1.1b", 16, 3, True, estimate=70),
    ]


def suite_ckpt() -> list[Case]:
    """Issue 19.3: the loop's stall per periodic save, written in the background (the default) and synchronously
    (`checkpoint.async_save: false`), same checkpoint, ZeRO-3 on 2 GPUs. One save per case: the 8B's (about 96 GB
    with its optimizer state) fills most of the disk; corpora long enough that the run keeps training while it is
    written; the harness ends the run once the save is complete. The first background save comes late enough for
    the host buffers (allocated ahead after the first step, about 1 GB/s of pinned memory per rank) to be ready."""

    def case(name: str, shape: str, mb: int, every: int, background: bool, tokens: int, **kw) -> Case:
        sets = {
            "checkpoint.every_steps": every,
            "checkpoint.async_save": background,
            "checkpoint.keep": 3,
            "train.max_steps": 100_000,
        }
        return dataclasses.replace(llama(name, shape, mb, 3, True, saves=1, sets=sets, **kw), corpus_tokens=tokens)

    return [
        case("l1b-ckpt-async", "llama-1.1b", 16, 30, True, 4_000_000, estimate=90, timeout=170),
        case("l8b-ckpt-async", "llama-8b", 4, 70, True, 2_500_000, estimate=230, timeout=320),
        case("l8b-ckpt-sync", "llama-8b", 4, 15, False, 2_500_000, estimate=150, timeout=240),
        case("l1b-ckpt-sync", "llama-1.1b", 16, 10, False, 4_000_000, estimate=60, timeout=150),
    ]


def suite_ckpt_smoke() -> list[Case]:
    """The ckpt suite's plumbing on 2 CPU workers (tiny Llama)."""
    cpu = {
        "scaling.use_gpu": False,
        "scaling.cpus_per_worker": 1,
        "data.seq_length": 128,
        "train.micro_batch_size": 2,
        "checkpoint.every_steps": 3,
        "checkpoint.keep": 3,
        "train.max_steps": 100_000,
    }
    return [
        Case(
            f"smoke-ckpt-{mode}",
            "tiny-llama",
            {**cpu, "checkpoint.async_save": mode == "async"},
            corpus_tokens=200_000,
            saves=1,
            timeout=200,
        )
        for mode in ("async", "sync")
    ]


CHAT = {"data.format": "chat", "data.chat_template": "zephyr", "data.train_on_prompt": False, "data.packing": True}
LORA = {"model.lora": {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "auto"}}  # as the 8B chat example
ONE_GPU = {"scaling.num_workers": 1, "train.learning_rate": 2e-4}


def chat_case(name: str, shape: str, mb: int, stage: int, lora: bool, runner: str = "app", **kw) -> Case:
    """Chat SFT on one GPU: synthetic multi-turn conversations (assets.chat_corpus), the zephyr template, loss on
    the assistant turns, whole conversations packed into 2048-token blocks, Liger on, weights from a safetensors
    folder (LoRA needs a base model; the peer loads the same folder), LoRA r=16 on every projection or all
    parameters. The same config file drives the app and TRL's SFTTrainer."""
    sets = {**ONE_GPU, **CHAT, **(LORA if lora else {}), **kw.pop("sets", {})}
    tokens = 700_000 if shape == "llama-1.1b" else 250_000
    case = llama(name, shape, mb, stage, True, runner=runner, lengths="chat", weights=True, sets=sets, **kw)
    return dataclasses.replace(case, corpus_tokens=tokens)


def suite_chat() -> list[Case]:
    """Chat SFT with LoRA and full-parameter on one H200, the app against TRL's SFTTrainer with the same model,
    LoRA settings, template, packing, Liger, data and batch (TRL without DeepSpeed, its fastest on one GPU; TRL with
    the app's ZeRO-3 config and PEFT fails in backward, see chat-diag). The 8B pair last: its weights are written
    first (about 16 GB)."""
    return [
        chat_case("chat-l1b-lora-z3", "llama-1.1b", 8, 3, True, estimate=90, timeout=200),
        chat_case("trl-chat-l1b-lora", "llama-1.1b", 8, 3, True, runner="trl", estimate=50, timeout=180),
        chat_case("chat-l1b-lora-z2", "llama-1.1b", 8, 2, True, estimate=65, timeout=180),
        chat_case("chat-l1b-full-z3", "llama-1.1b", 8, 3, False, estimate=70, timeout=180),
        chat_case("trl-chat-l1b-full", "llama-1.1b", 8, 3, False, runner="trl", estimate=50, timeout=180),
        chat_case(
            "trl-chat-l8b-lora", "llama-8b", 4, 3, True, runner="trl", warmup=2, steps=5, estimate=200, timeout=300
        ),
        chat_case("chat-l8b-lora-z3", "llama-8b", 4, 3, True, warmup=2, steps=5, estimate=110, timeout=240),
    ]


PURE = {"train.pure_bf16": True}


def suite_chat_pure() -> list[Case]:
    """The 1.1B chat pairs again, the app packing best fit decreasing as TRL does, and each lever on its own: pure
    bf16 (train.pure_bf16: weights, gradients and AdamW moments in bf16, as TRL trains a model loaded in bf16) on
    ZeRO-2, for full-parameter and LoRA, then mixed precision on ZeRO-2 and ZeRO-3. In order of need: the deadline
    cuts the tail."""
    return [
        chat_case("trl-chat-l1b-full", "llama-1.1b", 8, 3, False, runner="trl", estimate=50, timeout=180),
        chat_case("chat-l1b-full-z2-pure", "llama-1.1b", 8, 2, False, sets=PURE, estimate=70, timeout=180),
        chat_case("trl-chat-l1b-lora", "llama-1.1b", 8, 3, True, runner="trl", estimate=50, timeout=180),
        chat_case("chat-l1b-lora-z2", "llama-1.1b", 8, 2, True, estimate=65, timeout=180),
        chat_case("chat-l1b-lora-z2-pure", "llama-1.1b", 8, 2, True, sets=PURE, estimate=65, timeout=180),
        chat_case("chat-l1b-full-z2", "llama-1.1b", 8, 2, False, estimate=70, timeout=180),
        chat_case("chat-l1b-full-z3", "llama-1.1b", 8, 3, False, estimate=70, timeout=180),
    ]


def profiled(case: Case, name: str | None = None, **sets: Any) -> Case:
    """`case` with one timed step profiled (app/profiling.py: where its time goes), which then goes untimed: one
    more step is run. `sets` are further config overrides (dotted keys with "__" for ".")."""
    extra = {k.replace("__", "."): v for k, v in sets.items()}
    return dataclasses.replace(
        case,
        name=name or case.name,
        sets={**case.sets, **extra},
        steps=case.steps + 1,
        env={**case.env, profiling.STEP_ENV: str(case.warmup + 2)},
    )


def suite_profile() -> list[Case]:
    """Where a step's time goes, app against peer, one profiled step each: the full-parameter and LoRA chat pairs
    against TRL (1.1B, one GPU), the full-parameter case without background saves (their host buffers are
    reserved while training runs), then the text 1.1B ZeRO-3 pair against Trainer + Liger."""
    full = chat_case("chat-l1b-full-z2-pure", "llama-1.1b", 8, 2, False, sets=PURE, estimate=75, timeout=180)
    text = {c.name: c for c in suite_peer1()}
    return [
        profiled(chat_case("trl-chat-l1b-full", "llama-1.1b", 8, 3, False, runner="trl", estimate=50, timeout=180)),
        profiled(full),
        profiled(full, "chat-l1b-full-z2-pure-sync", checkpoint__async_save=False),
        profiled(chat_case("chat-l1b-lora-z2", "llama-1.1b", 8, 2, True, estimate=65, timeout=180)),
        profiled(chat_case("trl-chat-l1b-lora", "llama-1.1b", 8, 3, True, runner="trl", estimate=50, timeout=180)),
        profiled(text["l1b-z3-mb16-1gpu"]),
        profiled(text["hf-liger-l1b-z3-mb16-1gpu"]),
    ]


STAGE0 = {**PURE, "deepspeed.zero_optimization.stage": 0}  # no DeepSpeed mixed precision: the app's AdamW steps
HOST_REGISTER = {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"}


def suite_plain() -> list[Case]:
    """Pure bf16 at ZeRO stage 0 (ds_config.plain_bf16: the bf16 model stepped by the app's clipping AdamW, no
    DeepSpeed wrapper), full-parameter and LoRA against TRL, one step of each app case profiled; then the host
    buffers of background saves, reserved after the first step, pinned by malloc + cudaHostRegister in 8 threads
    instead of cudaHostAlloc, and no background saves at all (nothing reserved)."""
    full = chat_case("chat-l1b-full-z0-pure", "llama-1.1b", 8, 0, False, sets=STAGE0, estimate=90, timeout=180)
    return [
        profiled(full),
        chat_case("trl-chat-l1b-full", "llama-1.1b", 8, 3, False, runner="trl", estimate=45, timeout=180),
        profiled(chat_case("chat-l1b-lora-z0-pure", "llama-1.1b", 8, 0, True, sets=STAGE0, estimate=90, timeout=180)),
        chat_case("trl-chat-l1b-lora", "llama-1.1b", 8, 3, True, runner="trl", estimate=45, timeout=180),
        dataclasses.replace(full, name="chat-l1b-full-z0-pure-hostreg", env=HOST_REGISTER),
        profiled(full, "chat-l1b-full-z0-pure-sync", checkpoint__async_save=False),
    ]


def suite_plain2() -> list[Case]:
    """After `plain`, with the register-based pinned memory as the workers' default: FP8 matmuls on top of stage-0
    pure bf16 (full-parameter 1.1B), the bf16 case again, both against TRL in this run; then the 8B LoRA pair."""
    full = chat_case("chat-l1b-full-z0-pure", "llama-1.1b", 8, 0, False, sets=STAGE0, estimate=85, timeout=180)
    fp8 = dataclasses.replace(full, name="chat-l1b-full-z0-pure-fp8", sets={**full.sets, "model.fp8": True})
    eight = {"warmup": 2, "steps": 5}
    return [
        dataclasses.replace(fp8, estimate=95),
        chat_case("trl-chat-l1b-full", "llama-1.1b", 8, 3, False, runner="trl", estimate=45, timeout=180),
        full,
        chat_case("trl-chat-l8b-lora", "llama-8b", 4, 3, True, runner="trl", estimate=190, timeout=300, **eight),
        chat_case("chat-l8b-lora-z0-pure", "llama-8b", 4, 0, True, sets=STAGE0, estimate=110, timeout=240, **eight),
    ]


def qwen_text(name: str, **kw) -> Case:
    """The Qwen2-0.5B shape on text, as the 1.1B's peer1 case: ZeRO-3, 16 x 2048, Liger, one GPU."""
    sets = {"scaling.num_workers": 1, **kw.pop("sets", {})}
    return llama(name, "qwen2-0.5b", 16, 3, True, sets=sets, estimate=kw.pop("estimate", 80), **kw)


def suite_fp8rule() -> list[Case]:
    """FP8 where it pays (benchmarks/fp8_shapes.py runs first, timing each projection shape): FP8 on top of stage-0
    pure bf16 against TRL (full-parameter chat, 1.1B), the Qwen2-0.5B shape in bf16 and FP8, then the text 1.1B
    ZeRO-3 pair against Trainer + Liger with one step of each profiled."""
    full = chat_case("chat-l1b-full-z0-pure", "llama-1.1b", 8, 0, False, sets=STAGE0, estimate=85, timeout=180)
    text = {c.name: c for c in suite_peer1()}
    return [
        dataclasses.replace(full, name="chat-l1b-full-z0-pure-fp8", sets={**full.sets, **FP8}, estimate=95),
        chat_case("trl-chat-l1b-full", "llama-1.1b", 8, 3, False, runner="trl", estimate=45, timeout=180),
        qwen_text("q05-z3-mb16-1gpu"),
        qwen_text("q05-z3-mb16-1gpu-fp8", sets=FP8, estimate=90),
        profiled(text["l1b-z3-mb16-1gpu"]),
        profiled(text["hf-liger-l1b-z3-mb16-1gpu"]),
    ]


def suite_fp8rule2() -> list[Case]:
    """With model.fp8 converting only the layers that gain (app.model.fp8_pays; fp8_shapes.py runs first, with each
    layer's GPU time): the Qwen2-0.5B shape in bf16 and FP8 (where nothing converts), then the text 1.1B ZeRO-3
    case in bf16 (one step profiled: against Trainer + Liger's profile of the fp8rule run) and FP8, then its ZeRO-2
    start-up (random-init weights now built on the GPU)."""
    text = {c.name: c for c in suite_peer1()}["l1b-z3-mb16-1gpu"]
    return [
        qwen_text("q05-z3-mb16-1gpu"),
        qwen_text("q05-z3-mb16-1gpu-fp8", sets=FP8),
        profiled(text),
        dataclasses.replace(text, name="l1b-z3-mb16-1gpu-fp8", sets={**text.sets, **FP8}, estimate=85),
        llama("l1b-z2-mb16-1gpu", "llama-1.1b", 16, 2, True, sets={"scaling.num_workers": 1}, estimate=80),
    ]


def suite_full8b() -> list[Case]:
    """Full-parameter chat SFT of the 8B shape on one H200 against TRL: pure bf16 at stage 0 against TRL's bf16
    model (weights, gradients and AdamW moments bf16 on both sides), then the same with `model.fp8` (at 4 x 2048
    tokens the rule converts the MLP and q/o projections); activation checkpointing on all three, as 16 GB of
    weights, 16 of gradients and 32 of moments leave no room for the activations; no background saves: their 48 GB
    of pinned host buffers would be reserved during the few timed steps."""
    eight = {"warmup": 2, "steps": 5, "timeout": 300}
    # 2e-5, a full-parameter 8B fine-tune's usual rate: at the chat cases' LoRA rate (2e-4) both app runs' losses
    # rose from step 7 (12.5 -> 19.1 and 17.9; record 2026-12-02-full8b.jsonl) while TRL's had not by its step 7.
    ckpt = {"model.gradient_checkpointing": True, "train.learning_rate": 2e-5}
    app_sets = {**STAGE0, **ckpt, "checkpoint.async_save": False}
    pure = chat_case("chat-l8b-full-z0-pure", "llama-8b", 4, 0, False, sets=app_sets, estimate=150, **eight)
    return [
        pure,
        chat_case("trl-chat-l8b-full", "llama-8b", 4, 3, False, runner="trl", sets=ckpt, estimate=120, **eight),
        dataclasses.replace(pure, name="chat-l8b-full-z0-pure-fp8", sets={**pure.sets, **FP8}, estimate=170),
    ]


def suite_full1b() -> list[Case]:
    """The 1.1B under model.fp8's layer rule: the full-parameter chat pair (stage 0, pure bf16 + FP8 against TRL),
    then the text ZeRO-3 case in FP8 and bf16 beside Trainer + Liger (peer1's pair)."""
    full = chat_case("chat-l1b-full-z0-pure", "llama-1.1b", 8, 0, False, sets=STAGE0, estimate=85, timeout=180)
    text = {c.name: c for c in suite_peer1()}
    bf16 = text["l1b-z3-mb16-1gpu"]
    return [
        dataclasses.replace(full, name="chat-l1b-full-z0-pure-fp8", sets={**full.sets, **FP8}, estimate=95),
        chat_case("trl-chat-l1b-full", "llama-1.1b", 8, 3, False, runner="trl", estimate=45, timeout=180),
        dataclasses.replace(bf16, name="l1b-z3-mb16-1gpu-fp8", sets={**bf16.sets, **FP8}, estimate=90),
        bf16,
        text["hf-liger-l1b-z3-mb16-1gpu"],
    ]


def suite_pin1() -> list[Case]:
    """After the background saves' buffers were pinned chunk by chunk and Ray Train's controller stopped importing
    torch: the full-parameter chat pair of full1b (its early steps were the ones the pinning slowed), then start1
    (the text case tokenizing, Trainer + Liger, the text case again). device_run.sh runs pin_stall.py first."""
    return [*suite_full1b()[:2], *suite_start1()]


def suite_step4() -> list[Case]:
    """The full-parameter chat cases' slow fourth step (0.46-0.66 s against 0.20-0.24 s in pin1's two calls): the
    FP8 case with step 4 profiled (the GPU idle 526 of 707 ms, the host waiting on nothing), the same case, the
    pure-bf16 case without FP8 (no slow step)."""
    fp8, _ = suite_full1b()[:2]
    bf16 = chat_case("chat-l1b-full-z0-pure", "llama-1.1b", 8, 0, False, sets=STAGE0, estimate=85, timeout=180)
    step4 = dataclasses.replace(fp8, name=fp8.name + "-prof4", env={**fp8.env, profiling.STEP_ENV: "4"})
    return [step4, fp8, bf16]


def suite_step4b() -> list[Case]:
    """The FP8 cases of full1b (the chat pair, the text case) and Trainer + Liger beside the text case. Measured
    with the loop collecting Python's garbage once after its first step (not kept: the chat case's step 4 was as
    slow, and with TORCH_LOGS=recompiles no recompilation came after step 1)."""
    full1b = suite_full1b()
    return [*full1b[:3], full1b[4]]


def suite_step4c() -> list[Case]:
    """The full-parameter chat FP8 case's slow fourth step, located: step 4 profiled with the host's side too (ops by
    their own time, the loop's Python stack sampled), the case without background saves (their host buffers are
    pinned while steps 2-4 run), the case itself (each step's time and data wait in the record), and TRL."""
    fp8, trl = suite_full1b()[:2]
    prof = dataclasses.replace(fp8, name=fp8.name + "-prof4", env={**fp8.env, profiling.STEP_ENV: "4"})
    quiet = dataclasses.replace(fp8, name=fp8.name + "-nobg", sets={**fp8.sets, "checkpoint.async_save": False})
    return [prof, quiet, fp8, trl]


def suite_warm() -> list[Case]:
    """Start-up with the compile caches cold and warm: the 1.1B text ZeRO-3 case and Trainer + Liger, each first on
    a fresh machine, then each again (the app's kernels kept under its storage root, Trainer's in ~/.triton); then
    the full-parameter chat FP8 case twice, the second time with every kernel it compiles already cached (the
    slow fourth step was Triton compiling Liger's cross-entropy kernel for a new integer specialization), 20 timed
    steps, and TRL with as many."""
    text = {c.name: c for c in suite_peer1()}
    app, hf = text["l1b-z3-mb16-1gpu"], text["hf-liger-l1b-z3-mb16-1gpu"]
    fp8, trl = (dataclasses.replace(c, steps=20) for c in suite_full1b()[:2])
    again = [dataclasses.replace(c, name=c.name + "-again") for c in (app, hf, fp8)]
    return [app, hf, again[0], again[1], fp8, again[2], trl]


def suite_nosync() -> list[Case]:
    """The full-parameter chat FP8 case without a host sync between logged steps (the loop's non-finite check read
    a step late, DeepSpeed's throughput timer off): first on the machine (its kernels compiled and cached), again
    with a sync each step as the harness has timed so far (20 steps), TRL likewise; then both sides timing
    windows of 5 steps, nothing read on the host in between (TRL's per-step NaN check off), twice in either order."""
    fp8, trl = suite_full1b()[:2]
    windows = {"train.log_every_steps": 5}

    def windowed(case: Case, name: str) -> Case:
        sets = {**case.sets, **windows}
        return dataclasses.replace(case, name=name, sets=sets, warmup=1, steps=4, corpus_tokens=1_500_000)

    per_step = [dataclasses.replace(c, name=c.name + "-20", steps=20) for c in (fp8, trl)]
    a, b = windowed(fp8, fp8.name + "-w5"), windowed(trl, trl.name + "-w5")
    again = [dataclasses.replace(c, name=c.name + "-again") for c in (b, a)]
    return [fp8, *per_step, a, b, *again, profiled(dataclasses.replace(fp8, name=fp8.name + "-prof"))]


def suite_fusedmlp() -> list[Case]:
    """The full-parameter chat FP8 case with each SwiGLU MLP as one compiled function (app.model.fuse_fp8_mlps:
    one host call, gate and up sharing the input's cast) and, its lever alone, with the three projections one by
    one: first on the machine (its kernels compiled and cached), then 20 steps timed one by one of each, and TRL."""
    from app.model import FUSED_MLP_ENV

    fp8, trl = suite_full1b()[:2]
    per_step = [dataclasses.replace(c, name=c.name + "-20", steps=20) for c in (fp8, trl)]
    separate = dataclasses.replace(per_step[0], name=fp8.name + "-separate-20", env={**fp8.env, FUSED_MLP_ENV: "0"})
    return [fp8, separate, per_step[0], per_step[1]]


def suite_qwenchat() -> list[Case]:
    """The Qwen2-0.5B shape's full-parameter chat case (pure bf16, stage 0), which ran 0.94x TRL (docs/benchmarks.md,
    2026-12-04): first on the machine, one step of it and of TRL profiled, then 20 timed steps of each."""
    app = chat_case("chat-q05-full-z0-pure", "qwen2-0.5b", 8, 0, False, sets=STAGE0, estimate=60, timeout=180)
    trl = chat_case("trl-chat-q05-full", "qwen2-0.5b", 8, 3, False, runner="trl", estimate=40, timeout=180)
    timed = [dataclasses.replace(c, name=c.name + "-20", steps=20) for c in (app, trl)]
    return [app, profiled(app, app.name + "-prof"), profiled(trl, trl.name + "-prof"), *timed]


def suite_losschunk() -> list[Case]:
    """Liger's fused loss in larger chunks (app.model.loss_options): the Qwen2-0.5B shape's chat case (128 chunks of
    128 rows by Liger's own rule) first on the machine, then 20 timed steps with the app's chunks, with Liger's own
    (the lever alone) and TRL; then the 1.1B chat pure-bf16 case both ways. device_run.sh runs
    check_loss_chunks.py first."""
    from app.model import LOSS_CHUNK_ENV

    app, _, _, app20, trl20 = suite_qwenchat()
    l1b = chat_case("chat-l1b-full-z0-pure-20", "llama-1.1b", 8, 0, False, sets=STAGE0, steps=20, estimate=75)
    liger_own = [
        dataclasses.replace(c, name=c.name + "-ligerchunks", env={**c.env, LOSS_CHUNK_ENV: "0"}) for c in (app20, l1b)
    ]
    return [app, app20, liger_own[0], trl20, l1b, liger_own[1]]


def suite_losschunk2() -> list[Case]:
    """losschunk's Qwen2-0.5B cases again on another machine, Liger's own chunks timed before the app's this time,
    then TRL. device_run.sh runs check_loss_chunks.py first."""
    app, app20, liger_own, trl20 = suite_losschunk()[:4]
    return [app, liger_own, app20, trl20]


def suite_features() -> list[Case]:
    """GPT-2 packed on one GPU, its attention dropout (0.1) now given to FlashAttention's varlen kernel, beside the
    same case with every dropout off (what the kernel's dropout costs); then start1 (the 1.1B ZeRO-3 text case
    tokenizing, Trainer + Liger, the case again: start-up). device_run.sh runs check_varlen.py first: the kernel's
    sliding window and dropout against SDPA."""
    one = {"scaling.num_workers": 1}
    dropout = gpt2("gpt2-z2-mb16-1gpu", 16, 2, sets=one)
    no_dropout = gpt2("gpt2-z2-mb16-1gpu-nodropout", 16, 2, sets={**one, "model.dropout": 0.0})
    return [dropout, no_dropout, *suite_start1()]


def suite_warm2() -> list[Case]:
    """Start-up with each side's compile cache warm: warm's text pair, each side twice (the app first, tokenizing
    the corpus). device_run.sh runs check_varlen.py first."""
    return suite_warm()[:4]


def suite_chunk8b() -> list[Case]:
    """Liger's fused loss in the app's chunks (app.model.loss_options: 8 chunks of 1024 rows for the 8B's 128,256-token
    head at 4 x 2048 tokens) against Liger's own (32 of 256 rows, FINETUNE_LOSS_CHUNK=0) on the 8B full-parameter
    chat case in pure bf16, Liger's own first (it pays for compiling the kernels both share); 8 timed steps each."""
    from app.model import LOSS_CHUNK_ENV

    pure = dataclasses.replace(suite_full8b()[0], steps=8)
    own = dataclasses.replace(pure, name=pure.name + "-ligerchunks", env={**pure.env, LOSS_CHUNK_ENV: "0"})
    return [own, pure]


def suite_chunk8b2() -> list[Case]:
    """chunk8b in the other order: the app's chunks first on the machine, then Liger's own."""
    return suite_chunk8b()[::-1]


def suite_fusedmlp8b() -> list[Case]:
    """fusedmlp's lever on the 8B full-parameter chat FP8 case (the MLP and q/o projections FP8): fused first on
    the machine (so it, not the other, pays for compiling the kernels both share), the projections one by one,
    then TRL; 8 timed steps each."""
    from app.model import FUSED_MLP_ENV

    _, trl, fp8 = suite_full8b()
    fused = dataclasses.replace(fp8, steps=8)
    separate = dataclasses.replace(fused, name=fp8.name + "-separate", env={**fp8.env, FUSED_MLP_ENV: "0"})
    return [fused, separate, dataclasses.replace(trl, steps=8)]


def suite_warm8b() -> list[Case]:
    """The 8B full-parameter chat FP8 case of full8b, first on the machine (its Triton and torch.compile kernels
    compiled mid-run, as its slow fourth step was) and again with them cached under the storage root, then TRL;
    8 timed steps each after the first run."""
    _, trl, fp8 = suite_full8b()
    again = dataclasses.replace(fp8, name=fp8.name + "-again", steps=8, estimate=150)
    return [fp8, again, dataclasses.replace(trl, steps=8)]


def suite_solo3() -> list[Case]:
    """ZeRO-3 on one GPU partitions nothing: the 1.1B text case with every parameter persistent (gathered once,
    never released), one step profiled, beside the default and Trainer + Liger. Measured: no gain (the same
    kernels; docs/benchmarks.md)."""
    text = {c.name: c for c in suite_peer1()}
    bf16 = text["l1b-z3-mb16-1gpu"]
    persist = {"deepspeed.zero_optimization.stage3_param_persistence_threshold": 10**12}
    return [
        profiled(dataclasses.replace(bf16, name="l1b-z3-mb16-1gpu-persist", sets={**bf16.sets, **persist})),
        bf16,
        text["hf-liger-l1b-z3-mb16-1gpu"],
    ]


def suite_chat_diag() -> list[Case]:
    """The chat case's variants that located its non-finite gradients from step 1 (a tokenizer without the
    template's markers, since fixed in assets.model_folder; docs/benchmarks.md, History): without Liger, unpacked
    (one padded conversation per row), without clipping; and TRL with the app's ZeRO-3 config."""
    return [
        chat_case("chat-l1b-full-z3-noliger", "llama-1.1b", 8, 3, False, sets={"model.liger_kernels": False}),
        chat_case("chat-l1b-full-z3-padded", "llama-1.1b", 8, 3, False, sets={"data.packing": False}),
        chat_case("chat-l1b-full-z3-noclip", "llama-1.1b", 8, 3, False, sets={"train.max_grad_norm": 0.0}),
        chat_case("trl-ds-chat-l1b-lora-z3", "llama-1.1b", 8, 3, True, runner="trl-ds", estimate=55, timeout=180),
    ]


def suite_chat_diag2() -> list[Case]:
    """With chat-diag: the chat case from random-init (no weights folder), and text data from the weights folder,
    on one GPU."""
    chat_random = dataclasses.replace(chat_case("chat-l1b-full-z3-random", "llama-1.1b", 8, 3, False), weights=False)
    text_weights = llama("l1b-z3-mb8-text-weights", "llama-1.1b", 8, 3, True, weights=True, sets=ONE_GPU)
    return [chat_random, text_weights]


def suite_chat_smoke() -> list[Case]:
    """The chat suite's app cases on CPUs (tiny Llama, one worker): the config, corpus and weights plumbing."""
    cpu = {"scaling.use_gpu": False, "scaling.cpus_per_worker": 1, "model.liger_kernels": False, "data.seq_length": 256}
    return [
        chat_case("smoke-chat-lora", "tiny-llama", 2, 3, True, warmup=1, steps=2, sets=cpu),
        chat_case("smoke-chat-full", "tiny-llama", 2, 2, False, warmup=1, steps=2, sets=cpu),
    ]


def suite_smoke() -> list[Case]:
    """CPU plumbing check: 2 CPU workers, tiny shapes; every runner and the checkpoint path once."""
    cpu = {"scaling.use_gpu": False, "scaling.cpus_per_worker": 1}
    return [
        Case(
            "smoke-tutorial",
            "tiny-gpt2",
            {**cpu, "data.packing": False, "data.seq_length": 64, "train.micro_batch_size": 1},
            lengths="news",
            corpus_tokens=50_000,
            warmup=1,
            steps=3,
        ),
        Case(
            "smoke-llama-z2",
            "tiny-llama",
            {**cpu, "data.seq_length": 128, "train.micro_batch_size": 2, "deepspeed.zero_optimization.stage": 2},
            corpus_tokens=50_000,
            warmup=1,
            steps=3,
        ),
        Case(
            "smoke-llama-z3-ckpt",
            "tiny-llama",
            {**cpu, "data.seq_length": 128, "train.micro_batch_size": 2},
            corpus_tokens=50_000,
            warmup=1,
            steps=3,
            checkpoint=True,
        ),
        Case(
            "smoke-hf-z3",
            "tiny-llama",
            {**cpu, "data.seq_length": 128, "train.micro_batch_size": 2},
            runner="hf",
            corpus_tokens=50_000,
            warmup=1,
            steps=3,
        ),
    ]


SUITES = {
    "peer": suite_peer,
    "peer1": suite_peer1,
    "start1": suite_start1,
    "start3": suite_start3,
    "fp8rule": suite_fp8rule,
    "fp8rule2": suite_fp8rule2,
    "full8b": suite_full8b,
    "full1b": suite_full1b,
    "solo3": suite_solo3,
    "pin1": suite_pin1,
    "step4": suite_step4,
    "step4b": suite_step4b,
    "step4c": suite_step4c,
    "warm": suite_warm,
    "nosync": suite_nosync,
    "fusedmlp": suite_fusedmlp,
    "fusedmlp8b": suite_fusedmlp8b,
    "features": suite_features,
    "warm2": suite_warm2,
    "chunk8b": suite_chunk8b,
    "chunk8b2": suite_chunk8b2,
    "warm8b": suite_warm8b,
    "peer2": suite_peer2,
    "explore": suite_explore,
    "gpu": suite_gpu,
    "tune": suite_tune,
    "final": suite_final,
    "prefetch": suite_prefetch,
    "confirm": suite_confirm,
    "full": suite_full,
    "smoke": suite_smoke,
    "start": suite_start,
    "fa4": suite_fa4,
    "tutorial": suite_tutorial,
    "start-ab": suite_start_ab,
    "start-ab2": suite_start_ab2,
    "ckpt": suite_ckpt,
    "ckpt-smoke": suite_ckpt_smoke,
    "fp8": suite_fp8,
    "chat": suite_chat,
    "qwenchat": suite_qwenchat,
    "losschunk": suite_losschunk,
    "losschunk2": suite_losschunk2,
    "chat-smoke": suite_chat_smoke,
    "chat-diag": suite_chat_diag,
    "chat-pure": suite_chat_pure,
    "chat-diag2": suite_chat_diag2,
    "profile": suite_profile,
    "plain": suite_plain,
    "plain2": suite_plain2,
}


# ---- configs ---------------------------------------------------------------------------------------------


def set_dotted(doc: dict[str, Any], key: str, value: Any) -> None:
    node = doc
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def case_config(case: Case, work: Path) -> tuple[dict[str, Any], assets.Shape]:
    shape = assets.SHAPES[case.shape]
    model = assets.model_folder(work, shape)
    source = f"random-init:{model}"
    if case.weights:  # written by make_weights (config, tokenizer, safetensors) before the case's config checks
        source = str(weights_folder(work, shape))
    if case.lengths == "chat":
        corpus = assets.chat_corpus(work, shape.vocab, case.corpus_tokens)
    else:
        corpus = assets.corpus(work, assets.LENGTHS[case.lengths], shape.vocab, case.corpus_tokens)
    if case.config:
        doc = yaml.safe_load((REPO / case.config).read_text()) or {}
    else:
        doc = {
            "train": {"learning_rate": 1e-4, "lr_scheduler": "constant"},
            "scaling": {"num_workers": 2, "use_gpu": True, "cpus_per_worker": 8},
            "data": {"loader_workers": 2},
        }
    need = case.warmup + case.steps
    forced = {
        "experiment.name": case.name,
        "experiment.storage_path": str(work / "storage"),
        "model.name_or_path": source,
        "model.tokenizer": str(assets.tokenizer_folder(model)),
        "data.dataset": str(corpus),
        "data.split": "train",
        "data.eval_split": None,
        "data.eval_fraction": 0.0,
        "train.epochs": 1,
        "train.max_steps_per_epoch": None,
        # A few spare steps: the harness ends the run after the timed ones (a checkpoint case ends by itself).
        "train.max_steps": (need if case.checkpoint else need + 3) * case.sets.get("train.log_every_steps", 1),
        "train.log_every_steps": 1,
        "train.eval_every_steps": None,
        "checkpoint.every_steps": None,
        "checkpoint.export_final": False,
        "checkpoint.keep": 1,
    }
    for key, value in {**forced, **case.sets}.items():
        set_dotted(doc, key, value)
    return doc, shape


# ---- environment -----------------------------------------------------------------------------------------


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "deepspeed", "ray", "datasets", "accelerate", "liger-kernel", "triton"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        pass
    if shutil.which("nvidia-smi"):
        q = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()
        )
        out["gpus"] = q
    out["cpus"] = os.cpu_count()
    out["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    return out


# ---- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="explore", choices=sorted(SUITES))
    p.add_argument("--only", default="", help="comma-separated case names to run (default: all)")
    p.add_argument("--out", required=True, help="folder for results.jsonl, summary.txt and logs.txt")
    p.add_argument("--work", default="/tmp/finetune-bench", help="scratch folder: models, corpora, storage")
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip cases that would end after this many seconds")
    args = p.parse_args(argv)

    t0 = time.time()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    cases = SUITES[args.suite]()
    if args.only:
        wanted = set(args.only.split(","))
        cases = [c for c in cases if c.name in wanted]
    env = versions()
    (out / "env.json").write_text(json.dumps(env, indent=2))
    results = []
    for case in cases:
        elapsed = time.time() - t0
        row: dict[str, Any] = {"case": case.name, "runner": case.runner, "shape": case.shape, "note": case.note}
        failed = {r["case"] for r in results if r.get("error") or r.get("skipped")}
        if case.fallback_for and case.fallback_for not in failed:
            continue
        if elapsed + case.estimate > args.deadline_s:
            row["skipped"] = f"deadline ({elapsed:.0f}s elapsed)"
            print(f"-- {case.name}: skipped, {row['skipped']}", flush=True)
            _emit(out, row, results)
            continue
        doc, shape = case_config(case, work)
        cfg_path = work / "configs" / f"{case.name}.yaml"
        cfg_path.parent.mkdir(parents=True, exist_ok=True)
        cfg_path.write_text(yaml.safe_dump(doc, sort_keys=False))
        log_path = work / "logs" / f"{case.name}.log"
        log_path.unlink(missing_ok=True)
        if case.weights:  # before the config checks: they look for the weight files
            made = subprocess.run(
                [sys.executable, "-m", "benchmarks.make_weights", "--shape", case.shape, "--work", str(work)],
                cwd=REPO,
                env=bench_env(),
                capture_output=True,
                text=True,
            )
            row["weights"] = json.loads(made.stdout.splitlines()[-1]) if made.returncode == 0 else made.stderr[-800:]
        try:
            row.update(_knobs(doc, shape, cfg_path, case.runner))
        except ConfigError as exc:  # refused by the app's preflight (e.g. a combination known to fail)
            row["error"] = f"invalid config: {exc}"
            print(f"-- {case.name}: {row['error']}", flush=True)
            _emit(out, row, results)
            continue
        print(f"-- {case.name}: {row['command']}", flush=True)
        started = time.time()
        run_dir = work / "storage" / case.name
        try:
            if case.runner in PEERS:
                shutil.rmtree(run_dir, ignore_errors=True)
                run_dir.mkdir(parents=True)
                (run_dir / "cache").symlink_to(work / "cache", target_is_directory=True)
                row.update(run_hf(case, cfg_path, row["workers"], work / f"{case.name}.json", log_path))
            else:
                row.update(run_app(case, cfg_path, run_dir, work / "cache", log_path))
        except Exception as exc:  # noqa: BLE001 - one broken case must not end the suite
            row["error"] = f"harness: {type(exc).__name__}: {exc}"
        row["wall_s"] = round(time.time() - started, 1)
        row["versions"] = env
        row["mfu_formula"] = MFU_FORMULA
        shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints are large; the figures are in the row
        _emit(out, row, results)
        _append_log(out / "logs.txt", case.name, log_path)
        print(f"   {_line(row)}", flush=True)
    summary = table(results)
    (out / "summary.txt").write_text(summary)
    print(summary)
    print(f"total {time.time() - t0:.0f}s")
    return 0


def _knobs(doc: dict[str, Any], shape: assets.Shape, cfg_path: Path, runner: str) -> dict[str, Any]:
    from app import config as config_mod
    from app import driver

    cfg = config_mod.load(cfg_path)
    workers = cfg.scaling.num_workers
    ds, _ = driver.check(cfg)  # what the app hands the workers (and hf_trainer builds the same way)
    return {
        "workers": workers,
        "stage": cfg.zero_stage,
        "micro_batch": cfg.train.micro_batch_size,
        "grad_accum": cfg.train.gradient_accumulation_steps,
        "seq": cfg.data.seq_length,
        "packing": cfg.data.packing,
        "liger": cfg.model.liger_kernels,
        "compile": cfg.model.compile,
        "act_ckpt": cfg.model.gradient_checkpointing,
        "offload": bool(ds["zero_optimization"].get("offload_optimizer")),
        "ds_config": ds,
        "lora": cfg.model.lora.model_dump() if cfg.model.lora else None,
        "format": cfg.data.format,
        "command": " ".join(["python", *peer_command(runner, cfg_path, workers)[1:]])
        if runner in PEERS
        else f"python -m app.cli train {cfg_path}",
    }


def _emit(out: Path, row: dict[str, Any], results: list[dict[str, Any]]) -> None:
    results.append(row)
    with (out / "results.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


def _append_log(dest: Path, name: str, log_path: Path, lines: int = 40) -> None:
    text = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    keep = [line for line in text if "step " in line or "rror" in line or "resumed" in line][-lines:]
    with dest.open("a") as f:
        f.write(f"===== {name}\n" + "\n".join(keep or text[-lines:]) + "\n")


def _line(r: dict[str, Any]) -> str:
    if r.get("error"):
        return f"ERROR {r['error'][:400]}"
    mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
    startup = "  start-up " + json.dumps(r["startup"]) if r.get("startup") else ""
    return (
        f"step {r.get('step_s', 0):.3f}s  tok/s/GPU {r.get('tokens_per_s_per_gpu', 0):,.0f}  MFU {mfu}  "
        f"mem {r.get('peak_mem_gib')} GiB  first step {r.get('time_to_first_step_s')}s  wall {r.get('wall_s')}s"
        f"{startup}"
    )


def table(results: list[dict[str, Any]]) -> str:
    base = next((r.get("tokens_per_s_per_gpu") for r in results if r["case"].startswith("tutorial")), None)
    rows = [
        "| case | runner | stage | mb x seq | liger | step s | real tok/s/GPU | x tutorial | MFU | peak GiB "
        "| 1st step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.get("skipped") or r.get("error"):
            rows.append(f"| {r['case']} | {r['runner']} | | | | {r.get('skipped') or 'ERROR'} | | | | | |")
            continue
        tps = r.get("tokens_per_s_per_gpu") or 0
        ratio = f"{tps / base:,.0f}x" if base else ""
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else ""
        rows.append(
            f"| {r['case']} | {r['runner']} | {r.get('stage')} | {r.get('micro_batch')} x {r.get('seq')} | "
            f"{'y' if r.get('liger') else ''} | {r.get('step_s')} | {tps:,.0f} | {ratio} | {mfu} | "
            f"{r.get('peak_mem_gib')} | {r.get('time_to_first_step_s')} |"
        )
        if r.get("checkpoint"):
            rows.append(f"|   checkpoint | {json.dumps(r['checkpoint'])} |")
        for save in r.get("saves") or []:
            rows.append(f"|   save | {json.dumps(save)} |")
    return "\n".join(rows) + "\n" + peer_table(results)


def peer_table(results: list[dict[str, Any]]) -> str:
    """Each app chat case against the TRL cases of its shape and kind (LoRA or full): tokens/s ratio, memory, the
    first and last losses of both."""
    done = [r for r in results if r.get("format") == "chat" and r.get("tokens_per_s_per_gpu")]
    lines = []
    for app in (r for r in done if r["runner"] == "app"):
        for peer in (r for r in done if r["runner"].startswith("trl") and r["shape"] == app["shape"]):
            if bool(peer.get("lora")) != bool(app.get("lora")):
                continue
            ratio = app["tokens_per_s_per_gpu"] / peer["tokens_per_s_per_gpu"]
            losses = [f"{x['losses'][0]}->{x['losses'][-1]}" if x.get("losses") else "-" for x in (app, peer)]
            lines.append(
                f"| {app['case']} | {peer['case']} | {ratio:.2f}x | {app.get('peak_mem_gib')} | "
                f"{peer.get('peak_mem_gib')} | {losses[0]} | {losses[1]} |"
            )
    if not lines:
        return ""
    head = "| app case | TRL case | app/TRL tok/s | app GiB | TRL GiB | app loss first->last | TRL loss first->last |"
    return "\n" + "\n".join([head, "|---|---|---|---|---|---|---|", *lines]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
