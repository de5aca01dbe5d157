// EpLayout (ep_layout.h): the rows of an expert-parallel dispatch from the home counts.
#include "moefold/moe/ep_layout.h"

#include <algorithm>

#include "moefold/core/error.h"

namespace moefold {

EpLayout::EpLayout(int ranks, int64_t local_experts, int64_t rounds)
    : ranks_(ranks), local_(local_experts), rounds_(rounds) {
  MF_CHECK(ranks >= 1 && local_experts >= 1 && rounds >= 1, "EpLayout: ", ranks, " ranks, ", local_experts,
           " local experts, ", rounds, " rounds");
}

void EpLayout::set_counts(const int64_t* counts_PE) { counts_PE_ = counts_PE; }

int64_t EpLayout::sent(int from, int to) const {
  MF_CHECK(counts_PE_ != nullptr, "EpLayout: no counts");
  const int64_t* c = counts_PE_ + from * ranks_ * local_ + to * local_;
  int64_t n = 0;
  for (int64_t l = 0; l < local_; ++l) n += c[l];
  return n;
}

std::pair<int64_t, int64_t> EpLayout::part(int64_t n, int64_t j) const {
  return {n * j / rounds_, n * (j + 1) / rounds_};
}

std::pair<int64_t, int64_t> EpLayout::home_block(int r, int m) const {
  const int64_t* c = counts_PE_ + r * ranks_ * local_;
  int64_t h0 = 0;
  for (int64_t e = 0; e < m * local_; ++e) h0 += c[e];
  return {h0, h0 + sent(r, m)};
}

std::pair<int64_t, int64_t> EpLayout::home_part(int r, int m, int64_t j) const {
  const int64_t h0 = home_block(r, m).first;
  const auto [a, b] = part(sent(r, m), j);
  return {h0 + a, h0 + b};
}

int64_t EpLayout::piece_row(int r, int s, int64_t j) const {
  int64_t row = sent(r, r);  // the own rows come first
  for (int64_t j2 = 0; j2 <= j; ++j2)
    for (int k = 1; k < ranks_; ++k) {
      const int s2 = (r + k) % ranks_;
      if (j2 == j && s2 == s) return row;
      const auto [a, b] = part(sent(s2, r), j2);
      row += b - a;
    }
  MF_CHECK(false, "piece_row: no piece from rank ", s, " in round ", j, " at rank ", r);
  return row;
}

int64_t EpLayout::rows_at(int r) const {
  int64_t n = 0;
  for (int s = 0; s < ranks_; ++s) n += sent(s, r);
  return n;
}

int64_t EpLayout::lay_out(int me, std::vector<EpLayoutPiece>& pieces, int64_t* offsets_L1) const {
  const int64_t e_n = ranks_ * local_, c_n = ranks_ > 1 ? rounds_ : 0;
  pieces.clear();
  int64_t row = 0;
  // A piece is part [a, b) of a block of rows that is expert-major with counts_L; its offsets are
  // the counts clipped to the part.
  const auto add = [&](const EpPieceSource& src, const int64_t* counts_L, int64_t a, int64_t b) {
    int64_t* o = offsets_L1 + static_cast<int64_t>(pieces.size()) * (local_ + 1);
    o[0] = 0;
    for (int64_t l = 0, start = 0; l < local_; start += counts_L[l], ++l)
      o[l + 1] = o[l] + std::max<int64_t>(0, std::min(start + counts_L[l], b) - std::max(start, a));
    MF_CHECK(o[local_] == b - a, "EpLayout: piece offsets sum to ", o[local_], ", the piece has ", b - a, " rows");
    pieces.push_back(EpLayoutPiece{src, row, row + (b - a)});
    row += b - a;
  };
  const auto [hs0, hs1] = home_block(me, me);
  const int64_t n_self = hs1 - hs0;
  const int64_t* own_counts = counts_PE_ + me * e_n + me * local_;
  // One rank: the own rows in one piece (exactly LocalDispatcher's GEMMs); else in two halves.
  const int64_t self_cut = ranks_ > 1 ? n_self / 2 : n_self;
  add(EpPieceSource{me, -1, hs0}, own_counts, 0, self_cut);
  if (ranks_ > 1) {
    add(EpPieceSource{me, -1, hs0 + self_cut}, own_counts, self_cut, n_self);
    row = 0;  // all own rows again (the backward's own piece)
    add(EpPieceSource{me, -1, hs0}, own_counts, 0, n_self);
  }
  for (int64_t j = 0; j < c_n; ++j)
    for (int k = 1; k < ranks_; ++k) {
      const int q = (me + k) % ranks_;
      const int64_t n = sent(q, me);
      MF_CHECK(row == piece_row(me, q, j), "EpLayout: piece from rank ", q, " in round ", j, " at row ", row,
               ", the peers place it at ", piece_row(me, q, j));
      const auto [a, b] = part(n, j);
      add(EpPieceSource{q, j, 0}, counts_PE_ + q * e_n + me * local_, a, b);
    }
  return row;
}

}  // namespace moefold
