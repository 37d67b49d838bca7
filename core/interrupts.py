"""SIGINT and SIGTERM as an exception at the next safe point, so that every command stops the same way: the
`finally` blocks on the way out remove staging folders and locks, the command prints one line and exits
130 (SIGINT) or 143 (SIGTERM). The first signal decides: those after it are only noted, so that nothing cuts the
cleanup short or says it twice."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import signal
import sys
import threading
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the signals that came inside stop_on_signals(), first first
_holding = 0  # depth of held() blocks
_raised = False  # whether Interrupted was raised for the first signal


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
    """The first signal that arrived inside stop_on_signals(), if any: for native calls (an engine build) that take
    the exception raised in their Python callbacks as a plain failure."""
    return _received[0] if _received else None


def _interrupt() -> None:
    global _raised
    _raised = True
    raise Interrupted(_received[0])


def _on_signal(signum, _frame) -> None:
    _received.append(signum)
    if len(_received) == 1 and not _holding:
        _interrupt()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within: the first SIGINT or SIGTERM raises Interrupted in the main thread (elsewhere signals cannot be handled).
    Once one came, the process ends on it: the handlers are not put back, and later signals are ignored."""
    global _raised
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _on_signal) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            # SIG_IGN, unlike a Python handler, outlives Python's own exit (which puts the default handlers back).
            signal.signal(signum, signal.SIG_IGN if _received else old)
        _received.clear()
        _raised = False


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Within stop_on_signals(): a signal that comes inside the block waits for it to end, and is then raised, so
    that what the block does is done whole (a set of files linked, or removed again, and its staging folder gone)."""
    global _holding
    _holding += 1
    try:
        yield
    finally:
        _holding -= 1
    if _received and not _raised and not _holding:
        _interrupt()


def run_main(prog: str, module: str) -> int:
    """Import `module` (command `prog`'s) and run its main(). The import alone takes seconds on a busy machine, so
    SIGINT and SIGTERM are answered first, with the command's one line and 128 + the signal's number; once main()
    runs, the command's own handling (stop_on_signals) takes over; after it, the same answer holds to the process's
    last moment (end_here)."""

    def interrupted(signum, _frame):
        # Nothing is written before the command runs, nor after it, so there is nothing to clean up: exit at once.
        os.write(2, f"{prog}: interrupted\n".encode())
        os._exit(128 + signum)

    status = 1  # where main() raises, Python prints the traceback and exits 1

    def end_here() -> None:
        # Registered first, so run last: after the command's threads and every other exit function. Python's own
        # exit would go on to tear the interpreter down with the default handlers back, where a signal kills the
        # process without its line; there is nothing left to do that needs it.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe
                stream.flush()
        os._exit(status)

    atexit.register(end_here)
    for signum in SIGNALS:
        signal.signal(signum, interrupted)
    try:
        status = importlib.import_module(module).main()
    except SystemExit as exc:  # argparse's --help and its usage errors
        status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        raise
    return status
