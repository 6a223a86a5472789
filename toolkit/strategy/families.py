"""Every strategy family by its name (ParallelLayout.family): adding a family is one folder of toolkit/strategy/
and one entry here. `FILES` is the order a checkpoint folder's files are recognised in."""

from __future__ import annotations

from types import ModuleType

from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.ddp.family import FAMILY as DDP
from toolkit.strategy.deepspeed.family import FAMILY as DEEPSPEED
from toolkit.strategy.family import Family
from toolkit.strategy.fsdp.family import FAMILY as FSDP
from toolkit.strategy.pipeline.family import FAMILY as PIPELINE
from toolkit.strategy.single.family import FAMILY as SINGLE

FAMILIES: dict[str, Family] = {f.name: f for f in (SINGLE, DDP, FSDP, DEEPSPEED, PIPELINE)}
# the family whose save writes each kind of files, asked in this order: a DeepSpeed or FSDP2 save may hold a
# model*.safetensors too, so DDP's (which one process writes as well) are asked last
FILES: dict[str, ModuleType] = {f.name: f.files for f in (DEEPSPEED, FSDP, PIPELINE, DDP)}


def family_of(layout: ParallelLayout) -> Family:
    """What `layout`'s strategy family does its own way, launched or not."""
    return FAMILIES[layout.family]
