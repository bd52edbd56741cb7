"""One real control plane per test session (tests/e2e/controlplane.py), one namespace per test."""

from __future__ import annotations

import itertools
import signal
import time

import k8s_support
import pytest

from e2e.controlplane import ControlPlane

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
        print(f"\ncontrol plane: kubernetes {v['KUBERNETES_VERSION']}, etcd {v['ETCD_VERSION']}, "
              f"KubeRay {v['KUBERAY_VERSION']}; build/reuse {v['BUILD_SECONDS']} s, ready after {time.monotonic() - t0:.0f} s")
        yield cp
    finally:
        cp.stop()
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def namespace(cluster, request) -> str:
    """A fresh namespace per test (deleted afterwards without waiting; the control plane goes at session end)."""
    name = f"e2e-{next(_ids)}-{request.node.name.split('[')[0].removeprefix('test_').replace('_', '-')}"[:50].rstrip("-")
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
