source scripts/gpu/env.sh; B=.gpu/bin/moefold
watch() { sleep 35; for p in $(pgrep -f "bin/moefold"); do echo "pid $p: $(cat /proc/$p/wchan) $(awk '{print $3, $14, $15}' /proc/$p/stat)"; for t in /proc/$p/task/*; do echo "  $(cat $t/comm) $(awk '{print $3, $14}' $t/stat) $(cat $t/wchan)"; done; done; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; }
a="--config qwen3-30b-a3b --steps 2 --warmup 1 --set model.num_hidden_layers=2"
echo "== gbs2 mbs2"; (watch &) ; MOEFOLD_TRACE=1 timeout 45 $B bench train $a --set train.global_batch_size=2 --set train.micro_batch_size=2 > $OUT/trace.log 2>&1; echo "rc $?"; grep -c . $OUT/trace.log; head -5 $OUT/trace.log; tail -12 $OUT/trace.log
echo "== gbs8 mbs1"; MOEFOLD_TRACE=1 timeout 45 $B bench train $a --set train.global_batch_size=8 > $OUT/trace8.log 2>&1; echo "rc $?"; grep -c . $OUT/trace8.log; head -5 $OUT/trace8.log; tail -12 $OUT/trace8.log
