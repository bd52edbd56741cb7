"""Preemption without a cluster: the notice, `finetune preempt` (the pods' preStop hook), the grace-period note,
Ray's SIGTERM route in its pinned version, and the chart's grace period and hook. The real runs (SIGTERM to a
rank, to the driver, twice) are in tests/test_reliability.py, section 8."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import threading
import time

import pytest
from conftest import run_cli
from k8s_support import render

from app import preemption
from app.lease import Lease


def test_notice_is_for_one_run_and_cleared_by_the_next(tmp_path):
    assert not preemption.notice_for(tmp_path, "a")
    preemption.write_notice(tmp_path, "a", "test")
    assert preemption.notice_for(tmp_path, "a") and not preemption.notice_for(tmp_path, "b")
    preemption.write_notice(tmp_path, None, "test")  # no token: whichever run holds the folder
    assert preemption.notice_for(tmp_path, "b")
    (tmp_path / ".preempt").write_text("{torn")
    assert preemption.notice_for(tmp_path, "b")  # unreadable: stop with a checkpoint rather than not at all
    preemption.clear(tmp_path)
    assert not preemption.notice_for(tmp_path, "a") and not list(tmp_path.iterdir())


def test_preempt_command_without_a_run(tmp_path):
    out = run_cli("preempt", str(tmp_path), "--wait", "5", timeout=60)
    assert out.returncode == 0 and "nothing to preempt" in out.stdout, out.stdout + out.stderr
    assert not (tmp_path / ".preempt").exists()


@pytest.mark.parametrize("wait", ["nan", "inf", "-1", "soon"])
def test_wait_options_take_a_finite_number_of_seconds(wait, tmp_path):
    """`--wait nan` compared false with every deadline, so it waited for ever (`resume`, and `preempt` while a run
    holds the folder); argparse now refuses it, as it refuses any other bad argument: exit 2, nothing done."""
    for command in (["preempt", str(tmp_path)], ["resume", "exp"]):
        out = run_cli(*command, "--wait", wait, timeout=60)
        assert out.returncode == 2 and f"argument --wait: '{wait}'" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and not list(tmp_path.iterdir())


def test_preempt_command_asks_the_holder_and_waits_for_its_release(tmp_path):
    lease = Lease(tmp_path, 600, on_lost=lambda *_: None).acquire()
    asked_at = []

    def holder():  # the run: it sees the notice after a step, saves (1 s here) and releases
        deadline = time.monotonic() + 90
        while not (tmp_path / ".preempt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        asked_at.append(time.monotonic())
        time.sleep(1)
        lease.release()

    threading.Thread(target=holder, daemon=True).start()
    out = run_cli("preempt", str(tmp_path), "--wait", "60", timeout=120)
    assert out.returncode == 0 and "the run stopped and released" in out.stdout, out.stdout + out.stderr
    assert asked_at and 0.9 < time.monotonic() - asked_at[0] < 60  # it waited for the release, not longer
    assert json.loads((tmp_path / ".preempt").read_text())["token"] == lease.token
    lease = Lease(tmp_path, 600, on_lost=lambda *_: None).acquire()
    out = run_cli("preempt", str(tmp_path), "--wait", "1", timeout=60)
    assert out.returncode == 0 and "still holds" in out.stdout, out.stdout  # the kubelet goes on regardless
    lease.release()


def test_preempt_command_stops_waiting_for_a_run_that_died(tmp_path):
    """A holder that ended without releasing its lease (SIGKILLed: `ray job stop` escalates after 3 s, and a
    deleted RayJob's pods get their preStop after that): the hook says so and returns instead of keeping the pod
    terminating for the whole grace period."""
    holder = "import os, sys; from app.lease import Lease; Lease(sys.argv[1], 600).acquire(); os._exit(0)"
    subprocess.run([sys.executable, "-c", holder, str(tmp_path)], check=True, timeout=60)
    t0 = time.monotonic()
    out = run_cli("preempt", str(tmp_path), "--wait", "120", timeout=180)
    assert out.returncode == 0 and "which has ended: it resumes from its last complete" in out.stdout, (
        out.stdout + out.stderr
    )
    assert time.monotonic() - t0 < 60


def test_grace_note(monkeypatch):
    monkeypatch.delenv(preemption.GRACE_ENV, raising=False)
    assert preemption.grace_note(10) is None  # not on Kubernetes: nothing to compare with
    monkeypatch.setenv(preemption.GRACE_ENV, "300")
    fits, text = preemption.grace_note(9.5)
    assert fits and "9.50 s" in text and "300 s grace period" in text
    fits, text = preemption.grace_note(200)
    assert not fits and "took 200 s" in text and "preemption.gracePeriodSeconds to at least 800" in text


def test_rays_worker_sigterm_handler_is_the_one_the_route_takes():
    """The pinned Ray's worker handler calls raise_sys_exit_with_custom_error_message (a module global, looked up
    at each call) with a message naming SIGTERM; a Ray bump that changes this fails here."""
    import ray._private.worker as ray_worker

    source = inspect.getsource(ray_worker.Worker.main_loop)
    assert "def sigterm_handler" in source and "raise_sys_exit_with_custom_error_message(" in source
    assert "SIGTERM" in source and callable(ray_worker.raise_sys_exit_with_custom_error_message)


@pytest.mark.parametrize("enabled", [True, False])
def test_chart_sets_the_grace_period_and_the_prestop_hook(enabled):
    objects = render(sets=[f"preemption.enabled={str(enabled).lower()}", "preemption.gracePeriodSeconds=120"])
    job = next(o for o in objects if o["kind"] == "RayJob")
    spec = job["spec"]["rayClusterSpec"]
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    experiment = job["metadata"]["name"]
    for pod in pods:
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        if enabled:
            assert pod["terminationGracePeriodSeconds"] == 120
            command = container["lifecycle"]["preStop"]["exec"]["command"]
            assert command[:2] == ["finetune", "preempt"] and command[2].endswith(f"/{experiment}"), command
            assert command[3:] == ["--wait", "115"] and env["FINETUNE_GRACE_PERIOD_S"] == "120"
        else:
            assert "terminationGracePeriodSeconds" not in pod and "lifecycle" not in container
            assert "FINETUNE_GRACE_PERIOD_S" not in env


def test_the_sigterm_route_holds_only_while_the_loop_runs(monkeypatch):
    """While the loop's thread runs, a rank's first SIGTERM becomes a preemption request; once the loop has ended
    (Ray stops finished workers with SIGTERM), Ray's handler exits the worker as before, with no preemption log."""
    import ray._private.worker as ray_worker

    monkeypatch.setattr(
        ray_worker, "raise_sys_exit_with_custom_error_message", ray_worker.raise_sys_exit_with_custom_error_message
    )  # restored after the test
    monkeypatch.setattr(preemption, "_requested", threading.Event())
    stop = threading.Event()
    loop = threading.Thread(target=stop.wait)
    loop.start()
    monkeypatch.setattr(preemption, "_loop_thread", loop)
    preemption._route_worker_sigterm()
    handler = ray_worker.raise_sys_exit_with_custom_error_message
    assert handler("The process receives a SIGTERM.", exit_code=1) is None
    assert preemption.requested_in_this_process()
    with pytest.raises(SystemExit):  # a second SIGTERM: Ray's own exit
        handler("The process receives a SIGTERM.", exit_code=1)
    monkeypatch.setattr(preemption, "_requested", threading.Event())
    stop.set()
    loop.join()
    with pytest.raises(SystemExit):  # the loop has ended: no request, Ray's exit
        handler("The process receives a SIGTERM.", exit_code=1)
    assert not preemption.requested_in_this_process()
