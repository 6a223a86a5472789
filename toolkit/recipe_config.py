"""The config trees of the recipes, composed from the components' own sections."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.batching import TrainConfig
from toolkit.checkpoint import CheckpointConfig
from toolkit.config import field
from toolkit.corpus import DataConfig
from toolkit.metrics import LoggingConfig
from toolkit.model import ModelConfig
from toolkit.optim import OptimConfig
from toolkit.tokenizer import TokenizerConfig


@dataclass
class SampleConfig:
    prompt: str = field("The", help="prompt for the sample generated at the end of training")
    max_new_tokens: int = field(40, help="tokens to generate for the sample (0 = no sample)")

    def validate(self) -> list[str]:
        return [] if self.max_new_tokens >= 0 else [f"max_new_tokens={self.max_new_tokens} must be >= 0"]


@dataclass
class PretrainConfig:
    output_dir: str = field("runs/pretrain", help="where checkpoints, metrics, plots and final/ go")
    seed: int = field(1234, help="seed for init, data order and dropout")
    resume: str | None = field(None, help="auto (newest complete checkpoint in output_dir) or a checkpoint folder")
    overwrite: bool = field(False, help="delete an existing run in output_dir and start over")
    model: ModelConfig = field(default_factory=ModelConfig, help="architecture")
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig, help="tokenizer")
    data: DataConfig = field(default_factory=DataConfig, help="corpus and packing")
    train: TrainConfig = field(default_factory=TrainConfig, help="steps, batch sizes, precision")
    optim: OptimConfig = field(default_factory=OptimConfig, help="optimizer and schedule")
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, help="checkpoint cadence")
    logging: LoggingConfig = field(default_factory=LoggingConfig, help="metrics and evaluation")
    sample: SampleConfig = field(default_factory=SampleConfig, help="generation at the end")

    def validate(self) -> list[str]:
        if self.resume and self.overwrite:
            return ["resume and overwrite=true contradict each other; choose one"]
        return []
