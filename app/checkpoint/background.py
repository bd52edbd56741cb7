"""Checkpoint files written in the background: the loop waits only while each rank's state is copied to host memory.

During `engine.save_checkpoint`, DeepSpeed hands every file it would write to its checkpoint engine's `save(state,
path)`; `Capture` (swapped in for that one call, `formats.checkpoint_engine`) copies the state to host memory instead
(`HostCopy`) and queues it for this rank's writer thread, which writes each file to a temp name, fsyncs it and renames
it into place. The bytes are those DeepSpeed would have written (the same state dicts, storage by storage). A file
whose copy would not fit in free host memory is written at once, in the loop, the same way.
"""

from __future__ import annotations

import copy
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("finetune")
MEMORY_MARGIN = 2 * 2**30  # bytes of host memory a snapshot leaves free for everything else


class HostCopy:
    """Host-memory copies of state dicts. Each tensor storage is copied once, whole, and the tensors are rebuilt as
    views of the copies, so `torch.save` writes exactly what it would write for the originals. Buffers (pinned for
    GPU tensors) are kept for the next save (one save in flight at a time: the previous write is done by then), and
    `reserve` allocates them ahead, in the writer thread, so that even the first save only copies."""

    def __init__(self):
        self.free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self.used: list[tuple[tuple[int, bool], torch.Tensor]] = []
        self.lock = threading.Lock()
        self.reserved = (0, 0.0)  # bytes allocated ahead by `reserve`, and the seconds it took
        self.allocated = 0  # bytes allocated by `copy` itself (no buffer of that size was free)

    @staticmethod
    def storages(obj: Any) -> dict[tuple, torch.Tensor]:
        """The distinct tensor storages in `obj` (one tensor of each)."""
        found: dict[tuple, torch.Tensor] = {}
        for t in _tensors(obj):
            if t.device.type != "meta":
                found.setdefault(_key(t), t)
        return found

    def release(self) -> None:
        """The write that used the buffers is done: they serve the next save."""
        with self.lock:
            for size, buf in self.used:
                self.free.setdefault(size, []).append(buf)
            self.used = []

    def reserve(self, obj: Any) -> None:
        """Allocate buffers for the storages of `obj` (the optimizer's state: the bulk of a checkpoint)."""
        started, total = time.perf_counter(), 0
        for t in self.storages(obj).values():
            size = (t.untyped_storage().nbytes(), t.is_cuda)
            buf = host_buffer(*size)
            total += size[0]
            with self.lock:
                self.free.setdefault(size, []).append(buf)
        self.reserved = (total, time.perf_counter() - started)

    def new_bytes(self, obj: Any) -> int:
        """Host memory `copy(obj)` would allocate (storages without a free buffer of their size)."""
        need, spare = 0, {}
        with self.lock:
            for t in self.storages(obj).values():
                size = (t.untyped_storage().nbytes(), t.is_cuda)
                spare.setdefault(size, len(self.free.get(size, [])))
                if spare[size]:
                    spare[size] -= 1
                else:
                    need += size[0]
        return need

    def copy(self, obj: Any) -> Any:
        """A host copy of `obj`; GPU copies are queued on the current stream (the caller synchronises)."""
        buffers = {key: self._into(t) for key, t in self.storages(obj).items()}
        memo: dict[int, Any] = {}
        tensors = list(_tensors(obj))
        for t in tensors:  # every tensor object once, so that references to one stay references to one
            if id(t) not in memo:
                memo[id(t)] = _host_tensor(t, buffers)
        for t in tensors:  # attributes DeepSpeed sets on tensors (ds_id) are pickled with them
            if t.__dict__ and not memo[id(t)].__dict__:
                memo[id(t)].__dict__.update(_rebuild(t.__dict__, memo))
        return _rebuild(obj, memo)

    def _into(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        size = (storage.nbytes(), t.is_cuda)
        with self.lock:
            spare = self.free.get(size)
            buf = spare.pop() if spare else None
        if buf is None:
            buf = host_buffer(*size)
            self.allocated += size[0]
        with self.lock:
            self.used.append((size, buf))
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        for start in range(0, max(size[0], 1), PIN_CHUNK):  # each copy lands in one pinned chunk: asynchronous
            buf[start : start + PIN_CHUNK].copy_(src[start : start + PIN_CHUNK], non_blocking=t.is_cuda)
        return buf


# Host memory for GPU copies is pinned in chunks of this size, by cudaHostRegister on pages already touched. One
# cudaHostAlloc (or one registration) of a whole multi-GB optimizer state kept the driver busy for seconds, and the
# training thread's launches and copies waited behind it: pinning a 1.1B model's 13 GB beside a loop of GPU steps
# added 15.2 s to them by cudaHostAlloc, 0.38 s by torch's register-based allocator and 0.08 s in chunks of this
# size (benchmarks/pin_stall.py; docs/benchmarks.md). A chunk holds the driver for milliseconds.
PIN_CHUNK = 256 * 2**20


class _Pinned:
    """Anonymous memory (page-aligned, so no page is in two chunks) registered with CUDA chunk by chunk; the
    registrations end with this object, which the buffer tensor keeps alive."""

    def __init__(self, nbytes: int):
        self.memory = mmap.mmap(-1, max(nbytes, 1))
        self.tensor = torch.frombuffer(self.memory, dtype=torch.uint8)[:nbytes]
        self.registered: list[int] = []
        cudart = torch.cuda.cudart()
        for start in range(0, nbytes, PIN_CHUNK):
            piece = self.tensor[start : start + PIN_CHUNK]
            piece.fill_(0)  # the kernel maps the pages here, not under the driver's registration
            if int(cudart.cudaHostRegister(piece.data_ptr(), piece.numel(), 0)) != 0:
                self.close()
                raise RuntimeError("cudaHostRegister failed")
            self.registered.append(piece.data_ptr())

    def close(self) -> None:
        cudart = torch.cuda.cudart()
        while self.registered:
            cudart.cudaHostUnregister(self.registered.pop())

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone: the process frees the memory
            pass


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """`nbytes` of host memory; pinned (for copies from a GPU) in `PIN_CHUNK` pieces, or by torch's own
    allocator where registering fails."""
    if not pinned:
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        block = _Pinned(nbytes)
    except (RuntimeError, OSError):  # no CUDA runtime to register with, or no memory to map
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    block.tensor._pinned_block = block  # the registrations last as long as the buffer
    return block.tensor


def _key(t: torch.Tensor) -> tuple:
    """What `torch.save` tells storages apart by (the storage object itself), so sharing is kept as it was."""
    return (t.device, t.untyped_storage()._cdata)


def _tensors(obj: Any):
    """Every tensor in `obj` (in containers, and in tensors' own attributes), in the order torch.save meets them."""
    if torch.is_tensor(obj):
        yield obj
        for v in obj.__dict__.values():
            yield from _tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _host_tensor(t: torch.Tensor, buffers: dict[tuple, torch.Tensor]) -> torch.Tensor:
    """`t` as a view of its storage's host copy: same type, dtype, offset, shape, strides and requires_grad."""
    if t.device.type == "meta":
        return t
    host = torch.empty(0, dtype=t.dtype).set_(
        buffers[_key(t)].untyped_storage(), t.storage_offset(), t.size(), t.stride()
    )
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(host, requires_grad=t.requires_grad)
    if type(t) is not torch.Tensor:
        host = host.as_subclass(type(t))
    return host.requires_grad_(t.requires_grad) if t.is_leaf and t.is_floating_point() else host


def _rebuild(obj: Any, memo: dict[int, Any]) -> Any:
    """A copy of `obj` in which the tensors are their host copies (`memo`), containers are new, other objects are
    deep copies (the loop may change them after the save: a scheduler's lists), and shared references stay
    shared, as `copy.deepcopy` keeps them."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = memo[id(obj)] = copy.copy(obj)  # keeps the mapping's type (OrderedDict, defaultdict)
        for k, v in obj.items():
            out[k] = _rebuild(v, memo)
    elif isinstance(obj, list):
        out = memo[id(obj)] = []
        out.extend(_rebuild(v, memo) for v in obj)
    elif isinstance(obj, tuple):
        items = [_rebuild(v, memo) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            out = obj
        else:
            out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        memo[id(obj)] = out
    else:
        try:
            out = copy.deepcopy(obj, memo)
        except Exception:  # noqa: BLE001 - an object that cannot be copied is written as it is
            out = obj
    return out


def free_host_memory() -> int:
    """Bytes of host memory this process may still use: the lower of the kernel's MemAvailable and what the
    container's memory limit (cgroup v2, or v1) leaves."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            limit = (Path("/sys/fs/cgroup") / limit_file).read_text().strip()
            usage = int((Path("/sys/fs/cgroup") / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            free = min(free if free is not None else 2**62, int(limit) - usage)
        break
    return free if free is not None else 2**62


def write_file(state: Any, path: str, zipfile: bool = True) -> None:
    """`torch.save` to a temp name, fsync, rename: the file exists complete and on disk, or not at all."""
    tmp = os.path.splitext(path)[0] + ".tmp"  # the same stem: torch names the archive inside the file after it
    torch.save(state, tmp, _use_new_zipfile_serialization=zipfile)
    fsync_path(Path(tmp))
    os.replace(tmp, path)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Writer:
    """One rank's writer thread. `submit` queues a file; `seal` queues the end of a checkpoint (the fsync of the
    files this rank wrote in the loop, and of the folders); `wait` returns once the checkpoint is durable (or its
    write failed: `error`)."""

    def __init__(self, before_write: Callable[[str], None] = lambda path: None):
        self.jobs: queue.Queue = queue.Queue()
        self.idle = threading.Event()
        self.idle.set()
        self.error: BaseException | None = None
        self.before_write = before_write  # test-only fault drills (app/faults.py)
        self.thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def begin(self) -> None:
        self.idle.clear()
        self.error = None

    def submit(self, state: Any, path: str, ready: torch.cuda.Event | None, zipfile: bool) -> None:
        self.jobs.put(("file", state, path, ready, zipfile))

    def seal(self, files: list[Path], folders: list[Path]) -> None:
        self.jobs.put(("seal", files, folders, None, None))

    def reserve(self, copier: HostCopy, state: Any) -> None:
        """Allocate `copier`'s buffers for `state` in this thread, while training goes on."""
        self.begin()
        self.jobs.put(("reserve", copier, state, None, None))
        self.seal([], [])

    def wait(self) -> None:
        self.idle.wait()

    def _run(self) -> None:
        while True:
            kind, a, b, ready, zipfile = self.jobs.get()
            if self.error is not None:  # the checkpoint is lost already: drop its other files
                if kind == "seal":
                    self.idle.set()
                continue
            try:
                if kind == "file":
                    if ready is not None:
                        ready.synchronize()  # the host copy has landed
                    self.before_write(b)
                    write_file(a, b, zipfile)
                elif kind == "reserve":
                    if b is not None and a.new_bytes(b) + MEMORY_MARGIN < free_host_memory():
                        a.reserve(b)
                else:
                    for f in a:
                        if f.is_file():
                            fsync_path(f)
                    for d in b:
                        if d.is_dir():
                            fsync_path(d)
            except BaseException as exc:  # noqa: BLE001 - reported to the loop, which stops the run
                self.error = exc
            if kind == "seal":
                self.idle.set()


def capture_engine(base, copier: HostCopy, writer: Writer):
    """A DeepSpeed checkpoint engine (the same class as `base`, DeepSpeed's torch engine, with its settings) whose
    `save` copies the state to host memory and queues it for `writer`."""

    class Capture(type(base)):
        def __init__(self):
            self.__dict__.update(base.__dict__)
            self.written_now: list[str] = []  # files written in the loop (no room for a host copy)

        def save(self, state_dict, path: str):
            need = copier.new_bytes(state_dict)
            if need and need + MEMORY_MARGIN > free_host_memory():
                write_file(state_dict, path, self.zipfile_serialization)
                self.written_now.append(path)
                return
            host = copier.copy(state_dict)
            ready = None
            if any(t.is_cuda for t in _tensors(state_dict)):
                ready = torch.cuda.Event()
                ready.record()
            writer.submit(host, path, ready, self.zipfile_serialization)

    return Capture()
