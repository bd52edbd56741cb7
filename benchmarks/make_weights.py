"""A model folder with real (random-valued) weights for a benchmark shape, in the form `finetune export` writes:
config.json, the tokenizer and bf16 safetensors shards from `save_pretrained` (app/checkpoint.py: export).
Runs in a process of its own (the model is initialised on GPU 0, which the harness needs free afterwards):

    python -m benchmarks.make_weights --shape llama-8b --work /tmp/finetune-bench

The folder is `<work>/models/<shape>-weights`; it is kept when complete (a `done` marker).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from benchmarks import assets


def weights_folder(work: Path, shape: assets.Shape) -> Path:
    return work / "models" / f"{shape.name}-weights"


def make(work: Path, shape: assets.Shape) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = weights_folder(work, shape)
    if (out / "done").exists():
        return json.loads((out / "done").read_text())
    source = assets.model_folder(work, shape)
    started = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it is fast; transformers' own init of each module
        model = AutoModelForCausalLM.from_config(assets.SHAPES[shape.name].hf_config(), dtype=torch.bfloat16)
    built = time.time()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    os.sync()
    size = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
    record = {
        "shape": shape.name,
        "bytes": size,
        "build_s": round(built - started, 1),
        "write_s": round(time.time() - built, 1),
    }
    (tmp / "done").write_text(json.dumps(record) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", required=True, choices=sorted(assets.SHAPES))
    p.add_argument("--work", default="/tmp/finetune-bench")
    args = p.parse_args()
    print(json.dumps(make(Path(args.work), assets.SHAPES[args.shape])), flush=True)


if __name__ == "__main__":
    main()
