"""A call made as a user without root's pass through permission bits, for the tests of what a
user who may not read or write a folder is told.

As root, permission bits do not apply, so the call runs in a forked child that has become
`nobody` (uid 65534); as anyone else, in this process."""

from __future__ import annotations

import os
from collections.abc import Callable


def error_as_nobody(call: Callable[[], object]) -> str:
    """`call()`'s exception as "Type: message" ("no error" if it returns)."""
    if os.geteuid() != 0:
        return _outcome(call)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports through the pipe and never returns into pytest
        try:
            os.setgid(65534)
            os.setuid(65534)
            message = _outcome(call)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            message = f"{type(exc).__name__}: {exc}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as answer:
        return answer.read()


def _outcome(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the message is what the tests compare
        return f"{type(exc).__name__}: {exc}"
    return "no error"
