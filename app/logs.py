"""What a person sees while a run works: the quiet view (default) or everything (`--verbose`).

Every process logs everything, one self-describing line per record (`TIME LEVEL LOGGER: message`); the quiet
view is one line filter, `view()`, applied where the lines are shown: the local driver's terminal (its own
records and the worker lines Ray forwards to it) and `finetune logs` reading a RayJob's log. Under a RayJob the
driver writes everything, so `finetune logs --verbose` can still show it. The quiet view keeps the app's own
lines (logger `finetune`: banner, progress, checkpoints, result) and other WARNING-or-worse records, and drops
library chatter below WARNING, Ray's internal actor messages and a few known-harmless warnings (NOISE).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import IO

ENV_VERBOSE = "FINETUNE_VERBOSE"
APP_LOGGER = "finetune"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%Y-%m-%d %H:%M:%S"
LEVELS = "DEBUG|INFO|WARNING|ERROR|CRITICAL"

# Warnings that say nothing a user of this app can act on; hidden in the quiet view, shown with --verbose.
NOISE = re.compile(
    "|".join(
        (
            r"`loss_type=None` was set in the config but it is unrecognized",  # transformers 5 on GPT-2 configs
            r"FutureWarning|DeprecationWarning",  # to library developers (DeepSpeed's reduce_scatter_tensor)
            # torch 2.13 to torchao, whose import (by transformers, when installed) registers its enums the old way:
            r"is an Enum subclass and is now natively supported by torch\.compile",
            r"Token authentication is enabled for this Ray cluster",  # the local cluster is private to this process
            r"Setting accelerator to CPU",  # DeepSpeed, on purpose here
            r"`use_return_dict` is deprecated",  # transformers 5, from Liger's patched forward on every step's model
            # Liger 0.8 probing optional kernel backends (CuTe DSL, Ascend) that this image does not carry:
            r"Backend impl '[^']+' for op '[^']+' could not be imported",
            r"barrier\(\): using the device under current context",  # torch c10d: the device it picks is the rank's
            r"CUDA-enabled jaxlib is not installed",  # JAX, imported by a library; this app does not use it
            r"has constructor arguments in the object store",  # Ray Train's PreemptionWatcher, a Ray-internal note
            r"Failed to send resource request for",  # Ray Train's autoscaling client on a busy CPU; "safe to ignore"
            r"^ray\.exceptions\.GetTimeoutError: Get timed out",  # ... and the end of its traceback
            # Ray Train's controller narrating the worker group's start (the app says what it is doing instead):
            r"^Requesting resources|^Attempting to start training worker group|^Started training worker group|^- \(ip=",
        )
    )
)
# Ray-internal actors whose every line is chatter. PlacementGroupCleaner polls the State API, which needs the
# dashboard that the embedded cluster does not start, and warns about it every few seconds.
QUIET_SOURCES = ("PlacementGroupCleaner",)
# Sources whose lines without a level are library prints, progress bars or C++ logs (dropped when quiet). The
# TrainController's are kept (but NOISE): it reports worker failures and restarts that way.
RAW_HIDDEN_SOURCES = ("RayTrainWorker",)

_TRACEBACK_BODY = re.compile(r'^(Traceback \(most recent call last\):|  File "|    \S|\s*\^+$)')
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\].*$")
_RAY_PREFIX = re.compile(r"^\((?P<source>[\w.<>-]+)(?: pid=\w+)?(?:, ip=[\w.:-]+)?\) ?(?P<rest>.*)$")
_OURS = re.compile(
    rf"^(?P<time>\d{{4}}-\d\d-\d\d (?P<clock>\d\d:\d\d:\d\d))(?:,\d+)? (?P<level>{LEVELS}) "
    r"(?P<name>\S+): (?P<msg>.*)$"
)
# Ray's ("2026-01-01 10:00:00,123\tINFO worker.py:1 -- ...") and DeepSpeed's ("[2026-...] [WARNING] [...] ...").
_OTHER = re.compile(rf"^\[?\d{{4}}-\d\d-\d\d[ T][\d:,.]+\]?\s+\[?(?P<level>{LEVELS})\]?[ :]")


_verbose = False


def verbose() -> bool:
    """--verbose was given, FINETUNE_VERBOSE=1 is set, or the driver runs under a RayJob."""
    return _verbose or os.environ.get(ENV_VERBOSE) == "1"


def view(line: str, source: str | None = None) -> str | None:
    """The line as the quiet view shows it, or None to hide it. `source` is the Ray actor that printed it
    (e.g. "RayTrainWorker"), None for the driver's own output."""
    line = _REPEATED.sub("", _ANSI.sub("", line.rstrip("\r\n")))
    if source is None:
        m = _RAY_PREFIX.match(line)
        if m and ("pid=" in line.split(")", 1)[0] or m["source"] in ("raylet", "autoscaler")):
            source, line = m["source"], m["rest"]
    if source in QUIET_SOURCES:
        return None
    ours = _OURS.match(line)
    if ours:
        if not ours["msg"].strip():
            return None
        if ours["name"] == APP_LOGGER and ours["level"] == "INFO":
            return f"{ours['clock']} {ours['msg']}"
        if logging.getLevelName(ours["level"]) < logging.WARNING or NOISE.search(ours["msg"]):
            return None
        return f"{ours['clock']} {ours['level']} {ours['msg']}" + (f"  [{source}]" if source else "")
    other = _OTHER.match(line)
    if other:
        if logging.getLevelName(other["level"]) < logging.WARNING or NOISE.search(line):
            return None
        return line + (f"  [{source}]" if source else "")
    if NOISE.search(line) or not line.strip():
        return None
    if source in RAW_HIDDEN_SOURCES or (source and _TRACEBACK_BODY.match(line)):
        return None  # a traceback's frames; its last line, the error itself, stays
    return line if source is None else f"({source}) {line}"


class _LineFormatter(logging.Formatter):
    """Puts the prefix on every line of a record (a traceback too), so each line says its level and logger."""

    def format(self, record: logging.LogRecord) -> str:
        first, *rest = super().format(record).rstrip("\n").split("\n")
        if record.name == "py.warnings":
            return first  # "file:line: Category: message"; the source line that follows says nothing more
        prefix = " ".join(first.split(" ", 4)[:4]) + " "  # date, time, level, "logger:"
        return "\n".join([first] + [prefix + line for line in rest])


class _CapturedDisassembly(logging.Filter):
    """Drops the bytecode listings of `dis`. datasets fingerprints map functions with dill, whose globals scan
    captures stdout around `dis.dis()`; Ray Train's worker print patch logs every print() to the root logger
    at INFO even while stdout is captured, so each listing (~120 lines a map call) reached the app's handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.endswith(f"{os.sep}dis.py")


class _ViewHandler(logging.StreamHandler):
    """Writes records through `view()` (the quiet view) unless verbose."""

    def emit(self, record: logging.LogRecord) -> None:
        if verbose():
            return super().emit(record)
        try:
            shown = [s for s in (view(line) for line in self.format(record).split("\n")) if s]
            if shown:
                self.stream.write("\n".join(shown) + self.terminator)
                self.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def _install(handler: logging.Handler, level: int) -> None:
    handler.setFormatter(_LineFormatter(FORMAT, DATEFMT))
    handler.addFilter(_CapturedDisassembly())
    handler.finetune = True
    root = logging.getLogger()
    for old in list(root.handlers):  # ours from an earlier call, and console handlers (Ray Train's, in workers)
        if getattr(old, "finetune", False) or getattr(old, "stream", None) in (sys.stderr, sys.__stderr__, sys.stdout):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger(APP_LOGGER).setLevel(level)
    logging.captureWarnings(True)  # warnings become WARNING records with a level (py.warnings)
    # torch writes this logger through a handler of its own, installed at its import (so not through ours): its
    # one warning here is torch 2.13's to torchao about how torchao registers its enums, a note to library authors.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # Libraries with handlers of their own: through ours, so every line carries its level.
    for name in ("transformers", "DeepSpeed", "datasets"):
        lib = logging.getLogger(name)
        for old in list(lib.handlers):
            lib.removeHandler(old)
        lib.propagate = True
    try:
        import transformers.utils.logging as tl

        tl.disable_default_handler()
        tl.enable_propagation()
    except ImportError:
        pass


def setup(want_verbose: bool = False) -> None:
    """The CLI's process: its records through the quiet view (or all of them with --verbose). Under a RayJob
    the driver writes everything and `finetune logs` applies the view, so --verbose there still has it all."""
    global _verbose
    _verbose = want_verbose or bool(os.environ.get("FINETUNE_RAYJOB_NAME"))
    _install(_ViewHandler(sys.stderr), logging.INFO)
    if not verbose():
        try:
            import transformers.utils.logging as tl

            tl.disable_progress_bar()  # "Loading weights" when the CLI loads the final model for its sample
        except ImportError:
            pass
        # "Generating train split" as the driver reads the data to prepare (read when datasets is imported).
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def setup_worker(rank: int) -> None:
    """A training worker: everything to stderr, which Ray forwards to the driver (where the view applies).
    The app's own INFO lines come from rank 0 only; other ranks log warnings and errors."""
    _install(logging.StreamHandler(sys.stderr), logging.INFO if rank == 0 else logging.WARNING)


def before_ray_init() -> dict:
    """ray.init() keyword arguments, and Ray's own driver messages through NOISE: below WARNING only when
    verbose (the Ray logger has its own handler, set up when ray is imported)."""
    for handler in logging.getLogger("ray").handlers:
        handler.addFilter(lambda record: verbose() or not NOISE.search(record.getMessage()))
    return {"logging_level": logging.INFO if verbose() else logging.WARNING}


def after_ray_init() -> None:
    """The worker lines Ray forwards to this driver go through `view()` unless verbose. Uses Ray's stream
    dispatcher (ray._private); if it changes shape, the unfiltered output stays."""
    if verbose():
        return
    try:
        from ray._private.ray_logging import (
            global_worker_stdstream_dispatcher as dispatcher,
        )
    except ImportError:
        return
    original = next((handler for name, handler in dispatcher.handlers if name == "ray_print_logs"), None)
    if original is None:
        return

    def print_viewed(data: dict) -> None:
        pid = data.get("pid")
        if pid == "autoscaler":
            return original(data)  # Ray keeps only the autoscaler's events
        source = data.get("actor_name") or data.get("task_name") or (pid if pid == "raylet" else "worker")
        shown = [s for s in (view(line, source) for line in data.get("lines", ())) if s]
        if shown:
            sink = sys.stderr if data.get("is_err") else sys.stdout
            sink.write("\n".join(shown) + "\n")
            sink.flush()

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", print_viewed)


class StreamView:
    """Applies `view()` to a byte stream of log lines (a pod's log), line by line; verbose passes it through."""

    def __init__(self, out: IO[bytes], show_all: bool):
        self.out, self.show_all, self.partial = out, show_all, b""

    def write(self, chunk: bytes) -> None:
        if self.show_all:
            self.out.write(chunk)
        else:
            *lines, self.partial = (self.partial + chunk).split(b"\n")
            self._emit(lines)
        self.out.flush()

    def close(self) -> None:
        if self.partial and not self.show_all:
            self._emit([self.partial])
            self.out.flush()
        self.partial = b""

    def _emit(self, lines: list[bytes]) -> None:
        for raw in lines:
            shown = view(raw.decode("utf-8", "replace"))
            if shown:
                self.out.write(shown.encode() + b"\n")
