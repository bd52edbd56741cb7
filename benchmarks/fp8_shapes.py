"""Which linear layers gain from FP8: each distinct projection of the Qwen2-0.5B, Llama 1.1B and Llama-3-8B shapes,
forward and backward at the tokens per micro-batch the benchmarks train with, in bf16 (torch.nn.Linear) and through
the app's own FP8 path (app.model.convert_to_fp8: torchao's float8 training, casts compiled). One GPU. Each layer is
timed alone (wall clock: the host's dispatch and the GPU's kernels, whichever is longer) and profiled (the GPU's
kernel time alone).

    python -m benchmarks.fp8_shapes --out OUT/fp8_shapes.json

The rule in app.model.fp8_pays is derived from these figures (docs/benchmarks.md has them).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

# (shape in benchmarks.assets.SHAPES, tokens per micro-batch), most needed first: the deadline cuts the tail.
# 32,768 tokens is the text cases' 16 x 2048, 16,384 the 1.1B chat cases' 8 x 2048, 8,192 the 8B's 4 x 2048.
RUNS = [("qwen2-0.5b", 32768), ("llama-1.1b", 16384), ("llama-1.1b", 32768), ("llama-8b", 8192), ("qwen2-0.5b", 8192)]


def projections(shape: str) -> list[tuple[str, int, int, bool]]:
    """One decoder layer's distinct projections, (names, in_features, out_features, bias), read off the shape's
    meta-device model: the layers app.model.fp8_linears offers for conversion."""
    from app.model import fp8_linears, meta_model
    from benchmarks.assets import SHAPES

    model = meta_model(SHAPES[shape].hf_config())
    first = {id(m): name.rsplit(".", 1)[-1] for name, m in model.model.layers[0].named_modules()}
    found: dict[tuple[int, int, bool], list[str]] = {}
    for layer in fp8_linears(model):
        if id(layer) in first:
            key = (layer.in_features, layer.out_features, layer.bias is not None)
            found.setdefault(key, []).append(first[id(layer)])
    return [("/".join(names), *key) for key, names in found.items()]


def time_fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, iters: int) -> float:
    """Milliseconds per forward + backward (input and weight gradients), after warm-up (compilation)."""
    for _ in range(3):
        layer(x).backward(grad)
    _sync(x)
    started = time.perf_counter()
    for _ in range(iters):
        layer(x).backward(grad)
    _sync(x)
    return (time.perf_counter() - started) * 1000 / iters


def gpu_ms(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, iters: int = 5) -> float:
    """Milliseconds a forward + backward keeps the GPU busy (kernel time, app.profiling): what the layer costs
    when the host runs ahead of the GPU, as it does in a step that is GPU-bound."""
    from app import profiling

    with profiling.profile(True) as summary:
        for _ in range(iters):
            layer(x).backward(grad)
    return summary["gpu_busy_ms"] / iters


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize()


def measure(tokens: int, in_features: int, out_features: int, bias: bool, iters: int, device: str) -> dict:
    from app.model import convert_to_fp8

    torch.manual_seed(0)
    bf16 = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=bias)).to(device, torch.bfloat16)
    fp8 = copy.deepcopy(bf16)
    convert_to_fp8(fp8, [fp8[0]], compiled=device == "cuda")
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)
    compile_started = time.time()
    fp8(x).backward(grad)
    _sync(x)
    compile_s = time.time() - compile_started
    ms_bf16, ms_fp8 = time_fwd_bwd(bf16, x, grad, iters), time_fwd_bwd(fp8, x, grad, iters)
    flops = 6 * tokens * in_features * out_features
    gpu = (
        {f"{name}_gpu_ms": round(gpu_ms(m, x, grad), 3) for name, m in (("bf16", bf16), ("fp8", fp8))}
        if x.is_cuda
        else {}
    )
    return {
        "bf16_ms": round(ms_bf16, 3),
        "fp8_ms": round(ms_fp8, 3),
        "fp8_speedup": round(ms_bf16 / ms_fp8, 3),
        **gpu,
        "bf16_tflops": round(flops / ms_bf16 / 1e9, 1),
        "fp8_first_call_s": round(compile_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--deadline-s", type=float, default=150, help="stop measuring after this many seconds")
    parser.add_argument("--tokens-scale", type=float, default=1.0, help="scale the token counts (CPU smoke runs)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only checks the plumbing (FP8 is emulated)")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 256  # one graph per measured shape
    started, rows = time.time(), []
    for model, tokens in RUNS:
        tokens = max(16, int(tokens * args.tokens_scale))
        for name, fan_in, fan_out, bias in projections(model):
            if time.time() - started > args.deadline_s:
                break
            row = {"model": model, "tokens": tokens, "proj": name, "in": fan_in, "out": fan_out, "bias": bias}
            row.update(measure(tokens, fan_in, fan_out, bias, args.iters, args.device))
            print(json.dumps(row), flush=True)
            rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": _device_name(args.device), "rows": rows}, indent=1))


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else device


if __name__ == "__main__":
    main()
