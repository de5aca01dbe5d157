#!/usr/bin/env bash
# Builds a deliberately broken copy of one GPU test binary into .gpu/bin/<target>_broken (after
# scripts/gpu/bundle.sh), to see on the GPU machine that the test goes red:
#   scripts/gpu/bundle_broken.sh TARGET FILE SED_EXPRESSION
# e.g. scripts/gpu/bundle_broken.sh test_ops_cuda_gemm src/moefold/ops/cuda/wgrad_grouped_gemm.cu \
#        's/o_tile = o_group \* kCluster + static_cast<int>(rank);/o_tile = o_group * kCluster;/'
# The expression must change FILE (else nothing is built); FILE is restored afterwards, also on
# failure, and touched so that the next build compiles it again.
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 TARGET FILE SED_EXPRESSION" >&2; exit 2; }
target=$1 file=$2 expr=$3
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${MOEFOLD_GPU_BUILD:-$root/build-gpu}"
cd "$root"
[ -d .gpu/bin ] || { echo "bundle_broken: run scripts/gpu/bundle.sh first" >&2; exit 1; }
keep=$(mktemp)
cp "$file" "$keep"
trap 'cp "$keep" "$file"; touch "$file"; rm -f "$keep"' EXIT
sed -i "$expr" "$file"
if cmp -s "$file" "$keep"; then
  echo "bundle_broken: '$expr' changes nothing in $file" >&2
  exit 1
fi
diff "$keep" "$file" || true
cmake --build "$build" -j"$(nproc)" --target "$target"
strip -o ".gpu/bin/${target}_broken" "$build/$target"
echo "bundle_broken: .gpu/bin/${target}_broken"
