"""Training metrics: `metrics.jsonl`, model FLOPs utilisation, and the copy of a step's numbers to the host
(loss.png: toolkit.training.loss_plot)."""

from __future__ import annotations

import contextlib
import difflib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import LoggerType
from tqdm.auto import tqdm

from toolkit.config.declarations import ALWAYS, free
from toolkit.config.load import field
from toolkit.models.scratch import count_parameters
from toolkit.run.writes import writing
from toolkit.training.profiling import check_steps

# Dense bf16 peak (no sparsity) per GPU, FLOP/s, from the vendors' datasheets.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 125e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,  # fp16 tensor cores; V100 has no bf16
    "T4": 65e12,
}


def accelerate_trackers() -> list[str]:
    """The trackers Accelerate drives, by the names logging.trackers takes: its own list (LoggerType),
    without "all" (a run says which trackers it logs to)."""
    return [str(t) for t in LoggerType if t != LoggerType.ALL]


REPORTED = free("what is reported")


@dataclass
class LoggingConfig:
    every: int = field(1, help="write a metrics line every N optimizer steps", resume=REPORTED, used_when=ALWAYS,
                       accepts={"2**31": "metrics at the last step only"})
    trackers: list[str] = field(
        default_factory=lambda: ["tensorboard"],
        help=f"Accelerate's trackers to log to, any of: {', '.join(accelerate_trackers())} ([] = metrics.jsonl only)",
        resume=REPORTED, used_when=ALWAYS, path=None, unique=True, accepts={"[]": "metrics.jsonl only, as documented"},
    )
    profile: list[int] = field(
        default_factory=list,
        help="[FIRST, LAST]: trace these optimizer steps with torch.profiler into profile/ (trace.json, and "
             "summary.md: device busy time, idle gaps, top kernels); [] = off",
        resume=REPORTED, used_when=ALWAYS, unique=False,  # [first, last]: a pair, in order
        accepts={"[]": "no profiling: the default"},
    )

    def validate(self) -> list[str]:
        problems = []
        if self.every < 1:
            problems.append(f"every={self.every}: use at least 1")
        problems += check_steps(self.profile)
        known = accelerate_trackers()
        for t in self.trackers:
            if t not in known:
                close = difflib.get_close_matches(str(t).lower(), known, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                problems.append(f"trackers has {t!r}, which Accelerate does not drive; its trackers are "
                                f"{', '.join(known)}{hint}")
        return problems


def check_trackers(trackers: list[str]) -> None:
    """Accelerate drops a tracker whose package is missing with a debug line only; a run must not
    log nowhere. Its own availability checks decide (accelerate.tracking)."""
    import accelerate.tracking

    from toolkit.config.errors import UserError

    available = {str(t) for t in accelerate.tracking.get_available_trackers()}
    for name in trackers:
        if name not in available:
            raise UserError(
                f"logging.trackers has {name}, but the {name} package is not installed; "
                f"pip install {name}, or remove it from logging.trackers"
            )


def tracker_log_with(trackers: list[str], project_dir: str) -> list:
    """What the Accelerator logs with: tensorboard built here, so that its events stay in
    `project_dir`/tensorboard/ whatever the project is called (Accelerate names its folder after
    the project); every other tracker by name, started by init_trackers under the run's project."""
    from accelerate.tracking import TensorBoardTracker

    return [TensorBoardTracker("tensorboard", project_dir) if name == "tensorboard" else name for name in trackers]


def flops_per_token(n_matmul_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token, as in PaLM (appendix B) and nanoGPT: 6N for the weight matmuls
    plus 12 * layers * seq_len * hidden for the attention scores and values (forward + backward)."""
    return 6 * n_matmul_params + 12 * n_layers * seq_len * hidden


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of the device, or None where it is not known (CPUs: never guessed)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def estimate_mfu(tokens_per_s: float, flops_token: float, world_size: int, peak: float | None) -> float | None:
    if peak is None:
        return None
    return tokens_per_s * flops_token / (peak * world_size)


def model_size(model: torch.nn.Module, seq_len: int) -> tuple[int, float]:
    """(parameters, training FLOPs per token) of a model about to train, for the card and MFU.

    The FLOPs count every weight that multiplies: the input embedding is a lookup and does not,
    but a tied output head is the same matrix used as a matmul over the vocabulary, and counts
    (leaving it out read SmolLM2's MFU ~20 % low, the 1B config's ~6 %).
    """
    n_params = count_parameters(model)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied_head = head is not None and embedding is not None and head.weight is embedding.weight
    n_matmul = count_parameters(model, exclude_embeddings=True) + (head.weight.numel() if tied_head else 0)
    flops = flops_per_token(n_matmul, model.config.num_hidden_layers, model.config.hidden_size, seq_len)
    return n_params, flops


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """This process's peak resident memory, and on GPUs the peak memory torch allocated."""
    import resource

    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
    if device.type == "cuda":
        out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


# metrics.jsonl: one JSON object a line, each with a `kind` and the columns of that kind (the optional ones: a
# mixture's per-source columns `tokens/<name>`, `eval_loss/<name>`, `eval_tokens/<name>` or `eval_pairs/<name>`; a MoE's
# `router_aux_loss`; a preference objective's `rewards/*` and `eval_rewards/*`), so that
# `pandas.read_json(path, lines=True).groupby("kind")` gives one dense frame a kind (docs/metrics.md).
KINDS = {
    "train": ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "epoch"),  # every logging.every steps
    "eval": ("step", "phase", "eval_loss"),  # phase: before (a fine-tune's base), train, after; eval_ppl but for pairs
    "memory": ("step", "held_bytes"),  # the bytes each rank held after its first step
    "nonfinite": ("step", "nonfinite", "action", "in_a_row"),  # a NaN/inf step skipped, or the run stopped
    "checkpoint_error": ("step", "checkpoint_error"),  # a save that failed under checkpoint.on_save_error=continue
    "harness": ("step", "phase"),  # eval.harness_tasks' scores, harness/<task>/<metric>; logged when they arrive
    "canary": ("step", "loss", "reference_loss", "loss_drift", "grad_drift", "tolerance", "drifted"),  # train.canary
    # a budgeted fine-tune's forgetting, after each evaluation (and at step 0, phase before): share and best_step null
    # without replay or a kept checkpoint, general_limit null for a general set reported without a budget
    "budget": ("step", "domain_loss", "general_loss", "general_base", "general_limit", "general_change", "within",
               "share", "best_step"),
    "summary": ("step", "parameter_digests", "peak_memory"),  # after the last evaluation and checkpoint
    "phases": ("step", "seconds", "total_seconds"),  # the last row: each phase's wall seconds (toolkit.training.phases)
}


def check_kind(kind: str, record: dict) -> str:
    """`kind`, once `record` has its columns (a row another reader would find sparse fails the run's tests)."""
    missing = [c for c in KINDS[kind] if c not in record]
    if missing:
        raise ValueError(f"a {kind} row of metrics.jsonl lacks {missing}: {sorted(record)}")
    return kind


class MetricsWriter:
    """Appends one JSON object per line; on resume, drops lines past the resumed step, and a
    last line torn by a hard kill (it would otherwise make every later read fail). A write that
    fails (a full disk) is said once through `say`, and the run goes on without metrics.jsonl's
    later rows (toolkit.run.writes.WRITERS['metrics'])."""

    def __init__(self, path: Path, resume_step: int | None, say: Callable[[str], None] = print):
        self.path, self.say = path, say
        self._kept: list[dict] = []
        self._file = None
        with writing("metrics", say=self._give_up):
            self._open(path, resume_step)

    def _open(self, path: Path, resume_step: int | None) -> None:
        if resume_step is not None and path.exists():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and record.get("step", 0) <= resume_step:
                    kept.append(line)
                    self._kept.append(record)
            path.write_text("".join(line + "\n" for line in kept))
        self._file = path.open("a")

    def has(self, step: int, key: str, kind: str | None = None) -> bool:
        """Whether a kept record of `step` (of `kind`) holds `key` (what a resumed run must not write twice)."""
        return any(r.get("step") == step and key in r and kind in (None, r.get("kind")) for r in self._kept)

    def write(self, record: dict) -> None:
        if self._file is None:  # a write failed: said once, the rows after it are not written
            return
        with writing("metrics", say=self._give_up):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def _give_up(self, warning: str) -> None:
        self.say(warning)
        if self._file is not None:
            with contextlib.suppress(OSError):  # closing flushes the rows that did not fit, and fails again
                self._file.close()
        self._file = None

    def close(self) -> None:
        if self._file is not None:
            with writing("metrics", say=self._give_up):
                self._file.close()
            self._file = None


class TrackerLog:
    """The numbers of each row to the trackers Accelerate drives (logging.trackers), until a write fails (a full
    disk): said once through `say`, then left alone for the rest of the run (toolkit.run.writes.WRITERS['trackers'])."""

    def __init__(self, accelerator, trackers: list[str], say: Callable[[str], None]):
        self.accelerator, self.trackers, self.say, self.written = accelerator, trackers, say, True

    def log(self, scalars: dict, step: int) -> None:
        if self.trackers and self.written:
            self.written = False
            with writing("trackers", say=self.say):
                self.accelerator.log(scalars, step=step)
                self.written = True

    def close(self) -> None:
        """Flush and close the trackers (Accelerate's end_training)."""
        with writing("trackers", say=self.say):
            self.accelerator.end_training()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def flat_hparams(tree: dict, prefix: str = "") -> dict:
    """A nested config as the flat scalars that tensorboard's hparams take."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_hparams(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


@contextlib.contextmanager
def beside_the_bar(bar) -> Iterator[None]:
    """What is printed inside, on a line of its own while a progress bar is drawn: in a terminal the bar is cleared
    and drawn again under it; in a file (SLURM, `> log`), where the bar's updates are "\r" with no end of line, its
    line is ended first. No bar (or a closed one: closing ended its line), as printed."""
    if bar is None or bar.disable:
        yield
    elif sys.stderr.isatty():
        with tqdm.external_write_mode():
            yield
    else:
        sys.stderr.write("\n")
        sys.stderr.flush()
        yield
        sys.stdout.flush()


class HostCopy:
    """A few numbers of a device tensor, copied to the host without waiting for the device.

    On CUDA the copy goes to pinned memory behind an event; `get` waits for that event only,
    not for whatever the device was given afterwards. On the CPU the values are there at once.
    """

    def __init__(self, values: torch.Tensor):
        self.event = None
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values

    @property
    def immediate(self) -> bool:
        """Whether `get` never waits (the same on every rank, unlike asking the event)."""
        return self.event is None

    def get(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
