"""A first run a person can follow: the quiet view of a real run, --verbose, `finetune logs`, stale build locks,
an experiment deployed again after it finished, and export from an experiment folder."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, run_cli, tiny_overrides
from torch.utils.file_baton import FileBaton

from app import logs, opbuild

MAX_LINES = 40
# A user's defaults, not the suite's quieter ones (conftest sets TRANSFORMERS_VERBOSITY=error, no dedup).
USER_ENV = {"TRANSFORMERS_VERBOSITY": "warning", "RAY_DEDUP_LOGS": "1"}
RUN = {
    "train.max_steps_per_epoch": 16,
    "train.log_every_steps": 5,
    "checkpoint.every_steps": 10,
    "checkpoint.export_final": True,
    "data.eval_fraction": 0.05,
}
# What the issue found in a default run, each a line the quiet view must not show.
NOISE = (
    "PlacementGroupCleaner",
    "Disassembly of",
    "LOAD_",
    "TrainingReport(",
    "loss_type=None",
    "is deprecated",
    "Started a local Ray instance",
    "Token authentication",
    "it/s]",
    "Requesting resources",
)


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory, tiny_model):
    storage = tmp_path_factory.mktemp("storage")
    result = run_cli("train", *tiny_overrides(storage, "quiet", tiny_model, **RUN), env=USER_ENV)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return storage, tiny_model, result.stdout + result.stderr


@pytest.fixture(scope="module")
def verbose_run(tmp_path_factory, tiny_model):
    storage = tmp_path_factory.mktemp("storage")
    args = tiny_overrides(storage, "loud", tiny_model, **{**RUN, "train.stop_after_steps": 5})
    result = run_cli("train", *args, "--verbose", env=USER_ENV)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


def _modes(folder: Path) -> dict[str, str]:
    return {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()}


def test_a_default_run_of_16_steps_is_quiet(quiet_run):
    storage, _, out = quiet_run
    umask = os.umask(0o022)
    os.umask(umask)
    assert set(_modes(storage / "quiet" / "final").values()) == {oct(0o666 & ~umask)}  # the weights too
    lines = out.splitlines()
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines:\n{out}"
    for noise in NOISE:
        assert noise not in out, f"{noise!r} came back:\n{out}"
    for wanted in (
        "experiment: quiet",
        "model: ",
        "train: 1 epoch(s) x 16 steps, 2 CPU workers, ZeRO-3",
        "starting a local Ray cluster",
        "starting 2 training workers",
        "model and DeepSpeed engine ready",
        "step 5/16",
        "step 16/16",
        "checkpoint saved: ",
        "step-00000010",
        "exported Hugging Face model",
        "done: quiet at global step 16",
        "final model: ",
    ):
        assert wanted in out, f"{wanted!r} missing:\n{out}"


def test_verbose_shows_what_the_quiet_view_hides(verbose_run):
    out = verbose_run
    assert "TrainingReport(" in out and "Started a local Ray instance" in out and "step 5/16" in out
    # The quiet view of that full log (what `finetune logs` shows of a RayJob's driver) is the local one.
    shown = [s for s in (logs.view(line) for line in out.splitlines()) if s]
    assert len(shown) <= MAX_LINES and any("step 5/16" in s for s in shown), shown
    assert not [s for s in shown for noise in NOISE if noise in s], shown


def test_finetune_logs_shows_the_quiet_view_and_verbose_all(verbose_run, tmp_path, monkeypatch, capsys):
    from fake_k8s import FakeKube
    from test_ops import NS, RUNNING, finetune, rayjob

    server = FakeKube().start()
    try:
        monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        server.add_rayjob(rayjob(), status=RUNNING)
        server.add_pod(
            NS,
            "exp1-sub",
            {"batch.kubernetes.io/job-name": "exp1"},
            ["ray-job-submitter"],
            {"ray-job-submitter": verbose_run},
        )
        code, quiet, _ = finetune(capsys, "logs", "exp1")
        assert code == 0 and "step 5/16" in quiet and len(quiet.splitlines()) <= MAX_LINES, quiet
        assert not [n for n in NOISE if n in quiet], quiet
        code, everything, _ = finetune(capsys, "logs", "exp1", "--verbose")
        assert code == 0 and everything == verbose_run
    finally:
        server.stop()


def test_a_finished_experiment_deployed_again_says_so_and_stops(quiet_run):
    storage, model, _ = quiet_run
    final = storage / "quiet" / "final" / "model.safetensors"
    before = final.stat().st_mtime_ns
    started = time.monotonic()
    result = run_cli("train", *tiny_overrides(storage, "quiet", model, **RUN), env=USER_ENV)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "quiet already finished: global step 16" in out, out
    assert "starting a local Ray cluster" not in out and final.stat().st_mtime_ns == before
    assert time.monotonic() - started < 120  # no cluster, no training: the CLI start-up alone (loaded CI: ~20 s)
    # Asked to, it exports again (without a cluster); more epochs would train on.
    result = run_cli("train", *tiny_overrides(storage, "quiet", model, **RUN), "--re-export", env=USER_ENV)
    assert result.returncode == 0 and final.stat().st_mtime_ns != before, result.stdout + result.stderr
    assert len(set(_modes(final.parent).values())) == 1, _modes(final.parent)


def test_captured_disassembly_never_reaches_the_log():
    """The cause of the bytecode listings: dill scans a function's globals by capturing stdout around dis.dis(),
    and Ray Train's print patch logs every print() to the root logger even while stdout is captured."""
    code = (
        "import builtins, dill.detect\n"
        "from ray.train.v2._internal.logging.patch_print import redirected_print\n"
        "from app import logs\n"
        "logs.setup_worker(0)\n"
        "builtins.print = redirected_print\n"
        "def pack(batch):\n    return [x + 1 for x in batch]\n"
        "dill.detect.globalvars(pack)\n"
        "import logging; logging.getLogger('finetune').info('app line')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "app line" in done.stderr and "LOAD_" not in done.stderr and "RESUME" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    "line",
    [
        "\x1b[36m(PlacementGroupCleaner pid=9869)\x1b[0m Failed to query Ray Train Controller actor state.",
        (
            "(RayTrainWorker pid=9956) 2026-11-30 11:25:03 INFO /x/ray/train/v2/_internal/execution/context.py: "
            "Reporting training result 1: TrainingReport(checkpoint=Checkpoint(filesystem=local, path=/s/x/step-10))"
        ),
        "(RayTrainWorker pid=9956) 2026-11-30 11:24:48 INFO root:               8 LOAD_DEREF       8 (tokenizer)",
        (
            "(RayTrainWorker pid=9956) 2026-11-30 11:25:02 WARNING py.warnings: /t/c10d_logger.py:83: FutureWarning: "
            "`torch.distributed.reduce_scatter_tensor` is deprecated. \x1b[32m [repeated 591x across cluster]\x1b[0m"
        ),
        (
            "(RayTrainWorker pid=9956) 2026-11-30 11:25:02 WARNING transformers.modeling_utils: `loss_type=None` was "
            "set in the config but it is unrecognized. Using the default loss: `ForCausalLMLoss`."
        ),
        "(RayTrainWorker pid=9956) tokenize+pack: 100%|##########| 1900/1900 [00:00<00:00, 12531.59 examples/s]",
        (
            "(RayTrainWorker pid=9956) 2026-11-30 11:24:48 WARNING jax._src.xla_bridge: An NVIDIA GPU may be present "
            "on this machine, but a CUDA-enabled jaxlib is not installed. Falling back to cpu."
        ),
        "(TrainController pid=9651) Attempting to start training worker group of size 2 with the following resources",
        "(TrainController pid=3) Failed to send resource request for train-e00e. If this only happens transiently",
        "(TrainController pid=3) ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.",
        '(TrainController pid=3)   File "/x/ray/train/v2/_internal/execution/controller.py", line 1, in run',
        "2026-11-30 11:22:28,828\tINFO worker.py:2038 -- Started a local Ray instance.",
        "[2026-11-30 11:22:04,127] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
        # Seen on one H200 (docs/benchmarks.md's chat-pure run), each once per worker:
        "(RayTrainWorker pid=7) 2026-12-01 16:15:40 WARNING transformers.utils.generic: `use_return_dict` is "
        "deprecated! Use `return_dict` instead!",
        "(RayTrainWorker pid=7) 2026-12-01 16:15:41 WARNING liger_kernel.ops.backends: Backend impl "
        "'liger_kernel.ops.backends._cutedsl.rope' for op 'rope' could not be imported: ImportError: cutedsl backend "
        "requires the NVIDIA CUTLASS Python DSL (CuTe DSL).",
        "(RayTrainWorker pid=7) 2026-12-01 16:15:34 WARNING py.warnings: /x/torch/distributed/c10d_logger.py:83: "
        "UserWarning: barrier(): using the device under current context. You can specify `device_id` in "
        "`init_process_group` to mute this warning.",
    ],
)
def test_the_quiet_view_hides(line):
    assert logs.view(line) is None


@pytest.mark.parametrize(
    "line, shown",
    [
        (
            "(RayTrainWorker pid=1) 2026-11-30 11:25:02 INFO finetune: step 5/16 epoch 0 loss 6.0660",
            "11:25:02 step 5/16 epoch 0 loss 6.0660",
        ),
        (
            "(RayTrainWorker pid=2) 2026-11-30 11:25:02 WARNING finetune: resuming on 4 workers",
            "11:25:02 WARNING resuming on 4 workers  [RayTrainWorker]",
        ),
        (
            "(RayTrainWorker pid=2) 2026-11-30 11:25:02 ERROR torch.distributed: gloo timed out",
            "11:25:02 ERROR gloo timed out  [RayTrainWorker]",
        ),
        (
            "(TrainController pid=3) Training failed due to worker errors",
            "(TrainController) Training failed due to worker errors",
        ),
        (
            "experiment: quiet   (deploy again with this name to resume)",
            "experiment: quiet   (deploy again with this name to resume)",
        ),
        ("error: training of quiet failed: boom", "error: training of quiet failed: boom"),
    ],
)
def test_the_quiet_view_keeps(line, shown):
    assert logs.view(line) == shown


def test_stream_view_joins_lines_split_across_chunks():
    import io

    out = io.BytesIO()
    view = logs.StreamView(out, show_all=False)
    for chunk in (b"2026-11-30 11:25:02 INFO fine", b"tune: step 1/2\n(PlacementGroupCleaner pid=1) x\nend"):
        view.write(chunk)
    view.close()
    assert out.getvalue() == b"11:25:02 step 1/2\nend\n"


# Build locks (torch's FileBaton waits without a limit while its lock file exists).
def _planted(tmp_path: Path, age_s: float) -> Path:
    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    for name in ("build.ninja", "shm.o", "lock"):
        (folder / name).write_text("x")
        os.utime(folder / name, (time.time() - age_s,) * 2)
    return folder


def test_a_stale_build_lock_is_moved_aside_and_torch_can_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = _planted(tmp_path, age_s=opbuild.STALE_AFTER_S + 60)
    assert opbuild.build_folder("deepspeed_shm_comm") == folder
    started = time.monotonic()
    opbuild.prepare(cpu_workers=True, offloaded_optimizer=False, announce=True)
    assert time.monotonic() - started < 5
    assert not (folder / "lock").exists() and list(folder.glob("lock.stale-*"))
    assert FileBaton(str(folder / "lock")).try_acquire()  # torch's own lock: a build can start now


def test_a_live_build_is_waited_for_but_not_forever(tmp_path):
    folder = _planted(tmp_path, age_s=0)
    (folder / "lock").unlink()
    baton = FileBaton(str(folder / "lock"))  # a live build: torch holds the lock open while it builds
    assert baton.try_acquire() and opbuild.held_open(folder / "lock")
    threading.Timer(0.5, baton.release).start()  # ... and finishes
    assert opbuild.clear_stale_lock(folder, stale_after_s=30, poll_s=0.1) is None
    assert not list(folder.glob("lock.stale-*"))
    assert baton.try_acquire()  # a build that hangs (or is held where it cannot be seen): bounded by stale_after_s
    started = time.monotonic()
    moved = opbuild.clear_stale_lock(folder, stale_after_s=1.0, poll_s=0.1)
    assert moved and "nothing in" in moved and 0.5 < time.monotonic() - started < 5
    os.close(baton.fd)


def test_a_fresh_lock_that_no_process_holds_is_stale_at_once(tmp_path):
    folder = _planted(tmp_path, age_s=0)  # a build killed a moment ago
    started = time.monotonic()
    moved = opbuild.clear_stale_lock(folder, stale_after_s=300, poll_s=0.1)
    assert moved and "no process holds it" in moved and time.monotonic() - started < 5


def test_a_lock_taken_afresh_while_a_stale_one_is_judged_is_left_alone(tmp_path, monkeypatch):
    """Two ranks find the same stale lock: the first moves it aside and takes a fresh one for its build; the
    second, which judged the old one, must not move the fresh one (its holder's release would fail)."""
    folder = _planted(tmp_path, age_s=opbuild.STALE_AFTER_S + 60)
    lock = folder / "lock"
    fresh = FileBaton(str(lock))
    calls = []

    def other_rank_meanwhile(path):
        calls.append(path)
        if len(calls) == 1:  # while this rank scans /proc: the other moves the stale lock and takes a new one
            os.replace(path, folder / "lock.stale-by-the-other-rank")
            assert fresh.try_acquire()
            return None  # holders unknown: the judgement falls back to the (old) folder activity
        if len(calls) == 2:
            threading.Timer(0.3, fresh.release).start()  # the other rank's build finishes
        return True

    monkeypatch.setattr(opbuild, "held_open", other_rank_meanwhile)
    assert opbuild.clear_stale_lock(folder, poll_s=0.1) is None
    assert len(calls) >= 2 and not lock.exists()  # released by its holder, without an error
    assert [p.name for p in folder.glob("lock.stale-*")] == ["lock.stale-by-the-other-rank"]


def test_builds_use_this_environments_ninja(monkeypatch):
    """Two ninja versions taking turns on one build folder rebuild the op at every start."""
    import shutil

    own = Path(sys.executable).parent / "ninja"
    if not own.exists():
        pytest.skip("this environment has no ninja of its own")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    opbuild.use_this_environments_ninja()
    assert shutil.which("ninja") == str(own)


def test_export_takes_an_experiment_folder_and_never_overwrites_silently(quiet_run, tmp_path):
    storage, _, _ = quiet_run
    out = tmp_path / "hf"
    result = run_cli("export", str(storage / "quiet"), str(out))
    assert result.returncode == 0, result.stderr
    assert "exporting step-00000016, the newest complete checkpoint" in result.stderr, result.stderr
    assert (out / "model.safetensors").exists() and len(set(_modes(out).values())) == 1, _modes(out)
    again = run_cli("export", str(storage / "quiet"), str(out))
    assert again.returncode == 2 and "OUT: already exists" in again.stderr and "--force" in again.stderr, again.stderr
    assert run_cli("export", str(storage / "quiet"), str(out), "--force").returncode == 0
    not_one = run_cli("export", str(storage), str(tmp_path / "other"))  # the storage root is no experiment
    assert not_one.returncode == 2 and "nor an experiment folder with a complete checkpoint" in not_one.stderr
    assert not (tmp_path / "other").exists()


def test_opbuild_names_the_ops_it_knows_when_given_another(capsys):
    """`python -m app.opbuild` (make setup's last step) refuses an unknown op with the list, exit 2."""
    with pytest.raises(SystemExit) as exited:
        opbuild.main(["shm"])
    assert exited.value.code == 2
    assert "unknown op 'shm'; the ops are cpu_adam, deepspeed_shm_comm" in capsys.readouterr().err
