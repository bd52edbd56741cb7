"""The lease is taken over at once when its holder is provably gone, and only after the timeout otherwise
(issue 14, item 5): real processes on this host, and RayJobs through tests/fake_k8s.py with the real client; and
a run whose lease was taken over never completes a checkpoint."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from fake_k8s import FakeKube

from app.lease import Lease, LeaseHeld

# A holder that takes the lease with a 10-minute timeout, says so, then either dies without releasing it
# (`exit`: as a SIGKILLed driver would leave it) or holds it (`hold`).
HOLDER = r"""
import os, sys, time
from pathlib import Path
from app.lease import Lease
Lease(Path(sys.argv[1]), 600, on_lost=lambda *_: None).acquire()
print("holding", flush=True)
if sys.argv[2] == "exit":
    os._exit(0)
time.sleep(600)
"""


def holder(folder: Path, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), mode],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "holding"
    return proc


def lease_record(folder: Path) -> dict:
    return json.loads((folder / ".lease").read_text())


def test_dead_holder_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    proc = holder(tmp_path, "exit")
    proc.wait(timeout=30)
    dead = lease_record(tmp_path)
    assert dead["pid"] == proc.pid
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="finetune"):
        new = Lease(tmp_path, 600).acquire()
    assert time.monotonic() - started < 5  # not the 600 s timeout
    assert lease_record(tmp_path)["token"] == new.token
    assert f"ran as pid {proc.pid} on this host, which has ended" in caplog.text
    new.release()


def test_live_holder_is_not_taken_over_until_its_process_ends(tmp_path):
    proc = holder(tmp_path, "hold")
    try:
        with pytest.raises(LeaseHeld):
            Lease(tmp_path, 600).acquire()
    finally:
        proc.kill()
        proc.wait()
    Lease(tmp_path, 600).acquire().release()  # killed: taken over at once


def test_pid_reused_by_a_later_process_is_not_the_holder(tmp_path):
    """The recorded pid is alive (this test's own process), but it started at another time: not the holder."""
    proc = holder(tmp_path, "exit")
    proc.wait(timeout=30)
    record = {**lease_record(tmp_path), "pid": os.getpid()}
    (tmp_path / ".lease").write_text(json.dumps(record))
    Lease(tmp_path, 600).acquire().release()


@pytest.mark.parametrize(
    "change",
    [{"host": "another-host"}, {"pid_ns": "pid:[1]"}, {"boot_id": "an-earlier-boot"}],
    ids=["another host", "another pid namespace", "another boot"],
)
def test_a_holder_elsewhere_is_judged_by_the_timeout_only(change, tmp_path):
    """Its pid means nothing here, dead or alive: the lease is held until it expires."""
    proc = holder(tmp_path, "exit")
    proc.wait(timeout=30)
    (tmp_path / ".lease").write_text(json.dumps({**lease_record(tmp_path), **change}))
    with pytest.raises(LeaseHeld):
        Lease(tmp_path, 600).acquire()
    stale = time.time() - 700
    os.utime(tmp_path / ".lease", (stale, stale))
    Lease(tmp_path, 600).acquire().release()


@pytest.fixture
def kube(tmp_path, monkeypatch):
    server = FakeKube().start()
    monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace="ml")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield server
    server.stop()


RAYJOB = {
    "apiVersion": "ray.io/v1",
    "kind": "RayJob",
    "metadata": {"name": "exp1", "namespace": "ml"},
    "spec": {"entrypoint": "finetune train /etc/finetune/config.yaml"},
}


def rayjob_lease(folder: Path, uid: str) -> None:
    """A fresh lease written by a driver on another node, under RayJob ml/exp1 with this uid."""
    folder.mkdir(exist_ok=True)
    (folder / ".lease").write_text(
        json.dumps(
            {
                "token": "t",
                "host": "exp1-head-abcde",
                "pid": 7,
                "pod": "exp1-head-abcde",
                "namespace": "ml",
                "boot_id": "other-node",
                "pid_ns": "pid:[2]",
                "timeout_s": 600,
                "rayjob": {"namespace": "ml", "name": "exp1", "uid": uid},
            }
        )
    )


def test_holder_records_the_rayjob_it_runs_under(kube, tmp_path, monkeypatch):
    uid = kube.add_rayjob(RAYJOB)["metadata"]["uid"]
    monkeypatch.setenv("FINETUNE_RAYJOB_NAME", "exp1")
    monkeypatch.setenv("FINETUNE_RAYJOB_NAMESPACE", "ml")
    with Lease(tmp_path, 600).acquire():
        assert lease_record(tmp_path)["rayjob"] == {"namespace": "ml", "name": "exp1", "uid": uid}


@pytest.mark.parametrize("how", ["deleted", "redeployed"])
def test_holder_whose_rayjob_is_gone_is_taken_over_at_once(how, kube, tmp_path, caplog):
    uid = kube.add_rayjob(RAYJOB)["metadata"]["uid"]
    rayjob_lease(tmp_path, uid)
    with pytest.raises(LeaseHeld):  # its RayJob exists: the driver may be alive
        Lease(tmp_path, 600).acquire()
    kube.rayjobs.pop(("ml", "exp1"))  # helm uninstall, kubectl delete
    if how == "redeployed":
        assert kube.add_rayjob(RAYJOB)["metadata"]["uid"] != uid
    with caplog.at_level(logging.WARNING, logger="finetune"):
        Lease(tmp_path, 600).acquire().release()
    expected = "which no longer exists" if how == "deleted" else "which was deleted (the RayJob of that name is a new"
    assert f"ran under RayJob ml/exp1, {expected}" in caplog.text, caplog.text


def test_without_api_access_the_timeout_decides(kube, tmp_path, caplog):
    kube.mode = "forbidden"
    rayjob_lease(tmp_path, "some-uid")
    with caplog.at_level(logging.INFO, logger="finetune"), pytest.raises(LeaseHeld):
        Lease(tmp_path, 600).acquire()
    assert "forbidden" in caplog.text and "expires by timeout" in caplog.text


# --- the commit side: a run whose lease was taken over never completes a checkpoint ------------------------


class ShardWriter:
    """Stands in for the DeepSpeed engine in these tests: writes one shard where save_checkpoint would, and runs
    `during` while "writing" (a takeover that happens in the middle of a save). The real engine's save is covered
    by the Ray runs in tests/test_reliability.py; what is tested here is the lease check around it."""

    def __init__(self, during=None):
        self.during = during or (lambda: None)

    def save_checkpoint(self, path, tag, client_state, save_latest):
        (Path(path) / tag).mkdir(parents=True, exist_ok=True)
        torch.save({"shard": torch.zeros(4)}, Path(path) / tag / "mp_rank_00_model_states.pt")
        self.during()


def take_over(run_dir: Path) -> Lease:
    """Another deploy takes the experiment's lease (as it would from a run it judged gone)."""
    (run_dir / ".lease").unlink()
    return Lease(run_dir, 600, on_lost=lambda *_: None).acquire()


def save(run_dir: Path, step: int, token: str, engine: ShardWriter) -> Path:
    from app import checkpoint

    path = checkpoint.checkpoint_dir(run_dir, step)
    state = {"global_step": step, "world_size": 1, "epoch": 0, "step_in_epoch": step}
    checkpoint.save(engine, path, state, 0, lambda: None, lambda p: p.mkdir(parents=True), lease_token=token)
    return path


@pytest.mark.parametrize("when", ["before the save", "while the shards are written"])
def test_checkpoint_is_not_completed_after_a_takeover(when, tmp_path):
    from app import checkpoint

    old = Lease(tmp_path, 600, on_lost=lambda *_: None).acquire()
    first = save(tmp_path, 2, old.token, ShardWriter())
    assert checkpoint.problem(first) is None  # while the lease is ours, a save completes
    if when == "before the save":
        new = take_over(tmp_path)
        engine = ShardWriter()
    else:
        holder = []
        engine = ShardWriter(during=lambda: holder.append(take_over(tmp_path)))
    with pytest.raises(checkpoint.CheckpointError, match="no longer belongs to this run"):
        save(tmp_path, 4, old.token, engine)
    assert not (checkpoint.checkpoint_dir(tmp_path, 4) / "trainer_state.json").exists()
    assert checkpoint.newest_usable(tmp_path) == first
    new = new if when == "before the save" else holder[0]
    # The new holder's own checkpoint of the same step completes, and the old run could not have removed it.
    assert checkpoint.problem(save(tmp_path, 4, new.token, ShardWriter())) is None
    with pytest.raises(checkpoint.CheckpointError):
        save(tmp_path, 4, old.token, ShardWriter())
    assert checkpoint.problem(checkpoint.checkpoint_dir(tmp_path, 4)) is None
    old._stop.set(), new.release()
