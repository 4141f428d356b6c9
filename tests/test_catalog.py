"""Delta tables: a delta names the tensors the last seed catalogued by id (delta_sync.catalog).

Real channels (gloo, in this process) between a WeightSync and an in-memory receiver; the vLLM
engine's routing of tables is tested in test_vllm_receiver."""

import json

import pytest
import torch

from delta_sync.bucket import BucketPacker, entry_patches
from delta_sync.catalog import Catalog
from delta_sync.errors import ChecksumMismatch, EngineError, NeedsSeed, PatchValidationError
from delta_sync.memory_receiver import MemoryReceiver
from delta_sync.patch import Patch, PatchBatch
from delta_sync.sync import WeightSync


def _state(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.w": torch.randn(8, 4 + i % 5, generator=g).to(torch.bfloat16) for i in range(n)}


def _touch(state: dict[str, torch.Tensor], g: torch.Generator, per_tensor: int = 1) -> None:
    for t in state.values():
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[:per_tensor]
        flat[idx] = (flat[idx].float() + 1.0).to(flat.dtype)


def _recording(sync: WeightSync) -> list[dict]:
    headers = []
    send = sync.channel.send_bucket

    def record(bucket):
        headers.append(json.loads(bucket.header_bytes()))
        send(bucket)
    sync.channel.send_bucket = record
    return headers


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 200], ids=["one-bucket", "split-tensors"])
def test_a_delta_names_its_tensors_by_id_in_a_compact_table_and_stays_exact(bucket_bytes, monkeypatch):
    """After a seed, a delta's sparse entries travel as a table of (id, count) pairs, at most 16
    header bytes per changed tensor, no JSON entry each; split across small buckets (a tensor
    continued from one bucket's table into the next) the receiver's tensors still equal the
    trainer's, bit for bit, over several deltas. A one-rank trainer hands the diff kernel's
    batches to the packer whole (no patch object per tensor)."""
    batches = []
    real = BucketPacker._pack_batch
    monkeypatch.setattr(BucketPacker, "_pack_batch", lambda self, fill, b: batches.append(len(b.names)) or real(self, fill, b))
    g = torch.Generator().manual_seed(1)
    state = _state(300, g)
    rx = MemoryReceiver()
    sync = WeightSync([rx], mode="delta", bucket_bytes=bucket_bytes)
    assert sync.update(state.items()).kind == "seed"
    headers = _recording(sync)
    for _ in range(3):
        headers.clear()
        _touch(state, g, per_tensor=3)
        assert sync.update(state.items()).kind == "delta"
        assert not rx.mismatched(state.items())
        tables = [h["table"] for h in headers if "table" in h]
        assert tables and not any(h["entries"] for h in headers), "every changed tensor catalogued: no JSON entry"
        # whole tables (their catalogue's name included) in one bucket; the (id, count) pairs alone
        # where a bucket of 200 bytes carries a few tensors each
        per_tensor = sum(len(json.dumps(t)) if bucket_bytes > 200 else len(t["ids"]) + len(t["counts"])
                         for t in tables) / len(state)
        assert per_tensor <= 16, per_tensor
    assert sum(batches) == 3 * len(state)
    if bucket_bytes == 200:
        assert len(headers) > 3  # the tensors' entries spread over buckets, some continued across two
    sync.verify()
    sync.close()


def test_a_receiver_without_the_senders_catalogue_refuses_the_delta_and_the_next_update_reseeds():
    """A receiver whose channel lost the catalogue (a new channel, a restart) cannot tell which
    tensors a table numbers: it refuses the delta naming the catalogue, writes nothing, asks for a
    seed; the trainer's next update is one, and deltas after it are tables again, exact."""
    g = torch.Generator().manual_seed(2)
    state = _state(40, g)
    rx = MemoryReceiver()
    sync = WeightSync([rx], mode="delta")
    sync.update(state.items())
    before = {n: t.clone() for n, t in rx.tensors.items()}
    rx.channel.catalog = None
    _touch(state, g)
    with pytest.raises(EngineError, match="NeedsSeed.*catalogue"):
        sync.update(state.items())
    assert all(torch.equal(rx.tensors[n], t) for n, t in before.items())
    assert rx.report()[0]["needs_seed"]
    assert sync.update(state.items()).kind == "seed" and not rx.mismatched(state.items())
    headers = _recording(sync)
    _touch(state, g)
    assert sync.update(state.items()).kind == "delta" and any("table" in h for h in headers)
    assert not rx.mismatched(state.items())
    sync.close()


def _catalog(names, shape=(4, 4)) -> Catalog:
    return Catalog(list(names), [shape] * len(names), ["bfloat16"] * len(names))


def _packed(catalog: Catalog, patches: list[Patch], bucket_bytes: int = 1 << 20) -> list:
    packer = BucketPacker(1, "delta", bucket_bytes)
    packer.catalog = catalog
    return list(packer.pack(patches))


def _sparse(name: str, idx: list[int], value: float = 1.0) -> Patch:
    return Patch(name, (4, 4), torch.bfloat16, torch.tensor(idx, dtype=torch.int32),
                 torch.full((len(idx),), value, dtype=torch.bfloat16))


def test_a_catalogues_fingerprint_tells_apart_names_shapes_and_dtypes():
    """Both ends compare catalogues by fingerprint: moving a character between names, a dimension
    between shapes, swapping shapes or changing a dtype gives another one; the same lists the same."""
    bf = ["bfloat16", "bfloat16"]
    cats = [Catalog(["ab", "c"], [(2,), (3,)], bf), Catalog(["a", "bc"], [(2,), (3,)], bf),
            Catalog(["ab", "c"], [(2, 1), (3,)], bf), Catalog(["ab", "c"], [(2,), (1, 3)], bf),
            Catalog(["ab", "c"], [(2,), (3,)], ["bfloat16", "float16"]), Catalog(["ab", "c"], [(3,), (2,)], bf),
            Catalog(["ab", "c"], [(23,), ()], bf)]
    assert len({c.fingerprint for c in cats}) == len(cats)
    assert Catalog(["ab", "c"], [(2,), (3,)], bf).fingerprint == cats[0].fingerprint
    # what trainers and engines of earlier versions compute for the same tensors: a mixed pair
    # would otherwise refuse every delta and reseed at every step
    tied = Catalog(["model.embed_tokens.weight", "lm_head.weight"], [(151936, 1024)] * 2, bf)
    assert tied.fingerprint == "645d442c14e7820350507565"


@pytest.mark.parametrize("checks", ["host kernel", "torch ops"])
def test_a_table_checks_its_entries_and_names_the_tensor(checks, monkeypatch):
    """A table's entries get the checks JSON entries get (order, bounds, finiteness), and a failure
    names the tensor; a stream out of the catalogue's order keeps the rest in JSON entries, and a
    dense entry goes beside the table; a receiver with another catalogue refuses the bucket. With
    the torch ops (buffers off the host) a good table is checked over its columns, with no entry
    per tensor made."""
    if checks == "torch ops":
        import delta_sync.bucket as bucket_mod
        from delta_sync.catalog import TableSlice
        monkeypatch.setattr(bucket_mod.native, "sparse_in_order", lambda *a: None)  # what device buffers get
        made = []
        entries = TableSlice.entries
        monkeypatch.setattr(TableSlice, "entries", lambda self, which=None: made.append(1) or entries(self, which))
    cat = _catalog(["a", "b", "c"])
    good = [_sparse("a", [1, 5]), Patch.full("b", torch.ones(4, 4, dtype=torch.bfloat16)), _sparse("c", [0])]
    (bucket,) = _packed(cat, good)
    assert [e["name"] for e in bucket.header["entries"]] == ["b"] and "table" in bucket.header
    out = entry_patches(bucket, catalog=cat)
    if checks == "torch ops":
        assert not made, "a good table was checked entry by entry"
    assert [p.name for _, p in bucket.table.patches()] == ["a", "c"] and [p.name for _, p in out] == ["b"]
    (shuffled,) = _packed(cat, [_sparse("c", [2]), _sparse("a", [3])])  # "a" after "c": a JSON entry
    assert [e["name"] for e in shuffled.header["entries"]] == ["a"]
    for idx, value, why in (([5, 3], 1.0, "not increasing"), ([2, 16], 1.0, "out of bounds"),
                            ([1, 2], float("nan"), "non-finite")):
        packer = BucketPacker(1, "delta", 1 << 20, check=False)  # a buggy sender: its own checks off
        packer.catalog = cat
        (bad,) = packer.pack([_sparse("a", [0]), _sparse("b", idx, value)])
        with pytest.raises(PatchValidationError, match=f"'b'.*{why}"):
            entry_patches(bad, catalog=cat)
        checked = BucketPacker(1, "delta", 1 << 20)  # the sender's own checks refuse it before it leaves
        checked.catalog = cat
        with pytest.raises(PatchValidationError, match=f"'b'.*{why}"):
            list(checked.pack([_sparse("a", [0]), _sparse("b", idx, value)]))
    for flip in ("value bits", "index out of bounds", "value to NaN"):  # payload bits changed on the way
        (flipped,) = _packed(cat, good)
        if flip == "value bits":
            flipped.values["bfloat16"].view(torch.int16)[0] ^= 0x4000
        elif flip == "index out of bounds":
            flipped.indices[-1] ^= 1 << 20
        else:
            flipped.values["bfloat16"].view(torch.int16)[-1] = 0x7FC0
        with pytest.raises(ChecksumMismatch):  # the checksum's verdict first, before the table's checks
            entry_patches(flipped, catalog=cat)
    with pytest.raises(NeedsSeed, match="catalogue"):
        entry_patches(bucket, catalog=_catalog(["a", "b", "x"]))


def _decoded(buckets: list, cat: Catalog) -> dict[str, tuple[list[int], list[float]]]:
    """Each tensor's indices and values as a receiver reads them from the buckets (tables and
    JSON entries), in bucket order."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for b in buckets:
        got = entry_patches(b, catalog=cat)
        table = b.table.patches() if b.table is not None else []
        for _, p in [*got, *table]:
            idx, val = out.setdefault(p.name, ([], []))
            idx += p.indices.tolist()
            val += p.values.float().tolist()
    return out


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64, 77], ids=["one-bucket", "split", "odd-split"])
def test_a_batch_packs_into_tables_as_its_patches_would(bucket_bytes):
    """A PatchBatch (one diff kernel batch: many tensors' changed elements in shared buffers) goes
    into the tables by ranges; what the receivers read is what the same tensors packed as
    patches one by one give, with buckets cutting through tensors; a tensor the catalogue lacks,
    or out of its order, travels as a JSON entry, and the run goes on after it."""
    names = [f"w{i}" for i in range(12)]
    cat = _catalog(names[:5] + names[6:])  # w5 is not catalogued
    g = torch.Generator().manual_seed(3)
    patches = []
    for i, n in enumerate(["w0", "w1", "w2", "w5", "w3", "w4", "w9", "w7", "w8", "w10", "w11"]):  # w7 after w9
        idx = torch.randperm(16, generator=g)[:2 + i % 7].sort().values.to(torch.int32)
        patches.append(Patch(n, (4, 4), torch.bfloat16, idx, torch.randn(idx.numel(), generator=g).bfloat16()))
    batch = PatchBatch([p.name for p in patches], [p.shape for p in patches], torch.bfloat16,
                       [p.count for p in patches], torch.cat([p.indices for p in patches]),
                       torch.cat([p.values for p in patches]))
    batch.validate()
    one_by_one, batched = _packed(cat, patches, bucket_bytes), _packed(cat, [batch], bucket_bytes)
    assert _decoded(batched, cat) == _decoded(one_by_one, cat)
    assert _decoded(batched, cat) == {p.name: (p.indices.tolist(), p.values.float().tolist()) for p in patches}
    json_names = {e["name"] for b in batched for e in b.header["entries"]}
    assert json_names == {"w5", "w7", "w8"}  # w7 and w8 come after w9
    if bucket_bytes < 100:  # buckets of a few elements: tensors cut between two buckets' tables
        per_bucket = [set(b.table.ids.tolist()) for b in batched if b.table is not None]
        assert len(per_bucket) >= 3 and any(a & b for a, b in zip(per_bucket, per_bucket[1:]))
    with pytest.raises(PatchValidationError, match="do not match its buffers"):
        PatchBatch(["a"], [(4, 4)], torch.bfloat16, [2], torch.zeros(1, dtype=torch.int32),
                   torch.zeros(1, dtype=torch.bfloat16)).validate()


@pytest.mark.parametrize("case", ["in-order", "second-batch-behind", "reshaped", "other-dtype"])
def test_a_batch_in_catalogue_order_goes_into_tables_and_anything_else_as_json(case):
    """A batch whose tensors are all catalogued as they are, after every table entry so far and in
    order, goes into the tables whole; a batch behind the tables so far, or a tensor of another shape
    or dtype than catalogued, travels as JSON entries, and both arrive exact."""
    names = [f"w{i}" for i in range(8)]
    cat = _catalog(names)
    g = torch.Generator().manual_seed(4)

    def batch(ns, shape=(4, 4), dtype=torch.bfloat16):
        ps = []
        for n in ns:
            idx = torch.randperm(16, generator=g)[:3].sort().values.to(torch.int32)
            ps.append(Patch(n, shape, dtype, idx, torch.randn(3, generator=g).to(dtype)))
        return ps, PatchBatch(ns, [shape] * len(ns), dtype, [3] * len(ns), torch.cat([p.indices for p in ps]),
                              torch.cat([p.values for p in ps]))

    first, b1 = batch(names[4:])
    how = {"in-order": {}, "second-batch-behind": {}, "reshaped": {"shape": (2, 8)},
           "other-dtype": {"dtype": torch.float16}}[case]
    second, b2 = batch(names[:4], **how)
    batches = [b1, b2] if case == "second-batch-behind" else [b2, b1]
    packed = _packed(cat, batches, 1 << 20)
    json_names = {e["name"] for b in packed for e in b.header["entries"]}
    assert json_names == (set() if case == "in-order" else set(names[:4])), json_names
    want = {p.name: (p.indices.tolist(), p.values.float().tolist()) for p in first + second}
    assert _decoded(packed, cat) == want
