#!/usr/bin/env bash
# On the 2-GPU machine (nvidia-h200-x2) after scripts/gpu/bundle.sh with MOEFOLD_GPU_EXTRA_TARGETS=moefold
# (targets test_comm_nccl test_train_layouts_cuda): pipeline parallelism over NCCL (issue 17, issue 23
# item 3) in one call: the non-blocking link messages and the two-GPU layouts with pp = 2 against one
# GPU, then `bench train` of qwen3-30b-a3b cut to 8 layers on pp = 2 (1F1B, and vpp = 2) for m = 4, 8
# and 16 micro-batches: each rank's bubble beside (pp - 1) / (m + pp - 1); then EP = 2 training with
# parallel.overlap_moe_a2a off and on (the exposed all-to-all, throughput). Full outputs land in $OUT.
#   scripts/gpu/pipeline.sh [tests|bench|overlap]   (default: all)
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
B="$root/.gpu/bin/moefold"
mpi() { OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 280 mpirun -np 2 -x LD_LIBRARY_PATH -x LD_PRELOAD "$@"; }
if [ "${1:-}" != bench ]; then
  echo "== tests on 2 ranks"
  mpi "$root/.gpu/bin/test_comm_nccl" --gtest_brief=1 2>&1 | tail -3
  mpi "$root/.gpu/bin/test_train_layouts_cuda" --gtest_brief=1 2>&1 | grep -E "pp, tp|PASSED|FAILED|largest" | tail -12
fi
[ "${1:-}" = tests ] && exit 0
if [ "${1:-}" != bench ]; then
  for ov in false true false true; do
    echo "== ep2 overlap_moe_a2a=$ov"
    mpi "$B" bench train --config qwen3-30b-a3b --set model.num_hidden_layers=4 --set train.global_batch_size=16 \
      --set train.micro_batch_size=2 --set parallel.ep=2 --set train.exp_avg_dtype=bf16 --set train.exp_avg_sq_dtype=bf16 \
      --set parallel.overlap_moe_a2a="$ov" --steps 4 --warmup 1 > "$out/ep2_overlap_$ov.md" 2>&1
    grep -E "^\| qwen|Exposed|moefold:" "$out/ep2_overlap_$ov.md" | head -3
  done
fi
[ "${1:-}" = overlap ] && exit 0
q=(--config qwen3-30b-a3b --set model.num_hidden_layers=8 --set train.micro_batch_size=2 --set parallel.pp=2
  --set train.exp_avg_dtype=bf16 --set train.exp_avg_sq_dtype=bf16 --set kernels.deterministic_attention=false)
for vpp in 1 2; do
  for m in 4 8 16; do
    name="pp2_vpp${vpp}_m${m}"
    echo "== $name"
    mpi "$B" bench train "${q[@]}" --set parallel.vpp="$vpp" --set train.global_batch_size=$((2 * m)) --steps 3 \
      --warmup 1 > "$out/$name.md" 2>&1
    grep -E "^\| qwen|Pipeline bubble|moefold:" "$out/$name.md" | head -3
  done
done
