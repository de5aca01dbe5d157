#!/usr/bin/env bash
# On the 2-GPU machine after scripts/gpu/bundle.sh with MOEFOLD_GPU_EXTRA_TARGETS=moefold: expert
# parallelism over NCCL (issue 5's EP = 2 target) in one call (~5 min): the 2-rank GPU tests of the
# exchange and of the EP layouts, then `bench moe-layer` at qwen3-30b-a3b on one GPU and with
# EP = 2 for several moe.ep_overlap_chunks (direct copies where the GPUs map each other), and over
# NCCL (--set parallel.ep_transport=nccl) with fewer SMs for the GEMMs (kernels.gemm_sms). Full outputs land in $OUT.
#   scripts/gpu/ep.sh [routing]   # balanced (default) or real; EP_FULL=1: all layout tests
#   EP_SWEEP="2:116:16 1:0:0" scripts/gpu/ep.sh   # only EP = 2 runs: chunks:GEMM SMs:NCCL CTAs (0: default)
#   EP_SHARED=1 scripts/gpu/ep.sh   # only moe.shared_expert_overlap off / on at DeepSeek-V3's layer, EP = 2
#   EP_GRAPHS=1 scripts/gpu/ep.sh   # only CUDA graphs of the layers on 2 GPUs: their tests, then training at
#                                   # EP = 2 (moe.dispatcher = "slots") without and with them (issue 23 item 6)
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
B="$root/.gpu/bin/moefold"
routing="${1:-balanced}"
one() { timeout 150 "$@"; }
mpi() {  # 2 ranks; NCCL_MAX_CTAS passed on where set (kernel choices are --set kernels.* options)
  local xs=(-x LD_LIBRARY_PATH -x LD_PRELOAD)
  [ -n "${NCCL_MAX_CTAS:-}" ] && xs+=(-x NCCL_MAX_CTAS)
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 150 mpirun -np 2 "${xs[@]}" "$@"
}
bench() {  # name, launcher (one or mpi), then options of bench moe-layer
  local name="$1" launcher="$2"
  shift 2
  echo "== $name"
  "$launcher" "$B" bench moe-layer --shape qwen3-30b-a3b --routing "$routing" --reps 10 --warmup 3 "$@" \
    > "$out/ep_$name.md" 2>&1
  grep "^| qwen3\|^| experts\|^| dispatch\|^| combine\|^| (within)\|error\|moefold:" "$out/ep_$name.md" | head -20
}
if [ "${EP_SHARED:-0}" = 1 ]; then  # moe.shared_expert_overlap at EP = 2: DeepSeek-V3's layer, off / on, twice
  for round in 1 2; do
    for ov in false true; do
      echo "== deepseek-v3 EP = 2, shared_expert_overlap=$ov, round $round"
      mpi "$B" bench moe-layer --shape deepseek-v3 --routing "$routing" --reps 5 --warmup 2 \
        --set train.main_grads_dtype=bf16 --set moe.shared_expert_overlap="$ov" > "$out/ep_shared_$ov.md" 2>&1
      grep "^| deepseek\|^| shared\|^| dispatch\|^| combine\|error\|moefold:" "$out/ep_shared_$ov.md" | head -10
    done
  done
  exit 0
fi
if [ "${EP_GRAPHS:-0}" = 1 ]; then  # train.cuda_graphs = "layers" on 2 GPUs (moe.dispatcher = "slots")
  echo "== graph tests on 2 ranks"
  mpi "$root/.gpu/bin/test_train_layouts_cuda" --gtest_filter='*LayerGraphs*' > "$out/ep_graph_tests.txt" 2>&1
  grep -E "^\[  (PASSED|FAILED) |FAILED \]|Failure|verified" "$out/ep_graph_tests.txt" | head -20
  # tiny (host-bound: where graphs pay) and 4 layers of qwen3-30b-a3b, each none / layers, twice.
  for round in 1 2; do
    for graphs in none layers; do
      for cfg in tiny qwen3-30b-a3b; do
        f="$out/ep_graphs_${cfg}_${graphs}_$round.md"
        echo "== train $cfg EP = 2 slots, cuda_graphs=$graphs, round $round"
        sets=(--set parallel.ep=2 --set moe.dispatcher=slots --set train.cuda_graphs="$graphs")
        [ "$cfg" = tiny ] || sets+=(--set model.num_hidden_layers=4 --set train.global_batch_size=8
          --set train.micro_batch_size=4)
        mpi "$B" bench train --config "$cfg" "${sets[@]}" --steps 10 --warmup 3 > "$f" 2>&1
        grep -E "^\| (tiny|qwen3)|^Host and GPU|loss|graphs|error|moefold:" "$f" | cut -c1-200 | head -6
      done
    done
  done
  exit 0
fi
if [ -n "${EP_SWEEP:-}" ]; then  # EP_SWEEP="chunks:gemm_sms:nccl_max_ctas ..." (0: default; EP_TRANSPORT=auto|nccl|ipc)
  for cfg in $EP_SWEEP; do
    IFS=: read -r c sms ctas <<< "$cfg"
    ( [ "$ctas" != 0 ] && export NCCL_MAX_CTAS="$ctas"
      bench "ep2_${routing}_c${c}_sms${sms}_ctas${ctas}" mpi --set moe.ep_overlap_chunks="$c" \
        --set kernels.gemm_sms="$sms" --set parallel.ep_transport="${EP_TRANSPORT:-auto}" )
  done
  exit 0
fi
echo "== tests on 2 ranks"
mpi "$root/.gpu/bin/test_comm_nccl" --gtest_brief=1 2>&1 | tail -3
# EP_FULL=1: every layout test (the 20-step bf16 curves too, several minutes), else one fp32 step.
layouts_filter='*OneStep*'
[ "${EP_FULL:-0}" = 1 ] && layouts_filter='*'
mpi "$root/.gpu/bin/test_train_layouts_cuda" --gtest_brief=1 --gtest_filter="$layouts_filter" 2>&1 | tail -4
bench one_gpu one
bench ep2_c1 mpi --set moe.ep_overlap_chunks=1
bench ep2_c2 mpi --set moe.ep_overlap_chunks=2
bench ep2_c4 mpi --set moe.ep_overlap_chunks=4
bench ep2_nccl_c2_sms116 mpi --set parallel.ep_transport=nccl --set kernels.gemm_sms=116
# A training step at EP = 2 (data parallel over the 2 ranks for the dense layers) against one GPU
# with the same tokens per GPU: 4 layers of qwen3-30b-a3b, micro-batches of 4 sequences.
train() {  # name, launcher, sequences per step; every run's report appended to $OUT/train.md
  echo "== train $1" | tee -a "$out/train.md"
  "$2" "$B" bench train --config qwen3-30b-a3b --set model.num_hidden_layers=4 --set train.global_batch_size="$3" \
    --set train.micro_batch_size=4 "${@:4}" --steps 4 --warmup 2 > "$out/train_run.md" 2>&1
  cat "$out/train_run.md" >> "$out/train.md"
  grep "^| qwen3\|^| gradient all-reduce\|^| model backward\|error\|moefold:" "$out/train_run.md" | head -4
  rm -f "$out/train_run.md"
}
train one_gpu one 4
train ep2 mpi 8 --set parallel.ep=2
# The data-parallel gradient all-reduce overlapped with backward (the default) against after it,
# at EP = 2 and at DP = 2 (experts replicated: their gradients travel too).
train ep2_no_overlap mpi 8 --set parallel.ep=2 --set parallel.overlap_grad_reduce=false
train dp2 mpi 8
train dp2_no_overlap mpi 8 --set parallel.overlap_grad_reduce=false
