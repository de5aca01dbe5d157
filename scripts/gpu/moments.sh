#!/usr/bin/env bash
# On the GPU machine (a bundle with moefold, test_ops_cuda, test_train_cuda): AdamW's moments in
# f32 vs bf16 (train.exp_avg_dtype / exp_avg_sq_dtype): the CUDA checks, then qwen3-30b-a3b 8
# layers x 8 sequences (micro-batch 2) planned and measured both ways, then the tiny preset's
# loss curve on the default corpus both ways (metrics.jsonl under $OUT).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
source "$root/scripts/gpu/env.sh"
B="$root/.gpu/bin/moefold"
out="${OUT:-/tmp}"
"$root/.gpu/bin/test_ops_cuda" --gtest_brief=1 --gtest_filter='CudaAdamW*' 2>&1 | tail -3
"$root/.gpu/bin/test_train_cuda" --gtest_brief=1 2>&1 | tail -3
q=(--config qwen3-30b-a3b --set model.num_hidden_layers=8 --set train.global_batch_size=8 --set train.micro_batch_size=2)
for d in f32 bf16 f32 bf16; do
  m=(--set train.exp_avg_dtype=$d --set train.exp_avg_sq_dtype=$d)
  echo "== moments $d"
  "$B" plan "${q[@]}" "${m[@]}" | grep -E "optimizer state|  peak"
  timeout 200 "$B" bench train "${q[@]}" "${m[@]}" --steps 4 --warmup 2 > "$out/bench_$d.md" 2>&1
  grep -E '^\| qwen|^Peak|optimizer step' "$out/bench_$d.md" | head -4
done
for d in f32 bf16; do
  timeout 200 "$B" train --device cuda --run-dir "$out/tiny_$d" --set train.exp_avg_dtype=$d \
    --set train.exp_avg_sq_dtype=$d > "$out/tiny_$d.log" 2>&1
  echo "== tiny, moments $d: $(tail -1 "$out/tiny_$d.log")"
done
