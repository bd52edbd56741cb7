"""The one shape of a user error: the field, the value, what is wrong and how to fix it (and the commands' one
numeric option type, a number of seconds, refused in argparse's own way)."""

from __future__ import annotations

import argparse
import math
from typing import Any


class Problem(Exception):
    """One invalid input: the field, the value, what is wrong and how to fix it."""

    def __init__(self, field: str, value: Any, message: str, fix: str = ""):
        self.field, self.value, self.message, self.fix = field, value, message, fix
        super().__init__(str(self))

    def __reduce__(self):  # raised in a Ray worker, it travels to the driver pickled: keep the four parts
        return type(self), (self.field, self.value, self.message, self.fix)

    def __str__(self) -> str:
        # A string value is most often where the problem is (a path, a file and its line): cut only when very long.
        got = _short(self.value, 400 if isinstance(self.value, str) else 80)
        text = f"{self.field}: {self.message} (got {got})"
        return f"{text}. Fix: {self.fix}" if self.fix else text


class ConfigError(Exception):
    """All problems found in one config; the CLI prints one line each and exits 2."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))

    def __reduce__(self):
        return type(self), (self.problems,)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def seconds(text: str) -> float:
    """argparse type of a --wait option: a finite number of seconds, at least 0 (nan would wait for ever)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: use a finite number of seconds, 0 or more")
    return value
