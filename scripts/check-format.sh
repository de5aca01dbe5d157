#!/usr/bin/env bash
# Fails when a C++ or CUDA file (.cpp, .h, .cu, .cuh) is not formatted as .clang-format says (run
# by CTest as `format`).
set -euo pipefail
cd "$(dirname "$0")/.."
find src tests fuzz bench \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print0 | sort -z |
  xargs -0 clang-format --dry-run -Werror
