"""Where checkpoints live and when one is usable: judged from the files alone, nothing imported from Ray or
DeepSpeed.

A checkpoint is `<experiment>/checkpoints/step-NNNNNNNN/`: DeepSpeed's shards under `ds/`, each rank's RNG
states, the model config and tokenizer under `hf/` (so it can be exported offline), and `trainer_state.json`,
written last, which also lists every file of the checkpoint with its size: a resume tells a complete
checkpoint from a truncated or half-deleted one without reading it.
"""

from __future__ import annotations

import json
import os
import re
import time
import zipfile
from pathlib import Path
from typing import Any

TAG = "ds"
STATE_FILE = "trainer_state.json"
UNIVERSAL = "universal"  # DeepSpeed universal checkpoint, converted at a world-size change
UNLOADABLE = ".unloadable"  # written into a checkpoint that failed to load: later resumes skip it
STEP_DIR = re.compile(r"^step-(\d+)$")
# What save() writes into a step folder; anything else there is someone else's.
OUR_NAMES = {
    TAG,
    UNIVERSAL,
    UNIVERSAL + ".tmp",
    "hf",
    "latest",
    STATE_FILE,
    STATE_FILE + ".tmp",
    "zero_to_fp32.py",
    "zero_to_torch.py",
    UNLOADABLE,
}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the folder and what to do."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def rng_file(path: Path, rank: int) -> Path:
    return Path(path) / f"rng-rank{rank}.pt"


def step_of(path: Path) -> int:
    m = STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else -1


def step_folders(run_dir: Path) -> list[Path]:
    """This app's step-NNNNNNNN folders, newest first; other names in checkpoints/ are ignored."""
    folders = [f for f in (Path(run_dir) / "checkpoints").glob("step-*") if STEP_DIR.match(f.name) and f.is_dir()]
    return sorted(folders, key=step_of, reverse=True)


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_FILE).read_text())


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def move_aside(folder: Path, why: str) -> Path:
    """Rename a step folder to `step-N.<why>-<time>`, where no resume looks: kept, never deleted."""
    aside = folder.with_name(f"{folder.name}.{why}-{time.strftime('%Y%m%dT%H%M%S')}")
    os.rename(folder, aside)
    return aside


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (the folder a new path would be created in)."""
    probe = Path(path)
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


def manifest(path: Path) -> dict[str, int]:
    """Every file a checkpoint consists of, with its size: recorded in its state file, checked by `problem`."""
    files = [p for sub in (TAG, "hf") for p in (path / sub).rglob("*") if p.is_file()]
    files += list(path.glob("rng-rank*.pt"))
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(files)}


def problem(path: Path) -> str | None:
    """Why `path` cannot be resumed from (missing, never finished, truncated, failed to load), or None."""
    path = Path(path)
    if not path.is_dir():
        return "its folder does not exist (deleted?)"
    if (path / UNLOADABLE).exists():
        return f"it failed to load before: {(path / UNLOADABLE).read_text().strip()[:300]}"
    if not (path / STATE_FILE).exists():
        return f"it was never finished (no {STATE_FILE}: the run died while saving it)"
    try:
        state = read_state(path)
    except (OSError, ValueError) as exc:
        return f"its {STATE_FILE} is unreadable ({exc})"
    if not (path / TAG).is_dir():
        return f"it has no {TAG}/ folder of DeepSpeed shards"
    files = state.get("files")
    if files is None:  # written before manifests existed: check the shards' zip structure at least
        files = {str(p.relative_to(path)): None for p in (path / TAG).glob("*.pt")}
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if size is not None and f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written (truncated or replaced)"
        if f.suffix == ".pt" and not zipfile.is_zipfile(f):
            return f"{name} is not a readable torch file"
    return None


def newest_usable(run_dir: Path) -> Path | None:
    """The newest checkpoint a resume could use, judged from the files alone."""
    return scan_usable(run_dir)[0]


def scan_usable(run_dir: Path, below: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest usable checkpoint below step `below` (None: any), and why newer ones were skipped."""
    skipped = []
    for folder in step_folders(run_dir):
        if below is not None and step_of(folder) >= below:
            continue
        why = problem(folder)
        if why is None:
            return folder, skipped
        skipped.append(f"{folder.name}: {why}")
    return None, skipped


def skipped_text(skipped: list[str]) -> str:
    return f" (skipped {'; '.join(skipped)})" if skipped else ""


def last_logged_step(run_dir: Path) -> int | None:
    """The step of the last progress record in metrics.jsonl: how far the previous attempt got."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    last = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "train" and isinstance(rec.get("step"), int):
            last = rec["step"]
    return last


def plain_modes(folder: Path) -> None:
    """Every file under `folder` gets the mode a plain write gives (0666 less the umask). safetensors writes its
    files 0600 (a temp file, renamed): a model folder on a shared volume would be unreadable to every other user,
    e.g. a serving pod of another uid in the same fsGroup."""
    umask = _umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def _umask() -> int:
    """This process's umask, read without setting it: os.umask can only be read by changing it, and for that moment
    a file another thread creates (a background checkpoint write) would get mode 0666."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022  # no /proc (not Linux): the common default
