#!/usr/bin/env bash
# On the GPU machine: is a kernel slower inside the layer bench than alone? First the own weight
# gradient at DeepSeek-V3's fc1 (full shape) back to back against after 300 ms of rest before each
# run (bench_fp8_gemm --rest-ms); then the halved (H100) or full (H200) DeepSeek-V3 MoE layer bench
# (balanced, bf16 gradients, wgrad=own) with nvidia-smi sampling the SM clock, power and clock-event
# reasons every 50 ms beside it; then ncu on the layer's grouped GEMMs and own weight gradients with
# their SM clock, with and without ncu's cache flush. After scripts/gpu/bundle.sh:
#   scripts/gpu/layer_clocks.sh [rounds]     # default 2
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
rounds="${1:-2}"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "== $gpu"
shape=(--shape deepseek-v3 --routing balanced --set train.main_grads_dtype=bf16 --set kernels.cutlass_tile=wgrad=own)
grep -q H200 <<< "$gpu" || shape+=(--tokens 4096 --set moe.num_experts=128)
for rest in 0 300 0 300; do
  echo "== bench_fp8_gemm --wgrad-own, deepseek-v3 fc1, --rest-ms $rest ($SECONDS s)"
  timeout 120 "$root/.gpu/bin/bench_fp8_gemm" --wgrad-own --wgrad-case "deepseek-v3 fc1" --wgrad-clusters 2 \
    --runs 8 --warmup 2 --rest-ms "$rest" 2>&1 | grep -E "written|added" | cut -c1-150
done
smi="$out/clocks_smi.csv"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader -lms 50 > "$smi" 2>&1 &
sampler=$!
sleep 1
for r in $(seq 1 "$rounds"); do
  echo "== round $r ($SECONDS s)"
  timeout 150 "$root/.gpu/bin/moefold" bench moe-layer "${shape[@]}" --reps 10 --warmup 2 > "$out/clocks_layer_$r.md" 2>&1
  grep -E "^\| (deepseek|experts|fc1 wgrad|fc1 forward \()|GPU during" "$out/clocks_layer_$r.md" | cut -c1-120
done
sleep 1
kill "$sampler" 2> /dev/null
wait "$sampler" 2> /dev/null
echo "== nvidia-smi beside the benches: samples, SM clock MHz min / median / max, power W max, reasons seen"
python3 - "$smi" << 'EOF'
import sys
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 5]
def num(s):
    try:
        return float(s.split()[0])
    except (ValueError, IndexError):
        return None
sm = sorted(v for v in (num(r[1]) for r in rows) if v is not None)
pw = [v for v in (num(r[3]) for r in rows) if v is not None]
reasons = {}
for r in rows:
    reasons[r[5].strip()] = reasons.get(r[5].strip(), 0) + 1
if sm:
    print(len(rows), sm[0], sm[len(sm) // 2], sm[-1], max(pw) if pw else "-", reasons)
else:
    print("no samples:", open(sys.argv[1]).read()[:300])
EOF
for cache in all none; do
  echo "== ncu, --cache-control $cache: the first layer's fc1 forward and own weight-gradient kernels ($SECONDS s)"
  timeout 200 ncu --clock-control none --cache-control "$cache" --kernel-name regex:"own_wgrad|device_kernel" \
    --launch-count 10 --csv --page raw --metrics \
    gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__cycles_elapsed.avg.per_second \
    "$root/.gpu/bin/moefold" bench moe-layer "${shape[@]}" --reps 1 --warmup 0 > "$out/clocks_ncu_$cache.csv" \
    2> "$out/clocks_ncu_$cache.err"
  python3 "$root/scripts/gpu/ncu_kernels.py" "$out/clocks_ncu_$cache.csv" | grep -v " 0.000      0.000 "
done
