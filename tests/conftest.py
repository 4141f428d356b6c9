"""Suite-wide: one engine secret for every process the tests start (engines, trainers, ranks), as
a launcher would hand it to both sides. Tests of refusals use other secrets explicitly."""

import os
import secrets

from delta_sync.auth import ENV

os.environ.setdefault(ENV, secrets.token_hex(32))
# Engines here see many trainers one after another, some killed on purpose; a trainer's claim on an
# engine (60 s of silence by default) would make each wait for the last. Claims are off for the
# suite; tests/test_vllm_receiver.py turns them on where it tests them.
os.environ.setdefault("DELTA_SYNC_CLAIM_S", "0")


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


@pytest.fixture(autouse=True)
def _test_tensors_travel_in_place(monkeypatch):
    """Test tensors weigh KiBs, production ones MiBs: lower the zero-copy threshold so that in-process
    senders send the larger test tensors from their source, straight into the receivers' tensors (the
    path every large tensor takes), while tensors under 4 KiB stay packed (the path of norms and
    biases). Trainers in processes of their own keep the default: everything packed there."""
    from delta_sync import bucket

    monkeypatch.setattr(bucket, "DIRECT_MIN_BYTES", 4 << 10)
