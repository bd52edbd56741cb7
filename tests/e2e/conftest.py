"""One real cluster per test session: the control plane of tests/e2e/controlplane.py with the real node of
tests/e2e/node.py (containerd, the kubelet, kube-proxy, CoreDNS), whose pods run the image `make image` built;
one namespace per test."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import k8s_support
import pytest

from e2e import image
from e2e.controlplane import REPO, ControlPlane
from e2e.node import Node

_ids = itertools.count()


@pytest.hookimpl(trylast=True)  # after tests/conftest.py's longest-first order, which would undo this one
def pytest_collection_modifyitems(items):
    """Tests marked before_node stage leftovers of a node on the host: they run before the session's node starts
    (a stable sort keeps every other test's order)."""
    items.sort(key=lambda item: item.get_closest_marker("before_node") is None)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def real_node():
    """The node and its control plane, started once; at the end everything is stopped and the session fails if
    anything is left on the machine (a process, mount, cgroup, nft table, bridge, sysctl or file)."""
    # SIGTERM (CI cancelling the job) unwinds like Ctrl-C, so this fixture's teardown stops the processes.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.monotonic()
    node = Node(k8s_support.tool("kubectl"), k8s_support.tool("helm"), app_image=image.build())
    try:
        node.start()
        v = node.cluster.versions
        print(
            f"\ncluster: kubernetes {v['KUBERNETES_VERSION']}, etcd {v['ETCD_VERSION']}, KubeRay "
            f"{v['KUBERAY_VERSION']}, image {node.app_ref}; ready after {time.monotonic() - t0:.0f} s "
            f"({json.dumps({k: round(t, 1) for k, t in node.timings.items()})})"
        )
        yield node
    finally:
        left = node.stop()
        signal.signal(signal.SIGTERM, previous)
        print(f"\nnode teardown: {node.timings.get('teardown_s', 0):.1f} s")
    assert not left, f"left behind after the node stopped: {left}"


@pytest.fixture(scope="session")
def cluster(real_node) -> ControlPlane:
    return real_node.cluster


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
def node(real_node, namespace) -> Node:
    """The real node, running the pods of the test's namespace (other tests' pods stay Pending: the node's
    taint)."""
    real_node.admit(namespace)
    return real_node


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
