"""A deadline for a step that must end soon or not at all (fail fast, reuse, do not wait):
it interrupts the step where it hangs instead of timing it afterwards, so that a slow
host running a correct step does not fail, while one that waits on for minutes does."""
from __future__ import annotations

import signal
from contextlib import contextmanager


class DeadlinePassed(AssertionError):
    pass


@contextmanager
def deadline(seconds: float, what: str):
    """Run the block; past ``seconds`` raise DeadlinePassed naming ``what`` (main thread only)."""
    def expire(signum, frame):
        raise DeadlinePassed(f"{what}: still running after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
