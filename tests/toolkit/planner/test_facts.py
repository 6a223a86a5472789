"""What the planner reads from an accelerate config (toolkit.planner.facts)."""

from __future__ import annotations

import pytest
import yaml
from planner_models import ROOT

from toolkit.config.errors import UserError
from toolkit.planner.facts import read_strategy
from toolkit.strategy.parallelism import launched_sizes


def test_the_shipped_configs_read_as_their_strategies():
    facts = {p.stem: read_strategy(p, 2048) for p in (ROOT / "accelerate_configs").glob("*.yaml")}
    assert facts["ddp"].layout.kind == "ddp" and facts["fsdp"].layout.kind == "fsdp"
    assert [facts[f"zero{n}"].layout.zero_stage for n in (1, 2, 3)] == [1, 2, 3]
    assert facts["zero3"].reduce_bucket == 2048 * 2048, "Accelerate fills reduce_bucket_size=auto with hidden^2"
    assert facts["zero3"].persistence_threshold == 10 * 2048
    assert facts["zero3_offload"].offload_optimizer and not facts["zero3"].offload_optimizer
    assert (facts["fsdp_cp"].layout.kind, facts["fsdp_cp"].layout.cp, facts["fsdp_cp"].layout.tp) == ("fsdp", 2, 1)
    assert (facts["fsdp_tp"].layout.kind, facts["fsdp_tp"].layout.cp, facts["fsdp_tp"].layout.tp) == ("fsdp", 1, 2)
    assert (facts["zero3_sp"].layout.kind, facts["zero3_sp"].layout.zero_stage, facts["zero3_sp"].layout.sp) == ("deepspeed", 3, 2)
    assert all(f.layout.sp == 1 for name, f in facts.items() if not name.endswith("_sp"))


@pytest.mark.parametrize(("sizes", "says"), [
    ({"dp_replicate": 2, "dp_shard": 2}, "parallelism_config_dp_replicate_size=2 is not supported yet"),
    ({"dp_shard": 1, "cp": 2, "tp": 2}, "parallelism_config_cp_size=2 with parallelism_config_tp_size=2 is not "
                                        "supported yet; use one of them"),
])
def test_a_parallelism_config_the_launch_refuses_is_refused_by_the_planner_in_the_same_words(tmp_path, monkeypatch,
                                                                                             sizes, says):
    """One function reads a parallelism_config for both (toolkit.strategy.parallelism.model_parallel_sizes)."""
    config = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2},
              "parallelism_config": {f"parallelism_config_{axis}_size": n for axis, n in sizes.items()}}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(UserError) as planned:
        read_strategy(tmp_path / "mine.yaml", 64)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for axis, n in sizes.items():
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE", str(n))
    with pytest.raises(UserError) as launched:
        launched_sizes(4)
    assert says in str(launched.value) and str(planned.value) == f"{tmp_path / 'mine.yaml'}: {launched.value}"
