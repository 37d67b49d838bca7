"""SIGINT and SIGTERM as an exception at the next safe point, so that every command stops the same way: the
`finally` blocks on the way out remove staging folders and locks, the command prints one line and exits
130 (SIGINT) or 143 (SIGTERM)."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import threading
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []


class Interrupted(BaseException):
    """A signal asked the command to stop (a BaseException, like KeyboardInterrupt, so that no library's
    `except Exception` takes it for a failure of its own)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def received() -> int | None:
    """The signal that arrived inside stop_on_signals(), if any: for native calls (an engine build) that take the
    exception raised in their Python callbacks as a plain failure."""
    return _received[-1] if _received else None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise Interrupted in the main thread (elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        _received.append(signum)
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, handler) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        _received.clear()


def run_main(prog: str, module: str) -> int:
    """Import `module` (command `prog`'s) and run its main(). The import alone takes seconds on a busy machine, so
    SIGINT and SIGTERM are answered first, with the command's one line and 128 + the signal's number; once main()
    runs, the command's own handling (stop_on_signals) takes over."""

    def interrupted(signum, _frame):
        # Nothing is written before the command runs, so there is nothing to clean up: exit at once.
        os.write(2, f"{prog}: interrupted\n".encode())
        os._exit(128 + signum)

    for signum in SIGNALS:
        signal.signal(signum, interrupted)
    return importlib.import_module(module).main()
