/* The two OpenBLAS-only functions moefold calls, for GPU machines that get netlib's reference
 * BLAS (with CBLAS) as libopenblas.so.0 instead of OpenBLAS (36 MB): scripts/gpu/bundle.sh
 * builds this and run.sh preloads it. CPU speed does not matter there: the CPU side of the GPU
 * tests only computes references. */
const char* openblas_get_corename(void) { return "netlib reference BLAS (GPU test bundle)"; }
void openblas_set_num_threads(int n) { (void)n; }
int openblas_get_num_threads(void) { return 1; }
