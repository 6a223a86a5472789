"""toolkit.data.hub: whether the Hub can be reached, said in ~2 s at most, asked once a process."""

from __future__ import annotations

import socket
import threading
import time

import huggingface_hub
import pytest

from toolkit.data import hub


@pytest.fixture
def probe(monkeypatch):
    """hub_unreachable asked afresh, HF_HUB_OFFLINE unset, no proxy: the connections the probe tries, recorded."""
    tried = []
    real = socket.create_connection

    def recorded(address, *args, **kwargs):
        tried.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(socket, "create_connection", recorded)
    hub.hub_unreachable.cache_clear()
    yield tried
    hub.hub_unreachable.cache_clear()


def test_a_refused_endpoint_is_said_at_once_and_asked_once(probe, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # discard: nothing listens
    start = time.monotonic()
    said = hub.hub_unreachable()
    assert time.monotonic() - start < 1
    assert said == "127.0.0.1: Connection refused"
    assert hub.hub_unreachable() == said and probe == [("127.0.0.1", 9)]  # once a process


def test_an_http_endpoint_without_a_port_is_tried_on_80_and_https_on_443(probe, monkeypatch):
    monkeypatch.setattr(socket, "create_connection", lambda address, *a, **k: probe.append(address) or _refuse())
    for endpoint, port in (("http://hub.internal", 80), ("https://hub.internal", 443)):
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        hub.hub_unreachable.cache_clear()
        assert hub.hub_unreachable() == "hub.internal: Connection refused"
        assert probe[-1] == ("hub.internal", port)


def test_a_connection_that_hangs_is_given_up_after_its_timeout(probe, monkeypatch):
    """A resolver that never answers: the connection's own timeout does not bound the name lookup."""
    answered = threading.Event()

    def never_answers(*args, **kwargs):
        answered.wait(30)  # the test's end lets the probe's thread go, refused, rather than outlive it
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", never_answers)
    start = time.monotonic()
    try:
        assert hub.hub_unreachable(timeout_s=0.5) == "huggingface.co: no answer in 0.5 s"
        assert time.monotonic() - start < 2
    finally:
        answered.set()


def test_a_proxy_is_what_is_tried_and_offline_tries_nothing(probe, monkeypatch):
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://huggingface.co")
    assert hub.hub_unreachable() == "127.0.0.1: Connection refused" and probe == [("127.0.0.1", 9)]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub.hub_unreachable.cache_clear()
    assert hub.hub_unreachable() == "HF_HUB_OFFLINE=1" and len(probe) == 1


def _refuse():
    raise ConnectionRefusedError(111, "Connection refused")
