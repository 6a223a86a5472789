"""Sharding is real: per-rank bytes held, measured from the live tensors, at 2 ranks.

Each strategy's matrix run (the recipe on 2 processes, tests/conftest.py's `strategy_runs`) logs
toolkit.strategy.sharding.held_bytes for every rank after its first step (2 micro-batches; conftest.py's
`matrix_sharding` reads it). Against
DDP: ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 and FSDP2 also the
parameters (each <= 0.55x DDP's). `pytest -s` prints the table.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
COLUMNS = ("params", "grads", "grads_peak", "optimizer", "master")
SHARDED = {  # what each strategy must hold at most 0.55x of DDP's (and, to be real, at least 0.45x)
    "zero1": ("optimizer",),
    "zero2": ("optimizer", "grads", "grads_peak"),
    "zero3": ("params", "grads", "optimizer"),
    "fsdp": ("params", "grads", "optimizer"),
}
NPROC = 2


def per_rank_max(result: dict) -> dict[str, int]:
    return {k: max(rank[k] for rank in result["ranks"]) for k in COLUMNS}


def table(results: dict[str, dict]) -> str:
    """MB per rank (largest rank) and the ratio to DDP; total = params + grads + optimizer + master."""
    def with_total(row: dict[str, int]) -> dict[str, int]:
        return {**row, "total": sum(row[c] for c in COLUMNS if c != "grads_peak")}

    ddp = with_total(per_rank_max(results["ddp"]))
    head = f"{'strategy':<18}" + "".join(f"{c:>19}" for c in (*COLUMNS, "total"))
    lines = [f"bytes held per rank at {NPROC} ranks: MB (x DDP), largest rank", head, "-" * len(head)]
    for result in results.values():
        row = with_total(per_rank_max(result))
        cells = [
            f"{row[c] / 1e6:>10.3f} {f'({row[c] / ddp[c]:.2f}x)' if ddp[c] else '':>8}" for c in (*COLUMNS, "total")
        ]
        lines.append(f"{result['strategy']:<18}" + "".join(cells))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def measured(matrix_sharding) -> dict[str, dict]:
    results = {s: matrix_sharding(s) for s in STRATEGIES}
    print("\n" + table(results))
    return results


def test_ddp_numbers_are_sane(measured):
    ddp = measured["ddp"]
    n = ddp["n_params"]
    for rank in ddp["ranks"]:
        assert rank["params"] == 4 * n, "DDP holds every fp32 parameter once"
        assert rank["grads"] == rank["grads_peak"] == 4 * n, "DDP holds one fp32 gradient per parameter"
        assert rank["optimizer"] >= 2 * rank["params"], "AdamW keeps exp_avg and exp_avg_sq per parameter"
        assert rank["master"] == 0, "DDP's optimizer updates the parameters themselves"


@pytest.mark.parametrize("strategy", sorted(SHARDED))
def test_sharded_against_ddp(measured, strategy):
    ddp, held = per_rank_max(measured["ddp"]), per_rank_max(measured[strategy])
    for key in SHARDED[strategy]:
        ratio = held[key] / ddp[key]
        assert ratio <= 0.55, f"{strategy} {key}: {held[key]} bytes per rank is {ratio:.2f}x DDP's {ddp[key]}"
        assert ratio >= 0.45, f"{strategy} {key}: {held[key]} bytes is {ratio:.2f}x DDP's; the measurement misses something"


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_zero_master_weights_are_sharded(measured, strategy):
    """DeepSpeed keeps an fp32 master copy beside the parameters; it must be a 1/N partition."""
    ddp_params = per_rank_max(measured["ddp"])["params"]
    ratio = per_rank_max(measured[strategy])["master"] / ddp_params
    assert 0.45 <= ratio <= 0.55, f"{strategy} master weights are {ratio:.2f}x the full parameters"
