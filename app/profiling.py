"""Where one training step's time goes: the step under torch's profiler, summarised by kind of GPU work (matmuls,
attention, Liger's kernels, optimizer, copies, communication, other) against the step's wall time, the rest being
the time the GPU sat idle (host syncs, Python, hooks, the loader). The host's side too: the ops and CUDA calls
that took the most host time, and where the loop's Python stack was, sampled every few milliseconds (time in Python
or in a C call that no op records, a lock for one, shows only there).

A diagnostic for performance work, off unless `FINETUNE_PROFILE_STEP=N` is set in the training processes'
environment: rank 0 profiles optimizer step N and writes the summary as a `profile` record to metrics.jsonl (the
benchmark harness reads it, and leaves that step out of its timings: the profiler slows it). The same summary
serves the benchmarks' peers (benchmarks/trl_sft.py, benchmarks/hf_trainer.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

STEP_ENV = "FINETUNE_PROFILE_STEP"

# Kernel-name fragments by kind, first match wins (cuBLAS/CUTLASS GEMMs, FlashAttention, Liger's Triton kernels,
# torch's multi-tensor optimizers, NCCL); lower case.
KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("liger", ("rms_norm", "swiglu", "rope", "cross_entropy", "element_mul", "liger")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("copy", ("memcpy", "memset", "copy", "catarray", "fill", "index")),
)
# Host calls that wait for the GPU: time the loop spends in them is time it launches nothing.
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def profiled_step() -> int | None:
    value = os.environ.get(STEP_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, parts in KINDS if any(p in name for p in parts)), "other")


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: time at least one kernel ran."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def summarise(events: list[Any], wall_s: float, top: int = 12) -> dict[str, Any]:
    """The summary of a profiled span from torch's `profile.events()`: GPU time by kind and by kernel (ms), the
    union of kernel time (busy), wall minus busy (idle), host time spent waiting in syncs, and the host-side ops
    and CUDA calls by their own (self) time."""
    from torch.autograd import DeviceType

    kinds: dict[str, float] = {}
    kernels: dict[str, float] = {}
    host: dict[str, float] = {}
    intervals, sync_us = [], 0.0
    for e in events:
        # A record_function range (the optimizer's "Optimizer.step#AdamW.step") also lands on the GPU's timeline,
        # spanning the kernels it launched: counted, it doubled the optimizer's time.
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            us = e.time_range.end - e.time_range.start
            kinds[kind_of(e.name)] = kinds.get(kind_of(e.name), 0.0) + us
            kernels[e.name] = kernels.get(e.name, 0.0) + us
            intervals.append((e.time_range.start, e.time_range.end))
            continue
        if e.name in SYNCS:
            sync_us += e.time_range.end - e.time_range.start
        if e.device_type == DeviceType.CPU:
            host[e.name] = host.get(e.name, 0.0) + getattr(e, "self_cpu_time_total", 0.0)
    busy_ms = _busy_us(intervals) / 1e3
    heaviest = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    host_heaviest = sorted(host.items(), key=lambda kv: -kv[1])[:top]
    return {
        "wall_ms": round(wall_s * 1e3, 1),
        "gpu_busy_ms": round(busy_ms, 1),
        "gpu_idle_ms": round(max(wall_s * 1e3 - busy_ms, 0.0), 1),
        "host_sync_wait_ms": round(sync_us / 1e3, 1),
        "kernels": len(intervals),
        "by_kind_ms": {k: round(v / 1e3, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": [[name[:120], round(us / 1e3, 1)] for name, us in heaviest],
        "host_ops_ms": [[name[:120], round(us / 1e3, 1)] for name, us in host_heaviest],
    }


class StackSampler:
    """Where one thread's Python stack is, every `interval_s`: the innermost `depth` frames of each sample,
    counted. Host time that no op records (Python between ops, a C call waiting on a lock) shows up here."""

    def __init__(self, thread_id: int, interval_s: float = 0.002, depth: int = 5):
        self.thread_id, self.interval_s, self.depth = thread_id, interval_s, depth
        self.counts: dict[str, int] = {}
        self.samples, self.span_s = 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.span_s = time.perf_counter() - self._started

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            parts = []
            while frame is not None and len(parts) < self.depth:
                code = frame.f_code
                parts.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
                frame = frame.f_back
            key = " < ".join(parts)
            self.counts[key] = self.counts.get(key, 0) + 1
            self.samples += 1

    def top(self, n: int = 10) -> list[list[Any]]:
        """[[stack, ms], ...], heaviest first; a stack's ms is its share of the samples times the span."""
        per_sample_ms = self.span_s * 1e3 / self.samples if self.samples else 0.0
        heaviest = sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]
        return [[stack, round(count * per_sample_ms, 1)] for stack, count in heaviest]


def headline(summary: dict[str, Any]) -> str:
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in summary["by_kind_ms"].items())
    return (
        f"{summary['wall_ms']:.0f} ms wall, GPU busy {summary['gpu_busy_ms']:.0f} ms, idle {summary['gpu_idle_ms']:.0f}"
        f" ms (host waits {summary['host_sync_wait_ms']:.0f} ms); by kind, ms: {kinds}"
    )


@contextlib.contextmanager
def profile(enabled: bool) -> Iterator[dict[str, Any]]:
    """Profile the block when `enabled`; the summary lands in the yielded dict once the block is over."""
    out: dict[str, Any] = {}
    if not enabled:
        yield out
        return
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sampler = StackSampler(threading.get_ident())
    with torch.profiler.profile(activities=activities, acc_events=True) as prof:  # one span: no cycle warning
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        with sampler:
            yield out
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        wall = time.perf_counter() - started
    out.update(summarise(list(prof.events()), wall))
    out["host_stacks_ms"] = sampler.top()


class StepProfiler:
    """Profiles optimizer step `at` and hands its summary to `metrics.profile` (rank 0's MetricsLogger)."""

    def __init__(self, at: int | None, metrics: Any):
        self.at, self.metrics = (at, metrics) if metrics is not None else (None, None)

    @classmethod
    def of(cls, rank: int, metrics: Any) -> StepProfiler:
        return cls(profiled_step() if rank == 0 else None, metrics)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        with profile(step == self.at) as summary:
            yield
        if summary:
            self.metrics.profile(step, summary)


OFF = StepProfiler(None, None)
