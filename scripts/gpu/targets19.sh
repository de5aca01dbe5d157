#!/usr/bin/env bash
# On the GPU machine (an H200: the full shapes fit), after
#   MOEFOLD_GPU_TARGETS="test_ops_cuda" MOEFOLD_GPU_EXTRA_TARGETS="moefold" scripts/gpu/bundle.sh
# issue 19's layer targets that layer_ab.sh does not time, in one call: deepseek-v3 and mixtral-8x7b
# under real routing, the PyTorch layer of scripts/bench_bar_moe.py and moefold's (bf16 gradients,
# the bar's own) in every round, one after the other, with each round's ratio; moefold once per
# weight-gradient kernel of TARGETS19_WGRAD (default "large own": CUTLASS's large tiles, the default,
# and the own kernel).
#   scripts/gpu/targets19.sh [rounds]   # default 2
# TARGETS19_SHAPES (default "deepseek-v3 mixtral-8x7b"), TARGETS19_ROUTING (default real).
# Every bench's whole output lands in $OUT (at most 8 files: one per shape and side, all rounds).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
rounds="${1:-2}"
routing="${TARGETS19_ROUTING:-real}"
status=0
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), rounds $rounds, $routing routing"
for r in $(seq 1 "$rounds"); do
  for shape in ${TARGETS19_SHAPES:-deepseek-v3 mixtral-8x7b}; do
    f="$out/targets19_bar_$shape.txt"
    echo "== round $r, $shape, the PyTorch layer ($SECONDS s)"
    timeout 200 python3 "$root/scripts/bench_bar_moe.py" --shape "$shape" --routing "$routing" --reps 5 \
      --warmup 2 >> "$f" 2>&1 || status=1
    bar=$(sed -n "s/^bar .*$routing: \([0-9.]*\) ms.*/\1/p" "$f" | tail -1)
    echo "PyTorch layer ${bar:-?} ms"
    for wgrad in ${TARGETS19_WGRAD:-large own}; do
      f="$out/targets19_${shape}_$wgrad.md"
      echo "== round $r, $shape, wgrad=$wgrad ($SECONDS s)"
      timeout 150 "$root/.gpu/bin/moefold" bench moe-layer --shape "$shape" --routing "$routing" --reps 5 \
        --warmup 2 --set train.main_grads_dtype=bf16 --set kernels.cutlass_tile=wgrad="$wgrad" > "$f.now" 2>&1 ||
        status=1
      cat "$f.now" >> "$f"
      ours=$(sed -n "s/^| $shape | $routing | [0-9]* | [0-9]* | \([0-9.]*\) |.*/\1/p" "$f.now" | head -1)
      grep -E "^\| (experts|fc1 wgrad|fc2 wgrad)" "$f.now" | cut -c1-100
      rm -f "$f.now"
      [ -z "$ours" ] || [ -z "$bar" ] ||
        echo "round $r, $shape, wgrad=$wgrad: ours $ours ms, the PyTorch layer / ours = $(python3 -c "print(f'{$bar / $ours:.3f}')")x"
    done
  done
done
exit $status
