"""Processes started ahead for Ray Train's actors (app.prestart): the workers' preload never counts CUDA devices
(Ray sets a worker's CUDA_VISIBLE_DEVICES only when its actor lands, and CUDA reads it once). That Ray Train's
actors take the processes started for them is asserted on a real run in tests/test_train.py (test_zero3_learns)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

# torch's device queries wrapped before anything else is imported: any call during the preload is recorded.
PROBE = """
import json, os, sys, torch
calls = []
def recorded(name, original):
    def call(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)
    return call
torch.cuda.device_count = recorded("device_count", torch.cuda.device_count)
torch.cuda.is_available = recorded("is_available", torch.cuda.is_available)
torch._C._cuda_getDeviceCount = recorded("_cuda_getDeviceCount", torch._C._cuda_getDeviceCount)
torch.cuda.init = recorded("init", torch.cuda.init)
from app import prestart
prestart.preload()
print(json.dumps({
    "calls": calls,
    "initialized": torch.cuda.is_initialized(),
    "missing": [m for m in prestart.PRELOAD if m not in sys.modules],
    "deepspeed": "deepspeed" in sys.modules,
    "preloaded_s": os.environ.get(prestart.PRELOADED_ENV),
}))
"""


def test_preload_imports_the_loop_and_never_counts_cuda_devices():
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["calls"] == [] and not found["initialized"], found
    # DeepSpeed counts devices when it is imported: the loop imports it once the actor holds its GPU.
    assert found["missing"] == [] and not found["deepspeed"], found
    assert float(found["preloaded_s"]) > 0, found


def test_preload_survives_a_module_that_fails(monkeypatch):
    from app import prestart

    monkeypatch.setattr(prestart, "PRELOAD", ("app.no_such_module", "json"))
    monkeypatch.delenv(prestart.PRELOADED_ENV, raising=False)
    prestart.preload()  # Ray ends a process whose setup hook raises
    assert float(__import__("os").environ[prestart.PRELOADED_ENV]) >= 0
