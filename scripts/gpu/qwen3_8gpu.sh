#!/usr/bin/env bash
# Qwen3-30B-A3B at its real size on one machine of 8 GPUs (issue 24), in one call, after
# scripts/gpu/bundle.sh with MOEFOLD_GPU_EXTRA_TARGETS=moefold (MOEFOLD_GPU_TARGETS may be any one
# test). Every output lands in $OUT (qwen3_8gpu_*.md / .log); the lines that matter are printed.
#   scripts/gpu/qwen3_8gpu.sh [plan] [bf16] [fp8] [resume] [layer]   # default: all, in this order
# The layout and options are the ones `moefold plan --perf --search --world 8` ranks first among
# those that fit 139 GiB (H200) with the options it names as the cheapest set that fits:
# EP = 8 over DP = 8 (every rank holds 16 of the 128 experts, the dense weights replicated), the
# distributed optimizer, bf16 AdamW moments, the non-deterministic attention backward, expert
# receive buffers for twice the average (moe.ep_recv_factor = 2), 64 sequences of 4096 per step, a
# 10-step learning-rate warm-up.
# CPU dry run of the same layout with a cut-down model (no GPU): QWEN3_8GPU_DRY=1 (below).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
steps="${QWEN3_8GPU_STEPS:-60}"  # >= 50 after the warm-up
parts="${*:-plan bf16 fp8 resume layer}"
# Expert rows a rank can receive, times the average: 2 fits 139 GiB; a dispatch beyond it stops the
# run with one line naming the key (then QWEN3_8GPU_RECV=3, or 0 for the worst case). The dry run's
# cut-down model (128 tokens per micro-batch) is far less even than 4096 tokens: the worst case.
recv="${QWEN3_8GPU_RECV:-2}"
[ "${QWEN3_8GPU_DRY:-0}" = 1 ] && recv="${QWEN3_8GPU_RECV:-0}"
layout=(--set parallel.ep=8 --set parallel.distributed_optimizer=true --set train.exp_avg_dtype=bf16
  --set train.exp_avg_sq_dtype=bf16 --set kernels.deterministic_attention=false --set moe.ep_recv_factor="${recv}"
  --set train.global_batch_size=64 --set train.micro_batch_size=1 --set train.eval_interval=0
  --set train.log_interval=5 --set train.warmup_steps=10)  # a short warm-up: the loss visibly falls in 60 steps
other=(--set parallel.ep=4)  # the layout the checkpoint resumes under (EP = 4 x EDP = 2 over DP = 8)
device=(--device cuda)
ranks=8
if [ "${QWEN3_8GPU_DRY:-0}" = 1 ]; then  # CPU ranks, a cut-down model with the same layout and key shapes
  B="${MOEFOLD_BIN:-$root/build/moefold}"
  device=(--device cpu --set model.hidden_size=64 --set model.num_attention_heads=4
    --set model.num_key_value_heads=2 --set model.head_dim=16 --set moe.moe_intermediate_size=32
    --set model.num_hidden_layers=4 --set model.vocab_size=512 --set train.seq_len=128
    --set train.global_batch_size=16)
  export OPENBLAS_NUM_THREADS=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
  export OPENBLAS_CORETYPE="${OPENBLAS_CORETYPE:-Sandybridge}"
  steps="${QWEN3_8GPU_STEPS:-6}"
else
  source "$root/scripts/gpu/env.sh"
  B="$root/.gpu/bin/moefold"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
  ranks=$(nvidia-smi -L | wc -l)
  [ "$ranks" -eq 8 ] || echo "qwen3_8gpu.sh: $ranks GPUs here, the runs below need 8"
fi
mpi() {  # seconds, then the command on every rank
  local seconds="$1"
  shift
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout "$seconds" mpirun --oversubscribe -np "$ranks" \
    -x LD_LIBRARY_PATH -x LD_PRELOAD -x OPENBLAS_NUM_THREADS -x OPENBLAS_CORETYPE \
    -x OMPI_MCA_btl_vader_single_copy_mechanism "$@"
}
run_dir="$out/qwen3_8gpu_run"
for part in $parts; do
  case "$part" in
    plan)  # what the plan says, and its ranking of the layouts (no GPU needed)
      "$B" plan --config qwen3-30b-a3b --world 8 --gpu-memory 139GiB "${layout[@]}" > "$out/qwen3_8gpu_plan.md" 2>&1
      grep "peak\|fits" "$out/qwen3_8gpu_plan.md" | head -6
      timeout 600 "$B" plan --perf --search --config qwen3-30b-a3b --world 8 --gpus-per-node 8 "${layout[@]}" \
        > "$out/qwen3_8gpu_search.md" 2>&1
      head -4 "$out/qwen3_8gpu_search.md"
      ;;
    bf16 | fp8)  # training from random weights on the default corpus: tokens/s, TFLOP/s, peak memory, loss
      extra=()
      # FP8 weights only (train.fp8_param): the distributed optimizer gathers FP8 codes, ~8.4 GiB per
      # rank less than the bf16 copies (moefold plan).
      [ "$part" = fp8 ] && extra=(--set train.fp8=blockwise --set moe.fp8_dispatch=true --set train.fp8_param=true)
      dir="$run_dir-$part"
      rm -rf "$dir"
      mpi 3000 "$B" train --config qwen3-30b-a3b "${layout[@]}" "${device[@]}" "${extra[@]}" \
        --set train.checkpoint_interval=$((steps / 2)) --steps "$steps" --run-dir "$dir" --quiet \
        > "$out/qwen3_8gpu_$part.log" 2>&1
      echo "== $part: rc $?"
      tail -n 4 "$dir/train.log" 2>/dev/null
      ;;
    resume)  # the bf16 run's middle checkpoint, resumed under another layout for 10 steps
      dir="$run_dir-bf16"
      rm -rf "$dir/checkpoints/step_$steps"  # resume from the middle one
      mpi 1500 "$B" train --config "$dir/config.toml" "${other[@]}" "${device[@]}" \
        --steps $((steps / 2 + 10)) --run-dir "$dir" --resume --quiet > "$out/qwen3_8gpu_resume.log" 2>&1
      echo "== resume under ${other[*]}: rc $?"
      tail -n 3 "$dir/train.log" 2>/dev/null
      ;;
    layer)  # the MoE layer at EP = 8 against one GPU (per-GPU TFLOP/s), qwen3-30b-a3b and deepseek-v3
      for shape in qwen3-30b-a3b deepseek-v3; do
        timeout 600 "$B" bench moe-layer --shape "$shape" --reps 10 --warmup 3 > "$out/qwen3_8gpu_layer_${shape}_1.md" 2>&1
        mpi 600 "$B" bench moe-layer --shape "$shape" --reps 10 --warmup 3 \
          > "$out/qwen3_8gpu_layer_${shape}_8.md" 2>&1
        echo "== $shape layer, one GPU / EP = 8"
        grep "^| $shape" "$out/qwen3_8gpu_layer_${shape}_1.md" "$out/qwen3_8gpu_layer_${shape}_8.md" | head -4
      done
      ;;
    *) echo "qwen3_8gpu.sh: unknown part '$part' (plan, bf16, fp8, resume, layer)"; exit 2 ;;
  esac
done
