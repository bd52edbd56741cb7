"""benchmarks/prepare_bench.py at its --quick size: the old path (a git worktree of the commit before issue #47) and
the current one (a local Ray cluster) prepare the same synthetic data, every block of both is compared, and one
record per case is written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def old_commit_present() -> bool:
    from benchmarks.prepare_bench import OLD_COMMIT

    if shutil.which("git") is None or not (REPO / ".git").exists():
        return False
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{OLD_COMMIT}^{{commit}}"], capture_output=True)
    return found.returncode == 0


@pytest.mark.slow  # a benchmark's plumbing, like tests/test_bench.py's smoke suite: `make test-all`
@pytest.mark.skipif(not old_commit_present(), reason="needs the repository's git history (the old commit)")
def test_quick_run_compares_both_paths_block_by_block(tmp_path):
    out = tmp_path / "results.jsonl"
    before = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.prepare_bench", "--quick", "--old-procs", "2", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["path"], r["kind"]) for r in records] == [
        ("old", "text"),
        ("old", "chat"),
        ("new", "text"),
        ("new", "chat"),
    ]
    for r in records:
        assert r["seconds"] > 0 and r["rate"] > 0 and r["blocks"] > 0 and r["tokens"] > 0
        assert r["size"] == (1000 if r["kind"] == "text" else 300)
        # One unit of rows, one map batch: both paths make the same blocks.
        assert r["equal_blocks"] is True, r
    old = {r["kind"]: r for r in records if r["path"] == "old"}
    new = {r["kind"]: r for r in records if r["path"] == "new"}
    for kind in ("text", "chat"):
        assert old[kind]["blocks"] == new[kind]["blocks"] and old[kind]["tokens"] == new[kind]["tokens"]
        assert new[kind]["bytes_per_token"] < old[kind]["bytes_per_token"] / 2
    assert new["chat"]["tokens"] == new["chat"]["manifest_tokens"]  # padding left out as the manifest counts
    assert new["text"]["ray_start_s"] > 0 and new["text"]["ray_cpus"] >= 1
    assert all(new[kind]["driver_cpu_s"] > 0 and new[kind]["rows_per_s"] > 0 for kind in ("text", "chat"))
    # A second preparation reuses the first's dataset, in the process and as a `finetune prepare` of its own.
    for kind in ("text", "chat"):
        assert new[kind]["reused_same"] is True and new[kind]["reuse_cli_reused"] is True, new[kind]
        assert 0 < new[kind]["reuse_s"] < new[kind]["seconds"] and new[kind]["reuse_cli_s"] > 0
    assert "| data | path |" in done.stdout and "command: python -m benchmarks.prepare_bench --quick" in done.stdout
    # The old commit's worktree is gone again.
    assert subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout == before


def test_help_lists_the_options():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.prepare_bench", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0
    for option in ("--docs", "--conversations", "--seq-length", "--vocab", "--cpus", "--old-tree", "--quick"):
        assert option in done.stdout
