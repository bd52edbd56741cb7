"""Pictures of a run's loss: loss.png in the experiment folder (matplotlib) and a small curve for the terminal.

Both read the experiment's metrics.jsonl, which every attempt of a run appends to: a step logged twice (an
attempt that died after it, then the resume that trained it again) counts with its latest value, so the
curve is the one the resumed run follows.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

Points = list[tuple[int, float]]
LOSS_PNG = "loss.png"
BLOCKS = " ▁▂▃▄▅▆▇█"  # eighths of a character cell, for the terminal curve


def read_curves(metrics: Path) -> tuple[Points, Points]:
    """(train loss, eval loss) by step from a metrics.jsonl; lines that do not parse (one being written) are
    skipped."""
    train: dict[int, float] = {}
    evals: dict[int, float] = {}
    try:
        with metrics.open() as f:
            for line in f:
                try:
                    record = json.loads(line)
                    if record.get("kind") == "train":
                        train[int(record["step"])] = float(record["loss"])
                    elif record.get("kind") == "eval":
                        evals[int(record["step"])] = float(record["eval_loss"])
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
    except OSError:
        pass
    return sorted(train.items()), sorted(evals.items())


def write_loss_png(run_dir: Path) -> Path | None:
    """Draw train and eval loss against step into <run_dir>/loss.png (replaced whole); None when there is no
    train loss yet."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train, evals = read_curves(run_dir / "metrics.jsonl")
    if not train:
        return None
    fig = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(*zip(*train), label="train loss", linewidth=1.2, color="#1f77b4")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", markersize=4, linewidth=1.2, color="#d62728")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(run_dir.name, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    out = run_dir / LOSS_PNG
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


def downsample(points: Points, n: int) -> Points:
    """At most `n` points, evenly spread, the first and the last kept."""
    if len(points) <= n:
        return list(points)
    return [points[round(i * (len(points) - 1) / (n - 1))] for i in range(n)]


def terminal_curve(points: Points, width: int = 60, height: int = 6) -> list[str]:
    """A loss curve in `height` lines of block characters over `width` columns of steps (each the mean of its
    steps; a column with none repeats the one before), the loss range on the left, the steps below."""
    points = [(s, v) for s, v in points if math.isfinite(v)]
    if len(points) < 2:
        return []
    first, last = points[0][0], points[-1][0]
    columns: list[list[float]] = [[] for _ in range(width)]
    for step, value in points:
        columns[min(width - 1, (step - first) * width // max(last - first, 1))].append(value)
    means: list[float] = []
    for column in columns:
        means.append(sum(column) / len(column) if column else means[-1])
    low, high = min(means), max(means)
    levels = [1 + round((m - low) / ((high - low) or 1) * (height * 8 - 1)) for m in means]
    label_width = max(len(f"{high:.3f}"), len(f"{low:.3f}"))
    lines = []
    for row in range(height - 1, -1, -1):
        cells = "".join(BLOCKS[max(0, min(8, level - row * 8))] for level in levels)
        label = f"{high:.3f}" if row == height - 1 else f"{low:.3f}" if row == 0 else ""
        lines.append(f"{label:>{label_width}} │{cells}")
    lines.append(" " * label_width + " └" + "─" * width)
    lines.append(" " * (label_width + 2) + str(first).ljust(width - len(str(last))) + f"{last} step")
    return lines
