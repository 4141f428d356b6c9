"""Host-memory diff kernel: built on first use, optional, checked against the torch-op path.

The torch-op diff (:mod:`delta_sync.diff`) runs on every device but, on a CPU, spends as much
time on its mask, ``nonzero`` and random gathers as on the compare itself. Snapshots kept in host
memory (the usual choice when accelerator memory is tight) deserve a one-pass scan, so this module
compiles ``_diff_kernel.c`` (plain C99, no Python or torch headers) with the system C compiler
into a per-user cache, loads it with :mod:`ctypes` (which releases the GIL during the call) and
runs contiguous ranges of one tensor on ``torch.get_num_threads()`` threads.

Nothing depends on it: without a compiler, or with ``DELTA_SYNC_NATIVE_DIFF=0``, :func:`kernel`
returns ``None`` and the torch-op path runs. Both produce identical patches (tested).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
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
    """``-mavx2`` where this x86 host has it (the digest's 16-bit multiply-adds run ~1.7x faster)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return []
    return ["-mavx2"] if " avx2" in flags else []
#: output entries per kernel call and thread: bounds scratch to 8 MiB whatever the density.
SCRATCH_ENTRIES = 1 << 20
#: below this many words a tensor is scanned on the calling thread (pool overhead dominates).
MIN_WORDS_PER_THREAD = 1 << 17

_VALUE_DTYPE = {16: torch.int16, 32: torch.int32}


def _cache_dir() -> Path:
    root = os.environ.get("DELTA_SYNC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "delta_sync")
    return Path(root)


def _build() -> Path:
    cc = os.environ.get("CC", "cc")
    src = SOURCE.read_bytes()
    flags = CFLAGS + _cpu_flags()
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
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("host diff kernel unavailable (%s %s); using the torch-op diff",
                    exc, detail.decode(errors="replace").strip()[:500])
        return None
    for width in _VALUE_DTYPE:
        fn = getattr(lib, f"diff_words_{width}")
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.POINTER(ctypes.c_int64)]
    lib.digest_words.restype = ctypes.c_int64
    lib.digest_words.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int16, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="delta_sync-diff")


def supports_words(t: torch.Tensor) -> bool:
    """Host tensor whose bytes the word kernels (digest) can read."""
    return t.device.type == "cpu" and kernel() is not None


def supports(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.element_size() * 8 in _VALUE_DTYPE and kernel() is not None


def _scan(fn, width: int, old64: torch.Tensor, new64: torch.Tensor, first: int, stop: int,
          lanes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # a small tensor needs no more room than its own elements (>= one 8-word block: progress)
    room = min(SCRATCH_ENTRIES, max(8 * lanes, (stop - first) * lanes))
    idx = torch.empty(room, dtype=torch.int32)
    val = torch.empty(room, dtype=_VALUE_DTYPE[width])
    done = ctypes.c_int64()
    out = []
    a, b = old64.data_ptr(), new64.data_ptr()
    w = first
    while w < stop:
        k = fn(a + 8 * w, b + 8 * w, stop - w, w * lanes, idx.data_ptr(), val.data_ptr(), room,
               ctypes.byref(done))
        if k:
            out.append((idx[:k].clone(), val[:k].clone()))
        if done.value == 0:  # cannot happen with room for 8 words of lanes
            raise RuntimeError(f"diff kernel made no progress at word {w} (scratch {room})")
        w += done.value
    return out


def changed_words(old64: torch.Tensor, new64: torch.Tensor, lanes: int
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Changed elements of two host int64 word arrays holding ``lanes`` elements per word.

    Returns index and value-bit parts (int32 flat element indices, strictly increasing across
    the parts in order; values as the signed integer of the element width).
    """
    width = 64 // lanes
    fn = getattr(kernel(), f"diff_words_{width}")
    nwords = old64.numel()
    threads = max(1, min(torch.get_num_threads(), nwords // MIN_WORDS_PER_THREAD))
    if threads == 1:
        parts = _scan(fn, width, old64, new64, 0, nwords, lanes)
    else:
        step = -(-nwords // threads)
        futures = [_pool(threads).submit(_scan, fn, width, old64, new64, s, min(s + step, nwords),
                                         lanes) for s in range(0, nwords, step)]
        parts = [p for f in futures for p in f.result()]
    return [i for i, _ in parts], [v for _, v in parts]
