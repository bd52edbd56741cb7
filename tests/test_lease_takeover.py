"""The lease is taken over at once when its holder is provably gone, and only after the timeout otherwise
(issue 14, item 5): real processes on this host, and pods through tests/fake_k8s.py with the real client."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.lease import Lease, LeaseHeld
from conftest import REPO
from fake_k8s import FakeKube

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
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), mode], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
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


@pytest.mark.parametrize("change", [{"host": "another-host"}, {"pid_ns": "pid:[1]"}, {"boot_id": "an-earlier-boot"}],
                         ids=["another host", "another pid namespace", "another boot"])
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


def pod_lease(folder: Path, pod: str) -> None:
    """A fresh lease written by a driver in pod `ml/<pod>` on another node."""
    folder.mkdir(exist_ok=True)
    (folder / ".lease").write_text(json.dumps({"token": "t", "host": pod, "pid": 7, "pod": pod, "namespace": "ml",
                                               "boot_id": "other-node", "pid_ns": "pid:[2]", "timeout_s": 600}))


def test_holder_pod_that_no_longer_exists_is_taken_over_at_once(kube, tmp_path, caplog):
    kube.add_pod("ml", "exp1-head-abcde", {}, ["ray-head"], {})
    pod_lease(tmp_path, "exp1-head-abcde")
    with pytest.raises(LeaseHeld):  # the pod runs: its driver may be alive
        Lease(tmp_path, 600).acquire()
    kube.pods.pop(("ml", "exp1-head-abcde"))  # deleted (helm uninstall, preemption)
    with caplog.at_level(logging.WARNING, logger="finetune"):
        Lease(tmp_path, 600).acquire().release()
    assert "ran in pod ml/exp1-head-abcde, which no longer exists" in caplog.text


def test_holder_pod_that_has_ended_is_taken_over_at_once(kube, tmp_path):
    kube.add_pod("ml", "exp1-head-fghij", {}, ["ray-head"], {}, phase="Failed")
    pod_lease(tmp_path, "exp1-head-fghij")
    Lease(tmp_path, 600).acquire().release()


def test_without_api_access_the_timeout_decides(kube, tmp_path, caplog):
    kube.mode = "forbidden"
    pod_lease(tmp_path, "exp1-head-klmno")
    with caplog.at_level(logging.INFO, logger="finetune"), pytest.raises(LeaseHeld):
        Lease(tmp_path, 600).acquire()
    assert "forbidden" in caplog.text and "expires by timeout" in caplog.text
