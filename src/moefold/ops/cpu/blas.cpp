#include "moefold/ops/blas.h"

#include <cblas.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace moefold {

const char* blas_core_name() { return openblas_get_corename(); }

void reexec_with_best_blas_core(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;  // the user's (or our earlier) choice
  const char* core = blas_core_name();
  const bool generic = core == nullptr || std::strcmp(core, "Prescott") == 0 || std::strcmp(core, "Core2") == 0 ||
                       std::strcmp(core, "Nehalem") == 0 || std::strcmp(core, "Sandybridge") == 0;
  if (!generic) return;
  __builtin_cpu_init();
  const char* best = nullptr;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
    best = "SkylakeX";
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    best = "Haswell";
  if (best == nullptr) return;
  ::setenv("OPENBLAS_CORETYPE", best, 1);
  ::execv("/proc/self/exe", argv);  // returns only on failure: keep going with the generic core
}

}  // namespace moefold
