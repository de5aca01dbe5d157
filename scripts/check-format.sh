#!/usr/bin/env bash
# Fails when a C++ file is not formatted as .clang-format says (run by CTest as `format`).
set -euo pipefail
cd "$(dirname "$0")/.."
find src tests -name '*.cpp' -o -name '*.h' | sort | xargs clang-format --dry-run -Werror
