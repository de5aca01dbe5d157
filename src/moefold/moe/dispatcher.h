// Token dispatchers (small strategy objects): dispatch() moves each token's k assignments to
// expert-contiguous rows and returns a DispatchPlan; combine() consumes that plan to bring the
// expert outputs back, weighted by the router's probabilities. Backends (local; all-to-all over
// EP ranks; all-gather over ETP ranks) implement the same calls, so MoeLayer knows nothing of
// parallelism.
// Gradient rule: every backward here WRITES its activation gradients (no parameters).
// Shape letters: T tokens, H hidden, K top-k, E (local) experts, R rows handed to the experts.
#pragma once

#include <cstdint>
#include <vector>

#include "moefold/core/memory.h"
#include "moefold/moe/moe_config.h"

namespace moefold {

// Rows [begin, end) of a plan's rows that the experts can run on their own: expert e's rows of the
// piece are [begin + offsets_E1[e], begin + offsets_E1[e+1]).
struct RowPiece {
  int64_t begin = 0, end = 0;
  Tensor offsets_E1;  // i64 [E+1], relative to begin, on the rows' device
};

struct DispatchPlan;

// How the experts run the pieces of a pipelined plan (expert parallelism: the all-to-all runs
// beside the experts), owned by the dispatcher that made the plan (DispatchPlan::schedule).
// dispatch() and combine_backward() may return before every piece's rows have arrived; whoever
// runs the experts (run_experts_forward / run_experts_backward, moe_layer.h) calls, for piece i of
// the plan: forward (pieces), rows_arrived(i) before reading its rows and outputs_done(i, out_RH)
// once its outputs are written; backward (backward_pieces), output_grads_arrived(i) before
// reading its dout rows and input_grads_done(i, drows_RH) once its drows are written. The
// dispatcher's combine() and dispatch_backward() REQUIRE every piece's outputs_done /
// input_grads_done.
class PieceSchedule {
 public:
  virtual ~PieceSchedule() = default;
  virtual void rows_arrived(size_t piece) = 0;
  virtual void outputs_done(size_t piece, const Tensor& out_RH) = 0;
  virtual void output_grads_arrived(size_t piece) = 0;
  virtual void input_grads_done(size_t piece, const Tensor& drows_RH) = 0;
  // Where the experts write piece i's outputs and input gradients and read its output gradients:
  // the piece's rows of the caller's tensor, unless the schedule keeps them where they are needed
  // next (AllToAllDispatcher: its own tokens' rows stay home).
  virtual Tensor output_rows(const DispatchPlan& plan, size_t piece, const Tensor& out_RH) const = 0;
  virtual Tensor output_grad_rows(const DispatchPlan& plan, size_t piece, const Tensor& dout_RH) const = 0;
  virtual Tensor input_grad_rows(const DispatchPlan& plan, size_t piece, const Tensor& drows_RH) const = 0;
};

// Who goes where, computed once in forward and reused by combine and by backward. Views are
// sized to the last dispatch (T tokens, R rows) and live in the dispatcher's bound buffers.
struct DispatchPlan {
  int64_t num_tokens = 0;  // T of the last dispatch
  int64_t num_rows = 0;    // R: rows handed to the local experts, padding included
  int64_t capacity = 0;    // rows kept per expert (0: dropless)
  Tensor counts_E;         // i64 [E]: rows per local expert (padding included)
  // i64 [E+1]: first row of each local expert, offsets_E1[E] = R, when the rows are expert-major
  // (LocalDispatcher, AllGatherDispatcher); undefined when they are not (AllToAllDispatcher: its
  // rows are grouped by source, and only its pieces describe them).
  Tensor offsets_E1;
  // The rows as pieces that tile [0, R), in the order the experts run them forward; one piece
  // when the dispatcher does not pipeline. backward_pieces tile them too, in the backward's order
  // (each piece after the first adds a pass over the expert weight gradients: fewer, larger ones).
  std::vector<RowPiece> pieces, backward_pieces;
  Tensor row_TK;        // i64 [T, K]: row of assignment (t, k); -1 when dropped by capacity
  Tensor token_R;       // i64 [R]: source token of each row; -1 for a padding row
  Tensor rows_RH;       // [R, H]: the dispatched rows (padding rows are zero)
  Tensor topk_prob_TK;  // the combine weights given to dispatch() (a view of the caller's)
  // The pipelining of the pieces (null: every piece's rows are here when dispatch() returns, and
  // its outputs and gradients are its rows of the caller's tensors).
  PieceSchedule* schedule = nullptr;
};

// Columns [first, first + size) of the expert FFN.
struct FfnSlice {
  int64_t first = 0, size = 0;
};

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;

  // Plans the dispatcher's buffers (plan, rows); called in both binding passes of a Memory.
  virtual void bind(Memory& mem) = 0;
  // Activation offload (expert_fc1): the rows the experts read (DispatchPlan::rows_RH) go to the
  // layer's offload slot (Memory::offloaded) where the dispatcher owns them in plain device
  // memory; peer-visible rows (expert parallelism over peer copies) stay. REQUIRES: before bind.
  void set_offload_rows(bool on) { offload_rows_ = on; }
  // moe.fp8_dispatch: dispatch() takes its tokens as packed FP8 rows (ops/fp8.h: u8
  // [T, fp8_packed_width(hidden)], fp8_quantize_packed's) and hands them to the experts so
  // (DispatchPlan::rows_RH), through every exchange; combine and the backwards keep the model's
  // dtype. REQUIRES: before bind.
  void set_fp8_rows(bool on) { fp8_rows_ = on; }
  bool fp8_rows() const { return fp8_rows_; }
  // Experts held here: the leading dimension of the expert weights fed by the rows.
  virtual int64_t num_local_experts() const = 0;
  // Global index of the first local expert (expert parallelism: this rank's block of experts).
  virtual int64_t first_local_expert() const { return 0; }
  // The columns of the expert FFN (F = ffn of the whole layer) the local experts hold: all of them,
  // unless the dispatcher splits F over expert-tensor-parallel ranks.
  virtual FfnSlice ffn_slice(int64_t ffn) const { return {0, ffn}; }
  // Most rows dispatch() can hand to the local experts (sizes the expert activations).
  virtual int64_t max_rows() const = 0;
  // Bytes this rank sent to other nodes since the last call (dispatchers that count them:
  // HierarchicalDispatcher), and the count starts again.
  virtual int64_t take_inter_node_bytes() { return 0; }
  // CUDA graphs: plan the rows without the host reading them back. With a capacity and no padding
  // a dispatcher that can (LocalDispatcher) then pads its last expert up to the bound
  // min(T*K, E*capacity) (moe_permute_plan without waiting): zero rows, the same results.
  virtual void set_rows_without_waiting(bool on) { (void)on; }
  // Rows a dispatch cannot place (SlotDispatcher: past its fixed slots) are left out and ADDED,
  // as a whole number, to overflow_1 (f64 [1] on the rows' device) without the host reading them;
  // the trainer fails the step when the sum is not 0. fill_1 (f64 [1], there too) is MAX-ed with
  // the largest share of a fixed buffer a dispatch asked for (rows over the bound: above 1 where
  // rows were left out). Dispatchers that cannot overflow, or that check on the host
  // (AllToAllDispatcher), ignore both. Undefined tensors: the dispatcher's own counters.
  virtual void set_overflow_sinks(const Tensor& overflow_1, const Tensor& fill_1) {
    (void)overflow_1;
    (void)fill_1;
  }

  // Routes x_TH to expert-contiguous rows. topk_idx_TK (i32) and topk_prob_TK come from the
  // router. REQUIRES: T <= max_tokens; topk_prob_TK stays unchanged until combine_backward (the
  // plan keeps a view). The plan is valid until the next dispatch().
  virtual const DispatchPlan& dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK) = 0;
  // y_TH[t] = sum_k prob_tk * out_RH[row(t, k)] (dropped assignments add 0); y written.
  virtual void combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) = 0;

  // dout_RH[row(t, k)] = prob_tk * dy_t (padding rows 0) and dprob_TK[t, k] = <dy_t, out_RH[row]>
  // (0 when dropped); both written.
  virtual void combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan,
                                const Tensor& dout_RH, const Tensor& dprob_TK) = 0;
  // dx_TH[t] = sum_k drows_RH[row(t, k)]; dx written.
  virtual void dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) = 0;

 protected:
  bool offload_rows_ = false;
  bool fp8_rows_ = false;
  // The rows dispatch() moves: their width and dtype for `hidden` in a memory of dtype `dtype`.
  int64_t row_width(int64_t hidden) const;
  DType row_dtype(DType dtype) const { return fp8_rows_ ? DType::u8 : dtype; }
};

// The memory of buf ([S, H] rows of any dtype) as `rows` rows [rows, width] of `dtype` (the
// dispatch leg's view of a buffer the other legs use in the model's dtype). REQUIRES: they fit.
Tensor rows_view(const Tensor& buf, int64_t rows, int64_t width, DType dtype);
// REQUIRES: rows is [R, width] of `dtype` (the rows a dispatcher was given or hands out).
void check_row_format(const Tensor& rows, int64_t width, DType dtype, const char* what);

// The plan's rows as one expert-major piece (dispatchers that do not pipeline).
void set_single_piece(DispatchPlan& plan);

// All experts on this process: the permutation is the whole dispatch.
class LocalDispatcher final : public Dispatcher {
 public:
  // REQUIRES: cfg.validate() passes.
  LocalDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens);

  void bind(Memory& mem) override;
  int64_t num_local_experts() const override { return cfg_.num_experts; }
  int64_t max_rows() const override { return cfg_.max_rows(max_tokens_); }

  const DispatchPlan& dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK) override;
  void combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) override;
  void combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan, const Tensor& dout_RH,
                        const Tensor& dprob_TK) override;
  void dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) override;
  void set_rows_without_waiting(bool on) override { without_waiting_ = on; }

 private:
  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  bool without_waiting_ = false;      // set_rows_without_waiting
  MoeConfig cfg_;
  int64_t hidden_;
  int64_t max_tokens_;
  // Buffers sized for max_tokens; plan_ holds views of their first T / R rows.
  Tensor counts_E_, offsets_E1_, row_TK_, token_R_, rows_RH_;
  DType rows_dtype_ = DType::f32;  // of x and the rows (row_dtype of the memory's)
  DispatchPlan plan_;
};

}  // namespace moefold
