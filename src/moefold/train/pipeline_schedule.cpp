#include "moefold/train/pipeline_schedule.h"

#include <algorithm>

#include "moefold/core/error.h"

namespace moefold {

std::vector<PipelineAction> pipeline_actions(int64_t pp, int64_t vpp, int64_t stage, int64_t micro, bool overlap) {
  MF_CHECK(pp >= 1 && vpp >= 1 && stage >= 0 && stage < pp && micro >= 1, "pipeline schedule of stage ", stage, " of ",
           pp, ", ", vpp, " chunks, ", micro, " micro-batches");
  MF_CHECK(vpp == 1 || micro % pp == 0, "interleaved pipeline schedule: ", micro,
           " micro-batches are not a multiple of pp = ", pp);
  MF_CHECK(!overlap || vpp == 1, "pipeline schedule: overlap with interleaving");
  const int64_t total = micro * vpp;
  // Virtual micro-batch k: its chunk (forward order; backward mirrors it) and micro-batch.
  auto chunk = [&](int64_t k, bool forward) {
    const int64_t c = k / pp % vpp;
    return forward ? c : vpp - 1 - c;
  };
  auto micro_of = [&](int64_t k) { return vpp == 1 ? k : k / (pp * vpp) * pp + k % pp; };
  int64_t warmup = 0;
  if (vpp == 1)
    warmup = std::min(pp - stage - (overlap ? 0 : 1), micro);
  else
    warmup = micro == pp ? total : std::min((pp - stage - 1) * 2 + (vpp - 1) * pp, total);
  std::vector<PipelineAction> out;
  auto f = [&](int64_t k, bool steady) { out.push_back({true, chunk(k, true), micro_of(k), steady}); };
  auto b = [&](int64_t k, bool steady) { out.push_back({false, chunk(k, false), micro_of(k), steady}); };
  for (int64_t k = 0; k < warmup; ++k) f(k, false);
  for (int64_t k = 0; k < total - warmup; ++k) {
    f(k + warmup, true);
    b(k, true);
  }
  for (int64_t k = total - warmup; k < total; ++k) b(k, false);
  return out;
}

std::vector<int64_t> micro_batches_in_flight(const std::vector<PipelineAction>& actions, int64_t vpp) {
  std::vector<int64_t> now(static_cast<size_t>(vpp), 0), most(static_cast<size_t>(vpp), 0);
  for (const PipelineAction& a : actions) {
    int64_t& n = now[static_cast<size_t>(a.chunk)];
    n += a.forward ? 1 : -1;
    most[static_cast<size_t>(a.chunk)] = std::max(most[static_cast<size_t>(a.chunk)], n);
  }
  return most;
}

std::vector<PipelineOp> pipeline_ops(int64_t pp, int64_t vpp, int64_t stage, int64_t micro, bool overlap) {
  using K = PipelineOpKind;
  const std::vector<PipelineAction> acts = pipeline_actions(pp, vpp, stage, micro, overlap);
  const std::vector<int64_t> in_flight = micro_batches_in_flight(acts, vpp);
  const int64_t last = pp * vpp - 1;
  auto virtual_stage = [&](int64_t c) { return c * pp + stage; };
  auto needs_recv = [&](const PipelineAction& a) {
    return a.forward ? virtual_stage(a.chunk) > 0 : virtual_stage(a.chunk) < last;
  };
  // Per model (chunk, model): its input holds a micro-batch backward still needs; its sends pending.
  struct State {
    bool busy = false, sending_activations = false, sending_grads = false;
  };
  std::vector<std::vector<State>> state(static_cast<size_t>(vpp));
  for (int64_t c = 0; c < vpp; ++c) state[static_cast<size_t>(c)].resize(static_cast<size_t>(in_flight[c]));
  auto model_of = [&](const PipelineAction& a) { return a.micro % in_flight[static_cast<size_t>(a.chunk)]; };
  auto st = [&](const PipelineAction& a) -> State& {
    return state[static_cast<size_t>(a.chunk)][static_cast<size_t>(model_of(a))];
  };
  std::vector<PipelineOp> ops;
  auto op = [&](K kind, const PipelineAction& a) { ops.push_back({kind, a.chunk, a.micro, model_of(a)}); };
  size_t posted = 0;  // actions before this one have their receives posted (or need none)
  // Posts action i's receive; ahead: only where that needs no wait (else later, just in time).
  auto post = [&](size_t i, bool ahead) {
    if (posted != i) return posted > i;
    const PipelineAction& a = acts[i];
    if (needs_recv(a)) {
      State& s = st(a);
      if (a.forward) {
        if (s.busy) {
          MF_CHECK(ahead, "pipeline_ops: the input of chunk ", a.chunk, "'s model ", model_of(a), " is still in use");
          return false;
        }
        op(K::post_recv_activations, a);
      } else {
        if (s.sending_grads) {
          if (ahead) return false;
          op(K::wait_send_grads, a);
          s.sending_grads = false;
        }
        op(K::post_recv_grads, a);
      }
    }
    posted = i + 1;
    return true;
  };
  // Before an action's computation: its buffers free and its data here.
  auto before = [&](const PipelineAction& a) {
    State& s = st(a);
    if (a.forward) {
      if (s.sending_activations) op(K::wait_send_activations, a);  // the output is written again
      s.sending_activations = false;
      if (needs_recv(a)) op(K::wait_recv_activations, a);
      return;
    }
    if (needs_recv(a)) {
      op(K::wait_recv_grads, a);
    } else if (s.sending_grads) {  // the head writes the stream gradient itself
      op(K::wait_send_grads, a);
      s.sending_grads = false;
    }
    // A recomputed last layer writes the output again: its send is done (the next stage's
    // gradient for this micro-batch came after it used it).
    if (s.sending_activations) op(K::wait_send_activations, a);
    s.sending_activations = false;
  };
  // After it: its result on its way.
  auto after = [&](const PipelineAction& a) {
    State& s = st(a);
    s.busy = a.forward;
    if (a.forward && virtual_stage(a.chunk) < last) {
      op(K::send_activations, a);
      s.sending_activations = true;
    }
    if (!a.forward && virtual_stage(a.chunk) > 0) {
      op(K::send_grads, a);
      s.sending_grads = true;
    }
  };
  for (size_t i = 0; i < acts.size(); ++i) {
    const PipelineAction& a = acts[i];
    // A steady forward and the backward after it (another micro-batch, never the step's last: with
    // overlap every stage warms up with one forward or more). Only those: pairing a stage's last
    // warm-up forward with its first cool-down backward could wait on the next stage's same pair.
    const bool pair =
        overlap && a.forward && a.steady && i + 1 < acts.size() && !acts[i + 1].forward && acts[i + 1].steady;
    MF_CHECK(!pair || (acts[i + 1].micro != a.micro && acts[i + 1].micro + 1 < micro), "pipeline_ops: pair of ",
             a.micro, " and ", acts[i + 1].micro);
    post(i, false);
    if (pair) post(i + 1, false);
    const size_t next = pair ? i + 2 : i + 1;
    if (next < acts.size()) post(next, true);
    if (!pair) {
      before(a);
      op(a.forward ? K::forward : K::backward, a);
      after(a);
      continue;
    }
    const PipelineAction& b = acts[i + 1];
    before(a);
    before(b);
    ops.push_back({K::forward_backward, a.chunk, a.micro, model_of(a), b.micro, model_of(b)});
    after(a);
    after(b);
    ++i;
  }
  for (int64_t c = 0; c < vpp; ++c)  // every send done before the step ends
    for (int64_t k = 0; k < in_flight[static_cast<size_t>(c)]; ++k) {
      const State& s = state[static_cast<size_t>(c)][static_cast<size_t>(k)];
      if (s.sending_activations) ops.push_back({K::wait_send_activations, c, -1, k});
      if (s.sending_grads) ops.push_back({K::wait_send_grads, c, -1, k});
    }
  return ops;
}

}  // namespace moefold
