"""Clients for the engines a sender drives: a vLLM HTTP server, or an in-process ``vllm.LLM``.

Both drive vLLM's weight-transfer protocol (pause -> start -> update -> finish -> resume). The
weight-transfer calls (init, start, update, staged, finish, discard, report) go to the workers' signed
``delta_sync_call`` method over ``collective_rpc`` (see :mod:`delta_sync.auth`); vLLM's own
unsigned routes for them are refused by a delta-sync engine. Nothing here imports vLLM: the
in-process client duck-types the ``LLM`` object. Every engine-side failure surfaces as
:class:`EngineError` carrying the engine's own message.
"""

from __future__ import annotations

import http.client
import json
import secrets
import threading
import time
import urllib.parse
from typing import Protocol

from .auth import OTHER_ENGINE, ROUTE_HEADER, Signer, load_secret
from .errors import EngineError


#: ``collective_rpc`` keyword that asks the API server to pause before the call and resume after
#: it succeeds (the delta-sync plugin takes it off before the workers see the call)
COMMIT_KWARG = "delta_sync_pause"


class EngineClient(Protocol):
    """What a sender drives. A client may also offer ``commit(version, mode)``: a delta's pause ->
    finish -> resume in one call (:meth:`HttpEngine.commit`); a sync with one engine uses it.
    ``start`` returns each worker's status (``version``, ``needs_seed``, as :meth:`report`): a
    delta checks its base there; a client whose ``start`` returns None is asked with ``report``."""

    name: str

    def pause(self, mode: str) -> None: ...
    def resume(self) -> None: ...
    def init(self, init_info: dict) -> None: ...
    def start(self, digest_names: list[str] | None = None) -> list[dict] | None: ...
    def update(self, update_info: dict) -> None: ...
    def finish(self, version: int) -> None: ...
    def discard(self) -> None: ...
    def reset_prefix_cache(self) -> None: ...
    def report(self, digests: bool = False, names: list[str] | None = None) -> list[dict]: ...


class _SignedEngine:
    """The weight-transfer calls, each a signed envelope (:mod:`delta_sync.auth`) handed to the
    workers' ``delta_sync_call`` method; subclasses say how a worker method is invoked."""

    name: str
    #: a delta's ``update`` may ask the workers to receive it on a thread of their own (``background``):
    #: the call returns at once, the engine serves while the delta arrives, ``await_staged``/``finish`` wait for it
    receives_in_background = True

    def __init__(self, secret: str | bytes | None):
        self._signer = Signer(load_secret(secret))
        #: the engine's identity for this boot (every envelope names it), asked on first use
        self._engine_id: str | None = None

    def _invoke(self, what: str, request: str) -> list: ...

    def _status(self, challenge: str) -> list: ...

    def identity(self) -> str:
        """The engine's identity for this boot, proven by every worker with the secret."""
        if self._engine_id is None:
            challenge = secrets.token_hex(16)
            statuses = [s for s in self._status(challenge) or [] if s]
            ids = {s.get("engine") for s in statuses}
            if len(ids) != 1 or not all(self._signer.identity_proven(challenge, s.get("engine") or "", s.get("proof"))
                                        for s in statuses):
                raise EngineError(self.name, f"the engine's workers did not prove one identity with this secret "
                                  f"(identities {sorted(map(str, ids))}); is it a delta-sync engine started with "
                                  "the same DELTA_SYNC_SECRET?", kind="identity")
            self._engine_id = ids.pop() or ""
        return self._engine_id

    def _signed(self, send):
        """``send(engine_id)``; once more with the identity asked anew where the engine says the call
        was signed for another engine (it restarted since this client asked: a new boot, a new id)."""
        try:
            return send(self.identity())
        except EngineError as e:
            if OTHER_ENGINE not in str(e):
                raise
            self._engine_id = None
            return send(self.identity())

    def _call(self, method: str, payload: dict | None = None) -> list:
        return self._signed(lambda engine: self._invoke(method, json.dumps(self._signer.sign(method, payload, engine))))

    def init(self, init_info: dict) -> None:
        # the channel token stays here: the workers derive it from the secret and channel_nonce
        self._call("init", {k: v for k, v in init_info.items() if k != "token"})

    def start(self, digest_names: list[str] | None = None) -> list[dict] | None:
        """Start an update; each worker's status comes back (the version it holds: a delta's base,
        checked with no call of its own), with ``digest_names`` its report (digests of those names,
        as they stand before this update): the drift sweep's check, no extra call either."""
        return self._call("start", {"digest_names": digest_names} if digest_names else None)

    def update(self, update_info: dict) -> None:
        self._call("update", update_info)

    def await_staged(self) -> None:
        """Wait until every worker staged the delta its ``update`` receives in the background (its
        error otherwise)."""
        self._call("staged")

    def finish(self, version: int) -> None:
        self._call("finish", {"version": version})

    def discard(self) -> None:
        self._call("discard")

    def report(self, digests: bool = False, names: list[str] | None = None) -> list[dict]:
        return self._call("report", {"digests": digests, "names": names})

    def release(self) -> None:
        """This trainer is done with the engine: another may claim it at once."""
        self._call("release")


class HttpEngine(_SignedEngine):
    """A vLLM OpenAI server started with ``VLLM_SERVER_DEV_MODE=1`` (RL + collective_rpc routes) and
    ``DELTA_SYNC_SECRET``; ``secret`` defaults to this process's ``DELTA_SYNC_SECRET``."""

    #: a call reuses an idle connection that its last call left less than this ago; the server
    #: must keep idle connections open longer (uvicorn, vLLM's server: 5 s)
    KEEPALIVE_S = 2.0
    #: idle connections kept (the sync's calls overlap at most two at a time: start / update and the main thread's)
    MAX_IDLE = 4

    def __init__(self, url: str, timeout_s: float = 600.0, secret: str | None = None):
        super().__init__(secret)
        self.url = url.rstrip("/")
        self.name = self.url
        self.timeout_s = timeout_s
        self._cleared = False  # the last pause emptied the caches (see pause)
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL {url!r}: expected http(s)://host[:port][/prefix]")
        self._conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._netloc, self._prefix = parts.netloc, parts.path.rstrip("/")
        #: idle connections and when their last call ended: the calls of one update (report, start,
        #: update, pause, finish, resume) share them instead of a TCP connection each
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection young enough to reuse (True), or a new one (False)."""
        now, stale, conn = time.monotonic(), [], None
        with self._lock:
            while self._idle:
                c, used = self._idle.pop()
                if now - used <= self.KEEPALIVE_S:
                    conn = c
                    break
                stale.append(c)
        for c in stale:
            c.close()
        return (conn, True) if conn is not None else (self._new_connection(), False)

    def _new_connection(self) -> http.client.HTTPConnection:
        return self._conn_cls(self._netloc, timeout=self.timeout_s)

    def _release(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self.MAX_IDLE:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections (a later call opens a new one)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    def _post(self, path: str, body: dict | None = None, query: dict | None = None, signed: str | None = None):
        """POST ``body`` to ``path``; ``signed`` (the engine's identity): with this trainer's signature
        of the route and query (the routes a delta-sync engine's API server guards: pause, resume)."""
        raw_query = urllib.parse.urlencode(query) if query else ""
        url = self._prefix + path + ("?" + raw_query if raw_query else "")
        data = json.dumps(body or {}).encode()
        headers = {"Content-Type": "application/json"}
        conn, reused = self._connection()
        while True:
            if signed is not None:  # a fresh nonce per attempt: a retried request is not a replay
                headers[ROUTE_HEADER] = self._signer.sign_route(path, raw_query, signed)
            try:
                conn.request("POST", url, body=data, headers=headers)
                r = conn.getresponse()
                raw = r.read()
                break
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if reused and isinstance(e, _CLOSED_BY_PEER):
                    # the server closed the idle connection before reading this request: once more on a
                    # new one (a signed call that did arrive would be refused as a replay, not run twice)
                    conn, reused = self._new_connection(), False
                    continue
                raise EngineError(self.name, f"{type(e).__name__}: {e}", kind=f"unreachable on {path}") from None
        if r.will_close:
            conn.close()
        else:
            self._release(conn)
        if r.status >= 400:
            raise EngineError(self.name, _server_message(raw), kind=f"HTTP {r.status} on {path}")
        return json.loads(raw) if raw else None

    def _rpc(self, what: str, method: str, arg: str, kwargs: dict | None = None) -> list:
        """Every worker's result of ``method(arg, **kwargs)`` through ``/collective_rpc``; an error
        names ``what`` was being done."""
        body = {"method": method, "args": [arg]}
        if kwargs:
            body["kwargs"] = kwargs
        try:
            out = self._post("/collective_rpc", body)
        except EngineError as e:
            e.kind = f"{what} ({e.kind})"
            raise
        return (out or {}).get("results", [])

    def _invoke(self, what: str, request: str, kwargs: dict | None = None) -> list:
        return self._rpc(what, "delta_sync_call", request, kwargs)

    def _status(self, challenge: str) -> list:
        return self._rpc("status", "delta_sync_status", challenge)

    def commit(self, version: int, mode: str = "wait") -> None:
        """A delta's pause -> finish -> resume in one HTTP call: the API server (delta-sync plugin)
        pauses generation with ``mode``, runs the workers' signed finish, resets the prefix cache
        after a ``keep`` pause, and resumes. A failed finish leaves the engine paused, as
        :meth:`finish` after :meth:`pause` would; the caller decides what serves next."""
        self._signed(lambda engine: self._invoke(
            "commit", json.dumps(self._signer.sign("finish", {"version": version}, engine)), {COMMIT_KWARG: mode}))
        self._cleared = False

    def pause(self, mode: str = "wait") -> None:
        self._signed(lambda engine: self._post("/pause", query={"mode": mode}, signed=engine))
        # vLLM's "wait" and "abort" pauses clear the KV and prefix caches once drained, and a paused
        # engine schedules nothing: the caches stay empty until resume
        self._cleared = mode != "keep"

    def resume(self) -> None:
        self._cleared = False
        self._signed(lambda engine: self._post("/resume", signed=engine))

    def reset_prefix_cache(self) -> None:
        """Drop cached KV of the old weights (one call; none after a pause that already cleared it)."""
        if self._cleared:
            return
        self._post("/reset_prefix_cache")


#: how a reused connection that the server closed while it idled fails (not a timeout: the server
#: may still be working on a long call)
_CLOSED_BY_PEER = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def _server_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:2000]
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            if key in body:
                v = body[key]
                return v.get("message", json.dumps(v)) if isinstance(v, dict) else str(v)
    return json.dumps(body)[:2000]


class InProcessEngine(_SignedEngine):
    """An offline ``vllm.LLM`` in this process (it has no pause: offline generation is not concurrent)."""

    def __init__(self, llm, name: str = "llm", secret: str | None = None):
        super().__init__(secret)
        self.llm = llm
        self.name = name

    def _guard(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            raise EngineError(self.name, f"{type(e).__name__}: {e}", kind=what) from e

    def _invoke(self, what: str, request: str) -> list:
        return self._guard(what, self.llm.collective_rpc, "delta_sync_call", None, (request,))

    def _status(self, challenge: str) -> list:
        return self._guard("identity", self.llm.collective_rpc, "delta_sync_status", None, (challenge,))

    def pause(self, mode: str = "wait") -> None:
        pass

    def resume(self) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        self._guard("reset_prefix_cache", self.llm.reset_prefix_cache)


def as_engine(target, secret: str | bytes | None = None) -> EngineClient:
    """A URL string becomes an :class:`HttpEngine`, an ``LLM`` an :class:`InProcessEngine` (both sign
    their calls with ``secret``, default ``$DELTA_SYNC_SECRET``); an object with the client methods
    is used as it is."""
    if isinstance(target, str):
        return HttpEngine(target, secret=secret)
    if hasattr(target, "collective_rpc") and hasattr(target, "generate"):  # a vllm.LLM
        return InProcessEngine(target, secret=secret)
    if all(hasattr(target, m) for m in ("start", "update", "finish", "report")):
        return target
    raise TypeError(f"cannot drive {target!r}: pass a vLLM server URL, a vllm.LLM, or an EngineClient")
