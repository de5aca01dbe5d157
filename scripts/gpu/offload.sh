#!/usr/bin/env bash
# On the GPU machine (a bundle with moefold, test_ops_cuda and test_train_cuda): the offload
# checks (the host AdamW against the kernel, offloaded runs against the GPU-only run), then
# qwen3-30b-a3b x 8 sequences (micro-batch 2) with a fraction of the optimizer state offloaded:
# `moefold plan`'s peak against the measured one, and the step's speed.
#   scripts/gpu/offload.sh [tests|measure|acts|combos]   (default: tests and measure; acts: activation
#   offload; combos: optimizer offload with bf16 gradients, activation offload with whole layers recomputed)
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
source "$root/scripts/gpu/env.sh"
B="$root/.gpu/bin/moefold"
out="${OUT:-/tmp}"
nproc
if [ "${1:-}" != measure ]; then
  "$root/.gpu/bin/test_ops_cuda" --gtest_brief=1 --gtest_filter='CudaAdamW*' 2>&1 | tail -3
  "$root/.gpu/bin/test_train_cuda" --gtest_brief=1 --gtest_filter='*Offload*:*StepLoop*' 2>&1 | tail -3
fi
if [ "${1:-}" = acts ] || [ "${1:-}" = combos ]; then
  "$root/.gpu/bin/test_train_cuda" --gtest_brief=1 2>&1 | tail -3
fi
[ "${1:-}" = tests ] && exit 0
check() {  # name, then config keys (section.key=value)
  local name=$1
  shift
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  echo "== $name: $*"
  "$B" plan --config qwen3-30b-a3b "${sets[@]}" 2>&1 | grep -E "  peak |offloaded"
  timeout 280 "$B" bench train --config qwen3-30b-a3b "${sets[@]}" --steps 3 --warmup 1 > "$out/offload_$name.md" 2>&1
  grep -E '^\| [a-z]' "$out/offload_$name.md" | tail -1
  grep -E '^Peak device memory|optimizer step' "$out/offload_$name.md" | head -3
}
if [ "${1:-}" = acts ]; then
  a=(model.num_hidden_layers=8 train.global_batch_size=8 train.micro_batch_size=2 train.exp_avg_dtype=bf16
    train.exp_avg_sq_dtype=bf16)
  check acts_none "${a[@]}"
  check acts_moe "${a[@]}" 'train.offload_modules=["expert_fc1","moe_act"]'
  check acts_all "${a[@]}" \
    'train.offload_modules=["attn_norm","qkv_linear","core_attn","attn_proj","mlp_norm","expert_fc1","moe_act"]'
  exit 0
fi
if [ "${1:-}" = combos ]; then
  c=(model.num_hidden_layers=8 train.global_batch_size=8 train.micro_batch_size=2 train.exp_avg_dtype=bf16
    train.exp_avg_sq_dtype=bf16 parallel.distributed_optimizer=true kernels.deterministic_attention=false)
  check q8_bf16g_off05 "${c[@]}" train.main_grads_dtype=bf16 train.optimizer_offload_fraction=0.5
  check q8_acts_block2 "${c[@]}" train.recompute_method=block train.recompute_num_layers=2 \
    'train.offload_modules=["attn_norm","qkv_linear","core_attn","attn_proj","mlp_norm","expert_fc1","moe_act"]'
  exit 0
fi
q=(train.global_batch_size=8 train.micro_batch_size=2 train.exp_avg_dtype=bf16 train.exp_avg_sq_dtype=bf16
  parallel.distributed_optimizer=true kernels.deterministic_attention=false)
check q8_off0 model.num_hidden_layers=8 "${q[@]}"
check q8_off05 model.num_hidden_layers=8 "${q[@]}" train.optimizer_offload_fraction=0.5
check q16_off04 model.num_hidden_layers=16 "${q[@]}" train.optimizer_offload_fraction=0.4
