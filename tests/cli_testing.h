// Running the moefold binary from the CLI tests (test_cli*.cpp).
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>

#include "moefold/core/error.h"
#include "testing.h"

namespace moefold {

namespace fs = std::filesystem;

struct Result {
  int code = -1;
  std::string out, err;
};

// Runs the binary with `args` (on np ranks under mpiexec when np > 0; args then start with "-- "),
// with the environment assignments `env` ("NAME=value ...") in front.
inline Result run(const std::string& args, const fs::path& cwd = fs::temp_directory_path(), int np = 0,
                  const std::string& env = "") {
  // Output files unique to this process and call: CTest runs test processes side by side, and
  // the default cwd (/tmp) is shared by them.
  static int calls = 0;
  const std::string tag = cat(::getpid(), "_", ++calls);
  const fs::path errf = cwd / cat("moefold_stderr_", tag, ".txt"), outf = cwd / cat("moefold_stdout_", tag, ".txt");
  std::string launcher = np > 0 ? cat("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
                                      "OMPI_MCA_btl_vader_single_copy_mechanism=none "
                                      "timeout 120 mpiexec --oversubscribe -np ",
                                      np, " ")
                                : std::string();
  std::string rest = np > 0 ? args.substr(3) : args;
  std::string cmd = cat("cd '", cwd.string(), "' && OPENBLAS_NUM_THREADS=1 ", env, " ", launcher, "'", MOEFOLD_BINARY,
                        "' ", rest, " >'", outf.string(), "' 2>'", errf.string(), "' </dev/null");
  int status = std::system(cmd.c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::stringstream so, se;
  so << std::ifstream(outf).rdbuf();
  se << std::ifstream(errf).rdbuf();
  r.out = so.str();
  r.err = se.str();
  std::error_code ec;
  fs::remove(outf, ec);
  fs::remove(errf, ec);
  return r;
}

// The binary on `np` ranks under mpiexec (as CI runs it: as root, oversubscribed).
inline Result run_mpi(int np, const std::string& args, const fs::path& cwd, const std::string& env = "") {
  return run(cat("-- ", args), cwd, np, env);
}

// Exit code 1 and a single stderr line "moefold: error: ..." containing every `needle`.
inline void expect_one_line_error(const Result& r, std::initializer_list<std::string> needles) {
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_TRUE(r.err.starts_with("moefold: error: ")) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  for (const auto& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << "missing '" << n << "' in: " << r.err;
}

inline std::string write(const fs::path& p, const std::string& text) {
  std::ofstream(p) << text;
  return p.string();
}

inline const char* kSmall =
    "--set model.hidden_size=16 --set model.num_hidden_layers=1 --set model.num_attention_heads=2 "
    "--set model.num_key_value_heads=1 --set model.head_dim=8 --set moe.num_experts=4 "
    "--set moe.moe_intermediate_size=8 --set train.seq_len=16 --set train.micro_batch_size=2 "
    "--set train.global_batch_size=2 --set train.eval_batches=1 --quiet";

}  // namespace moefold
