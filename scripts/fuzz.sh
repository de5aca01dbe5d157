#!/usr/bin/env bash
# Fuzzes moefold's file readers with clang's libFuzzer (fuzz/*.cpp): builds build-fuzz/ with clang,
# every library instrumented (-fsanitize=fuzzer-no-link,address,undefined; undefined behaviour
# aborts), then runs each target for FUZZ_SECONDS (default 600) from fuzz/corpus/<target>, and
# merges the inputs that found new coverage back into fuzz/corpus/<target> (-merge=1; kept to the
# seeds, the findings and the 200 smallest others), which CI replays (CTest's
# fuzz_replay_<target>). Findings (crash-*, leak-*, timeout-* files) land in
# build-fuzz/findings/<target>/; a summary line per target reports its executions.
#   scripts/fuzz.sh [target ...]   (default: safetensors npy tokens tokenizer config)
#   FUZZ_JOBS=2 runs that many targets at once (default 1).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-fuzz"
targets=("${@:-safetensors npy tokens tokenizer config}")
read -r -a targets <<< "${targets[*]}"
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S "$root" -B "$build" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMOEFOLD_CUDA=OFF -DMOEFOLD_TESTS=OFF -DMOEFOLD_FUZZ=ON -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" > /dev/null
cmake --build "$build" -j"$(nproc)" --target "${targets[@]/#/fuzzer_}" > "$build/build.log" 2>&1 ||
  { tail -30 "$build/build.log"; exit 1; }
seconds="${FUZZ_SECONDS:-600}"
run_one() {
  local t=$1 work="$build/work/$1" found="$build/findings/$1"
  rm -rf "$work" "$found" && mkdir -p "$work" "$found"
  (cd "$found" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$build/fuzzer_$t" -max_total_time="$seconds" -rss_limit_mb=4096 -max_len=65536 -timeout=10 \
    -print_final_stats=1 "$work" "$root/fuzz/corpus/$t" > "$build/$t.log" 2>&1) || true
  "$build/fuzzer_$t" -merge=1 "$root/fuzz/corpus/$t" "$work" > "$build/$t.merge.log" 2>&1 || true
  # The committed corpus: the seeds, every finding (its replay fails until it is fixed), the inputs
  # crafted by the audit of the readers (audit-*, docs/faults.md) and the 200 smallest inputs with
  # coverage of their own.
  cp "$found"/* "$root/fuzz/corpus/$t/" 2> /dev/null || true
  ls -S -r "$root/fuzz/corpus/$t" | grep -vE "^(seed_|crash-|timeout-|leak-|oom-|audit-)" | tail -n +201 |
    while read -r f; do rm "$root/fuzz/corpus/$t/$f"; done
  local execs rate
  execs=$(grep -m1 "stat::number_of_executed_units" "$build/$t.log" | awk '{print $2}')
  rate=$(grep -m1 "stat::average_exec_per_sec" "$build/$t.log" | awk '{print $2}')
  # A finding stops libFuzzer: the time it ran is executions / rate.
  echo "fuzz $t: ${execs:-?} executions in $(( ${execs:-0} / ${rate:-1} )) s (of ${seconds}), $(ls "$found" | wc -l)" \
    "findings, corpus $(ls "$root/fuzz/corpus/$t" | wc -l) inputs"
}
jobs_n=0
for t in "${targets[@]}"; do
  run_one "$t" &
  jobs_n=$((jobs_n + 1))
  if [ "$jobs_n" -ge "${FUZZ_JOBS:-1}" ]; then wait -n; jobs_n=$((jobs_n - 1)); fi
done
wait
