#!/usr/bin/env bash
# On the GPU machine after scripts/gpu/bundle.sh with MOEFOLD_GPU_EXTRA_TARGETS=moefold: what the
# run's observability costs on the GPU. Trains the tiny preset (--device cuda) with
# train.tensorboard on and off, alternating (ROUNDS rounds, STEPS steps each), and prints each run's
# median step time over its second half and its time outside the steps (the process's wall time
# minus the steps' sum: start-up, metrics, logs, event files); then `moefold report` of the last
# run with TensorBoard.
# $OUT gets that run's report.html, metrics.jsonl and event file.
#   scripts/gpu/observability.sh [steps (default 1000)] [rounds (default 2)]
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
bin="$root/.gpu/bin/moefold"
steps=${1:-1000}
rounds=${2:-2}
status=0
for round in $(seq "$rounds"); do
  for tb in true false; do
    dir="/tmp/moefold-runs/tb_$tb"
    rm -rf "$dir"
    t0=$(date +%s.%N)
    timeout 300 "$bin" train --quiet --device cuda --run-dir "$dir" --steps "$steps" \
      --set train.save_checkpoints=false --set "train.tensorboard=$tb" 2>&1 | tail -3
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    t1=$(date +%s.%N)
    env -u LD_PRELOAD python3 - "$dir/metrics.jsonl" "$round" "$tb" "$t0" "$t1" <<'PY' || status=1
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tail = rows[len(rows) // 2:]
steps = sum(r['step_time_s'] for r in rows)
wall = float(sys.argv[5]) - float(sys.argv[4])
print(f"round {sys.argv[2]} tensorboard={sys.argv[3]}: median step {statistics.median(r['step_time_s'] for r in tail) * 1e3:.3f} ms, "
      f"wall {wall:.2f} s, outside the steps {wall - steps:.2f} s, "
      f"loss {rows[-1]['loss']:.4f}, GPU peak {rows[-1].get('gpu_memory_peak_mib', 0):.0f} MiB")
PY
  done
done
dir=/tmp/moefold-runs/tb_true
"$bin" report "$dir" -o "$out/report.html" || status=1
cp "$dir/metrics.jsonl" "$out/" && cp "$dir"/tensorboard/events.out.tfevents.* "$out/" || status=1
exit $status
