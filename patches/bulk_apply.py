"""A seed or full update on one worker, written through the loader views as its buckets arrive.

No undo copy: from the first write on, the worker reports ``needs_seed`` (and ``partial``) until
the version completes. Each range's digest and finiteness are checked in the pass that writes it
where the view allows (a worker holding whole tensors), else before writing; ranges received
straight into the parameters (:meth:`BulkWrite.place`) are digested after the fact. A mismatch
fails the update, which leaves the worker needing a seed.
"""

from __future__ import annotations

import itertools
import time
from typing import Protocol

import torch

from delta_sync.bucket import check_dense_entry, check_dense_table
from delta_sync.catalog import DenseTable
from delta_sync.digest import (Digest, parse_texts, row_spec, rows_supported, scan_many, scan_range, scan_rows_table,
                               sum_rows)
from delta_sync.errors import DeltaSyncError, NeedsSeed, PatchValidationError
from delta_sync.patch import DTYPES, Patch

from .loader_views import (apply_dense_range, dense_range_copies, dense_range_rows, dense_range_target, flat_param,
                           param_extent, routes_for)


class WorkerWeights(Protocol):
    """What the writers need of a worker's receiver (:class:`~patches.vllm_receiver.DeltaSyncReceiver`):
    its model, loader views and seeded shapes, and the state a write changes."""

    model: torch.nn.Module
    views: dict  # checkpoint name -> LoaderView
    fallback: dict[str, str]  # names without a view -> why
    fallback_values: dict[str, torch.Tensor]  # their whole values, as handed to vLLM's loader
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    channel: object
    version: int | None
    needs_seed: bool
    partial: bool
    last_error: str | None
    param_table: object  # a ParamTable: the model's parameters by name, read through their modules
    routes: object  # a TableRoutes for the last catalogue a delta's tables named, and its key
    routes_key: tuple | None

    def probe(self, names_shapes: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None: ...

    def check_catalog(self, catalog) -> None: ...  # raises NeedsSeed where it numbers a tensor not as seeded

    def holds_whole_tensors(self) -> bool: ...

    def kept(self) -> str: ...

    def loader_layout(self): ...

#: what a worker keeps when a bulk update fails after its first write
PARTIAL = "engine paused with partially written weights; needs_seed: the next update must be a full seed"


def covered(views) -> dict[str, int]:
    """Per parameter, how many of its elements the segments of ``views`` write."""
    out: dict[str, int] = {}
    for view in views:
        for seg in view.segments:
            out[seg.param] = out.get(seg.param, 0) + seg.numel
    return out


class BulkWrite:
    """What one seed/full update has written so far on this worker, and the writes themselves."""

    def __init__(self, receiver: WorkerWeights):
        self.r = receiver
        self.writing = False
        self.done: dict[str, int] = {}  # name -> elements written, ranges arrive in order
        self.numel: dict[str, int] = {}
        self.pending: dict[str, list[torch.Tensor]] = {}  # fallback names: ranges until complete
        self.apply_s = 0.0
        self.placed = 0  # ranges received straight into the parameters
        self._params = None
        self._extents: dict[str, tuple[int, int] | None] = {}  # host parameters' extents (the rows' targets)
        self._dtypes: dict[str, torch.dtype] = {}  # parameters' dtypes, read once per update
        #: the ids of the dense tables written by id (:meth:`apply_table`), and the routes they took
        self.tabled: list[torch.Tensor] = []
        self._table_routes = None

    def params(self) -> dict[str, torch.Tensor]:
        if self._params is None:
            self._params = dict(self.r.model.named_parameters())
        return self._params

    def begin(self) -> None:
        """The first write: the old version is being overwritten."""
        if not self.writing:
            self.writing = True
            self.r.version, self.r.needs_seed = None, True
            self.r.partial = True

    def _advance(self, name: str, start: int, count: int, numel: int) -> None:
        have = self.done.get(name, 0)
        if start != have:
            raise PatchValidationError(name, f"dense range starts at {start}, expected {have}", kept="needs_seed")
        self.done[name] = have + count
        self.numel[name] = numel

    # ---- on the receive thread -------------------------------------------------------------------
    def place(self, header: dict) -> dict[int, torch.Tensor]:
        """Where a bulk bucket's ``seg`` entries are received (on the receive thread): the
        parameter slice of each range that lies in one contiguous segment of its loader view, in
        the range's dtype and known shape. Other entries arrive in the bucket's arena and are
        written by :meth:`apply_bucket`, which also checks every range's digest after the fact."""
        dense = [(i, e) for i, e in enumerate(header["entries"])
                 if e.get("encoding") == "dense" and e.get("dtype") in DTYPES]
        segs = [(i, e) for i, e in dense if e.get("seg")]
        if not segs:
            return {}
        # the whole bucket's new names in one loader call: the applying thread then probes nothing
        self.r.probe([(e["name"], tuple(int(d) for d in e["shape"]), DTYPES[e["dtype"]]) for _, e in dense])
        params = self.params()
        out = {}
        for i, e in segs:
            shape, dtype = tuple(int(d) for d in e["shape"]), DTYPES[e["dtype"]]
            view = self.r.views.get(e["name"])
            if view is None or self.r.shapes.get(e["name"], (shape, dtype)) != (shape, dtype):
                continue  # the applying thread names what is wrong
            dst = dense_range_target(view, params, int(e["start"]), int(e["count"]))
            if dst is not None and dst.dtype == dtype and dst.device == self.r.channel.device:
                out[i] = dst
                e["_placed"] = True  # already written: the applying thread only digests it
        if out:
            self.begin()
            self.placed += len(out)
        return out

    # ---- on the applying thread ------------------------------------------------------------------
    def apply_bucket(self, entries: list[tuple[dict, Patch]]) -> None:
        """One bucket's dense ranges, written through their loader views now (names seen for the
        first time are probed together, one loader call)."""
        self.begin()
        t0 = time.perf_counter()
        entry, p = entries[0] if entries else ({"start": 0}, None)
        try:
            self.r.probe([(p.name, p.shape, p.dtype) for _, p in entries])
            placed: list[tuple[dict, Patch]] = []
            copies: list[tuple[dict, Patch, list]] = []
            rows: list[tuple[dict, Patch, list]] = []
            whole = self.r.holds_whole_tensors() and rows_supported()  # (rows: the host kernel's)
            at_once = (self._whole_rows(entries) if whole else None) or {}
            for k, (entry, p) in enumerate(entries):
                made = at_once.get(k)
                if made is not None:
                    rows.append(made)
                else:
                    self._write_range(entry, p, placed, copies, rows if whole else None)
            # ranges received in place, and the copies into whole-tensor views made in the pass that
            # digests them: one scan for the bucket, spread over the threads; checked in order after
            items = [(p.values, int(entry["start"]), None) for entry, p in placed]
            items += [(part, lo, dst) for _, _, hits in copies for dst, part, lo in hits]
            key = next((e["_key"] for e, _ in entries if "_key" in e), None)
            try:
                scans = iter(scan_many(items, key=key))
            except Exception:
                owners = [*placed, *((e, q) for e, q, hits in copies for _ in hits)]
                entry, p = owners[failing(items, key)]  # the failure names its range, not the bucket's last
                raise
            for entry, p in placed:
                check_dense_entry(entry, *next(scans), p.values, "needs_seed")
            for entry, p, hits in copies:
                total, bad = Digest(), 0
                for d, b in itertools.islice(scans, len(hits)):
                    total, bad = total + d, bad + b
                check_dense_entry(entry, total, bad, p.values, "needs_seed")
            self._scan_rows(rows)  # (the copies' kind, checked after them as the copies were)
        except DeltaSyncError:
            raise
        except Exception as e:
            what = f"{p.name!r} [{entry['start']}, +{p.count})" if p is not None else "a bucket"
            raise DeltaSyncError(f"apply of {what} failed: {type(e).__name__}: {e}", kept=PARTIAL) from e
        finally:
            self.apply_s += time.perf_counter() - t0

    def apply_table(self, table: DenseTable) -> None:
        """A bulk bucket's dense table (whole catalogued tensors): each tensor copied to the one run of
        a host parameter that a delta's table entry of it goes to (:class:`~patches.loader_views.TableRoutes`),
        digested in the same pass and checked after it, as columns: no Python step per tensor. Where
        any of them is routed otherwise (not probed here yet, strided, off the host, not seeded as
        catalogued), the table is written tensor by tensor as entries (:meth:`apply_bucket`)."""
        dst = self._table_targets(table)
        if dst is None:
            self.apply_bucket(table.patches())
            return
        self.begin()
        t0 = time.perf_counter()
        try:
            check_dense_table(table, "needs_seed", dst)
        except DeltaSyncError:
            raise
        except Exception as e:
            raise DeltaSyncError(f"apply of {table.where}'s dense table failed: {type(e).__name__}: {e}",
                                 kept=PARTIAL) from e
        finally:
            self.apply_s += time.perf_counter() - t0
        self.tabled.append(table.ids)

    def _table_targets(self, table: DenseTable) -> torch.Tensor | None:
        """The host address each tensor of ``table`` is written to, in order; None where one of them
        is not one run of a host parameter (the caller then writes them as entries)."""
        r = self.r
        if not (r.holds_whole_tensors() and rows_supported()):
            return None
        try:
            r.check_catalog(table.catalog)
        except NeedsSeed:  # named tensor by tensor, as entries
            return None
        routes = routes_for(r, table.catalog)
        if routes is not self._table_routes:  # (once per update) its parameters are still where they were
            params = self.params()
            if any(name not in params or flat_param(params[name]).data_ptr() != flat.data_ptr()
                   for name, flat in routes.targets.items()):
                r.routes = None  # made again, from the parameters as they are now
                routes = routes_for(r, table.catalog)
            self._table_routes = routes
        ids = table.ids
        if bool((routes.how[ids] != 1).any()):
            return None
        cols = routes.cols[ids]
        if bool((cols[:, 1] + table.counts > cols[:, 2]).any()):  # (routes hold whole tensors: never)
            return None
        return cols[:, 0] + cols[:, 1] * (cols[:, 3] & 0xFF)

    def _whole_rows(self, entries: list[tuple[dict, Patch]]) -> dict[int, tuple[dict, Patch, list]] | None:
        """:meth:`_write_range`'s rows, by position, for the ranges of a bucket that hold whole
        tensors new to this update (all but the one or two a bucket's bounds cut), checked as
        lists (a 30B-A3B seed has ~19k ranges: a round of calls each was ~5 us): on the host, each
        view holds its tensor in contiguous runs of host parameters of its dtype, its shape the
        seeded one. None, having changed nothing, where any of that fails: the caller then writes
        range by range, naming what is wrong."""
        at = [k for k, (e, p) in enumerate(entries) if e["start"] == 0 and not e.get("_placed") and p.count == p.numel]
        if not at:
            return None
        chosen = [entries[k] for k in at]
        names = [p.name for _, p in chosen]
        views = list(map(self.r.views.get, names))
        if None in views or len(set(names)) != len(names) or not self.done.keys().isdisjoint(names):
            return None
        runs = [v.runs for v in views]
        metas = [(p.shape, p.dtype) for _, p in chosen]
        known = self.r.shapes
        if None in runs or any(k is not None and k != m for k, m in zip(map(known.get, names), metas)) or \
                not all(p.values.is_cpu and p.values.is_contiguous() for _, p in chosen):
            return None
        dtypes = self._dtypes
        for param in {param for r in runs for param, _, _, _ in r}:
            if param not in dtypes:
                dtypes[param] = self.params()[param].dtype
            if self._extent(param) is None:
                return None
        if any(dtypes[param] != dt for r, (_, dt) in zip(runs, metas) for param, _, _, _ in r):
            return None
        out = {k: (entry, p, dense_range_rows(r, self._extent, p.values, 0, row_spec(dt)))
               for k, (entry, p), r, (_, dt) in zip(at, chosen, runs, metas)}
        numels = [p.count for _, p in chosen]
        self.done.update(zip(names, numels))
        self.numel.update(zip(names, numels))
        known.update(zip(names, metas))
        return out

    def _check_target(self, p: Patch, view) -> None:
        known = self.r.shapes.get(p.name)
        if known is not None and known != (p.shape, p.dtype):
            raise PatchValidationError(p.name, f"shape/dtype {p.shape}/{p.dtype} differ from the seeded "
                                       f"{known[0]}/{known[1]}", kept="needs_seed")
        if view is None:
            return
        dtypes = self._dtypes
        for seg in view.segments:
            held = dtypes.get(seg.param)
            if held is None:
                held = dtypes[seg.param] = self.params()[seg.param].dtype
            if held != p.dtype:  # copy_ would convert silently, and every later digest would disagree
                raise PatchValidationError(p.name, f"arrives as {p.dtype} but the engine holds it as {held}; "
                                           f"convert on the trainer (WeightSync(dtype={held}))", kept="needs_seed")

    def _write_range(self, entry: dict, p: Patch, placed: list[tuple[dict, Patch]], copies: list,
                     rows: list | None) -> None:
        """Check one range and write it through its view (digested before it), or leave the write to
        the caller: a range received in place joins ``placed``; one whose view holds the whole
        tensor in contiguous segments joins ``rows`` as the digest kernel's rows where it and its
        parameters are on the host (given where the worker holds whole tensors), else ``copies``
        with its segments' slices (either way the caller copies and digests in one pass, and
        checks after)."""
        view = self.r.views.get(p.name)  # probed for the whole bucket by apply_bucket
        self._check_target(p, view)
        start = int(entry["start"])
        self._advance(p.name, start, p.count, p.numel)
        self.r.shapes[p.name] = (p.shape, p.dtype)
        if entry.get("_placed"):
            placed.append((entry, p))
            return
        if rows is not None and view is not None and view.runs is not None:
            got = dense_range_rows(view.runs, self._extent, p.values, start, row_spec(p.dtype))
            if got is not None:
                rows.append((entry, p, got))
                return
        params = self.params()
        with torch.no_grad():
            hits = dense_range_copies(view, params, p.values, start) \
                if view is not None and self.r.holds_whole_tensors() else None
            if hits is not None:  # written and digested in one pass by the caller: compared after the write
                copies.append((entry, p, hits))
                return
            check_dense_entry(entry, *scan_range(p.values, start, key=entry["_key"]), p.values, "needs_seed")
            if view is not None:
                apply_dense_range(view, params, p.values, start)
            else:  # vLLM's loader needs the whole tensor: hold its ranges until the last one
                parts = self.pending.setdefault(p.name, [])
                parts.append(p.values.clone())
                if self.done[p.name] == p.numel:
                    full = torch.cat(self.pending.pop(p.name)).reshape(p.shape)
                    with self.r.loader_layout():
                        self.r.model.load_weights([(p.name, full)])
                    self.r.fallback_values[p.name] = full

    def _extent(self, name: str) -> tuple[int, int] | None:
        """:func:`param_extent` of parameter ``name`` where it is on the host (once per update)."""
        if name not in self._extents:
            param = self.params()[name]
            self._extents[name] = param_extent(param) if param.is_cpu else None
        return self._extents[name]

    def _scan_rows(self, rows: list[tuple[dict, Patch, list]]) -> None:
        """Copy and digest the ranges made rows (:meth:`_write_range`) in one pass, spread over the
        threads, and check each one's digest and finiteness after (the write has happened: a
        mismatch leaves the worker needing a seed): one compare for the bucket against its header's
        texts, and range by range only to name the first that fails."""
        if not rows:
            return
        entries = [e for e, _, _ in rows]
        key = entries[0].get("_key")
        table = scan_rows_table([r for _, _, got in rows for r in got], key=key)
        if any(len(got) != 1 for _, _, got in rows):  # ranges of several rows (or none): added up
            table = sum_rows(table, [k for k, (_, _, got) in enumerate(rows) for _ in got], len(rows), key)
        want = parse_texts([e.get("digest") for e in entries])
        if key is not None and want is not None and all(e.get("_key") is key for e in entries) and \
                bool((key.masked_table(table, [e["_at"] for e in entries]) == want).all()) and \
                not bool(table[:, -1].any()):
            return
        for (entry, p, _), sums in zip(rows, table.tolist()):
            check_dense_entry(entry, Digest.of_residues(sums[:-1]), sums[-1], p.values, "needs_seed")

    # ---- once every bucket arrived ---------------------------------------------------------------
    def check_complete(self, upd, kept: str) -> None:
        """Every range of every tensor it started, every tensor seeded before, every parameter."""
        short = [n for n, k in self.done.items() if k != self.numel[n]]
        if short:
            raise PatchValidationError(short[0], f"{upd.kind} v{upd.version} ended with {self.done[short[0]]} of "
                                       f"{self.numel[short[0]]} elements written", kept=kept)
        ids = torch.cat(self.tabled) if self.tabled else None  # (each once: the receive checked it)
        written = set(self.done)
        if ids is not None:
            names = self._table_routes.catalog.names
            written.update(names[i] for i in ids.tolist())
        missing = sorted(set(self.r.shapes) - written)
        if missing:
            raise PatchValidationError(missing[0], f"{upd.kind} v{upd.version} left out {len(missing)} seeded "
                                       f"tensor(s); they would keep stale values", kept=kept)
        self._check_every_parameter_written(upd, ids)

    def _check_every_parameter_written(self, upd, tabled: torch.Tensor | None) -> None:
        """A seed/full update must write every element of every parameter this worker holds (through
        the loader views of the names it sent); an element it left out would keep the value this
        engine loaded at start, and every digest of the names sent would still agree. Names that went
        through vLLM's own loader write where that decides: with one of those in the update, the
        parameters are not counted against it. ``tabled``: the ids of the tensors written by id
        (:meth:`apply_table`), each one whole in one run of the parameter its route names."""
        if any(name in self.r.fallback for name in self.done):
            return
        written = covered(self.r.views[name] for name in self.done)
        if tabled is not None:  # their runs' elements summed per parameter, as columns
            routes = self._table_routes
            at, inverse = torch.unique(routes.cols[tabled, 0], return_inverse=True)
            sums = torch.zeros(at.numel(), dtype=torch.int64).index_add_(0, inverse, routes.catalog.numel[tabled])
            param_at = {flat.data_ptr(): name for name, flat in routes.targets.items()}
            for address, n in zip(at.tolist(), sums.tolist()):
                written[param_at[address]] = written.get(param_at[address], 0) + n
        short = [(pname, written.get(pname, 0), p.numel()) for pname, p in self.params().items()
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


def failing(items: list[tuple[torch.Tensor, int, torch.Tensor | None]], key) -> int:
    """Which of a bucket's scan items fails when scanned alone (after their scan together failed,
    to name its range); the last one if none does."""
    for k, item in enumerate(items):
        try:
            scan_range(*item, key=key)
        except Exception:  # noqa: BLE001 - looking for the one that fails
            return k
    return len(items) - 1
