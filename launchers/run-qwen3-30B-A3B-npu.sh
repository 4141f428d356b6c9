#!/usr/bin/env bash
# Qwen3-30B-A3B RL on six Ascend NPUs: training TP2/PP2/EP2 on cards 0-3, rollout engine TP2/PP1/EP2
# on cards 4-5, weights synced as deltas over HCCL every step.
#
# The same launcher and layout run on CPU in the test suite (tests/test_train_rl.py runs
# `--trainer-ranks 4 --tp 2 --pp 2 --ep 2` on the tiny MoE and checks the engine against a fresh one);
# this script only changes the devices, the model and the engine settings below. It has not been
# run on NPUs by this project: needs torch_npu + CANN, vllm-ascend, MindSpeed (Megatron on Ascend).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL=${MODEL:?path to the Qwen3-30B-A3B Hugging Face checkpoint}
# Address of trainer rank 0 (the sender) as the engine hosts see it: engine workers dial it to join
# the weight-sync channel. 127.0.0.1 only works while the engine runs on this host.
RENDEZVOUS_HOST=${RENDEZVOUS_HOST:-127.0.0.1}
# HCCL's default port 16666 collides with other Ascend transfer engines: pick the channel's port
# explicitly (open it in the firewall between hosts).
RENDEZVOUS_PORT=${RENDEZVOUS_PORT:-29600}
ENGINE_PORT=${ENGINE_PORT:-8000}
# The engine's dev-mode routes can pause it and reach its workers: it listens on loopback unless
# ENGINE_HOST says otherwise, and only callers holding DELTA_SYNC_SECRET may write its weights.
ENGINE_HOST=${ENGINE_HOST:-127.0.0.1}
export DELTA_SYNC_SECRET=${DELTA_SYNC_SECRET:-$(python -c 'import secrets; print(secrets.token_hex(32))')}
# Set ENGINE_URL to reach an engine on another host (and start it there with the settings below).
ENGINE_URL=${ENGINE_URL:-}

if [[ -z "$ENGINE_URL" ]]; then
  ENGINE_URL=http://${ENGINE_HOST}:${ENGINE_PORT}
  # Rollout engine on cards 4-5. ASCEND_RT_VISIBLE_DEVICES restricts this process's cards
  # (ASCEND_VISIBLE_DEVICES is the container runtime's knob, not this one).
  # VLLM_SERVER_DEV_MODE=1: exposes /pause, /start_weight_update, /update_weights,
  #   /finish_weight_update, /resume, which the trainer drives.
  # --tensor-parallel-size 2 --enable-expert-parallel: rollout TP2, experts split over the 2 cards (EP2);
  #   pipeline parallel stays 1 and dynamic EPLB off: loader views need a fixed layout.
  # --enforce-eager: ACL graphs capture weight addresses; in-place updates keep them, graphs are not needed.
  # weight_nz_mode 0 / rl_config: ND weights (FRACTAL_NZ tiles have no affine loader view; the receiver
  #   refuses NZ by name); no fp32 shadow copies or fused MC2 expert lists, which a patch would not update.
  # --weight-transfer-config backend delta_sync: the receiver registered by this package's vLLM plugin.
  ASCEND_RT_VISIBLE_DEVICES=4,5 \
  VLLM_SERVER_DEV_MODE=1 \
    python -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name m --host "$ENGINE_HOST" --port "$ENGINE_PORT" \
      --tensor-parallel-size 2 --enable-expert-parallel \
      --enforce-eager \
      --additional-config '{"weight_nz_mode": 0, "rl_config": {"enabled": true}}' \
      --weight-transfer-config '{"backend": "delta_sync"}' &
  engine_pid=$!
  trap 'kill $engine_pid 2>/dev/null || true' EXIT
  until curl -sf "$ENGINE_URL/health" >/dev/null; do sleep 5; done
fi

# Trainer on cards 0-3: 4 ranks = TP2 x PP2 (DP1), experts EP2 inside TP x DP at ETP1; rank r binds
# card r of ASCEND_RT_VISIBLE_DEVICES (--trainer-device npu: HCCL process group, MindSpeed).
# --update-weight-mode delta / sparse_hccl: a full seed once, then only changed elements over HCCL.
# --update-weight-buffer-size 512MiB: bucket bound (HBM scratch on the sender and each engine worker).
# --update-weight-verify-every 10: digest comparison every 10th version (and every seed).
# --lr 1e-6: RL post-training scale; with fp32 master weights this changes ~0.1-3% of bf16 elements.
ASCEND_RT_VISIBLE_DEVICES=0,1,2,3 \
  python -m launchers.train_rl --model "$MODEL" --engine-url "$ENGINE_URL" \
    --trainer-ranks 4 --tp 2 --pp 2 --ep 2 --trainer-device npu --lr 1e-6 \
    --update-weight-mode delta --update-weight-transport sparse_hccl \
    --update-weight-buffer-size 512MiB --update-weight-verify-every 10 \
    --update-weight-master-addr "$RENDEZVOUS_HOST" --update-weight-master-port "$RENDEZVOUS_PORT" \
    --out "$root/runs/qwen3-30b-a3b" "$@"
