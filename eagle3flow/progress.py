"""Progress lines with rate and ETA for long stages.

Printed to stderr (the rule's log) at most every ``interval`` seconds, e.g.::

    extract[train]: 12,288/40,960 tokens (30.0%) 3,412 tokens/s ETA 0:00:08
"""
from __future__ import annotations

import sys
import time
from datetime import timedelta


def format_eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    return str(timedelta(seconds=int(max(0.0, seconds))))


class Progress:
    """Counts work done against a known total; ``done`` may start above 0 on resume.

    The rate excludes work that was already done when the object was made, so a
    resumed run reports its own speed and an honest ETA.
    """

    def __init__(self, desc: str, total: float, unit: str = "items", done: float = 0,
                 interval: float = 5.0, stream=None):
        self.desc, self.total, self.unit = desc, float(total), unit
        self.done = float(done)
        self._start_done = float(done)
        self._t0 = time.monotonic()
        self._last_print = 0.0
        self.interval = interval
        self.stream = stream or sys.stderr
        self.extra = ""

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self._t0
        return (self.done - self._start_done) / elapsed if elapsed > 0 else 0.0

    @property
    def eta_seconds(self) -> float:
        rate = self.rate
        return (self.total - self.done) / rate if rate > 0 else float("inf")

    def line(self) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = (f"{self.desc}: {self.done:,.0f}/{self.total:,.0f} {self.unit} ({pct:.1f}%) "
                f"{self.rate:,.0f} {self.unit}/s ETA {format_eta(self.eta_seconds)}")
        return f"{text} {self.extra}".rstrip()

    def update(self, n: float = 1, extra: str | None = None, force: bool = False) -> None:
        self.done += n
        if extra is not None:
            self.extra = extra
        now = time.monotonic()
        if force or now - self._last_print >= self.interval or self.done >= self.total:
            self._last_print = now
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        elapsed = time.monotonic() - self._t0
        print(f"{self.desc}: done {self.done:,.0f} {self.unit} in {format_eta(elapsed)}",
              file=self.stream, flush=True)
