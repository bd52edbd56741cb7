"""The fine-tuning app. Importing it keeps one import out of every process that imports DeepSpeed: its autotuner
(which the app never runs) imports mlflow at `import deepspeed` when mlflow is installed, as it is in the image for
tracking. That pulls in pandas and FastAPI: 0.9-1.6 s of every training worker's start on 2 CPU cores
(`python -X importtime -c "import deepspeed"`), on the path to the first step. The autotuner then finds no mlflow,
as on a machine without it; the app's own tracking (app/tracking.py) imports mlflow where it is asked for.
"""

from __future__ import annotations

import sys

_AUTOTUNER = "deepspeed.autotuning.autotuner"


class _NoMlflowForDeepSpeedsAutotuner:
    """A finder that refuses `import mlflow` only when DeepSpeed's autotuner asks for it (its `except Exception`
    then sets has_mlflow = False); asked by this thread's own import, so another thread's import is untouched."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "mlflow":
            return None
        frame = sys._getframe(1)
        for _ in range(40):  # the autotuner's frame is a few importlib frames up
            if frame is None:
                return None
            if frame.f_globals.get("__name__") == _AUTOTUNER:
                raise ImportError("mlflow is left out of DeepSpeed's autotuner (app/__init__.py)")
            frame = frame.f_back
        return None


if not any(isinstance(f, _NoMlflowForDeepSpeedsAutotuner) for f in sys.meta_path):
    sys.meta_path.insert(0, _NoMlflowForDeepSpeedsAutotuner())
