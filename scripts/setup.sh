#!/usr/bin/env bash
# Installs the Debian packages moefold builds with, when missing (README: "Dependencies"), and
# build-venv/: a Python environment with TensorBoard, whose own reader the tests read moefold's
# event files with.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(build-essential cmake pkg-config clang-format libopenblas-dev nlohmann-json3-dev libtomlplusplus-dev
          libcli11-dev libgtest-dev libopenmpi-dev openmpi-bin libpcre2-dev libutf8proc-dev libxxhash-dev
          libprotobuf-dev protobuf-compiler libisal-dev zlib1g-dev libzstd-dev
          libpng-dev chromium-headless-shell  # tests: the report rendered by a real browser
          python3-pip python3-venv)  # pip: CMake fetches cuDNN's header-only C++ frontend from PyPI (CUDA builds)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
tensorboard_version=2.20.0
if ! build-venv/bin/python -c "import tensorboard, sys; sys.exit(tensorboard.__version__ != '$tensorboard_version')" \
  2>/dev/null; then
  echo "setup: installing TensorBoard $tensorboard_version into build-venv/ (tests only)"
  rm -rf build-venv
  python3 -m venv build-venv
  build-venv/bin/pip install -q --disable-pip-version-check "tensorboard==$tensorboard_version"
fi
