#!/usr/bin/env bash
# On the GPU machine (a bundle with moefold and test_train_cuda: scripts/gpu/bundle.sh): the
# recompute parity test, then per config `moefold plan`'s peak against `moefold bench train`'s
# measured peak and model TFLOP/s (recomputed FLOPs not counted): qwen3-30b-a3b 8 layers x 8
# sequences (micro-batch 2) with each recompute setting, and DeepSeek-V3's layers (MLA).
#   scripts/gpu/recompute.sh [tests|measure|sixteen]   (default: tests and measure)
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
source "$root/scripts/gpu/env.sh"
B="$root/.gpu/bin/moefold"
out="${OUT:-/tmp}"
[ -n "${1:-}" ] && [ "$1" != tests ] || "$root/.gpu/bin/test_train_cuda" --gtest_brief=1 2>&1 | tail -4
[ "${1:-}" = tests ] && exit 0
check() {  # name, preset, then config keys (section.key=value)
  local name=$1 preset=$2
  shift 2
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  echo "== $name: $*"
  "$B" plan --config "$preset" "${sets[@]}" 2>&1 | grep -E "  peak "
  timeout 240 "$B" bench train --config "$preset" "${sets[@]}" --steps 3 --warmup 1 --no-breakdown \
    > "$out/recompute_$name.md" 2>&1
  grep -E '^\| [a-z]' "$out/recompute_$name.md" | tail -1
  grep -E '^Peak device memory' "$out/recompute_$name.md"
}
q=(model.num_hidden_layers=8 train.global_batch_size=8 train.micro_batch_size=2 train.exp_avg_dtype=bf16
  train.exp_avg_sq_dtype=bf16)
if [ "${1:-}" = sixteen ]; then  # 16 layers with the options `moefold plan` picks, and 8 with bf16 gradients
  check q16_plan qwen3-30b-a3b "${q[@]}" model.num_hidden_layers=16 kernels.deterministic_attention=false \
    train.main_grads_dtype=bf16 'train.recompute_modules=["layernorm","moe_act","mla_up_proj"]'
  check q8_bf16grads qwen3-30b-a3b "${q[@]}" train.main_grads_dtype=bf16
  exit 0
fi
check q8_none qwen3-30b-a3b "${q[@]}"
check q8_cheap qwen3-30b-a3b "${q[@]}" 'train.recompute_modules=["layernorm","moe_act"]'
check q8_modules qwen3-30b-a3b "${q[@]}" 'train.recompute_modules=["layernorm","moe_act","core_attn","moe"]'
check q8_block4 qwen3-30b-a3b "${q[@]}" train.recompute_num_layers=4 train.recompute_method=block
check q8_uniform1 qwen3-30b-a3b "${q[@]}" train.recompute_num_layers=1
d=(model.num_hidden_layers=2 model.first_k_dense_replace=1 moe.num_experts=32 model.num_nextn_predict_layers=0
  train.global_batch_size=1 train.micro_batch_size=1)
check ds2_none deepseek-v3 "${d[@]}"
check ds2_modules deepseek-v3 "${d[@]}" \
  'train.recompute_modules=["layernorm","moe_act","mla_up_proj","core_attn","shared_experts","mlp"]'
check ds2_uniform1 deepseek-v3 "${d[@]}" train.recompute_num_layers=1
