"""A checkpoint's files written in the background (checkpoint.async_save): its tensors copied to host memory while
the step waits, written by one thread per process while training goes on.

While save_state runs, Accelerate's `save` and torch DCP's `save` are replaced by a stager that copies what
they are given and queues its write; one thread per rank writes the queue in order, so DCP's collectives meet
in the same order on every rank. The files are those of a blocking save (test_background.py compares them).
Why not DCP's own async_save, and what is shared: docs/internals.md, toolkit/checkpoint/background.py.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from toolkit.run.faults import fail_point, kill_point

_groups: dict[int, object] = {}  # the default group's id -> the gloo group DCP's background collectives use


def _dcp_group():
    """Made once per process group (every rank at its first save in the background), apart from the training's
    NCCL or gloo group: DCP plans on the CPU, and its collectives must not meet the training's."""
    import torch.distributed as dist

    default = dist.group.WORLD
    if id(default) not in _groups:
        _groups.clear()  # of a process group destroyed before this one
        _groups[id(default)] = dist.new_group(backend="gloo")
    return _groups[id(default)]


class Writes:
    """One rank's queued writes for the checkpoint of `step`, run in order by one thread."""

    def __init__(self, step: int, folder: Path):
        self.step, self.folder = step, folder
        self.jobs: list[Callable[[], None]] = []
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="checkpoint-writes")
        self._thread.start()

    def _run(self) -> None:
        try:
            for job in self.jobs:
                job()
                kill_point("save.background", self.step)  # after the first file: a partial checkpoint on disk
            fail_point("save.background", self.step, self.folder)
        except BaseException as exc:  # agreed by every rank where the checkpoint is completed
            self.error = exc
        finally:
            self.jobs = []  # the host copies go as soon as they are written

    def writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> BaseException | None:
        if self._thread is not None:
            self._thread.join()
        return self.error


def snapshot(obj, memo: dict | None = None):
    """`obj` with every tensor copied into host memory; tensors that shared a storage share the copy's."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if obj.is_meta:
            return obj
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), str(storage.device))
        copy = memo.get(key)
        if copy is None:
            copy = memo[key] = torch.UntypedStorage(storage.nbytes(), device="cpu")
            copy.copy_(storage)
        return torch.empty(0, dtype=obj.dtype).set_(copy, obj.storage_offset(), obj.size(), obj.stride())
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for key, value in obj.items():
            out[key] = snapshot(value, memo)
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(snapshot(value, memo) for value in obj)
    import copy as copying

    return copying.deepcopy(obj)  # numbers and strings; a sampler's state: what torch.save would pickle


@contextlib.contextmanager
def staged(writes: Writes) -> Iterator[None]:
    """Within it, Accelerate's `save` and DCP's `save` copy what they are given and queue its write in `writes`."""
    import accelerate.checkpointing as checkpointing
    import torch.distributed.checkpoint as dcp
    from accelerate.state import PartialState
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    accelerate_save, dcp_before = checkpointing.save, dcp.save

    def stage(obj, f, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
        state = PartialState()
        if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
            return  # the rank Accelerate would not write on: nothing to copy
        copy = snapshot(obj)
        writes.jobs.append(lambda: accelerate_save(copy, f, save_on_each_node=save_on_each_node,
                                                   safe_serialization=safe_serialization))

    def stage_dcp(state_dict, *, storage_writer, planner=None, **_) -> None:
        copy = storage_writer.stage(state_dict)  # FileSystemWriter's own copy into host memory
        group = _dcp_group()
        writes.jobs.append(lambda: dcp_save(copy, storage_writer=storage_writer, planner=planner, process_group=group))

    checkpointing.save, dcp.save = stage, stage_dcp
    try:
        yield
    finally:
        checkpointing.save, dcp.save = accelerate_save, dcp_before
