"""Where the time of a run goes: one stopwatch, always running in exactly one row.

A :class:`Stopwatch` holds one accumulator per row of :data:`ROWS`.  At every moment between
:meth:`Stopwatch.start` and :meth:`Stopwatch.stop` exactly one row is current, and
:meth:`Stopwatch.switch` charges the time since the last switch to it before making another row
current.  Nested work switches in and back out (``prev = clock.switch(SCHEDULER) ...
clock.switch(prev)``), so a backend call made from inside a scheduler call is charged to the
backend and not twice.  Every second between start and stop therefore belongs to exactly one
row, and the rows add up to the wall time by construction.

:class:`TimedBackend` wraps a Python backend so that its calls are charged to the backend row.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

__all__ = [
    "ROWS",
    "SETUP", "WORKLOAD", "SUBMISSION", "SCHEDULER", "BACKEND", "ENGINE", "CHECK",
    "Stopwatch",
    "TimedBackend",
    "is_c_backend",
    "percentile",
]

#: Row keys, in the order of the summary table.
ROWS = ("setup", "workload", "submission", "scheduler", "backend", "engine", "check")
SETUP, WORKLOAD, SUBMISSION, SCHEDULER, BACKEND, ENGINE, CHECK = range(len(ROWS))

_now = time.perf_counter


class Stopwatch:
    """Seconds per row of :data:`ROWS`; see the module docstring.

    A new stopwatch is running, in row ``row`` (``SETUP`` by default).  ``seconds[i]`` is the
    time charged to row ``i`` so far (the current row's running interval is added on the next
    switch or stop)."""

    __slots__ = ("seconds", "_row", "_t", "running")

    def __init__(self, row: int = SETUP) -> None:
        self.seconds: List[float] = [0.0] * len(ROWS)
        self._row = row
        self._t = _now()
        self.running = True

    @property
    def row(self) -> int:
        return self._row

    def switch(self, row: int) -> int:
        """Charge the time since the last switch to the current row, make ``row`` current and
        return the previous row (to switch back to)."""
        now = _now()
        if self.running:
            self.seconds[self._row] += now - self._t
        self._t = now
        prev = self._row
        self._row = row
        return prev

    def enter(self, row: int) -> Optional[int]:
        """Charge what follows to ``row`` (starting a stopped stopwatch); returns the token
        :meth:`leave` needs to switch back (or to stop again)."""
        if not self.running:
            self.start(row)
            return None
        return self.switch(row)

    def leave(self, token: Optional[int]) -> None:
        """Undo :meth:`enter`: switch back to the row it left, or stop if it started."""
        if token is None:
            self.stop()
        else:
            self.switch(token)

    def stop(self) -> None:
        """Charge the current interval and stop counting (a no-op when stopped)."""
        if self.running:
            self.switch(self._row)
            self.running = False

    def start(self, row: Optional[int] = None) -> None:
        """Count again from now, in ``row`` (default: the current row)."""
        if not self.running:
            self._t = _now()
            self.running = True
        if row is not None:
            self.switch(row)

    @property
    def wall_s(self) -> float:
        """Seconds counted so far (the sum of the rows, the running interval included)."""
        extra = _now() - self._t if self.running else 0.0
        return sum(self.seconds) + extra

    def as_dict(self) -> Dict[str, float]:
        return dict(zip(ROWS, self.seconds))


def is_c_backend(backend) -> bool:
    """A backend the scheduler calls through a capsule, with no Python in between to time
    (so never wrap it in a :class:`TimedBackend`)."""
    return (type(backend).__name__ == "PyCapsule"
            or getattr(backend, "__qualia_backend__", None) is not None)


class TimedBackend:
    """Wraps a Python backend: its ``execute_step``, ``execute_ragged``, ``prefill`` and
    ``copy_pages`` calls
    (those it has) are charged to the ``BACKEND`` row of ``clock`` and added up in ``.seconds``
    (per method in ``.by_method``, call counts in ``.calls``).  Everything else is the wrapped
    backend's (``__getattr__``).  Never wrap a C backend: the scheduler would find its capsule
    through ``__getattr__`` and call it directly, past the wrapper."""

    def __init__(self, inner, clock: Optional[Stopwatch] = None) -> None:
        self.inner = inner
        self.clock = clock
        self.seconds = 0.0
        self.by_method: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}
        self.pages_copied = 0
        for name in ("execute_step", "execute_ragged", "prefill", "copy_pages"):
            fn = getattr(inner, name, None)
            if callable(fn):
                self.by_method[name] = 0.0
                self.calls[name] = 0
                setattr(self, name, self._wrap(name, fn))

    def charge(self, name: str, seconds: float, calls: int = 1) -> None:
        """Count ``calls`` calls of ``name`` that took ``seconds`` in all, made to the wrapped
        backend directly by a caller that timed them (and charged its stopwatch) itself."""
        self.seconds += seconds
        self.by_method[name] = self.by_method.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + calls

    def _wrap(self, name, fn):
        def timed(*args):
            if name == "copy_pages":
                self.pages_copied += len(args[0])
            clock = self.clock
            prev = clock.switch(BACKEND) if clock is not None else None
            t0 = _now()
            try:
                return fn(*args)
            finally:
                dt = _now() - t0
                if clock is not None and prev is not None:  # prev is set iff there is a clock
                    clock.switch(prev)
                self.seconds += dt
                self.by_method[name] += dt
                self.calls[name] += 1

        timed.__name__ = name
        return timed

    def __getattr__(self, name):  # weights, config, counters of the wrapped backend
        if name == "inner":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def percentile(values: Union[Sequence[float], np.ndarray], q: float) -> float:
    if not len(values):
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))
