"""Where a few optimizer steps spend their time: torch.profiler over steps FIRST..LAST, and one table.

`logging.profile=[FIRST, LAST]` traces those steps on every rank. Rank 0 keeps its trace
(profile/trace.json, for Perfetto or chrome://tracing) and writes profile/summary.json and
profile/summary.md: how busy the device was over the traced wall time, its longest idle gaps with
the host work under each, and the kernels that took the most time. On a CPU run the "device" is
the CPU and its work the operators (aten::): the gaps are then the host's own Python between them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from toolkit.run.folder import RunDir
from toolkit.run.writes import writing

TOP = 12  # kernels and gaps in the table
# Each kernel's (or CPU operator's) kind, by the first pattern its lowered name holds: what a step's device time
# is spent on, the question a top-12 list leaves open when the time is spread over hundreds of small kernels.
KINDS = (
    ("attention", ("flex_attention", "flash", "fmha", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "_mm_")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("communication", ("nccl", "c10d", "allreduce", "all_gather", "reduce_scatter", "gloo")),
    ("memory copies", ("memcpy", "memset", "aten::copy_", "aten::_to_copy")),
)
OTHER = "other: elementwise, norms, loss, casts"


def check_steps(steps: list[int], max_steps: int | None = None) -> list[str]:
    """Problems with a logging.profile value: [] (off) or [FIRST, LAST] within the run."""
    if not steps:
        return []
    if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        return [f"profile={steps}: give two step numbers, [FIRST, LAST] (e.g. [6, 8]), or [] for none"]
    first, last = steps
    if not 1 <= first <= last:
        return [f"profile={steps}: use 1 <= FIRST <= LAST (optimizer steps, counted from 1)"]
    if max_steps is not None and last > max_steps:
        return [f"profile={steps} ends after train.max_steps={max_steps}: trace steps the run takes"]
    return []


class StepProfiler:
    """Started before step FIRST and stopped after step LAST (the trainer calls `begin` and `end` for every
    step); the device is synchronised at both ends, so the traced wall time is the steps' own."""

    def __init__(self, steps: list[int], run: Path, is_main: bool, device: torch.device, say=print):
        self.first, self.last = steps if steps else (0, -1)
        self.folder, self.is_main, self.device, self.say = RunDir(run).profile, is_main, device, say
        self.profiler: torch.profiler.profile | None = None
        self.started = False
        self.summary: dict | None = None
        self.t0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self, step: int) -> None:
        if not self.started and step > self.first > 0:  # a resume from past FIRST
            self.say(f"logging.profile=[{self.first}, {self.last}]: this run starts at step {step}, past step "
                     f"{self.first}: nothing is traced")
        self.started = True
        if step != self.first or self.profiler is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._sync()
        self.profiler = torch.profiler.profile(activities=activities)
        with _quiet_stderr():
            self.profiler.start()
        self.t0 = time.perf_counter()

    def end(self, step: int) -> None:
        """After step LAST: rank 0 writes profile/ and says where it went."""
        if step != self.last or self.profiler is None:
            return
        self._sync()
        wall_us = (time.perf_counter() - self.t0) * 1e6
        profiler, self.profiler = self.profiler, None
        with _quiet_stderr():
            profiler.stop()
        if not self.is_main:
            return
        self.summary = summarise(profiler.events(), wall_us, self.first, self.last)
        written = False
        with writing("profile", say=self.say):  # a full disk: one warning, the run goes on
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / "summary.json").write_text(json.dumps(self.summary, indent=1))
            (self.folder / "summary.md").write_text("\n".join(table(self.summary)) + "\n")
            profiler.export_chrome_trace(str(self.folder / "trace.json"))  # kineto's: device streams included
            written = True
        if not written:
            return
        self.say(f"profile: {self.folder} ({_steps(self.first, self.last)}: {self.summary['wall_ms']:.0f} ms, the "
                 f"device busy {self.summary['busy_share']:.0%} of it; the table in summary.md)")


@contextlib.contextmanager
def _quiet_stderr():
    """kineto (torch 2.13) writes "USDT: ... profiler_start" (and _stop) to the process's stderr from C++,
    whatever KINETO_LOG_LEVEL says: stderr points at /dev/null for those two calls only."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def summarise(events, wall_us: float, first: int, last: int) -> dict:
    """Busy share, longest gaps and top kernels from a profiler's FunctionEvents (times in microseconds)."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    on_device = bool(kernels)
    # on a CPU run the operators, at any depth: their union is the busy time, and each counts its self time
    work = kernels or [e for e in cpu if e.name.startswith("aten::")]
    busy = _merged([(e.time_range.start, e.time_range.end) for e in work])
    start = min((e.time_range.start for e in cpu), default=0.0)
    edges = [start, *[t for span in busy for t in span], start + wall_us]
    gaps = sorted(((edges[i + 1] - edges[i], edges[i]) for i in range(0, len(edges) - 1, 2)), reverse=True)

    def under(t: float) -> str:
        """The innermost host range running at time t (what the host was doing while the device idled)."""
        covering = [e for e in cpu if e.time_range.start <= t <= e.time_range.end and not e.name.startswith("ProfilerStep")]
        if not covering:
            return "(no operator: Python between calls)"
        inner = min(covering, key=lambda e: e.time_range.end - e.time_range.start)
        outer = max(covering, key=lambda e: e.time_range.end - e.time_range.start)
        return inner.name if inner is outer else f"{outer.name} > {inner.name}"

    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in work:
        totals[e.name][0] += (e.time_range.end - e.time_range.start) if on_device else e.self_cpu_time_total
        totals[e.name][1] += 1
    busy_us = sum(b - a for a, b in busy)
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:TOP]
    kinds: dict[str, float] = defaultdict(float)
    for name, (us, _) in totals.items():
        kinds[kind_of(name)] += us
    summed = sum(kinds.values())
    return {
        "steps": [first, last],
        "device": "cuda" if on_device else "cpu",
        "wall_ms": wall_us / 1e3,
        "busy_ms": busy_us / 1e3,
        "busy_share": busy_us / wall_us if wall_us else 0.0,
        "gaps": [{"ms": g / 1e3, "at_ms": (t - start) / 1e3, "host": under(t + g / 2)} for g, t in gaps[:TOP] if g > 0],
        "top": [{"name": name, "ms": us / 1e3, "calls": int(n), "share": us / busy_us if busy_us else 0.0}
                for name, (us, n) in top],
        "kinds": [{"kind": kind, "ms": us / 1e3, "share": us / summed if summed else 0.0}
                  for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1])],
    }


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KINDS if any(m in lowered for m in marks)), OTHER)


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def table(summary: dict) -> list[str]:
    """The summary as markdown: one line of totals, the longest gaps, the top kernels."""
    first, last = summary["steps"]
    what = "GPU kernels" if summary["device"] == "cuda" else "CPU operators"
    lines = [
        f"{_steps(first, last)}: {summary['wall_ms']:.1f} ms wall, device busy {summary['busy_ms']:.1f} ms "
        f"({summary['busy_share']:.1%}; {what})",
        "",
        "| longest idle gaps (ms) | at (ms) | host under it |",
        "|---:|---:|---|",
        *(f"| {g['ms']:.2f} | {g['at_ms']:.1f} | {g['host'][:90].replace('|', '/')} |" for g in summary["gaps"]),
        "",
        "| top kernels | ms | calls | share of busy |",
        "|---|---:|---:|---:|",
        *(f"| {k['name'][:90].replace('|', '/')} | {k['ms']:.2f} | {k['calls']} | {k['share']:.1%} |" for k in summary["top"]),
        "",
        "| all of them by kind | ms | share |",
        "|---|---:|---:|",
        *(f"| {k['kind']} | {k['ms']:.2f} | {k['share']:.1%} |" for k in summary.get("kinds", [])),
    ]
    return lines
