"""The parallel layout of a run: which strategy kind, over how many processes, split how. One frozen value,
built by toolkit.strategy.parallelism.parallel_layout for a launch and for the planner alike, and saved
in each checkpoint's trainer_state.json as fields."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["single", "ddp", "fsdp", "deepspeed"]  # "single": Accelerate's one process, DDP's files


@dataclass(frozen=True)
class ParallelLayout:
    kind: Kind
    world: int = 0  # processes (0 = not known: a config before a launch, an old checkpoint)
    tp: int = 1  # ranks each layer is split over (parallelism_config_tp_size)
    cp: int = 1  # ranks each sequence is split over (parallelism_config_cp_size)
    sp: int = 1  # ranks each sequence is split over, attention by heads (parallelism_config_sp_size)
    pp: int = 1  # pipeline stages (train.pipeline_stages)
    ep: int = 1  # ranks a mixture of experts' experts are spread over (tp for an MoE)
    zero_stage: int = 0  # DeepSpeed's
    fsdp_version: int = 2
    offload: tuple[str, ...] = ()  # what DeepSpeed offloads: "optimizer", "param"

    @property
    def family(self) -> str:
        """The strategy family that trains it (toolkit.strategy.families): pipeline stages run under DDP's launch,
        as a family of their own: their step, files and memory are not DDP's."""
        return "pipeline" if self.pp > 1 else self.kind

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model between them and read the same data."""
        return self.tp * self.cp * self.sp * self.pp

    @property
    def dp(self) -> int:
        """Ranks that read different data."""
        return self.world // self.model_parallel

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks that shard the model state (FSDP, ZeRO) rather than replicate it."""
        return self.dp if self.kind in ("fsdp", "deepspeed") and self.pp == 1 else 1

    @property
    def dp_replicate(self) -> int:
        return self.dp // max(1, self.dp_shard)

    @property
    def accelerate_name(self) -> str:
        """The strategy of the accelerate config, as the first log line names it (a pipeline runs under DDP's)."""
        if self.kind == "deepspeed":
            offload = f" (offload {'+'.join(self.offload)})" if self.offload else ""
            return f"DeepSpeed ZeRO-{self.zero_stage}{offload}"
        if self.kind == "fsdp":
            return f"FSDP{self.fsdp_version}"
        return "single process" if self.kind == "single" else "DDP"

    @property
    def name(self) -> str:
        return f"pipeline of {self.pp} stages" if self.pp > 1 else self.accelerate_name

    @property
    def files(self) -> str:
        """The file layout its save_state writes: ddp (one process alike), fsdp1, fsdp2, zero0..zero3 (offload
        changes nothing in the files), or pipeline (each stage's own, toolkit.strategy.pipeline.files)."""
        if self.pp > 1:
            return "pipeline"
        if self.kind == "deepspeed":
            return f"zero{self.zero_stage}"
        if self.kind == "fsdp":
            return f"fsdp{self.fsdp_version}"
        return "ddp"

    def describe(self) -> str:
        """What saved a checkpoint, in the messages about it."""
        if self.kind == "single" and self.pp == 1:
            return "one process"
        processes = f" on {self.world} process{'es' if self.world != 1 else ''}" if self.world else ""
        return f"{self.name}{processes}"

    def record(self) -> dict:
        return {**dataclasses.asdict(self), "offload": list(self.offload)}

    @classmethod
    def from_record(cls, record: dict) -> ParallelLayout:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in record.items() if k in known}
        return cls(**{**values, "offload": tuple(values.get("offload", ()))})

    @classmethod
    def from_name(cls, name: str, world: int) -> ParallelLayout:
        """The layout a checkpoint saved before its layout was recorded names by its strategy's name."""
        zero = re.match(r"DeepSpeed ZeRO-(\d)(?: \(offload (.+)\))?", name)
        if zero:
            return cls("deepspeed", world, zero_stage=int(zero[1]), offload=tuple(zero[2].split("+")) if zero[2] else ())
        stages = re.match(r"pipeline of (\d+) stages", name)
        if stages:
            return cls("ddp", world, pp=int(stages[1]))
        if name.startswith("FSDP"):
            return cls("fsdp", world, fsdp_version=1 if name == "FSDP1" else 2)
        return cls("single" if name == "single process" else "ddp", world)
