#!/usr/bin/env bash
# On the GPU machine: two moefold binaries timed in one call, alternating A B A B so that drift
# of the machine falls on both (docs/benchmarks.md: compare before/after in one call). Bundle B as
# usual (scripts/gpu/bundle.sh with MOEFOLD_GPU_EXTRA_TARGETS=moefold) and copy A, stripped, to
# .gpu/bin/moefold_a (e.g. a build of the commit before the change). Full outputs land in $OUT.
#   scripts/gpu/ab.sh [rounds]   # default 2 rounds
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
A="$root/.gpu/bin/moefold_a"
B="$root/.gpu/bin/moefold"
rounds="${1:-2}"
strip_table() { grep -v "^|---\|^$"; }
for r in $(seq 1 "$rounds"); do
  for side in a b; do
    bin="$A"
    [ "$side" = b ] && bin="$B"
    echo "== round $r, $side: moe-layer"
    timeout 150 "$bin" bench moe-layer --shape qwen3-30b-a3b --shape deepseek-v3 --reps 10 --warmup 2 \
      > "$out/ab_layer_${side}_$r.md" 2>&1
    strip_table < "$out/ab_layer_${side}_$r.md" | grep "^| qwen3\|^| deepseek\|error" | head -4
    echo "== round $r, $side: train (qwen3-30b-a3b, 4 layers, 4 x 4096 tokens)"
    timeout 150 "$bin" bench train --config qwen3-30b-a3b --set model.num_hidden_layers=4 \
      --set train.global_batch_size=4 --set train.micro_batch_size=4 --steps 4 --warmup 2 \
      > "$out/ab_train_${side}_$r.md" 2>&1
    strip_table < "$out/ab_train_${side}_$r.md" | sed -n 1,3p
    echo "== round $r, $side: train (tiny)"
    timeout 60 "$bin" bench train --steps 20 --warmup 5 --no-breakdown > "$out/ab_tiny_${side}_$r.md" 2>&1
    strip_table < "$out/ab_tiny_${side}_$r.md" | sed -n 1,3p
  done
done
