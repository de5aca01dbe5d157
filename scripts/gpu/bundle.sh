#!/usr/bin/env bash
# Builds the GPU test binaries here (Release unless told otherwise, sm_90a) and bundles them with the shared libraries
# the GPU machine lacks into .gpu/ (ignored by git, carried by the device tool; < 64 MiB):
#   .gpu/bin: the GPU test binaries (stripped), and MOEFOLD_GPU_EXTRA_TARGETS
#   .gpu/lib: Debian libraries they need (not glibc, not CUDA's nor Open MPI's: the GPU machine
#             (Ubuntu 24.04) has CUDA 13.0 and Open MPI 4.1; run.sh finds them there);
#             netlib's reference BLAS stands in for OpenBLAS, with blas_shim.c preloaded.
# Then on the GPU machine: scripts/gpu/run.sh (see there).
set -euo pipefail
# With MOEFOLD_GPU_BASELINE (below) the checkout rewrites the working tree, this file included, and
# bash reads a script as it goes: run from a copy.
if [ -n "${MOEFOLD_GPU_BASELINE:-}" ] && [ -z "${MOEFOLD_BUNDLE_ROOT:-}" ]; then
  copy=$(mktemp)
  cp "$0" "$copy"
  MOEFOLD_BUNDLE_ROOT="$(cd "$(dirname "$0")/../.." && pwd)" exec bash "$copy" "$@"
fi
root="${MOEFOLD_BUNDLE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}"
build="${MOEFOLD_GPU_BUILD:-$root/build-gpu}"
out="$root/.gpu"
# In a linked worktree .git is a file: the exclude list lives in the common git directory.
exclude="$(cd "$root" && git rev-parse --path-format=absolute --git-common-dir)/info/exclude"
for p in /.gpu/ /build-gpu/ /.gpupack/; do grep -qx "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
# MOEFOLD_GPU_BUILD_TYPE: Release by default; e.g. RelWithDebInfo with MOEFOLD_GPU_BUILD=build-ci to
# bundle the CI build's binaries instead of building everything again (device code is the same).
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE="${MOEFOLD_GPU_BUILD_TYPE:-Release}" -DMOEFOLD_WERROR=ON \
  -DMOEFOLD_CUDA_ARCHS=90a > /dev/null
# MOEFOLD_GPU_TARGETS: the test binaries (default: every tests/test_*cuda*.cpp, tests/mpi/test_*cuda*.cpp
# and test_comm_nccl).
targets=${MOEFOLD_GPU_TARGETS:-$(cd "$root/tests" && ls test_*cuda*.cpp mpi/test_*cuda*.cpp mpi/test_comm_nccl.cpp 2>/dev/null | xargs -n1 basename | sed 's/\.cpp$//')}
# MOEFOLD_GPU_EXTRA_TARGETS: more targets to bundle (e.g. "moefold test_train").
# MOEFOLD_GPU_BASELINE: a git ref (e.g. main) whose MOEFOLD_GPU_BASELINE_TARGETS (default: the extra
# targets) are bundled too, as .gpu/bin/<target>_old, for a before/after timing in one device call.
# They are built in the same build directory with the ref checked out in place (the working tree
# must be clean; the current commit is checked out again after, also on failure).
baseline_bin=""
if [ -n "${MOEFOLD_GPU_BASELINE:-}" ]; then
  if ! git -C "$root" diff --quiet HEAD; then
    echo "bundle: MOEFOLD_GPU_BASELINE needs a clean working tree (commit or stash first)" >&2
    exit 1
  fi
  current=$(git -C "$root" symbolic-ref -q --short HEAD || git -C "$root" rev-parse HEAD)
  baseline_bin=$(mktemp -d)
  trap 'git -C "$root" checkout -q "$current"' EXIT
  git -C "$root" checkout -q --detach "$MOEFOLD_GPU_BASELINE"  # detached: a branch checked out in another worktree works too
  base_targets=${MOEFOLD_GPU_BASELINE_TARGETS:-${MOEFOLD_GPU_EXTRA_TARGETS:-}}
  cmake --build "$build" -j"$(nproc)" --target $base_targets
  for t in $base_targets; do strip -o "$baseline_bin/${t}_old" "$build/$t"; done
  git -C "$root" checkout -q "$current"
  trap - EXIT
  echo "bundle: baseline $MOEFOLD_GPU_BASELINE ($(git -C "$root" rev-parse --short "$MOEFOLD_GPU_BASELINE")): $base_targets"
fi
cmake --build "$build" -j"$(nproc)" --target $targets ${MOEFOLD_GPU_EXTRA_TARGETS:-}
rm -rf "$out" && mkdir -p "$out/bin" "$out/lib"
for t in $targets ${MOEFOLD_GPU_EXTRA_TARGETS:-}; do
  strip -o "$out/bin/$t" "$build/$t"
done
[ -n "$baseline_bin" ] && cp "$baseline_bin"/* "$out/bin/" && rm -rf "$baseline_bin"
# Shared libraries: everything ldd finds outside glibc, the toolchain runtime and CUDA.
for b in "$out"/bin/*; do ldd "$b"; done | awk '/=>/ {print $3}' | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
    libcuda.so*|libcudart.so*|libcublas*|libnccl.so*|libcudnn*) ;;
    libopenblas.so*) ;;
    libmpi.so*|libopen-rte.so*|libopen-pal.so*|libhwloc.so*|libevent*) ;;  # the GPU machine has Open MPI 4.1
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done
cp -L /usr/lib/x86_64-linux-gnu/blas/libblas.so.3 "$out/lib/libopenblas.so.0"
for l in libgfortran.so.5 libquadmath.so.0; do cp -L "/lib/x86_64-linux-gnu/$l" "$out/lib/"; done
gcc -shared -fPIC -O2 -o "$out/lib/libmoefold_blas_shim.so" "$root/scripts/gpu/blas_shim.c"
du -sh "$out" | sed 's/^/bundle: /'
# The device tool carries at most 64 MiB with the working tree; the full set of GPU tests is larger
# (77 MB at b276583). A gzipped copy is a third of it: carry .gpupack and begin the command with
# `tar xzf .gpupack/gpu.tgz;`.
mkdir -p "$root/.gpupack" && tar czf "$root/.gpupack/gpu.tgz" -C "$root" .gpu
du -sh "$root/.gpupack/gpu.tgz" | sed 's/^/packed: /'
