"""The API server's door on a delta-sync engine: every HTTP route that can change the weights, pause,
resume or sleep the engine is signed or refused, before vLLM sees the request.

========================================  =========================================================
route                                     guard
========================================  =========================================================
``/collective_rpc``                       ``delta_sync_call``: its envelope is verified here (401
                                          otherwise; the workers verify it again); ``delta_sync_status``
                                          runs (read-only); any other worker method: 403, unless an
                                          operator names it in ``DELTA_SYNC_RPC_ALLOW``
``/pause``, ``/resume``, ``/sleep``,      the trainer's signature in the ``X-Delta-Sync-Call``
``/wake_up``                              header (:func:`delta_sync.auth.sign_route`): 401 without
vLLM's weight-transfer routes,            403: weights change only through ``delta_sync_call``
``/update_weight_version``,
``/scale_elastic_ep``
========================================  =========================================================

Every refusal is JSON ``{"error": {"message": ..., "type": ..., "code": ...}}`` naming what to do, and
nothing behind the route runs. Requests to other routes (generation, health, metrics, cache resets)
pass untouched, and so does everything on an engine without delta-sync.

The guard wraps the middleware stack of every FastAPI app in the process (:func:`install`, from the
plugin): where vLLM builds its app differs by generation and by how the server was started, the
ASGI app class does not. Whether delta-sync is on is read from the app's engine client
(``app.state.engine_client.vllm_config``) at request time.
"""

from __future__ import annotations

import json
import os
import urllib.parse

from delta_sync.auth import ROUTE_HEADER, AuthError, Verifier, load_secret, route_call

from . import enabled

#: routes that pause, resume or sleep the engine: accepted with the trainer's signature
SIGNED_ROUTES = ("/pause", "/resume", "/sleep", "/wake_up")
#: vLLM's own ways to write or relabel weights: a delta-sync engine takes weights only from delta_sync_call
REFUSED_ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                  "/finish_weight_update", "/shutdown_weight_transfer_engine", "/start_draft_weight_update",
                  "/update_weight_version", "/scale_elastic_ep")
#: worker methods any caller may reach through /collective_rpc (the first checks its own signature)
OPEN_RPC = ("delta_sync_call", "delta_sync_status")
#: comma-separated further worker methods an operator allows through /collective_rpc
RPC_ALLOW_ENV = "DELTA_SYNC_RPC_ALLOW"
#: the largest /collective_rpc body read here (envelopes are small: a few KiB)
MAX_RPC_BODY = 16 << 20


def allowed_rpc() -> frozenset[str]:
    extra = os.environ.get(RPC_ALLOW_ENV, "")
    return frozenset(OPEN_RPC) | {m.strip() for m in extra.split(",") if m.strip()}


class Refusal(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def install() -> None:
    """Wraps the middleware stack FastAPI builds for each app (once per process)."""
    try:
        from fastapi import FastAPI
    except ImportError:  # no HTTP server in this process's vLLM
        return
    if getattr(FastAPI, "_delta_sync_guard", False):
        return
    build = FastAPI.build_middleware_stack

    def build_middleware_stack(self):
        return DeltaSyncGuard(build(self), owner=self)

    FastAPI.build_middleware_stack = build_middleware_stack
    FastAPI._delta_sync_guard = True


class DeltaSyncGuard:
    """ASGI middleware in front of vLLM's API server app (``owner``: the app, whose state holds the
    engine client once the server has started; ``None``: always on)."""

    def __init__(self, app, verifier: Verifier | None = None, owner=None):
        self.app = app
        self.owner = owner
        self._verifier = verifier
        self._on: bool | None = None if owner is not None else True

    @property
    def verifier(self) -> Verifier:
        if self._verifier is None:  # refuses every signed call where no secret is configured
            self._verifier = Verifier(load_secret(required=False))
        return self._verifier

    def on(self) -> bool:
        if self._on is None:
            client = getattr(getattr(self.owner, "state", None), "engine_client", None)
            if client is None:
                return enabled(None)  # not serving an engine (yet): only the environment can say
            self._on = enabled(getattr(client, "vllm_config", None))
        return self._on

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or not self.on():
            return await self.app(scope, receive, send)
        path = scope.get("path", "").rstrip("/") or "/"
        try:
            if path in REFUSED_ROUTES:
                raise Refusal(403, f"{path} is refused on a delta-sync engine: its weights change only through "
                                   "the trainer's signed delta_sync_call; nothing changed")
            if path in SIGNED_ROUTES:
                self.check_route(path, scope)
            elif path == "/collective_rpc":
                body = await _read_body(receive)
                self.check_rpc(body)
                receive = _replay(body, receive)
        except Refusal as r:
            return await _refuse(send, r.status, str(r))
        return await self.app(scope, receive, send)

    def check_route(self, path: str, scope) -> None:
        headers = dict(scope.get("headers") or [])
        raw = headers.get(ROUTE_HEADER.lower().encode())
        query = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode()))
        try:
            envelope = json.loads(raw) if raw else None
            method, payload = self.verifier.check(envelope)
        except (AuthError, ValueError) as e:
            raise Refusal(401, f"{path} on a delta-sync engine needs the trainer's signature ({ROUTE_HEADER} "
                               f"header, made with DELTA_SYNC_SECRET by delta_sync.engines.HttpEngine): {e}") from None
        want = route_call(path, query)
        if (method, payload) != (want["method"], want["payload"]):
            raise Refusal(401, f"{path}: the signature is for {method} {payload}, not this request; nothing changed")

    def check_rpc(self, body: bytes) -> None:
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            raise Refusal(400, "/collective_rpc: the body is not JSON") from None
        method = request.get("method") if isinstance(request, dict) else None
        if method not in allowed_rpc():
            raise Refusal(403, f"/collective_rpc {method!r} is refused on a delta-sync engine: only the plugin's "
                               f"signed delta_sync_call and delta_sync_status run here (an operator allows others "
                               f"by name in {RPC_ALLOW_ENV}); nothing ran")
        if method != "delta_sync_call":
            return
        args = request.get("args") or []
        try:
            envelope = json.loads(args[0]) if args and isinstance(args[0], str) else None
            self.verifier.check(envelope)
        except (AuthError, ValueError) as e:
            raise Refusal(401, str(e)) from None


async def _read_body(receive) -> bytes:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_RPC_BODY:
            raise Refusal(413, f"/collective_rpc body over {MAX_RPC_BODY} bytes; nothing ran")
        parts.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(parts)


def _replay(body: bytes, receive):
    """A ``receive`` that hands the app the body read here, then the connection's own messages."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send, status: int, message: str) -> None:
    kind = {401: "Unauthorized", 403: "Forbidden", 413: "PayloadTooLarge"}.get(status, "BadRequest")
    data = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
