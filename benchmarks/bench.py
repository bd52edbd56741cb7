"""GPU throughput harness: the product's own training path, case by case, one JSON line per case.

    python -m benchmarks.bench --suite trainer --out OUT_DIR         # on a machine with one GPU (see SUITES)
    python -m benchmarks.bench --suite smoke --out /tmp/bench-smoke  # CPU plumbing check (2 CPU workers)

Each case is a training config (generated for a model shape, or one of examples/*.yaml) run by
`python -m app.cli train` with random weights built from the shape's config (`random-init:`), on a synthetic
corpus with a chosen document-length distribution, then ended after its timed steps. Side by side in the same
invocation: the tutorial's configuration and Hugging Face Trainer on the same DeepSpeed config, model, data and
batch. See docs/benchmarks.md for the figures and how to read them.

Every JSON line has: case, runner, shape, config knobs, step_s (mean over the timed steps; median, min, max),
tokens_per_s_per_gpu (real, non-padding tokens), mfu, peak_mem_gib (rank 0, torch max allocated),
time_to_first_step_s (process launch to the end of step 1), losses, versions, the ds_config the app used,
`defaults` (true when the case set none of the settings the app chooses: ZeRO stage, pure bf16, activation
checkpointing, micro-batch) and `resolved` (what the app chose for those it left to auto, as `finetune train` chooses
them on this machine's GPUs, or for --gpu-memory).
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
from app.config import AUTO_FIELDS, BEFORE_AUTO, ConfigError
from app.resolve import parse_memory
from benchmarks import assets
from benchmarks.make_weights import weights_folder
from benchmarks.runner import (
    PEERS,
    REPO,
    Case,
    bench_env,
    method_of,
    peer_command,
    run_app,
    run_hf,
    settled_config,
)

MFU_FORMULA = (
    "MFU = real tokens/s/GPU x (6 x parameters + 12 x layers x hidden x seq_length) / peak; "
    "peak = 989 TFLOP/s dense bf16 (H100/H200 SXM datasheet). Parameters include embeddings; "
    "recomputation (activation checkpointing) is not counted as useful work."
)


# ---- suites ----------------------------------------------------------------------------------------------
#
# One suite per table of docs/benchmarks.md, its cases written out below in the order they run. A case that two
# suites share is one named value (L1B_1GPU, ...), never another suite's case by position. The experiments that
# led here (levers measured and kept or dropped, re-runs) are in docs/benchmarks-history.md with the commit that
# defined each of their suites; their records stay in benchmarks/results/.

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
ONE_GPU = {"scaling.num_workers": 1}
FP8 = {"model.fp8": True}  # torchao's float8 matmuls in the layers whose shape gains (app.model.fp8_pays)
CHAT = {"data.format": "chat", "data.chat_template": "zephyr", "data.train_on_prompt": False, "data.packing": True}
LORA = {"model.lora": {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "auto"}}  # as the 8B chat example
# Pure bf16 at ZeRO stage 0: the bf16 model stepped by the app's clipping AdamW, no DeepSpeed wrapper, as TRL
# trains a bf16 model on one GPU.
STAGE0 = {"train.pure_bf16": True, "deepspeed.zero_optimization.stage": 0}
# The 8B full-parameter chat cases: 16 GB of weights, 16 of gradients and 32 of AdamW moments leave no room for the
# activations without checkpointing; 2e-5, a full-parameter 8B fine-tune's usual rate (at 2e-4 the app's losses
# rose from step 7: record 2026-12-02-full8b.jsonl); no background saves, whose 48 GB of pinned host buffers would
# be reserved during the few timed steps.
FULL_8B = {"model.gradient_checkpointing": True, "train.learning_rate": 2e-5}
EIGHT_B = {"warmup": 2, "steps": 8, "timeout": 300}
EIGHT_B_STEPS = {"warmup": 2, "steps": 8}
LORA_8B = {"warmup": 2, "steps": 5}
FULL_DPO_8B = {"warmup": 2, "steps": 5, "estimate": 220, "timeout": 300}
# DPO (issue #51): preference pairs in TRL's conversational form with the zephyr template, each pair's two sequences
# packed into one block (the app's way); the sigmoid loss at beta 0.1 against the base model (LoRA's adapters off, as
# TRL's DPOTrainer does with a peft model). LoRA as the chat cases' but without dropout: TRL's DPOTrainer disables
# dropout by default (disable_dropout), the app leaves the model's as configured.
DPO = {
    "data.format": "preference",
    "data.chat_template": "zephyr",
    "data.packing": True,
    "preference": {"loss": "sigmoid", "beta": 0.1},
}
LORA_DPO = {"model.lora": {**LORA["model.lora"], "dropout": 0.0}}


def tutorial(name: str = "tutorial", **kw) -> Case:
    """The tutorial's configuration: GPT-2, micro-batch 1, short texts padded to 512, ZeRO-3, its ds_config."""
    sets = {"data.packing": False, "data.seq_length": 512, "train.micro_batch_size": 1, **TUTORIAL_ZERO3}
    return Case(name, "gpt2-124m", sets, lengths="news", corpus_tokens=2_000_000, warmup=3, steps=12, estimate=80, **kw)


def gpt2(name: str, mb: int, stage: int, **kw) -> Case:
    """The tutorial's workload (the same short texts), packed into 1024-token blocks."""
    sets = {
        "data.packing": True,
        "data.seq_length": 1024,
        "train.micro_batch_size": mb,
        "deepspeed.zero_optimization.stage": stage,
        **kw.pop("sets", {}),
    }
    return Case(name, "gpt2-124m", sets, lengths="news", corpus_tokens=2_000_000, warmup=4, steps=15, **kw)


def llama(name: str, shape: str, mb: int, stage: int, ckpt: bool = False, seq: int = 2048, **kw) -> Case:
    """A text case of a Llama-like shape (long-tailed documents, packed, kept apart), Liger on."""
    sets = {
        "data.seq_length": seq,
        "train.micro_batch_size": mb,
        "deepspeed.zero_optimization.stage": stage,
        "model.liger_kernels": True,
        "model.gradient_checkpointing": ckpt,
        **kw.pop("sets", {}),
    }
    tokens = 2_500_000 if shape == "llama-1.1b" else 600_000
    return Case(name, shape, sets, corpus_tokens=tokens, **kw)


def chat_case(name: str, shape: str, mb: int, stage: int, lora: bool, runner: str = "app", **kw) -> Case:
    """Chat SFT on one GPU: synthetic multi-turn conversations (assets.chat_corpus), the zephyr template, loss on
    the assistant turns, whole conversations packed into 2048-token blocks, Liger on, weights from a safetensors
    folder (LoRA needs a base model; the peer loads the same folder), LoRA r=16 on every projection or all
    parameters. The same config file drives the app and TRL's SFTTrainer."""
    sets = {**ONE_GPU, "train.learning_rate": 2e-4, **CHAT, **(LORA if lora else {}), **kw.pop("sets", {})}
    case = llama(name, shape, mb, stage, runner=runner, lengths="chat", weights=True, sets=sets, **kw)
    return dataclasses.replace(case, corpus_tokens=700_000 if shape == "llama-1.1b" else 250_000)


def dpo_case(name: str, shape: str, mb: int, runner: str = "app", lora: bool = True, **kw) -> Case:
    """DPO with LoRA on one GPU (issue #51): assets.preference_corpus's pairs (UltraFeedback-like lengths, every pair
    more than half a 2048-token block: one pair a block, so the micro-batch is `mb` pairs on both sides), blocks of
    2048 (a pair's two sequences together: TRL's usual max_length of 1024 a sequence, as alignment-handbook's DPO
    recipes set it; TRL's max_length here is the same 2048 a sequence, which cuts none of them), Liger on, weights
    from a safetensors folder, lr 5e-6 (a LoRA DPO run's usual). The ZeRO stage, pure bf16, checkpointing and
    micro-batch are set (the app's auto settings refuse preference runs on GPUs: app.autoset has no memory model of
    the pairs' logits): stage 0 and pure bf16, the fast path on one GPU, no checkpointing. The same config file
    drives the app and TRL's DPOTrainer (runner trl-dpo). Full-parameter (`lora` false): lr 5e-7 (alignment-handbook's
    full DPO recipes), the reference's log-probabilities computed in a pass before training on both sides (the app's
    `reference: auto`, TRL's `precompute_ref_log_probs`), so neither holds a second model."""
    rate = {"train.learning_rate": 5e-6, **LORA_DPO} if lora else {"train.learning_rate": 5e-7}
    sets = {**ONE_GPU, **STAGE0, **DPO, **rate, **kw.pop("sets", {})}
    case = llama(name, shape, mb, 0, runner=runner, lengths="preference", weights=True, sets=sets, **kw)
    return dataclasses.replace(case, corpus_tokens=400_000 if shape == "llama-1.1b" else 150_000)


def defaults_case(shape: str, lora: bool, runner: str = "app", **kw) -> Case:
    """Chat SFT on one GPU as a user gets it: the workload alone (the shape with its weights, multi-turn chat data
    packed into 2048-token blocks, LoRA r=16 on every projection or all parameters, the learning rate) and every
    setting the app chooses left to it: ZeRO stage, pure bf16, checkpointing, Liger (auto) and the micro-batch (auto,
    so that both sides run the same workload: TRL's twin reads the same config and runs the app's micro-batch and
    checkpointing). The 8B full-parameter case trains at 2e-5 (at 2e-4 its losses rose) and saves synchronously."""
    short = {"llama-1.1b": "l1b", "llama-8b": "l8b", "qwen2-0.5b": "q05", "qwen3-1.7b": "q3-17"}[shape]
    name = f"{'trl-' if runner == 'trl' else ''}defaults-chat-{short}-{'lora' if lora else 'full'}"
    full_8b = shape == "llama-8b" and not lora
    sets = {**ONE_GPU, **CHAT, **(LORA if lora else {}), "data.seq_length": 2048, "train.micro_batch_size": "auto"}
    sets |= {"train.learning_rate": 2e-5 if full_8b else 2e-4, **({"checkpoint.async_save": False} if full_8b else {})}
    sets |= kw.pop("sets", {})
    tokens = {"llama-1.1b": 700_000, "llama-8b": 250_000, "qwen2-0.5b": 700_000, "qwen3-1.7b": 700_000}[shape]
    return Case(name, shape, sets, runner, lengths="chat", corpus_tokens=tokens, weights=True, auto=True, **kw)


def defaults_pair(shape: str, lora: bool, **kw) -> list[Case]:
    """The app's defaults case, TRL's twin on the same config, and TRL again with checkpointing should the twin run
    out of memory (TRL's activations are not the app's: the app's choice may not fit it)."""
    twin = defaults_case(shape, lora, "trl", **kw)
    spare = dataclasses.replace(
        twin, name=twin.name + "-ckpt", sets={**twin.sets, "model.gradient_checkpointing": True}, fallback_for=twin.name
    )
    return [defaults_case(shape, lora, **kw), twin, spare]


def profiled(case: Case) -> Case:
    """`case` with one timed step profiled (app/profiling.py: where its time goes), which then goes untimed: one
    more step is run."""
    return dataclasses.replace(case, steps=case.steps + 1, env={**case.env, profiling.STEP_ENV: str(case.warmup + 2)})


def again(case: Case, **kw) -> Case:
    """The same case run a second time in the call: the data tokenized and the compile caches filled by the first."""
    return dataclasses.replace(case, name=case.name + "-again", **kw)


def save_case(name: str, shape: str, mb: int, every: int, background: bool, **kw) -> Case:
    """One periodic save measured (the loop's stall, the write, the bytes), then the run ended. The first background
    save comes late enough for the host buffers (reserved after the first step) to be ready; the corpus is long
    enough that the run keeps training while the save is written."""
    sets = {
        "checkpoint.every_steps": every,
        "checkpoint.async_save": background,
        "checkpoint.keep": 3,
        "train.max_steps": 100_000,
    }
    case = llama(name, shape, mb, 3, saves=1, sets=sets, **kw)
    return dataclasses.replace(case, corpus_tokens=4_000_000 if shape == "llama-1.1b" else 2_500_000)


CPU = {"scaling.use_gpu": False, "scaling.cpus_per_worker": 1}
TINY = {"data.seq_length": 128, "train.micro_batch_size": 2}
SMOKE = {"corpus_tokens": 50_000, "warmup": 1, "steps": 3}
SMOKE_DPO = {**DPO, **LORA_DPO, "data.seq_length": 256, "train.micro_batch_size": 2, "train.learning_rate": 1e-3}


# The Llama 1.1B text case on one GPU (ZeRO-3 then partitions nothing: the model, kernels, packing and loop), and
# Hugging Face Trainer given the same Liger-patched model, ds_config, data and packed batches.
L1B_1GPU = llama("l1b-z3-mb16-1gpu", "llama-1.1b", 16, 3, sets=ONE_GPU, estimate=75)
HF_L1B_1GPU = llama("hf-liger-l1b-z3-mb16-1gpu", "llama-1.1b", 16, 3, runner="hf", sets=ONE_GPU)
L1B_1GPU_FP8 = llama("l1b-z3-mb16-1gpu-fp8", "llama-1.1b", 16, 3, sets={**ONE_GPU, **FP8}, estimate=90)
# Full-parameter chat SFT of the 1.1B against TRL: stage 0, pure bf16 with FP8 matmuls (the MLPs, each one function).
CHAT_L1B_FP8 = chat_case(
    "chat-l1b-full-z0-pure-fp8", "llama-1.1b", 8, 0, False, sets={**STAGE0, **FP8}, estimate=95, timeout=180
)
TRL_L1B = chat_case("trl-chat-l1b-full", "llama-1.1b", 8, 3, False, runner="trl", estimate=45, timeout=180)
CHAT_L8B = chat_case(
    "chat-l8b-full-z0-pure",
    "llama-8b",
    4,
    0,
    False,
    sets={**STAGE0, **FULL_8B, "checkpoint.async_save": False},
    estimate=150,
    **EIGHT_B,
)

# The Start-up table's cases, run first in the defaults suite.
STARTUP = [L1B_1GPU, HF_L1B_1GPU, again(L1B_1GPU), again(HF_L1B_1GPU)]


def long_case(seq: int, runner: str = "app", long: Any = "auto", tag: str = "", lora: bool = True, **kw) -> Case:
    """Chat SFT of the Llama-3-8B shape (its context extended to 2^20 positions) with LoRA r=16 (or, `lora` false,
    every parameter at lr 2e-5, "-full" in the name), micro-batch 1, activation checkpointing, pure bf16 at stage 0
    and Liger, conversations packed into blocks of `seq` tokens (kept apart: each attends within itself). `long`:
    model.long_sequence (auto: app/resolve.py chooses, from the GPU's memory and this machine's). The chat corpus
    holds a block for every step and a spare: a block takes whole conversations of at most assets.CHAT_MAX tokens,
    hundreds of them at 512k."""
    steps = kw.pop("steps", 2)
    warmup = kw.pop("warmup", 1)
    sets = {**STAGE0, "model.long_sequence": long} if runner == "app" else {**STAGE0}
    if not lora:
        sets["train.learning_rate"] = 2e-5
    prefix = "trl-" if runner == "trl" else ""
    name = f"{prefix}long-l8b-{seq // 1024}k{'' if lora else '-full'}{tag}"
    case = chat_case(name, "llama-8b-1m", 1, 0, lora, runner=runner, ckpt=True, seq=seq, sets=sets, **kw)
    return dataclasses.replace(case, warmup=warmup, steps=steps, corpus_tokens=int(seq * (warmup + steps + 2) * 1.1))


# The 8B's LoRA at 32k with model.long_sequence off and with every switch on (the tiled MLP and loss, every layer's
# checkpoint offloaded: their cost at a length auto leaves them off, at most 10% of the step by issue #52), then
# auto at 128k, 256k and 512k (on one 141 GB H200 and a 128 GiB host: off, tiles, tiles and 23 layers offloaded),
# and TRL at 128k and 256k.
OFF = {"tiled_mlp": False, "tiled_loss": False, "offload_checkpoints": False}
ON = {"tiled_mlp": True, "tiled_loss": True, "offload_checkpoints": True}
LONG = [
    long_case(32_768, long=OFF, tag="-off", steps=4, estimate=150, timeout=300),
    long_case(32_768, long=ON, tag="-on", steps=4, estimate=150, timeout=300),
    long_case(131_072, estimate=200, timeout=400),
    long_case(262_144, estimate=300, timeout=500),
    # Two steps trained (the first untimed): at 512k a step took 104 s and 267 s on one H200 (2026-12-05), so the
    # case outlasts one call's 600 s with its set-up; device_run.sh runs it in the background across two calls.
    long_case(524_288, steps=1, estimate=400, timeout=560),
    # The longest on one 80 GB H100 with a 128 GiB host (benchmarks/longest.py: 27 of 32 layers offloaded), two
    # steps.
    long_case(327_680, steps=1, estimate=330, timeout=480),
    long_case(131_072, runner="trl", estimate=200, timeout=400),
    long_case(262_144, runner="trl", estimate=300, timeout=500),
    # Full-parameter (the AdamW states in bf16 on the GPU: 45 GiB with the weights): the memory model predicts the
    # tiles and 8 layers' checkpoints offloaded at 256k, 26 layers (104 GiB of the 128 GiB host) at 512k.
    long_case(262_144, lora=False, estimate=300, timeout=480),
    long_case(524_288, lora=False, estimate=400, timeout=440),
]

SUITES: dict[str, list[Case]] = {
    # The tutorial's configuration against the same texts packed (2 x H200).
    "tutorial": [tutorial(), gpt2("gpt2-z2-mb16", 16, 2, estimate=80)],
    # Text, 1 x H200: the app in bf16 (tokenizing the corpus first, then again) and with model.fp8 against
    # Trainer + Liger. device_run.sh runs check_varlen.py first.
    "trainer": [L1B_1GPU, HF_L1B_1GPU, again(L1B_1GPU), L1B_1GPU_FP8],
    # Text, 2 x H200 (record 2026-11-30-q-fp8.jsonl, then suite fp8): the 8B and the 1.1B with model.fp8, Trainer +
    # Liger beside each, then the app in bf16.
    "trainer-2gpu": [
        llama("l8b-z3-mb4-fp8", "llama-8b", 4, 3, sets=FP8, warmup=2, steps=5, estimate=130),
        llama("hf-liger-l8b-z3-mb4", "llama-8b", 4, 3, runner="hf", warmup=2, steps=5, estimate=60),
        llama("l1b-z3-mb16-fp8", "llama-1.1b", 16, 3, sets=FP8, estimate=90),
        llama("hf-liger-l1b-z3-mb16", "llama-1.1b", 16, 3, runner="hf", estimate=35),
        llama("l8b-z3-mb4", "llama-8b", 4, 3, warmup=2, steps=5, estimate=100),
        llama("l1b-z3-mb16", "llama-1.1b", 16, 3, estimate=70),
    ],
    # Chat SFT against TRL's SFTTrainer (1 x H200): the 1.1B full-parameter with model.fp8 (first on the machine,
    # compiling its kernels, then 20 timed steps) and LoRA, the Qwen2-0.5B shape full-parameter in bf16 (its large
    # vocabulary on a small model), each beside TRL.
    "trl": [
        CHAT_L1B_FP8,
        dataclasses.replace(CHAT_L1B_FP8, name=CHAT_L1B_FP8.name + "-20", steps=20),
        dataclasses.replace(TRL_L1B, name=TRL_L1B.name + "-20", steps=20),
        profiled(chat_case("chat-l1b-lora-z0-pure", "llama-1.1b", 8, 0, True, sets=STAGE0, estimate=90, timeout=180)),
        chat_case("trl-chat-l1b-lora", "llama-1.1b", 8, 3, True, runner="trl", estimate=45, timeout=180),
        chat_case("chat-q05-full-z0-pure", "qwen2-0.5b", 8, 0, False, sets=STAGE0, estimate=60, timeout=180),
        chat_case("chat-q05-full-z0-pure-20", "qwen2-0.5b", 8, 0, False, sets=STAGE0, steps=20, estimate=60),
        chat_case("trl-chat-q05-full-20", "qwen2-0.5b", 8, 3, False, runner="trl", steps=20, estimate=40),
        # DPO (issue #51 item 6) against TRL's DPOTrainer: the 1.1B with LoRA and full-parameter, 8 pairs a step, then
        # the 8B's LoRA (its weights, 16 GB, written first), 4 pairs a step; each pair in one call (docs/benchmarks.md).
        dpo_case("dpo-l1b-lora-z0-pure", "llama-1.1b", 8, estimate=90, timeout=180),
        dpo_case("trl-dpo-l1b-lora", "llama-1.1b", 8, runner="trl-dpo", estimate=60, timeout=180),
        # The full-parameter pair profiled (one extra step each): where the app's step goes against TRL's.
        profiled(dpo_case("dpo-l1b-full-z0-pure", "llama-1.1b", 8, lora=False, estimate=100, timeout=180)),
        profiled(dpo_case("trl-dpo-l1b-full", "llama-1.1b", 8, runner="trl-dpo", lora=False, estimate=80, timeout=180)),
        dpo_case("dpo-l8b-lora-z0-pure", "llama-8b", 4, **LORA_8B, estimate=150, timeout=300),
        dpo_case("trl-dpo-l8b-lora", "llama-8b", 4, runner="trl-dpo", **LORA_8B, estimate=190, timeout=300),
        # The 8B full-parameter pair: weights, gradients and AdamW states in bf16 take 64 GB, so both sides check-
        # point activations; the reference stored by a pass before training, as the 1.1B's.
        dpo_case("dpo-l8b-full-z0-pure", "llama-8b", 4, lora=False, ckpt=True, **FULL_DPO_8B),
        dpo_case("trl-dpo-l8b-full", "llama-8b", 4, runner="trl-dpo", lora=False, ckpt=True, **FULL_DPO_8B),
    ],
    # The 8B shape against TRL (1 x H200; its weights folder, 16 GB, is written first): full-parameter with
    # model.fp8 and in bf16, then LoRA.
    "trl-8b": [
        dataclasses.replace(CHAT_L8B, name=CHAT_L8B.name + "-fp8", sets={**CHAT_L8B.sets, **FP8}, estimate=170),
        chat_case("trl-chat-l8b-full", "llama-8b", 4, 3, False, runner="trl", sets=FULL_8B, estimate=120, **EIGHT_B),
        CHAT_L8B,
        chat_case("trl-chat-l8b-lora", "llama-8b", 4, 3, True, runner="trl", **LORA_8B, estimate=190, timeout=300),
        chat_case("chat-l8b-lora-z0-pure", "llama-8b", 4, 0, True, sets=STAGE0, **LORA_8B, estimate=110),
    ],
    # The shipped defaults against TRL (1 x H200, issue #50): chat SFT, full-parameter and LoRA, of the Qwen2-0.5B,
    # Llama 1.1B and Llama-3-8B shapes, each beside TRL's SFTTrainer on the same config; every app case sets nothing
    # the app chooses ("defaults": true in its record, "resolved" what it chose). The 8B's weights (16 GB) last.
    # First, launch to first step phase by phase (the Start-up table, once a suite of its own): each side first on
    # the machine (the app tokenizing the corpus, the compile caches cold), then each again with the data tokenized
    # and its compile cache warm.
    "defaults": [
        *STARTUP,
        *defaults_pair("qwen2-0.5b", False, estimate=60, timeout=180),
        *defaults_pair("qwen2-0.5b", True, estimate=60, timeout=180),
        *defaults_pair("llama-1.1b", False, estimate=90, timeout=180),
        *defaults_pair("llama-1.1b", True, estimate=90, timeout=180),
        *defaults_pair("llama-8b", False, estimate=170, timeout=300, **EIGHT_B_STEPS),
        *defaults_pair("llama-8b", True, estimate=190, timeout=300, **LORA_8B),
        # A shape no case above tuned the app on (issue #60 item 2): Qwen3-1.7B's q/k norms, 128-wide heads and large
        # vocabulary, full-parameter and LoRA, each beside TRL.
        *defaults_pair("qwen3-1.7b", False, estimate=90, timeout=180),
        *defaults_pair("qwen3-1.7b", True, estimate=90, timeout=180),
    ],
    # Long sequences on one GPU (1 x H200, issue #52): the Llama-3-8B shape's chat LoRA, one packed block a step,
    # beside TRL's SFTTrainer; each row records peak GPU memory, the worker's peak host memory (RSS) and step time.
    "long": LONG,
    # A periodic save in the background (the default) and synchronously, 1.1B and 8B, ZeRO-3 on 2 x H200.
    "ckpt": [
        save_case("l1b-ckpt-async", "llama-1.1b", 16, every=30, background=True, estimate=90, timeout=170),
        save_case("l8b-ckpt-async", "llama-8b", 4, every=70, background=True, estimate=230, timeout=320),
        save_case("l8b-ckpt-sync", "llama-8b", 4, every=15, background=False, estimate=150, timeout=240),
        save_case("l1b-ckpt-sync", "llama-1.1b", 16, every=10, background=False, estimate=60, timeout=150),
    ],
    # FP8 against bf16 under the layer rule (1 x H200): the Qwen2-0.5B shape (nothing converts) and the 1.1B (its
    # MLPs convert). device_run.sh runs fp8_shapes.py first: each projection shape timed in bf16 and FP8.
    "fp8": [
        llama("q05-z3-mb16-1gpu", "qwen2-0.5b", 16, 3, sets=ONE_GPU, estimate=80),
        llama("q05-z3-mb16-1gpu-fp8", "qwen2-0.5b", 16, 3, sets={**ONE_GPU, **FP8}, estimate=80),
        L1B_1GPU,
        L1B_1GPU_FP8,
    ],
    # Llama-3-8B on one GPU: ZeRO-3 with the optimizer (fp32 master weights and Adam moments) in CPU memory, as
    # examples/llama-8b-1gpu-offload.yaml (the CPU update once per 8 micro-batches).
    "offload": [
        llama(
            "l8b-offload-1gpu",
            "llama-8b",
            4,
            3,
            ckpt=True,
            warmup=1,
            steps=2,
            estimate=300,
            timeout=480,
            sets={
                "scaling.num_workers": 1,
                "scaling.cpus_per_worker": 30,
                "train.gradient_accumulation_steps": 8,
                "deepspeed.zero_optimization.offload_optimizer": {"device": "cpu", "pin_memory": True},
            },
        )
    ],
}

# Not a table of the docs: the CPU plumbing check of the harness (2 CPU workers, tiny shapes; every runner and the
# checkpoint path once), run by tests/test_bench.py and as `--suite smoke`.
PLUMBING: dict[str, list[Case]] = {
    "smoke": [
        Case(
            "smoke-tutorial",
            "tiny-gpt2",
            {**CPU, "data.packing": False, "data.seq_length": 64, "train.micro_batch_size": 1},
            lengths="news",
            **SMOKE,
        ),
        Case("smoke-llama-z2", "tiny-llama", {**CPU, **TINY, "deepspeed.zero_optimization.stage": 2}, **SMOKE),
        Case("smoke-llama-z3-ckpt", "tiny-llama", {**CPU, **TINY}, checkpoint=True, **SMOKE),
        Case("smoke-hf-z3", "tiny-llama", {**CPU, **TINY}, runner="hf", **SMOKE),
        # DPO with LoRA: the app (2 workers, ZeRO-3) and TRL's DPOTrainer (one process) on the same tiny pairs.
        Case("smoke-dpo-lora", "tiny-llama", {**CPU, **SMOKE_DPO}, lengths="preference", weights=True, **SMOKE),
        Case(
            "smoke-trl-dpo",
            "tiny-llama",
            {**CPU, **SMOKE_DPO, **ONE_GPU},
            runner="trl-dpo",
            lengths="preference",
            weights=True,
            **SMOKE,
        ),
    ],
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
    elif case.lengths == "preference":  # pairs for blocks of the case's length
        corpus = assets.preference_corpus(work, shape.vocab, case.corpus_tokens, case.sets["data.seq_length"])
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
    if not case.auto:  # what the suites measured before "auto" existed (runner.Case.auto)
        for key, value in BEFORE_AUTO.items():
            if get_dotted(doc, key) in (None, "auto"):
                set_dotted(doc, key, value)
    return doc, shape


def get_dotted(doc: dict[str, Any], key: str) -> Any:
    node: Any = doc
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def ran_defaults(doc: dict[str, Any]) -> bool:
    """Whether a case's config sets none of the settings the app chooses (each absent, or auto): the shipped
    defaults, for the records' "defaults"."""
    return all(get_dotted(doc, key) in (None, "auto") for key in AUTO_FIELDS)


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
    p.add_argument(
        "--suite", required=True, choices=[*SUITES, *PLUMBING], help="one table of docs/benchmarks.md (or smoke)"
    )
    p.add_argument("--only", default="", help="comma-separated case names to run (default: all)")
    p.add_argument("--out", required=True, help="folder for results.jsonl, summary.txt and logs.txt")
    p.add_argument("--work", default="/tmp/finetune-bench", help="scratch folder: models, corpora, storage")
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip cases that would end after this many seconds")
    p.add_argument(
        "--gpu-memory",
        type=parse_memory,
        help="record the auto settings as chosen for GPUs of this memory, e.g. 140GiB (default: this machine's GPUs, "
        "as finetune train reads them)",
    )
    args = p.parse_args(argv)

    t0 = time.time()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    cases = list({**SUITES, **PLUMBING}[args.suite])
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
            row.update(_knobs(doc, shape, cfg_path, case.runner, args.gpu_memory))
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
                if case.lengths == "preference" and row.get("step_s"):  # one pair a block: assets.preference_pair
                    row["pairs_per_s_per_gpu"] = round(row["micro_batch"] * row["grad_accum"] / row["step_s"], 2)
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


def _knobs(
    doc: dict[str, Any], shape: assets.Shape, cfg_path: Path, runner: str, gpu_memory: int | None = None
) -> dict[str, Any]:
    from app import config as config_mod
    from app import driver

    # The auto settings as `finetune train` chooses them on this machine's GPUs (or for --gpu-memory).
    settled = settled_config(config_mod.resolve(config_mod.load(cfg_path)), gpu_memory)
    if settled.problems:
        raise ConfigError(settled.problems)
    cfg = settled.config
    workers = cfg.scaling.num_workers
    ds, _ = driver.check(cfg)  # what the app hands the workers (and hf_trainer builds the same way)
    return {
        "defaults": ran_defaults(doc),
        "resolved": {key: ("auto" if key in settled.standing_in else v) for key, v in settled.values.items()},
        "workers": workers,
        "stage": cfg.zero_stage,
        "micro_batch": cfg.train.micro_batch_size,
        "grad_accum": cfg.train.gradient_accumulation_steps,
        "seq": cfg.data.seq_length,
        "packing": cfg.data.packing,
        "liger": cfg.model.liger_kernels,
        "pure_bf16": cfg.train.pure_bf16,
        "compile": cfg.model.compile,
        "act_ckpt": cfg.model.gradient_checkpointing,
        "long_sequence": cfg.model.long_sequence
        if isinstance(cfg.model.long_sequence, str)
        else (cfg.model.long_sequence.model_dump()),
        "offload": bool(ds["zero_optimization"].get("offload_optimizer")),
        "ds_config": ds,
        "lora": cfg.model.lora.model_dump() if cfg.model.lora else None,
        "format": cfg.data.format,
        "method": method_of(cfg),  # sft, or the preference loss (dpo, ...): peer_table pairs within a method
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
        f"mem {r.get('peak_mem_gib')} GiB  host {r.get('peak_host_gib')} GiB  "
        f"first step {r.get('time_to_first_step_s')}s  wall {r.get('wall_s')}s"
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
    """Each app chat or preference case against the TRL cases of its shape, kind (LoRA or full) and method (SFT, DPO:
    a DPO case is never compared with an SFT one): tokens/s ratio (and pairs/s for preference runs), memory, the first
    and last losses of both and, for preference runs, the mean reward accuracy over the timed steps of both."""
    done = [r for r in results if r.get("format") in ("chat", "preference") and r.get("tokens_per_s_per_gpu")]
    lines = []
    for app in (r for r in done if r["runner"] == "app"):
        for peer in (r for r in done if r["runner"].startswith("trl") and r["shape"] == app["shape"]):
            if bool(peer.get("lora")) != bool(app.get("lora")) or peer.get("method", "sft") != app.get("method", "sft"):
                continue
            ratio = app["tokens_per_s_per_gpu"] / peer["tokens_per_s_per_gpu"]
            pairs = [x.get("pairs_per_s_per_gpu") for x in (app, peer)]
            by_pairs = f"{pairs[0] / pairs[1]:.2f}x" if all(pairs) else "-"
            losses = [f"{x['losses'][0]}->{x['losses'][-1]}" if x.get("losses") else "-" for x in (app, peer)]
            accuracy = " / ".join(timed_mean(x, "rewards/accuracies") for x in (app, peer))
            lines.append(
                f"| {app['case']} | {peer['case']} | {app.get('method', 'sft')} | {ratio:.2f}x | {by_pairs} | "
                f"{app.get('peak_mem_gib')} | {peer.get('peak_mem_gib')} | {losses[0]} | {losses[1]} | {accuracy} |"
            )
    if not lines:
        return ""
    head = (
        "| app case | TRL case | method | app/TRL tok/s | app/TRL pairs/s | app GiB | TRL GiB | app loss first->last "
        "| TRL loss first->last | reward acc. app / TRL |"
    )
    return "\n" + "\n".join([head, "|---|---|---|---|---|---|---|---|---|---|", *lines]) + "\n"


def timed_mean(r: dict[str, Any], name: str) -> str:
    """The mean of a logged metric over a record's timed steps (the app: those after its warm-up; TRL: the windows
    its clock timed), or '-'."""
    values = (r.get("metrics") or {}).get(name) or []
    timed = values[len(values) - r.get("steps_timed", 0) :] if r.get("steps_timed") else values
    return f"{sum(timed) / len(timed):.3f}" if timed else "-"


if __name__ == "__main__":
    sys.exit(main())
