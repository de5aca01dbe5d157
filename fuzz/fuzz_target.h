// What the fuzz targets share (fuzz/*.cpp): each is a libFuzzer target,
// LLVMFuzzerTestOneInput, over one of moefold's file readers. The readers take paths, so the input
// is written to a file of this process first (in $TMPDIR, else /dev/shm, else /tmp). A reader may
// reject any input, with moefold::Error (one clear line: the expected outcome); anything else
// (another exception, a crash, a sanitizer report) is a finding.
// Two builds: scripts/fuzz.sh (clang, -fsanitize=fuzzer,address,undefined: the fuzzing itself) and
// the normal build's fuzz_<target> executables (fuzz/replay_main.cpp: every file of a corpus once,
// CTest's fuzz_replay_<target> over fuzz/corpus/<target>).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "moefold/core/error.h"

namespace moefold::fuzz {

// A directory for this process's input files.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    for (const char* d : {static_cast<const char*>(std::getenv("TMPDIR")), "/dev/shm", "/tmp"})
      if (d != nullptr && std::filesystem::is_directory(d)) return std::string(d);
    return std::string(".");
  }();
  return dir;
}

// Writes `size` bytes to a file named after this process and `suffix`; returns its path.
inline std::string write_input(const uint8_t* data, size_t size, const std::string& suffix) {
  const std::string path = scratch_dir() + "/moefold-fuzz-" + std::to_string(::getpid()) + suffix;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

// Runs `read` and swallows the reader's rejection (moefold::Error); other exceptions escape.
template <class Read>
void expect_ok_or_error(const Read& read) {
  try {
    read();
  } catch (const Error&) {
  }
}

}  // namespace moefold::fuzz
