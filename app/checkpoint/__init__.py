"""Checkpointing, resume and export, one concern a module:

- `layout`: where checkpoints live and when one is complete, from the files alone;
- `saving`: every rank writes its shards, rank 0 the state file last; clear errors on a full or read-only volume;
- `background`: the shards copied to host memory and written by a thread while training goes on;
- `resuming`: the driver's pure `ResumePlan`, rank 0's choice broadcast as a `LoadPlan`, the load itself;
- `exporting`: a Hugging Face folder from any DeepSpeed checkpoint;
- `formats`: the only code that touches Ray's or DeepSpeed's private formats (tested against the pinned versions).
"""

from app.checkpoint.exporting import export
from app.checkpoint.formats import repair_ray_snapshot
from app.checkpoint.layout import (
    STATE_FILE,
    TAG,
    CheckpointError,
    checkpoint_dir,
    last_logged_step,
    newest_usable,
    problem,
    read_state,
    step_folders,
    step_of,
    write_atomic,
)
from app.checkpoint.resuming import LoadPlan, ResumePlan, choose, remove_newer, restore, resume
from app.checkpoint.saving import Saved, Saver, save, storage_error

__all__ = [
    "STATE_FILE",
    "Saved",
    "Saver",
    "TAG",
    "CheckpointError",
    "LoadPlan",
    "ResumePlan",
    "checkpoint_dir",
    "choose",
    "export",
    "last_logged_step",
    "newest_usable",
    "problem",
    "read_state",
    "remove_newer",
    "repair_ray_snapshot",
    "restore",
    "resume",
    "save",
    "step_folders",
    "step_of",
    "storage_error",
    "write_atomic",
]
