"""The longest sequence the app's memory model lets a `long` suite case train on this machine: its GPU memory as
`finetune train` reads it (or --gpu-memory) and this machine's host memory, searched in steps of --step tokens.

    python -m benchmarks.longest --lora                 # the 8B chat LoRA case (long-l8b-*k)
    python -m benchmarks.longest --full --gpu-memory 140GiB --host-memory 125GiB

Prints one JSON line: the longest length accepted, what model.long_sequence's auto chose there (tiles, offloaded
layers) and the refusal at the next step, in the app's own words. The case itself then runs as
`bench --suite long --only long-l8b-<N>k` where the suite has that length, or through `--seq` in the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import yaml

from app import autoset
from app.config import ConfigError, TrainingConfig
from benchmarks import assets, bench


def settle(seq: int, lora: bool, work: Path, gpu_memory: str | None, host: str | None) -> tuple[bool, str, dict]:
    """Whether the long case at `seq` tokens fits, the refusal if not, and what auto chose if so."""
    from app import driver

    case = bench.long_case(seq, lora=lora)
    given = {"scaling.host_memory": host, "scaling.gpu_memory": gpu_memory}
    sets = {**case.sets, **{key: value for key, value in given.items() if value}}
    doc, _ = bench.case_config(dataclasses.replace(case, weights=False, corpus_tokens=1000, sets=sets), work)
    cfg = TrainingConfig.model_validate(doc)

    hardware = autoset.Hardware(detect=lambda: driver.cluster_gpu_memory(cfg), strict=True)
    try:
        settled = autoset.settle(cfg, offline=True, hardware=hardware)
    except ConfigError as exc:
        return False, str(exc), {}
    if settled.problems:
        return False, "; ".join(str(p) for p in settled.problems), {}
    chose = settled.config.model.long_sequence
    return True, "", {"long_sequence": getattr(chose, "model_dump", lambda: chose)(), "lines": settled.lines}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--lora", action="store_true", default=True, help="the LoRA case (default)")
    kind.add_argument("--full", action="store_true", help="the full-parameter case")
    p.add_argument("--gpu-memory", help="scaling.gpu_memory, e.g. 80GiB (default: this machine's, as train reads it)")
    p.add_argument("--host-memory", help="scaling.host_memory (default: this machine's, as train reads it)")
    p.add_argument("--step", type=int, default=16384, help="the search's step in tokens (default 16384)")
    p.add_argument("--low", type=int, default=131072, help="a length known to fit (default 131072)")
    p.add_argument("--high", type=int, default=1 << 20, help="the longest to try (default 2^20)")
    args = p.parse_args(argv)
    lora = not args.full
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assets.model_folder(work, assets.SHAPES["llama-8b-1m"])
        fits = lambda n: settle(n, lora, work, args.gpu_memory, args.host_memory)  # noqa: E731
        ok, why, chose = fits(args.low)
        if not ok:
            print(json.dumps({"longest": None, "refused_at": args.low, "why": why}))
            return 1
        lo, hi = args.low // args.step, args.high // args.step + 1  # lo fits; hi is past the end
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok, _, found = fits(mid * args.step)
            lo, hi, chose = (mid, hi, found) if ok else (lo, mid, chose)
        _, why, _ = fits(hi * args.step) if hi * args.step <= args.high else (False, "past --high", {})
        out = {"longest": lo * args.step, "lora": lora, **chose, "next": hi * args.step, "refused_next": why}
        print(json.dumps(out))
        print(yaml.safe_dump({"long_sequence": chose.get("long_sequence")}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
