"""What each test costs, summed by area at the end of a run, against the budget in tests/README.md.

A test's cost is the CPU time it takes wherever it runs: the pytest worker's own, its child processes'
(a launcher and its ranks, a new Python; counted once waited for, grandchildren included), and that of
the ranks tests/support/probe_ranks.py's server forks for it (the server reports them). On two busy cores the
suite's wall time is about half of it, whatever the other worker was doing, so this is the number to
budget. A test's area is the costliest thing it does:

- "real model": it loads SmolLM2 (the `smollm2_gguf_path` fixture, or a run of a shipped SmolLM2 config);
- "launches": it starts processes as a user's command does (a launcher, a new Python of a recipe);
- "forked ranks": it runs recipes or probes on ranks forked from the rank server;
- "in-process": the rest.

Every run ends with that table, the 30 slowest tests (a test's setup, call and teardown together, with its
CPU time and area) and the total: the run's wall time, the tests' summed wall time and CPU minutes. A run of
the fast suite (`-m "not distributed"`) also says its wall time against its goal of 4 minutes.

The launches are also counted: one is the imports of every process it starts (~13 CPU-s for 2 ranks on a
fast core, ~20 on a slow one), and a new test that launches can share a launch that already runs or be
forked instead. A run that starts more launches than the budget fails, naming the tests that launched.
"""

from __future__ import annotations

import collections
import json
import os
import re
import resource
import subprocess
import time
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
COSTS_ENV = "LLM_TOOLKIT_TEST_COSTS"  # a file to write every test's cost to, as JSON
AREAS = ("real model", "launches", "forked ranks", "in-process")
SLOWEST = 30  # the slowest tests every run prints, CI's included (issue 40)
FAST_SUITE, FAST_GOAL_S = "not distributed", 240  # the fast suite's marks and its goal (issue 40), said at its end
# a subprocess that runs a recipe (recipes/*.py, recipes/launch.sh, llm-toolkit, or a test's wrapper of one in tests/recipes;
# recipes/install.sh runs none),
# through a launcher or as a new Python; the launches that only record a launcher's environment for the forked
# ranks (tests/support/probe_ranks.py) start no recipe and are not counted, though their CPU time is
# recipes/quickstart.sh runs only in test_install.py, with its install and launch logged, not run (a few CPU-s)
LAUNCH = re.compile(r"recipes/(?!install\.sh|quickstart\.sh)\w+\.(py|sh)$|(^|/)llm-toolkit$")  # or the installed command (toolkit/launch/cli.py)

# this process's running tallies; probe_ranks adds the forked ranks' CPU time, recipe_runner the real model
tally = {"launches": 0, "forked_cpu_s": 0.0, "forked_runs": 0, "real_model": 0}
_popen_init = subprocess.Popen.__init__


def _counting_init(self, args, *rest, **kwargs):
    words = [str(a) for a in args] if isinstance(args, list | tuple) else [str(args)]
    if any(LAUNCH.search(w) for w in words):
        tally["launches"] += 1
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _counting_init


def _snapshot() -> dict[str, float]:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": time.monotonic(), "cpu_s": me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime + tally["forked_cpu_s"],
            "launches": tally["launches"], "forked_runs": tally["forked_runs"], "real_model": tally["real_model"]}


def budget(readme: Path = README) -> tuple[dict[str, float], int]:
    """(CPU minutes per area, launches) from the README's "Budget" table."""
    rows = dict(re.findall(r"^\| (real model|launches|forked ranks|in-process|launches counted) \|[^|\n]*\| *([\d.]+) *\|",
                           readme.read_text(), re.M))
    if set(rows) != {*AREAS, "launches counted"}:
        raise ValueError(f"{readme}: the Budget table lacks rows for {sorted({*AREAS, 'launches counted'} - set(rows))}")
    return {a: float(rows[a]) for a in AREAS}, int(float(rows["launches counted"]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item._cost_snapshot = _snapshot()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    now = _snapshot()
    spent = {k: now[k] - item._cost_snapshot[k] for k in now}
    item._cost_snapshot = now
    if call.when == "setup" and "smollm2_gguf_path" in item.fixturenames:
        spent["real_model"] += 1
    report.user_properties.append(("cost", spent))


def _test(nodeid: str) -> str:
    """The node id without the "@group" pytest-xdist appends to a grouped test's."""
    return nodeid[:nodeid.rfind("@")] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def area(cost: dict[str, float]) -> str:
    if cost["real_model"]:
        return "real model"
    if cost["launches"]:
        return "launches"
    return "forked ranks" if cost["forked_runs"] else "in-process"


class Ledger:
    """The controller's (or a run without workers') sum of every test's reports."""

    def __init__(self, readme: Path = README):
        self.readme = readme
        self.started = time.monotonic()  # registered at pytest_configure, before the workers start and collect
        self.tests: dict[str, dict[str, float]] = collections.defaultdict(collections.Counter)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        if "gpu" in report.keywords:  # the budget is the CPU suite's; `-m gpu` runs on a lent GPU launch many more
            return
        for key, value in report.user_properties:
            if key == "cost":
                self.tests[_test(report.nodeid)].update(value)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        if not self.tests:
            return
        minutes, launch_budget = budget(self.readme)
        by_area = {a: [n for n, c in self.tests.items() if area(c) == a] for a in AREAS}
        write = terminalreporter.write_line
        terminalreporter.section(f"cost by area ({self.readme.name}, Budget)")
        write(f"{'area':<14}{'tests':>7}{'CPU min':>10}{'budget':>9}")
        for name, nodes in by_area.items():
            spent = sum(self.tests[n]["cpu_s"] for n in nodes) / 60
            over = "  over its budget" if spent > minutes[name] else ""
            write(f"{name:<14}{len(nodes):>7}{spent:>10.1f}{minutes[name]:>9.1f}{over}")
        total = sum(c["cpu_s"] for c in self.tests.values()) / 60
        write(f"{'all':<14}{len(self.tests):>7}{total:>10.1f}{sum(minutes.values()):>9.1f}"
              f"  (~{total / 2:.1f} min on 2 busy cores)")
        launches = self.launches()
        write(f"launches counted: {sum(launches.values())} (budget {launch_budget}) in {len(launches)} tests")
        slowest = sorted(self.tests.items(), key=lambda kv: -kv[1]["wall_s"])[:SLOWEST]
        write(f"the {len(slowest)} slowest tests (setup, call and teardown together):")
        write(f"{'wall s':>8}{'CPU s':>8}  {'area':<13} test")
        for node, spent in slowest:
            write(f"{spent['wall_s']:8.1f}{spent['cpu_s']:8.1f}  {area(spent):<13} {node}")
        wall = time.monotonic() - self.started
        write(f"total: {len(self.tests)} tests, {wall // 60:.0f}:{wall % 60:02.0f} wall (pytest's, from its start), "
              f"{sum(c['wall_s'] for c in self.tests.values()) / 60:.1f} min of tests' wall time, {total:.1f} CPU min")
        if config is not None and config.getoption("markexpr", "") == FAST_SUITE:
            over = f"  over its goal by {wall - FAST_GOAL_S:.0f} s" if wall > FAST_GOAL_S else ""
            write(f'the fast suite (-m "{FAST_SUITE}"): {wall // 60:.0f}:{wall % 60:02.0f} wall, '
                  f"goal {FAST_GOAL_S // 60}:00{over}", red=bool(over))
        if os.environ.get(COSTS_ENV):  # every test's cost, for a closer look than the table
            Path(os.environ[COSTS_ENV]).write_text(json.dumps({n: {**c, "area": area(c)} for n, c in self.tests.items()}))
        if sum(launches.values()) > launch_budget:
            write(f"error: {sum(launches.values())} launches, over the budget of {launch_budget} (tests/README.md, "
                  "Budget): share a launch, fork the ranks or retire one. Launched: "
                  + ", ".join(f"{n} ({k})" for n, k in sorted(launches.items())), red=True)

    def launches(self) -> dict[str, int]:
        return {n: int(c["launches"]) for n, c in self.tests.items() if c["launches"]}

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if self.tests and sum(self.launches().values()) > budget(self.readme)[1] and exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller, or a run without pytest-xdist
        config.pluginmanager.register(Ledger(), "cost-ledger")
