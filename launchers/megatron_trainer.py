"""A Megatron-core model loaded from a Hugging Face checkpoint through Megatron-Bridge, trained on
CPU over gloo with Megatron-style mixed precision: bf16 model weights, fp32 master weights in the
optimizer (with bf16-only Adam, updates below half an ulp vanish and nothing ever changes).

Only what the tests and the launcher need: TP (with sequence parallelism for MoE, as mcore
requires), DP, PP (one microbatch, driven by hand), EP (SequentialMLP experts, ETP=1) and tied
embeddings across pipeline stages. Gradients are reduced by hand the way Megatron's DDP and
``finalize_model_grads`` do: sequence-parallel and q/k-norm grads summed over TP, the tied
embedding's grad summed over the embedding group (first and last stage), then averaged over
data-parallel replicas (expert-data-parallel for experts).
"""

from __future__ import annotations

import importlib
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
    device: torch.device = torch.device("cpu")

    @classmethod
    def from_hf(cls, path, tp: int = 1, lr: float = 1e-6, pp: int = 1, ep: int = 1,
                sequence_parallel: bool | None = None, device: str | torch.device = "cpu",
                master_device: str = "device") -> "MegatronTrainer":
        """Every rank of the default process group calls this (model parallel state is initialised here).
        ``sequence_parallel`` defaults to on for MoE at TP>1 (mcore refuses to train it without).
        ``device``: where the model lives, the device this rank was bound to (see
        ``delta_sync.accelerator.bind``); tested on CPU only. On Ascend, Megatron runs through
        MindSpeed's adaptor, imported here before any Megatron module. ``master_device="cpu"`` keeps
        the fp32 master weights and Adam's state in host memory (12 B per parameter off the device;
        gradients travel to the host and bf16 weights back once per step)."""
        device = torch.device(device)
        if device.type == "npu":
            try:
                importlib.import_module("mindspeed.megatron_adaptor")  # patches Megatron for torch_npu
            except ImportError as e:
                raise ImportError("Megatron on Ascend NPUs needs MindSpeed (mindspeed.megatron_adaptor); "
                                  "install it next to torch_npu, or train on cpu/cuda") from e
        apply_all()
        from megatron.bridge import AutoBridge
        from megatron.bridge.models.gpt_provider import local_layer_spec
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                     expert_model_parallel_size=ep,
                                                     expert_tensor_parallel_size=1)
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
        moe = bool(getattr(provider, "num_moe_experts", None))
        provider.sequence_parallel = (moe and tp > 1) if sequence_parallel is None else sequence_parallel
        if moe:
            provider.moe_grouped_gemm = False  # grouped GEMM and permute fusion need TE / CUDA
            provider.moe_permute_fusion = False
            provider.moe_token_dispatcher_type = "allgather"  # alltoall creates a CUDA stream
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False,
                                                   use_cpu_initialization=device.type == "cpu")
        install_cpu()  # modules imported while building the model (a no-op where CUDA answers)
        params = [p for chunk in model for p in chunk.parameters()]
        home = device if master_device == "device" else torch.device(master_device)
        master = [p.detach().to(home, torch.float32, copy=True).requires_grad_(True) for p in params]
        opt = torch.optim.Adam(master, lr=lr)
        return cls(bridge, model, master, opt, device)

    def params(self) -> list[torch.Tensor]:
        return [p for chunk in self.model for p in chunk.parameters()]

    def step(self, input_ids: torch.Tensor, loss_weights: torch.Tensor | None = None) -> float:
        """One forward/backward/Adam step; ``loss_weights`` [b, s] scale per-token losses (advantages)."""
        from megatron.core import parallel_state

        model = self.model[0]
        input_ids = input_ids.to(self.device)
        loss_weights = (torch.ones(input_ids.shape) if loss_weights is None else loss_weights.float()).to(
            self.device, copy=True)
        loss_weights[:, -1] = 0  # the last position has no next token (labels wrap around)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if model.config.sequence_parallel and input_ids.shape[1] % tp:  # SP splits the sequence over TP
            pad = tp - input_ids.shape[1] % tp
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            loss_weights = torch.nn.functional.pad(loss_weights, (0, pad))
        s = input_ids.shape[1]
        pos = torch.arange(s, device=self.device).unsqueeze(0).expand_as(input_ids)
        # causal mask built here: core's default one is created on "cuda"
        mask = torch.triu(torch.ones(s, s, device=self.device), diagonal=1).bool()[None, None]
        labels = torch.roll(input_ids, -1, dims=1)
        loss = self._forward_backward(model, input_ids, pos, mask, labels, loss_weights)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group()
        edp_group = parallel_state.get_expert_data_parallel_group()  # replicas of *this rank's* experts
        tied = self._tied_embedding()
        named = [(n, p) for chunk in self.model for n, p in chunk.named_parameters()]
        for (name, p), mp in zip(named, self.master):
            g = p.grad.float() if p.grad is not None else torch.zeros_like(mp)
            if tp > 1 and (getattr(p, "sequence_parallel", False) and model.config.sequence_parallel
                           or "q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(g, group=tp_group)  # partial: this rank's tokens (SP) or heads (q/k norm)
            if p is tied:  # first stage's embedding and last stage's output layer: one weight
                dist.all_reduce(g, group=parallel_state.get_embedding_group())
            group = edp_group if ".local_experts." in name else dp_group
            if dist.get_world_size(group) > 1:
                dist.all_reduce(g, group=group)
                g /= dist.get_world_size(group)
            mp.grad = g.to(mp.device)
            p.grad = None
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, mp in zip(self.params(), self.master):
                p.copy_(mp)  # bf16 model weights = round(fp32 master)
        return loss

    def _tied_embedding(self) -> torch.Tensor | None:
        """The copy of a tied embedding this rank holds when it is split over pipeline stages."""
        from megatron.core import parallel_state

        model = getattr(self.model[0], "module", self.model[0])  # inside Float16Module
        if (not model.share_embeddings_and_output_weights
                or parallel_state.get_pipeline_model_parallel_world_size() == 1
                or not parallel_state.is_rank_in_embedding_group()):
            return None
        return model.shared_embedding_or_output_weight()

    @staticmethod
    def _forward_backward(model, input_ids, pos, mask, labels, loss_weights) -> float:
        """One microbatch through the pipeline by hand (Megatron's schedules hard-code CUDA):
        receive the previous stage's activations, forward, send them on; the last stage computes
        the weighted token loss; gradients travel back the same way. Returns the loss on the last
        stage, NaN elsewhere."""
        from megatron.core import parallel_state as ps

        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        b, s = input_ids.shape
        if model.config.sequence_parallel:  # stages exchange this rank's sequence shard
            s //= ps.get_tensor_model_parallel_world_size()
        hidden = (s, b, model.config.hidden_size)
        received = None
        if not first:
            received = torch.empty(hidden, dtype=model.config.params_dtype, device=input_ids.device)
            dist.recv(received, ps.get_pipeline_model_parallel_prev_rank())
            received.requires_grad_(True)
            model.set_input_tensor(received)
        out = model(input_ids, pos, mask, labels=labels if last else None)
        loss_value = float("nan")
        if last:
            token_loss = out.float()  # [b, s]
            weights = loss_weights
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
