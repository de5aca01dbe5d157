#!/usr/bin/env bash
# On the GPU machine after scripts/gpu/bundle.sh with MOEFOLD_GPU_EXTRA_TARGETS=moefold: the expert-load
# measurements of docs/expert-load.md. Runs listed on the command line, each NAME[:ARGS]:
#   qwen3 / deepseek [extra moefold train args]   moefold's run of the issue's shape
#                                                  (qwen3-30b-a3b 4 layers 300 steps; deepseek-v3 3 layers
#                                                  with 32 experts, 200 steps), loads per layer printed
#   hf-qwen3 / hf-deepseek [extra args]           transformers' own model on the same shapes and corpus
#                                                  (scripts/expert_load_hf.py), after an export of
#                                                  moefold's initial weights (1 step, lr 0) for its config
# e.g. scripts/gpu/expert_load.sh "qwen3" "qwen3 --set moe.aux_loss_coeff=1e-2" "hf-qwen3 --init hf --steps 20"
# Metrics land in $OUT/<label>.jsonl; a summary line per run and layer goes to stdout.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
bin="$root/.gpu/bin/moefold"
runs=/tmp/moefold-load
mkdir -p "$runs"
qwen3=(--config qwen3-30b-a3b --set model.num_hidden_layers=4 --set train.global_batch_size=8
  --set train.micro_batch_size=4 --set train.steps=300 --set train.warmup_steps=30)
deepseek=(--config deepseek-v3 --set model.num_hidden_layers=3 --set model.first_k_dense_replace=1
  --set moe.num_experts=32 --set model.num_nextn_predict_layers=0 --set train.global_batch_size=4
  --set train.micro_batch_size=1 --set train.steps=200)
n=0
summary() {  # metrics.jsonl label
  python3 - "$1" "$2" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
if not rows:
    sys.exit(print(f"{sys.argv[2]}: no steps"))
last = rows[-1]["step"]
marks = [s for s in (1, 2, 5, 10, 20, 50, 100, 150, 200, 250, 300) if s <= last] + ([last] if last not in (1, 2, 5, 10, 20, 50, 100, 150, 200, 250, 300) else [])
by = {r["step"]: r for r in rows}
for l in range(len(rows[0]["expert_load_max"])):
    if rows[0]["expert_load_mean"][l] == 0:
        continue
    cells = " ".join(f"{s}:{by[s]['expert_load_max'][l] / by[s]['expert_load_mean'][l]:.2f}" for s in marks if s in by)
    print(f"{sys.argv[2]} layer {l} max/mean {cells}")
ev = [r for r in rows if "eval_loss" in r]
print(f"{sys.argv[2]} loss {rows[0]['loss']:.4f} -> {last}: {rows[-1]['loss']:.4f} lm {rows[-1]['lm_loss']:.4f}"
      + (f" eval {ev[-1]['eval_loss']:.4f}" if ev else ""))
PY
}
export_init() {  # family -> $runs/<family>-init/hf (moefold's initial weights as a Hugging Face model)
  local fam=$1 dir="$runs/$1-init"
  [ -f "$dir/hf/config.json" ] && return 0
  rm -rf "$dir"
  local -n shape=$fam
  timeout 300 "$bin" train --quiet --device cuda --run-dir "$dir" "${shape[@]}" --set train.lr=1e-30 --set train.min_lr=0 \
    --set train.eval_batches=1 --steps 1 > "$dir.log" 2>&1 || { tail -5 "$dir.log"; return 1; }
  "$bin" convert --from "$dir/checkpoints/step_00000001" --to-hf "$dir/hf" > /dev/null || return 1
  rm -rf "$dir/checkpoints"
}
for spec in "$@"; do
  n=$((n + 1))
  read -r name rest <<< "$spec"
  label="$n-$name"
  echo "== $label: $rest"
  case "$name" in
    qwen3|deepseek)
      local_shape="${name}[@]"
      dir="$runs/$label"
      rm -rf "$dir"
      # shellcheck disable=SC2086
      timeout 400 "$bin" train --quiet --device cuda --run-dir "$dir" "${!local_shape}" \
        --set train.save_checkpoints=false $rest > "$dir.log" 2>&1 || { echo "failed:"; tail -5 "$dir.log"; }
      cp "$dir/metrics.jsonl" "$out/$label.jsonl" 2>/dev/null && summary "$dir/metrics.jsonl" "$label"
      ;;
    hf-qwen3|hf-deepseek)
      fam=${name#hf-}
      local_shape="${fam}[@]"
      if [[ " $rest " == *" --init file "* ]]; then  # moefold's initial weights, exported
        export_init "$fam" || { echo "export failed"; continue; }
        hf="$runs/$fam-init/hf"
      else  # transformers' own initialisation: only the config
        hf="$runs/$fam-hfconfig"
        mkdir -p "$hf"
        "$bin" config "${!local_shape}" --hf > "$hf/config.json" || continue
      fi
      corpus="$runs/corpus/default_corpus.tokens"  # the default corpus, prepared by a one-step tiny run
      [ -f "$corpus" ] || "$bin" train --quiet --run-dir "$runs/corpus" --steps 1 --set train.save_checkpoints=false \
        > /dev/null 2>&1
      if [ "$fam" = qwen3 ]; then sched=(--global-batch 8 --warmup 30 --schedule-steps 300 --lr 3e-4); else
        sched=(--global-batch 4 --warmup 2000 --schedule-steps 200 --lr 3e-4 --bias-rate 1e-3); fi
      # shellcheck disable=SC2086
      LD_PRELOAD= timeout 400 python3 "$root/scripts/expert_load_hf.py" --hf-dir "$hf" --tokens "$corpus" \
        --label "$label" "${sched[@]}" $rest 2>&1 | grep -v -i "warning\|detach\|aux +=" | tee "$out/$label.jsonl" | tail -40
      ;;
    *) echo "unknown run $name" ;;
  esac
done
