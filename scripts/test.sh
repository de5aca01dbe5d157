#!/usr/bin/env bash
# Installs what is missing, builds with warnings as errors, and runs every test (CTest); then
# builds without the CUDA backend, warning-free and under the sanitizers, and runs the CPU unit
# tests there.
set -euo pipefail
cd "$(dirname "$0")/.."
# OpenBLAS takes Sandy Bridge's kernels (AVX) in every test, whatever the CPU: tests that compare
# two layouts bit for bit (the same additions in the same order) need BLAS to sum a row alike
# whatever the GEMM's row count. Seen on a virtualised Xeon with AVX-512 that OpenBLAS read as
# "Prescott": LocalDispatcher.RowsWithoutWaitingChangeNothing failed with those kernels, the
# hierarchical dispatcher's layout tests with Haswell's and Zen's (1 ulp in dx); both pass with
# Sandy Bridge's and SkylakeX's. (CTest sets OPENBLAS_NUM_THREADS=1 itself.) Set whatever the
# environment says: a machine that exports OPENBLAS_CORETYPE=Haswell (seen, 2026-12-06, on an AMD
# EPYC) fails the hierarchical tests by 1 ulp otherwise. MOEFOLD_OPENBLAS_CORETYPE overrides it.
export OPENBLAS_CORETYPE="${MOEFOLD_OPENBLAS_CORETYPE:-Sandybridge}"
./scripts/setup.sh
# 1. `ci`: warnings are errors, the CUDA backend when nvcc is found; every test.
cmake --preset ci
cmake --build --preset ci -j "$(nproc)"
ctest --preset ci -j "$(nproc)"
# 2. `ci-nocuda`: CPU only, so the code and tests without their CUDA halves must compile warning-free
#    too; Debug, instrumented with AddressSanitizer + UBSan. One build serves both checks (-O0
#    compiles faster than the `ci` build's -O2, which sanitizers at -O2 would make ~4x slower).
cmake --preset ci-nocuda
cmake --build --preset ci-nocuda -j "$(nproc)"
# The sanitized subset: every CPU unit test (the GPU tests report skipped), i.e. every CTest entry
# but the multi-rank ones (`*_npN`, and Cli.BadLayoutsFailOnEveryRankWithoutHanging and
# CliFaults.LostRank*, which run ranks under mpiexec: Open MPI's own allocations read as leaks) and the format check (step 1):
#   ctest -E '_np[0-9]+$|^format$|^Cli\.BadLayoutsFailOnEveryRankWithoutHanging$|^CliFaults\.LostRank'
# Measured on 2 cores: the build 8.3 CPU-minutes (~4-6 min), these tests ~40 s (222 entries, 0 failing);
# step 1 takes ~10-11 min, so CI stays near 16 min.
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  ctest --test-dir build-ci-nocuda -j "$(nproc)" --output-on-failure --timeout 600 \
  -E '_np[0-9]+$|^format$|^Cli\.BadLayoutsFailOnEveryRankWithoutHanging$|^CliFaults\.LostRank'
