"""An in-memory receiver: joins the channel like an engine worker and rebuilds full checkpoint
tensors from seed + patches, with the engine client surface (init / pause / start / update /
finish / report) that :class:`~delta_sync.sync.WeightSync` drives.

The oracle of the trainer-side tests and the sync benchmark: it answers "did the trainer side send
exactly the model?" independently of any engine's loaders (engine tests run real vLLM)."""

from __future__ import annotations

import threading
from typing import Iterable

import torch

from . import native
from .channel import Channel
from .digest import digest_tensor
from .errors import EngineError, NeedsSeed
from .patch import DTYPES, apply_patch
from .transfer import acknowledge, receive_update


class MemoryReceiver:
    name = "memory-receiver"
    #: a delta's ``update`` may be received on a thread of its own (``background``), as an engine
    #: worker does (``patches.vllm_receiver.BackgroundReceive``): ``await_staged`` and ``finish`` wait for it
    receives_in_background = True

    def __init__(self, direct: bool = True, threads: int | None = None):
        self.tensors: dict[str, torch.Tensor] = {}
        #: threads a delta's writes are spread over (default: ``torch.get_num_threads()``); a
        #: receiver inside a trainer rank (which keeps to one thread) may use the host's cores as an
        #: engine's worker would use its own
        self.threads = threads
        #: receive large seed/full ranges straight into the tensors (else through the bucket arena)
        self.direct = direct
        self._lock = threading.Lock()
        self.version: int | None = None
        self.needs_seed = False  # set by an update it cannot take on its version (it asks for a seed)
        self.channel: Channel | None = None
        self._staged = None
        self._receiving: threading.Thread | None = None  # a background receive, until staged waits for it
        self._receive_error: BaseException | None = None
        #: most buckets alive at once while receiving (bounded by delta_sync.transfer.BUCKETS_IN_FLIGHT)
        self.peak_buckets = 0

    def init(self, info: dict) -> None:
        self._drop()  # a receive on the old channel (its sender dropped it) ends first
        if self.channel is not None:
            self.channel.close()
        self.channel = Channel.connect(info["host"], info["port"], info["rank_offset"], info["world_size"],
                                       info["token"], backend=info.get("backend"), timeout_s=info["timeout_s"])

    def pause(self, mode: str = "wait") -> None:
        pass

    def resume(self) -> None:
        pass

    def start(self, digest_names: list[str] | None = None) -> list[dict] | None:
        self._drop()
        return self.report(digests=bool(digest_names), names=digest_names)

    def update(self, update_info: dict) -> None:
        self._drop()  # (a receive of the last update that nobody waited for: the channel is in step after it)
        if not update_info.get("background"):
            self._receive()
            return
        self._staged = None
        self.channel.received_whole = self.channel.received_abort = None
        self._receiving = threading.Thread(target=self._receive_background, name="memory-receive", daemon=True)
        self._receiving.start()

    def _receive(self, delta_only: bool = False) -> None:
        try:
            self._staged = receive_update(self.channel, bulk_sink=self._refuse_bulk if delta_only else self._write_ranges,
                                          place=self._place if self.direct and not delta_only else None)
        except Exception as e:  # what an engine client reports for a failed update RPC
            if isinstance(e, NeedsSeed):  # e.g. a delta numbered by a catalogue this receiver lacks
                self.needs_seed = True
            raise EngineError(self.name, f"{type(e).__name__}: {e}", kind="update") from e
        self.peak_buckets = max(self.peak_buckets, self._staged.peak_buckets)

    def _receive_background(self) -> None:
        error = None
        try:
            self._receive(delta_only=True)
        except BaseException as e:  # noqa: BLE001 - raised by staged / finish
            error = e
        self._receive_error = acknowledge(self.channel, error)

    def _refuse_bulk(self, entries: list) -> None:
        self.needs_seed = True
        raise NeedsSeed("a seed or full update arrived in a background receive, which takes deltas only")

    def await_staged(self) -> None:
        """Wait for a background receive (the channel's timeout bounds it); raise what failed it."""
        th, self._receiving = self._receiving, None
        if th is not None:
            th.join()
        err, self._receive_error = self._receive_error, None
        if err is not None:
            self._staged = None
            raise err

    def _write_ranges(self, entries: list) -> None:
        """A seed/full bucket's entries, applied as it arrives: the old version is gone from here on."""
        for entry, p in entries:
            self._write_range(entry, p)

    def _place(self, header: dict) -> dict[int, torch.Tensor]:
        """Where a bulk bucket's ``seg`` entries land: straight in the tensors they belong to."""
        out = {i: self._range(e["name"], tuple(e["shape"]), DTYPES[e["dtype"]], int(e["start"]), int(e["count"]))
               for i, e in enumerate(header["entries"]) if e.get("seg") and e.get("dtype") in DTYPES}
        # a range that does not fit is left to the arena: the bucket's checks name what is wrong
        return {i: t for i, t in out.items()
                if t.device == self.channel.device and t.numel() == int(header["entries"][i]["count"])}

    def _range(self, name: str, shape: tuple, dtype: torch.dtype, start: int, count: int) -> torch.Tensor:
        with self._lock:  # the receive thread places ranges while the applying one writes others
            self.version = None  # the old version is gone from the first write on
            t = self.tensors.get(name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                t = self.tensors[name] = torch.empty(shape, dtype=dtype)
            return t.view(-1)[max(start, 0):start + count]

    def _write_range(self, entry: dict, p) -> None:
        dst = self._range(p.name, p.shape, p.dtype, int(entry["start"]), p.count)
        if dst.data_ptr() != p.values.data_ptr():  # not received in place
            dst.copy_(p.values)

    def finish(self, version: int) -> None:
        self.await_staged()
        upd, self._staged = self._staged, None
        if upd is None:
            return
        sparse = []  # written by the host kernel together where it can take them all (a tensor's
        for p in upd.patches:  # patches in one delta touch disjoint elements: any order will do)
            if p.name not in self.tensors:
                self.tensors[p.name] = torch.empty(p.shape, dtype=p.dtype)
            if p.dense:
                apply_patch(self.tensors[p.name], p)
            else:
                sparse.append(p)
        rows = [(self.tensors[p.name].view(-1), p.indices, 0, p.values, None) for p in sparse]
        if native.movable_rows(rows):  # (one tensor's patch per row: threads write disjoint tensors)
            native.move_rows(rows, native.thread_spans([p.count for p in sparse], threads=self.threads), checked=True)
        else:
            for p in sparse:
                apply_patch(self.tensors[p.name], p)
        self.version = upd.version
        if upd.kind != "delta":
            self.needs_seed = False

    def discard(self) -> None:
        self._drop()

    def _drop(self) -> None:
        """Drop what was staged; a background receive first ends (its sender aborted it, or dropped
        the channel: it ends now)."""
        try:
            self.await_staged()
        except EngineError:
            pass
        self._staged = None

    def reset_prefix_cache(self) -> None:
        pass

    def mismatched(self, expected: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Names, in order, whose tensor here is missing or differs from ``expected`` in any bit."""
        def bits(t: torch.Tensor) -> torch.Tensor:
            return t.detach().contiguous().reshape(-1).view(torch.uint8)

        return [n for n, t in expected if n not in self.tensors or not torch.equal(bits(self.tensors[n]), bits(t))]

    def report(self, digests: bool = False, names: list[str] | None = None) -> list[dict]:
        # (it reads dense tables, and keeps no catalogue across channels: see patches.vllm_receiver)
        out = {"version": self.version, "needs_seed": self.version is None or self.needs_seed, "rank": None,
               "catalog": None}
        if digests:
            out["digests"] = {n: [digest_tensor(t).hex(), t.numel(), t.numel()] for n, t in self.tensors.items()
                              if names is None or n in names}
        return [out]
