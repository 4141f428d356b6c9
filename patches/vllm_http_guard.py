"""The API server's door on a delta-sync engine: every HTTP route that can change the weights, pause,
resume or sleep the engine is signed or refused, before vLLM sees the request.

========================================  =========================================================
route                                     guard
========================================  =========================================================
``/collective_rpc``                       ``delta_sync_call``: its envelope is verified here (401
                                          otherwise; the workers verify it again); ``delta_sync_status``
                                          runs (read-only); any other worker method: 403, unless an
                                          operator names it in ``DELTA_SYNC_RPC_ALLOW``
``/pause``, ``/resume``, ``/sleep``,      the trainer's signature of the route and its raw query in
``/wake_up``,                             the ``X-Delta-Sync-Call`` header
``/release_kv_cache_memory``              (:meth:`delta_sync.auth.Signer.sign_route`): 401 without
vLLM's weight-transfer routes,            403: weights change only through ``delta_sync_call``
``/update_weight_version``,
``/scale_elastic_ep``, ``/weight_checker``
========================================  =========================================================

Every refusal is JSON ``{"error": {"message": ..., "type": ..., "code": ...}}`` naming what to do, and
nothing behind the route runs. Requests to other routes (generation, health, metrics, cache resets)
pass untouched, and so does everything on an engine without delta-sync.

The guard wraps the middleware stack of every FastAPI app in the process (:func:`install`, from the
plugin): where vLLM builds its app differs by generation and by how the server was started, the
ASGI app class does not. Whether delta-sync is on is read from the app's engine client
(``app.state.engine_client.vllm_config``) at request time; paths are matched without the server's
``root_path``, as Starlette routes them.
"""

from __future__ import annotations

import json

from delta_sync.auth import ROUTE_HEADER, AuthError, Verifier, load_secret, route_call

from . import enabled
from .engine_options import RPC_ALLOW_ENV, EngineOptions

#: routes that pause, resume, sleep or free the engine's memory: accepted with the trainer's signature
SIGNED_ROUTES = ("/pause", "/resume", "/sleep", "/wake_up", "/release_kv_cache_memory")
#: vLLM's own ways to write, reset or relabel weights: a delta-sync engine takes weights only from
#: delta_sync_call (``/weight_checker`` resets every weight with ``action=reset``)
REFUSED_ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                  "/finish_weight_update", "/shutdown_weight_transfer_engine", "/start_draft_weight_update",
                  "/update_weight_version", "/scale_elastic_ep", "/weight_checker")
#: worker methods any caller may reach through /collective_rpc (the first checks its own signature)
OPEN_RPC = ("delta_sync_call", "delta_sync_status")
#: the largest /collective_rpc body read here (envelopes are small: a few KiB)
MAX_RPC_BODY = 16 << 20


def allowed_rpc() -> frozenset[str]:
    """The worker methods /collective_rpc admits: delta-sync's own and those the operator allows by
    name (``DELTA_SYNC_RPC_ALLOW``)."""
    return frozenset(OPEN_RPC) | EngineOptions.from_env().rpc_allow


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

    def engine_client(self):
        """vLLM's engine client from the app's state (None before the server serves an engine)."""
        return getattr(getattr(self.owner, "state", None), "engine_client", None)

    async def verifier(self) -> Verifier:
        """This engine's verifier: the secret, and the identity its workers hold for this boot (asked
        of them once; every envelope must name it). Refuses every signed call where no secret is set."""
        if self._verifier is None:
            client = self.engine_client()
            if client is None:
                raise Refusal(503, "the engine is not serving yet; nothing ran")
            try:
                statuses = await client.collective_rpc("delta_sync_status")
            except Exception as e:  # noqa: BLE001 - answered as a refusal, never as an open door
                raise Refusal(503, f"the engine's workers did not say their identity ({type(e).__name__}: {e}); "
                                   "nothing ran") from None
            ids = {s.get("engine") for s in statuses or [] if isinstance(s, dict)}
            if len(ids) != 1 or not next(iter(ids)):
                raise Refusal(503, f"the engine's workers hold no single identity ({sorted(map(str, ids))}); "
                                   "nothing ran")
            self._verifier = Verifier(load_secret(required=False), engine=ids.pop())
        return self._verifier

    def on(self) -> bool:
        if self._on is None:
            client = self.engine_client()
            if client is None:
                return enabled(None)  # not serving an engine (yet): only the environment can say
            self._on = enabled(getattr(client, "vllm_config", None))
        return self._on

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or not self.on():
            return await self.app(scope, receive, send)
        path = _route_path(scope)
        try:
            if path in REFUSED_ROUTES:
                raise Refusal(403, f"{path} is refused on a delta-sync engine: its weights change only through "
                                   "the trainer's signed delta_sync_call; nothing changed")
            if path in SIGNED_ROUTES:
                envelope = self.check_route(await self.verifier(), path, scope)
                await self.check_with_workers(path, envelope)
            elif path == "/collective_rpc":
                body = await _read_body(receive)
                if self.check_rpc(body):
                    (await self.verifier()).check(_envelope(body))
                receive = _replay(body, receive)
        except Refusal as r:
            return await _refuse(send, r.status, str(r))
        except (AuthError, ValueError) as e:  # a delta_sync_call envelope that does not verify
            return await _refuse(send, 401, str(e))
        return await self.app(scope, receive, send)

    async def check_with_workers(self, path: str, envelope: dict) -> None:
        """The workers verify a signed route's envelope too (and do nothing else with it): their nonce
        state is the engine's, while this one is per API-server process, so a call replayed to another
        API server of the same engine (``--api-server-count`` > 1) is refused there."""
        client = self.engine_client()
        if client is None:  # a guard without an engine (tests of the guard alone)
            return
        try:
            await client.collective_rpc("delta_sync_call", args=(json.dumps(envelope),))
        except Exception as e:  # noqa: BLE001 - answered as a refusal, never as an open door
            raise Refusal(401, f"{path}: the engine's workers refused the signature ({type(e).__name__}: {e}); "
                               "nothing changed") from None

    @staticmethod
    def check_route(verifier: Verifier, path: str, scope) -> dict:
        """The route's verified envelope; :class:`Refusal` (401) for anything else."""
        headers = dict(scope.get("headers") or [])
        raw = headers.get(ROUTE_HEADER.lower().encode())
        query = scope.get("query_string", b"").decode()
        try:
            envelope = json.loads(raw) if raw else None
            method, payload = verifier.check(envelope)
        except (AuthError, ValueError) as e:
            raise Refusal(401, f"{path} on a delta-sync engine needs the trainer's signature ({ROUTE_HEADER} "
                               f"header, made with DELTA_SYNC_SECRET by delta_sync.engines.HttpEngine): {e}") from None
        want = route_call(path, query)
        if (method, payload) != (want["method"], want["payload"]):
            raise Refusal(401, f"{path}: the signature is for {method} {payload}, not this request; nothing changed")
        return envelope

    @staticmethod
    def check_rpc(body: bytes) -> bool:
        """Refuses a worker method outside the allowed ones; True for a ``delta_sync_call``, whose
        envelope the caller verifies."""
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            raise Refusal(400, "/collective_rpc: the body is not JSON") from None
        method = request.get("method") if isinstance(request, dict) else None
        if not isinstance(method, str) or method not in allowed_rpc():
            raise Refusal(403, f"/collective_rpc {method!r} is refused on a delta-sync engine: only the plugin's "
                               f"signed delta_sync_call and delta_sync_status run here (an operator allows others "
                               f"by name in {RPC_ALLOW_ENV}); nothing ran")
        return method == "delta_sync_call"


def _envelope(body: bytes):
    """The envelope a ``delta_sync_call`` body carries (its first argument), or None."""
    args = json.loads(body).get("args") or []
    return json.loads(args[0]) if isinstance(args, list) and args and isinstance(args[0], str) else None


def _route_path(scope) -> str:
    """The path the app routes on: without the server's ``root_path`` (``--root-path``: Starlette
    strips it before matching routes, so must the guard) and without a trailing slash."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path.rstrip("/") or "/"


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
