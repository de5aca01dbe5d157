// CudaGraph (cuda_graph.h): stream capture, instantiation and launch.
#include "moefold/core/cuda_graph.h"

#include <utility>

#include "moefold/core/error.h"

#ifdef MOEFOLD_WITH_CUDA
#include <cuda_runtime.h>

#include "moefold/core/cuda_check.h"
#endif

namespace moefold {

CudaGraph::CudaGraph(CudaGraph&& o) noexcept : exec_(std::exchange(o.exec_, nullptr)) {}

CudaGraph& CudaGraph::operator=(CudaGraph&& o) noexcept {
  std::swap(exec_, o.exec_);
  return *this;
}

#ifdef MOEFOLD_WITH_CUDA

CudaGraph::~CudaGraph() {
  if (exec_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
}

bool CudaGraph::capture(const ExecContext& ctx, WorkRef work, std::string* why) {
  MF_CHECK(ctx.device() == Device::cuda && ctx.stream() != nullptr, "CudaGraph::capture: not a GPU stream");
  auto* stream = static_cast<cudaStream_t>(ctx.stream());
  auto fail = [&](const std::string& reason) {
    if (why) *why = reason;
    cudaGetLastError();  // a failed capture leaves its error behind: not the next call's
    return false;
  };
  cudaError_t err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  if (err != cudaSuccess) return fail(std::string("cudaStreamBeginCapture: ") + cudaGetErrorString(err));
  std::string thrown;
  try {
    work();
  } catch (const std::exception& e) {
    thrown = e.what();
  }
  cudaGraph_t graph = nullptr;
  err = cudaStreamEndCapture(stream, &graph);
  if (!thrown.empty()) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    return fail(thrown);
  }
  if (err != cudaSuccess || graph == nullptr)
    return fail(std::string("the captured work used a call a graph cannot hold (") + cudaGetErrorString(err) + ")");
  cudaGraphExec_t exec = nullptr;
  err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (err != cudaSuccess) return fail(std::string("cudaGraphInstantiate: ") + cudaGetErrorString(err));
  if (exec_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  exec_ = exec;
  return true;
}

void CudaGraph::launch(const ExecContext& ctx) const {
  MF_CHECK(exec_ != nullptr, "CudaGraph::launch: nothing captured");
  MF_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(ctx.stream())));
}

#else

CudaGraph::~CudaGraph() = default;

bool CudaGraph::capture(const ExecContext&, WorkRef, std::string* why) {
  if (why) *why = "built without CUDA";
  return false;
}

void CudaGraph::launch(const ExecContext&) const { MF_FAIL("CudaGraph::launch: built without CUDA"); }

#endif

}  // namespace moefold
