"""Whether the Hugging Face Hub can be reached: asked once a process, answered in ~2 s at most.

Offline, the hub client retries each file for ~45 s (datasets for ~30 s), printing each retry, before it says so; a
hub id is then read from the local cache alone, or refused in one line, at once.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import urllib.parse
import urllib.request

import huggingface_hub


@functools.cache
def hub_unreachable(timeout_s: float = 2.0) -> str | None:
    """Why the Hub (HF_ENDPOINT) cannot be reached, or None: one connection tried, through the proxy the environment
    names where it names one; with HF_HUB_OFFLINE=1 none is tried."""
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE=1"
    url = urllib.parse.urlsplit(huggingface_hub.constants.ENDPOINT)
    host, port = url.hostname or "", url.port or (80 if url.scheme == "http" else 443)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        through = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = through.hostname or "", through.port or 80
    return _connect(host, port, timeout_s)


def datasets_offline() -> str | None:
    """The variable that keeps datasets off the Hub (HF_DATASETS_OFFLINE, which datasets reads before
    HF_HUB_OFFLINE), or None."""
    import datasets.config

    if not datasets.config.HF_HUB_OFFLINE:
        return None
    return "HF_DATASETS_OFFLINE=1" if os.environ.get("HF_DATASETS_OFFLINE") else "HF_HUB_OFFLINE=1"


def _connect(host: str, port: int, timeout_s: float) -> str | None:
    # in a thread: the connection's own timeout does not bound its name lookup, which a broken resolver holds for
    # 10 s and more
    said: list[str | None] = []

    def attempt():
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            said.append(None)
        except OSError as exc:
            said.append(f"{host}: {exc.strerror or exc}")

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return said[0] if said else f"{host}: no answer in {timeout_s:g} s"
