"""Python's automatic cyclic GC held off while delta-sync works (an update on the trainer, a
weight-transfer call on an engine worker).

A full collection walks every live object and lands wherever an allocation tips its threshold:
~0.1 s in a bare torch process, far more in a trainer's heap or an engine worker's whose heap
vLLM did not freeze (its CPU worker does not). The garbage of one update is small; a collection
that came due meanwhile runs after it, in the caller's code, as it would have without us.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator


class GcHold:
    """Counted: overlapping holders (several syncs, an in-process engine's calls beside its
    trainer's update) re-enable the GC once, when the last one is done, and only if it was enabled
    when the first one began."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._was_enabled:
                    gc.enable()


#: the process's one hold (``with gc_held(): ...``)
gc_held = GcHold()
