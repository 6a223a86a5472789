"""The config trees of the recipes, composed from the components' own sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from toolkit.models.adapter import AdapterConfig
from toolkit.models.base_model import BaseModelConfig
from toolkit.data.batching import TrainConfig
from toolkit.data.chat import ChatDataConfig
from toolkit.training.checkpoint import CheckpointConfig
from toolkit.config import field
from toolkit.data.corpus import DataConfig
from toolkit.training.metrics import LoggingConfig
from toolkit.models.scratch import ModelConfig
from toolkit.training.optim import OptimConfig
from toolkit.data.tokenizer import TokenizerConfig


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


@dataclass
class FinetuneDataConfig(DataConfig):
    """The pretraining corpus options plus what chat SFT needs; `format` picks the mode."""

    format: Literal["text", "chat"] = field(
        "text", help="text = continued pretraining on raw text; chat = SFT on chat records (loss on assistant tokens)"
    )
    overlong: Literal["truncate", "drop"] = field(
        "truncate", help="chat: a conversation longer than seq_len is truncated (keeps its start) or dropped"
    )
    chat_template: str | None = field(
        None, help="chat: Jinja chat template (text or .jinja file) used instead of the tokenizer's"
    )

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.format == "chat":
            problems += [p for p in self.chat().validate() if p not in problems and not p.startswith("val_fraction")]
        return problems

    def chat(self) -> ChatDataConfig:
        return ChatDataConfig(
            path=self.path, seq_len=self.seq_len, overlong=self.overlong, chat_template=self.chat_template,
            val_fraction=self.val_fraction,
        )


@dataclass
class SamplesConfig:
    prompts: list[str] = field(
        default_factory=lambda: ["The"], help="prompts generated from before and after training, into samples.md"
    )
    max_new_tokens: int = field(48, help="tokens generated per prompt (greedy); 0 = no samples")

    def validate(self) -> list[str]:
        return [] if self.max_new_tokens >= 0 else [f"max_new_tokens={self.max_new_tokens} must be >= 0"]


@dataclass
class FinetuneConfig:
    output_dir: str = field("runs/finetune", help="where checkpoints, metrics, samples, adapter/ and final/ go")
    seed: int = field(1234, help="seed for LoRA init, data order and dropout")
    resume: str | None = field(None, help="auto (newest complete checkpoint in output_dir) or a checkpoint folder")
    overwrite: bool = field(False, help="delete an existing run in output_dir and start over")
    base_model: BaseModelConfig = field(default_factory=BaseModelConfig, help="the pretrained model to adapt")
    adapter: AdapterConfig = field(default_factory=AdapterConfig, help="full, LoRA or QLoRA")
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig, help="domain text or chat records")
    train: TrainConfig = field(default_factory=TrainConfig, help="steps, batch sizes, precision")
    optim: OptimConfig = field(default_factory=OptimConfig, help="optimizer and schedule")
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, help="checkpoint cadence")
    logging: LoggingConfig = field(default_factory=LoggingConfig, help="metrics and evaluation")
    samples: SamplesConfig = field(default_factory=SamplesConfig, help="generations before and after")

    def validate(self) -> list[str]:
        if self.resume and self.overwrite:
            return ["resume and overwrite=true contradict each other; choose one"]
        return []
