#!/usr/bin/env bash
# Qwen3-30B-A3B RL on six Ascend NPUs: training TP2/PP2/EP2 on cards 0-3, rollout engine TP2/PP1/EP2
# on cards 4-5, weights synced as deltas over HCCL every step.
#
# The same launcher and layout run on CPU in the test suite (tests/test_train_rl.py runs
# `--trainer-ranks 4 --tp 2 --pp 2 --ep 2` on the tiny MoE and checks the engine against a fresh one);
# this script only changes the devices, the model and the engine settings below. It has not been
# run on NPUs by this project: needs torch_npu + CANN, vllm-ascend, MindSpeed (Megatron on Ascend).
# The engine is the released vLLM-Ascend 0.23.0.post1, which runs on vLLM 0.23.0 (torch 2.10.0,
# torch_npu 2.10.0.post4, CANN 9.1.0); delta-sync installs into that environment with its
# `ascend-engine` extra (docs/versions.md). The trainer's environment is its own.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL=${MODEL:?path to the Qwen3-30B-A3B Hugging Face checkpoint}
OUT=${OUT:-$root/runs/qwen3-30b-a3b}
# CANN (toolkit: HCCL, runtime) and ATB (the fused kernels vLLM-Ascend calls) set their library paths
# in set_env.sh scripts; without them torch_npu fails to load or falls back. Default install places,
# override with ASCEND_TOOLKIT_ENV / ATB_ENV.
ASCEND_TOOLKIT_ENV=${ASCEND_TOOLKIT_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}
ATB_ENV=${ATB_ENV:-/usr/local/Ascend/nnal/atb/set_env.sh}
for env_script in "$ASCEND_TOOLKIT_ENV" "$ATB_ENV"; do
  [[ -f "$env_script" ]] || { echo "missing $env_script (CANN / ATB not installed here?)" >&2; exit 1; }
  # shellcheck disable=SC1090
  source "$env_script"
done
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

# HCCL opens one listening port per card from HCCL_IF_BASE_PORT up (16 per process group set); two
# jobs on one host with the same base collide. Trainer and engine get disjoint ranges.
TRAINER_HCCL_BASE_PORT=${TRAINER_HCCL_BASE_PORT:-61000}
ENGINE_HCCL_BASE_PORT=${ENGINE_HCCL_BASE_PORT:-62000}

start_engine() {  # $1: checkpoint directory. The synced engine, and later the fresh one, exactly alike. ASCEND_RT_VISIBLE_DEVICES restricts this process's cards
  # (ASCEND_VISIBLE_DEVICES is the container runtime's knob, not this one).
  # VLLM_SERVER_DEV_MODE=1: exposes /pause, /resume and /collective_rpc, which the trainer drives.
  # --tensor-parallel-size 2 --enable-expert-parallel: rollout TP2, experts split over the 2 cards (EP2);
  #   pipeline parallel stays 1 and dynamic EPLB off: loader views need a fixed layout.
  # --enforce-eager: ACL graphs capture weight addresses; in-place updates keep them, graphs are not needed.
  # weight_nz_mode 0 / rl_config: ND weights (FRACTAL_NZ tiles have no affine loader view; the receiver
  #   refuses NZ by name); no fp32 shadow copies or fused MC2 expert lists, which a patch would not update.
  # "delta_sync": true in --additional-config: switches on this package's vLLM plugin (the signed
  #   delta_sync_call and its receiver on every worker); no --weight-transfer-config (a second writer).
  ASCEND_RT_VISIBLE_DEVICES=4,5 HCCL_IF_BASE_PORT=$ENGINE_HCCL_BASE_PORT \
  VLLM_SERVER_DEV_MODE=1 \
    python -m vllm.entrypoints.openai.api_server --model "$1" --served-model-name m --host "$ENGINE_HOST" --port "$ENGINE_PORT" \
      --tensor-parallel-size 2 --enable-expert-parallel \
      --enforce-eager \
      --additional-config '{"delta_sync": true, "weight_nz_mode": 0, "rl_config": {"enabled": true}}' &
  engine_pid=$!
  trap 'kill $engine_pid 2>/dev/null || true' EXIT
  until curl -sf "$ENGINE_URL/health" >/dev/null; do
    kill -0 "$engine_pid" 2>/dev/null || { echo "the engine exited; see its output above" >&2; exit 1; }
    sleep 5
  done
}

local_engine=0
if [[ -z "$ENGINE_URL" ]]; then
  ENGINE_URL=http://${ENGINE_HOST}:${ENGINE_PORT}
  local_engine=1
  start_engine "$MODEL"
fi

# Trainer on cards 0-3: 4 ranks = TP2 x PP2 (DP1), experts EP2 inside TP x DP at ETP1; rank r binds
# card r of ASCEND_RT_VISIBLE_DEVICES (--trainer-device npu: HCCL process group, MindSpeed).
# --update-weight-mode delta / sparse_hccl: a full seed once, then only changed elements over HCCL.
# --update-weight-buffer-size 512MiB: bucket bound (HBM scratch on the sender and each engine worker).
# --update-weight-verify-every 10: digest comparison every 10th version (and every seed).
# --lr 1e-6: RL post-training scale; with fp32 master weights this changes ~0.1-3% of bf16 elements.
# --master-device cpu: per rank, TP2 x PP2 x EP2 (ETP1) holds ~7.6B of the 30.5B parameters (experts
#   29B / (EP2 x PP2) + the rest 1.5B / (TP2 x PP2)). On the card: bf16 weights 15 GB + bf16 grads 15 GB
#   + the delta fast path's bf16 shard snapshots, a copy of the weights it diffs against, 15 GB
#   (update_weight/megatron_shard_delta.py keeps them on the parameters' device) + activations:
#   ~45 GB of 64 before activations, so keep the micro-batch small; fp32 masters (30 GB) and Adam
#   m, v (61 GB) would add 91 GB (DP=1: a distributed optimizer has nothing to shard over), so they
#   live in host memory: 91 GB per rank, ~365 GB for the four ranks of this host. Rank 0 also holds
#   two 512 MiB buckets and, during a delta, its share of the payload (~0.1 GB at 0.2%). Engine cards:
#   their weights (61 GB / 2) + KV cache + during a delta two 512 MiB buckets in flight (plus ~44 B per
#   element of a 16M-element chunk while its positions are worked out, ~0.7 GB) and, in the pause, one
#   bucket's writes at a time (~16 B per element of it: ~1.4 GB at most); the staged table, positions and
#   undo log (~14 B per changed element it holds: ~0.4 GB at 0.2%, ~4 GB at an Adam step's ~2%) wait in
#   pinned host memory (DELTA_SYNC_DELTA_STAGING=host, the default; =device keeps them on the card).
#   Measured on an H200, not on an NPU (docs/benchmarks.md, run 4).
# --equivalence record: after training, only the synced engine's outputs are recorded; the fresh
#   engine then starts on the same cards (4-5) with the same options, once the synced one is stopped.
ASCEND_RT_VISIBLE_DEVICES=0,1,2,3 HCCL_IF_BASE_PORT=$TRAINER_HCCL_BASE_PORT \
  python -m launchers.train_rl --model "$MODEL" --engine-url "$ENGINE_URL" \
    --trainer-ranks 4 --tp 2 --pp 2 --ep 2 --trainer-device npu --master-device cpu --lr 1e-6 \
    --update-weight-mode delta --update-weight-transport sparse_hccl \
    --update-weight-buffer-size 512MiB --update-weight-verify-every 10 \
    --update-weight-master-addr "$RENDEZVOUS_HOST" --update-weight-master-port "$RENDEZVOUS_PORT" \
    --equivalence record --out "$OUT" "$@"

# The fresh-checkpoint check on the engine's own cards, with its own options.
if [[ $local_engine == 1 ]]; then
  kill "$engine_pid"
  wait "$engine_pid" || true
  start_engine "$OUT/export"
  python -m launchers.equivalence --phase fresh --fresh "$ENGINE_URL" --out "$OUT"
else
  echo "engine at $ENGINE_URL: stop it, start it on $OUT/export with the same options, then run" \
       "python -m launchers.equivalence --phase fresh --fresh $ENGINE_URL --out $OUT"
fi
