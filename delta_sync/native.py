"""Host-memory kernels (diff, digest, patch moves): built on first use, optional, checked against the torch-op path.

The torch-op diff (:mod:`delta_sync.diff`) runs on every device but, on a CPU, spends as much
time on its mask, ``nonzero`` and random gathers as on the compare itself. Snapshots kept in host
memory (the usual choice when accelerator memory is tight) deserve a one-pass scan, so this module
compiles ``_diff_kernel.c`` (plain C99, no Python or torch headers) with the system C compiler
into a per-user cache, loads it with :mod:`ctypes` (which releases the GIL during the call) and
runs contiguous ranges of one tensor on ``torch.get_num_threads()`` threads.

The same library holds the digest's scan and :func:`move_rows`: a delta's sparse writes and its
undo log's reads at int32/int64 positions, many tensors per foreign call (torch's index ops want
int64 positions, one op and one allocation per tensor).

Nothing depends on it: without a compiler, or with ``DELTA_SYNC_NATIVE_DIFF=0``, :func:`kernel`
returns ``None`` and the torch-op path runs. Both produce identical patches (tested).
"""

from __future__ import annotations

import array
import bisect
import ctypes
import functools
import hashlib
import itertools
import logging
import operator
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_diff_kernel.c")
CFLAGS = ["-O3", "-std=c99", "-shared", "-fPIC"]


def _cpu_flags() -> list[str]:
    """``-mavx2`` where this x86 host has it (the digest's 16-bit multiply-adds vectorize), and
    AVX-512BW's flags too where it has that (twice the words per multiply-add), with VNNI's where
    it has that too."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return []
    out = ["-mavx2"] if "avx2" in flags else []
    if out and "avx512f" in flags and "avx512bw" in flags:
        out += ["-mavx512f", "-mavx512bw"]
        if "avx512_vnni" in flags:  # the multiply-add and its sum in one instruction
            out.append("-mavx512vnni")
    return out
#: output entries per kernel call and thread (8 MiB whatever the density), except a batch's first
#: call where the caller expects more (:func:`changed_batch`'s ``expect``: what the result holds anyway)
SCRATCH_ENTRIES = 1 << 20
#: below this many words a tensor is scanned on the calling thread (pool overhead dominates).
MIN_WORDS_PER_THREAD = 1 << 17
#: elements of host writes per thread below which :func:`thread_spans` keeps them on one thread
SPREAD_MIN_ELEMENTS = 1 << 16

_VALUE_DTYPE = {16: torch.int16, 32: torch.int32}
#: element sizes in bytes the diff kernel scans
WORD_WIDTHS = tuple(bits // 8 for bits in _VALUE_DTYPE)
_MOVE_BYTES = (1, 2, 4, 8)
_MOVE_POS = (torch.int32, torch.int64)
#: int64 words per row of the move kernel's table (its MOVE_ROW)
_MOVE_ROW = 8


def _cache_dir() -> Path:
    root = os.environ.get("DELTA_SYNC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "delta_sync")
    return Path(root)


def _build(vector_flags: list[str] | None = None) -> Path:
    cc = os.environ.get("CC", "cc")
    src = SOURCE.read_bytes()
    flags = CFLAGS + (_cpu_flags() if vector_flags is None else vector_flags)
    key = hashlib.sha256(src + " ".join([cc, *flags, sys.platform]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"diff_kernel-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build under a private name, then rename: ranks that start together never load a half file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, or ``None`` (disabled, or no working C compiler)."""
    if os.environ.get("DELTA_SYNC_NATIVE_DIFF", "1") == "0":
        return None
    best = _cpu_flags()
    # a compiler that refuses the host's widest vectors still builds the narrower kernel
    tries = list(dict.fromkeys(tuple(f) for f in (best, [f for f in best if "vnni" not in f],
                                                  [f for f in best if "avx512" not in f])))
    for k, flags in enumerate(tries):
        try:
            return load(_build(list(flags)))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip()[:500]
            if k + 1 < len(tries):
                log.warning("host diff kernel with %s failed to build (%s %s); building it without", " ".join(flags),
                            exc, detail)
                continue
            log.warning("host diff kernel unavailable (%s %s); using the torch-op diff", exc, detail)
    return None


def load(path: Path) -> ctypes.CDLL:
    """The kernel library built at ``path``, its functions' signatures declared."""
    lib = ctypes.CDLL(str(path))
    for width in _VALUE_DTYPE:
        fn = getattr(lib, f"diff_words_{width}")
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.POINTER(ctypes.c_int64)]
        many = getattr(lib, f"diff_many_{width}")
        many.restype = ctypes.c_int64
        many.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    lib.move_rows.restype = ctypes.c_int64
    lib.move_rows.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    lib.run_slices.restype = None
    lib.run_slices.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 7
    lib.gather_runs.restype = None
    lib.gather_runs.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.sparse_order_bounds.restype = ctypes.c_int64
    lib.sparse_order_bounds.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                        ctypes.c_void_p]
    lib.digest_words.restype = ctypes.c_int64
    lib.digest_words.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_int16, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.digest_many.restype = None
    lib.digest_many.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return lib


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="delta_sync-diff")


def run_spread(calls: list) -> tuple[list, BaseException | None]:
    """Run the zero-argument ``calls`` at once: the first on the calling thread, the others on the
    pool. Every call finishes before this returns (so none still writes when an error leaves):
    their results in order (None where one raised) and the first error, or None."""
    futures = [_pool(len(calls)).submit(c) for c in calls[1:]]
    results: list = [None] * len(calls)
    error = None
    for k, step in enumerate([*calls[:1], *(f.result for f in futures)]):
        try:
            results[k] = step()
        except BaseException as e:  # noqa: BLE001 - every call finishes first; the first error goes to the caller
            error = error or e
    return results, error


def contiguous_groups(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Split ``range(len(sizes))`` into at most ``parts`` non-empty ``(lo, hi)`` ranges, in order,
    of about equal total size: how whole tensors are shared out between threads."""
    n = len(sizes)
    bounds, acc, share = [0], 0, -(-sum(sizes) // max(1, parts))
    for i, size in enumerate(sizes):
        acc += size
        if acc >= share * len(bounds) and len(bounds) < parts and i + 1 < n:
            bounds.append(i + 1)
    bounds.append(n)
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def thread_spans(sizes: list[int], min_per_thread: int = SPREAD_MIN_ELEMENTS, threads: int | None = None
                 ) -> list[tuple[int, int]]:
    """``range(len(sizes))`` cut into contiguous ``(lo, hi)`` parts of about equal size, one per
    thread (``threads``, by default ``torch.get_num_threads()``), each of at least ``min_per_thread``
    elements (one part below that: a thread's hand-off costs more than it saves)."""
    if not sizes:
        return []
    threads = min(threads or torch.get_num_threads(), len(sizes), max(1, sum(sizes) // min_per_thread))
    return contiguous_groups(sizes, threads) if threads > 1 else [(0, len(sizes))]


def capped_groups(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """Split ``range(len(sizes))`` into ``(lo, hi)`` ranges, in order, each summing to at most
    ``limit`` (or holding one larger item): how a batch is cut to bound its temporaries."""
    runs, lo, acc = [], 0, 0
    for i, size in enumerate(sizes):
        if i > lo and acc + size > limit:
            runs.append((lo, i))
            lo, acc = i, 0
        acc += size
    if lo < len(sizes):
        runs.append((lo, len(sizes)))
    return runs


def can_move(flat: torch.Tensor, pos: torch.Tensor) -> bool:
    """Can :func:`move_rows` take positions like ``pos`` into ``flat`` (given buffers of its dtype)?"""
    return movable_rows([(flat, pos, 0, None, None)])


def movable(flat: torch.Tensor, pos: torch.Tensor, values: torch.Tensor | None = None,
            old: torch.Tensor | None = None) -> bool:
    """A row :func:`move_rows` takes: :func:`can_move`, and ``values`` / ``old`` (None, or host
    tensors of ``flat``'s dtype and ``pos``'s count)."""
    return movable_rows([(flat, pos, 0, values, old)])


def movable_rows(rows: list[tuple]) -> bool:
    """Can :func:`move_rows` take every ``(flat, pos, offset, values, old)`` row (the one place these
    checks live)? Each target is checked once, however many rows write it, and each row's buffers
    with a few attribute reads: a MoE's tens of thousands of rows per update cost milliseconds."""
    if kernel() is None:
        return False
    targets: dict[int, bool] = {}
    for flat, pos, _, values, old in rows:
        ok = targets.get(id(flat))
        if ok is None:
            ok = targets[id(flat)] = (flat.device.type == "cpu" and flat.element_size() in _MOVE_BYTES
                                      and flat.is_contiguous())
        if not (ok and pos.dtype in _MOVE_POS and pos.device.type == "cpu" and pos.dim() == 1
                and pos.is_contiguous()):
            return False
        n, dtype = pos.numel(), flat.dtype
        for t in (values, old):
            if t is not None and not (t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
                                      and t.numel() == n):
                return False
    return True


def move_rows(rows: list[tuple], spans: list[tuple[int, int]] | None = None, checked: bool = False) -> None:
    """Patch positions of contiguous host tensors, many patches per foreign call. Each row is
    ``(flat, pos, offset, values, old)``: ``old[i] = flat[offset + pos[i]]`` (when ``old`` is not
    None), then ``flat[offset + pos[i]] = values[i]`` (when ``values`` is not None), for int32 or
    int64 ``pos`` (no int64 copy of int32 indices, no offset added in a pass of its own); with both,
    each position is read and written in one visit. Rows run in order.

    Every position of every row is checked first: one outside its tensor raises IndexError, and
    nothing was read or written. ``spans``: ``(lo, hi)`` row ranges that then run concurrently,
    one thread each (rows writing one tensor belong in one span). Rows must pass :func:`can_move`,
    their buffers be of the tensor's dtype and the positions' count (ValueError otherwise; ``checked``:
    the caller ran :func:`movable_rows` on them already). The same as :func:`row_table`, then
    :func:`check_rows` and :func:`run_rows`, which a caller may run apart (the table and its check
    before an engine pauses, the run inside the pause)."""
    if not rows:
        return
    table = row_table(rows, checked)
    check_rows(rows, table)
    run_rows(table, spans)


def row_table(rows: list[tuple], checked: bool = False) -> torch.Tensor:
    """The kernel's table of :func:`move_rows`' rows (their buffers' addresses: they must stay alive
    and in place until the table is run)."""
    bad_row = None if checked else next((k for k, (f, p, _, v, o) in enumerate(rows) if not movable(f, p, v, o)),
                                        None)
    if bad_row is not None:
        flat, pos = rows[bad_row][:2]
        raise ValueError(f"row {bad_row} ({flat.dtype} {flat.device} target, {pos.dtype} positions) is not for the "
                         "host kernel: check can_move() and the buffers' dtype and count first")
    return torch.tensor([[flat.data_ptr(), pos.data_ptr(), pos.numel(), int(off), flat.numel(),
                          0 if v is None else v.data_ptr(), 0 if o is None else o.data_ptr(),
                          flat.element_size() | pos.element_size() << 8] for flat, pos, off, v, o in rows],
                        dtype=torch.int64).reshape(-1, _MOVE_ROW)


def check_rows(rows: list[tuple] | None, table: torch.Tensor) -> None:
    """Raise IndexError, naming it, for the first position of ``table``'s rows outside its tensor
    (reads and writes nothing). ``rows``: the table's rows, to name the position (None: a table
    built without them)."""
    lib, bad = kernel(), ctypes.c_int64()
    k = lib.move_rows(table.shape[0], table.data_ptr(), 1, ctypes.byref(bad))
    if k >= 0 and rows is None:
        raise IndexError(f"row {k} of a patch table: its entry {bad.value} of {int(table[k, 2])} positions is outside "
                         f"a tensor of {int(table[k, 4])} elements; no patch of this batch was read or written")
    if k >= 0:
        flat, pos, off = rows[k][:3]
        raise IndexError(f"patch position {int(pos[bad.value]) + int(off)} (entry {bad.value} of {pos.numel()}) is "
                         f"outside a tensor of {flat.numel()} elements; no patch of this batch was read or written")


def run_rows(table: torch.Tensor, spans: list[tuple[int, int]] | None = None) -> None:
    """Perform the rows of a checked ``table`` (:func:`check_rows`), each span of rows on a thread."""
    lib, bad = kernel(), ctypes.c_int64()
    spans = spans or [(0, table.shape[0])]
    _, error = run_spread([functools.partial(lib.move_rows, hi - lo, table[lo].data_ptr(), 0, ctypes.byref(bad))
                           for lo, hi in spans if hi > lo])
    if error is not None:  # cannot happen for checked rows: the kernel only loads and stores
        raise error


def move_at(flat: torch.Tensor, pos: torch.Tensor, offset: int = 0, values: torch.Tensor | None = None,
            old: torch.Tensor | None = None) -> bool:
    """One row of :func:`move_rows`; False, having touched nothing, where the host kernel cannot
    take it (not a host tensor, not contiguous, other dtypes or counts, no kernel): the caller
    runs torch ops instead."""
    if not movable(flat, pos, values, old):
        return False
    move_rows([(flat, pos, offset, values, old)])
    return True


def host_ints(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a 1-D host tensor of ``dtype`` (int32 or int64), made through :mod:`array`: a
    list of a model's ~19k ints in ~0.25 ms, where ``torch.tensor`` takes ~1 ms."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def sparse_in_order(indices: torch.Tensor, counts: list[int] | torch.Tensor, limits: list[int] | torch.Tensor
                    ) -> bool | None:
    """Do the sparse entries tiling ``indices`` (entry k: the next ``counts[k]`` of them) each
    strictly increase within ``[0, limits[k])``? One pass of the host kernel. None where it
    cannot say (no kernel, not a contiguous host int32 buffer, counts that do not tile it): the
    caller checks with torch ops, which also name what is wrong when this says False. ``counts``
    and ``limits``: lists, or host int64 tensors (a table's columns, no list made)."""
    lib = kernel()
    if lib is None or indices.device.type != "cpu" or indices.dtype != torch.int32 or not indices.is_contiguous():
        return None
    counts, limits = (c.contiguous() if isinstance(c, torch.Tensor) else host_ints(c) for c in (counts, limits))
    if counts.device.type != "cpu" or int(counts.sum()) != indices.numel():
        return None
    return lib.sparse_order_bounds(indices.data_ptr(), indices.numel(), counts.numel(), counts.data_ptr(),
                                   limits.contiguous().data_ptr()) < 0


@functools.cache
def _memcmp():
    try:
        fn = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):  # no C library to ask (the caller compares with torch)
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do ``a`` and ``b`` (one dtype) hold the same elements, bit for bit? One ``memcmp`` where both
    are contiguous host tensors (2x ``torch.equal``'s speed here), else ``torch.equal``."""
    if a.dtype != b.dtype or a.numel() != b.numel():
        return False
    fn = _memcmp() if a.is_cpu and b.is_cpu and a.is_contiguous() and b.is_contiguous() else None
    if fn is None:
        return torch.equal(a.reshape(-1), b.reshape(-1))
    return a.numel() == 0 or fn(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0


def supports_words(t: torch.Tensor) -> bool:
    """Host tensor whose bytes the word kernels (digest) can read."""
    return t.is_cpu and kernel() is not None  # (is_cpu: no device object per call)


def supports(t: torch.Tensor) -> bool:
    return t.is_cpu and t.element_size() in WORD_WIDTHS and kernel() is not None


def _scan(fn, width: int, old64: torch.Tensor, new64: torch.Tensor, first: int, stop: int,
          lanes: int, absorb: bool) -> list[tuple[torch.Tensor, ...]]:
    # a small tensor needs no more room than its own elements (>= one 8-word block: progress)
    room = min(SCRATCH_ENTRIES, max(8 * lanes, (stop - first) * lanes))
    idx, val, prev = _outputs(room, width, absorb)
    done = ctypes.c_int64()
    out = []
    a, b = old64.data_ptr(), new64.data_ptr()
    w = first
    try:
        while w < stop:
            k = fn(a + 8 * w, b + 8 * w, stop - w, w * lanes, idx.data_ptr(), val.data_ptr(),
                   prev.data_ptr() if absorb else None, room, ctypes.byref(done))
            if k:  # the output is the scratch itself (a copy into fresh pages cost as much as the scan)
                out.append((idx[:k], val[:k]) + ((prev[:k],) if absorb else ()))
            if done.value == 0:  # cannot happen with room for 8 words of lanes
                raise RuntimeError(f"diff kernel made no progress at word {w} (scratch {room})")
            w += done.value
            if k and w < stop:
                idx, val, prev = _outputs(room, width, absorb)
    except BaseException:
        if absorb:  # this range goes back to its old bits before the error leaves
            for piece in out:
                put_back(old64, piece[0], piece[2])
        raise
    return out


def _outputs(room: int, width: int, absorb: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Output of one diff kernel call: ``room`` entries of indices, values and (absorb) old bits.
    Callers hand views of them on as the result: only the pages the kernel wrote are touched."""
    vdt = _VALUE_DTYPE[width]
    return (torch.empty(room, dtype=torch.int32), torch.empty(room, dtype=vdt),
            torch.empty(room, dtype=vdt) if absorb else None)


def changed_words(old64: torch.Tensor, new64: torch.Tensor, lanes: int, absorb: bool = False
                  ) -> tuple[list[torch.Tensor], ...]:
    """Changed elements of two host int64 word arrays holding ``lanes`` elements per word.

    Returns index and value-bit parts (int32 flat element indices, strictly increasing across
    the parts in order; values as the signed integer of the element width). With ``absorb``, also
    the old value bits of each entry, and every changed word of ``old64`` now holds ``new64``'s.
    """
    width = 64 // lanes
    fn = getattr(kernel(), f"diff_words_{width}")
    nwords = old64.numel()
    threads = max(1, min(torch.get_num_threads(), nwords // MIN_WORDS_PER_THREAD))
    if threads == 1:
        parts = _scan(fn, width, old64, new64, 0, nwords, lanes, absorb)
    else:
        step = -(-nwords // threads)
        results, error = run_spread([functools.partial(_scan, fn, width, old64, new64, s, min(s + step, nwords),
                                                       lanes, absorb) for s in range(0, nwords, step)])
        parts = [piece for res in results if res for piece in res]  # each failed range restored itself
        if error is not None:
            if absorb:  # the ranges that did advance go back too: old64 is as it was
                for piece in parts:
                    put_back(old64, piece[0], piece[2])
            raise error
    return tuple([p[j] for p in parts] for j in range(3 if absorb else 2))


def word_shares(words: list[int], parts: int, align: int = 64) -> list[tuple[int, int, int, int]]:
    """Split the words of arrays of ``words`` words each, in order, into at most ``parts`` runs of
    about equal words (cut at multiples of ``align`` words of the whole): ``(lo, first, hi, last)``
    per run, the run covering arrays ``lo:hi`` from word ``first`` of array ``lo`` up to word
    ``last`` (exclusive) of array ``hi - 1``. An array may be split between runs; arrays of no
    words fall in the run around them."""
    total = sum(words)
    if total == 0:
        return [(0, 0, len(words), words[-1] if words else 0)] if words else []
    cuts = sorted({min(total, -(-total * i // parts) // align * align) for i in range(1, parts)} - {0, total})
    starts = list(itertools.accumulate(words, initial=0))
    runs, lo, first = [], 0, 0
    for cut in [*cuts, total]:
        hi = bisect.bisect_left(starts, cut, lo + 1) if cut < total else len(words)  # arrays starting before cut
        last = cut - starts[hi - 1]
        runs.append((lo, first, hi, last))
        if cut < total:  # the next run starts in array hi - 1, or at the start of array hi
            lo, first = (hi - 1, last) if last < words[hi - 1] else (hi, 0)
    return runs


def changed_many(olds: list[torch.Tensor], news: list[torch.Tensor], lanes: int, absorb: bool = False
                 ) -> list[tuple[torch.Tensor, ...]]:
    """:func:`changed_batch`, as ``(indices, value bits[, old bits])`` per tensor (views)."""
    counts, *found = changed_batch(olds, news, lanes, absorb)
    sizes = counts.tolist()
    return list(zip(*(f.split(sizes) for f in found))) if olds else []


def changed_batch(olds: list[torch.Tensor], news: list[torch.Tensor], lanes: int, absorb: bool = False,
                  facts: tuple[list[int], list[int], list[int]] | None = None, expect: int = 0
                  ) -> tuple[torch.Tensor, ...]:
    """:func:`changed_words` of many contiguous host tensors of ``lanes`` elements per 64-bit word
    (8-byte aligned, a whole number of words each) in a few kernel calls: ``(counts, indices, value
    bits[, old bits])``, tensor ``k``'s ``counts[k]`` (int64) changed elements after those of the
    tensors before it in each output. For a model's many small tensors, where a call per tensor
    (scratch, foreign call, copies, a Python object) costs more than scanning it.

    The words of all arrays are split into ``torch.get_num_threads()`` runs of about equal words,
    one thread each, cutting through a tensor where a cut falls (not by whole tensors, which left
    one thread scanning a large tensor while the other waited). With ``absorb``, a failure puts
    every advanced word back before it is raised. ``facts``: each tensor's words and both sides'
    addresses, known to the caller (per tensor of a model's ~19k, no call on the tensors).
    ``expect``: about how many elements the caller expects to have changed (e.g. the last scan's
    count): each run's first call gets room for its share of that, a quarter more, so that a run
    whose changes fit comes out of one call and the outputs need no join (otherwise calls of
    :data:`SCRATCH_ENTRIES` follow, and their chunks are joined)."""
    width = 64 // lanes
    n = len(olds)
    words = facts[0] if facts is not None else [t.numel() // lanes for t in olds]
    threads = max(1, min(torch.get_num_threads(), sum(words) // MIN_WORDS_PER_THREAD))
    runs = word_shares(words, threads)
    if facts is None:
        facts = (words, [t.data_ptr() for t in olds], [t.data_ptr() for t in news])
    run = functools.partial(_scan_many, getattr(kernel(), f"diff_many_{width}"), width, olds, facts, lanes,
                            absorb)
    total = sum(words)
    rooms = [0] * len(runs)
    if expect > 0 and total:  # each run's share of the expected changes, by its words
        starts = list(itertools.accumulate(words, initial=0))
        rooms = [-(-expect * 5 * (starts[hi - 1] + last - starts[lo] - first) // (4 * total))
                 for lo, first, hi, last in runs]
    # every run finishes (or restores itself) before an error leaves
    results, error = run_spread([functools.partial(run, *r, room) for r, room in zip(runs, rooms)])
    counts = torch.zeros(n, dtype=torch.int64)
    chunks: list[tuple[torch.Tensor, ...]] = []
    for (lo, _, hi, _), res in zip(runs, results):
        if res is not None:
            counts[lo:hi] += res[0]
            chunks += res[1]
    if error is not None:
        if absorb:  # the runs that did advance go back too
            for (lo, _, hi, _), res in zip(runs, results):
                if res is not None:
                    _put_back_all(olds[lo:hi], *res)
        raise error
    if not chunks:
        return (counts, *(o.narrow(0, 0, 0) for o in _outputs(0, width, absorb) if o is not None))
    # in run order: a tensor cut between runs has its pieces one after the other, indices increasing
    return (counts, *(c[0] if len(chunks) == 1 else torch.cat(c) for c in zip(*chunks)))


def _scan_many(fn, width: int, olds: list[torch.Tensor], facts: tuple[list[int], list[int], list[int]], lanes: int,
               absorb: bool, lo: int, first: int, hi: int, last: int, expect: int = 0
               ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    """Tensors ``lo:hi`` through ``diff_many``, from word ``first`` of tensor ``lo`` to word ``last``
    of tensor ``hi - 1`` (see :func:`word_shares`) in a few calls: each tensor's count of changed
    elements, and each call's outputs (views). ``facts``: every tensor's words, old and new addresses
    (``olds`` only to put advanced words back after a failure); ``expect``: room for the first call
    where that is more than the later calls' (:data:`SCRATCH_ENTRIES`), at most the run's elements."""
    n = hi - lo
    words, old_ptrs, new_ptrs = facts
    ends = words[lo:hi]
    ends[-1] = last
    # (int64 arrays the kernel reads: array.array takes a list of ints at C speed, torch.tensor does not)
    addr = [array.array("q", a) for a in (old_ptrs[lo:hi], new_ptrs[lo:hi], ends)]
    a_addr, b_addr, n_addr = (a.buffer_info()[0] for a in addr)
    span = (sum(ends) - first) * lanes  # the run's elements
    later = min(SCRATCH_ENTRIES, max(8 * lanes, span))  # every call's room after the first
    # (a call stops where the next 8 words' lanes might not fit: that much more for the expected)
    room = max(later, min(expect + 8 * lanes, span)) if expect > 0 else later
    idx, val, prev = _outputs(room, width, absorb)
    done = torch.empty(n, dtype=torch.int64)  # per call: entries written up to the end of each tensor
    counts = torch.zeros(n, dtype=torch.int64)
    chunks: list[tuple[torch.Tensor, ...]] = []
    stop_t, stop_w = ctypes.c_int64(), ctypes.c_int64()
    t, w = 0, first
    try:
        while t < n:
            k = fn(n, a_addr, b_addr, n_addr, t, w, idx.data_ptr(),
                   val.data_ptr(), prev.data_ptr() if absorb else None, room, done.data_ptr(),
                   ctypes.byref(stop_t), ctypes.byref(stop_w))
            st, sw = stop_t.value, stop_w.value
            if st > t:  # tensors t..st-1 ended in this call
                counts[t:st] += torch.diff(done[t:st], prepend=done.new_zeros(1))
            if st < n:  # the stopped tensor's share comes last
                counts[st] += k - (int(done[st - 1]) if st > t else 0)
            if k:
                chunks.append(tuple(g.narrow(0, 0, k) for g in ((idx, val, prev) if absorb else (idx, val))))
            if (st, sw) == (t, w):  # cannot happen with room for 8 words of lanes
                raise RuntimeError(f"diff kernel made no progress at array {lo + t}, word {w} (scratch {room})")
            t, w = st, sw
            if k and t < n:
                room = later
                idx, val, prev = _outputs(room, width, absorb)
    except BaseException:
        if absorb:  # put this run back before the error leaves
            _put_back_all(olds[lo:hi], counts, chunks)
        raise
    return counts, chunks


def _put_back_all(olds: list[torch.Tensor], counts: torch.Tensor, chunks: list[tuple[torch.Tensor, ...]]) -> None:
    """Undo an absorbing scan of ``olds`` whose outputs are ``chunks`` (counts per tensor)."""
    if not chunks:
        return
    idx, prev = (torch.cat([c[i] for c in chunks]) for i in (0, 2))
    put_back_many(olds, counts, idx, prev)


def put_back_many(olds: list[torch.Tensor], counts: torch.Tensor, idx: torch.Tensor, prev: torch.Tensor) -> None:
    """:func:`put_back` of each of ``olds`` in turn, its ``counts[k]`` positions and old bits next in
    ``idx`` (int32) and ``prev``: one call of the host kernel where every one is a contiguous host
    tensor of ``prev``'s width (a rollback of a batch of a model's ~19k tensors: ~8 us a tensor one
    by one, ~0.2 us here), else one by one. The positions came from the scan that advanced ``olds``."""
    lib, width, n = kernel(), prev.element_size(), len(olds)
    if (lib is None or n == 0 or width not in _MOVE_BYTES or idx.dtype != torch.int32 or not idx.is_cpu
            or not prev.is_cpu or not idx.is_contiguous() or not prev.is_contiguous() or counts.numel() != n
            or not all(map(_ON_CPU, olds)) or not all(map(torch.Tensor.is_contiguous, olds))
            or list(map(torch.Tensor.element_size, olds)).count(width) != n):
        offsets = counts.tolist()
        for old, i, p in zip(olds, idx.split(offsets), prev.split(offsets)):
            put_back(old, i, p)
        return
    cnt = counts.to(torch.int64, copy=True)
    start = torch.cumsum(cnt, 0) - cnt
    table = torch.zeros((n, _MOVE_ROW), dtype=torch.int64)
    table[:, 0] = torch.tensor(list(map(torch.Tensor.data_ptr, olds)), dtype=torch.int64)
    table[:, 1] = start * idx.element_size() + idx.data_ptr()
    table[:, 2] = cnt
    table[:, 4] = torch.tensor(list(map(torch.Tensor.numel, olds)), dtype=torch.int64)
    table[:, 5] = start * width + prev.data_ptr()
    table[:, 7] = width | idx.element_size() << 8
    # the kernel's check and run passes called here, not through check_rows / run_rows: those are the
    # apply's (a fault injected there in the tests must not also fail the rollback that follows it)
    bad = ctypes.c_int64()
    if lib.move_rows(n, table.data_ptr(), 1, ctypes.byref(bad)) >= 0:  # (checked first: nothing written)
        raise IndexError(f"a rollback position lies outside its snapshot (entry {bad.value}); nothing was restored")
    lib.move_rows(n, table.data_ptr(), 0, ctypes.byref(bad))


_ON_CPU = operator.attrgetter("is_cpu")


def put_back(old: torch.Tensor, idx: torch.Tensor, prev: torch.Tensor) -> None:
    """Undo an absorbing scan: the old bits ``prev`` back at flat element indices ``idx`` of ``old``
    (any dtype of their width, any device)."""
    if idx.numel():
        old.reshape(-1).view(prev.dtype).index_copy_(0, idx.to(torch.int64), prev)


def run_slices(param: torch.Tensor, start: torch.Tensor, end: torch.Tensor, ptrs: torch.Tensor, cnt: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``r`` covers offsets ``[start[r], end[r])`` of parameter ``param[r]``, whose changed offsets
    are the ``cnt[param[r]]`` int32 at address ``ptrs[param[r]]`` (increasing): where its changes
    begin among them and how many there are, ``(lo, n)`` (one per run). All int64 host tensors."""
    lo, n = torch.empty_like(start), torch.empty_like(start)
    kernel().run_slices(start.numel(), param.data_ptr(), start.data_ptr(), end.data_ptr(), ptrs.data_ptr(),
                        cnt.data_ptr(), lo.data_ptr(), n.data_ptr())
    return lo, n


def gather_runs(rows: torch.Tensor, width: int, total: int, values_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(int32 offsets address, values address, count, shift)`` (an int64 ``[R, 4]`` host
    tensor; ``total``: the counts' sum): every row's offsets plus its shift and its values
    (``width`` bytes each), one row after the other, as ``(int32 indices, values)``."""
    idx = torch.empty(total, dtype=torch.int32)
    vals = torch.empty(total, dtype=values_dtype)
    kernel().gather_runs(rows.shape[0], rows.data_ptr(), width, idx.data_ptr(), vals.data_ptr())
    return idx, vals
