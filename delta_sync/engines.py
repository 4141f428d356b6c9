"""Clients for the engines a sender drives: a vLLM HTTP server, or an in-process ``vllm.LLM``.

Both speak vLLM's weight-transfer protocol (pause -> start -> update -> finish -> resume) plus
delta-sync's ``delta_sync_report`` / ``delta_sync_discard`` worker methods over ``collective_rpc``.
Nothing here imports vLLM: the in-process client duck-types the ``LLM`` object. Every engine-side
failure surfaces as :class:`EngineError` carrying the engine's own message.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Protocol

from .errors import EngineError


class EngineClient(Protocol):
    name: str

    def pause(self, mode: str) -> None: ...
    def resume(self) -> None: ...
    def init(self, init_info: dict) -> None: ...
    def start(self) -> None: ...
    def update(self, update_info: dict) -> None: ...
    def finish(self, version: int) -> None: ...
    def discard(self) -> None: ...
    def reset_prefix_cache(self) -> None: ...
    def report(self, digests: bool = False) -> list[dict]: ...


class HttpEngine:
    """A vLLM OpenAI server started with ``VLLM_SERVER_DEV_MODE=1`` (RL + collective_rpc routes)."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.name = self.url
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict | None = None, query: dict | None = None):
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise EngineError(self.name, _server_message(e.read()), kind=f"HTTP {e.code} on {path}") from None
        except urllib.error.URLError as e:
            raise EngineError(self.name, str(e.reason), kind=f"unreachable on {path}") from None
        return json.loads(raw) if raw else None

    def pause(self, mode: str = "wait") -> None:
        self._post("/pause", query={"mode": mode})

    def resume(self) -> None:
        self._post("/resume")

    def init(self, init_info: dict) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start(self) -> None:
        self._post("/start_weight_update")

    def update(self, update_info: dict) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish(self, version: int) -> None:
        self._post("/finish_weight_update", {"weight_version": str(version)})

    def _rpc(self, method: str, arg: dict) -> list:
        out = self._post("/collective_rpc", {"method": method, "args": [json.dumps(arg)]})
        return (out or {}).get("results", [])

    def discard(self) -> None:
        self._rpc("delta_sync_discard", {})

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")

    def report(self, digests: bool = False) -> list[dict]:
        return self._rpc("delta_sync_report", {"digests": digests})


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


class InProcessEngine:
    """An offline ``vllm.LLM`` in this process (it has no pause: offline generation is not concurrent)."""

    def __init__(self, llm, name: str = "llm"):
        self.llm = llm
        self.name = name

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            raise EngineError(self.name, f"{type(e).__name__}: {e}", kind=what) from e

    def pause(self, mode: str = "wait") -> None:
        pass

    def resume(self) -> None:
        pass

    def init(self, init_info: dict) -> None:
        self._call("init", self.llm.init_weight_transfer_engine, {"init_info": init_info})

    def start(self) -> None:
        self._call("start", self.llm.start_weight_update)

    def update(self, update_info: dict) -> None:
        self._call("update", self.llm.update_weights, {"update_info": update_info})

    def finish(self, version: int) -> None:
        self._call("finish", self.llm.finish_weight_update, str(version))

    def discard(self) -> None:
        self._call("discard", self.llm.collective_rpc, "delta_sync_discard", None, ("{}",))

    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache", self.llm.reset_prefix_cache)

    def report(self, digests: bool = False) -> list[dict]:
        return self._call("report", self.llm.collective_rpc, "delta_sync_report", None,
                          (json.dumps({"digests": digests}),))


def as_engine(target) -> EngineClient:
    """A URL string becomes an :class:`HttpEngine`, an ``LLM`` an :class:`InProcessEngine`."""
    if isinstance(target, str):
        return HttpEngine(target)
    if hasattr(target, "init_weight_transfer_engine") and hasattr(target, "collective_rpc"):
        return InProcessEngine(target)
    if all(hasattr(target, m) for m in ("start", "update", "finish", "report")):
        return target
    raise TypeError(f"cannot drive {target!r}: pass a vLLM server URL, a vllm.LLM, or an EngineClient")
