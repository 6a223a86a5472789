"""The config trees of the recipes, composed from the components' own sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

from toolkit.checkpoint.manager import CheckpointConfig
from toolkit.config.declarations import (
    ALWAYS,
    FROM_NEXT_STEP,
    OWN_CHECK,
    SCHEDULE,
    TOKENS,
    CheckedBy,
    Need,
    declared,
    free,
    refused,
)
from toolkit.config.load import field
from toolkit.config.values import name_problems, path_problems
from toolkit.data.chat import ChatDataConfig
from toolkit.data.corpus import DataConfig
from toolkit.data.records import ColumnsConfig
from toolkit.data.tokenizer import TokenizerConfig
from toolkit.models import float8
from toolkit.models.adapter import AdapterConfig
from toolkit.models.base_model import BaseModelConfig
from toolkit.models.preference_loss import PreferenceLoss
from toolkit.models.scratch import ModelConfig
from toolkit.run.paths import OUTPUT, READ, RESUME
from toolkit.training.evaluation import EvalConfig
from toolkit.training.forgetting import ForgettingConfig, forgetting_problems
from toolkit.training.metrics import LoggingConfig
from toolkit.training.optim import OptimConfig
from toolkit.training.profiling import check_steps
from toolkit.training.samples import SamplesConfig
from toolkit.training.unused import repeated_entries, unused_settings

SEED_MAX = 2**32 - 1  # numpy's legacy seed range, the common one; the data order's generator takes seed x 1,000,003

# Keys renamed in 0.2 (one name per concept across the recipes); the old ones work for one release.
EVAL_RENAMED = {"logging.eval_every": "eval.every", "logging.eval_blocks": "eval.blocks"}
FP8 = Need("train.mixed_precision", ("fp8",), "fp8's")


def _epochs_count_the_run(cfg) -> str | None:
    return f"train.epochs={cfg.train.epochs:g} sets it from the data" if cfg.train.epochs is not None else None


@dataclass
class TrainConfig:
    max_steps: int = field(200, help="optimizer steps to train", resume=SCHEDULE, used_when=_epochs_count_the_run,
                           accepts={"2**31": "a long run: stopped any time by Ctrl-C or SIGTERM, it checkpoints and "
                                    "resumes"})
    epochs: float | None = field(
        None, help="passes over the packed training blocks, in place of max_steps: max_steps = ceil(epochs x steps per "
        "epoch), said when the data is ready", resume=FROM_NEXT_STEP, used_when=ALWAYS,
        accepts={"unset": "train.max_steps counts the run: the default"},
    )
    global_batch_size: int = field(
        16, help="sequences per optimizer step, over all processes and micro-batches", resume=OWN_CHECK, used_when=ALWAYS,
        accepts={"2**31": "refused once the data is packed, before training: fewer blocks than one step "
                 "(toolkit.data.batching)"},
    )
    micro_batch_size: int = field(
        4, help="sequences per forward/backward on one process",
        resume=free("the accumulation splits the same global batch (test_strategies' parity runs)"), used_when=ALWAYS,
        accepts={"2**31": "refused at launch by the layout: it does not divide global_batch_size"},
    )
    mixed_precision: Literal["auto", "no", "bf16", "fp16", "fp8"] = field(
        "auto", help="auto = bf16 where the GPU supports it, fp32 on CPU; bf16 also trains on CPU (slowly); fp8 = "
        "the large linear layers in float8 through torchao, the rest in bf16 (GPUs of compute capability 8.9+, with "
        "model.compile; docs/fp8.md)",
        resume=refused("the strategy's saved weights and optimizer state are in its precision"), used_when=ALWAYS,
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] = field(
        "tensorwise", help="with mixed_precision=fp8: torchao's scaling, one scale per tensor (faster) or per row "
        "(closer to bf16)", resume=FROM_NEXT_STEP, used_when=FP8,
    )
    fp8_layers: Literal["auto", "mlp"] = field(
        "auto", help="with mixed_precision=fp8: which linear layers compute in float8; auto = those torchao's size "
        "rule keeps, mlp = only the MLP's among them (on an H200 the 1B's 2048 x 2048 attention projections were "
        "slower in float8 alone: docs/fp8.md)", resume=FROM_NEXT_STEP, used_when=FP8,
    )
    collective_timeout_s: int = field(
        1800,
        help="seconds a rank waits in a collective (all-reduce, barrier) before the run fails with an error "
        "naming the rank and the wait; raise it if rank 0 alone prepares a very large corpus",
        resume=free("a wait limit"), used_when=ALWAYS,
    )
    on_nonfinite: Literal["skip", "abort"] = field(
        "skip",
        help="a NaN or inf loss or gradient on any rank, found before the optimizer step: skip = drop that "
        "batch (weights, optimizer state and schedule untouched), abort = stop the run (exit code 5); under "
        "train.step_sync=none both are said a step later", resume=FROM_NEXT_STEP, used_when=ALWAYS,
    )
    pipeline_stages: int = field(
        1, help="cut the model's layers into this many pipeline stages, one process each (torch's 1F1B schedule over "
        "the accumulation's micro-batches); processes = replicas x stages, under accelerate_configs/ddp.yaml",
        resume=free("a checkpoint converts to another layout (test_resume_elsewhere)"), used_when=ALWAYS,
        accepts={"2**31": "refused at launch: it does not divide the processes launched (toolkit.strategy.parallelism)"},
    )
    step_sync: Literal["auto", "host", "none"] = field(
        "auto", help="host = the step waits for the device to say whether a NaN/inf step is skipped; none = torch's "
        "fused AdamW skips it on the device and the skip's log, counters and schedule follow a step later (the "
        "GPU never waits for the host); auto = none where fused AdamW steps (CUDA, not DeepSpeed or a pipeline)",
        resume=free("when the host reads the step's verdict"), used_when=ALWAYS,
    )
    canary: Literal["none", "stop", "warn"] = field(
        "none", help="check the fast paths in use (model.compile, flex or flash attention, fp8, model.loss=chunked, "
        "the per-step bf16 copy) against their references while training: at the launch's first step and every "
        "canary_every steps, a row of the step's batch goes through both on the same weights; a loss or sampled "
        "gradient past the precision's tolerance stops the run (exit code 5) or, with warn, is said",
        resume=free("a check beside training: it changes no number training computes (test_canary)"),
        used_when=ALWAYS,
    )
    canary_every: int = field(
        100, help="with canary on: steps between two checks (each costs about two forwards and backwards of one "
        "row)", resume=free("(test_canary)"), used_when=Need("train.canary", ("stop", "warn"), "the canary's"),
        accepts={"2**31": "one check, at the launch's first step"},
    )
    max_nonfinite_skips: int = field(
        3, help="with on_nonfinite=skip, stop the run (exit code 5) after this many skipped steps in a row: "
        "then it is the model that diverged, not one bad batch", resume=FROM_NEXT_STEP,
        used_when=Need("train.on_nonfinite", ("skip",), "on_nonfinite=skip's"),
        accepts={"2**31": "never stop for skipped steps: each is still said"},
    )

    def validate(self) -> list[str]:
        problems = []
        for name in ("max_steps", "global_batch_size", "micro_batch_size", "collective_timeout_s", "max_nonfinite_skips",
                     "pipeline_stages", "canary_every"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be at least 1")
        if self.epochs is not None and not 0 < self.epochs < 1e6:  # NaN fails both
            problems.append(f"epochs={self.epochs} must be above 0 (and finite)")
        if self.collective_timeout_s > YEAR_S:  # timedelta and the backends' millisecond counts overflow past that
            problems.append(f"collective_timeout_s={self.collective_timeout_s} must be at most {YEAR_S} (a year)")
        return problems


YEAR_S = 365 * 24 * 3600


@dataclass
class RunConfig:
    """The sections every recipe has, named alike: where the run goes and how the shared loop runs."""

    PATHS: ClassVar[tuple[str, ...]] = ()  # the keys that hold paths: path_keys, set below each recipe's config
    # eval.harness_tasks scored at every eval.every step, beside training (toolkit.training.harness_runs)
    HARNESS_STEPS: ClassVar[bool] = True

    output_dir: str = field("runs/run", help="where checkpoints, metrics, plots and the deliverables go",
                            resume=free("where the run is (resume=PATH names a checkpoint of another)"),
                            used_when=ALWAYS, path=OUTPUT)
    seed: int = field(1234, help="seed for init, data order and dropout", resume=OWN_CHECK, used_when=ALWAYS,
                      accepts={"0": "a seed like any other", "2**31": "within numpy's seed range (up to 2**32 - 1)"})
    resume: str | None = field(
        None, help="auto (newest complete checkpoint in output_dir) or a checkpoint folder",
        resume=free("which checkpoint"), used_when=CheckedBy("RunConfig.validate (with overwrite=true)"),
        path=RESUME,  # a checkpoint, in this run's checkpoints/ or another's: read once, at the start
        accepts={"unset": "no resume: the default"},
    )
    overwrite: bool = field(False, help="delete an existing run in output_dir and start over",
                            resume=free("refused beside resume (RunConfig.validate)"), used_when=ALWAYS)
    train: TrainConfig = field(default_factory=TrainConfig, help="steps, batch sizes, precision")
    optim: OptimConfig = field(default_factory=OptimConfig, help="optimizer and schedule")
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, help="checkpoint cadence")
    logging: LoggingConfig = field(default_factory=LoggingConfig, help="metrics and trackers")
    eval: EvalConfig = field(default_factory=EvalConfig, help="held-out evaluation cadence and size")

    def validate(self) -> list[str]:
        problems = path_problems(self, ("output_dir", "resume"))
        if self.resume and self.overwrite:
            problems.append("resume and overwrite=true contradict each other; choose one")
        if not 0 <= self.seed <= SEED_MAX:  # numpy takes no negative seed; the batch order multiplies it
            problems.append(f"seed={self.seed} must be in [0, {SEED_MAX}]")
        if not check_steps(self.logging.profile) and self.train.epochs is None:  # else the steps follow from the data
            problems += [f"logging.{p}" for p in check_steps(self.logging.profile, self.train.max_steps)]
        if self.train.mixed_precision == "fp8":
            problems += float8.config_problems(self)
        if self.train.epochs is not None and (self.data.sources or getattr(self.data, "streaming", False)):
            problems.append(f"train.epochs={self.train.epochs:g} counts passes over one prepared corpus; with "
                            f"data.{'sources' if self.data.sources else 'streaming'} give train.max_steps instead")
        return problems + repeated_entries(self)

    def notes(self) -> list[str]:
        """Lines for the log before anything runs: the settings the rest of the config leaves without effect (a YAML
        written for LoRA run with adapter.method=full keeps its LoRA keys, and is said to)."""
        return unused_settings(self)


@dataclass
class PretrainConfig(RunConfig):
    output_dir: str = field("runs/pretrain", help="where checkpoints, metrics, plots and final/ go")
    model: ModelConfig = field(default_factory=ModelConfig, help="architecture")
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig, help="tokenizer")
    data: DataConfig = field(default_factory=DataConfig, help="corpus and packing")
    samples: SamplesConfig = field(
        default_factory=lambda: SamplesConfig(max_new_tokens=40), help="generations from final/ at the end"
    )

    RENAMED: ClassVar[dict] = {
        "sample.prompt": ("samples.prompts", lambda prompt: [prompt]),
        "sample.max_new_tokens": "samples.max_new_tokens",
        **EVAL_RENAMED,
    }

    def validate(self) -> list[str]:
        problems = super().validate()
        # generated from final/ after training: past the model's positions it fails (learned positions) or runs on
        # for hours, with training done and nothing of the samples saved
        limit = self.model.positions()
        if limit is not None and self.data.seq_len > limit:  # as recipes/pretrain.py's check_seq_len, at load
            problems.append(f"data.seq_len={self.data.seq_len} is larger than the model's max positions ({limit}); "
                            "lower data.seq_len or raise model.config.max_position_embeddings")
        if limit is not None and self.samples.max_new_tokens > limit:
            problems.append(f"samples.max_new_tokens={self.samples.max_new_tokens} is more than the model's "
                            f"{limit} positions; use at most {limit}, or 0 for no samples")
        return problems


@dataclass
class FinetuneDataConfig(DataConfig):
    """The pretraining corpus options plus what chat SFT needs; `format` picks the mode."""

    format: Literal["text", "chat", "preference"] = field(
        "text", help="text = continued pretraining on raw text; chat = SFT on chat records (loss on assistant tokens); "
        "preference = prompt/chosen/rejected records for train.objective dpo, simpo or orpo",
        resume=refused(TOKENS), used_when=ALWAYS,
    )
    overlong: Literal["truncate", "drop"] = field(
        "truncate", help="chat: a conversation longer than seq_len is truncated (keeps its start) or dropped",
        resume=refused(TOKENS), used_when=Need("data.format", ("chat", "preference"), "chat and preference records'"),
    )
    chat_template: str | None = field(
        None, help="chat: Jinja chat template (text or .jinja file) used instead of the tokenizer's",
        resume=refused(TOKENS), used_when=CheckedBy("FinetuneDataConfig.validate"),
        path=READ,  # a .jinja file, or the template itself
        accepts={"unset": "the tokenizer's own template"},
    )
    append_stop: bool = field(
        False, help="chat, preference: train the EOS token after each assistant answer whose turn the template ends "
        "without it (a turn that ends with the next role's marker): the repair of the stop check (docs/data.md)",
        resume=refused(TOKENS), used_when=Need("data.format", ("chat", "preference"), "chat and preference records'"),
    )
    val_path: str | None = field(
        None, help="held-out data of its own, read as data.path is (records for chat and preference, text "
        "otherwise), in place of val_fraction", resume=refused(TOKENS),
        used_when=ALWAYS,  # beside data.sources: FinetuneDataConfig.validate
        path=READ, accepts={"unset": "data.val_fraction of data.path is held out"},
    )
    columns: ColumnsConfig = field(
        default_factory=ColumnsConfig, help="chat: records of another shape, mapped: conversation, role, content, user, "
        "assistant, system (docs/data.md)"
    )
    record_format: Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion"] = field(
        "auto", help="chat: the records' shape: messages, sharegpt, alpaca or prompt_completion (docs/data.md); auto = "
        "each record's own", resume=refused(TOKENS), used_when=CheckedBy("FinetuneDataConfig.validate"),
    )

    def validate(self) -> list[str]:
        problems = super().validate() + path_problems(self, ("val_path",))
        problems += [f"columns.{p}" for p in name_problems(self.columns, (
            "conversation", "role", "content", "user", "assistant", "system"))]
        if self.chat_template is not None and not self.chat_template.strip():
            problems.append("chat_template is blank; give the template's text or a .jinja file, or leave it out "
                            "(data.chat_template=) for the tokenizer's own")
        if self.streaming:
            problems.append("streaming=true is for pretraining (recipes/pretrain.py); fine-tuning prepares its "
                            "corpus ahead: drop data.streaming")
        if self.format in ("chat", "preference"):
            problems += [p for p in self.chat().validate() if p not in problems and not p.startswith("val_fraction")]
        if self.record_format != "auto" and self.format != "chat":  # set, and silently not used
            problems.append(f"record_format={self.record_format} names the shape of chat records; format={self.format} "
                            "does not read it: drop it, or set data.format=chat")
        elif self.columns.conversation and self.record_format != "auto":
            problems.append(f"record_format={self.record_format} and columns.conversation={self.columns.conversation} "
                            "both say how to read the records: keep one")
        elif self.record_format != "auto" and not self.path and not self.sources:
            problems.append(f"record_format={self.record_format} names the shape of your records in data.path; the "
                            "embedded set needs none: give data.path, or drop it")
        if self.columns.conversation and self.format != "chat":  # set, and silently not used
            problems.append(f"columns.conversation={self.columns.conversation} maps chat records; format={self.format} "
                            "does not read it: drop it, or set data.format=chat")
        if self.chat_template and self.format == "text":
            problems.append("chat_template is for format=chat or preference; continued pretraining on text renders no "
                            "conversations: drop it, or set data.format=chat")
        if self.val_path and self.path and self.val_path == self.path:
            problems.append(f"val_path={self.val_path} is data.path itself: the held-out data would be trained on; give "
                            "data of its own, or drop val_path to hold out data.val_fraction of data.path")
        if self.val_path and self.sources:
            problems.append("val_path holds one corpus's held-out data; with sources each source holds out its own "
                            "(val_fraction): drop val_path")
        return problems

    def source_problems(self) -> list[str]:
        """Each source's record_format and columns: chat's only; columns keys as data.columns has, naming the column
        of turns, and not beside a record_format."""
        problems, keys = [], [f.name for f in dataclasses.fields(ColumnsConfig)]
        for i, s in enumerate(self.sources):
            set_here = [k for k in ("record_format", "columns") if s is not None and getattr(s, k)]
            if s is None:
                continue
            if set_here and self.format != "chat":
                problems += [f"sources[{i}].{k} maps chat records; format={self.format} does not read it: drop it, or "
                             "set data.format=chat" for k in set_here]
            elif unknown := sorted(set(map(str, s.columns)) - set(keys)):
                problems.append(f"sources[{i}].columns names {', '.join(unknown)}; its keys are {', '.join(keys)}")
            elif bad := [k for k, v in s.columns.items() if not isinstance(v, str) or not v.strip()]:
                problems.append(f"sources[{i}].columns.{bad[0]}={s.columns[bad[0]]!r} must be a name (a string)")
            elif s.columns and not s.columns.get("conversation"):
                problems.append(f"sources[{i}].columns has no conversation: name the column holding the turns")
            elif s.columns and s.record_format:
                problems.append(f"sources[{i}].record_format={s.record_format} and its columns both say how to read "
                                "its records: keep one")
        return problems

    def of_sources(self) -> list[FinetuneDataConfig]:
        """Each source as a data section, its record_format and columns its own where it names them (a source naming
        either reads by it alone; one naming neither reads by data.record_format and data.columns)."""
        parts = super().of_sources()
        if not self.sources:
            return parts
        return [dataclasses.replace(
            part, record_format=s.record_format or ("auto" if s.columns else self.record_format),
            columns=ColumnsConfig(**s.columns) if s.columns else ColumnsConfig() if s.record_format else self.columns)
            for part, s in zip(parts, self.sources, strict=True)]

    def chat(self) -> ChatDataConfig:
        return ChatDataConfig(
            path=self.path, seq_len=self.seq_len, overlong=self.overlong, chat_template=self.chat_template,
            val_fraction=self.val_fraction, record_format=self.record_format, val_path=self.val_path, name=self.name,
            split=self.split, columns=self.columns, append_stop=self.append_stop,
        )


BETA = {"dpo": 0.1, "simpo": 2.0, "orpo": 0.1}  # train.beta when empty: the papers' (and TRL's) usual values
OWN = {"gamma": ("simpo", 0.5), "orpo_lambda": ("orpo", 0.1)}  # a setting of one objective, and its value when empty


@dataclass
class FinetuneTrainConfig(TrainConfig):
    """The shared loop's options plus what the model is trained to do."""

    objective: Literal["sft", "dpo", "simpo", "orpo"] = field(
        "sft", help="sft = next-token loss on the targets; dpo, simpo, orpo = preference tuning on "
        "data.format=preference pairs (docs/preference.md)", resume=FROM_NEXT_STEP,
        used_when=ALWAYS,  # beside data.format: FinetuneConfig.validate
    )
    beta: float | None = field(
        None, help="dpo: how strongly the model is held to its reference (empty: 0.1); simpo: the scale of its "
        "length-normalised rewards (empty: 2.0); orpo: of its rewards (empty: 0.1)", resume=FROM_NEXT_STEP,
        used_when=CheckedBy("FinetuneTrainConfig.validate"),
        accepts={"unset": "the objective's usual beta (0.1, or 2.0 for simpo)"},
    )
    gamma: float | None = field(
        None, help="simpo: the margin the chosen answer's reward must clear (empty: 0.5)", resume=FROM_NEXT_STEP,
        used_when=CheckedBy("FinetuneTrainConfig.validate"),
        accepts={"unset": "simpo's usual margin, 0.5", "0": "simpo with no margin"},
    )
    orpo_lambda: float | None = field(
        None, help="orpo: weight of the odds-ratio term beside the chosen answer's loss (empty: 0.1)",
        resume=FROM_NEXT_STEP, used_when=CheckedBy("FinetuneTrainConfig.validate"),
        accepts={"unset": "orpo's usual weight, 0.1", "0": "orpo without its odds-ratio term"},
    )

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.beta is not None and self.beta <= 0:
            problems.append(f"beta={self.beta} must be > 0")
        if self.beta is not None and self.objective == "sft":
            problems.append(f"beta={self.beta} is a preference objective's; train.objective=sft does not use it: "
                            "drop it, or set train.objective to dpo, simpo or orpo")
        for name, (objective, _) in OWN.items():
            value = getattr(self, name)
            if value is not None and value < 0:
                problems.append(f"{name}={value} must be >= 0")
            elif value is not None and self.objective != objective:  # set, and silently not used
                problems.append(f"{name}={value} is {objective}'s; train.objective={self.objective} does not use it: "
                                f"drop it, or set train.objective={objective}")
        return problems

    def objective_settings(self) -> dict:
        """What a checkpoint records of the objective (toolkit.checkpoint.settings): gamma and orpo_lambda only
        where the objective uses them, at the value it uses."""
        used = {f"train.{name}": self.setting(name) for name, (objective, _) in OWN.items() if objective == self.objective}
        return {"train.objective": self.objective, "train.beta": self.beta, **used}

    def setting(self, name: str) -> float:
        value = getattr(self, name)
        return OWN[name][1] if value is None else value

    def preference(self) -> PreferenceLoss | None:
        """The preference loss of train.objective, or None for sft."""
        if self.objective == "sft":
            return None
        beta = self.beta if self.beta is not None else BETA[self.objective]
        return PreferenceLoss(self.objective, beta, self.setting("gamma"), self.setting("orpo_lambda"))


@dataclass
class FinetuneConfig(RunConfig):
    output_dir: str = field("runs/finetune", help="where checkpoints, metrics, samples, adapter/ and final/ go")
    train: FinetuneTrainConfig = field(default_factory=FinetuneTrainConfig, help="steps, batch sizes, precision, "
                                       "objective")
    model: BaseModelConfig = field(default_factory=BaseModelConfig, help="the pretrained model to adapt")
    adapter: AdapterConfig = field(default_factory=AdapterConfig, help="full, LoRA or QLoRA")
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig, help="domain text or chat records")
    samples: SamplesConfig = field(default_factory=SamplesConfig, help="generations before and after, into samples.md")
    forgetting: ForgettingConfig = field(default_factory=ForgettingConfig, help="what the base knew that the run may "
                                         "lose: a general held-out set and a budget held at each evaluation")

    RENAMED: ClassVar[dict] = {"base_model": "model", **EVAL_RENAMED}
    HARNESS_STEPS: ClassVar[bool] = False  # a fine-tune scores its base and its result, at its end (recipes/finetune.py)

    def validate(self) -> list[str]:
        problems = super().validate()
        preference = self.data.format == "preference"
        if preference and self.train.objective == "sft":
            problems.append("data.format=preference holds pairs to prefer, not text to imitate; set train.objective to "
                            "dpo, simpo or orpo")
        elif not preference and self.train.objective != "sft":
            problems.append(f"train.objective={self.train.objective} trains on preference pairs; set "
                            "data.format=preference (records with prompt, chosen and rejected)")
        return problems + forgetting_problems(self)


def path_keys(cls: type) -> tuple[str, ...]:
    """The keys of a recipe's config that hold paths (their fields' path=): load_config expands `~` and variables in
    them, the same way wherever they are read; relative ones are relative to where the recipe runs."""
    return tuple(k for k, role in declared(cls, "path").items() if role is not None)


PretrainConfig.PATHS = path_keys(PretrainConfig)
FinetuneConfig.PATHS = path_keys(FinetuneConfig)
