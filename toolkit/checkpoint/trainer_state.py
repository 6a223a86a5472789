"""What a checkpoint holds besides the strategy's tensors (`trainer_state.json`, written last: its presence marks a
checkpoint complete, toolkit.run.folder.is_complete), with its one writer and its one reader."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.config.files import KeyTwice, once
from toolkit.parallel_layout import ParallelLayout
from toolkit.run.folder import STATE_FILE


@dataclass
class TrainerState:
    """What a checkpoint holds besides the strategy's tensors: where the run was, and what it measured.

    The data position needs no field: the batch order is a function of (seed, step)."""

    step: int = 0
    tokens_seen: int = 0
    seed: int | None = None
    last_eval: dict[str, float] = field(default_factory=dict)  # the newest held-out loss and perplexity
    eval_step: int = -1  # the step last_eval was measured at: a resumed run does not measure it twice
    eval_before: dict[str, float] = field(default_factory=dict)  # fine-tuning: the base model's, for the comparison
    samples_before: list[str] = field(default_factory=list)  # fine-tuning: the base model's generations
    manifest_crc32: str = ""  # the checkpoint's manifest.json: binds this state to the files beside it
    # why this checkpoint may hold a diverged model ("" = it passed its checks): saved right after
    # a skipped non-finite step, or with non-finite weights; rotation keeps the newest that passed
    suspect: str = ""
    # what wrote the checkpoint's files (None in checkpoints older than the record): a resume under
    # another layout converts them (toolkit.checkpoint.conversion)
    layout: ParallelLayout | None = None
    # sequences per optimizer step (0 in older checkpoints): the data position is a function of
    # (seed, step, global batch), so a resume must keep it
    global_batch_size: int = 0
    # a mixture's sources and weights ({} for one corpus): {"sources": names, "plan": [[first batch, weights]]}
    # (toolkit.data.mixture.weight_plan), and its tokens trained from each source so far (tokens/<name>)
    mixture: dict = field(default_factory=dict)
    source_tokens: dict[str, int] = field(default_factory=dict)
    # the optimizer and schedule settings it trained with ({} in older checkpoints): a resume says how
    # it takes a change, or refuses one it cannot take (toolkit.checkpoint.settings.check_same_settings)
    settings: dict = field(default_factory=dict)
    # a fine-tune's forgetting budget ({} without one): the base's general loss, replay's decisions, the kept step
    # and the evaluations since it (toolkit.training.forgetting.Budget.state)
    budget: dict = field(default_factory=dict)

    def write(self, folder: Path) -> None:
        """Atomically, so that a reader sees the whole state or none (the completeness marker)."""
        tmp = folder / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps({**dataclasses.asdict(self), "layout": self.layout and self.layout.record()}, indent=2))
        tmp.rename(folder / STATE_FILE)

    @classmethod
    def passed(cls, folder: Path) -> bool:
        """Whether a complete checkpoint passed its checks: not suspect, and its state readable (a damaged one is
        not, and rotation may delete it)."""
        try:
            return not cls.read(folder).suspect
        except DamagedState:
            return False

    @classmethod
    def read(cls, folder: Path) -> TrainerState:
        """The state saved in `folder`; DamagedState (a ValueError) when its file is not what write() wrote: not
        UTF-8, not JSON, not an object, a key twice, a field of another type (each checked against the field's own
        annotation, so a field added later is checked too)."""
        saved = _state_record(folder / STATE_FILE)
        hints = typing.get_type_hints(cls)
        for name, value in saved.items():
            if name in hints and not _fits(value, hints[name]):
                raise DamagedState(f"its {name} is {value!r:.60}, not {_said(hints[name])}")
        known = {f.name for f in dataclasses.fields(cls)}
        state = cls(**{k: v for k, v in saved.items() if k in known})
        try:
            if isinstance(saved.get("layout"), dict):
                state.layout = ParallelLayout.from_record(saved["layout"])
            elif saved.get("strategy"):  # saved before the layout was recorded: its strategy's name and world size
                state.layout = ParallelLayout.from_name(saved["strategy"], saved.get("world_size", 0))
        except (TypeError, ValueError, AttributeError) as exc:
            raise DamagedState(f"its layout {saved.get('layout') or saved.get('strategy')!r:.80} is not one the toolkit "
                               f"writes ({exc})") from None
        return state


class DamagedState(ValueError):
    """A trainer_state.json that is not what TrainerState.write wrote: the checkpoint is damaged (a resume sets it
    aside or refuses it, toolkit.checkpoint.integrity). Its text says what is wrong, without the path."""


def _state_record(path: Path) -> dict:
    data = path.read_bytes()
    try:
        saved = json.loads(data.decode("utf-8"), object_pairs_hook=once)
    except KeyTwice as exc:
        raise DamagedState(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise DamagedState(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    except json.JSONDecodeError as exc:
        what = "empty" if not data.strip() else f"not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        raise DamagedState(what + ("" if not data.strip() else " (truncated?)" if exc.pos >= len(data.rstrip()) else "")) from None
    if not isinstance(saved, dict):
        raise DamagedState(f"a JSON {type(saved).__name__}, not the object the toolkit writes")
    return saved


def _fits(value, hint) -> bool:
    """Whether a JSON value is of a TrainerState field's type (ParallelLayout: its record, a mapping)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is ParallelLayout:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is dict:
        return isinstance(value, dict) and (not args or all(_fits(v, args[1]) for v in value.values()))
    if origin is list:
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    return isinstance(value, hint)


def _said(hint) -> str:
    if isinstance(hint, type):
        return {int: "an integer", str: "a string", float: "a number"}.get(hint, hint.__name__)
    return str(hint).replace("typing.", "").replace("toolkit.parallel_layout.", "")
