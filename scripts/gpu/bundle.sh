#!/usr/bin/env bash
# Builds the GPU test binaries here (Release unless told otherwise, sm_90a) and bundles them with the shared libraries
# the GPU machine lacks into .gpu/ (ignored by git, carried by the device tool; < 64 MiB):
#   .gpu/bin: the GPU test binaries (stripped), and MOEFOLD_GPU_EXTRA_TARGETS
#   .gpu/lib: Debian libraries they need (not glibc, not CUDA's nor Open MPI's: the GPU machine
#             (Ubuntu 24.04) has CUDA 13.0 and Open MPI 4.1; run.sh finds them there);
#             netlib's reference BLAS stands in for OpenBLAS, with blas_shim.c preloaded.
# Then on the GPU machine: scripts/gpu/run.sh (see there).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${MOEFOLD_GPU_BUILD:-$root/build-gpu}"
out="$root/.gpu"
grep -qx '/.gpu/' "$root/.git/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$root/.git/info/exclude"
grep -qx '/build-gpu/' "$root/.git/info/exclude" 2>/dev/null || echo '/build-gpu/' >> "$root/.git/info/exclude"
# MOEFOLD_GPU_BUILD_TYPE: Release by default; e.g. RelWithDebInfo with MOEFOLD_GPU_BUILD=build-ci to
# bundle the CI build's binaries instead of building everything again (device code is the same).
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE="${MOEFOLD_GPU_BUILD_TYPE:-Release}" -DMOEFOLD_WERROR=ON \
  -DMOEFOLD_CUDA_ARCHS=90a > /dev/null
# MOEFOLD_GPU_TARGETS: the test binaries (default: every tests/test_*cuda*.cpp, tests/mpi/test_*cuda*.cpp
# and test_comm_nccl).
targets=${MOEFOLD_GPU_TARGETS:-$(cd "$root/tests" && ls test_*cuda*.cpp mpi/test_*cuda*.cpp mpi/test_comm_nccl.cpp 2>/dev/null | xargs -n1 basename | sed 's/\.cpp$//')}
# MOEFOLD_GPU_EXTRA_TARGETS: more targets to bundle (e.g. "moefold test_train").
cmake --build "$build" -j"$(nproc)" --target $targets ${MOEFOLD_GPU_EXTRA_TARGETS:-}
rm -rf "$out" && mkdir -p "$out/bin" "$out/lib"
for t in $targets ${MOEFOLD_GPU_EXTRA_TARGETS:-}; do
  strip -o "$out/bin/$t" "$build/$t"
done
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
grep -qx '/.gpupack/' "$root/.git/info/exclude" 2>/dev/null || echo '/.gpupack/' >> "$root/.git/info/exclude"
mkdir -p "$root/.gpupack" && tar czf "$root/.gpupack/gpu.tgz" -C "$root" .gpu
du -sh "$root/.gpupack/gpu.tgz" | sed 's/^/packed: /'
