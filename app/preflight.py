"""Every check before a run, in one pass: `problems` runs each domain's checks once, in a fixed order, for
`finetune validate`, `prepare` and `train` alike, before any cluster starts. The domains keep their checks:
app.ds_config the deepspeed block against the other sections, app.data and app.chat a data source and a sample of
its rows, app.model the model's settings against its config and the workers (seq_length, packing, compile,
attention, FP8, LoRA). The checks here cost milliseconds: the config as plain data, the storage folder, the model
and tokenizer files, the splits and fractions of local data, what DeepSpeed itself would refuse only at
`initialize`, and whether the machine a local Ray cluster starts on can ever hold the workers asked for. Also the
one place that turns Ray's "the worker group could not be placed" into one line naming the request and what the
cluster offers.

Every check reads files or a few numbers; none starts a process. What only the workers can judge (a hub model
when the hub is unreachable, a hub dataset's splits) is left to them.
"""

from __future__ import annotations

import codecs
import errno
import json
import math
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from app import data, ds_config, sequence_parallel
from app.config import SOURCE_KEYS, DataConfig, TrainingConfig, stand_ins
from app.data import chat
from app.data import files as data_files
from app.errors import Problem
from app.model import (
    attention_problems,
    check_seq_length,
    compile_problems,
    fp8_model_problems,
    load_model_config,
    lora_problems,
    model_source,
    packed_documents_problems,
)

# Ray Train's wait for the worker group's placement (its default is 60 s, then it retries without limit).
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


class Found(NamedTuple):
    """What the pass found: every problem, the model's transformers config (None where it cannot be read here) and
    a note saying why not."""

    problems: list[Problem]
    model_config: Any
    note: str | None


def problems(
    cfg: TrainingConfig,
    offline: bool = True,
    local_cluster: bool = False,
    before: list[Problem] | None = None,
    partial: bool = False,
    model: tuple[Any, list[Problem], str | None] | None = None,
) -> Found:
    """Every check before a run, each once, in this order: the deepspeed block against the other sections, the config
    as plain data, the storage folder, each data source, the model's and the tokenizer's files, the deepspeed block's
    own keys, this machine's GPUs and CPUs when a local Ray cluster starts here (`local_cluster`); then, with the
    model's config, seq_length against its context, packed documents, compile, the attention kernel and, when
    nothing else was found (`before` included: the resume plan's problems), FP8's layers and LoRA's targets on the
    meta-device model. The hub is asked only when `offline` is false. `partial`: `cfg` is what is left of a config
    with invalid keys, their defaults in their place: only the checks of one setting each run, so that no rule
    between settings blames a default the user never chose. `model`: read_model_config's answer where the caller
    read it already (app.autoset, for the auto settings), so that it is read once."""
    whole = not partial
    found = list(before or []) + (ds_config.check(cfg) if whole else [])
    found += plain_data_problems(cfg) + storage_problems(cfg.experiment.storage_path) + data_problems(cfg)
    weights = model_problems(cfg, offline)
    found += weights + tokenizer_setting_problems(cfg, offline, model_found=bool(weights)) + deepspeed_problems(cfg)
    if whole and local_cluster:
        found += resource_problems(cfg)
    # A model folder found lacking is not read: model_problems has named what it lacks.
    if weights:
        mc, unread, note = None, [], None
    else:
        mc, unread, note = model if model is not None else read_model_config(cfg, offline)
    found += unread + (check_seq_length(cfg.data.seq_length, mc) if mc is not None else [])
    if not whole:
        return Found(found, mc, note)
    found += compile_problems(cfg) + attention_problems(cfg) + sequence_parallel.problems(cfg, mc)
    if mc is not None:
        found += packed_documents_problems(cfg.data, mc)
    if not found and cfg.model.fp8 and mc is not None:
        found += fp8_model_problems(cfg, mc)
    if not found and cfg.model.lora is not None and mc is not None:
        found += lora_problems(cfg.model, mc)
    return Found(found, mc, note)


def read_model_config(cfg: TrainingConfig, offline: bool) -> tuple[Any, list[Problem], str | None]:
    """The transformers model config (None when it cannot be read now), the problem of a local folder that holds
    none, and a note when it cannot be read now (offline, or a hub that does not answer)."""
    source, _ = model_source(cfg.model.name_or_path)
    local = data_files.is_local(source)
    try:
        if offline and not local:
            from transformers import AutoConfig

            mc = AutoConfig.from_pretrained(
                source, local_files_only=True, trust_remote_code=cfg.model.trust_remote_code
            )
        else:
            mc = load_model_config(cfg.model)
    except Exception as exc:  # noqa: BLE001 - any failure here means "cannot read it now"
        if local:
            reason = f"not a model folder ({type(exc).__name__})"
            return (
                None,
                [Problem("model.name_or_path", cfg.model.name_or_path, reason, "point it at a from_pretrained folder")],
                None,
            )
        return (
            None,
            [],
            (
                f"model config of '{cfg.model.name_or_path}' is not available offline: seq_length and the "
                "model-shape 'auto' values are checked at run start"
            ),
        )
    return mc, [], None


# --- the config, the storage folder and the data sources ------------------------------------------------------


def plain_data_problems(cfg: TrainingConfig) -> list[Problem]:
    """The config must be plain JSON data: the deepspeed block becomes DeepSpeed's config file."""
    try:
        json.dumps(cfg.model_dump(mode="json"), ensure_ascii=False).encode()
        json.dumps(cfg.deepspeed.to_dict(), allow_nan=True)
    except (TypeError, ValueError) as exc:  # a date, bytes, a lone surrogate, a YAML anchor that contains itself
        return [
            Problem(
                "CONFIG",
                "...",
                f"is not plain text and JSON data: {exc}",
                "use only mappings, lists, UTF-8 strings, numbers, booleans and null (quote dates)",
            )
        ]
    return []


def storage_problems(storage_path: str) -> list[Problem]:
    """Is the storage path (or its nearest existing parent) a writable folder? Leaves nothing behind."""
    from app.checkpoint.layout import nearest_existing

    field = "experiment.storage_path"
    try:
        probe = nearest_existing(Path(storage_path).expanduser())
    except OSError as exc:
        return [Problem(field, storage_path, f"is not a usable path ({exc.strerror})", "use a shorter folder path")]
    if not probe.is_dir():
        return [
            Problem(
                field, storage_path, f"{probe} is not a folder", "point it at a folder (a mounted volume on Kubernetes)"
            )
        ]
    try:
        # O_TMPFILE: an unnamed file, so the check never leaves an entry in the folder.
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        reason = "read-only" if exc.errno == errno.EROFS else exc.strerror
        return [
            Problem(
                field, storage_path, f"{probe} is not writable ({reason})", "mount it read-write or choose another path"
            )
        ]
    return []


def data_problems(cfg: TrainingConfig) -> list[Problem]:
    """Each data source's: a chat template's name, its files, columns and a sample of its rows (app.data), and its
    splits and fractions; a mixture's sources under their own keys."""
    found = []
    for n, (source, _) in enumerate(cfg.data.sources()):
        try:
            own = [p for p in [chat.template_name_problem(source)] if p] or data.check_source(
                source, cfg.model, preference=cfg.preference is not None
            )
        except OSError as exc:  # e.g. a folder under /proc, or one that vanishes while it is listed
            own = [Problem("data.dataset", source.dataset, f"cannot be listed ({exc})", "point it at your data files")]
        named = {p.field for p in own}  # e.g. a saved DatasetDict's missing split, found by check_source
        own += [p for p in split_problems(cfg.model_copy(update={"data": source})) if p.field not in named]
        found += in_source(own, cfg.data, n)
    return found


def in_source(problems: list[Problem], d: DataConfig, n: int) -> list[Problem]:
    """The problems of a mixture's source n under its own keys (data.datasets[n].split); as they are for the
    single source of data.dataset."""
    if not d.datasets:
        return problems
    out = []
    for p in problems:
        key = p.field.removeprefix("data.")
        field = f"data.datasets[{n}].{key}" if key in SOURCE_KEYS else p.field
        out.append(Problem(field, p.value, p.message, p.fix))
    return out


# --- model and tokenizer -----------------------------------------------------------------------------------

WEIGHTS = ("model.safetensors", "pytorch_model.bin")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# What transformers' tokenizers load their vocabulary from (tokenizer_config.json alone is not a tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.txt")


def looks_local(name: str) -> bool:
    """A folder path rather than a hub name ('name' or 'owner/name')."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.path.exists(os.path.expanduser(name))


def model_problems(cfg: TrainingConfig, offline: bool) -> list[Problem]:
    """model.name_or_path: a URL, a local folder without what from_pretrained reads, or (online) a hub name the hub
    does not know."""
    source, random_init = model_source(cfg.model.name_or_path)
    if remote := data_files.url_problem("model.name_or_path", cfg.model.name_or_path, source, "the model folder"):
        return [remote]
    if looks_local(source):
        return model_folder_problems(Path(source).expanduser(), cfg.model.name_or_path, random_init)
    return [] if offline else hub_problems(source, "model.name_or_path", weights=not random_init)


def tokenizer_setting_problems(cfg: TrainingConfig, offline: bool, model_found: bool) -> list[Problem]:
    """model.tokenizer's files or hub name; unset, the model folder's tokenizer files (unless `model_found`
    problems with the folder already)."""
    source, _ = model_source(cfg.model.name_or_path)
    tokenizer = cfg.model.tokenizer
    if tokenizer and looks_local(tokenizer):
        return tokenizer_problems(Path(tokenizer).expanduser(), "model.tokenizer", tokenizer)
    if tokenizer and not offline:
        return hub_problems(tokenizer, "model.tokenizer", weights=False)
    if not tokenizer and looks_local(source) and not model_found:
        return tokenizer_problems(
            Path(source).expanduser(), "model.name_or_path", cfg.model.name_or_path, "or set model.tokenizer"
        )
    return []


def model_folder_problems(folder: Path, value: str, random_init: bool) -> list[Problem]:
    field = "model.name_or_path"
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "no such folder"
        return [Problem(field, value, what, "point it at a from_pretrained folder (config.json and weights)")]
    if not (folder / "config.json").is_file():
        if (folder / "adapter_config.json").is_file():
            return [_adapter_problem(folder, value)]
        return [Problem(field, value, "the folder has no config.json", "point it at a from_pretrained folder")]
    if random_init:
        return []  # random-init: builds from config.json alone
    for index in INDEXES:
        if (folder / index).is_file():
            return _index_problems(folder, index, value)
    single = [folder / name for name in WEIGHTS if (folder / name).is_file()]
    if not single:
        return [
            Problem(
                field,
                value,
                f"the folder has config.json but no weights ({', '.join(WEIGHTS + INDEXES)})",
                "copy the weight files in, or write random-init:<folder> to train from freshly initialised weights",
            )
        ]
    return _safetensors_problems(single[0], value)


def _adapter_problem(folder: Path, value: str) -> Problem:
    """A PEFT adapter (final/adapter/ of a LoRA run) is no model: its base, or the merged model, is."""
    try:
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    merged = folder.parent if (folder.parent / "config.json").is_file() else None
    where = f"its base model ({base})" if isinstance(base, str) and base else "its base model"
    return Problem(
        "model.name_or_path",
        value,
        "is a LoRA adapter (adapter_config.json), not a model",
        f"point it at {where}" + (f", or at the merged model beside it ({merged})" if merged else ""),
    )


def _index_problems(folder: Path, index: str, value: str) -> list[Problem]:
    field = "model.name_or_path"
    try:
        shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [Problem(field, value, f"{index} is not a weight index ({type(exc).__name__})", "download it again")]
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        listed = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return [
            Problem(
                field,
                value,
                f"{index} names {len(shards)} shards; {len(missing)} missing: {listed}",
                "download the missing shards (an interrupted download?)",
            )
        ]
    return [p for s in shards if s.endswith(".safetensors") for p in _safetensors_problems(folder / s, value)][:1]


def _safetensors_problems(path: Path, value: str) -> list[Problem]:
    """A safetensors file whose size differs from what its header says is cut short (an interrupted copy)."""
    if path.suffix != ".safetensors":
        return []
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(size - 8, 100 << 20):
                raise ValueError("header length beyond the file")
            header = json.loads(f.read(length))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        return [
            Problem("model.name_or_path", value, f"{path.name} is not a safetensors file ({exc})", "download it again")
        ]
    if 8 + length + end != size:
        return [
            Problem(
                "model.name_or_path",
                value,
                f"{path.name} is {size:,} bytes but its header describes {8 + length + end:,}",
                "download it again (the copy was cut short)",
            )
        ]
    return []


def tokenizer_problems(folder: Path, field: str, value: str, alternative: str = "") -> list[Problem]:
    fix = f"point it at a folder with a tokenizer (save_pretrained of one){' ' + alternative if alternative else ''}"
    if not folder.is_dir():
        return [Problem(field, value, "is a file, not a folder" if folder.exists() else "no such folder", fix)]
    if any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return []
    if (folder / "vocab.json").is_file():
        if (folder / "merges.txt").is_file():
            return []
        return [Problem(field, value, "the tokenizer has vocab.json but no merges.txt", fix)]
    return [Problem(field, value, f"the folder has no tokenizer files ({', '.join(TOKENIZER_FILES)}, ...)", fix)]


def hub_problems(name: str, field: str, weights: bool) -> list[Problem]:
    """A hub repository that does not exist, is gated, or holds no weights; asked only when the hub answers within
    a few seconds (otherwise the workers find out, as they would anyway)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return []
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        files = [s.rfilename for s in HfApi().model_info(name, timeout=5).siblings or []]
    except GatedRepoError:
        return [Problem(field, name, "is a gated model", "accept its terms on the hub and set HF_TOKEN")]
    except RepositoryNotFoundError:
        return [Problem(field, name, "no such model on the hub (or it is private)", "check the name, or set HF_TOKEN")]
    except Exception:  # noqa: BLE001 - unreachable hub, proxy, rate limit: left to the workers
        return []
    if weights and not any(f.endswith((".safetensors", ".bin")) for f in files):
        return [Problem(field, name, "the hub repository has no weight files", "use a model repository with weights")]
    return []


# --- splits and fractions of local data ---------------------------------------------------------------------

COUNT_BYTES = 256 << 20  # local data up to this size is counted row by row (a second or so); larger is not


def split_problems(cfg: TrainingConfig) -> list[Problem]:
    """A split expression that selects no row or names a split the data does not have, an eval split likewise,
    and an eval fraction that leaves fewer training rows than one optimizer step needs."""
    d = cfg.data
    try:
        sizes = split_sizes(cfg)
    except (OSError, ValueError, KeyError, TypeError, data_files.TooManyFiles):
        return []  # check_source reports an unreadable or unusable source
    if sizes is None or not any(sizes.values()):
        return []  # unknown here, or no rows at all (check_source says the data is empty)
    train, found = _selected("data.split", d.split, sizes)
    if d.eval_split:
        _, more = _selected("data.eval_split", d.eval_split, sizes)
        found += more
    if found or train is None:
        return found
    held_out = math.ceil(d.eval_fraction * train) if d.eval_fraction else 0
    left = train - held_out
    t, world = stand_ins(cfg).train, cfg.scaling.num_workers  # a micro-batch still auto (partial): the least, 1
    # Unpacked, each row is at most one sequence; packed, a row can fill several, so one row may do.
    needed = 1 if d.packing else t.micro_batch_size * t.gradient_accumulation_steps * world
    if left >= needed:
        return []
    if held_out:
        most = max(0.0, math.floor(round((train - needed) / train * 1000, 6)) / 1000)
        return [
            Problem(
                "data.eval_fraction",
                d.eval_fraction,
                f"holds out {held_out} of the split's {train} rows, leaving {left} for training; one step needs "
                f"{needed}",
                f"set data.eval_fraction <= {most:g}, or use a larger split",
            )
        ]
    return [
        Problem(
            "data.split",
            d.split,
            f"selects {train} rows; one step needs {needed} (micro-batch {t.micro_batch_size} x accumulation "
            f"{t.gradient_accumulation_steps} x {world} workers, one row each without packing)",
            "select more rows, or lower train.micro_batch_size / scaling.num_workers",
        )
    ]


def _selected(field: str, spec: str, sizes: dict[str, int]) -> tuple[int | None, list[Problem]]:
    """(rows `spec` selects, problems), by `datasets`' own parser of split expressions. A plain split name is
    looked up here: importing `datasets` (a second of the driver's start-up on the CPU machine, before Ray
    starts) is needed only for slices and sums."""
    if re.fullmatch(r"\w+(\.\w+)*", spec):  # datasets' own rule for a split's name
        rows, error = sizes.get(spec), None if spec in sizes else "Unknown split"
    else:
        rows, error = _rows_of_expression(spec, sizes)
    if error is not None:
        if error.startswith("Unknown split"):
            return None, [Problem(field, spec, f"no such split; the data has {sorted(sizes)}", "use one of them")]
        return None, [
            Problem(
                field, spec, f"is not a split expression ({error})", "write e.g. train, train[:90%] or train[:1000]"
            )
        ]
    if rows == 0:
        counts = ", ".join(f"{name}: {n:,} rows" for name, n in sorted(sizes.items()))
        return 0, [Problem(field, spec, f"selects no row ({counts})", "select a non-empty range, e.g. train[:50%]")]
    return rows, []


def _rows_of_expression(spec: str, sizes: dict[str, int]) -> tuple[int | None, str | None]:
    """(rows, None) or (None, datasets' error's first line)."""
    from datasets.arrow_reader import ReadInstruction

    try:
        parts = ReadInstruction.from_spec(spec).to_absolute(sizes)
    except (ValueError, AssertionError, KeyError) as exc:
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return sum(max(0, p.to - p.from_) for p in parts), None


def split_sizes(cfg: TrainingConfig) -> dict[str, int] | None:
    """{split: rows} of local data as `datasets` will load it (a folder's splits as app.data.files finds them, a file
    or glob one split, 'train'), or None when unknown:
    a hub dataset, a saved single Dataset (loaded whole, whatever the split), or data too large to count here."""
    spec = cfg.data.dataset
    if not data_files.is_local(spec):
        return None
    path = Path(spec).expanduser()
    if data_files.saved_dataset(path):
        if not (path / "dataset_dict.json").is_file():
            return None
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        return {name: _saved_rows(path / name) for name in splits}
    by_split = data_files.split_files(spec, cfg.data.config_name)
    files = [f for fs in by_split.values() for f in fs]
    kinds = {data_files.kind_of(f) for f in files}
    if not files or len(kinds) != 1 or None in kinds or sum(map(_weight, files)) > COUNT_BYTES:
        return None
    kind = kinds.pop()
    return {split: sum(count_rows(f, kind) for f in fs) for split, fs in by_split.items()}


def _weight(file: str) -> int:
    """A file's share of what counting reads: compressed text is read back about 5x its size."""
    return os.path.getsize(file) * (5 if Path(file).suffix in data_files.COMPRESSIONS else 1)


def _saved_rows(folder: Path) -> int:
    state = json.loads((folder / "state.json").read_text())
    import pyarrow as pa

    total = 0
    for entry in state["_data_files"]:
        with pa.memory_map(str(folder / entry["filename"])) as source:
            total += pa.ipc.open_stream(source).read_all().num_rows
    return total


def count_rows(file: str, kind: str) -> int:
    """Rows of one file as `datasets`' builder reads them: every line of text, every non-blank line of JSON Lines."""
    if os.path.getsize(file) == 0:
        return 0
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(file).metadata.num_rows
    if kind in data_files.CSV_SEPARATORS:
        import pandas as pd

        try:
            return len(pd.read_csv(file, usecols=[0], sep=data_files.CSV_SEPARATORS[kind]))
        except pd.errors.EmptyDataError:
            return 0
    with data_files.open_data(file) as f:
        head = f.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip()
        f.seek(0)
        if kind == "json" and head.startswith((b"[", b"{")) and not _is_json_lines(head):
            doc = json.load(f)
            return len(doc) if isinstance(doc, list) else len(next(iter(doc.values()), []))
        if kind == "text":
            return sum(1 for _ in f)
        return sum(1 for line in f if line.strip())


def _is_json_lines(head: bytes) -> bool:
    first = head.split(b"\n", 1)[0]
    try:
        return isinstance(json.loads(first), dict) and b"\n" in head
    except ValueError:
        return False


# --- what DeepSpeed refuses only at initialize ----------------------------------------------------------------

# deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS (matched lower-cased); any other type must be a torch.optim class.
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
# deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES; any other type must be a torch.optim.lr_scheduler class.
DEEPSPEED_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


# The keys DeepSpeed's ZeRO config models accept (fields and aliases of DeepSpeedZeroConfig and its offload
# configs, which forbid any other: a typo there fails deepspeed.initialize on every worker).
ZERO_KEYS = (
    "allgather_bucket_size", "allgather_partitions", "allgather_sequential", "compute_grad_norm",
    "contiguous_gradients", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory", "elastic_checkpoint",
    "enable_sanity_checks", "gather_16bit_weights_on_model_save", "ignore_unused_parameters", "leaf_module",
    "legacy_stage1", "load_from_fp32_weights", "log_trace_cache_warnings", "max_live_parameters",
    "max_reuse_distance", "memory_efficient_linear", "model_persistence_threshold", "module_granularity_threshold",
    "offload_optimizer", "offload_param", "overlap_comm", "override_module_apply", "param_persistence_threshold",
    "parameter_alignment", "pipeline_loading_checkpoint", "prefetch_bucket_size", "reduce_bucket_size",
    "reduce_scatter", "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage",
    "stage3_allgather_sequential", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_model_persistence_threshold", "stage3_module_granularity_threshold",
    "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size", "stage3_use_all_reduce_for_fetch_params",
    "sub_group_size", "use_all_reduce_for_fetch_params", "use_multi_rank_bucket_allreduce", "zenflow",
    "zero_hpz_partition_size", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
    "zero_quantized_weights",
)  # fmt: skip
OFFLOAD_KEYS = {
    "offload_param": ("buffer_count", "buffer_size", "device", "max_in_cpu", "nvme_path", "pin_memory"),
    "offload_optimizer": (
        "buffer_count", "cpuadam_cores_perc", "device", "fast_init", "nvme_path", "pin_memory", "pipeline_read",
        "pipeline_write", "ratio", "super_offload",
    ),
}  # fmt: skip


def deepspeed_problems(cfg: TrainingConfig) -> list[Problem]:
    ds = cfg.deepspeed
    found = _unknown_keys("deepspeed.zero_optimization", ds.zero_optimization, ZERO_KEYS)
    for key, known in OFFLOAD_KEYS.items():
        if getattr(ds.zero_optimization, key) is not None:
            found += _unknown_keys(f"deepspeed.zero_optimization.{key}", getattr(ds.zero_optimization, key), known)
    if ds.optimizer is not None:
        found += _component("optimizer", ds.optimizer.type, _optimizer_known)
    if ds.scheduler is not None:
        found += _component("scheduler", ds.scheduler.type, _scheduler_known)
    zero = ds.zero_optimization
    for key in ("offload_param", "offload_optimizer"):
        offload = getattr(zero, key)
        if offload is not None and offload.device == "nvme" and not (offload.model_extra or {}).get("nvme_path"):
            found.append(
                Problem(
                    f"deepspeed.zero_optimization.{key}.nvme_path",
                    None,
                    "device nvme needs a folder on the NVMe drive (DeepSpeed refuses nvme_path=None at initialize, "
                    "after building its CPU Adam)",
                    f"set deepspeed.zero_optimization.{key}.nvme_path=/local_nvme, or device: cpu",
                )
            )
    return found


def _unknown_keys(where: str, block, known: tuple[str, ...]) -> list[Problem]:
    import difflib

    found = []
    for key in sorted(block.model_fields_set | set(block.model_extra or {})):
        if key not in known:
            guess = difflib.get_close_matches(key, known, n=1)
            fix = f"did you mean '{guess[0]}'?" if guess else "remove it (see DeepSpeed's config docs)"
            found.append(Problem(f"{where}.{key}", getattr(block, key, None), "DeepSpeed accepts no such key", fix))
    return found


def _component(key: str, kind: Any, known) -> list[Problem]:
    field = f"deepspeed.{key}.type"
    if not isinstance(kind, str) or not kind:
        return [Problem(field, kind, f"a DeepSpeed {key} needs a type", f"set it, or remove deepspeed.{key}")]
    choices = known(kind)
    if choices is None:
        return []
    import difflib

    guess = difflib.get_close_matches(kind, choices, n=1, cutoff=0.6)
    fix = f"did you mean '{guess[0]}'?" if guess else f"use one of {', '.join(choices)}"
    return [
        Problem(
            field,
            kind,
            f"DeepSpeed knows no {key} of this type (its own or torch's)",
            f"{fix} (or remove deepspeed.{key} to use the app's)",
        )
    ]


def _optimizer_known(kind: str) -> list[str] | None:
    """None when DeepSpeed builds `kind`; else the names to suggest."""
    import torch

    if kind.lower() in DEEPSPEED_OPTIMIZERS or _is_class(torch.optim, kind, torch.optim.Optimizer):
        return None
    return list(DEEPSPEED_OPTIMIZERS)


def _scheduler_known(kind: str) -> list[str] | None:
    import torch

    if kind in DEEPSPEED_SCHEDULERS or _is_class(torch.optim.lr_scheduler, kind, torch.optim.lr_scheduler.LRScheduler):
        return None
    return list(DEEPSPEED_SCHEDULERS)


def _is_class(module, name: str, base: type) -> bool:
    value = getattr(module, name, None)
    return isinstance(value, type) and issubclass(value, base)


# --- resources ----------------------------------------------------------------------------------------------


def resource_problems(cfg: TrainingConfig) -> list[Problem]:
    """A run that starts its own local Ray cluster gets this machine's GPUs and CPUs, no more: a worker group that
    cannot fit would wait for ever. On a cluster it joins (RAY_ADDRESS) nodes may still come (autoscaling), so
    there the wait is bounded instead (`placement_failure`)."""
    if os.environ.get("RAY_ADDRESS"):
        return []
    s = cfg.scaling
    gpus, cpus = local_gpus(), local_cpus()
    found = []
    if s.use_gpu and s.num_workers > gpus:
        found.append(
            Problem(
                "scaling.use_gpu",
                True,
                f"{s.num_workers} worker(s) need one GPU each; this machine has {gpus or 'none'} (a local Ray cluster "
                "starts here: RAY_ADDRESS is not set)",
                "set scaling.use_gpu=false to train on CPUs"
                + (f", or scaling.num_workers={gpus}" if gpus else "")
                + ", or set RAY_ADDRESS to a cluster with GPUs",
            )
        )
    if s.num_workers * s.cpus_per_worker > cpus:
        most = max(1, int(cpus // s.cpus_per_worker))
        found.append(
            Problem(
                "scaling.num_workers",
                s.num_workers,
                f"{s.num_workers} workers x {s.cpus_per_worker:g} CPUs (scaling.cpus_per_worker) need "
                f"{s.num_workers * s.cpus_per_worker:g} CPUs; this machine has {cpus}",
                f"set scaling.num_workers <= {most}, or lower scaling.cpus_per_worker",
            )
        )
    return found


def local_gpus() -> int:
    """GPUs a local Ray cluster would find here, by Ray's own detection (CUDA_VISIBLE_DEVICES counts)."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        manager = get_accelerator_manager_for_resource("GPU")
        visible = manager.get_current_process_visible_accelerator_ids()
        return len(visible) if visible is not None else manager.get_current_node_num_accelerators()
    except Exception:  # noqa: BLE001 - Ray internals moved: count what torch sees
        import torch

        return torch.cuda.device_count()


def local_cpus() -> int:
    """CPUs a local Ray cluster would offer here (Ray's own count: the process's CPU set and cgroup quota)."""
    try:
        from ray._private.utils import get_num_cpus

        return int(get_num_cpus())
    except Exception:  # noqa: BLE001
        return len(os.sched_getaffinity(0))


def start_timeout_s(cfg: TrainingConfig) -> str:
    """Ray Train's placement wait for this run, as its environment variable wants it."""
    return f"{cfg.scaling.placement_timeout_s:g}"


def placement_failure(exc: BaseException, cfg: TrainingConfig) -> str | None:
    """Ray's error when the worker group could not be placed (its start timed out, or the cluster's largest size
    cannot hold it) as one line naming the request and what the cluster offers; None for any other error."""
    from ray.train.v2._internal.exceptions import InsufficientClusterResourcesError, WorkerGroupStartupTimeoutError

    cause = getattr(exc, "controller_failure", exc)
    if not isinstance(cause, (WorkerGroupStartupTimeoutError, InsufficientClusterResourcesError)):
        return None
    s = cfg.scaling
    ask = {"CPU": s.cpus_per_worker, **({"GPU": 1} if s.use_gpu else {})}
    waited = (
        f"within scaling.placement_timeout_s={s.placement_timeout_s:g} s"
        if isinstance(cause, WorkerGroupStartupTimeoutError)
        else "on the cluster's largest size"
    )
    return (
        f"scaling: {s.num_workers} workers x {_resources(ask)} could not be placed {waited}; the cluster offers "
        f"{_resources(_offered())} in all. Fix: lower scaling.num_workers or scaling.cpus_per_worker, set "
        "scaling.use_gpu to match the nodes, add nodes, or raise scaling.placement_timeout_s when nodes are still "
        "starting"
    )


def _offered() -> dict[str, float]:
    try:
        import ray

        return {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")} or {"CPU": 0}
    except Exception:  # noqa: BLE001 - the cluster went away meanwhile
        return {}


def _resources(amounts: dict[str, float]) -> str:
    if not amounts:
        return "(unknown)"
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(amounts.items())) + "}"
