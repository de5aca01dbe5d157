#!/usr/bin/env bash
# SIGKILL training runs at random instants and check that nothing is lost: a run saves a
# checkpoint after every step (the 2 newest kept, synchronous and asynchronous runs alternating);
# each trial kills it after a random delay, checks that every checkpoint left is complete
# (`moefold eval` loads the newest), resumes it to the end and compares the losses and the last
# checkpoint's files with an uninterrupted run, byte for byte.
#
#   scripts/crash_trials.sh [TRIALS (default 100)] [BUILD_DIR (default build-ci)]
#
# The deterministic kill points (every stage of a save) are CTest's CliFaults tests; this adds
# instants nobody chose. Prints one line per trial and a summary; exit 1 on any mismatch.
set -euo pipefail
trials=${1:-100}
build=${2:-build-ci}
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/$build/moefold"
[[ -x "$bin" ]] || { echo "crash_trials.sh: $bin not built" >&2; exit 2; }
work=$(mktemp -d /tmp/moefold-crash-XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"
export OPENBLAS_NUM_THREADS=1

python3 - <<'EOF' > corpus.txt
import random
random.seed(7)
words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
for _ in range(20000):
    print(" ".join(random.choice(words) for _ in range(14)))
EOF
"$bin" prepare corpus.txt -o data.tokens >/dev/null
head -50 corpus.txt > few.txt && "$bin" prepare few.txt -o few.tokens >/dev/null  # what eval loads a checkpoint on

# Large enough that a save (about 10 MB) takes a good share of a step.
args=(train --steps 12 --quiet --set data.path=../data.tokens --set model.hidden_size=128
      --set model.num_hidden_layers=2 --set model.num_attention_heads=4 --set model.num_key_value_heads=2
      --set model.head_dim=32 --set moe.num_experts=16 --set moe.moe_intermediate_size=128
      --set train.seq_len=64 --set train.micro_batch_size=4 --set train.global_batch_size=4
      --set train.eval_batches=1 --set train.eval_interval=4 --set train.checkpoint_interval=1
      --set train.keep_checkpoints=2)

# The fields of metrics.jsonl that do not depend on timing.
losses() {
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    print(json.dumps({k: j.get(k) for k in ("step", "loss", "grad_norm", "eval_loss")}))' "$1"
}

mkdir ref && (cd ref && "$bin" "${args[@]}" --run-dir run)
losses ref/run/metrics.jsonl > ref.losses
last=run/checkpoints/step_00000012
start=$(date +%s.%N)
(mkdir timing && cd timing && "$bin" "${args[@]}" --run-dir run)
span=$(python3 -c "import time; print(time.time() - $start)")
echo "an uninterrupted run takes ${span} s; $trials trials"

bad=0 none=0
for ((t = 1; t <= trials; ++t)); do
  mode=false
  ((t % 2 == 0)) && mode=true
  rm -rf trial && mkdir trial
  delay=$(python3 -c "import random; print(round(random.uniform(0.25 * $span, $span), 3))")
  (cd trial && exec "$bin" "${args[@]}" --run-dir run --set train.async_checkpoint=$mode) &
  pid=$!
  sleep "$delay"
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  newest=$(ls -d trial/run/checkpoints/step_* 2>/dev/null | sort | tail -1 || true)
  left=$(ls -a trial/run/checkpoints 2>/dev/null | grep -v '^\.\.\?$' | tr '\n' ' ' || true)
  status=ok
  if [[ -n "$newest" ]]; then
    # The newest complete checkpoint loads (checksums, names, shapes).
    if ! (cd trial && "$bin" eval --checkpoint "../$newest" --tokens ../few.tokens --seq-len 64 >/dev/null 2>eval.err); then
      status="newest checkpoint does not load: $(cat trial/eval.err)"
    fi
    resume=(--resume)
  else
    none=$((none + 1))
    resume=()
  fi
  if [[ $status == ok ]]; then
    if ! (cd trial && "$bin" "${args[@]}" --run-dir run --set train.async_checkpoint=$mode "${resume[@]}" 2>resume.err); then
      status="resume failed: $(cat trial/resume.err)"
    elif ! diff -q <(losses trial/run/metrics.jsonl) ref.losses >/dev/null; then
      status="losses differ"
    elif ! cmp -s trial/$last/model.safetensors ref/$last/model.safetensors ||
         ! cmp -s trial/$last/optimizer.safetensors ref/$last/optimizer.safetensors; then
      status="final checkpoint differs"
    fi
  fi
  [[ $status == ok ]] || bad=$((bad + 1))
  printf 'trial %3d async=%-5s killed at %6.3f s; left: %s-> %s\n' "$t" "$mode" "$delay" "$left" "$status"
done
echo "crash_trials: $trials trials, $bad failed, $none killed before the first checkpoint was complete"
((bad == 0))
