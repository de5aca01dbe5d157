// OpenBLAS kernel selection. OpenBLAS picks its kernels from CPUID when the library loads; on
// virtual machines that hide the CPU model (seen on this project's Sapphire Rapids machines,
// OpenBLAS 0.3.21) it falls back to the SSE3 "Prescott" kernels, about 1.7x slower end to end
// for the tiny preset. The choice can only be made through OPENBLAS_CORETYPE before the library
// loads, so the binary re-executes itself once with it set.
#pragma once

namespace moefold {

// The core OpenBLAS chose ("Haswell", "SkylakeX", ...).
const char* blas_core_name();

// When OpenBLAS chose a generic core although the CPU has AVX2 (or AVX-512) and the user did
// not set OPENBLAS_CORETYPE, sets it and re-executes /proc/self/exe with `argv`; otherwise
// returns. Call first thing in main().
void reexec_with_best_blas_core(char** argv);

}  // namespace moefold
