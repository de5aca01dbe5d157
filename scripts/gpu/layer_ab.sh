#!/usr/bin/env bash
# On the GPU machine: the DeepSeek-V3 MoE layer (balanced routing, bf16 gradients, the own weight
# gradient) of two moefold builds, alternating, against the PyTorch layer of
# scripts/bench_bar_moe.py and its floor (--floor: the layer's GEMMs alone at cuBLAS's rate and
# the memory-bound stages' bytes at a device copy's rate), all in one call. Bundle B as usual and
# A as .gpu/bin/moefold_old (MOEFOLD_GPU_BASELINE=<ref> scripts/gpu/bundle.sh), then
#   scripts/gpu/layer_ab.sh [rounds]     # default 2
# Optional tests first: LAYER_AB_TESTS="TARGET=FILTER ..." runs .gpu/bin/TARGET --gtest_filter=FILTER,
# and TARGET_broken (scripts/gpu/bundle_broken.sh) where there is one: that must fail.
# An H200 runs the full layer (256 experts, 8,192 tokens); an H100 (80 GB) the halved one (128
# experts, 4,096 tokens: the same 256 rows an expert). Each round also times the Qwen3-30B-A3B layer
# (balanced; LAYER_AB_QWEN3= skips it). LAYER_AB_FLOOR= skips the floor. (A per-kernel ncu table
# of the layer needs the bench's set-up kernels skipped: its first launches are the weights'
# random fill.)
# LAYER_AB_ROPE=1: ncu's times of both builds' RoPE kernels in a Qwen3-30B-A3B layer's step.
# LAYER_AB_SIDES (default "old new"): the builds in each round, .gpu/bin/moefold_<side> (new: moefold);
# a side may add settings to the DeepSeek-V3 bench: "new+kernels.own_wgrad_units=16" (several: +a=b+c=d).
# LAYER_AB_BAR_ROUNDS=1: the PyTorch layer again at the start of every round (the GPU's state drifts
# over a call: the power cap, the temperature), and each round's ratio printed.
# Every bench's whole output lands in $OUT.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
moefold_of() { [ "$1" = new ] && echo "$root/.gpu/bin/moefold" || echo "$root/.gpu/bin/moefold_$1"; }
rounds="${1:-2}"
status=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "== $gpu, rounds $rounds"
shape=(--shape deepseek-v3)
bar=(--shape deepseek-v3)
if ! grep -q H200 <<< "$gpu"; then
  shape+=(--tokens 4096 --set moe.num_experts=128)
  bar+=(--tokens 4096 --experts 128)
fi
read -ra specs <<< "${LAYER_AB_TESTS:-}"  # (no pathname expansion of the filters' stars)
for spec in "${specs[@]}"; do  # TARGET=FILTER ...: .gpu/bin/TARGET's tests, then TARGET_broken's
  t=${spec%%=*} filter=${spec#*=}
  echo "== $t: $filter ($SECONDS s)"
  started=$SECONDS
  timeout 200 "$root/.gpu/bin/$t" --gtest_filter="$filter" > "$out/layer_ab_$t.txt" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |FAILED \]|Failure" "$out/layer_ab_$t.txt" | head -10
  if [ -x "$root/.gpu/bin/${t}_broken" ]; then  # scripts/gpu/bundle_broken.sh: must fail
    echo "== ${t}_broken: the same tests must fail or hang, cut at 3x the good run's time ($SECONDS s)"
    timeout $((3 * (SECONDS - started) + 10)) "$root/.gpu/bin/${t}_broken" --gtest_filter="$filter" \
      > "$out/layer_ab_${t}_broken.txt" 2>&1
    case $? in
      0) echo "the broken build PASSED"; status=1 ;;
      124) echo "the broken build hung (cut by the timeout): red" ;;
    esac
    grep -E "^\[  (PASSED|FAILED) |FAILED \]|Failure" "$out/layer_ab_${t}_broken.txt" | head -6
  fi
done
echo "== the PyTorch layer and its floor ($SECONDS s)"
timeout 200 python3 "$root/scripts/bench_bar_moe.py" "${bar[@]}" --routing balanced --reps 5 --warmup 2 \
  > "$out/layer_ab_bar.txt" 2>&1 || status=1
if [ -n "${LAYER_AB_FLOOR-1}" ]; then  # LAYER_AB_FLOOR= skips the floor
  timeout 150 python3 "$root/scripts/bench_bar_moe.py" "${bar[@]}" --floor --reps 5 --warmup 2 \
    >> "$out/layer_ab_bar.txt" 2>&1 || status=1
fi
grep -E "^(bar|floor)" "$out/layer_ab_bar.txt" | cut -c1-160
round_bar=""
bar_ms() { sed -n 's/^bar .*balanced: \([0-9.]*\) ms.*/\1/p' "$1" | tail -1; }
for r in $(seq 1 "$rounds"); do
  if [ -n "${LAYER_AB_BAR_ROUNDS:-}" ]; then
    echo "== round $r, the PyTorch layer ($SECONDS s)"
    timeout 200 python3 "$root/scripts/bench_bar_moe.py" "${bar[@]}" --routing balanced --reps 5 --warmup 2 \
      >> "$out/layer_ab_bar.txt" 2>&1 || status=1
    round_bar=$(bar_ms "$out/layer_ab_bar.txt")
    echo "PyTorch layer $round_bar ms"
  fi
  for spec in ${LAYER_AB_SIDES:-old new}; do
    side=${spec%%+*} sets=()
    [ "$spec" = "$side" ] || for kv in $(tr '+' ' ' <<< "${spec#*+}"); do sets+=(--set "$kv"); done
    bin=$(moefold_of "$side")
    name=$(tr -c 'A-Za-z0-9._\n-' '_' <<< "$spec")  # files come back named in these characters only
    f="$out/layer_ab_${name}_$r.md"
    echo "== round $r, $spec ($SECONDS s)"
    layer() { timeout 150 "$bin" bench moe-layer "${shape[@]}" --routing balanced --reps 5 --warmup 2 "$@" \
      --set train.main_grads_dtype=bf16 --set kernels.cutlass_tile=wgrad=own "${sets[@]}" >> "$f" 2>&1 || status=1; }
    : > "$f"
    layer
    if ! grep -q "^| deepseek-v3 |" "$f"; then  # no report: again without the CUPTI timeline
      echo "(no report; again with --activity-reps 0)"
      layer --activity-reps 0
    fi
    grep -E "^\| deepseek|^\| (router|dispatch|combine|experts|shared|fc1 wgrad)|GPU during" "$f" | cut -c1-110
    ours=$(sed -n 's/^| deepseek-v3 | balanced | [0-9]* | [0-9]* | \([0-9.]*\) |.*/\1/p' "$f" | head -1)
    [ -z "${LAYER_AB_BAR_ROUNDS:-}" ] || [ -z "$ours" ] || [ -z "$round_bar" ] ||
      echo "round $r, $spec: the PyTorch layer / ours = $(python3 -c "print(f'{$round_bar / $ours:.3f}')")x"
    [ -n "${LAYER_AB_QWEN3-1}" ] || continue  # LAYER_AB_QWEN3= skips it
    [ "$spec" = "$side" ] || continue  # the settings are DeepSeek-V3's
    f="$out/layer_ab_qwen3_${side}_$r.md"
    timeout 100 "$bin" bench moe-layer --shape qwen3-30b-a3b --routing balanced --reps 10 --warmup 2 > "$f" 2>&1 ||
      status=1
    grep -E "^\| qwen3|^\| (dispatch|combine)" "$f" | cut -c1-110
  done
done
if [ -n "${LAYER_AB_ROPE:-}" ]; then  # RoPE's kernels of both builds in one Qwen3-30B-A3B layer's step (ncu)
  for side in old new; do
    bin=$(moefold_of "$side")
    echo "== ncu, RoPE kernels, $side ($SECONDS s)"
    timeout 120 ncu --clock-control none --kernel-name regex:rope --launch-count 8 --csv --page raw --metrics \
      gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum "$bin" bench train --config qwen3-30b-a3b \
      --set model.num_hidden_layers=1 --set train.global_batch_size=4 --set train.micro_batch_size=4 --steps 1 \
      --warmup 0 --no-breakdown > "$out/layer_ab_rope_$side.csv" 2> "$out/layer_ab_rope_$side.err" || status=1
    python3 "$root/scripts/gpu/ncu_kernels.py" "$out/layer_ab_rope_$side.csv" | tail -9
  done
fi
exit $status
