"""Tiny Qwen3 / Qwen3-MoE checkpoints built locally (no hub): for examples, tests and benchmarks.

``build(kind)`` returns the directory of a random checkpoint of that kind (built once, then cached
under ``$DELTA_SYNC_CHECKPOINTS``, default ``.cache/checkpoints`` of the source tree or
``~/.cache/delta_sync/checkpoints`` of an installed package); ``save_like`` writes a state dict as
a checkpoint beside another's config and tokenizer. Needs ``transformers`` (imported on use).

Shapes are the smallest that still exercise every loader path vLLM has for the real models:
2 layers, GQA (4 query heads, 2 kv heads), head_dim 32 (vLLM's CPU attention rejects 16), tied
embeddings for the dense model (as Qwen3-0.6B), 8 experts with per-expert checkpoint names for
the MoE model (as Qwen3-30B-A3B). Weights are N(0, 0.2) so greedy outputs are distinct.

``moe-wide`` has 24 experts (12 per rank at EP=2: two-digit local expert numbers, which changed
Bridge's export order). ``moe-bench`` is larger (54M parameters, 32 experts, experts ~93% of the weights as in
Qwen3-30B-A3B, weights N(0, 0.02) as real initialisations) for the sync benchmark, not for engines;
``moe-e2e`` (0.33B parameters, same init) is the end-to-end benchmark's Megatron model.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import torch

def _root() -> Path:
    if os.environ.get("DELTA_SYNC_CHECKPOINTS"):
        return Path(os.environ["DELTA_SYNC_CHECKPOINTS"])
    tree = Path(__file__).resolve().parents[1]
    if (tree / "pyproject.toml").is_file():  # a source checkout
        return tree / ".cache" / "checkpoints"
    return Path(os.path.expanduser("~/.cache")) / "delta_sync" / "checkpoints"


ROOT = _root()
CORPUS = (
    "the quick brown fox jumps over the lazy dog. weights change a little every step of "
    "reinforcement learning, and the engine must serve exactly the trained weights. "
    "one two three four five six seven eight nine ten. alpha beta gamma delta epsilon. "
    "def add(a, b): return a + b\nprint(add(2, 3))\n"
)
VOCAB = 384
COMMON = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
              vocab_size=VOCAB, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)

#: MoE kinds: (shape overrides of COMMON, expert settings).
MOE = {
    "moe": ({}, dict(intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)),
    # >= 10 experts per EP rank at EP=2: Bridge's export order depends on it
    "moe-wide": ({}, dict(intermediate_size=256, moe_intermediate_size=32, num_experts=24, num_experts_per_tok=2)),
    "moe-bench": (dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=64),
                  dict(intermediate_size=1024, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4)),
    # 0.33B parameters (experts ~92%), for the end-to-end benchmark's Megatron section (bench e2e)
    "moe-e2e": (dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=64),
                dict(intermediate_size=3072, moe_intermediate_size=384, num_experts=32, num_experts_per_tok=4)),
}
#: Qwen3-30B-A3B's names and layout (48 layers x 128 experts x 3 matrices: 18,867 tensors) at tiny
#: dimensions (39M parameters): the per-tensor costs of a sync at the production tensor count.
#: ``moe-30b-skeleton-L12``: the same with 12 layers (slope fits over the layer count).
SKELETON = "moe-30b-skeleton"
MOE[SKELETON] = (dict(hidden_size=64, num_hidden_layers=48, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32),  # vLLM's CPU attention takes head_dim >= 32
                 dict(intermediate_size=128, moe_intermediate_size=32, num_experts=128, num_experts_per_tok=8))


def moe_kind(kind: str) -> tuple[dict, dict] | None:
    """``MOE[kind]``, or a skeleton of another depth (``moe-30b-skeleton-L<n>``); None if neither."""
    if kind in MOE:
        return MOE[kind]
    base, _, layers = kind.rpartition("-L")
    if base == SKELETON and layers.isdigit() and int(layers) > 0:
        shape, experts = MOE[SKELETON]
        return dict(shape, num_hidden_layers=int(layers)), experts
    return None


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)


def _randomize(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def build(kind: str, seed: int = 0) -> Path:
    """Path of the cached checkpoint ``kind`` ("dense" or a row of ``MOE``); built once, under a lock."""
    path = ROOT / f"qwen3-{kind}-s{seed}"
    if (path / "done").exists():
        return path
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "done").exists():
            return path
        from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

        if kind == "dense":
            model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=256, tie_word_embeddings=True, **COMMON))
        elif moe_kind(kind) is not None:
            shape, experts = moe_kind(kind)
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**dict(COMMON, **shape), **experts, norm_topk_prob=True,
                                                       decoder_sparse_step=1, mlp_only_layers=[],
                                                       tie_word_embeddings=False))
        else:
            raise ValueError(kind)
        _randomize(model, seed, std=0.02 if kind in ("moe-bench", "moe-e2e") else 0.2)
        model = model.to(torch.bfloat16)
        tmp = path.with_suffix(".tmp")
        model.save_pretrained(tmp, safe_serialization=True)
        _tokenizer(tmp)
        if tmp.exists() and path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        (path / "done").write_text(json.dumps({"kind": kind, "seed": seed}))
    return path


def save_like(state: dict[str, torch.Tensor], like: str | Path, out: str | Path) -> Path:
    """A checkpoint at ``out``: ``state`` as one safetensors file, every other file (config,
    tokenizer) copied from ``like``; ``like``'s weights, shard index and build marker are not."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(like, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", "done"))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _attention(p: str, hidden: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """One Qwen3 layer's attention and norm tensors (dense and MoE alike), checkpoint names."""
    return {p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}


def _norms(p: str, hidden: int) -> dict[str, tuple[int, ...]]:
    return {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}


def qwen3_shapes(layers: int = 28, hidden: int = 1024, inter: int = 3072, vocab: int = 151_936,
                 heads: int = 16, kv_heads: int = 8, head_dim: int = 128) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of a Qwen3 dense model (defaults: Qwen3-0.6B, tied embeddings)."""
    out = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update(_attention(p, hidden, heads, kv_heads, head_dim))
        out.update({p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                    p + "mlp.down_proj.weight": (hidden, inter)})
        out.update(_norms(p, hidden))
    return out


def skeleton_shapes(layers: int = 48) -> dict[str, tuple[int, ...]]:
    """Names and shapes of :data:`SKELETON` (``moe-30b-skeleton``) with ``layers`` layers."""
    shape, experts = MOE[SKELETON]
    return qwen3_moe_shapes(layers, hidden=shape["hidden_size"], expert_inter=experts["moe_intermediate_size"],
                            experts=experts["num_experts"], vocab=VOCAB, heads=shape["num_attention_heads"],
                            kv_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"])


def qwen3_moe_shapes(layers: int = 48, hidden: int = 2048, expert_inter: int = 768, experts: int = 128,
                     vocab: int = 151_936, heads: int = 32, kv_heads: int = 4, head_dim: int = 128
                     ) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of a Qwen3-MoE model (defaults: Qwen3-30B-A3B, untied head)."""
    out = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
           "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update(_attention(p, hidden, heads, kv_heads, head_dim))
        out[p + "mlp.gate.weight"] = (experts, hidden)
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out.update({q + "gate_proj.weight": (expert_inter, hidden), q + "up_proj.weight": (expert_inter, hidden),
                        q + "down_proj.weight": (hidden, expert_inter)})
        out.update(_norms(p, hidden))
    return out
