# One device call (session 4): the GPU tests touched, the two-GPU layout checks, then the
# benchmarks; logs in $OUT.
source scripts/gpu/env.sh; B=.gpu/bin/moefold
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for t in test_ops_cuda test_ops_cuda_gemm test_train_cuda; do
  echo "== $t"; timeout 100 .gpu/bin/$t --gtest_brief=1 2>&1 | grep -v "^Running main" | tail -8
done
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  echo "== nccl"; timeout 40 mpirun -np 2 -x LD_LIBRARY_PATH -x LD_PRELOAD .gpu/bin/test_comm_nccl --gtest_brief=1 2>&1 | grep -v "^Running main" | tail -4
  echo "== layouts"; timeout 110 mpirun -np 2 -x LD_LIBRARY_PATH -x LD_PRELOAD .gpu/bin/test_train_layouts_cuda --gtest_brief=1 --gtest_filter='*OneStep*:*Checkpoint*' > $OUT/layouts.log 2>&1; echo "rc $?"; grep -v "^Running main\|^\[ *OK\|^\[ RUN\|^\[----" $OUT/layouts.log | tail -30
fi
tr() { echo "== train $1 layers, $2 seqs"; timeout 80 $B bench train --config qwen3-30b-a3b --set model.num_hidden_layers=$1 --set train.global_batch_size=$2 --set train.micro_batch_size=$2 --steps 4 --warmup 2 > $OUT/train_$1.md 2>&1; echo "rc $?"; grep -v "^|---\|^$" $OUT/train_$1.md | head -60; }
tr 8 2
tr 4 4
echo "== moe"; timeout 60 $B bench moe-layer --shape qwen3-30b-a3b --shape deepseek-v3 --shape qwen3-235b-a22b --reps 10 --warmup 2 > $OUT/moe.md 2>&1; echo "rc $?"; sed -n 1,12p $OUT/moe.md
