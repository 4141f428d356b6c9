#!/usr/bin/env bash
# Qwen3-30B-A3B RL on six Ascend NPUs: training TP2/PP2/EP2 ... on cards 0-3, rollout engine
# TP2/PP1/EP2 on cards 4-5, weights synced as deltas over HCCL every step.
#
# NOT RUNNABLE YET: launchers/train_rl.py drives TP and DP only (PP and EP are not wired into the
# trainer on this CPU-only project). The layout and every engine setting below are the
# production target; the flags the script passes exist and are validated today.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL=${MODEL:?path to the Qwen3-30B-A3B Hugging Face checkpoint}
RENDEZVOUS_HOST=${RENDEZVOUS_HOST:-127.0.0.1}   # host of trainer rank 0 (the sender): engines on other hosts dial it
ENGINE_PORT=${ENGINE_PORT:-8000}
ENGINE_URL=${ENGINE_URL:-http://127.0.0.1:${ENGINE_PORT}}   # point at remote engines to run them elsewhere

# Rollout engine on cards 4-5. ASCEND_RT_VISIBLE_DEVICES restricts this process's cards
# (ASCEND_VISIBLE_DEVICES is the container runtime's knob, not this one).
ASCEND_RT_VISIBLE_DEVICES=4,5 \
VLLM_SERVER_DEV_MODE=1 \
  python -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name m --port "$ENGINE_PORT" \
    --tensor-parallel-size 2 --enable-expert-parallel \
    --enforce-eager \
    --additional-config '{"weight_nz_mode": 0, "rl_config": {"enabled": true}}' \
    --weight-transfer-config '{"backend": "delta_sync"}' &
# --enforce-eager: ACL graphs capture weight addresses; in-place updates are safe, graphs are not needed
# weight_nz_mode 0 / rl_config: ND weights (FRACTAL_NZ tiles have no affine loader view); no fp32
#   shadow copies (precast_fp32_weight) or fused MC2 expert lists, which a patch would not update
# pipeline parallel stays 1 and dynamic EPLB off on the engine: loader views need a fixed layout
engine_pid=$!
trap 'kill $engine_pid 2>/dev/null || true' EXIT

# Trainer on cards 0-3. HCCL's default port 16666 collides with other Ascend transfer engines:
# the delta-sync channel rendezvous picks a free port on RENDEZVOUS_HOST instead.
ASCEND_RT_VISIBLE_DEVICES=0,1,2,3 \
  python -m launchers.train_rl --model "$MODEL" --engine-url "$ENGINE_URL" \
    --trainer-ranks 4 --tp 2 \
    --update-weight-mode delta --update-weight-transport sparse_hccl \
    --update-weight-buffer-size 512MiB --update-weight-verify-every 10 \
    --out "$root/runs/qwen3-30b-a3b" "$@"
