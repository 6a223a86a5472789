"""What each phase of a run cost (toolkit.training.phases): its own seconds, an inner phase pausing the outer one, the
end summary's line in PHASES' order with the phases that did not run left out, and each pass's bar, drawn as the
training bar is."""

from __future__ import annotations

import io
import sys

import pytest

from toolkit.training.phases import PHASES, Phases, clock


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(("seconds", "said"), [(0, "0:00"), (0.4, "0:00"), (59.4, "0:59"), (59.6, "1:00"),
                                                (754, "12:34"), (3599.5, "1:00:00"), (3725, "1:02:05")])
def test_a_phase_s_cost_is_said_in_minutes_and_seconds(seconds, said):
    assert clock(seconds) == said


def test_an_inner_phase_pauses_the_outer_one_and_the_line_keeps_the_table_s_order():
    now = Clock()
    phases = Phases(main=False, now=now)
    now.t += 2  # the launch: no phase
    with phases("reference pass", total=3):  # (a run goes through it after data; said after it below)
        now.t += 100
    with phases("data"):
        now.t += 12
    with phases("training", total=4):
        now.t += 60
        with phases("evaluations during training", total=2):
            now.t += 30
        now.t += 60
        with phases("evaluations during training", total=2):  # summed
            now.t += 15
        with phases("checkpoints"):
            now.t += 4.4
        now.t += 30
    assert phases.seconds == {"reference pass": 100, "data": 12, "training": 150, "evaluations during training": 45,
                              "checkpoints": pytest.approx(4.4)}
    now.t += 1  # the summary
    assert phases.said() == ("time        : 5:14 (data 0:12, reference pass 1:40, training 2:30, "
                             "evaluations during training 0:45, checkpoints 0:04, other 0:03)")
    assert phases.row() == {"seconds": {"data": 12.0, "reference pass": 100.0, "training": 150.0,
                                        "evaluations during training": 45.0, "checkpoints": 4.4},
                            "total_seconds": 314.4}


def test_a_phase_that_raises_is_timed_and_its_bar_closed(capfd):
    now = Clock()
    phases = Phases(main=True, now=now)
    with pytest.raises(RuntimeError, match="out of memory"), phases("evaluation before", total=5) as bar:
        bar.update()
        now.t += 70
        raise RuntimeError("out of memory")
    assert bar.disable and phases.seconds == {"evaluation before": 70} and not phases.open
    with phases("final save"):  # nothing open is charged twice
        now.t += 1
    assert phases.seconds == {"evaluation before": 70, "final save": 1}
    assert phases.said() == "time        : 1:11 (evaluation before 1:10, final save 0:01)"  # less than 0.5 s: no other


def test_a_phase_outside_the_table_or_a_pass_without_its_total_is_refused():
    phases = Phases(main=False)
    with pytest.raises(ValueError, match=r"^'warmup' is not a phase; add it to toolkit.training.phases.PHASES$"):
        with phases("warmup"):
            pass
    with pytest.raises(ValueError, match=r"^'reference pass' is a pass: give its total"):
        with phases("reference pass"):
            pass
    with pytest.raises(ValueError, match=r"^'base load' is no pass: give no total"):
        with phases("base load", total=3):
            pass
    assert not phases.seconds and not phases.open


@pytest.mark.parametrize("phase", [p for p, shown in PHASES.items() if shown])
def test_each_pass_draws_its_bar_with_an_eta_on_the_main_process_only(phase, capfd):
    """To stderr also into a file (the training bar's policy), labelled with the phase, on the line the training bar
    is on (no cursor movement a log would keep); in a file its line ends with its last count, so that the log line
    printed next starts a line of its own (was: glued after the cleared bar's "\r", where grep '^[finetune]' missed
    it)."""
    for main in (True, False):
        with Phases(main=main)(phase, total=4, mininterval=0) as bar:
            bar.update(2)
        print("[finetune] step 0 (before): held-out loss 3.2865", file=sys.stderr)
        err = capfd.readouterr().err
        if not main:
            assert err == "[finetune] step 0 (before): held-out loss 3.2865\n"
            continue
        assert f"{phase}:   0%|" in err and f"{phase}:  50%|" in err and "| 2/4 [" in err and "<" in err  # the ETA
        assert "\x1b[" not in err  # no escape code
        *bar_lines, said, end = err.split("\n")
        assert said == "[finetune] step 0 (before): held-out loss 3.2865" and end == ""
        assert len(bar_lines) == 1 and "| 2/4 [" in bar_lines[0].rsplit("\r", 1)[-1]  # its last count, line ended


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("phase", [p for p, shown in PHASES.items() if shown and p != "training"])
def test_in_a_terminal_a_pass_s_bar_is_gone_at_its_end(phase, monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    with Phases(main=True)(phase, total=4, mininterval=0) as bar:
        bar.update(2)
    err = sys.stderr.getvalue()
    assert "| 2/4 [" in err and "\x1b[" not in err and "\n" not in err  # no escape code, no line left behind
    assert err.endswith("\r") and not err.rsplit("\r", 2)[-2].strip()  # its line cleared


def test_the_training_bar_is_left_behind_where_it_asks_to_be(capfd):
    with Phases(main=True)("training", total=3, initial=1, leave=True, mininterval=0) as bar:
        bar.update()
    err = capfd.readouterr().err
    assert "training:  33%|" in err and err.endswith("\n") and "| 2/3 [" in err.rsplit("\r", 1)[-1]
