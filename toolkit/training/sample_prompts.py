"""Whether a run's samples.prompts were written for other data than the run's own.

The shipped configs' prompts are about their own data (Python questions for the embedded CPython docs and Q&A set,
"The history of" for WikiText), and a user who points a copy of one at their data (data.path, data.sources) keeps
them unless told: samples.md then compares the base and the result on questions about Python. Said once at startup
and at the top of samples.md, as information: the prompts are still sampled.
"""

from __future__ import annotations

import functools
from typing import Any

from toolkit.config.files import SHIPPED_CONFIGS, read_yaml
from toolkit.training.samples import SamplesConfig

DEFAULT = "the default"


@functools.cache
def _written_for() -> tuple[tuple[str, tuple[str, ...], frozenset[str]], ...]:
    """(whose, prompts, the data paths they were written for) of each shipped config and of the default."""
    found = [(DEFAULT, tuple(SamplesConfig().prompts), frozenset())]
    for path in sorted(SHIPPED_CONFIGS.glob("*.yaml")):
        raw = read_yaml(path) or {}
        prompts = (raw.get("samples") or {}).get("prompts", SamplesConfig().prompts)
        data = raw.get("data") or {}
        paths = {data.get("path"), *((s or {}).get("path") for s in data.get("sources") or [])}
        found.append(("the shipped config", tuple([prompts] if isinstance(prompts, str) else prompts),
                      frozenset(p for p in paths if p)))
    return tuple(found)


def _data_paths(cfg: Any) -> frozenset[str]:
    return frozenset(p for p in (cfg.data.path, *(s.path for s in cfg.data.sources)) if p)


def prompts_for_other_data(cfg: Any) -> str | None:
    """Whose prompts a run samples ("the shipped config", "the default") where they were written for data other than
    the run's own, or None: its own prompts, its data the one they were written for (the embedded corpus, a shipped
    config's), or no samples."""
    own = _data_paths(cfg)
    if not own or not cfg.samples.prompts or not cfg.samples.max_new_tokens:
        return None
    whose = [(name, paths) for name, prompts, paths in _written_for() if prompts == tuple(cfg.samples.prompts)]
    if not whose or any(own <= paths for _, paths in whose):
        return None
    return whose[0][0]


def prompts_line(cfg: Any) -> str | None:
    """The log's line at startup where the prompts were written for other data (prompts_for_other_data), or None."""
    return _said(cfg, "samples: the prompts are {whose}'s (written for its data), not about yours ({yours}); set "
                      "'samples.prompts=[a question about your data, another]' for samples that show what this run "
                      "learned")


def prompts_note(cfg: Any) -> str | None:
    """samples.md's note at its top, where the prompts were written for other data (prompts_for_other_data)."""
    return _said(cfg, "Note: these prompts are {whose}'s, written for its data, not for this run's ({yours}); set "
                      "samples.prompts to prompts about your data for samples that show what the run learned.")


def _said(cfg: Any, words: str) -> str | None:
    whose = prompts_for_other_data(cfg)
    yours = f"data.path={cfg.data.path}" if cfg.data.path else "data.sources"
    return None if whose is None else words.format(whose=whose, yours=yours)
