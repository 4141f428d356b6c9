"""Python's full cyclic-GC passes held off while delta-sync works (an update on the trainer, a
weight-transfer call on an engine worker).

A full (oldest-generation) collection walks every live object and lands wherever an allocation
tips its threshold: a noticeable pause in a bare torch process, far longer in a trainer's heap or in an engine
worker's whose heap vLLM did not freeze (its CPU worker does not). The young generations keep
being collected (they hold the update's own short-lived objects, and any cycle among them is
freed as before: a long seed's source cannot pile up cyclic garbage); a full pass that came due
meanwhile runs after the update, in the caller's code, as it would have without us.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

#: the oldest generation's threshold while held: no automatic full pass fires
_NEVER = 1 << 30


class GcHold:
    """Counted: overlapping holders (several syncs, an in-process engine's calls beside its
    trainer's update) restore the thresholds once, when the last one is done, to what they were
    when the first one began."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._saved: tuple[int, ...] = ()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._saved = gc.get_threshold()
                gc.set_threshold(*self._saved[:2], _NEVER)
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    gc.set_threshold(*self._saved)


#: the process's one hold (``with gc_held(): ...``)
gc_held = GcHold()
