// EpLayout (moe/ep_layout.h) without MPI: for random home counts of P ranks (zero-row experts and
// ranks included), every rank's pieces tile its rows, their expert offsets are the counts
// clipped to each part, and sender and receiver agree on every piece: rank s's part j of its
// block for rank m has the length and the place at m that m's layout gives the piece from s in
// round j (what lets peers copy straight into each other's rows).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "moefold/moe/ep_layout.h"
#include "testing.h"

namespace moefold {
namespace {

struct Case {
  int ranks;
  int64_t local, rounds;
};

std::vector<int64_t> random_counts(std::mt19937_64& rng, int ranks, int64_t local) {
  std::vector<int64_t> c(static_cast<size_t>(ranks * ranks * local));
  std::uniform_int_distribution<int64_t> n(0, 9);
  for (int64_t& x : c) x = n(rng) < 3 ? 0 : n(rng);  // a third of the experts get no rows
  return c;
}

void check_case(const Case& k, std::mt19937_64& rng) {
  SCOPED_TRACE(::testing::Message() << k.ranks << " ranks, " << k.local << " local experts, " << k.rounds << " rounds");
  const std::vector<int64_t> counts = random_counts(rng, k.ranks, k.local);
  EpLayout layout(k.ranks, k.local, k.rounds);
  layout.set_counts(counts.data());
  const int64_t e_n = k.ranks * k.local;
  std::vector<EpLayoutPiece> pieces;
  std::vector<int64_t> offsets(static_cast<size_t>(layout.max_pieces() * (k.local + 1)), -1);
  for (int me = 0; me < k.ranks; ++me) {
    SCOPED_TRACE(::testing::Message() << "rank " << me);
    const int64_t rows = layout.lay_out(me, pieces, offsets.data());
    EXPECT_EQ(rows, layout.rows_at(me));
    ASSERT_EQ(static_cast<int64_t>(pieces.size()), layout.max_pieces());
    // The own rows: [0, n/2), [n/2, n), then all of them again; the peers' pieces after them,
    // each starting where the previous one ended.
    const int64_t n_self = layout.sent(me, me);
    const auto [h0, h1] = layout.home_block(me, me);
    EXPECT_EQ(h1 - h0, n_self);
    int64_t row = n_self;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const EpLayoutPiece& p = pieces[i];
      const int64_t* o = offsets.data() + i * static_cast<size_t>(k.local + 1);
      EXPECT_EQ(o[0], 0);
      for (int64_t l = 0; l < k.local; ++l) EXPECT_LE(o[l], o[l + 1]) << "piece " << i;
      EXPECT_EQ(o[k.local], p.end - p.begin) << "piece " << i;
      if (p.source.round < 0) {
        EXPECT_EQ(p.source.peer, me);
        EXPECT_GE(p.source.home, h0);
        EXPECT_LE(p.source.home + (p.end - p.begin), h1);
        continue;
      }
      const int s = p.source.peer;
      const int64_t j = p.source.round;
      EXPECT_NE(s, me);
      EXPECT_EQ(p.begin, row) << "pieces do not tile the rows";
      EXPECT_EQ(p.begin, layout.piece_row(me, s, j));
      // The sender's part of its home rows has the same length.
      const auto [a, b] = layout.home_part(s, me, j);
      EXPECT_EQ(b - a, p.end - p.begin) << "from rank " << s << " round " << j;
      // Its offsets: the counts rank s holds for my experts, clipped to part j.
      const int64_t* c = counts.data() + s * e_n + me * k.local;
      const auto [pa, pb] = layout.part(layout.sent(s, me), j);
      for (int64_t l = 0, start = 0; l < k.local; start += c[l], ++l) {
        const int64_t in = std::max<int64_t>(0, std::min(start + c[l], pb) - std::max(start, pa));
        EXPECT_EQ(o[l + 1] - o[l], in) << "piece " << i << " expert " << l;
      }
      row = p.end;
    }
    EXPECT_EQ(row, rows);
    if (k.ranks > 1) {
      EXPECT_EQ(pieces[0].begin, 0);
      EXPECT_EQ(pieces[1].begin, pieces[0].end);
      EXPECT_EQ(pieces[1].end, n_self);
      EXPECT_EQ(pieces[2].begin, 0);
      EXPECT_EQ(pieces[2].end, n_self);
    }
  }
  // Each rank's home blocks tile its home rows in rank order.
  for (int r = 0; r < k.ranks; ++r) {
    int64_t at = 0;
    for (int m = 0; m < k.ranks; ++m) {
      const auto [a, b] = layout.home_block(r, m);
      EXPECT_EQ(a, at);
      at = b;
      int64_t parts = 0;
      for (int64_t j = 0; j < k.rounds; ++j) {
        const auto [pa, pb] = layout.home_part(r, m, j);
        EXPECT_EQ(pa, a + parts);
        parts += pb - pa;
      }
      EXPECT_EQ(parts, b - a);
    }
  }
}

TEST(EpLayout, PiecesTileTheRowsAndSendersAgreeWithReceivers) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "MOEFOLD_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (const Case& k : {Case{1, 4, 2}, Case{2, 1, 1}, Case{2, 3, 2}, Case{3, 2, 3}, Case{4, 2, 2}, Case{4, 5, 1}})
    for (int trial = 0; trial < 20; ++trial) check_case(k, rng);
}

TEST(EpLayout, OneRankIsOnePieceOfItsOwnRows) {
  const std::vector<int64_t> counts = {3, 0, 5};
  EpLayout layout(1, 3, 2);
  layout.set_counts(counts.data());
  std::vector<EpLayoutPiece> pieces;
  int64_t offsets[4] = {};
  EXPECT_EQ(layout.lay_out(0, pieces, offsets), 8);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].source.round, -1);
  EXPECT_EQ(offsets[1], 3);
  EXPECT_EQ(offsets[2], 3);
  EXPECT_EQ(offsets[3], 8);
}

}  // namespace
}  // namespace moefold
