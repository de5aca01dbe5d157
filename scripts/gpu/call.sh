# The session's last device call: the GPU tests of the fused clipping, then the training benchmarks.
source scripts/gpu/env.sh; B=.gpu/bin/moefold
for t in test_ops_cuda test_train_cuda; do
  echo "== $t"; timeout 100 .gpu/bin/$t --gtest_brief=1 2>&1 | grep -v "^Running main" | tail -8
done
tr() { echo "== train $1 layers, $2 seqs"; timeout 80 $B bench train --config qwen3-30b-a3b --set model.num_hidden_layers=$1 --set train.global_batch_size=$2 --set train.micro_batch_size=$2 --steps 4 --warmup 2 > $OUT/train_$1.md 2>&1; echo "rc $?"; grep -v "^|---\|^$" $OUT/train_$1.md | head -60; }
tr 8 2
tr 4 4
