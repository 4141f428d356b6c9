"""Megatron-core (via Megatron-Bridge) trainer side on real gloo ranks, CPU."""

from __future__ import annotations

import pytest
import torch

from launchers.checkpoints import build

from .multiproc import run_ranks

pytestmark = pytest.mark.slow

BATCH = torch.tensor([[1, 17, 45, 99, 130, 7, 250, 3, 60, 61], [1, 60, 61, 62, 200, 201, 9, 2, 17, 45]])


def _train_and_sync(rank, world, port, path, tp, steps, transport):
    import argparse

    import torch.distributed as dist

    from launchers.megatron_trainer import MegatronTrainer
    from update_weight import add_update_weight_args, build_updater
    from update_weight.megatron_source import BridgeExportSource

    from .reference_receiver import ReferenceReceiver

    trainer = MegatronTrainer.from_hf(path, tp=tp, lr=1e-4)
    source = BridgeExportSource(trainer.bridge, trainer.model)
    receiver = ReferenceReceiver() if rank == 0 else None
    args = add_update_weight_args(argparse.ArgumentParser()).parse_args(
        ["--update-weight-transport", transport, "--update-weight-mode", "delta" if transport.startswith("sparse")
         else "full", "--update-weight-verify-every", "1"])
    updater = build_updater(args, [receiver] if rank == 0 else [])
    kinds = []
    for _ in range(steps):
        trainer.step(BATCH)
        rep = updater.update_weights(source)
        kinds.append((rep.kind, rep.changed_elements, rep.total_elements))
    # an independent full export, consumed by every rank, compared on rank 0 bit for bit
    mismatched = []
    for name, t in BridgeExportSource(trainer.bridge, trainer.model):
        if rank == 0 and not torch.equal(receiver.tensors[name].view(torch.int16), t.view(torch.int16)):
            mismatched.append(name)
    n_tensors = len(receiver.tensors) if rank == 0 else None
    updater.close()
    dist.barrier()
    return kinds, mismatched, n_tensors


@pytest.mark.parametrize("tp", [2])
def test_tp_trainer_reconstruction_equals_independent_export(tp):
    path = str(build("dense"))
    results = run_ranks(_train_and_sync, tp, path, tp, 3, "sparse_gloo", timeout=600)
    kinds, mismatched, n_tensors = results[0]
    assert [k for k, _, _ in kinds] == ["seed", "delta", "delta"]
    assert all(0 < c < total for _, c, total in kinds[1:]), kinds
    assert n_tensors == 24 and mismatched == []
    assert all(r[0] == kinds for r in results)  # every rank reports the same updates
