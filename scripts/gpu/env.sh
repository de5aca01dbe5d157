# Sourced on the GPU machine (by run.sh, train_smoke.sh, or by hand before running .gpu/bin/*):
# LD_LIBRARY_PATH gets .gpu/lib and the directories of CUDA's libraries found there (cuBLASLt,
# NCCL, cuDNN: the toolkit's or PyTorch's wheels); LD_PRELOAD the BLAS shim (see bundle.sh).
#   source scripts/gpu/env.sh
moefold_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
moefold_libdirs="$moefold_root/.gpu/lib"
# Python's site-packages too (PyTorch in a virtualenv or a user install: nvidia/cudnn/lib).
moefold_pydirs=$(python3 -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' \
  2>/dev/null)
for name in libcublasLt.so.13 libnccl.so.2 libcudnn.so.9; do
  found=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/x86_64-linux/lib /opt /usr/lib /usr/local/lib \
    $moefold_pydirs -name "$name" 2>/dev/null | head -1)
  if [ -n "$found" ]; then
    moefold_libdirs="$moefold_libdirs:$(dirname "$found")"
  else
    echo "env.sh: $name not found"
  fi
done
export LD_LIBRARY_PATH="$moefold_libdirs:${LD_LIBRARY_PATH:-}"
export LD_PRELOAD="$moefold_root/.gpu/lib/libmoefold_blas_shim.so"
export MOEFOLD_SOURCE_DIR="$moefold_root"
