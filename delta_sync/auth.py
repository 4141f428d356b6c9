"""Only the trainer writes weights: calls to an engine prove knowledge of a shared secret.

The engine gets the secret when it starts (``DELTA_SYNC_SECRET`` in its environment); the trainer
gets the same one. The secret itself never travels. Every weight-transfer call (init, start,
update, finish, discard, report) is an *envelope*::

    {"method": "finish", "payload": {...}, "nonce": "<session>:<counter>", "engine": "<id>", "mac": "<hex>"}

``mac`` is HMAC-SHA256 over a domain tag, the method, the nonce, the engine it is meant for and the
canonical JSON of the payload; the engine recomputes it and compares in constant time. Nonces carry
a random session id (one per signer) and a counter that only grows, so a recorded call cannot be
replayed to the same engine; ``engine`` is the engine's identity for this boot (vLLM's
``instance_id``, new at every start), which a verifier bound to an engine requires, so a recorded
call is refused by a sibling engine with the same secret and by the same engine after a restart. The
channel's rendezvous token is derived from the secret and a fresh nonce
(:func:`channel_token`), so the token is not sent either, and bucket headers carry a MAC under it.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import os
import secrets
import threading
from collections import OrderedDict

from .errors import DeltaSyncError

ENV = "DELTA_SYNC_SECRET"
MIN_SECRET_CHARS = 16
_TAG = b"delta-sync/v1\0"
#: how far a counter may run behind the newest one seen in its session (calls to one engine are
#: sequential; this only absorbs reordering of concurrent calls), and how many sessions are kept
_WINDOW = 256
_SESSIONS = 4096


class AuthError(DeltaSyncError):
    """A call without a valid proof of the engine's secret: refused, nothing written."""


def load_secret(secret: str | bytes | None = None, *, required: bool = True) -> bytes | None:
    """The secret given, else ``$DELTA_SYNC_SECRET``; too short or missing (when required) is an error.
    Bytes are a secret loaded already (passed on as they are)."""
    if isinstance(secret, bytes):
        return secret
    value = secret if secret is not None else os.environ.get(ENV)
    if not value:
        if required:
            raise AuthError(f"no engine secret: set {ENV} (the same value for the trainer and the engine "
                            f"processes) or pass secret=...", kept="nothing was sent")
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise AuthError(f"{ENV} is {len(value)} characters; use at least {MIN_SECRET_CHARS} "
                        f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))')", kept="nothing was sent")
    return value.encode()


def ensure_secret() -> str:
    """``$DELTA_SYNC_SECRET``, generated for this process tree if unset (launchers that start their engine)."""
    if not os.environ.get(ENV):
        os.environ[ENV] = secrets.token_hex(32)
    return os.environ[ENV]


#: the HTTP header that carries a signed envelope for a route the engine's API server guards
#: (``/pause``, ``/resume``, ``/sleep``, ``/wake_up``: ``patches/vllm_http_guard.py``)
ROUTE_HEADER = "X-Delta-Sync-Call"


#: the method a signed HTTP route's envelope names, before the route's path
ROUTE_PREFIX = "route:"


def route_call(path: str, query: str = "") -> dict:
    """What a signed call to an HTTP route signs: the route and its raw query string, exactly as sent
    (the guarded routes take no body)."""
    return {"method": f"{ROUTE_PREFIX}{path}", "payload": {"query": query}}


def canonical(payload: dict) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def mac(key: bytes, *parts: bytes) -> str:
    return hmac.new(key, _TAG + b"\0".join(parts), hashlib.sha256).hexdigest()


def identity_proof(key: bytes, challenge: str, engine: str) -> str:
    """An engine's answer to a client's challenge, under a key of its own derived from the secret
    (a caller chooses the challenge: nothing it gets back is a MAC any envelope could carry)."""
    return mac(hmac.new(key, b"delta-sync/identity", hashlib.sha256).digest(), challenge.encode(), engine.encode())


def channel_token(key: bytes, nonce: str) -> str:
    """The channel's rendezvous token for one connection (both ends derive it; it never travels)."""
    return mac(key, b"channel", nonce.encode())


class Signer:
    """Trainer side: wraps calls in envelopes (thread-safe)."""

    def __init__(self, key: bytes):
        self._key = key
        self._session = secrets.token_hex(8)
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def nonce(self) -> str:
        with self._lock:
            return f"{self._session}:{next(self._counter)}"

    def sign(self, method: str, payload: dict | None = None, engine: str = "") -> dict:
        """An envelope for ``method`` with ``payload``, for the engine whose identity is ``engine``."""
        payload = payload or {}
        nonce = self.nonce()
        return {"method": method, "payload": payload, "nonce": nonce, "engine": engine,
                "mac": mac(self._key, method.encode(), nonce.encode(), engine.encode(), canonical(payload))}

    def sign_route(self, path: str, query: str = "", engine: str = "") -> str:
        """The :data:`ROUTE_HEADER` value for a POST to ``path`` with the raw query string ``query``."""
        call = route_call(path, query)
        return json.dumps(self.sign(call["method"], call["payload"], engine))

    def identity_proven(self, challenge: str, engine: str, proof: str | None) -> bool:
        """Did an engine holding the secret answer ``challenge`` with identity ``engine``?"""
        return isinstance(proof, str) and hmac.compare_digest(identity_proof(self._key, challenge, engine), proof)


#: what a verifier bound to an engine says when a call was signed for another one (clients that see
#: it ask the engine for its identity again: it restarted)
OTHER_ENGINE = "was signed for engine"


class Verifier:
    """Engine side: checks envelopes. ``key=None`` (no secret configured) refuses every call;
    ``engine``: this engine's identity, which every envelope must name (None: any)."""

    def __init__(self, key: bytes | None, engine: str | None = None):
        self._key = key
        self.engine = engine
        self._seen: OrderedDict[str, tuple[int, set[int]]] = OrderedDict()
        self._lock = threading.Lock()
        self.session: str | None = None

    def check(self, envelope) -> tuple[str, dict]:
        """``(method, payload)`` of a valid envelope; :class:`AuthError` otherwise."""
        kept = "nothing was written; the trainer's channel and staged update are unchanged"
        if self._key is None:
            raise AuthError(f"this engine was started without {ENV}: weight-transfer calls are refused. "
                            f"Start it with {ENV} set (the trainer needs the same value)", kept=kept)
        if not isinstance(envelope, dict) or not all(isinstance(envelope.get(k), str)
                                                     for k in ("method", "nonce", "mac")):
            raise AuthError("unsigned weight-transfer call (expected an envelope with method, payload, nonce "
                            f"and mac; the trainer needs this engine's {ENV})", kept=kept)
        payload = envelope.get("payload") or {}
        if not isinstance(payload, dict):
            raise AuthError("envelope payload is not an object", kept=kept)
        method, nonce, engine = envelope["method"], envelope["nonce"], envelope.get("engine", "")
        if not isinstance(engine, str):
            raise AuthError(f"{method!r}: malformed engine identity", kept=kept)
        want = mac(self._key, method.encode(), nonce.encode(), engine.encode(), canonical(payload))
        if not hmac.compare_digest(want, envelope["mac"]):
            raise AuthError(f"{method!r}: the call's MAC does not match this engine's secret", kept=kept)
        if self.engine is not None and engine != self.engine:
            raise AuthError(f"{method!r} {OTHER_ENGINE} {engine or '(none)'}, this is engine {self.engine}: a call "
                            "captured on another engine with the same secret, or before this engine restarted",
                            kept=kept)
        session, _, counter = nonce.rpartition(":")
        if not session or not counter.isdigit():
            raise AuthError(f"{method!r}: malformed nonce", kept=kept)
        self._fresh(method, session, int(counter), kept)
        self.session = session  # whose call this is (the engine's trainer claim is keyed by it)
        return method, payload

    def _fresh(self, method: str, session: str, counter: int, kept: str) -> None:
        with self._lock:
            newest, seen = self._seen.pop(session, (0, set()))
            if counter in seen or counter <= newest - _WINDOW:
                self._seen[session] = (newest, seen)
                raise AuthError(f"{method!r}: nonce {session}:{counter} was already used (a replayed call)", kept=kept)
            seen.add(counter)
            newest = max(newest, counter)
            seen = {c for c in seen if c > newest - _WINDOW}
            self._seen[session] = (newest, seen)
            while len(self._seen) > _SESSIONS:
                self._seen.popitem(last=False)

    def prove_identity(self, challenge: str) -> str | None:
        """This engine's answer to a client's ``challenge``: its identity, MACed (None without a secret)."""
        if self._key is None:
            return None
        return identity_proof(self._key, challenge, self.engine or "")

    def channel_token(self, nonce: str) -> str:
        if self._key is None:
            raise AuthError(f"this engine was started without {ENV}", kept="no channel")
        return channel_token(self._key, nonce)
