// Pipeline schedules: the order in which one pipeline rank runs the forwards and backwards of a
// step's micro-batches over its model chunks (train/trainer.h runs them).
//
// 1F1B (vpp = 1; Megatron-Core's non-interleaved schedule): stage s runs min(pp - s - 1, m)
// warm-up forwards, then one forward and one backward in turn, then the remaining backwards.
//
// Interleaved 1F1B (vpp > 1 virtual stages per rank; Megatron-Core's interleaved schedule): rank s
// holds chunks c = 0..vpp-1, chunk c being virtual stage c * pp + s. The m * vpp forwards go in
// groups of pp micro-batches through chunk 0, then chunk 1, ...: forward k runs chunk
// (k / pp) % vpp on micro-batch (k / (pp * vpp)) * pp + k % pp; backward k the same micro-batch
// on chunk vpp - 1 - (k / pp) % vpp. Warm-up: (pp - s - 1) * 2 + (vpp - 1) * pp forwards (all of
// them when m == pp), then one forward and one backward in turn. REQUIRES m % pp == 0.
//
// With overlap (parallel.overlap_moe_a2a; 1F1B only) each stage warms up with one forward more,
// min(pp - s, m), so that each steady forward k + w has a backward k of another micro-batch to run
// interleaved with (pipeline_ops pairs them); pp = 1 then keeps two micro-batches in flight.
//
// Both keep the order in which a stage sends to a neighbour equal to the order in which the
// neighbour consumes (forward k of chunk c on stage s feeds forward k of chunk c on stage s + 1, or
// forward k + pp of chunk c + 1 on stage 0 from the last stage; backwards the other way), so each
// direction of each link can be one in-order channel.
#pragma once

#include <cstdint>
#include <vector>

namespace moefold {

struct PipelineAction {
  bool forward = true;
  int64_t chunk = 0;    // the rank's model chunk (0 without interleaving)
  int64_t micro = 0;    // the step's local micro-batch
  bool steady = false;  // of the steady phase (one forward, then one backward)
};

// Rank `stage`'s actions for one step of `micro` micro-batches: every (chunk, micro-batch) once
// forward, once backward, the forward first.
std::vector<PipelineAction> pipeline_actions(int64_t pp, int64_t vpp, int64_t stage, int64_t micro,
                                             bool overlap = false);

// Per chunk, the most micro-batches whose forward ran and backward did not yet (the activations a
// chunk keeps at once: one model per micro-batch in flight).
std::vector<int64_t> micro_batches_in_flight(const std::vector<PipelineAction>& actions, int64_t vpp);

// What a rank does, step by step, to run its actions with non-blocking messages: micro-batch j of
// chunk c runs on the chunk's model j mod (its micro-batches in flight); activations come in to a
// model's input and go out from its output, gradients come in to and go out from its stream
// gradient (Model::input, output, stream_grad). Receives are posted in the order of the actions,
// one action ahead where the buffer is free (it is not while the model's last micro-batch still
// needs it); a buffer being sent is waited for before it is written again. Virtual stage c * pp + s
// receives activations unless it is the first and gradients unless it is the last.
enum class PipelineOpKind : uint8_t {
  post_recv_activations,
  post_recv_grads,
  wait_recv_activations,
  wait_recv_grads,
  wait_send_activations,
  wait_send_grads,
  forward,
  backward,
  forward_backward,  // the forward of (chunk, micro, model) interleaved with the backward of (micro2, model2)
  send_activations,
  send_grads,
};
struct PipelineOp {
  PipelineOpKind kind;
  int64_t chunk = 0, micro = 0, model = 0;  // model: the chunk's model (0 .. in flight - 1)
  int64_t micro2 = -1, model2 = -1;         // forward_backward: the backward's
};
// overlap: each steady forward with the backward after it as one forward_backward, their receives
// waited for before it, their sends started after it.
std::vector<PipelineOp> pipeline_ops(int64_t pp, int64_t vpp, int64_t stage, int64_t micro, bool overlap = false);

}  // namespace moefold
