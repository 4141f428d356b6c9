"""Bulk updates by id: a later seed's or full update's whole tensors go in dense tables
(delta_sync.catalog.DenseTable), numbered by the catalogue of the bulk update before.

Real channels (gloo between a WeightSync and an in-memory receiver; the in-process backend where a
test plays a sender that breaks the format). The vLLM engine's writes by id are tested in
test_vllm_receiver."""

import json
import threading

import pytest
import torch

import delta_sync.bucket as bucket_mod
from delta_sync.bucket import BucketPacker, check_dense_table, entry_patches
from delta_sync.catalog import Catalog, CatalogBuilder, known, remember
from delta_sync.channel import LOCAL, Channel
from delta_sync.errors import ChecksumMismatch, NeedsSeed, PatchValidationError
from delta_sync.memory_receiver import MemoryReceiver
from delta_sync.patch import Patch, Whole
from delta_sync.sync import WeightSync
from delta_sync.transfer import receive_update

from .test_catalog import _recording, _state


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 300], ids=["one-bucket", "small-buckets"])
def test_a_later_bulk_update_sends_whole_tensors_by_id_and_stays_exact(bucket_bytes):
    """The first bulk update names every tensor in JSON; the next ones carry the tensors the
    catalogue holds as they are in dense tables (ids and digests, ~22 header bytes a tensor), the
    rest as JSON entries: a tensor split over buckets, one added, one reshaped. The receiver's
    tensors equal the trainer's after each, and both ends number the update's own catalogue in the
    order the tensors travelled (a delta after it goes by table again)."""
    g = torch.Generator().manual_seed(5)
    state = _state(60, g)
    rx = MemoryReceiver()
    sync = WeightSync([rx], mode="full", bucket_bytes=bucket_bytes)
    sync.update(state.items())
    headers = _recording(sync)
    for step in range(3):
        headers.clear()
        for t in state.values():
            t.add_(1.0)
        if step == 1:  # one tensor added in the middle, one reshaped: both by name
            state = {**dict(list(state.items())[:30]), "extra.w": torch.ones(3, 5, dtype=torch.bfloat16),
                     **dict(list(state.items())[30:])}
            state["layers.7.w"] = state["layers.7.w"].reshape(-1).clone()
        assert sync.update(state.items()).kind == "full"
        assert not rx.mismatched(state.items())
        dense = [h["dense"] for h in headers if "dense" in h]
        json_names = {e["name"] for h in headers for e in h["entries"]}
        assert dense, "a later bulk update names its catalogued tensors by id"
        if bucket_bytes > 300:
            assert json_names == ({"extra.w", "layers.7.w"} if step == 1 else set()), json_names
            per_tensor = len(json.dumps(dense)) / (len(state) - len(json_names))
            assert per_tensor <= 24, per_tensor
        else:  # tensors larger than a bucket's room go in pieces, by name
            assert json_names and len(json_names) < len(state) / 2
        order = [n for n in state]
        assert rx.channel.catalog.fingerprint == sync.channel.catalog.fingerprint == \
            Catalog(order, [tuple(state[n].shape) for n in order], ["bfloat16"] * len(order)).fingerprint
    sync.verify()
    sync.close()


def _catalog(names, shape=(4, 4)) -> Catalog:
    return Catalog(list(names), [shape] * len(names), ["bfloat16"] * len(names))


def _full(name: str, value: float = 1.0, shape=(4, 4)) -> Patch:
    return Patch.full(name, torch.full(shape, value, dtype=torch.bfloat16))


def _packed(catalog: Catalog | None, patches: list[Patch], kind: str = "full", check: bool = True) -> list:
    packer = BucketPacker(1, kind, 1 << 20, check=check)
    packer.dense = catalog
    return list(packer.pack(patches))


@pytest.mark.parametrize("checks", ["host kernel", "torch ops"])
def test_a_dense_table_is_checked_and_a_failure_names_the_tensor(checks, monkeypatch):
    """A dense table's tensors get the checks dense JSON entries get, on both ends: the packer
    refuses Inf/NaN naming the tensor; a receiver refuses values whose keyed digest differs (a byte
    changed in flight), ids that do not increase, a JSON entry placed after more table tensors
    than there are, a dense table in a delta bucket, and one numbered by a catalogue it lacks (it
    needs the tensors by name). With the torch ops (no host kernel: a device's path) the same."""
    if checks == "torch ops":
        monkeypatch.setattr(bucket_mod, "rows_supported", lambda: False)
    cat = _catalog(["a", "b", "c"])
    # ("b" and "n" as a bulk update's stream gives them: whole tensors, not patches yet)
    good = [_full("a", 1.0), Whole("n", torch.full((2, 3), 5.0, dtype=torch.bfloat16)),
            Whole("b", torch.full((4, 4), 2.0, dtype=torch.bfloat16)), _full("c", 3.0)]
    (bucket,) = _packed(cat, good)
    assert [e["name"] for e in bucket.header["entries"]] == ["n"] and bucket.header["entries"][0]["after"] == 1
    out = entry_patches(bucket, catalog=cat)
    got = {p.name: p.values for _, p in out + bucket.dense.patches()}
    assert {n: v.float().tolist() for n, v in got.items()} == \
        {p.name: p.values.float().tolist() for p in good}

    def refused(b, err, match, catalog=cat):
        with pytest.raises(err, match=match):
            entry_patches(b, catalog=catalog)

    (bad,) = _packed(cat, good)
    bad.dense.values["bfloat16"][16 + 3] = 7.0  # "b"'s fourth element, after "a"'s 16
    refused(bad, ChecksumMismatch, "'b' values .* digest")
    with pytest.raises(PatchValidationError, match="'c'.*non-finite"):
        _packed(cat, [_full("a"), _full("c", float("nan"))])
    (bad,) = _packed(cat, good)
    bad.header["dense"]["ids"] = bucket_mod.encode_dense(cat, [2, 1, 0], bad.dense.digests)["ids"]
    refused(bad, PatchValidationError, "increase strictly")
    (bad,) = _packed(cat, good)
    bad.header["entries"][0]["after"] = 4
    refused(bad, PatchValidationError, "'n'.*after 4")
    (bad,) = _packed(cat, good)
    bad.header["kind"] = "delta"
    refused(bad, PatchValidationError, "dense table in a delta bucket")
    refused(_packed(cat, good)[0], NeedsSeed, "catalogue", catalog=_catalog(["a", "b", "x"]))
    refused(_packed(cat, good)[0], NeedsSeed, "catalogue", catalog=None)


@pytest.mark.parametrize("checks", ["host kernel", "torch ops"])
def test_a_dense_tables_copy_by_address_is_checked_after_it(checks, monkeypatch):
    """An engine writes a dense table's tensors to the addresses its routes give, digesting them in
    the same pass, and checks after: the values land, and a changed byte is still named (the write
    happened: the update fails, the engine needs a seed). Without the host kernel the copy by
    address is refused (a device engine writes such tables as entries)."""
    cat = _catalog(["a", "b"])
    (bucket,) = _packed(cat, [_full("a", 1.0), _full("b", 2.0)])
    entry_patches(bucket, catalog=cat, check_dense=False)
    target = torch.zeros(2, 16, dtype=torch.bfloat16)
    dst = torch.tensor([target[1].data_ptr(), target[0].data_ptr()])  # "a" into row 1, "b" into row 0
    if checks == "torch ops":
        monkeypatch.setattr(bucket_mod, "rows_supported", lambda: False)
        with pytest.raises(ValueError, match="by address"):
            check_dense_table(bucket.dense, "kept", dst)
        return
    check_dense_table(bucket.dense, "kept", dst)
    assert target[1].eq(1.0).all() and target[0].eq(2.0).all()
    bucket.dense.values["bfloat16"][0] = 9.0
    with pytest.raises(ChecksumMismatch, match="'a' values"):
        check_dense_table(bucket.dense, "kept", dst)
    assert target[1, 0] == 9.0  # written before the check, as an engine's bulk writes are


def _pair(token: str) -> tuple[Channel, Channel]:
    got = {}
    th = threading.Thread(target=lambda: got.setdefault(
        "rx", Channel.connect("127.0.0.1", 0, 1, 2, token, backend=LOCAL, timeout_s=30)))
    th.start()
    tx = Channel.connect("127.0.0.1", 0, 0, 2, token, backend=LOCAL, timeout_s=30)
    th.join()
    return tx, got["rx"]


@pytest.mark.parametrize("case", ["table-twice", "entry-after-table", "table-after-entry"])
def test_a_bulk_update_names_each_tensor_once_across_its_tables_and_entries(case):
    """A sender that numbers a tensor in two buckets' tables, or sends it both by id and by name,
    is refused by the receiver naming the tensor, whatever came first; the update it cut off
    leaves the receiver without a catalogue (its next bulk update goes by name)."""
    cat = _catalog(["a", "b", "c"])
    tx, rx = _pair(f"dense-once-{case}")
    tx.catalog = rx.catalog = cat
    packer = BucketPacker(1, "full", 1 << 20, keys=tx.digest_key)
    packer.dense = cat
    first = list(packer.pack([_full("a"), _full("b")], close=False))
    if case == "table-twice":
        packer._table_last = -1  # a buggy sender: it numbers "a" again
        rest = list(packer.pack([_full("a"), _full("c")]))
    elif case == "entry-after-table":
        packer.dense = None  # "a" again, by name
        rest = list(packer.pack([_full("a"), _full("c")]))
    else:  # "c" by name first, then in a table
        packer.dense = None
        first = list(BucketPacker(1, "full", 1 << 20, keys=tx.digest_key).pack([_full("c")], close=False))
        packer = BucketPacker(1, "full", 1 << 20, keys=tx.digest_key)
        packer.dense, packer.seq = cat, len(first)
        rest = list(packer.pack([_full("a"), _full("b"), _full("c")]))
    error = {}

    def receive():
        try:
            receive_update(rx, bulk_sink=lambda entries: None)
        except Exception as e:  # noqa: BLE001 - what the test looks at
            error["e"] = e
    th = threading.Thread(target=receive)
    th.start()
    for b in first + rest:
        tx.send_bucket(b)
    th.join(30)
    name = "'c'" if case == "table-after-entry" else "'a'"
    assert isinstance(error.get("e"), PatchValidationError) and name in str(error["e"]) \
        and "sent twice" in str(error["e"]), error
    assert rx.catalog is None
    tx.close()
    rx.close()


def test_a_catalogue_is_remembered_by_fingerprint_for_later_channels():
    """What a trainer keeps of a channel it leaves: its catalogue, numbered, found again by
    fingerprint (the engines report theirs), the last few only; none for an unknown one."""
    cats = [_catalog([f"t{i}", "x"]) for i in range(6)]
    for c in cats:
        assert remember(c) is c
    assert known(cats[-1].fingerprint) is cats[-1] and known(cats[0].fingerprint) is None
    assert known(None) is None and remember(None) is None


@pytest.mark.parametrize("case", ["same", "added", "swapped", "left-out"])
def test_a_bulk_update_of_the_same_tensors_in_order_keeps_its_catalogue(case):
    """A bulk update that carries the catalogue's tensors once each in its order (by id, and by name
    where split over buckets or sent alone) keeps that very catalogue: neither end numbers 18,867
    names again. A tensor added or left out, or two swapped, numbers them anew, in travel order."""
    g = torch.Generator().manual_seed(6)
    state = {f"w{i}": torch.randn(3 + i, 5, generator=g).to(torch.bfloat16) for i in range(30)}
    state["big"] = torch.randn(1000, 100, generator=g).to(torch.bfloat16)  # by name, in pieces
    state["z"] = torch.randn(7, 3, generator=g).to(torch.bfloat16)

    def numbered(catalog, items):
        packer = BucketPacker(1, "full", 1 << 14)
        packer.dense, packer.record, packer.direct_min_bytes = catalog, CatalogBuilder(), 1 << 12
        list(packer.pack([Patch.full(n, t) for n, t in items]))
        return packer.record.build()

    base = numbered(None, state.items())
    items = list(state.items())
    if case == "added":
        items.insert(5, ("new", torch.ones(2, 2, dtype=torch.bfloat16)))
    elif case == "swapped":
        items[3], items[4] = items[4], items[3]
    elif case == "left-out":
        del items[7]
    got = numbered(base, items)
    assert (got is base) == (case == "same")
    assert got.names == [n for n, _ in items] and got.fingerprint == \
        Catalog([n for n, _ in items], [tuple(t.shape) for _, t in items], ["bfloat16"] * len(items)).fingerprint


def test_a_receiver_that_says_nothing_of_catalogues_gets_every_tensor_by_name():
    """An engine of a version before dense tables does not report a catalogue: a trainer keeps
    naming every tensor in JSON for it (it would refuse a table), and its updates stay exact."""

    class Older(MemoryReceiver):
        def report(self, digests=False, names=None):
            out = super().report(digests, names)
            for w in out:
                w.pop("catalog")
            return out

    g = torch.Generator().manual_seed(7)
    state = _state(20, g)
    for rx, by_id in ((Older(), False), (MemoryReceiver(), True)):
        sync = WeightSync([rx], mode="full")
        sync.update(state.items())
        headers = _recording(sync)
        for t in state.values():
            t.add_(1.0)
        sync.update(state.items())
        assert any("dense" in h for h in headers) == by_id and not rx.mismatched(state.items())
        sync.close()


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 100, 64])
def test_a_run_of_whole_tensors_packs_as_its_tensors_one_by_one(bucket_bytes):
    """A bulk update's stream reaches the packer as runs of whole tensors (``WholeRun``): those the
    catalogue holds that fit the bucket's room go into its dense table a share at a time, any other
    (larger than the room left: split by name; not catalogued; reshaped) one by one. The buckets
    are the same, header and bytes, as for the same tensors given one ``Whole`` at a time."""
    from delta_sync.patch import WholeRun

    g = torch.Generator().manual_seed(3)
    sizes = [4, 9, 30, 2, 16, 5, 40, 3, 7, 1, 12, 6]
    items = [(f"t{i}", torch.randn(n, generator=g).bfloat16()) for i, n in enumerate(sizes)]
    cat = Catalog([n for n, _ in items if n != "t5"], [tuple(t.shape) for n, t in items if n != "t5"],
                  ["bfloat16"] * (len(items) - 1))
    items[8] = ("t8", items[8][1].reshape(7, 1))  # reshaped since the catalogue

    def packed(stream):
        packer = BucketPacker(1, "full", bucket_bytes)
        packer.dense = cat
        return list(packer.pack(stream))

    one = packed([Whole(n, t) for n, t in items])
    runs = packed([WholeRun([n for n, _ in items[a:b]], [t for _, t in items[a:b]]) for a, b in ((0, 4), (4, 5), (5, 6), (6, 8), (8, 12))])
    assert len(one) == len(runs) > (1 if bucket_bytes < 1 << 20 else 0)
    assert any(b.dense is not None for b in runs) and any(b.header["entries"] for b in runs)
    for x, y in zip(one, runs):
        assert x.header == y.header
        assert x.values.keys() == y.values.keys() and all(torch.equal(x.values[k], y.values[k]) for k in x.values)
