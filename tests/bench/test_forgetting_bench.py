"""bench/forgetting.py's parts that decide its figures: the general English text it builds from the fortune files, a
run's base and result read from its budget rows, and the table's two verdicts (the runs themselves:
`python bench/forgetting.py --smoke`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import forgetting as bench  # noqa: E402


def test_the_general_text_is_the_fortune_files_prose(tmp_path, monkeypatch):
    fortunes = tmp_path / "fortunes"
    fortunes.mkdir()
    (fortunes / "wisdom").write_text("A proverb of some length, said plainly.\n%\n  |__|  \n  |  |  \n%\nshort\n%\n"
                                     "Two lines of\nplain English prose.\n%\n")
    (fortunes / "wisdom.dat").write_bytes(b"\x00\x01")  # the index fortune(6) reads
    (fortunes / "computers").write_text("Real programmers write Fortran in any language.\n")  # jargon: left out
    monkeypatch.setattr(bench, "FORTUNES", fortunes)
    text = bench.english_text(tmp_path).read_text()
    assert text == "A proverb of some length, said plainly.\n\nTwo lines of\nplain English prose.\n"


def rows(general: list[float], domain: list[float], best: int | None) -> list[dict]:
    return [{"step": 5 * i, "domain_loss": d, "general_loss": g, "general_base": general[0], "best_step": best}
            for i, (g, d) in enumerate(zip(general, domain, strict=True))]


def test_a_run_is_read_at_its_kept_step_and_judged_against_the_unconstrained_one():
    free = bench.result(rows([4.0, 4.3, 4.4], [3.0, 2.8, 2.6], None))  # no budget: the last evaluation
    held = bench.result(rows([4.0, 4.18, 4.3], [3.0, 2.65, 2.7], 5))  # the kept step 5, not the last
    assert (free["step"], free["gain"], free["change"]) == (10, pytest.approx(0.4), pytest.approx(0.1))
    assert (held["step"], held["gain"], held["change"]) == (5, pytest.approx(0.35), pytest.approx(0.045))
    said = bench.table({**free, "seconds": 60}, {**held, "seconds": 90}, 0.05)
    assert "| budget 5% | 5 of 10 | 3.0000 → 2.6500 | 0.3500 | 4.0000 → 4.1800 | +4.50% | 1.5 min |" in said
    assert "general loss within the budget: yes (+4.50% against +5%; unconstrained +10.00%)" in said
    assert "domain gain kept: 88% of the unconstrained run's (yes, at least 80 %)" in said
    short = bench.table({**free, "seconds": 60}, {**bench.result(rows([4.0, 4.3, 4.3], [3.0, 2.9, 2.9], 5)),
                                                  "seconds": 60}, 0.05)
    assert "within the budget: no" in short and "kept: 25% of the unconstrained run's (no" in short
