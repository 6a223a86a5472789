"""A fine-tune's forgetting budget: how much a general held-out loss may rise over the base's, held at each evaluation.

Replay moves the general source's share of each batch (next_share), selection keeps the checkpoint with the best
domain loss within the budget for final/, patience ends a run whose domain loss has not improved within the budget.
Every decision reads evaluation numbers already reduced over the ranks, so every rank takes it alike; its inputs live
in the checkpoint (TrainerState.budget), so a resume under any strategy takes the same ones (docs/finetuning.md).
"""

from __future__ import annotations

import glob
import math
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.declarations import ALWAYS, FROM_NEXT_STEP, TOKENS, CheckedBy, free, refused
from toolkit.config.errors import UserError
from toolkit.config.load import field
from toolkit.config.values import path_problems
from toolkit.data.corpus import local_only
from toolkit.run.paths import READ

# The share moves to hold the general loss at half its budget: the evaluations between two decisions have room to
# rise before they cross it. GAIN is how far one evaluation moves it (a rise of the whole budget: +0.25).
AIM, GAIN, MAX_SHARE = 0.5, 0.5, 0.9
GENERAL = "general"  # the metric name of a general set read from a path: eval_loss/general


def _budgeted(cfg) -> str | None:
    return None if cfg.forgetting.budget is not None else "forgetting.budget is unset: nothing is held to it"


def _replayed(cfg) -> str | None:
    if cfg.forgetting.budget is None:
        return "forgetting.budget is unset: nothing is held to it"
    if cfg.forgetting.general not in [s.name for s in cfg.data.sources]:
        return "forgetting.general is not one of data.sources: there is no general data to replay"
    return None


def _scored(cfg) -> str | None:
    return None if cfg.eval.harness_tasks else "eval.harness_tasks is empty: nothing is scored"


@dataclass
class ForgettingConfig:
    general: str | None = field(
        None, help="the general held-out set whose loss must not rise past the budget: a data.sources name, or a "
        "file, folder, glob or hub id of text (all of it held out); its loss is reported at every evaluation",
        resume=refused("the budget is measured against the base's loss on it"), used_when=ALWAYS, path=READ,
        accepts={"unset": "no general set: nothing reported or held"})
    budget: float | None = field(
        None, help="how much the general held-out loss may rise over the base's, relative (0.05 = 5 %); held at "
        "every eval.every by replay, selection and patience", resume=FROM_NEXT_STEP,
        used_when=CheckedBy("forgetting_problems"), accepts={"unset": "reported, not held: the default"})
    harness_points: float | None = field(
        None, help="points (of 100) each eval.harness_tasks score may lose from the base's; judged on the result "
        "in the end table", resume=free("judged at the end, on the scores"), used_when=_scored,
        accepts={"unset": "no harness budget"})
    replay: bool = field(
        True, help="raise the general source's share of each batch when its loss nears the budget, lower it when "
        "there is room (forgetting.general names a data.sources entry)", resume=refused(TOKENS), used_when=_replayed)
    select: bool = field(
        True, help="final/ (and adapter/, and exports) is the checkpoint with the best domain held-out loss within "
        "the budget, not the last step's", resume=FROM_NEXT_STEP, used_when=_budgeted)
    patience: int = field(
        3, help="end the run once this many evaluations in a row bring no better domain loss within the budget "
        "(0 = never)", resume=FROM_NEXT_STEP, used_when=_budgeted,
        accepts={"0": "never ends early", "2**31": "never ends early"})

    def validate(self) -> list[str]:
        problems = path_problems(self, ("general",))
        problems += [f"{name}={getattr(self, name)} must be >= 0" for name in ("budget", "harness_points", "patience")
                     if getattr(self, name) is not None and getattr(self, name) < 0]
        if self.budget is not None and self.general is None:
            problems.append(f"budget={self.budget} bounds the loss of a general held-out set, and there is none: set "
                            "forgetting.general to a data.sources name or a file, folder or hub id of general text, or "
                            "drop forgetting.budget")
        return problems


def forgetting_problems(cfg) -> list[str]:
    """What the rest of a fine-tune's config leaves a budget unable to do, one line each (before the base loads)."""
    f, data = cfg.forgetting, cfg.data
    if path_problems(f, ("general",)):  # blank, a line break, too long for the file system: its own line says so
        return []
    if f.general is None:
        return [f"forgetting.harness_points={f.harness_points} needs forgetting.general and forgetting.budget"
                ] if f.harness_points is not None and f.budget is None else []
    names = [s.name for s in data.sources if s is not None]
    problems = []
    if data.format == "preference":
        problems.append("forgetting.general measures a token loss; train.objective's preference loss is not one: drop "
                        "forgetting.*, or fine-tune on text or chat data")
    if f.general in names:
        if len(names) == 1:
            problems.append(f"forgetting.general={f.general} is the only data source: nothing is left to be the domain; "
                            "add the domain's data to data.sources")
        if f.budget is not None and f.replay and data.stages:
            problems.append("forgetting.replay moves the general source's weight, and data.stages sets the weights too: "
                            "drop data.stages, or set forgetting.replay=false to keep your stages")
        if data.val_fraction == 0:
            problems.append(f"forgetting.general={f.general} is measured on its held-out part, and data.val_fraction=0 "
                            "holds none out; set data.val_fraction above 0 (e.g. 0.05)")
        if sum(max(0.0, s.weight) for s in data.sources if s is not None and s.name != f.general) == 0:
            problems.append(f"forgetting.general={f.general} is the only data source with weight: nothing is left to be "
                            "the domain; give the domain's sources a weight above 0")
    else:
        if GENERAL in names:
            problems.append(f"forgetting.general={f.general} is read as text and reported as {GENERAL}, the name of a "
                            f"data source; name the source something else, or set forgetting.general={GENERAL}")
        if names and "/" not in f.general and not Path(f.general).exists():
            problems.append(f"forgetting.general={f.general} is neither a data.sources name ({', '.join(names)}) nor a "
                            "file; name a source, or give the path of general text")
        elif (local_only(f.general) or glob.has_magic(f.general)) and not _files(f.general):
            problems.append(f"forgetting.general={f.general} does not exist"
                            + (" (no file matches the pattern)" if glob.has_magic(f.general) else "")
                            + "; give a file, folder or glob of general text, or a data.sources name")
        trained = [data.path] if not data.sources else [s.path for s in data.sources]
        if any(_same_data(f.general, p) for p in trained if p):
            problems.append(f"forgetting.general={f.general} is training data too: its loss would fall with the domain's; "
                            "give general text the run does not train on")
    if f.budget is not None:
        if cfg.eval.every == 0:
            problems.append(f"forgetting.budget={f.budget} is held at each evaluation, and eval.every=0 evaluates only "
                            "at the end; set eval.every (e.g. a sixth of train.max_steps)")
        if data.val_fraction == 0 and not getattr(data, "val_path", None):
            problems.append(f"forgetting.budget={f.budget} keeps the step with the best domain held-out loss, and "
                            "data.val_fraction=0 holds none out; set data.val_fraction above 0 (e.g. 0.05)")
    if f.harness_points is not None and f.budget is None:
        problems.append(f"forgetting.harness_points={f.harness_points} is part of the budget: set forgetting.budget "
                        "too (the held-out loss's)")
    return problems


def _files(path: str) -> list[Path]:
    """What a data path names on this machine: the file or folder, or what a glob matches, resolved."""
    named = glob.glob(path) if glob.has_magic(path) else [path] if Path(path).exists() else []
    return [Path(p).resolve() for p in named]


def _same_data(a: str, b: str) -> bool:
    """Whether two data paths (files, folders, globs) share a file, one holding the other, or name the same hub id."""
    if a == b:
        return True
    return any(x == y or x in y.parents or y in x.parents for x in _files(a) for y in _files(b))


def _percent(budget: float) -> str:
    return f"{100 * budget:+.4g}%"


def next_share(share: float, change: float, budget: float) -> float:
    """The general source's share after an evaluation whose general loss changed by `change` (relative to the base's)
    under `budget`: up when the change nears the budget, down when there is room, in hundredths."""
    ratio = change / budget if budget > 0 else (math.inf if change > 0 else 0.0)
    moved = share + max(-GAIN / 2, min(GAIN, GAIN * (ratio - AIM)))
    return round(min(MAX_SHARE, max(0.0, moved)), 2)


def weights_at(weights: list[float], general: int, share: float) -> list[float]:
    """The sources' weights (normalised) with source `general` at `share`, the others keeping their proportions."""
    rest = sum(w for i, w in enumerate(weights) if i != general)
    if rest == 0:  # only the general source had weight: the others share the rest equally
        return [share if i == general else (1 - share) / (len(weights) - 1) for i in range(len(weights))]
    return [share if i == general else w / rest * (1 - share) for i, w in enumerate(weights)]


@dataclass
class Judged:
    """One evaluation judged: its budget row (metrics.jsonl kind "budget"), its log line, and what it decides."""

    row: dict
    line: str
    keep: bool = False  # a new best within the budget: its checkpoint is saved, and kept through rotation
    end: bool = False  # patience ran out: the run ends after this step's checkpoint
    plan: list | None = None  # the mixture's new weight plan (replay moved the share)


class Budget:
    """The budget at work over a run. `sources` are a mixture's names ([] for one corpus); `plan` its configured
    weight plan (toolkit.data.mixture.weight_plan)."""

    def __init__(self, cfg: ForgettingConfig, sources: list[str], plan: list | None):
        self.cfg, self.sources = cfg, sources
        self.name = cfg.general if cfg.general in sources else GENERAL
        self.index = sources.index(cfg.general) if cfg.general in sources else None
        self.replays = cfg.budget is not None and cfg.replay and self.index is not None
        self.base_plan = plan
        share = plan[0][1][self.index] if self.replays else None
        self.state = {"general_base": None, "domain_base": None, "share": share, "decisions": [], "best_step": None,
                      "best_eval": {}, "since_best": 0, "ended": None, "last": {},
                      "gone": False}

    @classmethod
    def of(cls, cfg, sources: list[str], plan: list | None) -> Budget | None:
        return cls(cfg.forgetting, sources, plan) if getattr(cfg, "forgetting", None) and cfg.forgetting.general else None

    @property
    def held(self) -> bool:
        return self.cfg.budget is not None

    @property
    def limit(self) -> float | None:
        base = self.state["general_base"]
        return None if base is None or not self.held else base * (1 + self.cfg.budget)

    def said(self) -> str:
        """The budget in one line, for the log."""
        cfg = self.cfg
        where = (f"data source {self.name}'s held-out part" if self.index is not None else
                 f"{cfg.general} ({', '.join(map(str, _files(cfg.general)[:3])) or 'a hub dataset'})")
        if not self.held:
            return f"general held-out set: {where}; its loss is reported at each evaluation (no forgetting.budget)"
        levers = ["replay of its share of each batch"] if self.replays else []
        levers += ["selection of the best step within it"] if cfg.select else []
        levers += [f"patience {cfg.patience}"] if cfg.patience else []
        return (f"general held-out set: {where}; its loss may rise {cfg.budget:.1%} over the base's, held at each "
                f"evaluation by {', '.join(levers) or 'nothing (replay, select and patience are off): reported'}")

    def plan(self) -> list | None:
        """The mixture's weight plan with replay's decisions: [(first batch, weights)]."""
        if self.index is None or not self.state["decisions"]:  # (made, they stay: the data order a resume continues)
            return None
        weights = self.base_plan[0][1]
        return [(0, weights), *((first, weights_at(weights, self.index, share))
                                for first, share in self.state["decisions"])]

    def restore(self, saved: dict, schedule) -> dict:
        """The state to go on from (TrainerState.budget), a resumed run's `saved` one; its replay's decisions set on the
        mixture's `schedule` (toolkit.data.mixture.MixtureSchedule), so that its steps draw the blocks they drew."""
        if not saved:  # a checkpoint of a run without forgetting.general: the base's loss was never measured
            raise UserError("this run's checkpoint was trained without forgetting.general, so the base's general loss "
                            "was not measured before it; start a new output_dir with forgetting.general (model.path= "
                            "the checkpoint's weights to go on from them), or resume without forgetting.*")
        share = self.state["share"]
        self.state = {**self.state, **saved}
        if self.state["share"] is None:  # a budget set on a resume: replay starts from the configured share
            self.state["share"] = share
        if (plan := self.plan()) is not None:
            schedule.reweigh(plan)
        return self.state

    def losses(self, result: dict, general: float | None) -> tuple[float, float]:
        """(domain, general) held-out losses of an evaluation: a general source's left out of the domain's."""
        if self.index is None:
            return result["eval_loss"], general
        domain = [(result[f"eval_loss/{n}"], result[f"eval_tokens/{n}"]) for n in self.sources
                  if n != self.name and f"eval_loss/{n}" in result]
        tokens = sum(t for _, t in domain)
        return sum(loss * t for loss, t in domain) / max(1, tokens), result[f"eval_loss/{self.name}"]

    def judge(self, step: int, phase: str, result: dict, general: float | None = None, tokens: int = 0) -> Judged:
        """Evaluation `phase` at `step` (before: the base's), with `general` the loss of a general set read from a path
        (None: a source's, in `result`), after `tokens` trained."""
        s, cfg = self.state, self.cfg
        domain, general = self.losses(result, general)
        if phase == "before":
            s["general_base"], s["domain_base"] = general, domain
        else:
            s["last"] = {"domain_loss": domain, "general_loss": general}
        base = s["general_base"]
        change = general / base - 1 if base else 0.0
        within = self.limit is None or general <= self.limit
        judged = Judged(row={}, line="")
        words = [f"general {general:.4f} ({change:+.2%} of the base's"
                 + (f", budget {_percent(cfg.budget)})" if self.held else ")"), f"domain {domain:.4f}"]
        if phase != "before" and self.held:
            if within and (s["best_step"] is None or domain < s["best_eval"]["domain_loss"]):
                s["best_step"], s["since_best"] = step, 0
                s["best_eval"] = {**result, "domain_loss": domain, "general_loss": general, "tokens": tokens}
                judged.keep = cfg.select
                words.append("the best within the budget" + (": kept" if cfg.select else ""))
            else:
                s["since_best"] += 1
                words.append("over the budget" if not within else f"no better than step {s['best_step']}")
            if cfg.patience and s["since_best"] >= cfg.patience and phase == "train":
                s["ended"] = step
                judged.end = True
            if self.replays and phase == "train":
                share = next_share(s["share"], change, cfg.budget)
                if share != s["share"]:
                    words.append(f"general share {s['share']:.2f} -> {share:.2f}")
                    s["share"] = share
                    s["decisions"].append([step, share])
                    judged.plan = self.plan()
        judged.row = {"step": step, "phase": phase, "general": self.name, "domain_loss": domain, "general_loss": general,
                      "general_base": base, "general_limit": self.limit, "general_change": change, "within": within,
                      "share": s["share"], "best_step": s["best_step"]}
        judged.line = "; ".join(words)
        return judged

    def result(self, step: int, tokens: int) -> tuple[int, int]:
        """(step, tokens trained) of the weights a run of `step` steps and `tokens` delivers: the kept step's."""
        if self.selected(step) is None or self.state["gone"]:
            return step, tokens
        return self.state["best_step"], self.state["best_eval"].get("tokens", tokens)

    def selected(self, step: int) -> int | None:
        """The step whose checkpoint final/ is made from, where it is not the last one (`step`)."""
        best = self.state["best_step"]
        return best if self.held and self.cfg.select and best is not None and best != step else None

    def rows(self, before: dict, after: dict, step: int) -> list[tuple[str, str, str]]:
        """The end table's rows (name, before, after): what the domain gained and what general text lost, against the
        budget; each eval.harness_tasks score against forgetting.harness_points; the step kept (`step`: the last).
        `before` and `after` hold the harness/* scores of the base and of the result."""
        s, cfg = self.state, self.cfg
        if s["general_base"] is None or not s["last"]:
            return []
        result = s["best_eval"] if self.selected(step) is not None else s["last"]
        domain, general = result["domain_loss"], result["general_loss"]
        change = general / s["general_base"] - 1
        rows = [("forgetting", "before", "after"), ("-" * 14, "-" * 10, "-" * 10),
                ("domain loss", f"{s['domain_base']:.4f}", f"{domain:.4f}"),
                ("domain gain", "", f"{1 - domain / s['domain_base']:+.1%}"),
                (f"general loss: {self.name}", f"{s['general_base']:.4f}", f"{general:.4f}"),
                ("general change" + (f" (budget {_percent(cfg.budget)})" if self.held else ""), "",
                 f"{change:+.2%}" + (" over" if self.held and change > cfg.budget else ""))]
        if cfg.harness_points is not None:
            for key in before:
                if key.startswith("harness/") and key in after:
                    lost = (before[key] - after[key]) * 100
                    rows.append((f"general change: {key.removeprefix('harness/')} (budget -{cfg.harness_points:g} "
                                 "points)", "", f"{-lost:+.1f} points" + (" over" if lost > cfg.harness_points else "")))
        if self.held:
            best = s["best_step"]
            rows.append(("kept", "", f"step {step} (none within)" if best is None else f"step {step}" if s["gone"]
                         or not cfg.select else f"step {best} of {step}"))
        return rows

    def warnings(self, step: int) -> list[str]:
        """What the end says of a result that is not what a budget is for: nothing within it, or no domain gain."""
        s, cfg = self.state, self.cfg
        if not self.held or not s["last"]:
            return []
        if s["best_step"] is None:
            return [f"warning: no evaluation was within forgetting.budget={cfg.budget} (the general loss rose "
                    f"{s['last']['general_loss'] / s['general_base'] - 1:+.2%} by step {step}): the result is the last "
                    "step's; lower optim.lr, raise the general data's weight, or loosen the budget"]
        kept = s["best_eval"] if self.selected(step) is not None else s["last"]
        if kept["domain_loss"] >= s["domain_base"]:
            return [f"warning: the result (step {s['best_step'] if self.selected(step) is not None else step}) has "
                    f"gained nothing on the domain ({kept['domain_loss']:.4f} against the base's {s['domain_base']:.4f})"
                    " within the budget"]
        return []

    def ended_said(self) -> str | None:
        """A resumed run that patience ended: why it trains no more, and what would train on; None otherwise. One whose
        forgetting.patience has been raised (or set to 0) since is no longer ended."""
        s, patience = self.state, self.cfg.patience
        if s["ended"] is None:
            return None
        if not patience or s["since_best"] < patience:
            s["ended"] = None
            return None
        return (f"the run ended at step {s['ended']}: forgetting.patience={patience} evaluations brought no better domain "
                f"loss within the budget; raise forgetting.patience (or set it to 0) to train on")
