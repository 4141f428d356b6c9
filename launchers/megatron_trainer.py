"""A Megatron-core model loaded from a Hugging Face checkpoint through Megatron-Bridge, trained on
CPU over gloo with Megatron-style mixed precision: bf16 model weights, fp32 master weights in the
optimizer (with bf16-only Adam, updates below half an ulp vanish and nothing ever changes).

Only what the tests and the launcher need: TP, DP, PP (one microbatch, driven by hand) and EP
(SequentialMLP experts; their gradients are averaged over expert-data-parallel replicas only) on CPU.
Not supported on CPU: TP>1 for MoE (needs sequence parallelism, i.e. TE/apex norms) and tied
embeddings at PP>1 (core moves the shared weight with ``.cuda()``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from patches.megatron_bridge import apply_all, hf_config_compat, install_cpu

_FUSIONS = ("bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "bias_dropout_fusion",
            "apply_rope_fusion", "gradient_accumulation_fusion", "cross_entropy_loss_fusion")


@dataclass
class MegatronTrainer:
    bridge: object
    model: list
    master: list[torch.Tensor]
    opt: torch.optim.Optimizer

    @classmethod
    def from_hf(cls, path, tp: int = 1, lr: float = 1e-6, pp: int = 1, ep: int = 1) -> "MegatronTrainer":
        """Every rank of the default gloo group calls this (model parallel state is initialised here)."""
        apply_all()
        from megatron.bridge import AutoBridge
        from megatron.bridge.models.gpt_provider import local_layer_spec
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                     expert_model_parallel_size=ep)
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        bridge = AutoBridge.from_hf_pretrained(str(path), torch_dtype=torch.bfloat16)
        hf_config_compat(bridge.hf_pretrained.config)
        provider = bridge.to_megatron_provider(load_weights=True)
        provider.transformer_layer_spec = local_layer_spec
        provider.kv_channels = bridge.hf_pretrained.config.head_dim  # Bridge 0.3.0 keeps 128
        provider.tensor_model_parallel_size = tp
        provider.pipeline_model_parallel_size = pp
        provider.expert_model_parallel_size = ep
        provider.expert_tensor_parallel_size = 1
        for name in _FUSIONS:
            if hasattr(provider, name):
                setattr(provider, name, False)
        provider.hidden_dropout = provider.attention_dropout = 0.0
        if getattr(provider, "num_moe_experts", None):
            provider.moe_grouped_gemm = False  # grouped GEMM and permute fusion need TE / CUDA
            provider.moe_permute_fusion = False
            provider.moe_token_dispatcher_type = "allgather"  # alltoall creates a CUDA stream
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        install_cpu()  # modules imported while building the model
        params = [p for chunk in model for p in chunk.parameters()]
        master = [p.detach().float().clone().requires_grad_(True) for p in params]
        opt = torch.optim.Adam(master, lr=lr)
        return cls(bridge, model, master, opt)

    def params(self) -> list[torch.Tensor]:
        return [p for chunk in self.model for p in chunk.parameters()]

    def step(self, input_ids: torch.Tensor, loss_weights: torch.Tensor | None = None) -> float:
        """One forward/backward/Adam step; ``loss_weights`` [b, s] scale per-token losses (advantages)."""
        from megatron.core import parallel_state

        model = self.model[0]
        s = input_ids.shape[1]
        pos = torch.arange(s).unsqueeze(0).expand_as(input_ids)
        mask = torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None]  # core's default mask is on "cuda"
        labels = torch.roll(input_ids, -1, dims=1)
        loss = self._forward_backward(model, input_ids, pos, mask, labels, loss_weights)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group()
        edp_group = parallel_state.get_expert_data_parallel_group()  # replicas of *this rank's* experts
        named = [(n, p) for chunk in self.model for n, p in chunk.named_parameters()]
        for (name, p), mp in zip(named, self.master):
            g = p.grad.float() if p.grad is not None else torch.zeros_like(mp)
            if ("q_layernorm" in name or "k_layernorm" in name) and dist.get_world_size(tp_group) > 1:
                dist.all_reduce(g, group=tp_group)  # per-head norms see only this rank's heads
            group = edp_group if ".local_experts." in name else dp_group
            if dist.get_world_size(group) > 1:
                dist.all_reduce(g, group=group)
                g /= dist.get_world_size(group)
            mp.grad = g
            p.grad = None
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, mp in zip(self.params(), self.master):
                p.copy_(mp)  # bf16 model weights = round(fp32 master)
        return loss

    @staticmethod
    def _forward_backward(model, input_ids, pos, mask, labels, loss_weights) -> float:
        """One microbatch through the pipeline by hand (Megatron's schedules hard-code CUDA):
        receive the previous stage's activations, forward, send them on; the last stage computes
        the weighted token loss; gradients travel back the same way. Returns the loss on the last
        stage, NaN elsewhere."""
        from megatron.core import parallel_state as ps

        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        b, s = input_ids.shape
        hidden = (s, b, model.config.hidden_size)
        received = None
        if not first:
            received = torch.empty(hidden, dtype=model.config.params_dtype)
            dist.recv(received, ps.get_pipeline_model_parallel_prev_rank())
            received.requires_grad_(True)
            model.set_input_tensor(received)
        out = model(input_ids, pos, mask, labels=labels if last else None)
        loss_value = float("nan")
        if last:
            token_loss = out.float()  # [b, s]
            weights = torch.ones_like(token_loss) if loss_weights is None else loss_weights.float()
            weights[:, -1] = 0
            loss = (token_loss * weights).sum() / weights.abs().sum().clamp(min=1)
            loss.backward()
            loss_value = float(loss.detach())
        else:
            dist.send(out.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
            grad = torch.empty_like(out)
            dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
            out.backward(grad)
        if not first:
            dist.send(received.grad.contiguous(), ps.get_pipeline_model_parallel_prev_rank())
        return loss_value
