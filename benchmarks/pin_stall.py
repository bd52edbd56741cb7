"""How much pinning host memory in a background thread slows a GPU-bound loop in the main thread, by method.

The background saves reserve their host buffers (the optimizer's state: 13 GB for the 1.1B under ZeRO-3) in the
writer thread after the first step, and the app's first timed steps ran slower while they did. This times a
loop of bf16 matmuls (one host sync a step, a small pinned batch copied in each step as a DataLoader's would be)
while another thread pins GB_TOTAL of host memory, each method in a process of its own:

- `none`: nothing pinned (the baseline);
- `alloc`: `torch.empty(pin_memory=True)`, torch's default (cudaHostAlloc);
- `register`: the same through torch's register-based allocator (`pinned_use_cuda_host_register`, 8 threads);
- `chunked`: pageable memory, its pages touched, then `cudaHostRegister` CHUNK_MIB at a time.

    python3 -m benchmarks.pin_stall --out OUT/pin_stall.json    # one GPU, about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time

GB_TOTAL = 13
STORAGE_GB = 1.1  # the size of one optimizer-state storage (ZeRO-3's flat fp32 partitions are a few GB each)


def pin(method: str, nbytes: int, chunk: int) -> None:
    import torch

    if method in ("alloc", "register"):
        KEEP.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))  # kept, or torch's cache reuses it
        return
    buf = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # page-aligned: chunks share no page
    cudart = torch.cuda.cudart()
    for start in range(0, nbytes, chunk):
        piece = buf[start : start + chunk]
        piece.fill_(0)  # the pages exist before the driver pins them
        rc = int(cudart.cudaHostRegister(piece.data_ptr(), piece.numel(), 0))
        if rc:
            raise RuntimeError(f"cudaHostRegister: {rc}")
    KEEP.append(buf)


KEEP: list = []


def one(method: str, chunk_mib: int, steps: int) -> dict:
    import torch

    torch.cuda.init()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    batch = torch.empty(16 * 2048, dtype=torch.int64).pin_memory()

    def step():
        x = a
        batch.to("cuda", non_blocking=True)
        for _ in range(150):  # about 0.2 s of matmuls on an H200
            x = (x @ a).clamp_(-1, 1)
        return float(x[0, 0])  # the host waits for the step, as the loop's logging does

    for _ in range(5):
        step()
    times, pinned = [], {}

    def reserve():
        started = time.perf_counter()
        nbytes = int(STORAGE_GB * 2**30)
        for _ in range(int(GB_TOTAL / STORAGE_GB)):
            pin(method, nbytes, chunk_mib * 2**20)
        pinned["s"] = time.perf_counter() - started

    thread = threading.Thread(target=reserve) if method != "none" else None
    for i in range(steps):
        if i == 3 and thread:
            thread.start()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    if thread:
        thread.join()
    base = statistics.median(times[:3])
    return {
        "method": method,
        "chunk_mib": chunk_mib if method == "chunked" else None,
        "pin_s": pinned.get("s"),
        "step_median_s": statistics.median(times),
        "first_steps_s": times[:3],
        "extra_s": sum(t - base for t in times[3:]),
        "max_step_s": max(times),
        "steps_s": [round(t, 4) for t in times],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--chunk-mib", type=int, default=256)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.chunk_mib, a.steps)))
        return
    rows = []
    plans = [("none", 0), ("alloc", 0), ("register", 0), ("chunked", 1024), ("chunked", 256), ("chunked", 64)]
    for method, chunk in plans:
        env = dict(os.environ)
        if method == "register":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
        cmd = [sys.executable, "-m", "benchmarks.pin_stall", "--out", a.out, "--one", method, "--chunk-mib", str(chunk)]
        cmd += ["--steps", str(a.steps)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode:
            rows.append({"method": method, "chunk_mib": chunk, "error": done.stderr[-2000:]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"{method:9} chunk {chunk:5} MiB: pinned {GB_TOTAL} GB in {r.get('pin_s') or 0:.2f} s, "
            f"extra {r.get('extra_s', 0):.2f} s over the steps, max step {r.get('max_step_s', 0):.3f} s, "
            f"median {r.get('step_median_s', 0):.3f} s {r.get('error', '')}",
            flush=True,
        )
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:  # after each method: a call's deadline keeps what was measured
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
