#!/usr/bin/env bash
# On the GPU machine after scripts/gpu/bundle.sh with MOEFOLD_GPU_EXTRA_TARGETS=moefold: trains the
# tiny preset and a qwen3-30b-a3b-shaped model cut to a few layers with --device cuda; metrics
# (tokens/s, peak GPU memory) land in $OUT/<name>/metrics.jsonl.
#   scripts/gpu/train_smoke.sh [layers of the mid-size model (default 2)] [steps (default 10)]
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
bin="$root/.gpu/bin/moefold"
status=0
run() {  # name, args...
  local name=$1; shift
  local dir="/tmp/moefold-runs/$name"  # checkpoints stay on the machine; metrics come back
  rm -rf "$dir"
  echo "== $name: $*"
  timeout 300 "$bin" train --quiet --run-dir "$dir" "$@" 2>&1 | tail -5
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  mkdir -p "$out/$name" && cp "$dir/metrics.jsonl" "$out/$name/"
  python3 - "$dir/metrics.jsonl" <<'PY' || status=1
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
tail = rows[len(rows) // 2:]
print(f"steps {len(rows)}: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, median tok/s {statistics.median(r['tokens_per_s'] for r in tail):.0f}, "
      f"median step {statistics.median(r['step_time_s'] for r in tail)*1e3:.1f} ms, peak GPU {rows[-1].get('gpu_memory_peak_mib', 0):.0f} MiB")
PY
}
run tiny_cuda --device cuda --steps 200
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 2 ]; then
  # Two GPUs through the CLI: mpirun (MPI bootstrap) with EP=2, and torchrun-style environment
  # variables (TCP bootstrap) with TP=2; the loss curves should follow tiny_cuda's.
  echo "== tiny_ep2 (mpirun -np 2, parallel.ep=2)"
  rm -rf /tmp/moefold-runs/tiny_ep2
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 300 mpirun -np 2 -x LD_LIBRARY_PATH -x LD_PRELOAD \
    "$bin" train --quiet --device cuda --steps 200 --set parallel.ep=2 --run-dir /tmp/moefold-runs/tiny_ep2 2>&1 | tail -5
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "== tiny_tp2 (RANK/WORLD_SIZE/MASTER_ADDR, parallel.tp=2)"
  rm -rf /tmp/moefold-runs/tiny_tp2
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 timeout 300 \
      "$bin" train --quiet --steps 200 --set parallel.tp=2 --run-dir /tmp/moefold-runs/tiny_tp2 > "$out/tiny_tp2_rank$r.log" 2>&1 &
  done
  wait || status=1
  tail -n 3 "$out"/tiny_tp2_rank*.log
  python3 - <<'PY' || status=1
import json
def curve(n): return [json.loads(l)["loss"] for l in open(f"/tmp/moefold-runs/{n}/metrics.jsonl")]
ref = curve("tiny_cuda")
for n in ("tiny_ep2", "tiny_tp2"):
    c = curve(n)
    worst = max(abs(a - b) / b for a, b in zip(c, ref))
    print(f"{n}: {len(c)} steps, loss {c[0]:.4f} -> {c[-1]:.4f}; largest relative difference to tiny_cuda {worst:.3g} "
          f"(first 20 steps {max(abs(a - b) / b for a, b in zip(c[:20], ref[:20])):.3g})")
PY
fi
layers=${1:-2}; steps=${2:-10}
run mid_cuda --device cuda --config qwen3-30b-a3b --set model.num_hidden_layers=$layers --set train.global_batch_size=8 \
  --set train.warmup_steps=2 --set train.eval_interval=0 --set train.checkpoint_interval=0 --steps $steps
exit $status
