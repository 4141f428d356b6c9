"""Loader views on stand-in modules whose loaders fuse, slice and transpose like vLLM's."""

import types

import pytest
import torch

from delta_sync.digest import Digest, digest_tensor, scan_many
from patches.loader_views import (UndoLog, apply_dense, apply_dense_range, apply_sparse, digest_view, probe_views,
                                  read_through)


class FusedStandIn(torch.nn.Module):
    """q/k rows fused into one parameter, a column-sliced (TP rank 1 of 2) matrix, a transposed
    copy (like vLLM-Ascend's w13 after loading), and a loader that computes on its source."""

    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(10, 4), requires_grad=False)
        self.cols = torch.nn.Parameter(torch.zeros(6, 3), requires_grad=False)
        self.tr = torch.nn.Parameter(torch.zeros(5, 7), requires_grad=False)
        self.scaled = torch.nn.Parameter(torch.zeros(3), requires_grad=False)

    def load_weights(self, items):
        for name, w in items:
            if name == "q":
                self.qk.data[:6].copy_(w)
            elif name == "k":
                self.qk.data[6:].copy_(w)
            elif name == "cols":
                self.cols.data.copy_(w[:, 3:])
            elif name == "tr":
                self.tr.data.copy_(w.t())
            elif name == "scaled":
                self.scaled.data.copy_(w * 2)


SPECS = [("q", (6, 4)), ("k", (4, 4)), ("cols", (6, 6)), ("tr", (7, 5)), ("scaled", (3,))]


def _reference(state):
    m = FusedStandIn()
    m.load_weights(state.items())
    return m


@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0])
def test_views_match_the_loader(density):
    g = torch.Generator().manual_seed(int(density * 10))
    model = FusedStandIn()
    views, unsupported = probe_views(model, [(n, s, torch.float32) for n, s in SPECS], whole=False)
    assert set(unsupported) == {"scaled"} and "computed" in unsupported["scaled"]
    assert all(p.abs().sum() == 0 for p in model.parameters())  # probing wrote nothing
    assert views["q"].segments[0].contiguous and not views["cols"].segments[0].contiguous
    params = dict(model.named_parameters())
    state = {n: torch.randn(s, generator=g) for n, s in SPECS if n != "scaled"}
    for n, t in state.items():
        apply_dense(views[n], params, t, None)
    new = {n: t.clone() for n, t in state.items()}
    undo = UndoLog()
    for n, t in new.items():
        flat = t.view(-1)
        k = int(flat.numel() * density)
        idx = torch.randperm(flat.numel(), generator=g)[:k].sort().values
        flat[idx] = torch.randn(k, generator=g)
        apply_sparse(views[n], params, idx.to(torch.int32), flat[idx], undo)
    ref = _reference(new)
    for name, p in params.items():
        if name != "scaled":
            assert torch.equal(p, dict(ref.named_parameters())[name]), name
    for n, t in new.items():
        idx, vals = read_through(views[n], params)
        assert torch.equal(t.view(-1)[idx], vals)
        digest, count = digest_view(views[n], params)  # contiguous, row-wise and transposed segments
        if n == "cols":  # this worker holds columns 3..5 only
            assert count == 18 and digest == digest_tensor(torch.where(_held_cols(), t, torch.zeros_like(t)))
        else:
            assert count == t.numel() and digest == digest_tensor(t), n
    undo.restore()
    ref = _reference(state)
    for name, p in params.items():
        if name != "scaled":
            assert torch.equal(p, dict(ref.named_parameters())[name]), name


def _held_cols() -> torch.Tensor:
    held = torch.zeros(6, 6, dtype=torch.bool)
    held[:, 3:] = True
    return held


@pytest.mark.parametrize("pieces", [1, 2, 5])
def test_dense_ranges_in_any_split_equal_the_loader(pieces):
    """A seed arrives as ranges cut at bucket boundaries, anywhere inside a tensor."""
    g = torch.Generator().manual_seed(pieces)
    model = FusedStandIn()
    views, _ = probe_views(model, [(n, s, torch.float32) for n, s in SPECS], whole=False)
    params = dict(model.named_parameters())
    state = {n: torch.randn(s, generator=g) for n, s in SPECS if n != "scaled"}
    for n, t in state.items():
        flat = t.reshape(-1)
        cuts = sorted({0, flat.numel(), *torch.randint(1, flat.numel(), (pieces - 1,), generator=g).tolist()})
        for a, b in zip(cuts, cuts[1:]):
            apply_dense_range(views[n], params, flat[a:b], a)
    ref = _reference(state)
    for name, p in params.items():
        if name != "scaled":
            assert torch.equal(p, dict(ref.named_parameters())[name]), name


@pytest.mark.parametrize("pieces", [1, 3])
def test_dense_ranges_as_kernel_rows_equal_the_loader_and_their_digests(pieces):
    """A seed's ranges through views of contiguous runs (``LoaderView.runs``) become rows of the
    digest kernel, addresses worked out from integers: copied and digested in one pass, the
    parameters equal to the loader's and each range's digest to its own; views of any other
    layout have no runs, a range off the host makes no rows, and a run outside its parameter's
    storage is refused before anything is written."""
    from delta_sync.digest import row_spec, scan_rows
    from patches.loader_views import dense_range_rows, param_extent

    g = torch.Generator().manual_seed(pieces)
    model = FusedStandIn()
    views, _ = probe_views(model, [(n, s, torch.float32) for n, s in SPECS], whole=False)
    assert views["q"].runs == (("qk", 0, 24, 0),) and views["k"].runs == (("qk", 0, 16, 24),)
    assert views["cols"].runs is None and views["tr"].runs is None  # strided: the tensor path
    params = dict(model.named_parameters())
    extent = {n: param_extent(p) for n, p in params.items()}
    spec = row_spec(torch.float32)
    state = {n: torch.randn(s, generator=g) for n, s in SPECS if n in ("q", "k")}
    rows, ranges = [], []
    for n, t in state.items():
        flat = t.reshape(-1)
        cuts = sorted({0, flat.numel(), *torch.randint(1, flat.numel(), (pieces - 1,), generator=g).tolist()})
        for a, b in zip(cuts, cuts[1:]):
            got = dense_range_rows(views[n].runs, extent.get, flat[a:b], a, spec)
            assert len(got) == 1
            rows += got
            ranges.append((flat[a:b], a))
    assert not torch.equal(params["qk"], torch.cat([state["q"], state["k"]]))
    assert scan_rows(rows) == scan_many([(v, a, None) for v, a in ranges])
    assert torch.equal(params["qk"], torch.cat([state["q"], state["k"]]))  # written in the scan
    assert dense_range_rows(views["q"].runs, lambda name: None, state["q"].reshape(-1), 0, spec) is None
    assert dense_range_rows(views["q"].runs, extent.get, torch.randn(24, 2)[:, 0], 0, spec) is None
    before = params["qk"].clone()
    with pytest.raises(ValueError, match="outside its storage"):
        dense_range_rows((("qk", 0, 24, 20),), extent.get, torch.randn(24), 0, spec)
    assert torch.equal(params["qk"], before)  # nothing written


def test_many_views_digested_together_equal_one_by_one():
    """A sweep's or a verify's digests of many views (contiguous segments read as kernel rows in one
    scan, strided and transposed ones one by one, views of no segment) equal :func:`digest_view`
    of each, counts included; a segment outside its parameter's storage is refused."""
    from patches.loader_views import LoaderView, Segment, view_digests

    g = torch.Generator().manual_seed(8)
    model = FusedStandIn()
    views, _ = probe_views(model, [(n, s, torch.float32) for n, s in SPECS], whole=False)
    params = dict(model.named_parameters())
    for n, t in {n: torch.randn(s, generator=g) for n, s in SPECS if n != "scaled"}.items():
        apply_dense(views[n], params, t, None)
    some = [views["q"], views["cols"], views["k"], views["tr"], LoaderView("none", (3,), torch.float32),
            views["k"]]
    table, counts = view_digests(some, params)
    assert [(Digest.of_residues(tuple(r)), n) for r, n in zip(table.tolist(), counts)] == \
        [digest_view(v, params) for v in some]
    assert view_digests([], params)[0].shape == (0, 4) and view_digests([], params)[1] == []
    # a device's parameters (no kernel rows): contiguous views as ranges of one scan, the others'
    # lanes computed there and read back in one wait, not one each
    from launchers.device_check import OpCounter
    import patches.loader_views as lv

    real, summed = lv.view_sums, []

    def on_device(view, ps):  # (what view_sums gives for device parameters: lanes on the device)
        summed.append(view.name)
        got = real(view, ps)
        OpCounter.device(got[0])
        return got
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lv, "rows_supported", lambda: False)  # (device parameters make no kernel rows)
        mp.setattr(lv, "view_sums", on_device)
        with OpCounter() as ops:
            again, _ = view_digests(some, params)
    assert torch.equal(again, table) and ops.which == {"cpu": 1}, ops.counts()
    assert summed == ["cols", "tr", "none"]  # (q and k: contiguous, no position per element made)
    # experts stored transposed (vLLM-Ascend's w13/w2): each one's checkpoint side one run, the
    # parameter's strided; copied into runs a bounded number of bytes at a time
    w = torch.randn(2, 6, 4, generator=g)  # two experts of (4, 6) in the checkpoint, stored (6, 4)
    experts = [LoaderView(f"e{e}", (4, 6), torch.float32, [Segment("w", (4, 6), 0, (6, 1), 24 * e, (1, 4))])
               for e in range(2)]
    assert all(v.segments[0].src_run and not v.segments[0].contiguous for v in experts)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lv, "rows_supported", lambda: False)
        mp.setattr(lv, "RUN_COPY_BYTES", 100)  # (one expert's copy at a time)
        summed.clear()
        mp.setattr(lv, "view_sums", on_device)
        got, counts = view_digests(experts + [views["cols"]], {**params, "w": w})
    assert [(Digest.of_residues(tuple(r)), n) for r, n in zip(got.tolist(), counts)] == \
        [digest_view(v, {**params, "w": w}) for v in experts + [views["cols"]]] and summed == ["cols"]
    outside = LoaderView("outside", (40,), torch.float32, [Segment("qk", (40,), 0, (1,), 10, (1,))])
    with pytest.raises(ValueError, match="outside its storage"):
        view_digests([views["q"], outside], params)


class _StandInReceiver:
    """What a seed's bulk writer reads and sets of a worker's receiver, around a plain module and
    hand-made views (a stand-in: no vLLM here)."""

    def __init__(self, model: torch.nn.Module, views: dict):
        self.model, self.views = model, views
        self.fallback, self.fallback_values, self.shapes = {}, {}, {}
        self.channel = types.SimpleNamespace(device=torch.device("cpu"))
        self.version, self.needs_seed, self.partial, self.last_error = 0, False, False, None

    def probe(self, names_shapes) -> None:
        pass

    def holds_whole_tensors(self) -> bool:
        return True

    def kept(self) -> str:
        return "v0"


@pytest.mark.parametrize("order", ["empty first", "empty last"])
def test_a_seed_bucket_of_ranges_of_several_rows_and_of_none_checks_each_against_its_own_digest(order):
    """A bucket's ranges through whole-tensor views: one spans two parameters (two kernel rows), an
    empty tensor's range makes none; each range's digest is the sum of its own rows (an empty one's
    is zero), so correct values pass and are written, and a flipped bit fails naming its tensor."""
    from delta_sync.bucket import BucketPacker, entry_patches
    from delta_sync.digest import DigestKey
    from delta_sync.errors import ChecksumMismatch
    from delta_sync.patch import Patch
    from patches.bulk_apply import BulkWrite
    from patches.loader_views import LoaderView, Segment

    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16), requires_grad=False)
    model.b = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16), requires_grad=False)
    views = {"x": LoaderView("x", (16,), torch.bfloat16, [Segment("a", (8,), 0, (1,), 0, (1,)),
                                                          Segment("b", (8,), 8, (1,), 0, (1,))]),
             "e": LoaderView("e", (0,), torch.bfloat16, [Segment("a", (0,), 0, (1,), 0, (1,))])}
    x = torch.randn(16, generator=torch.Generator().manual_seed(2)).bfloat16()
    patches = [Patch.full("e", torch.zeros(0, dtype=torch.bfloat16)), Patch.full("x", x)]
    packer = BucketPacker(1, "seed", 1 << 20)
    packer.keys = lambda nonce: DigestKey.derive(b"k" * 32, nonce)
    (bucket,) = list(packer.pack(patches if order == "empty first" else patches[::-1]))
    entries = entry_patches(bucket, check_dense=False)
    assert [e["count"] for e, _ in entries] == ([0, 16] if order == "empty first" else [16, 0])
    BulkWrite(_StandInReceiver(model, views)).apply_bucket(entries)
    assert torch.equal(torch.cat([model.a, model.b]).view(torch.int16), x.view(torch.int16))
    bucket.values["bfloat16"].view(torch.int16)[3] ^= 0x0100  # in flight, after the sender's digest
    with pytest.raises(ChecksumMismatch, match="'x' values"):
        BulkWrite(_StandInReceiver(model, views)).apply_bucket(entry_patches(bucket, check_dense=False))
    (alone,) = list(packer.pack(patches[:1]))  # a bucket of the empty range only: no row at all
    BulkWrite(_StandInReceiver(model, views)).apply_bucket(entry_patches(alone, check_dense=False))


@pytest.mark.parametrize("case", ["whole", "split", "seen", "dtype", "shape", "outside"])
def test_a_seed_bucket_of_whole_tensors_written_at_once_as_range_by_range(monkeypatch, case):
    """A bucket of whole tensors new to the update, through whole-tensor views, is checked and
    made rows as lists; its writes, digests and bookkeeping are those of the range-by-range path.
    A tensor split across buckets, one written before in this update, a parameter of another
    dtype or a shape other than the seeded one go range by range, which names what is wrong."""
    from delta_sync.bucket import BucketPacker, entry_patches
    from delta_sync.digest import DigestKey
    from delta_sync.errors import DeltaSyncError
    from delta_sync.patch import Patch
    from patches.bulk_apply import BulkWrite
    from patches.loader_views import LoaderView, Segment

    def run(whole_rows: bool):
        model = torch.nn.Module()
        model.a = torch.nn.Parameter(torch.zeros(52, dtype=torch.float32 if case == "dtype" else torch.bfloat16),
                                     requires_grad=False)
        model.b = torch.nn.Parameter(torch.zeros(48, dtype=torch.bfloat16), requires_grad=False)
        views = {"x": LoaderView("x", (2, 40), torch.bfloat16, [Segment("a", (40,), 0, (1,), 12, (1,)),
                                                                Segment("b", (40,), 40, (1,), 4, (1,))]),
                 "y": LoaderView("y", (3, 4), torch.bfloat16, [Segment("a", (12,), 0, (1,), 0, (1,))]),
                 "z": LoaderView("z", (4,), torch.bfloat16, [Segment("b", (4,), 0, (1,), 0, (1,))])}
        if case == "outside":
            views["z"] = LoaderView("z", (4,), torch.bfloat16, [Segment("b", (4,), 0, (1,), 46, (1,))])
        g = torch.Generator().manual_seed(4)
        state = {n: torch.randn(v.shape, generator=g).bfloat16() for n, v in views.items()}
        packer = BucketPacker(1, "seed", 64 if case == "split" else 1 << 20)
        packer.keys = lambda nonce: DigestKey.derive(b"k" * 32, nonce)
        buckets = list(packer.pack([Patch.full(n, t) for n, t in state.items()]))
        receiver = _StandInReceiver(model, views)
        if case == "shape":
            receiver.shapes["y"] = ((12,), torch.bfloat16)
        writer = BulkWrite(receiver)
        if not whole_rows:
            monkeypatch.setattr(BulkWrite, "_whole_rows", lambda self, entries: None)
        if case == "seen":
            writer.done["z"] = writer.numel["z"] = 4  # (written once already)
        for bucket in buckets:
            writer.apply_bucket(entry_patches(bucket, check_dense=False))
        monkeypatch.undo()
        return state, model, writer, receiver

    if case in ("dtype", "shape", "seen", "outside"):
        match = {"dtype": "arrives as torch.bfloat16 but the engine holds it as torch.float32",
                 "shape": "differ from the seeded", "seen": "starts at 0, expected", "outside": "outside its storage"}
        with pytest.raises(DeltaSyncError, match=match[case]):
            run(True)
        return
    made, real = [], BulkWrite._whole_rows
    monkeypatch.setattr(BulkWrite, "_whole_rows", lambda self, entries: made.append(real(self, entries)) or made[-1])
    state, model, writer, receiver = run(True)
    # whole tensors at once, a split tensor's pieces range by range (beside them in the last bucket)
    got = [None if m is None else sorted(e["name"] for e, _, _ in m.values()) for m in made]
    assert got == ([["x", "y", "z"]] if case == "whole" else [None, None, ["y", "z"]]), got
    _, model2, writer2, receiver2 = run(False)
    bits = lambda m: torch.cat([m.a, m.b]).view(torch.int16)  # noqa: E731
    assert torch.equal(bits(model), bits(model2))
    assert torch.equal(model.a[12:].view(torch.int16), state["x"].view(-1)[:40].view(torch.int16))
    assert torch.equal(model.b[:4].view(torch.int16), state["z"].view(torch.int16))
    assert (writer.done, writer.numel, receiver.shapes) == (writer2.done, writer2.numel, receiver2.shapes)
    assert writer.done == {"x": 80, "y": 12, "z": 4} and (len(writer.r.shapes) == 3)


class OddLoaders(torch.nn.Module):
    """Loaders that write parameters in ways a strided-copy view cannot replay."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)

    def load_weights(self, items):
        for name, w in items:
            if name == "setitem":  # param[rows] = f(w): __setitem__ of a computed value
                self.p.data[:2] = w[:2] + 1
            elif name == "index_copy":
                self.p.data.index_copy_(0, torch.tensor([0, 1]), w[:2])
            elif name == "fill":
                self.p.data.fill_(0.5)
            elif name == "twice":  # the same checkpoint rows land in two places
                self.p.data[:2].copy_(w[:2])
                self.p.data[2:4].copy_(w[:2])
                self.p.data[4:8].copy_(w[2:6])
            elif name == "half":  # a whole-tensor worker that keeps half of it
                self.p.data[:4].copy_(w[:4])
            elif name == "plain":
                self.p.data.copy_(w)


@pytest.mark.parametrize("name,why", [("setitem", "computed"), ("index_copy", "index_copy"), ("fill", "fill"),
                                      ("twice", "written by two segments"), ("half", "cover 16 of 32")])
def test_writes_a_view_cannot_replay_are_refused(name, why):
    model = OddLoaders()
    views, unsupported = probe_views(model, [(name, (8, 4), torch.float32), ("plain", (8, 4), torch.float32)])
    assert set(views) == {"plain"} and why in unsupported[name], unsupported
    assert model.p.abs().sum() == 0  # probing wrote nothing, whatever the loader tried


def test_probing_is_scoped_to_its_thread():
    """Another thread's copy_ into a parameter while a probe runs is performed (no process-wide patch)."""
    import threading

    model = OddLoaders()
    started, done = threading.Event(), threading.Event()

    def slow_loader(items):
        started.set()
        done.wait(10)
        model.load_weights(items)

    th = threading.Thread(target=lambda: probe_views(model, [("plain", (8, 4), torch.float32)], load_fn=slow_loader))
    th.start()
    started.wait(10)
    model.p.data.copy_(torch.ones(8, 4))  # this thread, during the probe
    done.set()
    th.join(10)
    assert torch.equal(model.p.data, torch.ones(8, 4))


def test_one_loader_call_per_batch_and_the_same_views_as_one_by_one():
    """A bucket's new names are probed in one loader call (vLLM's loader walks the whole module
    tree per call: per-name probing cost ~7 ms a tensor, minutes at 30B); a batch with a refused
    name is probed again name by name, and both give the views one-by-one probing gives."""
    model = FusedStandIn()
    calls = []

    def counting(items):
        items = list(items)
        calls.append([n for n, _ in items])
        model.load_weights(items)

    clean = [(n, s, torch.float32) for n, s in SPECS if n != "scaled"]
    views, unsupported = probe_views(model, clean, load_fn=counting, whole=False)
    assert calls == [["q", "k", "cols", "tr"]] and not unsupported
    single = {n: probe_views(model, [spec], whole=False)[0][n] for spec in clean for n in [spec[0]]}
    assert {n: v.segments for n, v in views.items()} == {n: v.segments for n, v in single.items()}
    calls.clear()
    views2, unsupported2 = probe_views(model, [(n, s, torch.float32) for n, s in SPECS], load_fn=counting,
                                       whole=False)
    assert len(calls) == 1 + len(SPECS) and set(unsupported2) == {"scaled"}
    assert {n: v.segments for n, v in views2.items()} == {n: v.segments for n, v in views.items()}


@pytest.mark.parametrize("host_kernel", [True, False], ids=["kernel", "torch-ops"])
def test_many_tensors_in_one_apply_equal_one_by_one(monkeypatch, host_kernel):
    """apply_sparse_many groups tensors held as one run by parameter (q and k share the fused qk:
    with the host kernel each tensor's int32 indices at its offset, with torch ops one index_copy_
    for both); the column-sliced and transposed ones go one by one; the result and the undo log
    equal per-tensor apply_sparse, with and without the host kernel."""
    from delta_sync import native
    from patches.loader_views import apply_sparse_many, whole_run

    if not host_kernel:
        monkeypatch.setattr(native, "kernel", lambda: None)
    else:
        assert native.can_move(torch.zeros(4), torch.zeros(1, dtype=torch.int32))

    g = torch.Generator().manual_seed(5)
    models = [FusedStandIn(), FusedStandIn()]
    views, _ = probe_views(models[0], [(n, s, torch.float32) for n, s in SPECS], whole=False)
    assert whole_run(views["q"]) and whole_run(views["k"]).dst_offset == 24
    assert whole_run(views["cols"]) is None and whole_run(views["tr"]) is None
    patches = []
    for n, s in SPECS:
        if n == "scaled":
            continue
        numel = torch.Size(s).numel()
        idx = torch.randperm(numel, generator=g)[:max(1, numel // 3)].sort().values.to(torch.int32)
        patches.append((n, idx, torch.randn(idx.numel(), generator=g)))
    patches.append(("k", torch.zeros(0, dtype=torch.int32), torch.zeros(0)))  # an empty patch writes nothing
    for m in models:
        for p in m.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g))
    models[1].load_state_dict(models[0].state_dict())
    before = {n: p.clone() for n, p in models[0].named_parameters()}
    undos = [UndoLog(), UndoLog()]
    params = [dict(m.named_parameters()) for m in models]
    n_many = apply_sparse_many(views, params[0], patches[:-1] + patches[-1:], undos[0])
    n_one = sum(apply_sparse(views[n], params[1], i, v, undos[1]) for n, i, v in patches)
    assert n_many == n_one > 0  # "cols" keeps half its columns: not every index lands
    for name in params[0]:
        assert torch.equal(params[0][name], params[1][name]), name
    assert not all(torch.equal(params[0][n], before[n]) for n in before)
    undos[0].restore()
    for name, p in params[0].items():
        assert torch.equal(p, before[name]), name


def _plain_pair(n: int, g: torch.Generator):
    """Two :class:`_Plain` models loaded with the same random state, and their loader views."""
    models = [_Plain(n), _Plain(n)]
    views, _ = probe_views(models[0], [(f"w{i}", (n,), torch.bfloat16) for i in range(4)])
    state = {f"w{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i in range(4)}
    for m in models:
        m.load_weights(state.items())
    return models, views, state


class _Plain(torch.nn.Module):
    """Four bf16 parameters loaded as they are (each checkpoint tensor one whole run)."""

    def __init__(self, numel: int):
        super().__init__()
        for i in range(4):
            self.register_parameter(f"w{i}", torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16),
                                                                requires_grad=False))

    def load_weights(self, items):
        for name, w in items:
            getattr(self, name).data.copy_(w)


@pytest.mark.parametrize("host_kernel", [True, False], ids=["kernel", "torch-ops"])
def test_host_writes_spread_over_threads_equal_one_thread(monkeypatch, host_kernel):
    """A delta's writes (each reading its old value for the undo log in the same visit) run on
    several threads, one parameter per thread at a time: the weights and the undo log equal a
    one-thread apply, through the host kernel (one foreign call per thread) and through torch ops;
    a write that fails on one thread lets the others finish, and the undo log restores everything."""
    import threading

    from delta_sync import native
    from patches import loader_views as lv

    n = 2 * lv.SPREAD_MIN_ELEMENTS
    g = torch.Generator().manual_seed(9)
    models, views, state = _plain_pair(n, g)
    patches = []
    for i in range(4):
        idx = torch.randperm(n, generator=g)[: n // 3].sort().values.to(torch.int32)
        patches.append((f"w{i}", idx, torch.randn(idx.numel(), generator=g).to(torch.bfloat16)))
    threads = set()
    if host_kernel:
        lib = native.kernel()
        real = lib.move_rows

        def recording_rows(count, rows, check, bad):
            if not check:
                threads.add(threading.get_ident())
            return real(count, rows, check, bad)

        monkeypatch.setattr(lib, "move_rows", recording_rows)
    else:
        monkeypatch.setattr(native, "kernel", lambda: None)
        put = lv._put

        def recording_put(*a):
            threads.add(threading.get_ident())
            put(*a)

        monkeypatch.setattr(lv, "_put", recording_put)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    undos = []
    for m, floor in zip(models, (lv.SPREAD_MIN_ELEMENTS, 1 << 40)):  # spread, then one thread
        monkeypatch.setattr(lv, "SPREAD_MIN_ELEMENTS", floor)
        threads.clear()
        undo = UndoLog()
        lv.apply_sparse_many(views, dict(m.named_parameters()), patches, undo)
        undos.append(undo)
        assert (len(threads) >= 2) if floor < n else len(threads) == 1  # (pool threads may take turns)
    for name, p in models[0].named_parameters():
        assert torch.equal(p, getattr(models[1], name)), name
        assert not torch.equal(p, state[name])
        expect = state[name].clone()
        idx, vals = next((i, v) for pn, i, v in patches if pn == name)
        expect[idx.long()] = vals
        assert torch.equal(p, expect), name
    undos[0].restore()
    for name, p in models[0].named_parameters():
        assert torch.equal(p, state[name]), name
    # a write failing on one thread (torch ops; the kernel checks every position before it writes
    # any): the other threads finish, the error leaves, restore repairs all
    monkeypatch.setattr(native, "kernel", lambda: None)
    monkeypatch.setattr(lv, "SPREAD_MIN_ELEMENTS", 1)
    last = dict(models[0].named_parameters())["w3"]
    plain_put = lv._put

    def failing_put(target, *a):
        if target.data_ptr() == last.data_ptr():
            raise RuntimeError("injected write failure")
        plain_put(target, *a)

    monkeypatch.setattr(lv, "_put", failing_put)
    threads.clear()
    undo = UndoLog()
    with pytest.raises(RuntimeError, match="injected write failure"):
        lv.apply_sparse_many(views, dict(models[0].named_parameters()), patches, undo)
    assert not torch.equal(models[0].w0, state["w0"])  # the other threads wrote theirs
    monkeypatch.setattr(lv, "_put", plain_put)
    undo.restore()
    for name, p in models[0].named_parameters():
        assert torch.equal(p, state[name]), name


def test_an_apply_mixing_dense_and_sparse_tensors_is_restored_whole():
    """A delta whose tensors go partly dense (a view write the host kernel does not take) and
    partly sparse: the apply writes each as the checkpoint says, through the kernel where it takes
    a parameter's writes and torch ops elsewhere, and the undo log restores all of it."""
    from patches import loader_views as lv

    n = 4096
    g = torch.Generator().manual_seed(11)
    models, views, state = _plain_pair(n, g)
    m = models[0]
    dense = torch.randn(n, generator=g).to(torch.bfloat16)
    sparse = []
    for i in range(1, 4):
        idx = torch.randperm(n, generator=g)[: n // 7].sort().values.to(torch.int32)
        sparse.append((f"w{i}", idx, torch.randn(idx.numel(), generator=g).to(torch.bfloat16)))
    params = dict(m.named_parameters())
    undo = UndoLog()
    apply_dense(views["w0"], params, dense, undo)
    lv.apply_sparse_many(views, params, sparse, undo)
    assert torch.equal(m.w0, dense)
    for name, idx, vals in sparse:
        expect = state[name].clone()
        expect[idx.long()] = vals
        assert torch.equal(params[name], expect), name
    undo.restore()
    assert all(torch.equal(p, state[k]) for k, p in m.named_parameters())


def test_a_write_of_the_wrong_length_raises_and_leaves_nothing_to_restore_wrongly():
    """An undo-logged write whose values do not match its positions is refused by torch ops (the
    host kernel does not take it), and the undo log then restores what it recorded, bit for bit."""
    n = 64
    flat = torch.arange(n, dtype=torch.float32)
    undo = UndoLog()
    pos = torch.tensor([3, 9, 20], dtype=torch.int32)
    undo.change(flat, pos, torch.tensor([1.5, 2.5, 3.5]))
    with pytest.raises((IndexError, RuntimeError)):
        undo.change(flat, pos + 1, torch.tensor([7.0, 8.0]))  # two values for three positions
    undo.restore()
    assert torch.equal(flat, torch.arange(n, dtype=torch.float32))


class _Mixed(torch.nn.Module):
    """Parameters of three widths, odd sizes: bf16, fp32 and int8 (an fp8-like byte weight)."""

    DTYPES = (torch.bfloat16, torch.float32, torch.int8)

    def __init__(self):
        super().__init__()
        for i, dtype in enumerate(self.DTYPES):
            self.register_parameter(f"w{i}", torch.nn.Parameter(torch.zeros(97 + 2 * i, dtype=dtype),
                                                                requires_grad=False))

    def load_weights(self, items):
        for name, w in items:
            getattr(self, name).data.copy_(w)


def test_a_planned_apply_over_parameters_of_several_widths_writes_and_restores_each_exactly():
    """One kernel plan writes bf16, fp32 and int8 parameters (odd counts, so each row's room for
    its old values must be sized and aligned by its own width): the writes land as the patches
    say, the old values are read into room of the right size (the plan's undo bytes count them),
    and the restore puts every bit back."""
    from delta_sync import native
    from patches.loader_views import plan_sparse

    if native.kernel() is None:
        pytest.skip("no C compiler: the host kernel is not built")
    g = torch.Generator().manual_seed(3)
    m = _Mixed()
    specs = [(n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()]
    views, unsupported = probe_views(m, specs)
    assert not unsupported
    for p in m.parameters():
        p.data.copy_(torch.randint(-100, 100, p.shape, generator=g).to(p.dtype))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    patches = []
    for name, shape, dtype in specs:
        idx = torch.randperm(shape[0], generator=g)[:shape[0] // 3 * 2 + 1].sort().values.to(torch.int32)
        patches.append((name, idx, torch.randint(-100, 100, (idx.numel(),), generator=g).to(dtype)))
    plan = plan_sparse(views, dict(m.named_parameters()), patches)
    assert plan.table is not None and len(plan.rows) == 3
    undo = UndoLog()
    assert plan.run(undo) == sum(i.numel() for _, i, _ in patches)
    assert undo.nbytes == sum(i.numel() * (4 + v.element_size()) for _, i, v in patches)
    for name, idx, vals in patches:
        expect = before[name].clone()
        expect[idx.long()] = vals
        assert torch.equal(getattr(m, name), expect), name
    undo.restore()
    for name, p in m.named_parameters():
        assert torch.equal(p, before[name]), name


def test_a_bucket_whose_scan_fails_names_the_range_that_fails():
    """The engine copies and digests a bucket's ranges in one scan; when it fails, the range that
    fails alone is the one the error names (not the bucket's last)."""
    from patches.bulk_apply import failing

    ok = [(torch.ones(8, dtype=torch.bfloat16), 0, torch.empty(8, dtype=torch.bfloat16)) for _ in range(4)]
    bad = (torch.ones(8, dtype=torch.bfloat16), 0, torch.empty(7, dtype=torch.bfloat16))  # no room for it
    for at in range(5):
        items = ok[:at] + [bad] + ok[at:]
        with pytest.raises(ValueError, match="copy_to holds 7"):
            scan_many(items)
        assert failing(items, None) == at
    assert failing(ok, None) == len(ok) - 1  # none fails alone: the last


class _Experts(torch.nn.Module):
    """A MoE layer's experts fused as vLLM fuses them: every expert's gate and up rows in one
    ``w13`` parameter, every down in one ``w2`` (each checkpoint tensor one whole run of its
    parameter; the checkpoint's order interleaves the two); and a float32 norm (a table of two
    element dtypes)."""

    D, F = 4, 6

    def __init__(self, experts: int, transposed: bool = False):
        super().__init__()
        self.transposed = transposed  # the layout vLLM-Ascend leaves after loading (a stand-in of it):
        # w13 [E, D, 2F], w2 [E, F, D], every expert tensor written transposed
        self.norm = torch.nn.Parameter(torch.zeros(self.D), requires_grad=False)
        w13, w2 = ((experts, self.D, 2 * self.F), (experts, self.F, self.D)) if transposed else \
            ((experts, 2 * self.F, self.D), (experts, self.D, self.F))
        self.w13 = torch.nn.Parameter(torch.zeros(w13, dtype=torch.bfloat16), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.zeros(w2, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, items):
        for name, w in items:
            if name == "norm.weight":
                self.norm.data.copy_(w)
                continue
            _, e, kind = name.split(".")
            e = int(e)
            if self.transposed:
                w = w.t()
                dst = self.w2.data[e] if kind == "down_proj" else \
                    self.w13.data[e, :, :self.F] if kind == "gate_proj" else self.w13.data[e, :, self.F:]
            else:
                dst = self.w2.data[e] if kind == "down_proj" else \
                    self.w13.data[e, :self.F] if kind == "gate_proj" else self.w13.data[e, self.F:]
            dst.copy_(w)

    @classmethod
    def specs(cls, experts: int, held: int) -> list[tuple[str, tuple[int, ...]]]:
        """Checkpoint names and shapes of ``experts`` experts, of which this worker holds ``held``."""
        shape = {"down_proj": (cls.D, cls.F), "gate_proj": (cls.F, cls.D), "up_proj": (cls.F, cls.D)}
        return [("norm.weight", (cls.D,)), *((f"experts.{e}.{k}", s) for e in range(experts) for k, s in shape.items())]


def _routed_experts(experts: int, held: int, g: torch.Generator, bucket_bytes: int, norm: bool = True,
                    transposed: bool = False):
    """Two identical :class:`_Experts` workers holding the first ``held`` of ``experts`` experts, a
    delta of every expert (and of the float32 norm, with ``norm``) packed into catalogue tables,
    and the routes of the first worker."""
    from delta_sync.bucket import BucketPacker, entry_patches
    from delta_sync.catalog import Catalog
    from delta_sync.patch import Patch
    from patches.loader_views import LoaderView, TableRoutes

    specs = _Experts.specs(experts, held)[0 if norm else 1:]
    dtype = {n: torch.float32 if n == "norm.weight" else torch.bfloat16 for n, _ in specs}
    models = [_Experts(held, transposed), _Experts(held, transposed)]
    mine = [(n, s) for n, s in specs if n == "norm.weight" or int(n.split(".")[1]) < held]
    views, _ = probe_views(models[0], [(n, s, dtype[n]) for n, s in mine])
    views.update({n: LoaderView(n, s, torch.bfloat16) for n, s in specs if n not in views})  # another worker's
    for m in models:
        m.load_weights([(n, torch.randn(s, generator=g).to(dtype[n])) for n, s in mine])
    models[1].load_state_dict(models[0].state_dict())
    catalog = Catalog([n for n, _ in specs], [s for _, s in specs], [str(dtype[n]).split(".")[1] for n, _ in specs])
    patches = []
    for n, s in specs:
        numel = torch.Size(s).numel()
        idx = torch.randperm(numel, generator=g)[:1 + numel // 4].sort().values.to(torch.int32)
        patches.append(Patch(n, s, dtype[n], idx, torch.randn(idx.numel(), generator=g).to(dtype[n])))
    packer = BucketPacker(1, "delta", bucket_bytes)
    packer.catalog = catalog
    tables = []
    for b in packer.pack(patches):
        assert entry_patches(b, catalog=catalog) == []  # every entry in the table
        tables.append(b.table)
    params = [dict(m.named_parameters()) for m in models]
    return models, views, params, patches, tables, TableRoutes(catalog, views, params[0])


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed-standin"])
@pytest.mark.parametrize("host_kernel", [True, False, "staged"], ids=["kernel", "torch-ops", "staged-pairs"])
def test_tables_route_by_id_into_fused_experts_and_restore(monkeypatch, host_kernel, transposed):
    """A delta's tables, routed by tensor id straight into fused expert parameters (an expert's gate,
    up and down interleaved across two parameters, a tensor continued from one bucket's table into
    the next, another worker's experts skipped untouched), write what per-tensor ``apply_sparse``
    writes, through the host kernel's rows and through torch ops (what a device's parameters
    take, and transposed experts anywhere: one (positions, values) pair per parameter and table,
    no patch per entry); the undo log restores every weight. ``transposed``: the layout
    vLLM-Ascend leaves (a stand-in), each expert written with a row and a column stride.
    ``staged-pairs``: the pairs worked out at receipt as a device engine staging on the host does
    (:func:`routed_pairs`, int32 positions, in chunks of a few entries) and taken by the plan as
    they are."""
    from delta_sync import native
    from patches import loader_views
    from patches.loader_views import plan_tables, routed_pairs

    staged = host_kernel == "staged"
    if staged:
        host_kernel = False
        monkeypatch.setattr(loader_views, "STAGE_CHUNK_ELEMENTS", 40)  # several chunks per table
    if not host_kernel:
        monkeypatch.setattr(native, "kernel", lambda: None)
    g = torch.Generator().manual_seed(12)
    models, views, params, patches, tables, routes = _routed_experts(12, 8, g, bucket_bytes=700, transposed=transposed)
    assert len(tables) > 1
    if staged:
        for t in tables:  # (a table of another worker's experts only has none)
            t.routed = (routes, routed_pairs(routes, t))
        pairs = [d for t in tables if t.routed[1] for _, d, _ in t.routed[1].pairs]
        assert len(pairs) > len(tables) and all(d.dtype == torch.int32 for d in pairs)
    held = torch.tensor([n == "norm.weight" or int(n.split(".")[1]) < 8 for n in routes.catalog.names])
    expert = torch.tensor([n != "norm.weight" for n in routes.catalog.names])
    kernel = host_kernel and not transposed
    assert bool((routes.how[held & expert] == (1 if kernel else 2)).all()) and bool((routes.how[~held] == -1).all())
    assert bool(routes.strided[held & expert].all()) == transposed and not bool(routes.strided[~expert].any())
    before = {n: p.clone() for n, p in params[0].items()}
    plan, general = plan_tables(routes, tables)
    assert not general and (plan.table is not None) == host_kernel
    if staged:  # the plan took the pairs as they were
        assert not plan.joined and plan.staged == [t.routed[1] for t in tables if t.routed[1]]
    elif not kernel:  # pairs per parameter and table: a handful, whatever the entry count
        assert 0 < len(plan.joined) <= 3 * len(tables)
    undo = UndoLog()
    written = plan.run(undo)
    want = sum(apply_sparse(views[p.name], params[1], p.indices, p.values, None) for p in patches)
    assert written == want > 0
    for name in params[0]:
        assert torch.equal(params[0][name].view(torch.int16), params[1][name].view(torch.int16)), name
    undo.restore()
    for name, p in params[0].items():
        assert torch.equal(p.view(torch.int16), before[name].view(torch.int16)), name


def test_torch_op_table_routing_costs_the_same_ops_for_any_expert_count(monkeypatch):
    """Planning and writing a table through torch ops (a device's path) is a fixed number of
    dispatched operations per table and parameter: 8 experts or 64 (24 or 192 tensors) cost the
    same, contiguous or transposed (the Ascend stand-in), within the issue's bound of 4 per parameter and 50 per bucket (a table of one element
    dtype, as a bf16 checkpoint's are; each further dtype in a table costs as much again)."""
    from delta_sync import native
    from launchers.device_check import OpCounter
    from patches.loader_views import plan_tables, routed_pairs

    monkeypatch.setattr(native, "kernel", lambda: None)
    counts = []
    for transposed, staged in ((False, False), (True, False), (False, True), (True, True)):
        counts = []
        for experts in (8, 64):
            _, _, params, _, tables, routes = _routed_experts(experts, experts, torch.Generator().manual_seed(3),
                                                              bucket_bytes=1 << 20, norm=False, transposed=transposed)
            assert len(tables) == 1
            if staged:  # the pairs worked out at receipt (stage_routed), not counted: the pause's writes are
                tables[0].routed = (routes, routed_pairs(routes, tables[0]))
            with OpCounter() as ops:
                plan, _ = plan_tables(routes, tables)
                plan.run(UndoLog())
            counts.append(ops.ops)
        assert counts[0] == counts[1] <= 4 * 2 + 50, (transposed, staged, counts)


def test_a_staged_table_that_fails_midway_leaves_what_it_wrote_restorable(monkeypatch):
    """:meth:`StagedPairs.write` reads every pair's old values before writing it; if a write
    raises, the pairs read so far are in the undo log, and restoring it puts back every bit."""
    from delta_sync import native
    from patches import loader_views
    from patches.loader_views import plan_tables, routed_pairs

    monkeypatch.setattr(native, "kernel", lambda: None)
    _, _, params, _, tables, routes = _routed_experts(8, 8, torch.Generator().manual_seed(4), bucket_bytes=1 << 20,
                                                      transposed=True)
    tables[0].routed = (routes, routed_pairs(routes, tables[0]))
    assert len(tables[0].routed[1].pairs) >= 3
    before = {n: p.clone() for n, p in params[0].items()}
    real, calls = loader_views._write_pair, [0]

    def fails_third(flat, pos, values):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("device error")
        real(flat, pos, values)

    monkeypatch.setattr(loader_views, "_write_pair", fails_third)
    plan, _ = plan_tables(routes, tables)
    undo = UndoLog()
    with pytest.raises(RuntimeError, match="device error"):
        plan.run(undo)
    assert len(undo.entries) == 3  # two written, the third read before it failed
    assert any(not torch.equal(p.view(torch.int16), before[n].view(torch.int16)) for n, p in params[0].items())
    undo.restore()
    for n, p in params[0].items():
        assert torch.equal(p.view(torch.int16), before[n].view(torch.int16)), n


@pytest.mark.parametrize("fault", ["copy back", "no room"])
def test_a_staged_table_keeps_its_undo_whatever_fails_around_the_writes(monkeypatch, fault):
    """``copy back``: the old values' copy to host memory fails after every pair was written: the
    undo log still holds them all (on the device) and restores every bit. ``no room``: the device
    has no room for the table's buffers: the pairs are written one at a time instead, exactly."""
    from delta_sync import accelerator, native
    from patches.loader_views import apply_sparse, plan_tables, routed_pairs

    monkeypatch.setattr(native, "kernel", lambda: None)
    _, views, params, patches, tables, routes = _routed_experts(8, 8, torch.Generator().manual_seed(6),
                                                                bucket_bytes=1 << 20, transposed=True)
    tables[0].routed = (routes, routed_pairs(routes, tables[0]))
    before = {n: p.clone() for n, p in params[0].items()}
    if fault == "copy back":
        def fail(t, non_blocking=False):
            raise torch.OutOfMemoryError("no host memory left")
        monkeypatch.setattr(accelerator, "to_host", fail)
    else:
        real_empty = torch.empty

        def empty(*a, **k):  # the device buffers of the table (a host buffer names no device)
            if "device" in k:
                raise torch.OutOfMemoryError("cannot allocate 1.3 GiB on the device")
            return real_empty(*a, **k)
        monkeypatch.setattr(torch, "empty", empty)
    plan, _ = plan_tables(routes, tables)
    undo = UndoLog()
    if fault == "copy back":
        with pytest.raises(torch.OutOfMemoryError):
            plan.run(undo)
        assert len(undo.entries) == len(tables[0].routed[1].pairs)
    else:
        assert plan.run(undo) == sum(apply_sparse(views[p.name], params[1], p.indices, p.values, None)
                                     for p in patches)
        monkeypatch.undo()
        for name in params[0]:
            assert torch.equal(params[0][name].view(torch.int16), params[1][name].view(torch.int16)), name
    undo.restore()
    for n, p in params[0].items():
        assert torch.equal(p.view(torch.int16), before[n].view(torch.int16)), n


def test_a_pair_staged_in_host_memory_writes_and_restores_exactly():
    """:func:`write_staged` (a delta staged on the host, written into a device parameter a pair at
    a time; run here on the host, where its copies are no-ops): the same values as
    ``write_positions``, at an offset too, and the undo log puts back every old bit, NaN payloads
    included."""
    from patches.loader_views import write_positions, write_staged

    g = torch.Generator().manual_seed(5)
    base = torch.randn(4096, generator=g).to(torch.bfloat16)
    base.view(torch.int16)[7] = 0x7FC1  # a NaN with a payload
    dst = torch.randperm(4000, generator=g)[:300].sort().values
    vals = torch.randn(300, generator=g).to(torch.bfloat16)
    for offset in (0, 64):
        staged, plain = base.clone(), base.clone()
        undo = UndoLog()
        assert write_staged(staged, dst, vals, undo, offset) == 300
        write_positions(plain, dst, vals, None, offset)
        assert torch.equal(staged.view(torch.int16), plain.view(torch.int16))
        assert not torch.equal(staged.view(torch.int16), base.view(torch.int16))
        undo.restore()
        assert torch.equal(staged.view(torch.int16), base.view(torch.int16))


def test_the_parameter_table_notices_a_replaced_module_or_a_parameter_set_to_none():
    """The engine reads its parameters through a table of their owners (no walk of vLLM's module
    tree per call); a module replaced anywhere on the way, or a parameter set to None, makes it
    walk the model anew, so a layout check or a digest never reads orphaned tensors."""
    from patches.delta_apply import ParamTable

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.LayerNorm(2)))
    table = ParamTable(model)
    assert table.params_of(model) == dict(model.named_parameters())
    model[1][0] = torch.nn.Linear(4, 2)
    assert table.params_of(model)["1.0.weight"] is model[1][0].weight
    model[1] = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.LayerNorm(2))
    assert table.params_of(model) == dict(model.named_parameters())
    table = ParamTable(model)
    model[0].bias = None
    assert table.params_of(model) == dict(model.named_parameters()) and "0.bias" not in table.params_of(model)


def test_the_parameter_table_reads_parameters_without_running_their_torch_function():
    """vLLM's parameters are a tensor subclass whose ``__torch_function__`` runs in Python: the
    table's read (start, plan, apply and report each ask it) compares them by identity only, never
    with ``==`` (which ``None in`` a list of them does: half the engine worker's time per delta)."""
    from patches.delta_apply import ParamTable

    class Counted(torch.nn.Parameter):
        calls = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            Counted.calls += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(8)))
    for m in model:
        m.weight, m.bias = Counted(m.weight.data), Counted(m.bias.data)
    table = ParamTable(model)
    Counted.calls = 0
    got = table.params_of(model)
    assert Counted.calls == 0 and len(got) == 16 and got["3.weight"] is model[3].weight
