#!/usr/bin/env bash
# On the GPU machine, in the repository root with .gpu/ carried (scripts/gpu/bundle.sh made it):
# finds CUDA's libraries there (cuBLASLt, NCCL: the toolkit's or PyTorch's wheels), then runs
# the GPU parity tests and, with two GPUs, the multi-rank GPU tests (NCCL, layouts) under
# mpirun -np 2. Logs go to $OUT.
#   scripts/gpu/run.sh [gtest filter]
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp}"
source "$root/scripts/gpu/env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
status=0
mpi_tests="test_comm_nccl test_train_layouts_cuda"  # built with tests/mpi/mpi_main.cpp: run on 2 ranks
for t in "$root"/.gpu/bin/test_*; do
  name=$(basename "$t")
  case " $mpi_tests " in *" $name "*) continue ;; esac
  echo "== $name"
  "$t" --gtest_brief=1 ${1:+--gtest_filter=$1} 2>&1 | tee "$out/$name.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
gpus=$(nvidia-smi -L | wc -l)
mpirun=$(command -v mpirun || command -v mpiexec || true)
for name in $mpi_tests; do
  [ -x "$root/.gpu/bin/$name" ] || continue
  if [ -n "$mpirun" ] && [ "$gpus" -ge 2 ]; then
    echo "== $name on 2 ranks"
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$mpirun" -np 2 -x LD_LIBRARY_PATH -x LD_PRELOAD \
      "$root/.gpu/bin/$name" --gtest_brief=1 ${1:+--gtest_filter=$1} 2>&1 | tee "$out/$name.log" | tail -40
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  else
    echo "== $name skipped: ${gpus} GPU(s), mpirun: ${mpirun:-none}"
  fi
done
exit $status
