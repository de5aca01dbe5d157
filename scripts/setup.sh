#!/usr/bin/env bash
# Installs the Debian packages moefold builds with, when missing (README: "Dependencies").
set -euo pipefail
packages=(build-essential cmake pkg-config clang-format libopenblas-dev nlohmann-json3-dev libtomlplusplus-dev
          libcli11-dev libgtest-dev libopenmpi-dev openmpi-bin libpcre2-dev libutf8proc-dev libxxhash-dev
          python3-pip)  # pip: CMake fetches cuDNN's header-only C++ frontend from PyPI (CUDA builds)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "setup: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
