#!/usr/bin/env bash
# On the GPU machine (a bundle with the moefold binary: scripts/gpu/bundle.sh with
# MOEFOLD_GPU_EXTRA_TARGETS=moefold): `moefold plan`'s planned bytes against the peak device
# memory of `moefold bench train` (device_malloc's high-water mark, the table's peak column) for
# the same configs on one GPU. Per config: the plan's line, then the bench's table row.
#   scripts/gpu/plan_check.sh
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
source "$root/scripts/gpu/env.sh"
B="$root/.gpu/bin/moefold"
out="${OUT:-/tmp}"
check() {  # name, preset, then config keys (section.key=value)
  local name=$1 preset=$2
  shift 2
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  echo "== $name: $preset $*"
  "$B" plan --config "$preset" "${sets[@]}" 2>&1 | grep -E "planned on the GPU|library workspaces|  peak "
  timeout 300 "$B" bench train --config "$preset" "${sets[@]}" --steps 2 --warmup 1 --no-breakdown \
    > "$out/plan_$name.md" 2>&1
  grep -E '^\| [a-z]' "$out/plan_$name.md" | tail -1
  grep -E '^Peak device memory' "$out/plan_$name.md"
}
check qwen3_4l_4x4 qwen3-30b-a3b model.num_hidden_layers=4 train.global_batch_size=4 train.micro_batch_size=4
check qwen3_8l_2x2 qwen3-30b-a3b model.num_hidden_layers=8 train.global_batch_size=2 train.micro_batch_size=2
check qwen3_8l_8x2 qwen3-30b-a3b model.num_hidden_layers=8 train.global_batch_size=8 train.micro_batch_size=2
check qwen3_8l_8x2_distopt qwen3-30b-a3b model.num_hidden_layers=8 train.global_batch_size=8 \
  train.micro_batch_size=2 parallel.distributed_optimizer=true
check dsv3_2l_32e deepseek-v3 model.num_hidden_layers=2 model.first_k_dense_replace=1 moe.num_experts=32 \
  model.num_nextn_predict_layers=0 train.global_batch_size=1 train.micro_batch_size=1
check dsv3_2l_32e_mtp deepseek-v3 model.num_hidden_layers=2 model.first_k_dense_replace=1 moe.num_experts=32 \
  train.global_batch_size=2 train.micro_batch_size=1
check olmoe_8l olmoe-1b-7b model.num_hidden_layers=8 train.global_batch_size=4 train.micro_batch_size=2
check olmoe_full_seq4096 olmoe-1b-7b train.global_batch_size=2 train.micro_batch_size=1
check qwen3_4l_4x4_nondet qwen3-30b-a3b model.num_hidden_layers=4 train.global_batch_size=4 train.micro_batch_size=4 kernels.deterministic_attention=false
