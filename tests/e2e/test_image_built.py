"""The image that `make image` built from the Dockerfile (tools/image/build.sh) and pushed to the local registry,
checked from the inside: the CLI runs as uid 1000, pip finds no conflict, uid 1000 has no way to root (no sudo
rule, no setuid or setgid file), and DeepSpeed's CPU Adam and the CPU workers' shared-memory op are prebuilt.
The user and file checks also run on the stand-in base, which has what the Dockerfile removes, so a check that
cannot fail would show. No control plane needed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.request

import pytest

from e2e import image

# A cold build (no cache) takes about 30 minutes on 2 cores; make e2e builds before the suite starts.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

# Who can become root through sudo without a password: the base's rule and the sudo group's, with NOPASSWD.
SUDO_RULES = r"grep -rhsE '^(ray|%users|%sudo)[[:space:]].*NOPASSWD' /etc/sudoers /etc/sudoers.d || true"
SETUID = ["find", "/", "-xdev", "-type", "f", "-perm", "/6000"]


@pytest.fixture(scope="module")
def built() -> dict[str, str]:
    return image.build()


@pytest.fixture(scope="module")
def ctr(built):
    with image.Container(built["IMAGE_LOCAL"], built["CONTAINERS_STORAGE_CONF"]) as c:
        yield c


@pytest.fixture(scope="module")
def base(built):
    with image.Container(built["BASE_LOCAL"], built["CONTAINERS_STORAGE_CONF"]) as c:
        yield c


def test_pushed_to_the_registry_as_built(built):
    """The registry serves the tag at the digest the build pushed, and its config is the image's (user, labels)."""
    started = image.registry("start")["REGISTRY_STARTED"]
    try:
        out = subprocess.run(
            ["skopeo", "inspect", "--tls-verify=false", f"docker://{built['IMAGE']}"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    finally:
        if started == "1":
            image.registry("stop")
    remote = json.loads(out.stdout)
    assert remote["Digest"] == built["IMAGE_DIGEST"]
    assert remote["Labels"]["org.opencontainers.image.title"] == "ray-finetune"
    local = image.buildah(built["CONTAINERS_STORAGE_CONF"], "inspect", "--type", "image", built["IMAGE_LOCAL"])
    cfg = json.loads(local.stdout)["OCIv1"]["config"]
    assert cfg["User"] == "1000:100" and cfg["Cmd"] == ["finetune", "--help"] and not cfg.get("Entrypoint"), cfg


def test_finetune_runs_as_uid_1000(ctr):
    out = ctr.run("bash", "-c", "id -u; id -g; finetune --help").stdout.split("\n", 2)
    assert out[:2] == ["1000", "100"], out
    assert "train" in out[2] and "validate" in out[2], out[2]
    checked = ctr.run("finetune", "validate", "examples/local-cpu.yaml").stdout
    assert "local-cpu-demo" in checked, checked


def test_pip_check_finds_no_conflict(ctr):
    proc = ctr.run("pip", "check", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_setuid_or_setgid_file(ctr, base):
    assert ctr.run(*SETUID, user="0:0").stdout.split() == []
    assert "/usr/bin/sudo" in base.run(*SETUID, user="0:0").stdout.split(), "the base's sudo is setuid"


def test_uid_1000_has_no_sudo(ctr, base):
    assert ctr.run("bash", "-c", SUDO_RULES, user="0:0").stdout.strip() == ""
    # The groups /etc/group gives the user (what a runtime adds for uid 1000), not those of this buildah run.
    assert "sudo" not in ctr.run("id", "-nG", "ray").stdout.split()
    denied = ctr.run("sudo", "-n", "true", check=False)
    assert denied.returncode != 0, denied.stdout + denied.stderr
    # The same checks on the stand-in base find its rule, and sudo takes uid 1000 to root there.
    assert base.run("bash", "-c", SUDO_RULES, user="0:0").stdout.strip() == "ray ALL=NOPASSWD: ALL"
    assert "sudo" in base.run("id", "-nG", "ray").stdout.split()
    assert base.run("sudo", "-n", "id", "-u").stdout.strip() == "0"


# DeepSpeed loads a prebuilt op only when the accelerator at run time is the one it was built for (cuda);
# TORCH_EXTENSIONS_DIR is where a JIT build would write, so it must stay absent.
CPU_ADAM = """
import os, torch
from deepspeed.git_version_info import installed_ops, accelerator_name
from deepspeed.ops.adam import DeepSpeedCPUAdam
assert installed_ops["cpu_adam"] and accelerator_name == "cuda", (installed_ops, accelerator_name)
p = torch.nn.Parameter(torch.ones(8))
opt = DeepSpeedCPUAdam([p], lr=0.1)
p.grad = torch.ones(8)
opt.step()
assert float(p[0]) < 1.0, p
assert not os.path.exists(os.environ["TORCH_EXTENSIONS_DIR"]), "a JIT build ran"
print("cpu_adam prebuilt", installed_ops.get("fused_adam"))
"""


def test_cpu_adam_is_prebuilt(ctr):
    out = ctr.run("env", "DS_ACCELERATOR=cuda", "TORCH_EXTENSIONS_DIR=/tmp/jit", "python", "-c", CPU_ADAM).stdout
    # fused Adam (CUDA) is not prebuilt by make image: its builder has no nvcc (BUILD_FUSED_ADAM=0).
    assert "cpu_adam prebuilt False" in out, out


# DeepSpeed's shared-memory collectives of CPU workers: a load finds the image's build up to date.
SHM_COMM = """
import glob, os, time
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
(so,) = glob.glob(os.path.expanduser("~/.cache/torch_extensions/*/deepspeed_shm_comm/deepspeed_shm_comm.so"))
before, t0 = os.stat(so).st_mtime, time.time()
ShareMemCommBuilder().load(verbose=False)
print("shm_comm", "rebuilt" if os.stat(so).st_mtime != before else "prebuilt", f"{time.time() - t0:.1f} s")
"""


def test_shared_memory_op_of_cpu_workers_is_prebuilt(ctr):
    out = ctr.run("env", "DS_ACCELERATOR=cpu", "python", "-c", SHM_COMM).stdout
    assert "shm_comm prebuilt" in out, out


def test_registry_starts_once_and_stops_without_leftovers(tmp_path):
    """registry.sh on a cache and port of its own: a second start finds it running, stop ends the process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"FINETUNE_E2E_CACHE": str(tmp_path), "FINETUNE_E2E_REGISTRY_PORT": str(port)}
    first = image.registry("start", env)
    assert first == {"REGISTRY": f"127.0.0.1:{port}", "REGISTRY_STARTED": "1"}, first
    pidfile = tmp_path / "image" / "registry" / "registry.pid"
    pid = int(pidfile.read_text())
    try:
        assert image.registry("start", env)["REGISTRY_STARTED"] == "0"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=10) as answer:
            assert answer.status == 200
    finally:
        image.registry("stop", env)
    assert not pidfile.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=5)
