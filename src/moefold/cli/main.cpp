// The moefold command line: train, eval, convert, info, config, prepare, bench, report (one cmd_*.cpp
// each). User mistakes end in one line on stderr ("moefold: error: ...") and exit code 1; usage
// mistakes get CLI11's message and non-zero code.
#include <cstdio>

#include "moefold/cli/commands.h"
#include "moefold/comm/mpi.h"
#include "moefold/ops/blas.h"

int main(int argc, char** argv) {
  moefold::reexec_with_best_blas_core(argv);
  CLI::App app{"moefold: train Mixture-of-Experts transformers"};
  app.require_subcommand(1);
  using namespace moefold::cli;
  // The order of `moefold --help`.
  const Command commands[] = {add_train(app),   add_info(app),    add_plan(app),  add_config(app), add_eval(app),
                              add_convert(app), add_prepare(app), add_bench(app), add_report(app)};

  CLI11_PARSE(app, argc, argv);

  // Under mpirun/srun every rank runs this; user errors are agreed on by all ranks (run_training
  // fails on every rank together), so each prints its line and finalizes MPI cleanly.
  World w;
  int code = 0;
  try {
    for (const Command& c : commands)
      if (*c.app) c.run(w);
  } catch (const std::exception& e) {
    if (w.world && w.world->size() > 1)
      std::fprintf(stderr, "moefold: error: rank %d: %s\n", w.world->rank(), e.what());
    else
      std::fprintf(stderr, "moefold: error: %s\n", e.what());
    code = 1;
  }
  w.world.reset();
  w.bootstrap.reset();
  moefold::mpi_finalize();
  return code;
}
