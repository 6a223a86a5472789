"""What the planner reads from an accelerate config (toolkit.planner.facts)."""

from __future__ import annotations

from planner_models import ROOT

from toolkit.planner.facts import read_strategy


def test_the_shipped_configs_read_as_their_strategies():
    facts = {p.stem: read_strategy(p, 2048) for p in (ROOT / "accelerate_configs").glob("*.yaml")}
    assert facts["ddp"].kind == "ddp" and facts["fsdp"].kind == "fsdp"
    assert [facts[f"zero{n}"].zero_stage for n in (1, 2, 3)] == [1, 2, 3]
    assert facts["zero3"].reduce_bucket == 2048 * 2048, "Accelerate fills reduce_bucket_size=auto with hidden^2"
    assert facts["zero3"].persistence_threshold == 10 * 2048
    assert facts["zero3_offload"].offload_optimizer and not facts["zero3"].offload_optimizer
    assert (facts["fsdp_cp"].kind, facts["fsdp_cp"].cp, facts["fsdp_cp"].tp) == ("fsdp", 2, 1)
    assert (facts["fsdp_tp"].kind, facts["fsdp_tp"].cp, facts["fsdp_tp"].tp) == ("fsdp", 1, 2)
    assert (facts["zero3_sp"].kind, facts["zero3_sp"].zero_stage, facts["zero3_sp"].sp) == ("deepspeed", 3, 2)
    assert all(f.sp == 1 for name, f in facts.items() if not name.endswith("_sp"))
