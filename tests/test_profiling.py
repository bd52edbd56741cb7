"""The step profiler's summary (app/profiling.py): kernel kinds, busy time as a union of intervals, and the
profiler handing one step's summary to the metrics logger."""

from __future__ import annotations

import time

import torch

from app import profiling


def test_kernel_names_fall_into_kinds():
    cases = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
        "nvjet_tst_192x192_64x3_1x2_h_bz_coopB_TNN": "matmul",
        "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>": "attention",
        "_rms_norm_backward_kernel": "liger",
        "liger_cross_entropy_kernel": "liger",
        "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor>": "optimizer",
        "Memcpy DtoH (Device -> Pinned)": "copy",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "communication",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>": "other",
    }
    assert {name: profiling.kind_of(name) for name in cases} == cases


def test_busy_time_counts_overlapping_kernels_once():
    assert profiling._busy_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert profiling._busy_us([]) == 0


def test_the_profiled_step_alone_reaches_the_metrics_logger(monkeypatch):
    class Sink:
        def __init__(self):
            self.got = []

        def profile(self, step, summary):
            self.got.append((step, summary))

    sink = Sink()
    monkeypatch.setenv(profiling.STEP_ENV, "2")
    profiler = profiling.StepProfiler.of(0, sink)
    assert profiling.StepProfiler.of(1, sink).at is None  # rank 0 only
    for step in (1, 2, 3):
        with profiler.step(step):
            torch.randn(64, 64) @ torch.randn(64, 64)
    assert [step for step, _ in sink.got] == [2]
    summary = sink.got[0][1]
    assert summary["wall_ms"] > 0 and summary["gpu_busy_ms"] == 0 and set(summary) >= {"by_kind_ms", "top_kernels_ms"}
    assert "wall" in profiling.headline(summary)
    monkeypatch.setenv(profiling.STEP_ENV, "soon")
    assert profiling.profiled_step() is None


def test_gpu_side_annotations_are_not_kernels():
    """torch's optimizers wrap step() in a record_function, which the profiler also puts on the GPU timeline over
    the kernels it launched: the summary counts the kernels once and the annotation not at all."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, start, end, annotation=False):
        span = SimpleNamespace(start=start, end=end)
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, time_range=span, is_user_annotation=annotation)

    events = [
        event("Optimizer.step#ClippingAdamW.step", 0, 9000, annotation=True),
        event("void multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", 1000, 6000),
        event("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 10000, 12000),
    ]
    summary = profiling.summarise(events, wall_s=0.012)
    assert summary["by_kind_ms"] == {"optimizer": 5.0, "matmul": 2.0}
    assert summary["kernels"] == 2 and summary["gpu_busy_ms"] == 7.0
    assert all("Optimizer.step" not in name for name, _ in summary["top_kernels_ms"])


def test_the_sampler_finds_where_the_thread_spends_its_time():
    """Host time outside any op (here a sleep standing for a lock or a slow Python call) shows in the stacks."""
    import threading

    def waits_on_something():
        time.sleep(0.2)

    with profiling.StackSampler(threading.get_ident(), interval_s=0.005) as sampler:
        waits_on_something()
        sum(range(10))
    (stack, ms), *_ = sampler.top()
    assert stack.startswith("test_profiling.py:waits_on_something:") and "test_the_sampler_finds" in stack
    assert 120 < ms < 320


def test_host_ops_are_summarised_by_their_own_time():
    with profiling.profile(True) as summary:
        for _ in range(300):
            torch.randn(256, 256) @ torch.randn(256, 256)
    names = [name for name, _ in summary["host_ops_ms"]]
    assert "aten::mm" in names and all(ms >= 0 for _, ms in summary["host_ops_ms"])
    assert summary["host_stacks_ms"] and "test_host_ops_are_summarised" in summary["host_stacks_ms"][0][0]
