// The moefold command line's subcommands (cmd_*.cpp, one file each) and what they share: the
// --config/--set options, the --device choice and the world of ranks. main.cpp registers them in
// the order `moefold --help` lists them and runs the one given.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/core/device.h"
#include "moefold/model/config.h"

namespace moefold::cli {

// The processes this one talks to, made by the commands that run on several ranks. main keeps it
// past the command: its error line names the rank when there are several, and it is released
// before MPI is finalized.
struct World {
  std::unique_ptr<Communicator> bootstrap;  // MPI under mpirun, kept alive under an NCCL world
  std::unique_ptr<Communicator> world;
};

// A registered subcommand: its CLI11 app (true once parsed) and what runs when it was given.
// REQUIRES of run: the command line was parsed. User mistakes throw moefold::Error.
struct Command {
  CLI::App* app = nullptr;
  std::function<void(World&)> run;
};

// --config and --set of a command that reads a config.
struct ConfigOptions {
  std::string spec;                    // preset name or TOML file (empty: the tiny preset)
  std::vector<std::string> overrides;  // "section.key=value"
  Config load() const { return load_config(spec, overrides); }
};
void add_config_options(CLI::App* cmd, ConfigOptions& o);

// --device auto|cpu|cuda: auto is the GPU when one is visible. Throws Error when cuda cannot be had.
Device pick_device(const std::string& name);

// The world of this process: CPU ranks talk over MPI; GPU ranks over NCCL, bootstrapped by MPI
// under mpirun/srun (kept alive in w.bootstrap) or by the torchrun / Slurm environment (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT); one rank alone otherwise. Selects this rank's GPU.
Communicator& make_world(Device device, double timeout_s, World& w);

Command add_train(CLI::App& app);
Command add_info(CLI::App& app);
Command add_plan(CLI::App& app);
Command add_config(CLI::App& app);
Command add_eval(CLI::App& app);
Command add_convert(CLI::App& app);
Command add_prepare(CLI::App& app);
Command add_bench(CLI::App& app);
Command add_report(CLI::App& app);

}  // namespace moefold::cli
