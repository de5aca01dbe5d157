// What the subcommands share (commands.h): --config/--set, the --device choice and the world of
// ranks a multi-rank command runs in.
#include "moefold/cli/commands.h"

#include "moefold/comm/mpi.h"
#include "moefold/comm/nccl.h"
#include "moefold/core/error.h"

namespace moefold::cli {

void add_config_options(CLI::App* cmd, ConfigOptions& o) {
  cmd->add_option("--config", o.spec, "preset name (tiny, qwen3-30b-a3b, qwen3-235b-a22b) or TOML file");
  cmd->add_option("--set", o.overrides, "override a config key: section.key=value (repeatable)");
}

Device pick_device(const std::string& name) {
  std::string n = name;
  if (n == "auto") n = cuda_built() && cuda_device_count() > 0 ? "cuda" : "cpu";
  if (n == "cpu") return Device::cpu;
  if (!cuda_built()) MF_FAIL("--device cuda: this moefold was built without CUDA (no nvcc at build time)");
  if (cuda_device_count() == 0) MF_FAIL("--device cuda: no GPU is visible to this process");
  return Device::cuda;
}

Communicator& make_world(Device device, double timeout_s, World& w) {
  if (launched_by_mpi()) {
    w.bootstrap = make_mpi_world(timeout_s);
    if (device == Device::cuda) w.world = make_nccl_world(w.bootstrap.get(), timeout_s);
  } else if (launched_by_torchrun()) {
    if (device != Device::cuda)
      MF_FAIL("launched by torchrun (RANK/WORLD_SIZE set): CPU ranks need mpirun; use --device cuda on GPUs");
    w.world = make_nccl_world(nullptr, timeout_s);
  }
  if (!w.world) w.world = w.bootstrap ? std::move(w.bootstrap) : make_self_communicator();
  if (device == Device::cuda && w.world->size() == 1) cuda_set_device(local_rank_from_env() % cuda_device_count());
  return *w.world;
}

}  // namespace moefold::cli
