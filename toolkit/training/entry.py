"""A recipe's command line: `--config FILE key=value ...` -> setup, train, cleanup, exit code.

Exit codes: 0 done, 2 bad input (one `error:` line on stderr, from rank 0 only), 3 stopped by
a signal after saving a checkpoint (resume=auto continues), 4 a collective failed: the ranks
fell out of step and one waited past train.collective_timeout_s, or a peer died (one `error:`
line per rank, naming the rank, the collective, where and at which step).
"""

from __future__ import annotations

import sys

from toolkit.config import UserError, load_config
from toolkit.strategy.distributed import collective_failure, is_launch_main, report_once
from toolkit.training.trainer import Stopped


def run(name: str, config_class: type, recipe_class: type, argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "--config" or len(argv) < 2:
        print(f"usage: recipes/{name}.py --config recipes/configs/NAME.yaml [key.sub=value ...]", file=sys.stderr)
        return 2
    recipe = None
    try:
        notes: list[str] = []
        cfg = load_config(config_class, argv[1], argv[2:], notes)
        if is_launch_main():
            for line in notes:
                print(f"[{name}] {line}", file=sys.stderr, flush=True)
        recipe = recipe_class(cfg)
        recipe.setup()
        recipe.train()
        recipe.cleanup()
    except UserError as exc:
        report_once(f"error: {exc}")
        return 2
    except Stopped as exc:
        recipe.trainer.accelerator.end_training()  # flush the trackers; the checkpoint is already saved
        report_once(f"[{name}] {exc}")
        return 3
    except Exception as exc:
        trainer = getattr(recipe, "trainer", None)
        line = collective_failure(exc, trainer.step if trainer is not None else None)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 4
    return 0
