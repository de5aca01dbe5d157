#!/usr/bin/env bash
# On the GPU machine after
#   MOEFOLD_GPU_TARGETS=test_ops_cuda_gemm MOEFOLD_GPU_EXTRA_TARGETS="bench_fp8_gemm moefold" scripts/gpu/bundle.sh
# the own weight-gradient kernel (kernels.cutlass_tile wgrad = own) in one call:
#   scripts/gpu/wgrad.sh [tests] [gemm] [ncu] [layer]   (none: all four)
# tests: the own-wgrad GPU tests (bits on any grid and cluster size, against CUTLASS and the CPU);
# gemm: bench_fp8_gemm --wgrad-own over every shape, CUTLASS's large tiles and the own kernel in
# clusters of 2 and 1; ncu: the own kernel at DeepSeek-V3 fc1, bf16 written: throughput, stall
# reasons per issued instruction and the SASS instructions the warps stall on (ncu --clock-control
# none); layer (an H200: the DeepSeek-V3 layer needs more than 80 GB): the PyTorch layer of
# scripts/bench_bar_moe.py and its --floor (the layer's GEMMs alone at cuBLAS's rate), then bench
# moe-layer at deepseek-v3, bf16 gradients, wgrad = large and own alternating (LAYER_RUNS, default
# "large own own large"; LAYER_ROUTINGS, default "balanced real"). Outputs under $OUT, few files.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
B="$root/.gpu/bin"
parts="${*:-tests gemm ncu layer}"
want() { [[ " $parts " == *" $1 "* ]]; }
status=0
if want tests; then
  echo "== own-wgrad tests ($SECONDS s)"
  timeout 200 "$B/test_ops_cuda_gemm" --gtest_filter='*OwnWeightGradient*:*WeightGradientWritten*:*CutlassPathMatchesCpu*' \
    > "$out/wgrad_tests.txt" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |FAILED \]|Failure|^\[       OK" "$out/wgrad_tests.txt" | head -20
fi
if want gemm; then
  echo "== bench_fp8_gemm --wgrad-own ($SECONDS s)"
  timeout 300 "$B/bench_fp8_gemm" --wgrad-own --runs 10 --warmup 2 > "$out/wgrad_gemm.txt" 2>&1 || status=1
  sed 's/  */ /g; s/wgrad E=[0-9]* m=[0-9]* O=[0-9]* I=[0-9]*//; s/^grouped //' "$out/wgrad_gemm.txt" | grep -E " ms "
fi
if want ncu; then
  echo "== ncu, the own kernel, deepseek-v3 fc1 bf16 written ($SECONDS s)"
  metrics=""
  for r in long_scoreboard barrier wait gmma short_scoreboard math_pipe_throttle branch_resolving no_instruction \
    dispatch_stall mio_throttle membar sleeping; do
    metrics="$metrics,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
  done
  run_ncu() {
    timeout 200 ncu --clock-control none --kernel-name regex:own_wgrad --launch-count 1 "$@" "$B/bench_fp8_gemm" \
      --wgrad-own --wgrad-case "deepseek-v3 fc1" --wgrad-clusters 2 --runs 1 --warmup 0
  }
  run_ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SourceCounters \
    --metrics "${metrics#,}" -o /tmp/wgrad_ncu > /dev/null 2>&1 || status=1
  ncu -i /tmp/wgrad_ncu.ncu-rep > "$out/wgrad_ncu.txt" 2>&1
  grep -E "Duration|Throughput|Busy|No Eligible|Hit Rate|Issued Warp|stalled" "$out/wgrad_ncu.txt" |
    sed 's/  */ /g; s/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -40
  ncu -i /tmp/wgrad_ncu.ncu-rep --page source --csv --print-source sass > /tmp/wgrad_sass.csv 2>&1
  python3 "$root/scripts/gpu/ncu_top_sass.py" /tmp/wgrad_sass.csv 25
fi
if want layer && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "== the PyTorch layer ($SECONDS s)"
  timeout 200 python3 "$root/scripts/bench_bar_moe.py" --shape deepseek-v3 --reps 5 --warmup 2 2>&1 | grep "^bar"
  timeout 100 python3 "$root/scripts/bench_bar_moe.py" --shape deepseek-v3 --floor --reps 5 --warmup 2 2>&1 |
    grep "^floor"
  for t in ${LAYER_RUNS:-large own own large}; do
    for routing in ${LAYER_ROUTINGS:-balanced real}; do
      echo "== bench moe-layer deepseek-v3 $routing, bf16 gradients, wgrad=$t ($SECONDS s)"
      timeout 150 "$B/moefold" bench moe-layer --shape deepseek-v3 --routing "$routing" --reps 5 --warmup 2 \
        --set train.main_grads_dtype=bf16 --set "kernels.cutlass_tile=wgrad=$t" > "$out/wgrad_layer.txt" 2>&1 || status=1
      grep -E "^\| deepseek|fc1 wgrad|GPU during" "$out/wgrad_layer.txt" | cut -c1-150 | head -4
    done
  done
fi
exit $status
