"""A prepared dataset's unit files: where a unit's arrays are and their writing, apart from app.data.store (whose
dataset is torch's), so that the Ray Data actors that write units import no torch (seconds of each actor's start).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def unit_path(folder: Path, split: str, unit: int, name: str) -> Path:
    return folder / split / f"unit-{unit:06d}.{name}.npy"


def write_unit(folder: Path, split: str, unit: int, arrays: dict[str, np.ndarray]) -> int:
    """The unit's arrays into `folder` (a prepared dataset's temporary folder); returns the bytes written."""
    written = 0
    (folder / split).mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        path = unit_path(folder, split, unit, name)
        np.save(path, array, allow_pickle=False)
        written += path.stat().st_size
    return written


def remove_tree(folder: Path) -> None:
    """A temporary folder's removal that never fails the caller (what it could not remove, a later run ignores)."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    if os.path.lexists(folder) and not os.path.isdir(folder):
        os.unlink(folder)
