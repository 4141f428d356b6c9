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
                          stage it; nothing touches the weights yet.
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

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from delta_sync import accelerator
from delta_sync.auth import AuthError, Verifier, load_secret
from delta_sync.channel import Channel
from delta_sync.bucket import check_dense_entry
from delta_sync.digest import digest_tensor, scan_many, scan_range
from delta_sync.errors import DeltaSyncError, EngineClaimed, LayoutNotSupported, NeedsSeed, PatchValidationError
from delta_sync.patch import DTYPES, Patch, apply_patch
from delta_sync.transfer import BULK_KINDS, ReceivedUpdate, receive_update

from .loader_views import (LoaderView, UndoLog, apply_dense, apply_dense_range, apply_dense_range_scanned,
                           apply_sparse_many, dense_range_target, digest_view,
                           probe_views)

from . import vllm_compat

log = logging.getLogger(__name__)

#: seconds of silence after which a trainer's claim on this engine lapses (a crashed trainer's
#: successor waits at most this long); 0 turns claims off
CLAIM_ENV = "DELTA_SYNC_CLAIM_S"
DEFAULT_CLAIM_S = 60.0


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


@dataclass
class DeltaSyncUpdateInfo:
    version: int | None = None  # if set, the version the sender announced out of band


#: the digest ``report`` gives a name applied through vLLM's loader when a parameter the loader
#: writes changed behind the updates: no digest has it (every lane is below its prime, < 0x8000)
DRIFTED = "f" * 16


def _covered(views) -> dict[str, int]:
    """Per parameter, how many of its elements the segments of ``views`` write."""
    out: dict[str, int] = {}
    for view in views:
        for seg in view.segments:
            out[seg.param] = out.get(seg.param, 0) + seg.numel
    return out


def _parse(cls, payload, what: str, kept: str):
    """``cls(**payload)``, or a :class:`DeltaSyncError` naming the keys that do not fit."""
    if not isinstance(payload, dict):
        raise DeltaSyncError(f"{what}: expected an object, got {type(payload).__name__}", kept=kept)
    try:
        return cls(**payload)
    except TypeError as e:
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


def _fingerprint(model: torch.nn.Module) -> dict[str, tuple]:
    return {n: (p.data_ptr(), tuple(p.stride()), tuple(p.shape), p.dtype) for n, p in model.named_parameters()}


class _BulkState:
    """What one seed/full update has written so far on this worker."""

    def __init__(self):
        self.writing = False
        self.done: dict[str, int] = {}  # name -> elements written, ranges arrive in order
        self.numel: dict[str, int] = {}
        self.pending: dict[str, list[torch.Tensor]] = {}  # fallback names: ranges until complete
        self.apply_s = 0.0
        self.placed = 0  # ranges received straight into the parameters
        self._params = None

    def params(self, model) -> dict[str, torch.Tensor]:
        if self._params is None:
            self._params = dict(model.named_parameters())
        return self._params

    def advance(self, name: str, start: int, count: int, numel: int) -> None:
        have = self.done.get(name, 0)
        if start != have:
            raise PatchValidationError(name, f"dense range starts at {start}, expected {have}", kept="needs_seed")
        self.done[name] = have + count
        self.numel[name] = numel

    def check_complete(self, upd, shapes: dict, kept: str) -> None:
        short = [n for n, k in self.done.items() if k != self.numel[n]]
        if short:
            raise PatchValidationError(short[0], f"{upd.kind} v{upd.version} ended with {self.done[short[0]]} of "
                                       f"{self.numel[short[0]]} elements written", kept=kept)
        missing = sorted(set(shapes) - set(self.done))
        if missing:
            raise PatchValidationError(missing[0], f"{upd.kind} v{upd.version} left out {len(missing)} seeded "
                                       f"tensor(s); they would keep stale values", kept=kept)


class DeltaSyncReceiver:
    """One worker's receiver: loader views, the staged update with its undo log, digests, the
    trainer's claim. Built from the worker's own ``vllm_config``, ``device`` and model."""

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
        self._fingerprint: dict | None = None
        self.last_timings: dict[str, float] = {}
        self.last_error: str | None = None
        #: a seed/full update wrote some weights and did not complete: serving them would be wrong
        self.partial = False
        #: checks signed calls (refuses every call without a secret); the plugin hands the worker's
        self.verifier = verifier if verifier is not None else Verifier(load_secret(required=False))
        #: the trainer session that syncs this engine and when it last called; another session is
        #: refused until this one releases it or stays silent for claim_s (0: no claims)
        self.claimed: tuple[str, float] | None = None
        self.claim_s = float(os.environ.get(CLAIM_ENV, DEFAULT_CLAIM_S))
        self._authorized = False
        self._call_version: int | None = None
        #: loader probes run on the receive thread (for in-place receives) and on the applying one
        self._probe_lock = threading.Lock()

    # ---- trust ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def authorized(self, version: int | None = None):
        """The scope of one verified ``delta_sync_call``: only inside it do lifecycle calls run
        (``version``: what a signed finish names, checked against the staged update)."""
        self._authorized, self._call_version = True, version
        try:
            yield
        finally:
            self._authorized, self._call_version = False, None

    def claim(self, method: str, session: str) -> bool:
        """One trainer per engine: a verified call from ``session`` is refused with
        :class:`EngineClaimed` while another session holds the engine (it called within
        ``claim_s`` and did not release); otherwise ``session`` holds it from now on. Returns False
        for a ``release``, which ends the claim and needs nothing else."""
        now = time.monotonic()
        if self.claimed is not None and self.claimed[0] != session and self.claim_s > 0:
            idle = now - self.claimed[1]
            if idle < self.claim_s:
                raise EngineClaimed(
                    f"{method}: another trainer syncs this engine (session {self.claimed[0][:8]}, last call "
                    f"{idle:.0f} s ago); a second one is refused until it closes its WeightSync or stays "
                    f"silent for {self.claim_s:.0f} s ({CLAIM_ENV}), i.e. in {self.claim_s - idle:.0f} s",
                    kept=self._kept() + "; the other trainer's channel and staged update are unchanged")
        if method == "release":
            if self.claimed is not None and self.claimed[0] == session:
                self.claimed = None
            return False
        self.claimed = (session, now)
        return True

    def require_authorized(self, what: str) -> None:
        if not self._authorized:
            raise AuthError(f"{what}: unsigned weight-transfer call refused (delta-sync engines accept them "
                            f"only through the signed delta_sync_call)",
                            kept=self._kept() + "; the trainer's channel and staged update are unchanged")

    # ---- identity ------------------------------------------------------------------------------
    def _worker_rank(self) -> int:
        pc = self.parallel_config
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - no TP group initialised (uni executor without distributed init)
            tp_rank = 0
        return getattr(pc, "data_parallel_index", 0) * pc.tensor_parallel_size + tp_rank

    def _whole(self) -> bool:
        """Does this worker hold every checkpoint tensor whole (no TP or expert sharding)?"""
        pc = self.parallel_config
        return pc.tensor_parallel_size == 1 and not getattr(pc, "enable_expert_parallel", False)

    def _kept(self) -> str:
        return "engine weights at version " + ("none (needs a seed)" if self.version is None else f"v{self.version}")

    # ---- lifecycle -----------------------------------------------------------------------------
    def parse_init_info(self, payload: dict) -> DeltaSyncInitInfo:
        return _parse(DeltaSyncInitInfo, payload, "init", self._kept())

    def parse_update_info(self, payload: dict) -> DeltaSyncUpdateInfo:
        return _parse(DeltaSyncUpdateInfo, payload, "update", self._kept())

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo) -> None:
        self.require_authorized("init")
        check_layout_supported(self.vllm_config, self.model, self.device)
        token = self.verifier.channel_token(init_info.channel_nonce)
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.discard_staged()
        rank = init_info.rank_offset + self._worker_rank()
        device = self.device if self.device.type != "cpu" else torch.device("cpu")
        self.channel = Channel.connect(init_info.host, init_info.port, rank, init_info.world_size, token,
                                       backend=init_info.backend, device=device, timeout_s=init_info.timeout_s)

    def start_weight_update(self) -> None:
        self.require_authorized("start")
        self.discard_staged()
        if self._fingerprint is not None and self._fingerprint != _fingerprint(self.model):
            changed = [n for n, f in _fingerprint(self.model).items() if self._fingerprint.get(n) != f]
            self.views.clear()
            self._fingerprint = None
            self.version = None
            self.needs_seed = True
            raise NeedsSeed(f"parameter storage or layout changed since the loader views were built "
                            f"({', '.join(changed[:3])}...); the next update must be a full seed",
                            kept="weights as they are, version unknown")

    def update_weights(self, update_info) -> None:
        self.require_authorized("update")
        self.receive_weights(self.parse_update_info(update_info or {}))
        accelerator.synchronize(self.device)

    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        if self.channel is None:
            raise DeltaSyncError("init_transfer_engine was not called", kept=self._kept())
        t0 = time.perf_counter()
        self._staged = None
        self._bulk = _BulkState()
        try:
            upd = receive_update(self.channel, kept=self._kept(), bulk_sink=self._apply_bulk_bucket, sink_checks=True,
                                 place=self._place_bulk if self._in_place() else None)
            if update_info.version is not None and upd.version != update_info.version:
                raise DeltaSyncError(f"received version {upd.version}, the sender announced {update_info.version}",
                                     kept=self._kept())
            if upd.kind in BULK_KINDS:
                self._bulk.check_complete(upd, self.shapes, self._kept())
                self._check_every_parameter_written(upd)
            else:
                if self.version is None or self.needs_seed:
                    raise NeedsSeed(f"delta v{upd.version} arrived but this engine has no base version",
                                    kept=self._kept())
                if upd.version != self.version + 1:  # a repeat, a regression, or another trainer's delta
                    raise DeltaSyncError(f"delta v{upd.version} does not follow this engine's v{self.version}; "
                                         "it was built on another base and was not staged", kept=self._kept())
                for p in upd.patches:
                    self._validate(p, seed=False)
        except Exception as e:
            self.last_error = str(e)
            raise
        self.last_timings = {"receive_s": time.perf_counter() - t0, "peak_buckets": float(upd.peak_buckets),
                             "bulk_apply_s": self._bulk.apply_s, "placed_ranges": float(self._bulk.placed),
                             "check_s": upd.check_s}
        self._staged = upd

    def _check_every_parameter_written(self, upd) -> None:
        """A seed/full update must write every element of every parameter this worker holds (through
        the loader views of the names it sent); an element it left out would keep the value this
        engine loaded at start, and every digest of the names sent would still agree. Names that went
        through vLLM's own loader write where that decides: with one of those in the update, the
        parameters are not counted against it."""
        if any(name in self.fallback for name in self._bulk.done):
            return
        written = _covered(self.views[name] for name in self._bulk.done)
        short = [(pname, written.get(pname, 0), p.numel()) for pname, p in self._bulk.params(self.model).items()
                 if p.numel() and written.get(pname, 0) < p.numel()]
        if short:
            pname, got, want = short[0]
            others = ", ".join(n for n, _, _ in short[1:4]) + (", ..." if len(short) > 4 else "")
            raise PatchValidationError(
                pname, f"{upd.kind} v{upd.version} wrote {got} of this parameter's {want} elements"
                f"{f' ({len(short) - 1} more parameter(s) short: {others})' if len(short) > 1 else ''}: the rest "
                "would keep the values the engine loaded at start. A seed must carry every tensor the model "
                "loads", kept="engine paused with partially written weights; needs_seed: the next update must be a "
                "full seed")

    def _in_place(self) -> bool:
        """Can large bulk ranges be received straight into the parameters? Where a worker holds
        whole tensors (TP=1) and the loader's layout is the parameters' own (not on Ascend, whose
        MoE weights are transposed around each loader call)."""
        return self._whole() and self.device.type != "npu"

    def _begin_bulk_write(self) -> None:
        state = self._bulk
        if not state.writing:
            state.writing = True
            self.version, self.needs_seed = None, True  # the old version is being overwritten
            self.partial = True

    def _place_bulk(self, header: dict) -> dict[int, torch.Tensor]:
        """Where a bulk bucket's ``seg`` entries are received (on the receive thread): the
        parameter slice of each range that lies in one contiguous segment of its loader view, in
        the range's dtype and known shape. Other entries arrive in the bucket's arena and are
        written by :meth:`_apply_bulk_bucket`, which also checks every range's digest after the fact."""
        dense = [(i, e) for i, e in enumerate(header["entries"])
                 if e.get("encoding") == "dense" and e.get("dtype") in DTYPES]
        segs = [(i, e) for i, e in dense if e.get("seg")]
        if not segs:
            return {}
        # the whole bucket's new names in one loader call: the applying thread then probes nothing
        self._probe([(e["name"], tuple(int(d) for d in e["shape"]), DTYPES[e["dtype"]]) for _, e in dense])
        params = self._bulk.params(self.model)
        out = {}
        for i, e in segs:
            shape, dtype = tuple(int(d) for d in e["shape"]), DTYPES[e["dtype"]]
            view = self.views.get(e["name"])
            if view is None or self.shapes.get(e["name"], (shape, dtype)) != (shape, dtype):
                continue  # the applying thread names what is wrong
            dst = dense_range_target(view, params, int(e["start"]), int(e["count"]))
            if dst is not None and dst.dtype == dtype and dst.device == self.channel.device:
                out[i] = dst
                e["_placed"] = True  # already written: the applying thread only digests it
        if out:
            self._begin_bulk_write()
            self._bulk.placed += len(out)
        return out

    def _apply_bulk_bucket(self, entries: list[tuple[dict, Patch]]) -> None:
        """One bucket's dense ranges of a seed/full update, written through their loader views now
        (names seen for the first time are probed together, one loader call). Each range's digest
        and finiteness are checked in the pass that writes it where the view allows (TP=1), else
        before writing: a mismatch fails the update, which leaves this engine needing a seed.
        Ranges received in place (:meth:`_place_bulk`) are only digested."""
        self._begin_bulk_write()
        state = self._bulk
        t0 = time.perf_counter()
        entry, p = entries[0] if entries else ({"start": 0}, None)
        try:
            self._probe([(p.name, p.shape, p.dtype) for _, p in entries])
            placed: list[tuple[dict, Patch]] = []
            for entry, p in entries:
                self._write_bulk_range(entry, p, placed)
            # ranges received in place: their digests, spread over the threads together
            scans = scan_many([(p.values, int(entry["start"]), None) for entry, p in placed],
                              key=placed[0][0]["_key"] if placed else None)
            for (entry, p), scanned in zip(placed, scans):
                check_dense_entry(entry, *scanned, p.values, "needs_seed")
        except DeltaSyncError:
            raise
        except Exception as e:
            kept = "engine paused with partially written weights; needs_seed: the next update must be a full seed"
            what = f"{p.name!r} [{entry['start']}, +{p.count})" if p is not None else "a bucket"
            raise DeltaSyncError(f"apply of {what} failed: {type(e).__name__}: {e}", kept=kept) from e
        finally:
            state.apply_s += time.perf_counter() - t0

    def _probe(self, names_shapes: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Loader views of the names not seen before, found in one probe of vLLM's loader."""
        with self._probe_lock:
            new = {n: (n, shape, dtype) for n, shape, dtype in names_shapes
                   if n not in self.views and n not in self.fallback}
            if not new:
                return
            with self._loader_layout():
                views, unsupported = probe_views(self.model, list(new.values()), whole=self._whole())
            self.views.update(views)
            self.fallback.update(unsupported)
        for name, why in unsupported.items():
            log.warning("delta-sync: %s has no loader view (%s); it uses vLLM's loader", name, why)

    def _write_bulk_range(self, entry: dict, p: Patch, placed: list[tuple[dict, Patch]]) -> None:
        """Check one range and write it through its view (digested in that pass or before it); a
        range received in place joins ``placed``, whose digests the caller checks together."""
        state = self._bulk
        known = self.shapes.get(p.name)
        if known is not None and known != (p.shape, p.dtype):
            raise PatchValidationError(p.name, f"shape/dtype {p.shape}/{p.dtype} differ from the seeded "
                                       f"{known[0]}/{known[1]}", kept="needs_seed")
        view = self.views.get(p.name)  # probed for the whole bucket by _apply_bulk_bucket
        params = state.params(self.model)
        wrong = next((params[seg.param].dtype for seg in view.segments if params[seg.param].dtype != p.dtype),
                     None) if view is not None else None
        if wrong is not None:  # copy_ would convert silently, and every later digest would disagree
            raise PatchValidationError(p.name, f"arrives as {p.dtype} but the engine holds it as {wrong}; "
                                       f"convert on the trainer (WeightSync(dtype={wrong}))", kept="needs_seed")
        start = int(entry["start"])
        state.advance(p.name, start, p.count, p.numel)
        self.shapes[p.name] = (p.shape, p.dtype)
        if entry.get("_placed"):
            placed.append((entry, p))
            return
        with torch.no_grad():
            scanned = apply_dense_range_scanned(view, params, p.values, start, entry["_key"]) \
                if view is not None and self._whole() else None
            if scanned is not None:  # written and digested in one pass: compare after the write
                check_dense_entry(entry, *scanned, p.values, "needs_seed")
                return
            check_dense_entry(entry, *scan_range(p.values, start, key=entry["_key"]), p.values, "needs_seed")
            if view is not None:
                apply_dense_range(view, params, p.values, start)
            else:  # vLLM's loader needs the whole tensor: hold its ranges until the last one
                parts = state.pending.setdefault(p.name, [])
                parts.append(p.values.clone())
                if state.done[p.name] == p.numel:
                    full = torch.cat(state.pending.pop(p.name)).reshape(p.shape)
                    with self._loader_layout():
                        self.model.load_weights([(p.name, full)])
                    self.fallback_values[p.name] = full

    def _validate(self, p: Patch, seed: bool) -> None:
        known = self.shapes.get(p.name)
        if known is None and not seed:
            raise PatchValidationError(p.name, "unknown checkpoint name (never seeded on this engine)",
                                       kept=self._kept())
        shape, dtype = known if known is not None else (None, None)
        if known is not None and (p.shape, p.dtype) == known:
            return  # the rest was checked per bucket as it arrived (entries, bounds, order, finiteness)
        p.validate(expected_shape=shape, expected_dtype=dtype, contents=False, kept=self._kept())

    def discard_staged(self) -> None:
        """Drop a received, not yet applied delta (nothing was written)."""
        self._staged = None

    def finish_weight_update(self) -> None:
        self.require_authorized("finish")
        version = self._call_version
        upd, self._staged = self._staged, None
        if upd is None:
            return  # start/finish with nothing received (e.g. the sender aborted before sending)
        if version is not None and upd.version != version:
            self.last_error = f"finish of v{version} but v{upd.version} is staged"
            raise DeltaSyncError(self.last_error + "; the staged update was discarded", kept=self._kept())
        if upd.kind in BULK_KINDS:  # applied while it arrived, and complete
            self.version, self.needs_seed, self.last_error = upd.version, False, None
            self.partial = False
            self._fingerprint = _fingerprint(self.model)
            self._record_loader_params()
            return
        t0 = time.perf_counter()
        undo = UndoLog()
        try:
            with torch.no_grad():
                self._apply_delta(upd.patches, dict(self.model.named_parameters()), undo)
        except Exception as e:
            undo.restore()
            kept = self._kept() + " (undo log restored)"
            self.last_error = f"apply of v{upd.version} failed: {type(e).__name__}: {e}"
            raise DeltaSyncError(self.last_error, kept=kept) from e
        self.version, self.needs_seed, self.last_error = upd.version, False, None
        self._fingerprint = _fingerprint(self.model)  # vLLM's loader, on the fallback path, may move storage
        self._record_loader_params()
        self.last_timings.update(apply_s=time.perf_counter() - t0, undo_bytes=float(undo.nbytes))

    # ---- apply ---------------------------------------------------------------------------------
    def _apply_delta(self, patches: list[Patch], params, undo: UndoLog) -> None:
        slow, sparse = [], []
        for p in patches:
            view = self.views.get(p.name)
            if view is None:
                slow.append(p)
            elif p.dense:
                apply_dense(view, params, p.values, undo)
            else:
                sparse.append((p.name, p.indices, p.values))
        apply_sparse_many(self.views, params, sparse, undo)
        if slow:
            self._apply_through_loader(slow, params, undo)

    def _apply_through_loader(self, patches: list[Patch], params, undo: UndoLog) -> None:
        """Patches of names without a loader view, through vLLM's loader (which may write anywhere:
        every parameter's old value goes into the undo log first). The kept whole value of each
        name is patched too; where this vLLM has no patch loader (0.23), that value is what the
        loader is given."""
        self._snapshot_all(params, undo)
        loader = vllm_compat.checkpoint_patch_loader()
        held = {}
        for p in patches:
            value = self.fallback_values.get(p.name)
            if value is None and loader is None:
                raise DeltaSyncError(f"{p.name}: this vLLM has no patch loader and no whole value of the tensor "
                                     "was kept (it was not seeded through vLLM's loader on this worker)",
                                     kept=self._kept())
            if value is not None:
                undo.record_view(value)
                apply_patch(value, p)
                held[p.name] = value
        with self._loader_layout():
            if loader is None:
                self.model.load_weights([(p.name, held[p.name].reshape(p.shape)) for p in patches])
                return
            patch_cls, load = loader
            for dense in (True, False):  # vLLM refuses dense and sparse patches in one call
                group = [patch_cls(p.name, p.shape, p.dtype, p.values, p.indices) for p in patches
                         if p.dense == dense]
                if group:
                    load(self.model, group)

    def _loader_layout(self):
        """The parameter layout vLLM's loader expects: on Ascend, MoE weights transposed back."""
        if self.device.type == "npu":
            from .vllm_ascend import checkpoint_layout

            return checkpoint_layout(self.model)
        return contextlib.nullcontext()

    @staticmethod
    def _snapshot_all(params, undo: UndoLog) -> None:
        """vLLM's loader may write anywhere: keep the old value of every parameter (fallback path only)."""
        for p in params.values():
            if p.numel():
                undo.record_view(p.data)

    def _loader_param_digests(self) -> dict[str, str]:
        """Digest of every parameter the loader views do not cover whole (none without names that
        went through vLLM's loader: then nothing is read)."""
        if not self.fallback_values:
            return {}
        params = dict(self.model.named_parameters())
        covered = _covered(self.views.values())
        return {n: digest_tensor(p.detach()).hex() for n, p in sorted(params.items())
                if covered.get(n, 0) < p.numel()}

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
               "timings": dict(self.last_timings)}
        if digests:
            t0 = time.perf_counter()
            params = dict(self.model.named_parameters())
            d = {}
            wanted = names or sorted(set(self.views) | set(self.fallback_values))
            drift = self._loader_drift() if any(n in self.fallback_values for n in wanted) else []
            if drift:  # what the loader wrote changed behind the updates: no kept value vouches for it
                out["loader_drift"] = drift
            for name in wanted:
                view = self.views.get(name)
                if view is not None:
                    digest, count = digest_view(view, params)
                    d[name] = [digest.hex(), count, int(torch.Size(view.shape).numel())]
                elif name in self.fallback_values:  # what vLLM's loader was given (whole, on every worker)
                    held = self.fallback_values[name]
                    d[name] = [DRIFTED if drift else digest_tensor(held).hex(), held.numel(), held.numel()]
            out["digests"] = d
            out["digest_s"] = time.perf_counter() - t0
        return out

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
