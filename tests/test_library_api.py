"""Custom PyTorch trainers through the public API: HF Qwen3 + AdamW, single process, DDP, FSDP2."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from delta_sync import WeightSync
from delta_sync.checkpoints import build

from .engine_helpers import PROMPTS, ROOT, close_llm, engine_differs_from, fresh_engine, load_state, max_logprob_error
from launchers.ranks import run_ranks

STEPS = 4
BATCH = torch.tensor([[1, 17, 45, 99, 130, 7, 250, 3], [1, 60, 61, 62, 200, 201, 9, 2]])


def _train_step(model, opt) -> None:
    loss = model(input_ids=BATCH, labels=BATCH).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def _save_bf16(config_dir, named_full: dict[str, torch.Tensor], out) -> None:
    """An independent export: a fresh HF model from the trained tensors, ``save_pretrained`` in bf16."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(named_full, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(config_dir, f), os.path.join(out, f))


def test_single_process_hf_trainer_equals_fresh_engine(tmp_path):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    from .engine_runner import engine_kwargs, greedy

    path = build("dense")
    llm = LLM(model=str(path), **engine_kwargs())
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # fp32 master weights
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sync = WeightSync([llm], dtype=torch.bfloat16, verify_every=1)
        reports = []
        for _ in range(STEPS):
            _train_step(model, opt)
            reports.append(sync.update(model.named_parameters()))
        assert [r.kind for r in reports] == ["seed"] + ["delta"] * (STEPS - 1)
        assert all(r.verified for r in reports)
        assert all(0 < r.changed_fraction < 1 for r in reports[1:]), [r.changed_fraction for r in reports]
        # in-process: the channel stays in this process (NCCL/HCCL refuse two ranks on one device)
        assert sync.channel.backend == "local"
        live = greedy(llm, PROMPTS)
        sync.close()
        _save_bf16(str(path), dict(model.named_parameters()), tmp_path / "trained")
        fresh = fresh_engine(tmp_path / "trained")
        assert live == fresh, f"max logprob error {max_logprob_error(live, fresh)}"
    finally:
        close_llm(llm)


def _multi_rank_trainer(rank, world, port, url, path, out, parallel):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if parallel == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        trained = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-4)
    sync = WeightSync([url], dtype=torch.bfloat16, verify_every=2)
    kinds = []
    for step in range(STEPS):
        batch = BATCH[rank:rank + 1]  # each rank its own data: gradients are averaged
        loss = trained(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        rep = sync.update(trained.named_parameters())
        kinds.append((rep.kind, rep.changed_elements))
    full = {}
    for name, p in trained.named_parameters():  # collective under FSDP2: every rank iterates
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        full[name.removeprefix("module.")] = t.detach().clone()
    if rank == 0:
        _save_bf16(str(path), full, out)
    sync.close()
    dist.barrier()
    return kinds


@pytest.mark.slow
def test_ddp_and_fsdp2_trainers_equal_their_exports(tmp_path, dense_server):
    """Two ranks under DDP, then FSDP2, sync one live HTTP engine; after each, every engine weight
    (read back through the loader views, as digests) equals an independent bf16 export of the
    trained model, bit for bit. (That views write the right places is shown against fresh engines
    by the single-process test above and tests/test_vllm_receiver.py.)"""
    path, base = dense_server.path, dense_server.base
    for parallel in ("ddp", "fsdp2"):
        kinds = run_ranks(_multi_rank_trainer, 2, base, str(path), str(tmp_path / parallel), parallel, timeout=600)
        assert kinds[0] == kinds[1] and [k for k, _ in kinds[0]] == ["seed"] + ["delta"] * (STEPS - 1)
        assert all(c > 0 for _, c in kinds[0])
        assert engine_differs_from(base, load_state(tmp_path / parallel)) == [], parallel


@pytest.mark.receiver
def test_readme_example_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"<!-- example -->\n```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_OMP_THREADS_BIND="nobind"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("seed", "delta"))]
    assert [ln.split()[0] for ln in lines] == ["seed", "delta", "delta"], out.stdout[-2000:]


def test_an_update_while_another_runs_is_refused():
    """Two threads calling update on one WeightSync: the second gets UpdateInFlight at once, the
    first completes, and the receiver holds exactly its version."""
    import threading

    from delta_sync.errors import UpdateInFlight
    from delta_sync.memory_receiver import MemoryReceiver

    rx = MemoryReceiver()
    sync = WeightSync([rx], mode="delta", timeout_s=60)
    state = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    inside, go = threading.Event(), threading.Event()

    def slow():
        inside.set()
        go.wait(30)
        yield from state.items()
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("rep", sync.update(slow())))
    th.start()
    assert inside.wait(30)
    with pytest.raises(UpdateInFlight, match="still running"):
        sync.update(state.items())
    go.set()
    th.join(60)
    assert result["rep"].kind == "seed" and rx.version == 0
    assert torch.equal(rx.tensors["w"], state["w"])
    sync.close()


def test_no_automatic_gc_pass_lands_inside_an_update():
    """A full cyclic-GC pass (~0.1 s in a bare torch process, more in a trainer's heap) is held off
    while an update runs, however it ends, and the thresholds are left as the caller had them
    afterwards; the young generations keep being collected (a long seed's cyclic garbage cannot
    pile up); with two syncs updating at once the thresholds come back only when both are done."""
    import gc
    import threading

    from delta_sync.memory_receiver import MemoryReceiver

    state = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    seen = []

    def watched(fail=False, inside=None, go=None):
        seen.append((gc.isenabled(), gc.get_threshold()))
        if inside is not None:
            inside.set()
            go.wait(30)
        if fail:
            raise RuntimeError("trainer export failed")
        yield from state.items()

    def held(entry):
        enabled, (t0, t1, t2) = entry
        return enabled and (t0, t1) == before[:2] and t2 > 1 << 20

    a, b = WeightSync([MemoryReceiver()], timeout_s=60), WeightSync([MemoryReceiver()], timeout_s=60)
    before = gc.get_threshold()
    try:
        a.update(watched())
        assert held(seen[-1]) and gc.get_threshold() == before
        with pytest.raises(RuntimeError, match="export failed"):
            a.update(watched(fail=True))
        assert held(seen[-1]) and gc.get_threshold() == before
        gc.disable()  # the caller's own choice stays
        try:
            a.update(watched())
            assert not gc.isenabled() and gc.get_threshold() == before
        finally:
            gc.enable()
        inside, go = threading.Event(), threading.Event()
        th = threading.Thread(target=a.update, args=(watched(inside=inside, go=go),))
        th.start()
        assert inside.wait(30)
        b.update(watched())  # ends while a's update still runs
        assert gc.get_threshold()[2] > 1 << 20
        go.set()
        th.join(60)
        assert gc.get_threshold() == before and held(seen[-1]) and held(seen[-2])
    finally:
        a.close(), b.close()
