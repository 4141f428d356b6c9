"""Suite-wide: one engine secret for every process the tests start (engines, trainers, ranks), as
a launcher would hand it to both sides. Tests of refusals use other secrets explicitly."""

import os
import secrets

from delta_sync.auth import ENV

os.environ.setdefault(ENV, secrets.token_hex(32))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def _session_dense_server():
    from .engine_helpers import Server

    srv = Server("dense", "session-dense.log", lease_s=4.0)
    yield srv
    srv.stop()


@pytest.fixture
def dense_server(_session_dense_server):
    """One vLLM HTTP engine (tiny dense Qwen3, TP1, checkpoint layout, pause lease 4 s) for every
    test that needs *an* engine rather than a particular one: each such test starts with its own
    trainer, whose first update is a seed, so nothing leaks between tests. A test may kill and
    restart it (``start``); the next test gets it back running (started on first use)."""
    return _session_dense_server.ensure()
