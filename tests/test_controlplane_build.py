"""tools/controlplane/build.sh fails loudly (never skips) when Go is missing or a build fails, and leaves no
half-built cache folder that a later run would take for a complete one. The real build runs in `make e2e`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "tools" / "controlplane" / "build.sh"


def run_build(tmp_path: Path, go: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GO": go, "FINETUNE_E2E_CACHE": str(tmp_path / "cache")}
    return subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, env=env, timeout=60)


def test_missing_go_fails_with_the_fix(tmp_path):
    out = run_build(tmp_path, "no-such-go")
    assert out.returncode == 1 and out.stdout == ""
    assert "no Go toolchain ('no-such-go' not on PATH): install Go >= 1.25" in out.stderr, out.stderr


def test_failed_build_fails_and_leaves_no_cache_entry(tmp_path):
    fake = tmp_path / "go"
    fake.write_text('#!/bin/sh\n[ "$1" = mod ] && exit 0\necho "compile error (fake)" >&2\nexit 2\n')
    fake.chmod(0o755)
    out = run_build(tmp_path, str(fake))
    assert out.returncode == 1 and out.stdout == ""
    assert "compile error (fake)" in out.stderr and "go build" in out.stderr and "failed" in out.stderr, out.stderr
    assert not any((tmp_path / "cache").iterdir()), list((tmp_path / "cache").iterdir())
