#!/usr/bin/env bash
# On the GPU machine after scripts/gpu/bundle.sh with MOEFOLD_GPU_EXTRA_TARGETS=moefold: the
# issue-5 benchmarks in one call (~5 min on one H200); full outputs land in $OUT.
#   scripts/gpu/perf.sh [tiles|swiglu]   # tiles: also compare CUTLASS tile configurations;
#                                        # swiglu: also the layer with SwiGLU unfused (kernels.fused_swiglu=off)
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
B="$root/.gpu/bin/moefold"
strip_table() { grep -v "^|---\|^$"; }
if [ "${1:-}" = tiles ]; then
  for t in large pingpong forward=pingpong,dgrad=pingpong,wgrad=large wgrad=pingpong; do
    echo "== tiles $t"
    timeout 90 "$B" bench moe-layer --shape qwen3-30b-a3b --shape deepseek-v3 --reps 10 \
      --warmup 2 --set kernels.cutlass_tile="$t" 2>&1 | strip_table | sed -n 2,6p
  done
fi
if [ "${1:-}" = swiglu ]; then
  for fused in off on; do
    echo "== kernels.fused_swiglu=$fused"
    timeout 90 "$B" bench moe-layer --shape qwen3-30b-a3b --shape deepseek-v3 --reps 10 \
      --warmup 2 --set kernels.fused_swiglu="$fused" 2>&1 | strip_table | sed -n 2,6p
  done
fi
echo "== moe-layer, every shape"
timeout 200 "$B" bench moe-layer --reps 10 --warmup 2 > "$out/moe_layer.md" 2>&1
strip_table < "$out/moe_layer.md" | sed -n 1,12p
echo "== moe-layer, later micro-batches (expert gradients accumulated)"
timeout 90 "$B" bench moe-layer --shape qwen3-30b-a3b --shape deepseek-v3 --accumulate-grads --reps 10 --warmup 2 \
  2>&1 | strip_table | sed -n 2,6p
train() {  # layers, sequences per step, sequences per micro-batch
  echo "== train: $1 layers, $2 sequences per step, micro-batch $3"
  timeout 120 "$B" bench train --config qwen3-30b-a3b --set model.num_hidden_layers="$1" \
    --set train.global_batch_size="$2" --set train.micro_batch_size="$3" --steps 4 --warmup 2 \
    > "$out/train_$1x$2.md" 2>&1
  strip_table < "$out/train_$1x$2.md" | sed -n 1,3p
}
train 4 4 4
train 8 2 2
train 8 8 2
