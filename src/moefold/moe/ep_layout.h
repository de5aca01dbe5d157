// Where an expert-parallel dispatch puts every row (AllToAllDispatcher), computed from every rank's
// home counts alone: pure arithmetic, the same on every rank, so a sender knows where its rows
// land at the receiver and the receiver where each piece starts, without exchanging offsets.
// Shape letters: P EP ranks, L local experts per rank, E = P * L experts, C rounds (chunks per
// peer), S home rows of a rank (its tokens' assignments sorted by global expert).
//
// Home rows of rank r: expert-major over all E experts; its block for rank m's experts is
// home_block(r, m), cut into C parts (part j: home_part). Rows at rank m (handed to its experts):
// [its own block | round 0: the parts from ranks m + 1, m + 2, ... (mod P) | round 1 | ...];
// piece_row(m, s, j) is where rank s's part j starts there.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace moefold {

// Where a piece's rows come from: this rank (round -1: its home rows [home, home + rows)) or peer
// `peer` in round `round`.
struct EpPieceSource {
  int peer = 0;
  int64_t round = -1;
  int64_t home = 0;
};

// One piece of a rank's rows: rows [begin, end), expert-major over the L local experts.
struct EpLayoutPiece {
  EpPieceSource source;
  int64_t begin = 0, end = 0;
};

class EpLayout {
 public:
  // REQUIRES: ranks >= 1, local_experts >= 1, rounds >= 1 (used only when ranks > 1).
  EpLayout(int ranks, int64_t local_experts, int64_t rounds);

  // counts_PE: host i64 [P, E]: rank p's home rows for global expert e (padding included). The
  // layout reads it until the next call. REQUIRES: counts >= 0.
  void set_counts(const int64_t* counts_PE);

  // Rows rank `from` sends to rank `to`'s experts.
  int64_t sent(int from, int to) const;
  // Part j of n rows: [n j / C, n (j + 1) / C).
  std::pair<int64_t, int64_t> part(int64_t n, int64_t j) const;
  // Rank r's home rows for rank m's experts, all of them / part j of them.
  std::pair<int64_t, int64_t> home_block(int r, int m) const;
  std::pair<int64_t, int64_t> home_part(int r, int m, int64_t j) const;
  // The first row, at rank r, of the piece from rank s in round j (s != r).
  int64_t piece_row(int r, int s, int64_t j) const;
  // Rows rank r hands to its experts: sum over s of sent(s, r).
  int64_t rows_at(int r) const;

  // Rank `me`'s pieces in layout order: [own first half, own second half, all own rows (restarting
  // at row 0: the backward's own piece), then round 0's peers from me + 1 on, round 1, ...]; one
  // rank: its own rows as one piece. offsets_L1 (host i64 [pieces, L + 1], room for
  // max_pieces()) gets each piece's expert offsets relative to its begin (the local experts' counts
  // clipped to the piece's part of its block). Returns the rows laid out (rows_at(me)).
  int64_t lay_out(int me, std::vector<EpLayoutPiece>& pieces, int64_t* offsets_L1) const;
  // Pieces of lay_out: 3 + C (P - 1) with several ranks, 1 with one.
  int64_t max_pieces() const { return ranks_ > 1 ? 3 + rounds_ * (ranks_ - 1) : 1; }

 private:
  int ranks_;
  int64_t local_, rounds_;
  const int64_t* counts_PE_ = nullptr;
};

}  // namespace moefold
