#include "moefold/train/grad_reduce.h"

#include <algorithm>
#include <cctype>
#include <utility>

#include "moefold/core/error.h"

namespace moefold {

int64_t grad_ready_point(const std::string& param_name, int64_t num_layers) {
  const auto starts = [&](const char* prefix) { return param_name.rfind(prefix, 0) == 0; };
  if (starts("model.norm.") || starts("lm_head.")) return num_layers;
  static const std::string layers = "model.layers.";
  if (!starts(layers.c_str())) return -1;
  size_t i = layers.size();
  int64_t n = 0;
  const size_t first = i;
  while (i < param_name.size() && std::isdigit(static_cast<unsigned char>(param_name[i])))
    n = n * 10 + (param_name[i++] - '0');
  if (i == first || i >= param_name.size() || param_name[i] != '.') return -1;
  return std::min(n, num_layers);  // the multi-token-prediction modules: num_layers + depth - 1
}

GradReducer::GradReducer(const Memory& mem, int64_t num_layers, const std::vector<Group>& groups) {
  for (const Group& g : groups) {
    if (g.comm == nullptr || g.comm->size() == 1) continue;
    Plan plan{g.group, g.comm, mem.grad_block(g.group), {}};
    const int64_t n = plan.block.defined() ? plan.block.numel() : 0;
    if (n == 0) continue;
    if (mem.sharded()) {  // Memory's buckets, padded to the shard count
      for (const GradBucket& b : mem.grad_buckets(g.group))
        plan.buckets.push_back({b.key, b.begin, b.end, !b.full_master});
      plans_.push_back(std::move(plan));
      continue;
    }
    const int64_t esize = static_cast<int64_t>(dtype_size(plan.block.dtype()));
    const char* base = static_cast<const char*>(plan.block.data());
    std::vector<Bucket> params;  // one per parameter: its ready point and elements
    for (const Param& p : mem.params()) {
      if (p.group != g.group || p.grad.numel() == 0) continue;
      const int64_t begin = (static_cast<const char*>(p.grad.data()) - base) / esize, end = begin + p.grad.numel();
      MF_CHECK(begin >= 0 && end <= n, "GradReducer: the gradient of ", p.name, " lies outside its group's block");
      params.push_back({grad_ready_point(p.name, num_layers), begin, end});
    }
    // Runs of parameters with one ready point, in block order; the padding between two parameters
    // (zero) goes with the run before it, the block's head and tail with the first and last run.
    std::sort(params.begin(), params.end(), [](const Bucket& a, const Bucket& b) { return a.begin < b.begin; });
    for (const Bucket& q : params) {
      if (!plan.buckets.empty() && plan.buckets.back().point == q.point) {
        plan.buckets.back().end = q.end;
        continue;
      }
      if (!plan.buckets.empty()) plan.buckets.back().end = q.begin;
      plan.buckets.push_back({q.point, plan.buckets.empty() ? 0 : q.begin, q.end});
    }
    if (plan.buckets.empty()) plan.buckets.push_back({-1, 0, n});
    plan.buckets.back().end = n;
    plans_.push_back(std::move(plan));
  }
}

void GradReducer::start(const Plan& p, const Bucket& b) {
  const Tensor part = p.block.slice(b.begin, b.end);
  const int64_t ticket =
      b.scatter ? p.comm->start_reduce_scatter(part, ReduceOp::sum) : p.comm->start_all_reduce(part, ReduceOp::sum);
  for (auto& [comm, t] : last_ticket_)
    if (comm == p.comm) {
      t = ticket;
      return;
    }
  last_ticket_.emplace_back(p.comm, ticket);
}

void GradReducer::ready(int64_t point) {
  for (const Plan& p : plans_)
    for (const Bucket& b : p.buckets)
      if (b.point == point) start(p, b);
}

void GradReducer::finish() {
  ready(-1);
  // Each communicator runs its buckets in order on its stream: waiting for its last one waits for all.
  for (const auto& [comm, ticket] : last_ticket_) comm->wait(ticket);
  last_ticket_.clear();
}

void GradReducer::reduce_all() {
  for (const Plan& p : plans_) {
    if (std::any_of(p.buckets.begin(), p.buckets.end(), [](const Bucket& b) { return b.scatter; })) {
      for (const Bucket& b : p.buckets) start(p, b);  // sharded: each bucket as its kind says
    } else {
      p.comm->all_reduce(p.block, ReduceOp::sum);
    }
  }
  for (const auto& [comm, ticket] : last_ticket_) comm->wait(ticket);
  last_ticket_.clear();
}

std::vector<GradReducer::Bucket> GradReducer::buckets(ParamGroup group) const {
  for (const Plan& p : plans_)
    if (p.group == group) return p.buckets;
  return {};
}

}  // namespace moefold
