"""vLLM general plugin (entry point ``vllm.general_plugins``): loaded in every vLLM process.

On an engine with delta-sync switched on (``additional_config={"delta_sync": true}`` or
``DELTA_SYNC_ENGINE=1``: :func:`patches.enabled`) it installs the CPU checkpoint-layout mode and
adds two worker methods for ``collective_rpc``:

* ``delta_sync_call(envelope)``: the one door for weight-transfer calls (init, start, update,
  staged, finish, discard, report). The envelope is verified against the engine secret
  (:mod:`delta_sync.auth`) before anything runs. The worker's receiver
  (:class:`patches.vllm_receiver.DeltaSyncReceiver`) is created on the first verified call from
  the worker's own ``vllm_config``, device and model, and driven by this method alone.
* ``delta_sync_status()``: version, ``needs_seed`` and ``partial`` (nothing secret; the pause
  lease reads it).

They are added to ``WorkerBase``, the base of every platform's worker (vLLM's GPU/CPU ``Worker``
and vLLM-Ascend's ``NPUWorker`` alike), so they do not depend on which worker class a platform
picks or on how its vLLM generation builds weight-transfer engines. vLLM's own weight-transfer
lifecycle methods (``start_weight_update``, ..., reached by unsigned HTTP routes; on vLLM 0.23 and
vLLM-Ascend they run a layerwise reload that swaps the model's parameters out) are refused on a
delta-sync engine before they run. In the API server process the plugin adds the *pause lease*
(:func:`_install_pause_lease`). What differs between vLLM generations is asked of
:mod:`patches.vllm_compat`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time

from delta_sync.auth import ROUTE_PREFIX

from . import ENABLE_ENV, enabled, vllm_compat
from .engine_options import EngineOptions

log = logging.getLogger(__name__)


#: the lifecycle methods of vLLM's worker that a delta-sync engine serves only inside delta_sync_call
_GATED = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
          "shutdown_weight_transfer_engine", "start_draft_weight_update", "reset_weights", "reload_weights")


def register() -> None:
    options = EngineOptions.from_env()  # a bad setting stops the engine here, naming its variable
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from . import vllm_cpu_layout

        vllm_cpu_layout.install()
    _patch_worker()
    _install_core_commit()
    _install_pause_lease()
    from . import vllm_http_guard

    vllm_http_guard.install()
    if options.spin_s:
        _cap_shm_spin(options.spin_s)


#: seconds between a capped reader's checks of its queue (it sleeps, not spins) within the
#: ``DELTA_SYNC_VLLM_SPIN_S`` window (``launchers.equivalence.start_engine`` sets it for CPU
#: engines, which share the host's cores with the trainer)
SPIN_POLL_S = 0.0002


def _cap_shm_spin(seconds: float) -> None:
    """After every read, a reader of vLLM's shm message queue (each worker waiting for the next RPC,
    the engine core waiting for the workers' replies) spins on ``sched_yield`` for 1 s before it
    sleeps on its notify socket. On a host where the engine and the trainer share a few cores,
    every sync call then costs the trainer about a core for a second. Capped here to ``seconds``,
    and within them the reader checks the queue every :data:`SPIN_POLL_S` instead of spinning: a
    delta's diff runs while the workers wait between calls (docs/usage.md). Later than ``seconds``
    after the previous read, a read waits on vLLM's socket."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    if getattr(SpinCondition, "_delta_sync_spin", None) == seconds:
        return
    wait = getattr(SpinCondition, "_delta_sync_wait", SpinCondition.wait)

    def capped_wait(self, timeout_ms=None):
        self.busy_loop_s = min(self.busy_loop_s, seconds)
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(SPIN_POLL_S)  # the caller checks the queue again
            return None
        return wait(self, timeout_ms)

    SpinCondition._delta_sync_wait = wait
    SpinCondition._delta_sync_spin = seconds
    SpinCondition.wait = capped_wait


#: the worker attribute that holds its receiver once the first verified call created it
RECEIVER_ATTR = "_delta_sync_receiver"


def _enabled_on(worker) -> bool:
    return enabled(getattr(worker, "vllm_config", None))


def _receiver(worker, create: bool = False):
    """The worker's delta-sync receiver; ``create``: build it now if there is none (a verified call).
    Refused where delta-sync is not switched on, or where a vLLM weight-transfer engine is also
    configured (two writers to one set of weights)."""
    receiver = worker.__dict__.get(RECEIVER_ATTR)
    if receiver is not None or not create:
        return receiver
    from delta_sync.errors import DeltaSyncError

    kept = "engine weights as loaded; no delta-sync receiver was created"
    cfg = getattr(worker, "vllm_config", None)
    if not enabled(cfg):
        raise DeltaSyncError("delta-sync is not switched on for this engine: start it with --additional-config "
                             "'{\"delta_sync\": true}' (LLM(additional_config={\"delta_sync\": True})) or "
                             f"{ENABLE_ENV}=1 in its environment", kept=kept)
    other = vllm_compat.vllm_weight_transfer(cfg)
    if other is not None:
        raise DeltaSyncError(f"this engine also runs vLLM's weight-transfer engine (backend {other!r}): two writers "
                             "to one set of weights; start it without --weight-transfer-config", kept=kept)
    from .vllm_receiver import DeltaSyncReceiver

    receiver = DeltaSyncReceiver(cfg, worker.device, vllm_compat.worker_model(worker), verifier=_verifier(worker))
    setattr(worker, RECEIVER_ATTR, receiver)
    return receiver


def _patch_worker() -> None:
    """Adds the two collective_rpc methods to ``WorkerBase`` and gates vLLM's own lifecycle methods
    on every worker class that defines them: those already imported and, through
    ``__init_subclass__``, those a platform imports later (vLLM loads general plugins before it
    resolves ``worker_cls``; vLLM-Ascend's ``NPUWorker`` defines its own lifecycle)."""
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(WorkerBase, "_delta_sync_patched", False):
        return
    WorkerBase._delta_sync_patched = True
    WorkerBase.delta_sync_call = delta_sync_call
    WorkerBase.delta_sync_status = delta_sync_status
    _gate_subclasses(WorkerBase)
    own = WorkerBase.__dict__.get("__init_subclass__")  # a classmethod, if this vLLM defines one

    def __init_subclass__(cls, **kwargs):
        if own is not None:
            own.__get__(None, cls)(**kwargs)
        else:
            super(WorkerBase, cls).__init_subclass__(**kwargs)
        _gate_class(cls)

    WorkerBase.__init_subclass__ = classmethod(__init_subclass__)


def _gate_subclasses(base) -> None:
    seen, todo = set(), [base]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            _gate_class(cls)
            todo.extend(cls.__subclasses__())


def _gate_class(cls) -> None:
    """Wraps the lifecycle methods ``cls`` itself defines: on a delta-sync engine they run only
    inside a verified ``delta_sync_call``, refused before the worker touches any state (vLLM's HTTP
    routes call them with no proof; vLLM-Ascend's start would first swap the model's parameters for
    a layerwise reload)."""
    for name in _GATED:
        fn = cls.__dict__.get(name)
        if fn is None or getattr(fn, "_delta_sync_gate", False):
            continue

        def gated(self, *args, _name=name, _fn=fn, **kwargs):
            if _enabled_on(self):
                _refuse_vllm_lifecycle(self, _name)
            return _fn(self, *args, **kwargs)

        functools.update_wrapper(gated, fn)
        gated._delta_sync_gate = True
        setattr(cls, name, gated)


def _refuse_vllm_lifecycle(worker, name: str) -> None:
    from delta_sync.auth import AuthError

    receiver = _receiver(worker)
    kept = receiver.kept() if receiver is not None else "engine weights as they are"
    raise AuthError(f"{name}: unsigned weight-transfer call refused (delta-sync engines change weights only "
                    "through the signed delta_sync_call)",
                    kept=kept + "; the trainer's channel and staged update are unchanged")


def _verifier(worker):
    """The worker's verifier of signed calls (the engine secret and the nonces seen), kept from its
    first call on; the receiver is created only after a call passed it."""
    verifier = worker.__dict__.get("_delta_sync_verifier")
    if verifier is None:
        from delta_sync.auth import Verifier, load_secret

        # refuses all without a secret; every call must name this engine's identity for this boot
        verifier = worker._delta_sync_verifier = Verifier(load_secret(required=False),
                                                          engine=engine_identity(getattr(worker, "vllm_config", None)))
    return verifier


def engine_identity(vllm_config) -> str:
    """The engine's identity for this boot: vLLM's ``instance_id`` as the workers hold it (made where
    the engine core builds its config: a new one at every start). The API server's own config holds
    another, so its guard asks the workers (``patches/vllm_http_guard.py``)."""
    return str(getattr(vllm_config, "instance_id", "") or "")


@contextlib.contextmanager
def _lease_held(worker):
    """Counts a verified trainer call in flight on this worker and, when it succeeds, when it
    ended: what ``delta_sync_status`` tells every API server's lease watcher, so the engine has one
    lease however many API servers relay the trainer's calls."""
    lease = worker.__dict__.setdefault("_delta_sync_lease", {"in_flight": 0, "last": None})
    lease["in_flight"] += 1
    try:
        yield
        lease["last"] = time.monotonic()
    finally:
        lease["in_flight"] -= 1


def delta_sync_call(self, request: str = "{}", in_core: bool = False):
    """``collective_rpc("delta_sync_call", args=(json.dumps(envelope),))``: one verified call.
    ``in_core``: the engine core runs it inside a one-call commit (:func:`_core_commit`); a
    finish's timings say so (``commit_in_core``), nothing else differs.

    It drives the worker's delta-sync receiver itself, never the worker's own weight-transfer
    lifecycle: that differs by platform and version (vLLM 0.23's workers and vLLM-Ascend's
    ``NPUWorker`` run a layerwise reload around the transfer), and a delta-sync update must run the
    same everywhere. The worker's update session (start ... finish) is kept here. A signed HTTP
    route's envelope (``/pause``, ...) is only verified here, so its nonce is used engine-wide."""
    if not _enabled_on(self):  # named before the signature: nothing here could accept it
        _receiver(self, create=True)
    try:
        envelope = json.loads(request) if isinstance(request, str) else request
    except ValueError:
        envelope = None
    verifier = _verifier(self)
    method, payload = verifier.check(envelope)
    if method.startswith(ROUTE_PREFIX):  # a signed HTTP route, checked here too (its nonce is now used)
        return {"route": method[len(ROUTE_PREFIX):]}
    with _lease_held(self):
        return _dispatch(self, verifier, method, payload, in_core)


def _dispatch(self, verifier, method: str, payload: dict, in_core: bool = False):
    from delta_sync.gc_hold import gc_held

    receiver = _receiver(self, create=True)
    handler = _HANDLERS.get(method)
    if handler is None and method != "release":
        raise ValueError(f"unknown delta_sync_call method {method!r}")
    if method not in _READ_ONLY and not receiver.guard.claim(method, verifier.session):
        return {"released": True}
    t0 = time.perf_counter()
    try:
        with receiver.guard.authorized(version=payload.get("version") if method == "finish" else None), \
                _config(self), gc_held():  # the CPU worker's heap is not frozen: no full GC pass lands in a call
            return handler(self, receiver, payload)
    finally:
        if method in ("update", "staged", "finish"):  # the worker's own time of each (report's timings, after the update's)
            receiver.last_timings[f"{method}_call_s"] = time.perf_counter() - t0
        if method == "finish":
            receiver.last_timings["commit_in_core"] = float(bool(in_core))


def _active(worker) -> bool:
    return bool(worker.__dict__.get("_delta_sync_active", False))


def _end_session(worker) -> None:
    worker._delta_sync_active = False


def _on_init(worker, receiver, payload: dict):
    from .vllm_receiver import INIT_WAIT_S

    info = receiver.parse_init_info(payload)
    receiver.settle_receive("init", INIT_WAIT_S)  # refused while a delta still arrives: nothing changed
    if _active(worker):  # a new trainer: the old one's session is over
        receiver.discard_staged()
        _end_session(worker)
    receiver.init_transfer_engine(info)


def _on_start(worker, receiver, payload: dict):
    if _active(worker):
        raise RuntimeError("start: a weight update is already active on this worker (finish or init it first)")
    receiver.start_weight_update()
    worker._delta_sync_active = True
    if payload.get("digest_names"):  # the drift sweep: this version's digests, before the update
        try:
            return receiver.report(digests=True, names=list(payload["digest_names"]))
        except BaseException:  # a refused start opens no session (the trainer ends none)
            _end_session(worker)
            raise
    return receiver.status()  # the version held: a delta's trainer checks its base here, no call of its own


def _require_active(worker, method: str) -> None:
    if not _active(worker):
        raise RuntimeError(f"{method}: no weight update is active on this worker (start first)")


def _on_update(worker, receiver, payload: dict):
    _require_active(worker, "update")
    try:
        receiver.update_weights(payload)
    except BaseException:
        _end_session(worker)
        raise


def _on_staged(worker, receiver, payload: dict):
    """A delta received in the background is staged on this worker (its error otherwise): what a
    trainer with several engines waits for before it pauses any, as it waits for ``update`` calls."""
    _require_active(worker, "staged")
    try:
        receiver.await_receive()
    except BaseException:
        _end_session(worker)
        raise
    return receiver.status()


def _on_finish(worker, receiver, payload: dict):
    _require_active(worker, "finish")
    try:
        receiver.finish_weight_update()
    finally:  # applied or rolled back to v-1 by the receiver: the session is over either way
        _end_session(worker)
    reset_lora = getattr(getattr(worker, "model_runner", None), "reset_lora_state", None)
    if reset_lora is not None:  # as vLLM's worker does after a transfer
        reset_lora()


def _on_discard(worker, receiver, payload: dict):  # the sender gave up on this version on another engine
    receiver.discard_staged()
    return {"discarded": True}


def _on_report(worker, receiver, payload: dict):
    return receiver.report(digests=bool(payload.get("digests")), names=payload.get("names"))


#: verified methods that read and write nothing: a monitor's call neither takes nor renews the trainer's claim
_READ_ONLY = ("report",)
#: what each verified method does on the worker (``release`` only ends the trainer's claim)
_HANDLERS = {"init": _on_init, "start": _on_start, "update": _on_update, "staged": _on_staged,
             "finish": _on_finish, "discard": _on_discard, "report": _on_report}


def _config(worker):
    """vLLM's current-config scope around engine calls, as its worker sets it."""
    cfg = getattr(worker, "vllm_config", None)
    if cfg is None:
        return contextlib.nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(cfg)


def delta_sync_status(self, challenge: str | None = None) -> dict:
    """Version, ``needs_seed``, ``partial`` and the engine's identity; with a client's ``challenge``,
    also the identity's proof (a MAC under the engine secret) that clients sign their calls for."""
    receiver = _receiver(self)
    out = receiver.status() if receiver is not None else {"version": None, "needs_seed": True, "partial": False}
    lease = self.__dict__.get("_delta_sync_lease")
    if lease is not None:  # the trainer's calls as this worker saw them (any API server relayed them)
        out["lease"] = {"in_flight": lease["in_flight"],
                        "idle_s": None if lease["last"] is None else time.monotonic() - lease["last"]}
    if _enabled_on(self):  # the identity is no secret; its proof answers a client's challenge
        verifier = _verifier(self)
        out["engine"] = verifier.engine
        if challenge is not None:
            out["proof"] = verifier.prove_identity(str(challenge))
    return out


# ---- pause lease (API server process) ----------------------------------------------------------
def _install_pause_lease() -> None:
    """A paused delta-sync engine resumes by itself once no weight-transfer call has been in flight
    for the lease (``DELTA_SYNC_PAUSE_LEASE_S``), unless a seed/full update was cut off after it
    started writing (then it stays paused: serving half-written weights is worse than not serving).

    The trainer holds the lease simply by working: every ``delta_sync_call`` of its that succeeds
    renews it (over HTTP the API server verified its signature first: ``patches/vllm_http_guard.py``;
    other RPCs renew nothing), and a long update holds it while in flight. A trainer SIGKILLed after
    ``/pause`` therefore costs at most one lease of serving time. The engine stays paused past the
    lease where resuming would serve weights no update settled: a cut-off seed/full update, workers
    on different versions, or a status call that fails (logged, not fatal to the watcher)."""
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except Exception:  # noqa: BLE001 - no async engine in this vLLM build: nothing to lease
        return
    _lease_methods(AsyncLLM)


def _lease_methods(cls) -> None:
    """Wraps ``pause_generation``, ``resume_generation`` and ``collective_rpc`` of ``cls`` (vLLM's
    ``AsyncLLM``) with the pause lease; once per class."""
    if getattr(cls, "_delta_sync_lease", False):
        return
    cls._delta_sync_lease = True
    pause, resume, rpc = cls.pause_generation, cls.resume_generation, cls.collective_rpc

    def hold_lease(self) -> None:  # the engine is paused: the watcher runs until it resumes
        lease = _lease_s(self)
        if lease > 0:
            st = _lease_state(self)
            st["last"] = time.monotonic()
            if st.get("task") is None or st["task"].done():
                st["task"] = asyncio.get_running_loop().create_task(_watch(self, lease, resume, rpc))

    @functools.wraps(pause)
    async def pause_generation(self, *args, **kwargs):
        try:
            out = await _pause_now(self, pause, args, kwargs)
        except BaseException:
            # cancelled (the caller gone) or failed after the core took the pause: it may complete
            # without anyone left to resume it; the watcher does, by the lease's rules
            hold_lease(self)
            raise
        hold_lease(self)
        return out

    @functools.wraps(resume)
    async def resume_generation(self, *args, **kwargs):
        st = _lease_state(self)
        task = st.pop("task", None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        return await resume(self, *args, **kwargs)

    @functools.wraps(rpc)
    async def collective_rpc(self, *args, **kwargs):
        mode = _commit_mode(args, kwargs)
        if mode is not None:  # pause here, in this process, rather than in a call of its own
            out = await _commit_in_core(self, args, kwargs, mode, hold_lease)  # (an idle engine's)
            if out != CORE_COMMIT_DECLINED:
                return out
            await _in_flight(self, self.pause_generation(mode=mode, clear_cache=True))
        if kwargs.get("method", args[0] if args else None) != "delta_sync_call":
            return await rpc(self, *args, **kwargs)  # only the trainer's calls hold the lease
        out = await _in_flight(self, rpc(self, *args, **kwargs))
        _lease_state(self)["last"] = time.monotonic()  # renewed by a call that succeeded (HTTP ones were verified first)
        if mode is not None:  # the workers took the version: serve it (a failure above stays paused)
            if mode == "keep":  # frozen requests kept their KV of the old weights
                await self.reset_prefix_cache()
            await self.resume_generation()
        return out

    cls.pause_generation = pause_generation
    cls.resume_generation = resume_generation
    cls.collective_rpc = collective_rpc


async def _in_flight(llm, call):
    """Await ``call`` as a trainer call in flight: the lease's watcher resumes nothing meanwhile
    (a commit's "wait" pause, which lasts as long as the requests it waits for)."""
    st = _lease_state(llm)
    st["in_flight"] = st.get("in_flight", 0) + 1
    try:
        return await call
    finally:
        st["in_flight"] -= 1


#: what the one-call commit returns where it did nothing (the engine core's half, and the API
#: server's): the commit then takes vLLM's pause, finish and resume
CORE_COMMIT_DECLINED = "delta-sync: commit declined"


async def _commit_in_core(llm, args: tuple, kwargs: dict, mode: str, hold_lease):
    """A commit (``collective_rpc`` of a ``delta_sync_call`` finish with :data:`COMMIT_KWARG
    <delta_sync.engines.COMMIT_KWARG>` popped) as one engine-core call, :func:`_core_commit`:
    vLLM's pause, finish and resume cost three round trips to the engine core and the pause a
    fourth to the workers (a device sync), ~2-3 ms of a delta's ~10 ms pause window on a CPU host.
    Returns :data:`CORE_COMMIT_DECLINED` where the core did nothing (busy, paused, data parallel, or a vLLM
    without the pieces): the caller then takes the three-call path. A failing finish raises and
    leaves the engine paused under the lease, as the three-call path does."""
    core, renderer = getattr(llm, "engine_core", None), getattr(llm, "renderer", None)
    if getattr(llm, "_delta_sync_core_commit", True) is False or not hasattr(core, "call_utility_async") \
            or not hasattr(renderer, "clear_mm_cache_async") or not vllm_compat.single_engine_core(llm) \
            or not _delta_sync_engine(llm) or _has_requests(llm):
        return CORE_COMMIT_DECLINED
    # (the method is delta_sync_call: _commit_mode refuses the commit keyword on any other, and the
    # core runs that one only)
    timeout = kwargs.get("timeout", args[1] if len(args) > 1 else None)
    rpc_args = tuple(kwargs.get("args", args[2] if len(args) > 2 else ()))
    rpc_kwargs = kwargs.get("kwargs", args[3] if len(args) > 3 else None)
    try:
        await renderer.clear_mm_cache_async()  # (vLLM's pause with clear_cache does it first)
        out = await _in_flight(llm, core.call_utility_async("delta_sync_commit", timeout, rpc_args, rpc_kwargs,
                                                             mode))
    except BaseException as e:
        if "no attribute 'delta_sync_commit'" in str(e):  # an engine core without it (nothing ran): never again
            llm._delta_sync_core_commit = False
            return CORE_COMMIT_DECLINED
        # the finish failed (the engine stays paused, as after a pause and a failed finish), or this
        # call was cancelled (the client gone) while the core may run it: the lease's watcher, as a
        # pause starts it. Started now, its first look at the pause queues behind the commit. (Not
        # before the call: were the core to decline, vLLM's "wait" pause that follows could outlast
        # the lease, and the watcher would resume the engine in the middle of it.)
        hold_lease(llm)
        raise
    if out != CORE_COMMIT_DECLINED:
        _lease_state(llm)["last"] = time.monotonic()
    return out


def _install_core_commit() -> None:
    """Adds :func:`_core_commit` to vLLM's ``EngineCore`` as the utility ``delta_sync_commit``
    (this plugin loads in the engine-core process too)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception:  # noqa: BLE001 - no V1 engine core here: the API server takes the three-call path
        return
    if getattr(EngineCore, "delta_sync_commit", None) is not _core_commit:
        EngineCore.delta_sync_commit = _core_commit


def _core_commit(core, timeout, args, kwargs, mode):
    """The engine core's half of :func:`_commit_in_core`. A utility call runs between two steps,
    so nothing is scheduled while it runs: on an idle, unpaused engine it sets vLLM's pause state
    for ``mode`` and clears the caches as a ``clear_cache`` pause does, runs the workers'
    ``delta_sync_call`` (the signed finish; they check it), and resumes. The device sync of vLLM's
    pause is left out: it settles the last step's launches, and an idle engine has none. Anything
    else (requests, a pause already on, data parallelism, a vLLM without these pieces) changes
    nothing and returns :data:`CORE_COMMIT_DECLINED`. A finish that raises leaves the engine
    paused with its caches cleared, as a pause followed by a failed finish does."""
    pause_state = vllm_compat.pause_states()
    if pause_state is None or not _core_idle(core, pause_state):
        return CORE_COMMIT_DECLINED
    core.scheduler.set_pause_state(pause_state.PAUSED_ALL if mode == "keep" else pause_state.PAUSED_NEW)
    core._reset_caches()
    out = core.collective_rpc("delta_sync_call", timeout, tuple(args), dict(kwargs or {}, in_core=True))  # raises: paused
    core.scheduler.set_pause_state(pause_state.UNPAUSED)
    return out


def _core_idle(core, pause_state) -> bool:
    """Is this engine core alone (no data parallelism), unpaused and idle, with what the one-call
    commit uses (False where a vLLM lacks a piece: the commit then takes vLLM's three calls)?"""
    try:
        return (callable(getattr(core, "_reset_caches", None)) and callable(getattr(core.scheduler, "set_pause_state", None))
                and vllm_compat.single_engine_core(core)
                and core.scheduler.pause_state == pause_state.UNPAUSED and not core.has_work())
    except AttributeError:
        return False


async def _pause_now(llm, pause, args: tuple, kwargs: dict):
    """vLLM's ``pause`` (its own, unwrapped), or on an idle delta-sync engine :func:`_pause_idle`."""
    if _delta_sync_engine(llm) and not args and not _has_requests(llm) and vllm_compat.can_pause_scheduler_directly(llm):
        return await _pause_idle(llm, kwargs)
    return await pause(llm, *args, **kwargs)


async def _pause_idle(llm, kwargs: dict) -> None:
    """Nothing in flight: vLLM's pause minus its closing 20 ms sleep, which only lets the outputs
    of in-flight requests reach their callers first (vLLM: "not required for correctness"). On a
    delta that sleep was a third of the engine's pause window."""
    mode, clear = kwargs.get("mode", "abort"), kwargs.get("clear_cache", True)
    if clear:
        await llm.renderer.clear_mm_cache_async()
    await llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear)


def _commit_mode(args: tuple, kwargs: dict) -> str | None:
    """Pops ``COMMIT_KWARG`` from the workers' keyword arguments of a ``collective_rpc`` call
    (``kwargs["kwargs"]``, as vLLM's route passes them): a delta's finish that asks this API server
    to pause before it and resume after it (``delta_sync.engines.HttpEngine.commit``, its whole
    pause window in one HTTP call instead of three). Its pause mode, or None."""
    from delta_sync.engines import COMMIT_KWARG

    rpc_kwargs = kwargs.get("kwargs")
    if not isinstance(rpc_kwargs, dict) or COMMIT_KWARG not in rpc_kwargs:
        return None
    rpc_kwargs = dict(rpc_kwargs)
    mode = rpc_kwargs.pop(COMMIT_KWARG)
    kwargs["kwargs"] = rpc_kwargs
    method = kwargs.get("method", args[0] if args else None)
    if method != "delta_sync_call":  # only a (signed) weight-transfer call may ask for it
        raise ValueError(f"{COMMIT_KWARG} is for delta_sync_call, not {method!r}")
    if mode not in ("wait", "abort", "keep"):
        raise ValueError(f"{COMMIT_KWARG}={mode!r}: expected wait, abort or keep")
    return mode


def _delta_sync_engine(llm) -> bool:
    return enabled(getattr(llm, "vllm_config", None))


def _lease_s(llm) -> float:
    if not _delta_sync_engine(llm):
        return 0.0
    return EngineOptions.from_env().lease_s  # checked when the plugin loaded


def _has_requests(llm) -> bool:
    """Has the engine requests in flight (True where this vLLM cannot tell)?"""
    try:
        return bool(llm.output_processor.has_unfinished_requests())
    except Exception:  # noqa: BLE001 - cannot tell: counted as busy (the slower, safe pause)
        return True


def _lease_state(llm) -> dict:
    st = getattr(llm, "_delta_sync_lease_state", None)
    if st is None:
        st = llm._delta_sync_lease_state = {"in_flight": 0, "last": time.monotonic()}
    return st


def _keep_paused_because(status) -> str | None:
    """Why a paused engine must not resume on its own, from its workers' ``delta_sync_status``
    (None: it may): a cut-off seed/full update, or workers on different versions (a finish that
    failed on some of them), or no answer."""
    status = [s for s in status or [] if s]
    if not status:
        return "no worker answered the status call"
    if any(s.get("partial") for s in status):
        return "a seed/full update was cut off mid-write"
    versions = {s.get("version") for s in status}
    if len(versions) > 1:
        return f"the workers hold different versions ({', '.join(sorted(map(str, versions)))})"
    return None


def _held_by_workers(status, lease: float) -> bool:
    """Does a worker report a trainer call in flight or ended within the lease? (Calls relayed by
    another API server of this engine renew the lease there, not here: the workers saw them all.)"""
    for s in status or []:
        held = (s or {}).get("lease") or {}
        if held.get("in_flight") or (held.get("idle_s") is not None and held["idle_s"] < lease):
            return True
    return False


async def _watch(llm, lease: float, resume, rpc) -> None:
    """Runs while the engine is paused; ``resume``/``rpc`` are vLLM's own (they do not renew the lease)."""
    st = _lease_state(llm)
    warned: str | None = None

    def held() -> bool:  # a trainer call is in flight or ended within the lease
        return bool(st["in_flight"]) or time.monotonic() - st["last"] < lease

    while True:
        await asyncio.sleep(min(1.0, lease / 4))
        if not await llm.is_paused():
            return
        if held():
            continue
        try:
            status = await rpc(llm, "delta_sync_status")
        except Exception as e:  # noqa: BLE001 - the watcher must not die: it fails closed, loudly
            status, why = None, f"the workers' status call failed ({type(e).__name__}: {e})"
        else:
            why = _keep_paused_because(status)
        if held() or _held_by_workers(status, lease):
            continue  # a trainer call came in meanwhile (here, or through another API server)
        idle = time.monotonic() - st["last"]
        if why is not None:
            if warned != why:
                log.error("delta-sync: pause lease expired (%.0f s without a trainer call), but %s: staying "
                          "paused until a trainer's update settles it", idle, why)
                warned = why
            continue
        versions = sorted({str(s.get("version")) for s in status or [] if s})
        log.warning("delta-sync: pause lease expired (%.0f s without a trainer call); resuming on version %s",
                    idle, ",".join(versions) or "?")
        st.pop("task", None)
        await resume(llm)
        return
