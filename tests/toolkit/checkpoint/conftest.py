"""Fixtures of the checkpoint tests: a real one-process Strategy in this process, and a real checkpoint it wrote."""

from __future__ import annotations

from one_process_checkpoints import fresh_accelerate, one_process_checkpoint, strategy  # noqa: F401 (fixtures)

