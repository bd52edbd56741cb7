"""Where the start-up's import seconds go: `python -X importtime` of what the driver and a training worker
import, each in a fresh process, summarised as wall time and the slowest top-level packages.

    python -m benchmarks.import_profile --out OUT/imports.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SETS = {
    # `finetune train` before the workers start: the CLI, the checks (transformers, the meta-device model), Ray.
    "driver": "import app.cli, app.driver; import transformers; from transformers import AutoModelForCausalLM; "
    "import ray; from ray.train.torch import TorchTrainer",
    # A training worker: Ray Train's worker, the loop's module, then what the loop imports as it goes.
    "worker": "from ray.train.torch import TorchTrainer; import app.train_loop; import deepspeed; "
    "from transformers import AutoTokenizer, AutoModelForCausalLM; import datasets; "
    "import liger_kernel.transformers",
}


def profile(code: str) -> dict:
    started = time.time()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True)
    wall = time.time() - started
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if len(parts) != 3 or not line.startswith("import time:"):
            continue
        try:
            cumulative = int(parts[1])
        except ValueError:
            continue
        name = parts[2].rstrip()
        if not name.startswith("  "):  # one level below the top: what each statement pulled in
            rows.append((name.strip(), cumulative / 1e6))
    rows.sort(key=lambda r: -r[1])
    return {
        "wall_s": round(wall, 2),
        "rc": proc.returncode,
        "top": [[n, round(s, 2)] for n, s in rows[:25]],
        "error": proc.stderr[-800:] if proc.returncode else None,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = {name: [profile(code) for _ in range(2)] for name, code in SETS.items()}  # cold, then warm
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, runs in result.items():
        print(name, [r["wall_s"] for r in runs], runs[-1]["top"][:12], flush=True)


if __name__ == "__main__":
    main()
