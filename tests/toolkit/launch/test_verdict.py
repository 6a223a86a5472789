"""One error line per launch (toolkit.launch.verdict): through a real TCPStore where torchrun's agent holds one,
this test process playing each rank in turn."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def launch_store(monkeypatch):
    """A store where torchrun's agent would hold one, and the variables with which ranks find it."""
    from datetime import timedelta

    from toolkit.launch import verdict

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=10))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setattr(verdict, "ERROR_GRACE_S", 1.0)
    verdict._launch_store.cache_clear()
    yield store
    verdict._launch_store.cache_clear()


def as_rank(monkeypatch, rank: int) -> None:
    """This test process plays another rank: its own connection to the store, as a rank process has."""
    from toolkit.launch import verdict

    monkeypatch.setenv("RANK", str(rank))
    verdict._launch_store.cache_clear()


def test_a_user_error_is_one_line_however_many_ranks_meet_it(launch_store, monkeypatch, capsys):
    import time

    from toolkit.launch.verdict import report_once, reported_verdict

    as_rank(monkeypatch, 0)
    report_once("error: data.path=x holds no text", 2)
    as_rank(monkeypatch, 1)
    start = time.monotonic()
    report_once("error: data.path=x holds no text", 2)
    assert time.monotonic() - start < 0.5  # rank 0's report is there: no waiting out the grace
    assert capsys.readouterr().err == "error: data.path=x holds no text\n"  # rank 0's line only
    # rank 1, its barrier broken by rank 0's exit, takes rank 0's code and says nothing
    assert reported_verdict() == 2
    as_rank(monkeypatch, 0)
    assert reported_verdict() is None  # its own report is not a peer's


def test_an_error_of_one_other_rank_is_reported_with_its_rank(launch_store, monkeypatch, capsys):
    from toolkit.launch.verdict import report_once, reported_verdict

    as_rank(monkeypatch, 1)
    report_once("error: data.path=/local/x does not exist", 2)  # rank 0 reported nothing within the grace
    assert capsys.readouterr().err == "[rank 1] error: data.path=/local/x does not exist\n"
    as_rank(monkeypatch, 0)
    assert reported_verdict() == 2
    report_once("error: something rank 0 met later", 2)
    assert capsys.readouterr().err == ""  # the launch already has its line


def test_without_torchruns_store_every_rank_reports(monkeypatch, capsys):
    from toolkit.launch import verdict

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(verdict, "ERROR_GRACE_S", 0.1)
    verdict._launch_store.cache_clear()
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        verdict.report_once("error: bad", 2)
        assert verdict.reported_verdict() is None
    assert capsys.readouterr().err == "error: bad\n[rank 1] error: bad\n"
    verdict._launch_store.cache_clear()
