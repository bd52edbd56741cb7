"""One real control plane per test session (tests/e2e/controlplane.py), one namespace per test."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time
from pathlib import Path

import k8s_support
import pytest

from e2e.controlplane import REPO, ControlPlane
from e2e.podrunner import PodRunner

_ids = itertools.count()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def cluster():
    # SIGTERM (CI cancelling the job) unwinds like Ctrl-C, so this fixture's teardown stops the processes.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    cp = ControlPlane(kubectl_bin=k8s_support.tool("kubectl"), helm_bin=k8s_support.tool("helm"))
    try:
        t0 = time.monotonic()
        cp.start()
        v = cp.versions
        print(
            f"\ncontrol plane: kubernetes {v['KUBERNETES_VERSION']}, etcd {v['ETCD_VERSION']}, "
            f"KubeRay {v['KUBERAY_VERSION']}; build/reuse {v['BUILD_SECONDS']} s, ready after "
            f"{time.monotonic() - t0:.0f} s"
        )
        yield cp
    finally:
        cp.stop()
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def namespace(cluster, request) -> str:
    """A fresh namespace per test (deleted afterwards without waiting; the control plane goes at session end)."""
    name = f"e2e-{next(_ids)}-{request.node.name.split('[')[0].removeprefix('test_').replace('_', '-')}"[:50].rstrip(
        "-"
    )
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def pod_runner(cluster, namespace):
    """A Node whose pods run (tests/e2e/podrunner.py), for the test's namespace only. Afterwards it kills
    every process of its pods and removes their network namespaces, links, mount points and folders, and
    fails the test if anything is left."""
    runner = PodRunner(cluster, [namespace]).start()
    try:
        yield runner
    finally:
        left = runner.stop()
    assert not runner.errors, "pod runner errors:\n" + "\n".join(runner.errors)
    assert not left, f"left behind after the test: {left}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny GPT-2-style model of `make run`, built once (about 15 s); tests copy it onto the claim, where
    examples/values-cpu.yaml reads it."""
    out = tmp_path_factory.mktemp("tiny") / "tiny-gpt2"
    subprocess.run(
        [
            str(Path(sys.executable).with_name("finetune")),
            "tiny",
            "--model-dir",
            str(out),
            "--corpus",
            str(REPO / "examples" / "data" / "tiny-news.jsonl"),
        ],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    return out
