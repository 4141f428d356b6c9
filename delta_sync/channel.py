"""The sync channel: one process group linking the sender (rank 0) with every engine worker.

Rendezvous runs on a TCP store hosted by the sender; it listens on the address it is given only
(loopback by default). The store namespace is derived from a shared token (itself derived from the
engine secret, see :mod:`delta_sync.auth`), so a process without the token never meets the group
(it times out in an empty namespace) and cannot claim a rank; a rank claimed twice is refused.
The collective backend comes from the accelerator module (hccl on Ascend, nccl on CUDA, gloo on
CPU). The group is built directly on the store and never registered as torch.distributed's default
group, so it coexists with the engine's own TP/DP groups and the trainer's world.

Backend ``local``: every rank in this one process (in-process ``vllm.LLM`` engines). No store and
no wire: a broadcast hands the sender's tensor to the other ranks' threads, which copy it into
their own buffers on their own devices. NCCL and HCCL refuse two ranks on one device, which is where
an in-process engine sits on a one-GPU machine.

Bucket transfer: ``[header_len, index_count, n_value_buffers]`` (int64), header bytes followed by
an HMAC of them under the token, the index buffer, then one value buffer per dtype in name order:
3 + n_dtypes broadcasts per bucket. Sizes are bounded before anything is allocated. A value buffer
with ``seg`` entries travels as its segments instead (:func:`~delta_sync.bucket.value_segments`),
issued together and awaited together: the sender's from their source tensors, the receiver's into
the destinations it names for them (zero copy on both ends), or into its arena. A delta received
on the engine workers' own threads ends with one all-reduce (:meth:`Channel.acknowledge`, gloo):
every worker says whether it staged the version, before the sender pauses any engine.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from typing import Callable

import torch
from torch.distributed import PrefixStore, TCPStore

from . import accelerator, collectives
from .bucket import Arena, Bucket, parse_header, value_segments
from .catalog import Catalog, CatalogBuilder
from .digest import DigestKey
from .errors import ChannelError
from .options import env_seconds
from .patch import DTYPES

log = logging.getLogger(__name__)

#: largest bucket header a receiver accepts (a header lists a bucket's entries: ~100 B each)
MAX_HEADER_BYTES = 64 << 20
#: largest buffer (elements) a receiver allocates for one bucket: int32 indices bound a tensor anyway
MAX_BUFFER_ELEMENTS = (1 << 31) - 1
_MAC_BYTES = 32
#: a bucket opens with one broadcast of this many bytes: its sizes (3 x int64) and as much of its
#: signed header as fits (a seed bucket lists a few dozen entries in a few KB), so a bucket costs
#: one small collective before its payload instead of three (sizes, header, indices: each a round
#: trip that waits for the receiver)
PREAMBLE_BYTES = 64 << 10
_SIZES = struct.Struct("<3q")  # header bytes, index count, value buffers
#: seconds a device channel's peer may stay silent before it counts as dead (see :class:`PeerWatch`);
#: read on both ends (the trainer's rank 0 and every engine worker) when this module loads
PEER_TIMEOUT_S = env_seconds(os.environ, "DELTA_SYNC_PEER_TIMEOUT_S", 20.0, positive=True)
#: seconds between a device channel's liveness beats
BEAT_S = 1.0


def local_address_towards(host: str, port: int) -> str | None:
    """The address of this host's interface that reaches ``host`` (``host`` itself where it is one of
    this host's: the sender's store address); None for a wildcard host (0.0.0.0, ::), where the
    channel leaves the choice to the backend. Gloo's connections listen on it, not on whatever this
    host's name resolves to."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    family, _, _, _, addr = infos[0]
    if ipaddress.ip_address(addr[0]).is_unspecified:
        return None
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((addr[0], 0))  # one of this host's addresses (the sender's own store address)
            return addr[0]
        except OSError:
            pass
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing
        try:
            probe.connect(addr)
            return probe.getsockname()[0]
        except OSError:
            return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a server that binds it itself later (another
    process may take it first). The channel's own store does not use it: see :func:`listen`."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening socket for the channel store, bound before anyone is told its port (``port`` 0:
    the system picks one, ``getsockname()[1]``), so no other process can take the port between
    choosing and binding it. Pass it to :meth:`Channel.connect` as ``listener`` on rank 0."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def _namespace(token: str) -> str:
    return "delta-sync/" + hashlib.sha256(token.encode()).hexdigest()[:32]


class Channel:
    def __init__(self, pg, rank: int, world_size: int, device: torch.device, backend: str, store=None,
                 key: bytes = b"", watch: "PeerWatch | None" = None):
        self.pg, self.rank, self.world_size = pg, rank, world_size
        self._watch = watch  # device backends: a dead peer aborts the group (see PeerWatch)
        self.device, self.backend = device, backend
        self._store = store  # keeps the TCP store (and its listening socket) alive for the group's lifetime
        self._key = key  # bucket headers are MACed under the channel token
        #: host channels keep their bulk arenas between updates (see :meth:`arenas`)
        self._arenas: list = []
        self._catalog = None  # a Catalog, or the CatalogBuilder of the last whole bulk update (see catalog)
        #: may a bulk update name catalogued tensors by id (dense tables)? Every receiver must read
        #: them: a trainer's channel says no where an engine worker does not say it does
        self.dense_tables = True
        #: the version whose last bucket this end received last (the stream ended whole, whatever
        #: its checks found), or None: a background receive acknowledges only such a version
        self.received_whole: int | None = None
        #: the version whose stream the sender aborted (its abort bucket came: in step), or None
        self.received_abort: int | None = None

    @property
    def catalog(self) -> Catalog | None:
        """The tensors the last whole bulk update over this channel numbered (delta tables name them
        by id; :mod:`delta_sync.catalog`); None before one, and after a failed one. Numbered on first
        read, so channels that only ever carry full updates never build one."""
        if isinstance(self._catalog, CatalogBuilder):
            self._catalog = self._catalog.build()
        return self._catalog

    @catalog.setter
    def catalog(self, value: Catalog | CatalogBuilder | None) -> None:
        self._catalog = value

    @property
    def numbering(self) -> Catalog | CatalogBuilder | None:
        """:attr:`catalog` as it is kept, not numbered yet where it was not: what a new channel
        between the same ends may start from (:func:`delta_sync.catalog.remember`)."""
        return self._catalog

    @classmethod
    def connect(cls, host: str, port: int, rank: int, world_size: int, token: str,
                backend: str | None = None, device: torch.device | str | None = None,
                timeout_s: float = 300.0, listener: socket.socket | None = None,
                waiting: Callable[[], None] | None = None) -> "Channel":
        """Join the channel; rank 0 (the sender) hosts the store. All ranks must call this.
        ``listener`` (rank 0): the store's socket from :func:`listen`, bound at ``port`` already; the
        channel owns it from here on, and closes it if the channel does not come up.
        ``waiting`` (rank 0): called every few milliseconds until every other rank has come to the
        store; an exception it raises (say, an engine's refused join) ends the wait at once with
        that error, instead of after ``timeout_s``."""
        try:
            return cls._connect(host, port, rank, world_size, token, backend, device, timeout_s, listener, waiting)
        finally:
            if listener is not None and listener.fileno() != -1:
                listener.close()  # not adopted by a store: the channel did not come up

    @classmethod
    def _connect(cls, host, port, rank, world_size, token, backend, device, timeout_s, listener,
                 waiting) -> "Channel":
        if listener is not None and rank != 0:
            raise ChannelError(f"only rank 0 hosts the store; rank {rank} was given a listener")
        if not token:
            raise ChannelError("an empty channel token is not allowed")
        if not 0 <= rank < world_size:
            raise ChannelError(f"rank {rank} outside world size {world_size}")
        if backend == LOCAL:
            pg = LocalGroup.join(_namespace(token), rank, world_size, timeout_s)
            device = torch.device(device) if device is not None else torch.device("cpu")
            log.info("channel rank %d/%d up on %s in process", rank, world_size, device)
            return cls(pg, rank, world_size, device, LOCAL, None, key=token.encode())
        family = accelerator.family_for_backend(backend) if backend else accelerator.detect_family()
        backend = backend or accelerator.backend_for(family)
        accelerator.require_family(family)
        device = torch.device(device) if device is not None else (
            torch.device("cpu") if family == "cpu" else torch.device(family, torch.get_device_module(family).current_device()))
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = _store(host, port, rank == 0, timeout, listener)
        except Exception as e:  # noqa: BLE001 - named as the channel's error, with the cause in its text
            raise ChannelError(f"rank {rank}: cannot reach the channel store at {host}:{port}: {e}") from None
        ns = PrefixStore(_namespace(token), store)
        if ns.add(f"claim/{rank}", 1) != 1:
            raise ChannelError(f"rank {rank} is already taken in this channel (two engines with the "
                               f"same rank offset?)")
        _await_claims(ns, rank, world_size, timeout_s, waiting)
        try:
            pg = accelerator.make_process_group(backend, PrefixStore("pg", ns), rank, world_size, timeout, device,
                                                bind=local_address_towards(host, port) if backend == "gloo" else None)
        except Exception as e:  # noqa: BLE001 - named as the channel's error, with the cause in its text
            raise ChannelError(f"rank {rank}: rendezvous of {world_size} ranks over {backend} failed "
                               f"({type(e).__name__}: {e}); check the token and that every engine "
                               f"worker joined") from None
        log.info("channel rank %d/%d up on %s via %s", rank, world_size, device, backend)
        # gloo fails a collective as soon as a peer's connection drops; NCCL/HCCL wait for the timeout
        watch = None if backend == "gloo" else PeerWatch(ns, rank, world_size, pg)
        return cls(pg, rank, world_size, device, backend, store, key=token.encode(), watch=watch)

    # ---- primitives ------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.broadcast_all([tensor], src)
        return tensor

    def broadcast_all(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcast each tensor in turn, all in flight at once (the backend overlaps them)."""
        try:
            collectives.pg_broadcast_all(self.pg, tensors, src)
        except collectives.DeviceMismatch:
            raise
        except Exception as e:  # noqa: BLE001 - the channel's error, naming a dead peer where the watch saw one
            dead = self._watch.dead if self._watch is not None else None
            raise ChannelError(f"rank {self.rank}: broadcast from {src} failed: {dead or e}") from None

    def arenas(self) -> list | None:
        """The bulk arenas this end reuses from one update to the next, or None (a fresh set).

        Host memory freed by one update and allocated by the next comes back as fresh pages that
        fault on first touch (about as long as the copy into them), so a host
        channel keeps its two buckets' worth. Device channels do not: the device's caching
        allocator already reuses the blocks, and idle accelerator memory belongs to the engine."""
        return self._arenas if self.device.type == "cpu" else None

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        try:
            if hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception:  # noqa: BLE001 - best effort: the peer may be gone already
            pass
        self.pg = None
        self._store = None
        self._arenas = []

    @property
    def receives_in_background(self) -> bool:
        """May an engine worker receive a delta over this channel on a thread of its own? Host
        channels (gloo, in process) only: on NCCL/HCCL a broadcast from a second thread would be
        enqueued beside the model's own collectives in an order that may differ between ranks."""
        return self.backend in ("gloo", LOCAL)

    @property
    def acknowledges(self) -> bool:
        """Does a delta received in the background end with :meth:`acknowledge` on every rank? On
        gloo (the in-process channel has no such collective: its receivers are waited for by call)."""
        return self.backend == "gloo"

    def acknowledge(self, failed: bool) -> bool:
        """Every rank says whether it staged the version whose last bucket went over the channel
        (the sender: False): True where none failed. The engines' workers say it from the thread
        that received the delta, so the sender learns that every worker staged it, or that one
        failed, without a call to any engine, and its commit then waits for nothing."""
        t = torch.tensor([1 if failed else 0], dtype=torch.int32)
        try:
            collectives.pg_all_reduce_max(self.pg, t)
        except collectives.DeviceMismatch:
            raise
        except Exception as e:  # noqa: BLE001 - the channel's error, naming a dead peer where the watch saw one
            dead = self._watch.dead if self._watch is not None else None
            raise ChannelError(f"rank {self.rank}: the staged acknowledgement failed: {dead or e}") from None
        return int(t[0]) == 0

    # ---- buckets ---------------------------------------------------------------------------
    def digest_key(self, nonce: str) -> DigestKey:
        """The key a bucket's payload is digested under: from the channel key and the bucket's nonce."""
        return DigestKey.derive(self._key, nonce)

    def send_bucket(self, bucket: Bucket) -> None:
        raw = bucket.header_bytes()
        raw += hmac.digest(self._key, raw, "sha256")
        names = sorted(bucket.values)
        nidx = bucket.indices.numel()
        pre = bytearray(PREAMBLE_BYTES)  # sizes | the header's first bytes (the rest follows if longer)
        _SIZES.pack_into(pre, 0, len(raw), nidx, len(names))
        inline = min(len(raw), PREAMBLE_BYTES - _SIZES.size)
        pre[_SIZES.size:_SIZES.size + inline] = raw[:inline]
        self.broadcast(torch.frombuffer(pre, dtype=torch.uint8).to(self.device))
        if inline < len(raw):
            self.broadcast(torch.frombuffer(bytearray(raw[inline:]), dtype=torch.uint8).to(self.device))
        if nidx:
            self.broadcast(bucket.indices.to(self.device).contiguous())
        for k in names:
            self.broadcast_all([t.to(self.device).contiguous() for t in bucket.wire_parts(k)])

    def recv_bucket(self, arena_for: Callable[[dict], Arena | None] | None = None,
                    place: Callable[[dict], dict[int, torch.Tensor]] | None = None) -> Bucket:
        """The next bucket; its buffers are carved from ``arena_for(header)`` when that gives an arena.

        ``place(header)`` may name, per position of a ``seg`` entry, a contiguous tensor of that
        entry's dtype and count on this channel's device to receive its values into (they are then
        not in the bucket's value buffer: :attr:`Bucket.sources`)."""
        pre = bytes(self.broadcast(torch.empty(PREAMBLE_BYTES, dtype=torch.uint8, device=self.device)).cpu().numpy())
        hlen, nidx, nval = _SIZES.unpack_from(pre)
        if not (_MAC_BYTES < hlen <= MAX_HEADER_BYTES and 0 <= nidx <= MAX_BUFFER_ELEMENTS
                and 0 <= nval <= len(DTYPES)):
            raise ChannelError(f"rank {self.rank}: bucket sizes out of bounds (header {hlen} B of at most "
                               f"{MAX_HEADER_BYTES}, {nidx} indices, {nval} value buffers); nothing allocated")
        inline = min(hlen, PREAMBLE_BYTES - _SIZES.size)
        raw = pre[_SIZES.size:_SIZES.size + inline]
        if inline < hlen:
            raw += bytes(self.broadcast(torch.empty(hlen - inline, dtype=torch.uint8, device=self.device)).cpu().numpy())
        raw, tag = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if not hmac.compare_digest(tag, hmac.digest(self._key, raw, "sha256")):
            raise ChannelError(f"rank {self.rank}: a bucket header's MAC does not match the channel key "
                               "(not from this channel's sender)")
        header = parse_header(raw)
        key = self.digest_key(str(header.get("nonce", "")))
        counts = header["value_counts"]
        if len(counts) != nval:
            raise ChannelError(f"bucket {header['seq']}: header lists {len(counts)} value buffers, "
                               f"sender announced {nval}")
        for k in counts:
            if k not in DTYPES:
                raise ChannelError(f"bucket {header['seq']}: unknown dtype {k!r}")
            if not 0 <= int(counts[k]) <= MAX_BUFFER_ELEMENTS:
                raise ChannelError(f"bucket {header['seq']}: {k} buffer of {counts[k]} elements is out of bounds")
        names = sorted(counts)
        wants = [(torch.int32, nidx)] + [(DTYPES[k], int(counts[k])) for k in names]
        arena = arena_for(header) if arena_for is not None else None
        if arena is not None:
            bufs = arena.carve(wants)
        else:
            bufs = [torch.empty(n, dtype=dt, device=self.device) for dt, n in wants]
        segs = {k: value_segments(header["entries"], k, b.numel()) for k, b in zip(names, bufs[1:])}
        dests = place(header) if place is not None and any(i is not None for v in segs.values() for i, _, _ in v) \
            else {}
        for i, t in dests.items():
            e = header["entries"][i]
            if not (e.get("seg") and t.dtype == DTYPES[e["dtype"]] and t.numel() == int(e["count"])
                    and t.is_contiguous() and t.device == self.device):
                raise ChannelError(f"rank {self.rank}: the destination named for {e.get('name')!r} is "
                                   f"{tuple(t.shape)} {t.dtype} on {t.device}, the entry is {e.get('count')} "
                                   f"{e.get('dtype')} (a seg entry, contiguous, on {self.device})")
        bucket = Bucket(header, self.broadcast(bufs[0]) if nidx else bufs[0], dict(zip(names, bufs[1:])), dests,
                        key)
        for k in names:
            self.broadcast_all(bucket.wire_parts(k))
        return bucket


LOCAL = "local"


class LocalGroup:
    """The ranks of one channel that all live in this process, one thread each (backend ``local``).

    A broadcast works like gloo's asynchronous one: the source publishes its tensor (:meth:`publish`)
    and may issue more before it waits (:meth:`await_copies`) until every other rank copied each
    into its own tensor (any device; accelerator copies are synchronized before the source may
    reuse its buffer); the other ranks copy in order as the tensors appear (:meth:`receive`). So a
    bucket's many tensors cost the receiving thread one wake-up, not a round trip each. A rank that
    left before taking part, or one that does not arrive within the timeout, fails the broadcast
    on every rank waiting in it."""

    _groups: dict[str, "LocalGroup"] = {}
    _lock = threading.Lock()

    def __init__(self, world_size: int, timeout_s: float):
        self.world_size, self.timeout_s = world_size, timeout_s
        self.cv = threading.Condition()
        self.left: set[int] = set()
        self.gen = 0  # broadcasts published so far
        self.seen: dict[int, int] = {}  # joined rank -> broadcasts it copied
        self.payloads: dict[int, torch.Tensor] = {}  # broadcast -> the source's tensor, until copied
        self.copied: dict[int, int] = {}  # broadcast -> ranks that copied it
        self.failed: str | None = None  # a timeout or a mismatch: the group is unusable

    @classmethod
    def join(cls, namespace: str, rank: int, world_size: int, timeout_s: float) -> "LocalMember":
        with cls._lock:
            group = cls._groups.get(namespace)
            if group is None:
                group = cls._groups[namespace] = LocalGroup(world_size, timeout_s)
            if group.world_size != world_size:
                raise ChannelError(f"rank {rank}: in-process channel of {group.world_size} ranks, this rank "
                                   f"expects {world_size}")
            if rank in group.seen:
                raise ChannelError(f"rank {rank} is already taken in this channel (two engines with the "
                                   f"same rank offset?)")
            group.seen[rank] = 0
        return LocalMember(group, rank, namespace)

    def publish(self, tensor: torch.Tensor) -> int:
        """Source: offer ``tensor`` as the next broadcast; returns its number."""
        with self.cv:
            self.gen += 1
            self.payloads[self.gen], self.copied[self.gen] = tensor, 0
            self.cv.notify_all()
            return self.gen

    def await_copies(self, rank: int, gen: int) -> None:
        """Source: until every other rank copied broadcast ``gen`` (then its buffer is free)."""
        with self.cv:
            try:
                self._wait(lambda: self.copied[gen] == self.world_size - 1, rank, "every rank to copy",
                           lambda: [r for r in self.left if r != rank and self.seen.get(r, 0) < gen])
            finally:
                self.payloads.pop(gen, None)
                self.copied.pop(gen, None)

    def receive(self, rank: int, tensor: torch.Tensor, src: int) -> None:
        """Another rank: copy the next broadcast into ``tensor`` once the source published it."""
        with self.cv:
            want = self.seen[rank] + 1
            self._wait(lambda: self.gen >= want, rank, f"broadcast {want} from rank {src}",
                       lambda: [src] if src in self.left else [])
            payload = self.payloads[want]
        if payload.shape != tensor.shape or payload.dtype != tensor.dtype:
            with self.cv:
                self.failed = (f"rank {rank} expected {tuple(tensor.shape)} {tensor.dtype}, rank {src} sent "
                               f"{tuple(payload.shape)} {payload.dtype}")
                self.cv.notify_all()
            raise ChannelError(f"in-process channel: {self.failed}")
        tensor.copy_(payload)
        accelerator.synchronize(tensor.device)  # the source reuses its buffer once every copy is done
        accelerator.synchronize(payload.device)
        with self.cv:
            self.seen[rank] = want
            self.copied[want] = self.copied.get(want, 0) + 1  # gone if the source gave up on it
            self.cv.notify_all()

    def _wait(self, ready, rank: int, what: str, gone) -> None:
        """Under ``cv``: until ``ready()``; raises if the group failed or a rank in ``gone()`` left."""
        if not self.cv.wait_for(lambda: ready() or self.failed is not None or gone(), self.timeout_s):
            self.failed = f"rank {rank} waited {self.timeout_s:.0f} s for {what}"
            self.cv.notify_all()
        if self.failed is not None:
            raise ChannelError(f"in-process channel failed: {self.failed}")
        if not ready():
            raise ChannelError(f"in-process channel: rank(s) {gone()} closed their end before {what}")

    def leave(self, rank: int, namespace: str) -> None:
        with self.cv:
            self.left.add(rank)
            self.cv.notify_all()
        with LocalGroup._lock:  # forgotten once every rank left
            if len(self.left) == self.world_size and LocalGroup._groups.get(namespace) is self:
                del LocalGroup._groups[namespace]


class LocalMember:
    """One rank's handle on a :class:`LocalGroup`, shaped like the process group it stands for."""

    def __init__(self, group: LocalGroup, rank: int, namespace: str):
        self.group, self._rank, self._namespace = group, rank, namespace

    def name(self) -> str:
        return LOCAL

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.group.world_size

    def broadcast(self, tensors: list[torch.Tensor], opts) -> "_Done | _Copied":
        if self._rank == opts.rootRank:
            return _Copied(self.group, self._rank, self.group.publish(tensors[0]))
        self.group.receive(self._rank, tensors[0], opts.rootRank)
        return _Done()

    def shutdown(self) -> None:
        self.group.leave(self._rank, self._namespace)


class _Done:
    def wait(self) -> bool:
        return True


class _Copied:
    """The source's pending broadcast: ``wait`` returns once every other rank copied it."""

    def __init__(self, group: LocalGroup, rank: int, gen: int):
        self.group, self.rank, self.gen = group, rank, gen

    def wait(self) -> bool:
        self.group.await_copies(self.rank, self.gen)
        return True


#: rank 0's mark in the store that it gave the channel up before every rank joined (its reason)
_ABANDONED = "abandoned"


class PeerWatch:
    """Notices a dead peer of a device channel long before the process group's timeout.

    A collective with a dead NCCL/HCCL peer blocks until the group's timeout (300 s by default,
    after which the backend's watchdog may take the process down); gloo's fails as soon as the
    peer's connection drops. So every rank but 0 adds a beat to its counter in the channel's store
    every ``beat_s``, and rank 0 (which hosts the store) reads them: a rank whose counter stood
    still for ``bound_s`` is dead to rank 0, and a store that stops answering means rank 0 died.
    Either way the watch aborts the process group, so a blocked collective raises at once, and
    :attr:`dead` says who died (the channel's error names it). The channel is then unusable: the
    next update makes a new one. A peer whose host vanishes without closing its connections is
    noticed by rank 0 after ``bound_s``, by the others only at the store's own timeout."""

    def __init__(self, ns, rank: int, world_size: int, pg, bound_s: float | None = None,
                 beat_s: float = BEAT_S):
        self.ns, self.rank, self.world_size, self.pg = ns, rank, world_size, pg
        self.bound_s = PEER_TIMEOUT_S if bound_s is None else bound_s
        self.beat_s = beat_s
        #: why the group was aborted (a dead peer), or None
        self.dead: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delta_sync-peers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = {r: (-1, time.monotonic()) for r in range(1, self.world_size)}
        while not self._stop.wait(self.beat_s):
            try:
                if self.rank != 0:
                    self.ns.add(f"beat/{self.rank}", 1)
                    continue
                now = time.monotonic()
                for r, (count, since) in seen.items():
                    got = self.ns.add(f"beat/{r}", 0)
                    if got != count:
                        seen[r] = (got, now)
                    elif now - since > self.bound_s:
                        return self._abort(f"rank {r} sent no liveness beat for {self.bound_s:g} s (its process "
                                           "died or hangs); the channel was aborted")
            except Exception as e:  # noqa: BLE001 - the store's host (rank 0) is gone, or its connection broke
                if not self._stop.is_set():
                    return self._abort(f"the channel store on rank 0 stopped answering ({type(e).__name__}: "
                                       f"{e}): the sender died; the channel was aborted")

    def _abort(self, why: str) -> None:
        self.dead = why
        log.error("delta-sync channel rank %d: %s", self.rank, why)
        if not collectives.pg_abort(self.pg):
            log.error("delta-sync channel rank %d: the process group has no abort; collectives in flight "
                      "wait for its timeout", self.rank)

    def stop(self) -> None:
        self._stop.set()


def _await_claims(ns: PrefixStore, rank: int, world_size: int, timeout_s: float,
                  waiting: Callable[[], None] | None) -> None:
    """Every rank, before the process group's rendezvous: wait until every rank has claimed its
    own, or raise a :class:`ChannelError` naming the missing ranks after ``timeout_s``. Rank 0
    calls ``waiting`` in between; if it raises, rank 0 marks the channel abandoned in the store and
    raises that, and the ranks already waiting end with a :class:`ChannelError` at once rather than
    at their timeout."""
    keys = [f"claim/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not ns.check(keys):
        if time.monotonic() >= deadline:
            missing = [r for r in range(world_size) if not ns.check([f"claim/{r}"])]
            raise ChannelError(f"rank {rank}: rendezvous of {world_size} ranks timed out after {timeout_s:g} s: "
                               f"rank(s) {missing} never came to the channel store; check the token and "
                               "that every engine worker joined")
        if rank == 0 and waiting is not None:
            try:
                waiting()
            except BaseException as e:
                ns.set(_ABANDONED, f"{type(e).__name__}: {e}")
                raise
        elif rank != 0 and ns.check([_ABANDONED]):
            raise ChannelError(f"rank {rank}: the sender gave this channel up before every rank joined "
                               f"({ns.get(_ABANDONED).decode(errors='replace')})")
        time.sleep(0.005)


def _store(host: str, port: int, is_server: bool, timeout: datetime.timedelta,
           listener: socket.socket | None = None) -> TCPStore:
    """The rendezvous store; the server listens on ``host`` only (TCPStore alone binds every
    interface), on ``listener`` if given (see :func:`listen`)."""
    if not is_server:
        return TCPStore(host, port, None, False, timeout=timeout, use_libuv=True)
    sock = listener if listener is not None else listen(host, port)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store's server adopts the listening socket and closes it with itself
    return TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False,
                    master_listen_fd=fd, use_libuv=True)
