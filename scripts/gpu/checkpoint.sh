#!/usr/bin/env bash
# On the GPU machine after scripts/gpu/bundle.sh with MOEFOLD_GPU_EXTRA_TARGETS=moefold and
# test_train_cuda among the targets: asynchronous checkpoints on the GPU in one call.
#   scripts/gpu/checkpoint.sh [tests] [bench]   (none: both)
# tests: TrainCuda.AsyncCheckpointEqualsSyncWhileTrainingGoesOn (pinned copy, background write,
# the bytes of a synchronous save). bench: a 0.4B-parameter model (4 layers x 64 experts, 4.9 GB of
# checkpoint: f32 weights and both AdamW moments) trained 180 steps of 32 sequences of 2048 tokens
# with a checkpoint every 60, with train.async_checkpoint false then true: how long training waits
# per save, how long a save takes, and the step times while a write is in flight against the rest.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
B="$root/.gpu/bin/moefold"
parts="${*:-tests bench}"
want() { [[ " $parts " == *" $1 "* ]]; }
status=0
if want tests; then
  echo "== test_train_cuda (async checkpoints)"
  timeout 300 "$root/.gpu/bin/test_train_cuda" --gtest_filter='TrainCuda.AsyncCheckpoint*' 2>&1 | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want bench; then
  model=(--set model.hidden_size=1024 --set model.num_attention_heads=16 --set model.num_key_value_heads=4
         --set model.head_dim=64 --set model.num_hidden_layers=4 --set moe.num_experts=64
         --set moe.moe_intermediate_size=512 --set train.seq_len=2048 --set train.global_batch_size=32
         --set train.micro_batch_size=4 --set train.checkpoint_interval=60 --set train.keep_checkpoints=1
         --set train.eval_interval=0 --set train.eval_batches=1)
  for async in false true; do
    dir=/tmp/moefold-ckpt-$async
    rm -rf "$dir"
    echo "== train, train.async_checkpoint = $async"
    timeout 280 "$B" train --device cuda --steps 180 --run-dir "$dir" "${model[@]}" \
      --set train.async_checkpoint=$async > "$out/ckpt_$async.txt" 2>&1 || status=1
    grep "checkpoint step\|error\|training " "$out/ckpt_$async.txt" | head -8
    du -sh "$dir/checkpoints"/step_* 2>/dev/null | tail -1
    cp "$dir/metrics.jsonl" "$out/ckpt_metrics_$async.jsonl" 2>/dev/null
    python3 - "$dir/metrics.jsonl" "$out/ckpt_$async.txt" <<'PY' || status=1
import json, re, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
t = {r["step"]: r["step_time_s"] for r in rows}
text = open(sys.argv[2]).read()
saves = re.findall(r"saved in ([0-9.]+) s \(training waited ([0-9.]+) s\)", text)
# The 20 steps after the saves at 60 and 120 (an async write in flight) against the others.
after = [t[s] for s in list(range(61, 81)) + list(range(121, 141)) if s in t]
rest = [t[s] for s in t if s > 5 and not (61 <= s <= 80 or 121 <= s <= 140)]
print(f"median step {statistics.median(rest)*1e3:.1f} ms; in the 20 steps after a save {statistics.median(after)*1e3:.1f} ms; "
      f"saves took {', '.join(a for a, _ in saves)} s; training waited {', '.join(b for _, b in saves)} s")
PY
  done
fi
exit $status
