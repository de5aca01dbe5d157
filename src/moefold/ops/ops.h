// Every dense op of the model, forward and backward side by side (the CPU reference in ops/cpu/,
// the CUDA implementation in ops/cuda/). Every op takes the execution context it runs on first
// (core/exec.h: on a GPU its stream, scratch and library handles, and the run's kernel choices).
// Tensor-level entry points check shapes and dtypes, then dispatch on device (ops/dispatch.h:
// CUDA tensors to ops/cuda/) and dtype (f32, or f64 for gradient checks).
//
// Gradient rule for every backward below: gradients of activations (dx, dq, ...) are WRITTEN;
// gradients of parameters (dw, dtable) are ACCUMULATED (+=), so micro-batches add up.
// Shape letters: N rows (tokens), C channels, I/O linear in/out, V vocab, B batch, S sequence,
// Q query heads, G kv heads, D head dim, F expert FFN; Sq/Sk query/key sequence, P table positions.
#pragma once

#include <span>
#include <vector>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold {

// ---- elementwise helpers -------------------------------------------------------------------
// y += x. REQUIRES: same dtype and numel, contiguous.
void add_inplace(const ExecContext& ctx, const Tensor& y, const Tensor& x);
// y += a, then y += b (each sum rounded to the dtype): the bits of the two add_inplace, in one
// pass over y on a GPU. REQUIRES: as add_inplace, f32 or bf16 (or f64 on the CPU).
void add_two_inplace(const ExecContext& ctx, const Tensor& y, const Tensor& a, const Tensor& b);
// Sum of squares of all elements, accumulated in double.
double sum_squares(const ExecContext& ctx, const Tensor& x);
// out[i] = sum_squares(xs[i]) (the same bits), with one wait on a GPU for all of them; no heap
// allocation. REQUIRES: at most kMaxSumSquares tensors, on one device; out as many as xs.
constexpr size_t kMaxSumSquares = 8;
void sum_squares_each(const ExecContext& ctx, std::span<const Tensor> xs, std::span<double> out);
// x *= s.
void scale_inplace(const ExecContext& ctx, const Tensor& x, double s);

// dst = src converted to dst's dtype (f32, f64, bf16: round to nearest even). Same numel,
// contiguous, one device. Refreshes bf16 compute copies of master weights.
void cast(const ExecContext& ctx, const Tensor& src, const Tensor& dst);
// core's fill_normal for a contiguous float tensor on either device: element i gets
// mean + std * normal(seed, stream, first_index + i). The GPU draws the same Philox bits and runs
// the same double-precision Box-Muller (CUDA's log/cos may differ from the host's in the last bit
// of a double, so rarely in the last bit of an f32). Initialises GPU parameters in place.
void fill_normal_any(const ExecContext& ctx, const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std,
                     uint64_t first_index);

// ---- AdamW (decoupled weight decay), one parameter tensor ----------------------------------------
// m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// w = w (1 - lr wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), bc = 1 - beta^t.
// w, g, m, v: the same shape; w and g one dtype (f32 on the GPU: fp32 master weights); m and v
// each w's dtype or, beside f32 weights, bf16 (train.exp_avg_dtype / exp_avg_sq_dtype: read to
// f32, updated, stored rounded to nearest even; the weight's update uses the unrounded values).
// w_compute (optional, GPU): also written with the updated weight in its own dtype (bf16), so the
// compute copy costs no extra pass.
class HostThreads;  // core/host_threads.h
struct AdamWStep {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  double bias_correction1 = 1, bias_correction2 = 1;
  double grad_scale = 1;  // the update uses g * grad_scale (global-norm clipping fused into the pass)
};
void adamw_update(const ExecContext& ctx, const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                  const AdamWStep& s, const Tensor& w_compute = Tensor());
// Many tensors' AdamW updates as one operation (one kernel launch on a GPU, where a model's dozens
// of small parameters would otherwise cost a launch each): the same bits as one adamw_update per
// entry. Entries with `decay` take AdamWStep::weight_decay, the others 0. Every entry on one
// device, with one dtype for all gradients, one for all first and one for all second moments, and
// a compute copy in all entries (of one dtype) or in none. The addresses are kept (on a GPU in a
// table on the device, made once): the tensors must stay where they are.
struct AdamWEntry {
  Tensor w, g, m, v, compute;
  bool decay = true;
};
class AdamWBatch {
 public:
  AdamWBatch() = default;
  AdamWBatch(const AdamWBatch&) = delete;
  AdamWBatch& operator=(const AdamWBatch&) = delete;
  AdamWBatch(AdamWBatch&& o) noexcept;
  AdamWBatch& operator=(AdamWBatch&& o) noexcept;
  ~AdamWBatch();
  explicit AdamWBatch(std::vector<AdamWEntry> entries);
  void update(const ExecContext& ctx, const AdamWStep& s) const;
  size_t size() const { return entries_.size(); }

 private:
  std::vector<AdamWEntry> entries_;
  void* table_ = nullptr;  // GPU: the entries' descriptors (device memory)
  int64_t blocks_ = 0;     // GPU: blocks of one launch
};
// The same update on host tensors with the GPU kernel's arithmetic, bit for bit (f32, every
// operation rounded on its own): w f32; g, m, v f32 or bf16; w_compute (optional) bf16. Spread
// over `threads` (null: the calling thread) in blocks of 64 Ki elements (optimizer offload).
void adamw_update_host(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWStep& s,
                       const Tensor& w_compute, HostThreads* threads);

// ---- embedding: out_NC[n] = table_VC[ids_N[n]] ---------------------------------------------
// ids are i32; REQUIRES: 0 <= id < V (the data loader validates token ids).
void embedding_forward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& table_VC, const Tensor& out_NC);
void embedding_backward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& dout_NC, const Tensor& dtable_VC);

// ---- RMSNorm (Qwen3/Llama form): y = w * x / sqrt(mean(x^2) + eps) over the last dim ---------
// rstd_N saves 1/sqrt(mean(x^2)+eps) for backward.
void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, double eps, const Tensor& y_NC,
                     const Tensor& rstd_N);
void rmsnorm_backward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                      const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C);
// The residual stream's fused forms (one kernel each on a GPU, where each composed form is three
// or four operations), bit for bit their compositions:
// h_NC = x_NC + a_NC (rounded to the dtype), then rmsnorm_forward(h_NC) into y_NC / rstd_N, and a
// second copy of h into h2_NC when it is defined: copy, add_inplace, rmsnorm_forward, copy.
void add_rmsnorm_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& a_NC, const Tensor& w_C, double eps,
                         const Tensor& h_NC, const Tensor& y_NC, const Tensor& rstd_N, const Tensor& h2_NC = {});
// rmsnorm_backward whose input gradient is ADDED to dx_NC (the residual stream's gradient; the
// gradient rounded to the dtype, then added): rmsnorm_backward into a temporary, add_inplace.
void rmsnorm_backward_add(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                          const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C);

// ---- linear without bias: y_NO = x_NI @ w_OI^T (PyTorch/HF weight layout) ------------------
// dx may be undefined (Tensor{}) to skip the input gradient.
void linear_forward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& y_NO);
void linear_backward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& dy_NO,
                     const Tensor& dx_NI, const Tensor& dw_OI);

// ---- matmul on matrix views: c = alpha * op(a) @ op(b) + beta * c -------------------------------
// A row-major rows x cols matrix inside a tensor's memory: element (i, j) is element
// offset + i * ld + j of `storage` (contiguous, any shape); dtype and device come from storage.
// It names a whole 2-D tensor, a block of columns of a wider one (the gate and up halves of a
// fused gu_N2F: ld = 2F), or one expert's weight inside w_EOI (offset e*O*I).
// REQUIRES: rows, cols >= 0, ld >= max(1, cols), offset >= 0, the last element inside storage.
struct MatrixView {
  Tensor storage;      // the memory (contiguous)
  int64_t rows = 0;    // rows of the stored (untransposed) matrix
  int64_t cols = 0;    // columns of the stored matrix
  int64_t ld = 0;      // elements between the starts of consecutive rows (>= cols)
  int64_t offset = 0;  // elements before element (0, 0)
};
// The whole of a contiguous 2-D tensor t_RC.
MatrixView as_matrix(const Tensor& t_RC);
// Columns [begin, end) of a contiguous 2-D tensor t_RC (ld = C, offset = begin).
MatrixView column_block(const Tensor& t_RC, int64_t begin, int64_t end);
// op(x) = x^T when trans_x, else x. op(a) is M x K, op(b) K x N, c M x N. beta == 0 never reads c
// (NaN in c does not propagate); K == 0 gives c = beta * c. Elements of c's storage outside the
// view are untouched. REQUIRES: c overlaps neither a nor b; all views on one device.
// Dtypes: CPU: a, b, c all f32 or all f64. CUDA (cuBLASLt, f32 accumulation): a and b both bf16
// with c bf16 or f32 (bf16 operands into an f32 result: parameter gradients, router logits), or
// all f32 (full fp32, no TF32).
// dst = src, element (i, j) of two views of equal rows x cols and one dtype (any: a byte copy per
// row; the GPU does it with one 2-D memcpy). REQUIRES: one device; the views do not overlap.
void copy_matrix(const ExecContext& ctx, const MatrixView& src, const MatrixView& dst);
// dst += src (float dtypes, equal; accumulation in the dtype, f32 for bf16 on the GPU).
void add_matrix(const ExecContext& ctx, const MatrixView& src, const MatrixView& dst);
// Every element of the view = value (float dtypes, i32, i64).
void fill_matrix(const ExecContext& ctx, const MatrixView& dst, double value);
void matmul(const ExecContext& ctx, const MatrixView& a, bool trans_a, const MatrixView& b, bool trans_b,
            const MatrixView& c, double alpha, double beta);

// ---- rotary position embedding (HF "rotate_half" form, non-interleaved) --------------------
// Table for positions 0..S-1: inv_freq_j = theta^(-2j/D), angle = s * inv_freq_j;
// cos_SD/sin_SD hold each angle twice ([j] and [j + D/2]), as HF builds them.
void rope_table(double theta, const Tensor& cos_SD, const Tensor& sin_SD);
// The same with given inverse frequencies (D/2 of them; YaRN computes its own) and every cos/sin
// multiplied by attention_factor (YaRN's "mscale" of the table).
void rope_table(const std::vector<double>& inv_freq, double attention_factor, const Tensor& cos_SD,
                const Tensor& sin_SD);
// x_BSHD (H heads) rotated in place: x = x*cos + rotate_half(x)*sin at position s.
// interleaved: the rotated pairs are (x[2j], x[2j+1]) (DeepSeek's checkpoints) instead of
// (x[j], x[j + D/2]); applied to q and k alike it gives the same q.k as HF's de-interleaving.
void rope_forward(const ExecContext& ctx, const Tensor& x_BSHD, const Tensor& cos_SD, const Tensor& sin_SD,
                  bool interleaved = false);
// The transpose: d = d*cos - ... ; in place on the gradient.
void rope_backward(const ExecContext& ctx, const Tensor& dx_BSHD, const Tensor& cos_SD, const Tensor& sin_SD,
                   bool interleaved = false);
// Explicit positions (context parallelism: a rank's tokens are not 0..S-1): token s of x is at
// global position positions_S[s] (i32) and reads row positions_S[s] of a table built for P
// positions. REQUIRES: 0 <= positions_S[s] < P. Same in-place and WRITTEN rules as above.
void rope_forward_at(const ExecContext& ctx, const Tensor& x_BSHD, const Tensor& positions_S, const Tensor& cos_PD,
                     const Tensor& sin_PD, bool interleaved = false);
void rope_backward_at(const ExecContext& ctx, const Tensor& dx_BSHD, const Tensor& positions_S, const Tensor& cos_PD,
                      const Tensor& sin_PD, bool interleaved = false);

// ---- causal grouped-query attention ---------------------------------------------------------
// q_BSQD, k_BSGD, v_BSGD with Q % G == 0 (query head h reads kv head h / (Q/G));
// out_BSQD = softmax(q k^T * scale + causal mask) v; lse_BQS saves each row's log-sum-exp.
// work_SS: scratch of at least S*S elements (two such for backward: work_2SS holds 2*S*S).
void attention_forward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                       double scale, const Tensor& out_BSQD, const Tensor& lse_BQS, const Tensor& work_SS);
void attention_backward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                        const Tensor& out_BSQD, const Tensor& lse_BQS, const Tensor& dout_BSQD, double scale,
                        const Tensor& dq_BSQD, const Tensor& dk_BSGD, const Tensor& dv_BSGD, const Tensor& work_2SS);
// Explicit positions: Sq queries at global positions q_pos_Sq, Sk keys at k_pos_Sk (both i32, any
// order); query i attends key j iff k_pos[j] <= q_pos[i]. The plain ops above are these with
// positions 0..S-1 (bit-identical). work_SqSk holds Sq*Sk elements (work_2SqSk: 2*Sq*Sk).
// REQUIRES: every query sees at least one key (true for any causal chunking that includes each
// query's own position among the keys). dq, dk, dv WRITTEN.
void attention_forward_at(const ExecContext& ctx, const Tensor& q_BSqQD, const Tensor& k_BSkGD, const Tensor& v_BSkGD,
                          const Tensor& q_pos_Sq, const Tensor& k_pos_Sk, double scale, const Tensor& out_BSqQD,
                          const Tensor& lse_BQSq, const Tensor& work_SqSk);
void attention_backward_at(const ExecContext& ctx, const Tensor& q_BSqQD, const Tensor& k_BSkGD, const Tensor& v_BSkGD,
                           const Tensor& q_pos_Sq, const Tensor& k_pos_Sk, const Tensor& out_BSqQD,
                           const Tensor& lse_BQSq, const Tensor& dout_BSqQD, double scale, const Tensor& dq_BSqQD,
                           const Tensor& dk_BSkGD, const Tensor& dv_BSkGD, const Tensor& work_2SqSk);

// ---- SwiGLU: h_NF = silu(g) * u on a fused gate|up input gu_N2F ------------------------------
// How gate and up share gu's 2F columns: halves: g_j = gu[:, j], u_j = gu[:, F + j] (the dense
// MLP); pairs: g_j = gu[:, 2j], u_j = gu[:, 2j + 1] (the routed experts, whose gate_up weight
// rows interleave the same way, so one thread of a GEMM epilogue holds both; see experts.h).
// dgu has gu's layout.
enum class GateUp : uint8_t { halves, pairs };
// Where unit j of a gu row keeps its inputs: g at column step * j, u at step * j + up (halves:
// step 1, up F; pairs: step 2, up 1). For the CPU and CUDA kernels alike.
struct GateUpColumns {
  int64_t step, up;
};
inline GateUpColumns gate_up_columns(GateUp layout, int64_t f) {
  return layout == GateUp::pairs ? GateUpColumns{2, 1} : GateUpColumns{1, f};
}
void swiglu_forward(const ExecContext& ctx, const Tensor& gu_N2F, const Tensor& h_NF, GateUp layout = GateUp::halves);
void swiglu_backward(const ExecContext& ctx, const Tensor& gu_N2F, const Tensor& dh_NF, const Tensor& dgu_N2F,
                     GateUp layout = GateUp::halves);

// ---- softmax cross-entropy over the vocabulary ------------------------------------------------
// Returns the SUM over rows of -log softmax(logits)[target] (double); lse_N saved for backward.
// Targets are i32 in [0, V), or kIgnoreTarget: no loss and a zero gradient row (positions
// without a target, e.g. the last k of multi-token prediction at depth k).
// With loss_1 (f64 [1] on the logits' device) the sum is written there instead, nothing waits for
// the device, and NaN is returned.
inline constexpr int32_t kIgnoreTarget = -1;
double cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N,
                             const Tensor& lse_N, const Tensor& loss_1 = Tensor());
// Multi-token prediction's loss of one forward from its depths' token-loss sums (f64 [D], depth k
// at k - 1, on the device that keeps them): out_1 += (sum_k losses_D[k-1] * S / (S - k)) *
// scaling / D, in double, in that order, each operation rounded (Model::mtp_loss's arithmetic).
void mtp_loss_accumulate(const ExecContext& ctx, const Tensor& losses_D, int64_t seq_len, double scaling,
                         const Tensor& out_1);
// dlogits = grad_scale * (softmax(logits) - onehot(target)); grad_scale is d(loss)/d(row loss),
// e.g. 1 / (tokens in the global batch). dlogits may be logits itself (in place: elementwise).
void cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N,
                            const Tensor& lse_N, double grad_scale, const Tensor& dlogits_NV);

}  // namespace moefold
