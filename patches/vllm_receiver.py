"""delta-sync's receiver on each vLLM worker: stage + validate on update, apply at finish.

It is not a vLLM weight-transfer engine: those are built and driven differently by each vLLM
generation (vLLM 0.23, which vLLM-Ascend 0.23.0.post1 builds on, constructs them from three
arguments and runs a layerwise reload around them; 0.25 and later from four, with the engine owning
start/finish). The receiver is created by the plugin on a worker's first signed
``delta_sync_call`` from what every worker class has (its ``vllm_config``, ``device`` and model),
and only that call drives it (``patches/vllm_plugin.py``).

Lifecycle (names match vLLM's wire protocol)::

    init_transfer_engine  join the channel (rank_offset + this worker's rank; the token derived
                          from the engine secret), refuse layouts that in-place patching would corrupt
    start_weight_update   check that no parameter's storage or strides changed since the views
                          were built
    update_weights        a delta: receive *all* buckets of version v, validate every patch (name,
                          shape, dtype, bounds, order, duplicates, finite values, checksum) and
                          stage it; nothing touches the weights yet. With ``background`` it does so
                          on a thread of its own (:class:`BackgroundReceive`) and the call returns
                          at once: the engine's steps go on meanwhile; ``staged`` and ``finish``
                          wait for it.
                          a seed or full update: check and apply each bucket as it arrives (the
                          next one is received meanwhile; each entry's digest and finiteness
                          checked in one pass), no undo copy: from the first write on, the worker
                          reports ``needs_seed`` until the version completes
    finish_weight_update  a delta: apply it, each position's old value read into the undo log in
                          the visit that writes the new one; on failure restore v-1 from the undo
                          log. a bulk update: take the version it completed

Every lifecycle call must arrive through the worker's signed ``delta_sync_call`` (see
``patches/vllm_plugin.py`` and :mod:`delta_sync.auth`); vLLM's own unsigned routes reach these
methods without the proof and are refused before anything changes.

Loader views are recorded at the first seed (the seed names every checkpoint tensor and its
shape). Names whose loader is not a plain strided copy go through vLLM's own loader instead:
``model.load_weights`` for dense, ``load_checkpoint_weight_patches`` for sparse.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

import torch

from delta_sync import accelerator
from delta_sync.auth import Verifier
from delta_sync.catalog import Catalog
from delta_sync.channel import Channel
from delta_sync.digest import digest_tensor, digest_texts
from delta_sync.errors import DeltaSyncError, LayoutNotSupported, NeedsSeed, PatchValidationError
from delta_sync.gc_hold import gc_held
from delta_sync.options import is_int
from delta_sync.patch import DTYPES, Patch
from delta_sync.transfer import BULK_KINDS, ReceivedUpdate, acknowledge, receive_update

from .bulk_apply import BulkWrite, covered
from .delta_apply import DeltaPlan, ParamTable, apply_delta, layout_of, plan_delta, routes_for
from .engine_options import EngineOptions
from .loader_views import LoaderView, probe_views, stage_routed, view_digests
from .receiver_guard import ReceiverGuard

log = logging.getLogger(__name__)


@dataclass
class DeltaSyncInitInfo:
    """What a signed ``init`` carries: where the channel's store listens and this engine's ranks."""
    host: str
    port: int
    world_size: int
    channel_nonce: str  # the channel token is derived from it and the engine secret
    rank_offset: int = 1
    backend: str | None = None
    timeout_s: float = 300.0

    def __post_init__(self):
        _require(isinstance(self.host, str) and self.host, f"host must be a non-empty string, got {self.host!r}")
        for key in ("port", "world_size", "rank_offset"):
            _require(is_int(getattr(self, key)), f"{key} must be an integer, got {getattr(self, key)!r}")
        _require(0 <= self.port < 65536, f"port {self.port} is outside 0..65535")
        _require(1 <= self.rank_offset < self.world_size,
                 f"rank_offset {self.rank_offset} must lie in 1..world_size-1 (world_size {self.world_size})")
        _require(isinstance(self.channel_nonce, str) and self.channel_nonce, "channel_nonce must be a non-empty string")
        _require(self.backend is None or isinstance(self.backend, str), f"backend {self.backend!r} is not a name")
        _require(isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
                 and self.timeout_s > 0, f"timeout_s must be a positive number, got {self.timeout_s!r}")


@dataclass
class DeltaSyncUpdateInfo:
    version: int | None = None  # if set, the version the sender announced out of band
    #: a delta received on a thread of the worker (:class:`BackgroundReceive`): the call returns at
    #: once and the engine keeps serving while the delta arrives; ``staged`` or ``finish`` waits for it
    background: bool = False

    def __post_init__(self):
        _require(self.version is None or (is_int(self.version) and self.version >= 0),
                 f"version must be a non-negative integer, got {self.version!r}")
        _require(isinstance(self.background, bool), f"background must be true or false, got {self.background!r}")


def _require(ok, why: str) -> None:
    if not ok:
        raise ValueError(why)


#: seconds ``discard`` waits for a background receive its sender gave up on (its abort bucket ends
#: it at once); one still running then is left to end by itself, its result dropped
DISCARD_WAIT_S = 2.0

#: seconds a new channel's ``init`` waits for a background receive still running on the old one
INIT_WAIT_S = 5.0

#: the digest ``report`` gives a name applied through vLLM's loader when a parameter the loader
#: writes changed behind the updates: no digest has it (every lane is below its prime, < 0x8000)
DRIFTED = "f" * 16


def _parse(cls, payload, what: str, kept: str):
    """``cls(**payload)``, or a :class:`DeltaSyncError` naming the keys that do not fit."""
    if not isinstance(payload, dict):
        raise DeltaSyncError(f"{what}: expected an object, got {type(payload).__name__}", kept=kept)
    try:
        return cls(**payload)
    except (TypeError, ValueError) as e:
        raise DeltaSyncError(f"{what}: {e}", kept=kept) from e


def check_layout_supported(vllm_config, model: torch.nn.Module, device: torch.device) -> None:
    """Refuse settings under which checkpoint-layout writes would be wrong, naming the fix."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if getattr(mc, "quantization", None):
        raise LayoutNotSupported(f"quantized weights (quantization={mc.quantization!r}) cannot be patched "
                                 "in checkpoint coordinates; serve the unquantized checkpoint")
    if pc.pipeline_parallel_size > 1:
        raise LayoutNotSupported(f"pipeline_parallel_size={pc.pipeline_parallel_size}: delta-sync receivers "
                                 "need pipeline_parallel_size=1 (use TP/DP for the engine)")
    if getattr(pc, "enable_eplb", False):
        raise LayoutNotSupported("dynamic EPLB moves experts between ranks at run time: set enable_eplb=False")
    for mname, module in model.named_modules():
        for shadow in ("weight_fp32", "w13_weight_list", "w2_weight_list"):
            if getattr(module, shadow, None) is not None:
                raise LayoutNotSupported(f"{mname}.{shadow} is a second copy of the weights that a patch would "
                                         "not update; disable the setting that creates it (precast_fp32_weight / "
                                         "enable_fused_mc2 on Ascend)")
    for pname, p in model.named_parameters():
        if p.numel() == 0 and device.type == "cpu":
            raise LayoutNotSupported(f"{pname} is empty: the CPU kernels repacked it. Start the engine with "
                                     "additional_config {\"delta_sync\": true} (or DELTA_SYNC_ENGINE=1) so the "
                                     "checkpoint-layout mode is active from load time")
    if device.type == "npu":
        from .vllm_ascend import check_ascend_layout

        check_ascend_layout(vllm_config, model)


class BackgroundReceive:
    """A delta received on a thread of the worker while the engine keeps serving (``update`` with
    ``background``): the worker's main thread, which runs the engine's steps, is not held by the
    receive, the checks or the plan; nothing is written before ``finish``, as for a delta received
    in the call. :meth:`wait` (``staged``, ``finish``) returns once it is staged, or raises what failed it.

    Host channels only (gloo, in process): on a device channel (NCCL, HCCL) the worker receives in
    the call as before. A broadcast issued from a second thread would be enqueued beside the
    model's own collectives on other communicators in an order that differs from rank to rank, which
    NCCL and HCCL may deadlock on; not tried on hardware yet."""

    def __init__(self, receiver: "DeltaSyncReceiver", info: DeltaSyncUpdateInfo):
        self.version = info.version
        self.error: BaseException | None = None
        #: discarded while it ran: what it stages is dropped when it ends, and nobody waits for it
        self.abandoned = False
        self._done = threading.Event()
        receiver.channel.received_whole = receiver.channel.received_abort = None
        self._thread = threading.Thread(target=self._run, args=(receiver, info), name="delta_sync-receive",
                                        daemon=True)
        self._thread.start()

    def _run(self, receiver: "DeltaSyncReceiver", info: DeltaSyncUpdateInfo) -> None:
        channel = receiver.channel
        try:
            with gc_held():
                accelerator.use_device(receiver.device)  # (the current device is per thread)
                receiver.receive_weights(info)
                accelerator.synchronize(receiver.device)
        except BaseException as e:  # noqa: BLE001 - raised where the trainer waits for it
            self.error = e
        finally:
            # staged (or refused): the sender learns it on the channel before it pauses the engine
            self.error = acknowledge(channel, self.error)
            if self.abandoned:
                receiver._staged, receiver._plan = None, None
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the receive to end; whether it did."""
        return self._done.wait(timeout_s)


class DeltaSyncReceiver:
    """One worker's receiver: it runs the lifecycle (module doc) and keeps the worker's version,
    loader views and staged update. Who may call it is the :class:`ReceiverGuard`'s; a seed's
    writes are :class:`~patches.bulk_apply.BulkWrite`'s, a delta's apply is
    :func:`~patches.delta_apply.apply_delta`'s. Built from the worker's own ``vllm_config``,
    ``device`` and model."""

    def __init__(self, vllm_config, device: torch.device, model: torch.nn.Module, verifier: Verifier | None = None):
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.device = torch.device(device)
        self.model = model
        self.channel: Channel | None = None
        self.version: int | None = None
        self.needs_seed = False
        self.views: dict[str, LoaderView] = {}
        self.fallback: dict[str, str] = {}  # name -> why it has no view
        #: checkpoint value of every name without a view, as handed to vLLM's loader (its digest
        #: is what ``report`` can say for it: the loader's result cannot be read back)
        self.fallback_values: dict[str, torch.Tensor] = {}
        #: digest of every parameter that loader views do not cover whole (what vLLM's loader writes
        #: for the names above), read from the parameter after the last update: drift there is
        #: caught against these, since those names' own digests come from the kept values
        self.loader_params: dict[str, str] = {}
        self.shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        #: the received, not yet applied update, or None
        self._staged: ReceivedUpdate | None = None
        #: a delta still arriving on a thread of its own (``update`` with ``background``), or None
        self._background: BackgroundReceive | None = None
        #: how long ``staged``/``finish`` wait for it: the channel's timeout, and then some
        self._receive_bound_s = 330.0
        self._plan: DeltaPlan | None = None  # a staged delta's writes, planned on receipt
        #: the last applied delta and its plan, freed at the next update, not inside the pause
        self._retired: tuple | None = None
        self.param_table = ParamTable(model)
        self.routes, self.routes_key = None, None  # where a delta's table entries land (delta_apply)
        self._catalog_checked: str | None = None  # the catalogue whose names were checked against shapes
        #: the catalogue of the last whole bulk update (what the channel numbers by), kept for a new channel
        self._numbering = None
        self._bulk = BulkWrite(self)
        self._fingerprint: dict | None = None
        #: the parameters and their layout as ``start`` found them (a delta's plan starts from them)
        self._at_start: tuple[dict, dict] | None = None
        self.last_timings: dict[str, float] = {}
        self.last_error: str | None = None
        #: a seed/full update wrote some weights and did not complete: serving them would be wrong
        self.partial = False
        self.guard = ReceiverGuard(self.kept, verifier)
        #: where a received delta waits for finish (DELTA_SYNC_DELTA_STAGING): on a device engine
        #: the host, unless the operator keeps it on the device
        options = EngineOptions.from_env()
        self.stage = options.stage
        #: MoE weights transposed after loading: vLLM-Ascend's layout (or its CPU stand-in)
        self._transposed_moe = self.device.type == "npu" or options.cpu_moe_transposed
        #: loader probes run on the receive thread (for in-place receives) and on the applying one
        self._probe_lock = threading.Lock()

    # ---- identity ------------------------------------------------------------------------------
    def _worker_rank(self) -> int:
        pc = self.parallel_config
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - no TP group initialised (uni executor without distributed init)
            tp_rank = 0
        return getattr(pc, "data_parallel_index", 0) * pc.tensor_parallel_size + tp_rank

    def holds_whole_tensors(self) -> bool:
        """Does this worker hold every checkpoint tensor whole (no TP or expert sharding)?"""
        pc = self.parallel_config
        return pc.tensor_parallel_size == 1 and not getattr(pc, "enable_expert_parallel", False)

    def kept(self) -> str:
        """What this worker keeps, for an error message."""
        return "engine weights at version " + ("none (needs a seed)" if self.version is None else f"v{self.version}")

    # ---- lifecycle -----------------------------------------------------------------------------
    def parse_init_info(self, payload: dict) -> DeltaSyncInitInfo:
        return _parse(DeltaSyncInitInfo, payload, "init", self.kept())

    def parse_update_info(self, payload: dict) -> DeltaSyncUpdateInfo:
        return _parse(DeltaSyncUpdateInfo, payload, "update", self.kept())

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo) -> None:
        self.guard.require("init")
        check_layout_supported(self.vllm_config, self.model, self.device)
        token = self.guard.verifier.channel_token(init_info.channel_nonce)
        self.settle_receive("init", INIT_WAIT_S)  # (a crashed sender's receive fails as its channel does)
        self.discard_staged(wait_s=0)
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        rank = init_info.rank_offset + self._worker_rank()
        device = self.device if self.device.type != "cpu" else torch.device("cpu")
        self.channel = Channel.connect(init_info.host, init_info.port, rank, init_info.world_size, token,
                                       backend=init_info.backend, device=device, timeout_s=init_info.timeout_s)
        self.channel.catalog = self._numbering  # a trainer that knows it numbers by it too (see report)
        self._receive_bound_s = init_info.timeout_s + 30.0  # the channel fails a receive after timeout_s

    def start_weight_update(self) -> None:
        self.guard.require("start")
        self.discard_staged()
        self._at_start = None
        params = self.param_table.params_of(self.model) if self._fingerprint is not None else None
        now = layout_of(params) if params is not None else None
        if now is not None and self._fingerprint != now:
            self.param_table = ParamTable(self.model)
            changed = [n for n, f in now.items() if self._fingerprint.get(n) != f]
            self.views.clear()
            self._fingerprint = None
            self.version = None
            self.needs_seed = True
            raise NeedsSeed(f"parameter storage or layout changed since the loader views were built "
                            f"({', '.join(changed[:3])}...); the next update must be a full seed",
                            kept="weights as they are, version unknown")
        # (a delta's plan, made as its last bucket arrives, starts from what start found: the apply
        # compares the layout again, so a parameter moved since then has its writes planned anew)
        self._at_start = (params, now) if now is not None else None

    def update_weights(self, update_info) -> None:
        self.guard.require("update")
        info = self.parse_update_info(update_info or {})
        self._require_no_receive("update")
        if self.channel is None:
            raise DeltaSyncError("init_transfer_engine was not called", kept=self.kept())
        if self.channel.pg is None:
            raise DeltaSyncError("this worker's channel was closed (a delta's receive failed before its last "
                                 f"bucket: {self.last_error}); the trainer must join a new one (init)", kept=self.kept())
        self.last_timings = {}  # this update's (a background receive adds its own when it ends)
        if info.background and self.channel.receives_in_background:
            self._staged, self._plan = None, None
            self._background = BackgroundReceive(self, info)
            return
        # (a device channel receives in the call: its broadcast on a thread of its own would run beside
        # the model's own NCCL/HCCL collectives, whose order across ranks nothing then fixes)
        self.receive_weights(info)
        accelerator.synchronize(self.device)

    def settle_receive(self, what: str, wait_s: float) -> None:
        """Wait at most ``wait_s`` for a background receive to end; refuse ``what`` (nothing changed)
        while it still runs."""
        if self._background is not None:
            self._background.wait(wait_s)
        self._require_no_receive(what)

    def _require_no_receive(self, what: str) -> None:
        """Refuse ``what`` while a background receive is still running on this worker's channel."""
        if self._background is not None and not self._background.done():
            raise DeltaSyncError(f"{what}: a delta (v{self._background.version}) is still being received on this "
                                 "worker's channel; its sender must finish or abort it first (it ends by itself "
                                 "when the channel fails or times out)", kept=self.kept())

    def await_receive(self, timeout_s: float | None = None) -> None:
        """Wait for a background receive to end (it was staged, or its error is raised here); at
        most ``timeout_s`` (default: the channel's timeout and then some)."""
        bg = self._background
        if bg is None:
            return
        if bg.abandoned:  # discarded: nothing of it counts, and nobody waits for it
            if bg.done():
                self._background = None
            raise DeltaSyncError(f"the delta v{bg.version} received in the background was discarded before it "
                                 "ended; nothing was staged", kept=self.kept())
        t0 = time.perf_counter()
        bound = self._receive_bound_s if timeout_s is None else timeout_s
        if not bg.wait(bound):
            raise DeltaSyncError(f"the delta v{bg.version} received in the background did not end within "
                                 f"{bound:.0f} s; nothing was staged", kept=self.kept())
        self._background = None
        self.last_timings["receive_wait_s"] = time.perf_counter() - t0
        if bg.error is not None:
            self._staged, self._plan = None, None
            raise bg.error

    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        if self.channel is None:
            raise DeltaSyncError("init_transfer_engine was not called", kept=self.kept())
        t0 = time.perf_counter()
        self._staged, self._plan, self._retired = None, None, None
        at_start, self._at_start = self._at_start, None  # (a bulk update holds no parameter past its receive)
        self._bulk = BulkWrite(self)
        # a background receive takes a delta only: a bulk update writes as it arrives, under a pause
        bulk = self._bulk if not update_info.background else None
        try:
            upd = receive_update(self.channel, kept=self.kept(),
                                 bulk_sink=bulk.apply_bucket if bulk is not None else self._refuse_bulk,
                                 sink_checks=True, dense_sink=self._bulk.apply_table,
                                 place=bulk.place if bulk is not None and self._in_place() else None, tables=True,
                                 stage=torch.device("cpu") if self.stage == "host" else None,  # (no copy on a host)
                                 stage_table=self._stage_table if self.stage == "host" else None)
            if update_info.version is not None and upd.version != update_info.version:
                raise DeltaSyncError(f"received version {upd.version}, the sender announced {update_info.version}",
                                     kept=self.kept())
            if upd.kind in BULK_KINDS:
                self._bulk.check_complete(upd, self.kept())
            else:
                self._check_delta(upd)
                plan = plan_delta(self, upd.patches, upd.version, upd.tables, at_start=at_start)
        except Exception as e:
            self.last_error = str(e)
            if isinstance(e, NeedsSeed):  # e.g. a delta numbered by a catalogue this engine lacks: ask for a seed
                self.needs_seed = True
            raise
        finally:
            self._numbering = self.channel.numbering  # (a bulk update whose receive failed leaves none)
        self.last_timings.update({"receive_s": time.perf_counter() - t0, "peak_buckets": float(upd.peak_buckets),
                                  "bulk_apply_s": self._bulk.apply_s, "placed_ranges": float(self._bulk.placed),
                                  "tabled": float(sum(ids.numel() for ids in self._bulk.tabled)),
                                  "check_s": upd.check_s})
        if upd.kind not in BULK_KINDS:
            self._plan = plan
            self.last_timings["plan_s"] = plan.plan_s
        self._staged = upd

    def _refuse_bulk(self, entries) -> None:
        self.needs_seed = True  # nothing was written, but the channel numbers the tensors by this update now
        raise NeedsSeed("a seed or full update arrived in a background receive, which takes deltas only (a bulk "
                        "update is written as it arrives, under a pause); nothing was written, and the next "
                        "update must be a seed sent in the call", kept=self.kept())

    def _stage_table(self, table):
        """A checked delta table kept in host memory until the pause, the positions of its entries
        in this worker's parameters worked out on the device first (:func:`stage_routed`). Where
        that fails (no device memory for a chunk, say) the table is staged as it is and the plan
        works its positions out on the host: slower, the same writes, and a plan that does not fit
        is refused there with its reason."""
        host = torch.device("cpu")
        if table.indices.device.type == "cpu":
            return table
        try:
            with torch.no_grad():
                return stage_routed(routes_for(self, table.catalog), table, host)
        except Exception as e:  # noqa: BLE001 - staged without its positions; the plan decides
            log.warning("delta-sync: %s: positions not worked out on the device (%s: %s); the plan works them "
                        "out on the host", table.where, type(e).__name__, e)
            return table.staged(host)

    def _check_delta(self, upd: ReceivedUpdate) -> None:
        """A received delta follows this worker's version and names only seeded tensors as seeded."""
        if self.version is None or self.needs_seed:
            raise NeedsSeed(f"delta v{upd.version} arrived but this engine has no base version", kept=self.kept())
        if upd.version != self.version + 1:  # a repeat, a regression, or another trainer's delta
            raise DeltaSyncError(f"delta v{upd.version} does not follow this engine's v{self.version}; "
                                 "it was built on another base and was not staged", kept=self.kept())
        for p in upd.patches:
            self._validate(p)
        if upd.tables:
            self.check_catalog(upd.tables[0].catalog)

    def check_catalog(self, catalog) -> None:
        """The tensors a catalogue numbers are the ones seeded here, as seeded (once per catalogue)."""
        if self._catalog_checked == catalog.fingerprint:
            return
        for name, shape, dname in zip(catalog.names, catalog.shapes, catalog.dtypes):
            known = self.shapes.get(name)
            if known is None or known != (shape, DTYPES[dname]):
                raise NeedsSeed(f"{name}: the channel's catalogue has it as {shape} {dname}, this engine "
                                f"{'never seeded it' if known is None else f'seeded {known}'}", kept=self.kept())
        self._catalog_checked = catalog.fingerprint

    def _in_place(self) -> bool:
        """Can large bulk ranges be received straight into the parameters? Where a worker holds
        whole tensors (TP=1) and the loader's layout is the parameters' own (not on Ascend, whose
        MoE weights are transposed around each loader call)."""
        return self.holds_whole_tensors() and not self._transposed_moe

    def probe(self, names_shapes: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Loader views of the names not seen before, found in one probe of vLLM's loader."""
        with self._probe_lock:
            new = {n: (n, shape, dtype) for n, shape, dtype in names_shapes
                   if n not in self.views and n not in self.fallback}
            if not new:
                return
            with self.loader_layout():
                views, unsupported = probe_views(self.model, list(new.values()), whole=self.holds_whole_tensors())
            self.views.update(views)
            self.fallback.update(unsupported)
        for name, why in unsupported.items():
            log.warning("delta-sync: %s has no loader view (%s); it uses vLLM's loader", name, why)

    def _validate(self, p: Patch) -> None:
        known = self.shapes.get(p.name)
        if known is None:
            raise PatchValidationError(p.name, "unknown checkpoint name (never seeded on this engine)",
                                       kept=self.kept())
        if (p.shape, p.dtype) == known:
            return  # the rest was checked per bucket as it arrived (entries, bounds, order, finiteness)
        p.validate(expected_shape=known[0], expected_dtype=known[1], contents=False, kept=self.kept())

    def discard_staged(self, wait_s: float = DISCARD_WAIT_S) -> None:
        """Drop a received, not yet applied delta (nothing was written). One still arriving in the
        background is waited for at most ``wait_s`` (its sender's abort ends it at once); one that
        outlasts that is abandoned: it runs on, nobody waits for it (a later ``finish`` refuses naming
        it), ``update`` and ``init`` refuse while it runs, and what it stages is dropped."""
        bg = self._background
        if bg is not None:
            if bg.wait(wait_s):
                self._background = None  # its delta or its error: dropped
            else:
                bg.abandoned = True
        self._staged, self._plan = None, None

    def finish_weight_update(self) -> None:
        self.guard.require("finish")
        self.await_receive()
        version = self.guard.call_version
        upd, self._staged = self._staged, None
        plan, self._plan = self._plan, None
        if upd is None:
            return  # start/finish with nothing received (e.g. the sender aborted before sending)
        if version is not None and upd.version != version:
            self.last_error = f"finish of v{version} but v{upd.version} is staged"
            raise DeltaSyncError(self.last_error + "; the staged update was discarded", kept=self.kept())
        if upd.kind not in BULK_KINDS:  # a bulk update was applied while it arrived, and is complete
            self.last_timings.update(apply_delta(self, plan))
        self.version, self.needs_seed, self.last_error = upd.version, False, None
        self.partial = False
        # the layout the writes went to; vLLM's loader (the fallback path, a bulk update) may move storage
        moved = plan is None or plan.slow or self.last_timings.get("replanned")
        loaded = bool(self.fallback) and not self.fallback.keys().isdisjoint(self._bulk.done)  # by vLLM's loader
        self._fingerprint = self._layout_now(anew=loaded) if moved else plan.layout
        self._retired = (upd, plan)
        self._record_loader_params()

    def _layout_now(self, anew: bool = False) -> dict[str, tuple]:
        """The parameters' layout after writes that may have moved storage; the parameter table is
        made again where it did move, or ``anew`` (names went through vLLM's loader, which may
        replace what holds them). A new table makes every catalogue's routes again: ~0.1 s per
        18,867 tensors, which a bulk update written through the views alone never needs."""
        now = None if anew else layout_of(self.param_table.params_of(self.model))  # (walked anew where a module moved)
        if now is None or now != self._fingerprint:
            self.param_table = ParamTable(self.model)
            now = layout_of(self.param_table.params())
        return now

    def loader_layout(self):
        """The parameter layout vLLM's loader expects: on Ascend, MoE weights transposed back."""
        from .vllm_ascend import loader_layout

        return loader_layout(self.model, self._transposed_moe)

    # ---- drift of what vLLM's loader wrote -----------------------------------------------------
    def _loader_param_digests(self) -> dict[str, str]:
        """Digest of every parameter the loader views do not cover whole (none without names that
        went through vLLM's loader: then nothing is read)."""
        if not self.fallback_values:
            return {}
        params = self.param_table.params_of(self.model)
        written = covered(self.views.values())
        return {n: digest_tensor(p.detach()).hex() for n, p in sorted(params.items())
                if written.get(n, 0) < p.numel()}

    def _record_loader_params(self) -> None:
        self.loader_params = self._loader_param_digests()

    def _loader_drift(self) -> list[str]:
        """The parameters written through vLLM's loader that changed since the last update."""
        if not self.loader_params:
            return []
        now = self._loader_param_digests()
        return [n for n, d in self.loader_params.items() if now.get(n) != d]

    # ---- reporting -----------------------------------------------------------------------------
    def status(self) -> dict:
        """What anyone may read (the pause lease asks it): version, whether a seed is needed, and
        whether a cut-off seed/full update left half-written weights."""
        return {"version": self.version, "needs_seed": self.needs_seed or self.version is None,
                "partial": self.partial}

    def report(self, digests: bool = False, names: list[str] | None = None) -> dict:
        out = {**self.status(), "rank": self.channel.rank if self.channel else None, "views": len(self.views),
               "fallback": sorted(self.fallback), "last_error": self.last_error,
               "timings": dict(self.last_timings), "catalog": self._fingerprint_of_numbering()}
        if digests:
            t0 = time.perf_counter()
            params = self.param_table.params_of(self.model)
            d = {}
            wanted = names or sorted(set(self.views) | set(self.fallback_values))
            drift = self._loader_drift() if any(n in self.fallback_values for n in wanted) else []
            if drift:  # what the loader wrote changed behind the updates: no kept value vouches for it
                out["loader_drift"] = drift
            viewed = [name for name in wanted if name in self.views]
            table, counts = view_digests([self.views[n] for n in viewed], params)
            for name, text, count in zip(viewed, digest_texts(table), counts):
                d[name] = [text, count, math.prod(self.views[name].shape)]
            for name in wanted:
                if name not in self.views and name in self.fallback_values:  # what vLLM's loader was given
                    held = self.fallback_values[name]
                    d[name] = [DRIFTED if drift else digest_tensor(held).hex(), held.numel(), held.numel()]
            out["digests"] = d
            out["digest_s"] = time.perf_counter() - t0
        return out

    def _fingerprint_of_numbering(self) -> str | None:
        """The fingerprint of the catalogue a new channel of this worker starts from (numbered once)."""
        if self._numbering is not None and not isinstance(self._numbering, Catalog):
            self._numbering = self._numbering.build()
        return self._numbering.fingerprint if self._numbering is not None else None

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
