"""`finetune`: validate, prepare, train, export, and build the offline tiny model and corpus."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import yaml

from app import config as config_mod
from app import logs, ops, preemption
from app.config import ConfigError, Problem
from app.data import files as data_files
from app.errors import seconds
from app.exit_codes import Exit, epilog
from app.lease import LeaseHeld

log = logging.getLogger("finetune")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="training config YAML (omit for the tutorial's defaults)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config value, e.g. --set train.epochs=2 (repeatable; value parsed as YAML)",
    )
    _add_verbose(p)


def _add_accept_changed(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--accept-changed",
        dest="accepted",
        action="extend",
        nargs="+",
        default=[],
        metavar="FIELD",
        help="continue the experiment's checkpoints although FIELD, which they depend on, changed since it started "
        "(the refusal lists them; logged and recorded); without it such a redeploy exits 2",
    )


def _add_verbose(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show every log line (libraries' info messages, Ray's internal ones); default: the quiet view",
    )


def _add_validate(sub) -> None:
    p = sub.add_parser(
        "validate",
        help="check a config; print it resolved and the final DeepSpeed config",
        description="Check a training config and print the resolved config and the DeepSpeed "
        f"config JSON. Exit {Exit.OK} when valid, {Exit.INVALID} with one line per problem otherwise.",
    )
    _add_config_args(p)
    _add_accept_changed(p)
    p.add_argument("--online", action="store_true", help="allow downloading the model config to check it")
    p.add_argument("--ds-config-only", action="store_true", help="print only the DeepSpeed config JSON")
    p.add_argument(
        "--gpus",
        type=_positive,
        metavar="N",
        help="choose the auto settings (ZeRO stage, pure bf16, checkpointing, micro-batch) and predict each GPU's "
        "memory for N GPU workers: --set scaling.num_workers=N (default: the config's)",
    )
    p.add_argument(
        "--gpu-memory",
        type=_memory_size,
        metavar="SIZE",
        help="for GPUs of this memory, e.g. 80GiB (H100) or 140GiB (H200; G and GiB binary, GB decimal): "
        "--set scaling.gpu_memory=SIZE (default: the config's). A config that would not fit exits "
        f"{Exit.INVALID} with the figures",
    )


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GPUs (a whole number >= 1)")
    return int(text)


def _memory_size(text: str) -> str:
    from app.resolve import parse_memory

    try:
        parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_prepare(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="prepare the data of a training config (Ray Data, every CPU of the cluster) and exit",
        description="Read, render, mask, tokenize and pack the data of a training config into a prepared dataset "
        "under <storage>/prepared/<key>/, on Ray Data over every CPU of the Ray cluster (RAY_ADDRESS, or a local "
        "one), unless one with the same key is there already; print where it is and its summary. `finetune train` "
        "with the same data, tokenizer and data settings then starts training at once, whatever its experiment name.",
    )
    _add_config_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune",
        description="Fine-tune causal language models with Ray Train and DeepSpeed ZeRO, on CPUs or a Ray cluster.",
        epilog=epilog(),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_validate(sub)
    _add_prepare(sub)

    p = sub.add_parser(
        "train",
        help="train (or resume) an experiment",
        description="Train, or resume the experiment of the same name from its last complete "
        "checkpoint. Validates first and writes nothing when the config is invalid.",
    )
    _add_config_args(p)
    _add_accept_changed(p)
    p.add_argument(
        "--re-export",
        action="store_true",
        help="when the experiment has finished, write final/ again from its last checkpoint",
    )

    p = sub.add_parser(
        "export",
        help="write a Hugging Face folder from a checkpoint or an experiment",
        description="Consolidate a DeepSpeed checkpoint (any ZeRO stage) into a Hugging Face "
        "folder with safetensors weights and the tokenizer.",
    )
    p.add_argument(
        "checkpoint",
        help="an experiment folder <storage>/<experiment> (its newest complete checkpoint) "
        "or one checkpoint, e.g. <storage>/<experiment>/checkpoints/step-00000030",
    )
    p.add_argument("out", help="output folder (must not exist, or be empty, unless --force)")
    p.add_argument("--force", action="store_true", help="replace the output folder when it exists")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="weights precision (default: training's)")
    p.add_argument(
        "--model",
        help="model folder or hub name giving config and tokenizer (for DeepSpeed checkpoints not written by this app)",
    )
    _add_verbose(p)

    p = sub.add_parser(
        "tiny",
        help="build the offline tiny GPT-2 model and text corpus",
        description="Write a tiny GPT-2-style model folder (random weights, BPE tokenizer trained "
        "offline) and a generated ag_news-like corpus, for runs without a hub.",
    )
    p.add_argument("--model-dir", default=".local/tiny-gpt2", help="model folder to create")
    p.add_argument("--corpus", default="examples/data/tiny-news.jsonl", help="corpus file (created if missing)")
    _add_verbose(p)

    p = sub.add_parser(
        "preempt",
        help="ask the run of an experiment to save its current step and stop",
        description="Ask the live run of an experiment folder to finish its optimizer step in "
        f"flight, write a checkpoint and stop (exit {Exit.PREEMPTED}), as a SIGTERM to the driver does. "
        "The chart runs this as the pods' preStop hook, before the kubelet's SIGTERM.",
    )
    p.add_argument("experiment_dir", help="the experiment folder, <storage>/<experiment>")
    p.add_argument(
        "--wait",
        type=seconds,
        default=0,
        metavar="SECONDS",
        help="then wait up to this long for the run to save and let go of its lease (default: do not wait)",
    )
    _add_verbose(p)
    ops.register(sub)  # status, logs, resume: operate a RayJob through the Kubernetes API
    return parser


def main(argv: list[str] | None = None) -> Exit:
    args = build_parser().parse_args(argv)
    logs.setup(getattr(args, "verbose", False))
    if args.command in ops.COMMANDS:
        return ops.main(args)
    try:
        commands = {
            "validate": cmd_validate,
            "prepare": cmd_prepare,
            "train": cmd_train,
            "export": cmd_export,
            "tiny": cmd_tiny,
            "preempt": cmd_preempt,
        }
        return commands[args.command](args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return Exit.INVALID
    except Problem as exc:
        print(f"error: {exc}", file=sys.stderr)
        return Exit.INVALID


def _load(args) -> config_mod.TrainingConfig:
    doc = config_mod.load_document(args.config, args.overrides)
    try:
        cfg = config_mod.parse(doc)
    except ConfigError as exc:
        raise ConfigError(exc.problems + _more_problems(doc, exc)) from None
    return _absolute(config_mod.resolve(cfg))


def _more_problems(doc: dict, error: ConfigError) -> list[Problem]:
    """What the checks before a run find in the rest of a config with invalid keys: every problem at once. Only
    problems of other keys (a key left at its default is not the user's)."""
    from app import preflight

    rest = config_mod.without_invalid(doc, error)
    if rest is None:
        return []
    found = preflight.problems(_absolute(config_mod.resolve(rest)), partial=True).problems
    named = {p.field for p in error.problems}
    return [p for p in found if p.field not in named]


def _absolute(cfg: config_mod.TrainingConfig) -> config_mod.TrainingConfig:
    cfg.experiment.storage_path = str(Path(cfg.experiment.storage_path).expanduser().absolute())
    # Workers run in other folders: local paths are made absolute here, where they were written.
    for section, key in (("model", "name_or_path"), ("model", "tokenizer"), ("data", "dataset")):
        value = getattr(getattr(cfg, section), key)
        if value and not value.startswith("/") and Path(value).expanduser().exists():
            setattr(getattr(cfg, section), key, str(Path(value).expanduser().absolute()))
    return cfg


def cmd_validate(args) -> Exit:
    from app import autoset, driver, preflight

    hardware = [f"scaling.num_workers={args.gpus}"] if args.gpus else []
    hardware += [f"scaling.gpu_memory={args.gpu_memory}"] if args.gpu_memory else []
    args.overrides = [*args.overrides, *hardware]  # what train reads: the printed configs then agree with them
    loaded = _load(args)
    if hardware and not loaded.scaling.use_gpu:
        flags = " ".join(f"--{f}" for f, v in (("gpus", args.gpus), ("gpu-memory", args.gpu_memory)) if v)
        raise Problem(
            flags, " ".join(hardware), "the config trains on CPU workers (scaling.use_gpu: false)", "leave it out"
        )
    cfg, ds, note, auto = driver.prepare(loaded, offline=not args.online, accepted=tuple(args.accepted))
    for line in (auto.note, note):
        if line:
            print(f"note: {line}", file=sys.stderr)
    for problem in preflight.resource_problems(cfg):  # validate may check a config meant for a cluster
        print(f"note: `finetune train` on this machine (no RAY_ADDRESS) would refuse: {problem}", file=sys.stderr)
    shown = [f"# {line}" for line in auto.lines + parallelism(cfg)]
    if args.ds_config_only:  # the JSON alone on standard output
        print("\n".join(shown), file=sys.stderr)
    else:
        print("\n".join([*shown, "# training config (resolved)"]))
        print(yaml.safe_dump(autoset.shown_config(cfg, auto), sort_keys=False), end="")
        print("# deepspeed config")
    print(json.dumps(autoset.shown_ds(ds, auto), indent=2))
    return Exit.OK


def cmd_prepare(args) -> Exit:
    from app import driver
    from app.data import pipeline

    cfg = _load(args)
    driver.check(cfg, offline=False)  # every check of a training run's start: nothing starts for a bad config
    # Ray only to prepare: a dataset already on the volume (its key's manifest) is reported without a cluster.
    folder, manifest = pipeline.ensure(cfg, before_preparing=lambda: driver.start_ray(cfg))
    print(f"prepared: {folder}")
    print(pipeline.summary(manifest))
    return Exit.OK


def cmd_train(args) -> Exit:
    from app import driver

    cfg, ds, note, auto = driver.prepare(_load(args), offline=False, with_ray=True, accepted=tuple(args.accepted))
    if note:
        raise ConfigError(
            [
                Problem(
                    "model.name_or_path",
                    cfg.model.name_or_path,
                    "cannot read the model config",
                    "check the name, the network or HF_HOME, or use a local folder",
                )
            ]
        )
    banner = f"experiment: {cfg.experiment.name}   (deploy again with this name to resume)"
    print("=" * len(banner), banner, f"storage:    {cfg.experiment_dir}", "=" * len(banner), sep="\n")
    print(summary(cfg, ds), *auto.lines, sep="\n", flush=True)  # what auto chose, and why
    try:
        finished = driver.finished_checkpoint(cfg)
        if finished:
            return finish_again(cfg, *finished, re_export=args.re_export)
        result = driver.run(cfg, ds, tuple(args.accepted))
    except LeaseHeld as exc:
        print(f"error: {exc}", file=sys.stderr)
        return Exit.LEASE_HELD
    except Problem:  # the data, found bad while it was prepared: a user error, before any training worker
        raise
    except Exception as exc:  # noqa: BLE001 - Ray already logged the workers' tracebacks
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        end_tracking(cfg, "FAILED", first)
        print(f"error: training of {cfg.experiment.name} failed: {first}", file=sys.stderr)
        then = (
            "change the setting it names, then deploy again"
            if isinstance(exc, driver.WorkerProblem)
            else "deploy again"
        )
        print(
            f"       completed checkpoints stay in {cfg.experiment_dir}/checkpoints; {then} to resume", file=sys.stderr
        )
        return Exit.FAILED
    final = cfg.experiment_dir / "final"
    if (final / "config.json").exists():
        share_like_the_rest(final)
    metrics = result.metrics or {}
    # Preempted, or stopped early (train.stop_after_steps): the run goes on when deployed again.
    end_tracking(cfg, "FINISHED" if driver.finished_checkpoint(cfg) else "KILLED")
    if metrics.get("preempted"):
        print(
            f"preempted at step {metrics.get('global_step')}, checkpoint written in {metrics.get('save_s')} s "
            f"({metrics.get('checkpoint')}); deploy again as {cfg.experiment.name} to resume at step "
            f"{(metrics.get('global_step') or 0) + 1}",
            file=sys.stderr,
        )
        return Exit.PREEMPTED
    print(
        f"done: {cfg.experiment.name} at global step {metrics.get('global_step')}, checkpoint "
        f"{metrics.get('checkpoint')}"
    )
    if (final / "model.safetensors").exists() or any(final.glob("*.safetensors")):
        print(f"final model: {final}")
        if cfg.scaling.use_gpu is False:
            d = cfg.data  # chat rows, or rows rendered with data.chat_template: the sample asks a question
            chat = d.format in ("chat", "preference") or (d.format == "auto" and bool(d.chat_template))
            print(f"sample: {sample_generation(final, chat=chat)}")
    return Exit.OK


def end_tracking(cfg: config_mod.TrainingConfig, status: str, error: str | None = None) -> None:
    """The MLflow run's end (when tracking is on), with the final model when there is one."""
    from app import tracking

    final = cfg.experiment_dir / "final"
    exported = final if status == "FINISHED" and any(final.glob("*.safetensors")) else None
    tracking.end_run(cfg.experiment_dir, cfg.tracking.mlflow.uri, status, error, exported)


def cmd_preempt(args) -> Exit:
    """Exit 0 in every case a preStop hook can meet (no run, a run that stops in time, or one that does not):
    it says which, and the kubelet goes on either way."""
    import socket

    from app.lease import Lease

    run_dir = Path(args.experiment_dir).expanduser().absolute()
    holder, _ = Lease(run_dir, 1).read()
    if not holder:
        print(f"no run holds {run_dir}: nothing to preempt")
        return Exit.OK
    token = holder.get("token")
    preemption.write_notice(run_dir, token, f"finetune preempt on {socket.gethostname()}")
    print(
        f"asked the run holding {run_dir} ({holder.get('host')} pid {holder.get('pid')}) to save its step in "
        "flight and stop",
        flush=True,
    )
    if args.wait <= 0:
        return Exit.OK
    ended = preemption.wait_for_release(run_dir, token, args.wait)
    if ended == "released":
        print(f"the run stopped and released {run_dir}")
    elif ended:
        print(f"the run holding {run_dir} {ended}: it resumes from its last complete checkpoint")
    else:
        print(f"the run still holds {run_dir} after {args.wait:.0f} s; it resumes from its last complete checkpoint")
    return Exit.OK


def parallelism(cfg: config_mod.TrainingConfig) -> list[str]:
    """How the workers split the work, where sequence parallelism is on (one line; none when it is off)."""
    s = cfg.scaling
    if s.sequence_parallel == 1:
        return []
    return [
        f"sequence parallel {s.sequence_parallel} x data parallel {s.data_parallel} = {s.num_workers} workers: each "
        f"sequence of {cfg.data.seq_length} tokens is split over {s.sequence_parallel} workers "
        f"({cfg.data.seq_length // s.sequence_parallel} tokens each), and {s.data_parallel} group(s) read their own "
        "batches"
    ]


def summary(cfg: config_mod.TrainingConfig, ds: dict) -> str:
    """The resolved config in two lines: what trains on what, and how."""
    t, s = cfg.train, cfg.scaling
    steps = f"{t.max_steps_per_epoch} steps" if t.max_steps_per_epoch else "all batches"
    # The numerics change with pure bf16 (no fp32 master weights): said where every run's settings are.
    precision = "pure bf16 (bf16 master weights)" if t.pure_bf16 is True else t.precision
    precision += ", activation checkpointing" if cfg.model.gradient_checkpointing is True else ""
    zero = ds.get("zero_optimization", {}).get("stage", 0)
    d = cfg.data
    if d.datasets:
        shown = ", ".join(f"{source.dataset} x{weight:g}" for source, weight in d.sources())
        what = f"a mixture of {len(d.datasets)} sources: {shown} ("
    else:
        splits = data_files.folder_splits(d.dataset, d.config_name, d.split)
        what = f"{d.dataset} ({splits + '; ' if splits else ''}"
    workers = f"{s.num_workers} {'GPU' if s.use_gpu else 'CPU'} workers"
    if s.sequence_parallel > 1:  # how the workers split: sequences across a group, batches across the groups
        workers += f" (sequence parallel {s.sequence_parallel} x data parallel {s.data_parallel})"
    return (
        f"model: {cfg.model.name_or_path}   data: {what}{d.seq_length} tokens/sequence)\n"
        f"train: {t.epochs} epoch(s) x {steps}, {workers}, ZeRO-{zero}, "
        f"{precision}, micro-batch {ds.get('train_micro_batch_size_per_gpu')} x accumulation "
        f"{ds.get('gradient_accumulation_steps')}, lr {t.learning_rate:g} ({t.lr_scheduler})"
    )


def finish_again(cfg: config_mod.TrainingConfig, checkpoint: Path, state: dict, re_export: bool) -> Exit:
    """A finished experiment deployed again: say so and stop, exporting its last checkpoint only when final/
    is missing (and wanted) or --re-export asks for it. No cluster starts."""
    final = cfg.experiment_dir / "final"
    exported = any(final.glob("*.safetensors"))
    print(f"{cfg.experiment.name} already finished: global step {state.get('global_step')}, checkpoint {checkpoint}")
    if re_export or (cfg.checkpoint.export_final and not exported):
        from app import driver

        print(f"exporting {checkpoint.name} to {final} ...", flush=True)
        share_like_the_rest(driver.export_final(cfg, checkpoint))
        exported = True
    if exported:
        print(f"final model: {final}")
    print(
        "nothing to train: raise train.epochs (or train.max_steps) to continue it, or use a new experiment name"
        + ("" if re_export else "; --re-export writes final/ again")
    )
    return Exit.OK


def share_like_the_rest(folder: Path) -> None:
    """transformers writes the weights through a private temporary file (mode 0600) while the config and the
    tokenizer get the umask's mode (0644): every file of an exported folder gets the config's mode, so whoever
    may read the model may read its weights (a serving pod under another user, a teammate)."""
    mode = (folder / "config.json").stat().st_mode & 0o777
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)


# The CPU examples' sample prompts: a news text to continue, and a question like those of the bundled chat data.
SAMPLE_TEXT = "The central bank"
SAMPLE_QUESTION = "Which section is this headline for? The central bank raises its rates again."


def sample_generation(folder: Path, chat: bool = False, tokens: int = 12) -> str:
    """The exported model's greedy continuation of SAMPLE_TEXT; for a chat run, its answer to SAMPLE_QUESTION
    rendered with the chat template it was trained with ('question' -> 'answer')."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    chat = chat and bool(tok.chat_template)
    turn = [{"role": "user", "content": SAMPLE_QUESTION}]
    text = tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) if chat else SAMPLE_TEXT
    ids = tok(text, add_special_tokens=not chat, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    if not chat:
        return repr(tok.decode(out[0], skip_special_tokens=True))
    return f"{SAMPLE_QUESTION!r} -> {tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()!r}"


def cmd_export(args) -> Exit:
    from app.checkpoint import export

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    src, out = export_source(Path(args.checkpoint), args.model), Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        raise Problem("OUT", str(out), "already exists", "choose a new folder, or pass --force to replace it")
    try:
        out = export(src, out, args.dtype, args.model)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: cannot export {src}: {exc}", file=sys.stderr)
        return Exit.FAILED
    share_like_the_rest(out)
    print(f"exported: {out}")
    return Exit.OK


def export_source(src: Path, model: str | None) -> Path:
    """The checkpoint to export: `src` itself, or an experiment folder's newest complete checkpoint."""
    from app.checkpoint import newest_usable

    hint = "pass <storage>/<experiment> or one of its checkpoints/step-NNNNNNNN"
    if not src.is_dir():
        raise Problem("CHECKPOINT", str(src), "no such folder", hint)
    if (src / "ds").is_dir() or model:
        return src
    newest = newest_usable(src) if (src / "checkpoints").is_dir() else None
    if newest is None:
        raise Problem(
            "CHECKPOINT",
            str(src),
            "is neither a checkpoint of this app (no ds/ inside) nor an experiment folder with a complete checkpoint",
            f"{hint}; for another DeepSpeed checkpoint add --model "
            "with the model folder or hub name it was trained from",
        )
    print(f"exporting {newest.name}, the newest complete checkpoint of {src}", file=sys.stderr)
    return newest


def cmd_tiny(args) -> Exit:
    from app.tiny import build_tiny_model, read_texts, write_corpus

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # transformers imports DeepSpeed, which warns when it finds no GPU
    corpus = Path(args.corpus)
    try:
        if not corpus.exists():
            write_corpus(corpus)
        texts = read_texts(corpus)
    except (OSError, UnicodeDecodeError) as exc:
        raise Problem(
            "--corpus",
            args.corpus,
            f"cannot be written or read ({_reason(exc)})",
            "choose a writable path, or leave it out for examples/data/tiny-news.jsonl",
        ) from None
    except ValueError as exc:
        raise Problem(
            "--corpus",
            args.corpus,
            str(exc),
            "pass such a file, or a path that does not exist yet (it is then generated)",
        ) from None
    try:
        out = build_tiny_model(Path(args.model_dir), texts)
    except OSError as exc:
        raise Problem(
            "--model-dir", args.model_dir, f"cannot be written ({_reason(exc)})", "choose a folder you can write to"
        ) from None
    print(f"tiny model: {out}\ncorpus: {corpus}")
    return Exit.OK


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or type(exc).__name__


def run() -> None:
    """The console script (and `python -m app.cli`): `main`, then an exit that skips the interpreter's teardown.

    Python's teardown of the modules a run imports (torch, transformers, Ray, datasets) is seconds of garbage
    collection (2.5 s after a CPU `finetune train`, measured) that nobody waits for on purpose. Everything a run
    writes is on storage by then; the exit handlers (logging's flush, Ray's shutdown of a local cluster, MLflow's)
    still run; see `_normal_exit_needed` for when the normal exit is kept."""
    import atexit
    import contextlib

    try:
        code = main()
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe or socket: a real error
        code = Exit.FAILED
    if _normal_exit_needed():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that went away (`finetune ... | head`)
            stream.flush()
    os._exit(code)


def _stdout_closed() -> bool:
    """Whether the reader of standard output went away (`finetune validate ... | head`: it has what it wanted)."""
    import select

    poll = select.poll()
    poll.register(sys.stdout.fileno(), select.POLLOUT)
    if not any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0)):
        return False  # POLLERR: the write end of a pipe whose read end is closed
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that no later flush fails again
    return True


def _normal_exit_needed() -> bool:
    """A thread that is not a daemon (the normal exit waits for it), or a profiler or tracer (cProfile, coverage),
    which writes what it gathered when the interpreter exits."""
    import threading

    monitoring = getattr(sys, "monitoring", None)  # Python 3.12+: cProfile and coverage register as tools there
    tools = [monitoring.get_tool(i) for i in range(6)] if monitoring else []
    return (
        any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread())
        or sys.getprofile() is not None
        or sys.gettrace() is not None
        or any(tools)
    )


if __name__ == "__main__":
    run()
