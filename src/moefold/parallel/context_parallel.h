// Context parallelism (CP) for causal attention with causal load balancing: the sequence of S
// tokens is cut into 2c chunks of S/(2c); CP rank r holds chunks r and 2c-1-r, so every rank has
// the same amount of causal attention work. Attention all-gathers K and V over the CP group and
// runs the local queries against every key with explicit positions; its backward reduce-scatters
// dK and dV back to the ranks that own those tokens. Gradient rule: dq, dk, dv WRITTEN.
// Shape letters: B batch, S full sequence, L = S/c local tokens, Q/G query/kv heads, D head dim,
// c CP group size.
#pragma once

#include <cstdint>
#include <utility>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/ops/ops.h"

namespace moefold {

// The global positions of CP rank `cp_rank`'s L = S/c tokens, in local order: chunk cp_rank
// (front) then chunk 2c-1-cp_rank (back). REQUIRES: seq_len % (2 * cp_size) == 0.
void cp_positions(int64_t seq_len, int cp_size, int cp_rank, int32_t* positions_out);

// Local view of a [B, S, ...] tensor (any dtype, contiguous): local_BL[b, l] = full_BS[b, pos[l]]
// with this rank's positions. What the data loader does for tokens and (already shifted) targets.
void cp_shard_sequence(const Tensor& full_BS, int cp_size, int cp_rank, const Tensor& local_BL);
// The inverse, collective over `cp`: every rank gets the full [B, S, ...] tensor.
// scratch_cBL: c * local_BL.numel() elements of local_BL's dtype.
void cp_gather_sequence(Communicator& cp, const Tensor& local_BL, const Tensor& scratch_cBL, const Tensor& full_BS);

struct CpAttentionShape {
  int64_t batch = 0;         // B
  int64_t seq_len = 0;       // S, the full sequence (REQUIRES: S % (2c) == 0)
  int64_t num_q_heads = 0;   // Q
  int64_t num_kv_heads = 0;  // G (REQUIRES: Q % G == 0)
  int64_t head_dim = 0;      // D
};

// Attention of this rank's L queries against the whole sequence's keys, collective over `cp`.
// All workspace is bound through Memory (bind twice: measuring, then real); forward and backward
// allocate nothing. Nothing is saved between forward and backward beyond what the caller keeps
// (q, k, v, out, lse): backward gathers K and V again, so the workspace may be shared in time.
class ContextParallelAttention {
 public:
  // REQUIRES: `cp` outlives this object.
  ContextParallelAttention(Communicator& cp, const CpAttentionShape& shape);

  // Workspace: gathered K, V and their gradients [B, S, G, D], one exchange buffer
  // [c, B, L, G, D], positions, and 2*L*S attention scratch.
  void bind(Memory& mem);

  // q_BLQD, k_BLGD, v_BLGD: this rank's tokens (positions() order), rope already applied with
  // those positions. Writes out_BLQD and lse_BQL (saved for backward).
  void forward(const Tensor& q_BLQD, const Tensor& k_BLGD, const Tensor& v_BLGD, double scale, const Tensor& out_BLQD,
               const Tensor& lse_BQL);
  // Writes dq for the local queries and dk/dv for the local keys: the sum over every CP rank's
  // queries that attended them.
  void backward(const Tensor& q_BLQD, const Tensor& k_BLGD, const Tensor& v_BLGD, const Tensor& out_BLQD,
                const Tensor& lse_BQL, const Tensor& dout_BLQD, double scale, const Tensor& dq_BLQD,
                const Tensor& dk_BLGD, const Tensor& dv_BLGD);

  // This rank's L global positions (i32), valid after the real bind.
  const Tensor& positions() const { return q_pos_L_.dev; }
  int64_t local_len() const { return local_len_; }

 private:
  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  // K or V of every rank in key order [rank 0's L, rank 1's L, ...] into all_BSGD.
  void gather(const Tensor& local_BLGD, const Tensor& all_BSGD);
  // The sum over ranks of the rows of all_BSGD that this rank owns, into local_BLGD.
  void reduce_scatter(const Tensor& all_BSGD, const Tensor& local_BLGD);
  void check_local(const Tensor& t, int64_t heads, const char* what) const;
  // Rank r's [B, L*G*D] block of the exchange buffer and the matching block of all_BSGD.
  std::pair<MatrixView, MatrixView> blocks(const Tensor& all_BSGD, int r) const;

  Communicator& cp_;
  CpAttentionShape shape_;
  int cp_size_, cp_rank_;
  int64_t local_len_;
  Mirrored q_pos_L_, k_pos_S_;        // i32; key positions in gathered (rank-major) order
  Tensor k_all_BSGD_, v_all_BSGD_;    // gathered keys and values
  Tensor dk_all_BSGD_, dv_all_BSGD_;  // their gradients, before the reduce-scatter
  Tensor exchange_cBLGD_;             // all_gather receive / reduce_scatter send buffer
  Tensor work_2LS_;                   // attention scratch
};

}  // namespace moefold
