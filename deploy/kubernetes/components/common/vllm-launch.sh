#!/usr/bin/env bash
# Starts vLLM with the flashmoe backend for one pod's role. DP+EP: one DP rank per GPU, all ranks in
# one EP group. Model-specific flags come from the overlay's serve.yaml (vLLM --config).
#   single  one node: API server + every local rank
#   leader  LeaderWorkerSet leader: API server + its local ranks (DP ranks 0..G-1)
#   worker  LeaderWorkerSet worker: headless, DP ranks LWS_WORKER_INDEX*G ..
set -euo pipefail
role=${1:?usage: vllm-launch.sh single|leader|worker}
config=/etc/flashmoe/serve/serve.yaml # the flashmoe-serve ConfigMap
rpc_port=13345                        # leader ZMQ handshake port for headless ranks

# The GPUs this pod was given (the nvidia.com/gpu limit) are the only count that matters.
gpus=$(nvidia-smi -L | grep -c '^GPU ')
if [ "$gpus" -lt 1 ]; then
  echo "vllm-launch: no GPU visible in this pod" >&2
  exit 1
fi

args=(serve --config "$config" --enable-expert-parallel --moe-backend flashmoe)
case "$role" in
  single)
    args+=(--data-parallel-size "$gpus" --host 0.0.0.0 --port 8000)
    ;;
  leader | worker)
    : "${LWS_LEADER_ADDRESS:?set by LeaderWorkerSet}" "${LWS_GROUP_SIZE:?set by LeaderWorkerSet}"
    # One pod per node, DP ranks numbered node by node: flashmoe's nodes are blocks of $gpus EP ranks
    # (NVLink stores inside a block, NVSHMEM puts across). vLLM's ranks get no LOCAL_WORLD_SIZE.
    export FLASHMOE_NODE_SIZE="${FLASHMOE_NODE_SIZE:-$gpus}"
    args+=(--data-parallel-size $((LWS_GROUP_SIZE * gpus)) --data-parallel-size-local "$gpus"
      --data-parallel-address "$LWS_LEADER_ADDRESS" --data-parallel-rpc-port "$rpc_port")
    if [ "$role" = leader ]; then
      args+=(--host 0.0.0.0 --port 8000)
    else
      : "${LWS_WORKER_INDEX:?set by LeaderWorkerSet}"
      args+=(--headless --data-parallel-start-rank $((LWS_WORKER_INDEX * gpus)))
    fi
    ;;
  *)
    echo "vllm-launch: unknown role '$role' (single|leader|worker)" >&2
    exit 2
    ;;
esac
echo "vllm-launch: vllm ${args[*]}" >&2
exec vllm "${args[@]}"
