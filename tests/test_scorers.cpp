// ExpectedAttention and KeyDiff against brute-force re-implementations written from the
// papers' formulas with dense matrices (no running sums, no closed forms): same stream,
// kept positions compared after every step; plus hand-checked cases and bad configurations.
#include <kvevict/policies/block_granular.hpp>
#include <kvevict/policies/expected_attention.hpp>
#include <kvevict/policies/keydiff.hpp>
#include <bit>
#include <limits>
#include <map>
#include <set>

#include "support/test_support.hpp"

using namespace kvevict;
using policies::ExpectedAttention;
using policies::KeyDiff;
using policies::RopeLayout;

namespace {

using Mat = std::vector<std::vector<double>>;

// Dense RoPE matrix of angle set pos * theta_j, in the given layout.
Mat rope_matrix(int d, double pos, RopeLayout layout, double base) {
  Mat R(static_cast<std::size_t>(d), std::vector<double>(static_cast<std::size_t>(d), 0.0));
  if (layout == RopeLayout::none) {
    for (int i = 0; i < d; ++i) R[i][i] = 1.0;
    return R;
  }
  for (int j = 0; j < d / 2; ++j) {
    const double th = std::pow(base, -2.0 * j / d);
    const int a = layout == RopeLayout::halves ? j : 2 * j;
    const int b = layout == RopeLayout::halves ? j + d / 2 : 2 * j + 1;
    R[a][a] = std::cos(pos * th);
    R[a][b] = -std::sin(pos * th);
    R[b][a] = std::sin(pos * th);
    R[b][b] = std::cos(pos * th);
  }
  return R;
}
std::vector<double> mul(const Mat& A, const std::vector<double>& x) {
  std::vector<double> y(A.size(), 0.0);
  for (std::size_t i = 0; i < A.size(); ++i)
    for (std::size_t j = 0; j < x.size(); ++j) y[i] += A[i][j] * x[j];
  return y;
}
Mat mul(const Mat& A, const Mat& B) {
  Mat C(A.size(), std::vector<double>(B[0].size(), 0.0));
  for (std::size_t i = 0; i < A.size(); ++i)
    for (std::size_t k = 0; k < B.size(); ++k)
      for (std::size_t j = 0; j < B[0].size(); ++j) C[i][j] += A[i][k] * B[k][j];
  return C;
}
Mat transpose(const Mat& A) {
  Mat T(A[0].size(), std::vector<double>(A.size()));
  for (std::size_t i = 0; i < A.size(); ++i)
    for (std::size_t j = 0; j < A[0].size(); ++j) T[j][i] = A[i][j];
  return T;
}

struct Row {
  std::uint64_t seq;
  std::vector<float> key, value;
};

// The victim among `rows` (position -> row) with the lowest score, oldest first on ties,
// sinks and the recent band excluded.
template <class Score>
std::int64_t brute_victim(const std::map<std::int64_t, Row>& rows, std::size_t sinks,
                          std::size_t recent, std::uint64_t seq, Score&& score) {
  std::int64_t best = -1;
  double best_score = 0.0;
  std::uint64_t best_seq = 0;
  for (const auto& [p, r] : rows) {
    if (r.seq < sinks || r.seq + recent >= seq) continue;
    const double s = score(p, r);
    if (best < 0 || s < best_score || (s == best_score && r.seq < best_seq)) {
      best = p;
      best_score = s;
      best_seq = r.seq;
    }
  }
  REQUIRE(best >= 0);
  return best;
}

// ExpectedAttention written out: every query kept (un-rotated with the dense inverse
// rotation), the last W (after the sinks) give mean and covariance; Rbar is the average of
// the dense rotation matrices over the future positions.
struct BruteExpected {
  ExpectedAttention::Config c;
  int d, G;
  std::size_t capacity;
  std::map<std::int64_t, Row> rows;
  std::vector<std::vector<std::vector<double>>> queries;  // per g: un-rotated queries
  std::map<std::int64_t, double> acc;                     // decayed scores (horizon > 0)
  // rescore_every > 1: decisions so far; each row's score as of the last rescoring or its
  // arrival; the last rescoring's moved means, covariances and log-normalisers per g.
  // Kept and decayed scores are floats (as the policy keeps them between rescorings).
  std::size_t decisions = 0;
  std::map<std::int64_t, float> stale, accf;
  std::vector<std::vector<double>> frozen_mean;
  std::vector<Mat> frozen_cov;
  std::vector<double> frozen_norm;
  // BlockGranular<ExpectedAttention> (block > 0): a decision takes every row of the block
  // (seq / block) with the lowest sum (or max) of the scores above, among the blocks after
  // the first and before the newest held one that hold no sink and no recent-band row;
  // blocks within 1e-5 of the lowest count as tied and the oldest goes.
  std::uint64_t block = 0;
  bool block_max = false;

  // The positions a decision evicts, from each row's score.
  template <class Score>
  std::vector<std::int64_t> victims(std::uint64_t seq, std::size_t recent, Score&& score) const {
    if (block == 0) return {brute_victim(rows, c.sinks, recent, seq, score)};
    std::map<std::uint64_t, double> agg;
    std::set<std::uint64_t> shut;
    std::uint64_t newest = 0;
    for (const auto& [p, r] : rows) newest = std::max(newest, r.seq / block);
    for (const auto& [p, r] : rows) {
      const std::uint64_t b = r.seq / block;
      if (b < 1 || b + 1 > newest || r.seq < c.sinks || r.seq + recent >= seq) {
        shut.insert(b);
        continue;
      }
      const double x = static_cast<float>(score(p, r));  // the policy's costs are floats
      auto [it, fresh] = agg.emplace(b, x);
      if (!fresh) it->second = block_max ? std::max(it->second, x) : it->second + x;
    }
    std::int64_t best = -1;
    double best_agg = 0.0;
    for (const auto& [b, x] : agg)
      if (!shut.count(b) && (best < 0 || x < best_agg - 1e-5)) best = static_cast<std::int64_t>(b), best_agg = x;
    REQUIRE(best >= 0);
    std::vector<std::int64_t> out;
    for (const auto& [p, r] : rows)
      if (r.seq / block == static_cast<std::uint64_t>(best)) out.push_back(p);
    return out;
  }
  void erase(const std::vector<std::int64_t>& gone) {
    for (std::int64_t victim : gone) {
      rows.erase(victim);
      acc.erase(victim);
      accf.erase(victim);
      stale.erase(victim);
    }
  }

  double z_of(const std::vector<double>& m, const Mat& Sr, const std::vector<float>& k) const {
    double lin = 0.0, quad = 0.0;
    for (int a = 0; a < d; ++a) lin += m[a] * k[a];
    for (int a = 0; a < d; ++a)
      for (int b = 0; b < d; ++b) quad += k[a] * Sr[a][b] * k[b];
    return lin / std::sqrt(static_cast<double>(d)) +
           (c.covariance == ExpectedAttention::Covariance::full ? quad / (2.0 * d) : 0.0);
  }
  double with_value_norm(double s, const std::vector<float>& value) const {
    if (!c.value_norm) return s;
    double vn = 0.0;
    for (float x : value) vn += static_cast<double>(x) * x;
    return (s + c.epsilon) * std::sqrt(vn);
  }

  void step(std::int64_t pos, std::uint64_t seq, const std::vector<float>& key,
            const std::vector<float>& value, const float* q) {
    if (seq >= c.sinks)
      for (int g = 0; g < G; ++g) {
        std::vector<double> x(q + g * d, q + (g + 1) * d);
        queries[static_cast<std::size_t>(g)].push_back(
            mul(transpose(rope_matrix(d, static_cast<double>(pos), c.rope, c.rope_base)), x));
      }
    const bool amortised = c.rescore_every > 1 || c.rescore_fraction > 0.0f;
    // R 1 for heads of at most rescore_all_up_to rows, else the larger of the two rules.
    const std::size_t every =
        capacity <= c.rescore_all_up_to
            ? 1
            : std::max(c.rescore_every, static_cast<std::size_t>(static_cast<double>(c.rescore_fraction) * static_cast<double>(capacity)));
    if (rows.size() >= capacity && amortised && decisions++ % every != 0) {
      // Between rescorings: the kept scores, decayed.
      std::map<std::int64_t, float> score;
      const auto decay = static_cast<float>(1.0 - c.horizon / static_cast<double>(capacity));
      for (const auto& [p, r] : rows) {
        float s = stale.at(p);
        if (c.horizon > 0.0f) {
          const float decayed = decay * accf[p];  // multiply, then add (never fused)
          s = accf[p] = decayed + s;
        }
        score[p] = s;
      }
      const std::size_t recent = std::max(c.recent, static_cast<std::size_t>(c.recent_fraction * static_cast<float>(capacity)));
      erase(victims(seq, recent, [&](std::int64_t p, const Row&) { return score[p]; }));
    } else if (rows.size() >= capacity) {
      if (amortised) {
        frozen_mean.assign(static_cast<std::size_t>(G), {});
        frozen_cov.assign(static_cast<std::size_t>(G), {});
        frozen_norm.assign(static_cast<std::size_t>(G), 0.0);
      }
      Mat Rbar(static_cast<std::size_t>(d), std::vector<double>(static_cast<std::size_t>(d), 0.0));
      for (std::size_t t = 0; t < c.future_positions; ++t) {
        const Mat R = rope_matrix(d, static_cast<double>(pos + static_cast<std::int64_t>(t)), c.rope, c.rope_base);
        for (int i = 0; i < d; ++i)
          for (int j = 0; j < d; ++j) Rbar[i][j] += R[i][j] / static_cast<double>(c.future_positions);
      }
      std::map<std::int64_t, double> score;
      for (const auto& [p, r] : rows) score[p] = 0.0;
      for (int g = 0; g < G; ++g) {
        const auto& all = queries[static_cast<std::size_t>(g)];
        const std::size_t n = std::min(all.size(), c.query_window);
        std::vector<double> mu(static_cast<std::size_t>(d), 0.0);
        Mat S(static_cast<std::size_t>(d), std::vector<double>(static_cast<std::size_t>(d), 0.0));
        for (std::size_t i = all.size() - n; i < all.size(); ++i)
          for (int a = 0; a < d; ++a) mu[a] += all[i][a] / static_cast<double>(n);
        for (std::size_t i = all.size() - n; i < all.size(); ++i)
          for (int a = 0; a < d; ++a)
            for (int b = 0; b < d; ++b)
              S[a][b] += (all[i][a] - mu[a]) * (all[i][b] - mu[b]) / static_cast<double>(n);
        const auto m = mul(Rbar, mu);
        const Mat Sr = mul(Rbar, mul(S, transpose(Rbar)));
        auto z = [&](const std::vector<float>& k) { return z_of(m, Sr, k); };
        double total = std::exp(z(key));  // the incoming key is in the normaliser
        for (const auto& [p, r] : rows)
          if (r.seq >= c.sinks) total += std::exp(z(r.key));
        for (const auto& [p, r] : rows)
          if (r.seq >= c.sinks) score[p] += std::exp(z(r.key)) / total / G;
        if (amortised) {
          frozen_mean[static_cast<std::size_t>(g)] = m;
          frozen_cov[static_cast<std::size_t>(g)] = Sr;
          frozen_norm[static_cast<std::size_t>(g)] = std::log(total);
        }
      }
      const std::size_t recent = std::max(c.recent, static_cast<std::size_t>(c.recent_fraction * static_cast<float>(capacity)));
      for (const auto& [p, r] : rows) {
        double& s = score[p];
        s = with_value_norm(s, r.value);
        stale[p] = static_cast<float>(s);
        if (amortised) {  // ranked by the float kept score, decayed in float
          s = stale[p];
          if (c.horizon > 0.0f) {
            const float decayed = static_cast<float>(1.0 - c.horizon / static_cast<double>(capacity)) * accf[p];
            s = accf[p] = decayed + stale[p];
          }
          continue;
        }
        if (c.horizon > 0.0f) s = acc[p] = (1.0 - c.horizon / static_cast<double>(capacity)) * acc[p] + s;
      }
      erase(victims(seq, recent, [&](std::int64_t p, const Row&) { return score[p]; }));
    }
    rows[pos] = {seq, key, value};
    if (amortised) {  // scored on arrival against the last rescoring (0 before the first)
      double s = 0.0;
      if (!frozen_norm.empty() && seq >= c.sinks) {
        for (int g = 0; g < G; ++g)
          s += std::exp(z_of(frozen_mean[static_cast<std::size_t>(g)],
                             frozen_cov[static_cast<std::size_t>(g)], key) -
                        frozen_norm[static_cast<std::size_t>(g)]);
        s /= G;
      }
      stale[pos] = static_cast<float>(with_value_norm(s, value));
    }
  }
};

// KeyDiff written out: anchor = mean of the unit keys (live rows and the incoming key),
// evict the highest cosine similarity to it.
struct BruteKeyDiff {
  KeyDiff::Config c;
  std::size_t capacity;
  std::map<std::int64_t, Row> rows;
  // rescore_every > 1: decisions so far, each row's score as of the last rescoring or its
  // arrival, and the last rescoring's unit anchor (empty before the first).
  std::size_t decisions = 0;
  std::map<std::int64_t, float> stale;  // floats, as the policy keeps them
  std::vector<double> frozen;
  static std::vector<double> unit(const std::vector<float>& k) {
    double n = 0.0;
    for (float x : k) n += static_cast<double>(x) * x;
    std::vector<double> u(k.size(), 0.0);
    if (n > 0.0)
      for (std::size_t j = 0; j < k.size(); ++j) u[j] = k[j] / std::sqrt(n);
    return u;
  }
  static double neg_cosine(const std::vector<float>& k, const std::vector<double>& unit_anchor) {
    const auto u = unit(k);
    double dot = 0.0;
    for (std::size_t j = 0; j < u.size(); ++j) dot += u[j] * unit_anchor[j];
    return -dot;
  }
  void step(std::int64_t pos, std::uint64_t seq, const std::vector<float>& key,
            const std::vector<float>& value) {
    const bool amortised = c.rescore_every > 1;
    const std::size_t recent0 = std::max(c.recent, static_cast<std::size_t>(c.recent_fraction * static_cast<float>(capacity)));
    if (rows.size() >= capacity && amortised && decisions++ % c.rescore_every != 0) {
      const auto victim = brute_victim(rows, c.sinks, recent0, seq,
                                       [&](std::int64_t p, const Row&) { return stale.at(p); });
      rows.erase(victim);
      stale.erase(victim);
    } else if (rows.size() >= capacity) {
      std::vector<double> anchor(key.size(), 0.0);
      auto add = [&](const std::vector<float>& k) {
        const auto u = unit(k);
        for (std::size_t j = 0; j < k.size(); ++j) anchor[j] += u[j] / static_cast<double>(rows.size() + 1);
      };
      for (const auto& [p, r] : rows) add(r.key);
      add(key);
      double an = 0.0;
      for (double x : anchor) an += x * x;
      const std::size_t recent = std::max(c.recent, static_cast<std::size_t>(c.recent_fraction * static_cast<float>(capacity)));
      for (double& x : anchor) x /= std::sqrt(an);
      const auto victim = brute_victim(rows, c.sinks, recent, seq, [&](std::int64_t, const Row& r) {
        return neg_cosine(r.key, anchor);  // -cosine
      });
      rows.erase(victim);
      if (amortised) {
        stale.erase(victim);
        for (const auto& [p, r] : rows) stale[p] = static_cast<float>(neg_cosine(r.key, anchor));
        frozen = anchor;
      }
    }
    rows[pos] = {seq, key, value};
    if (amortised) stale[pos] = frozen.empty() ? 0.0f : static_cast<float>(neg_cosine(key, frozen));
  }
};

BruteKeyDiff brute_keydiff(const KeyDiff::Config& c, std::size_t capacity) {
  BruteKeyDiff b{};
  b.c = c;
  b.capacity = capacity;
  return b;
}

// Feeds the same random stream (positions with gaps, queries rotated at their position) to
// the cache and to one brute-force model per (layer, KV head); compares kept positions.
template <class Policy, class MakeBrute>
void compare(const Geometry& g, std::size_t cap, const Policy& policy, MakeBrute&& make,
             RopeLayout layout, float base, std::uint64_t seed, int steps = 150) {
  INFO("seed " << seed);
  KVCache<Policy> cache(g, Budget::uniform(static_cast<long long>(cap)), policy);
  std::vector<decltype(make())> brute;
  for (int i = 0; i < g.n_layers * g.n_kv_heads; ++i) brute.push_back(make());
  kvtest::Rng rng(seed);
  const int d = g.head_dim, G = g.group();
  std::int64_t pos = 0;
  for (int t = 0; t < steps; ++t) {
    pos += rng.uniform(1, 3);  // engine positions may skip
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = rng.normals(static_cast<std::size_t>(g.n_kv_heads * d));
      auto v = rng.normals(static_cast<std::size_t>(g.n_kv_heads * d));
      // Pre-RoPE queries with a persistent direction (so the mean matters), then rotated.
      auto q0 = rng.normals(static_cast<std::size_t>(g.n_heads * d));
      for (std::size_t i = 0; i < q0.size(); ++i) q0[i] += (i % 3 == 0) ? 1.5f : 0.0f;
      std::vector<float> q(q0.size());
      const Mat R = rope_matrix(d, static_cast<double>(pos), layout, base);
      for (int h = 0; h < g.n_heads; ++h) {
        std::vector<double> x(q0.begin() + h * d, q0.begin() + (h + 1) * d);
        const auto y = mul(R, x);
        for (int j = 0; j < d; ++j) q[static_cast<std::size_t>(h * d + j)] = static_cast<float>(y[j]);
      }
      cache.append(l, pos, k, v, q);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        auto& b = brute[static_cast<std::size_t>(l * g.n_kv_heads + h)];
        std::vector<float> kh(k.begin() + h * d, k.begin() + (h + 1) * d);
        std::vector<float> vh(v.begin() + h * d, v.begin() + (h + 1) * d);
        if constexpr (std::is_same_v<Policy, KeyDiff>)
          b.step(pos, static_cast<std::uint64_t>(t), kh, vh);
        else
          b.step(pos, static_cast<std::uint64_t>(t), kh, vh, q.data() + h * G * d);
        const auto kept_pos = cache.positions(l, h);
        std::set<std::int64_t> kept(kept_pos.begin(), kept_pos.end()), want;
        for (const auto& [p, row] : b.rows) want.insert(p);
        INFO("step " << t << " layer " << l << " head " << h);
        REQUIRE(kept == want);
      }
    }
  }
}

void compare_expected(const ExpectedAttention::Config& c, int G, std::size_t cap,
                      std::uint64_t seed, int d = 8, std::uint32_t block = 0, bool block_max = false) {
  const Geometry g{2, 2 * G, 2, d};
  const auto brute = [&] {
    BruteExpected b{};
    b.c = c;
    b.d = d;
    b.G = G;
    b.capacity = cap;
    b.queries.resize(static_cast<std::size_t>(G));
    b.block = block;
    b.block_max = block_max;
    return b;
  };
  if (block == 0) {
    compare(g, cap, ExpectedAttention(c), brute, c.rope, c.rope_base, seed);
    return;
  }
  const policies::BlockGranularConfig bc{.block_tokens = block, .sink_blocks = 1, .recent_blocks = 1,
                                         .score = block_max ? BlockScore::max : BlockScore::sum,
                                         .source = policies::BlockSource::costs};
  compare(g, cap, policies::BlockGranular(ExpectedAttention(c), bc), brute, c.rope, c.rope_base, seed);
}

}  // namespace

TEST_CASE("ExpectedAttention agrees with a dense brute-force rule", "[scorers]") {
  using C = ExpectedAttention::Covariance;
  for (int G : {1, 4}) {
    // The paper's form (full covariance, value norms), llama2.c's RoPE layout.
    compare_expected({.sinks = 2, .query_window = 16, .future_positions = 32}, G, 20, 100 + G);
    // Hugging Face's layout, a small base (fast rotations), mean only.
    compare_expected({.sinks = 0, .query_window = 5, .future_positions = 7,
                      .covariance = C::none, .rope = RopeLayout::halves, .rope_base = 50.0f},
                     G, 16, 200 + G);
    // No RoPE, no value norm, a recent band and an epsilon.
    compare_expected({.sinks = 1, .recent = 3, .recent_fraction = 0.25f, .query_window = 300,
                      .future_positions = 1, .value_norm = false, .rope = RopeLayout::none},
                     G, 24, 300 + G);
    compare_expected({.sinks = 4, .query_window = 8, .future_positions = 64, .epsilon = 0.01f,
                      .rope_base = 100.0f},
                     G, 12, 400 + G, 6);
    // kvevict's extension: decayed scores behind a sink and a recent band.
    compare_expected({.sinks = 1, .recent_fraction = 0.375f, .query_window = 4,
                      .future_positions = 4, .covariance = C::none, .horizon = 3.0f},
                     G, 16, 500 + G);
  }
}

TEST_CASE("KeyDiff agrees with a brute-force rule", "[scorers]") {
  for (const KeyDiff::Config c : {KeyDiff::Config{}, KeyDiff::Config{.sinks = 2, .recent = 3},
                                  KeyDiff::Config{.sinks = 1, .recent_fraction = 0.375f}}) {
    const Geometry g{2, 4, 2, 16};
    compare(g, 20, KeyDiff(c), [&] { return brute_keydiff(c, 20); }, RopeLayout::none,
            10000.0f, 7 + c.sinks);
  }
}

namespace {
// Keys of one kind per stream, to push the bounded candidate search (KeyDiff's default with
// rescore_every 1) where it could go wrong: near-ties, exact ties, zero keys, few
// directions (d 2: rows parallel to the anchor's drift, where the |A - A0| bound is tight),
// key norms out of the bounded search's range.
enum class KeyKind { gaussian, near_ties, zeros_and_copies };
std::vector<float> keydiff_key(kvtest::Rng& rng, KeyKind kind, std::size_t n,
                               std::vector<std::vector<float>>& seen) {
  std::vector<float> k = rng.normals(n);
  if (kind == KeyKind::near_ties) {  // four directions, perturbed at 1e-7
    const auto dir = static_cast<float>(rng.uniform(0, 3));
    for (std::size_t j = 0; j < n; ++j)
      k[j] = (j % 4 == static_cast<std::size_t>(dir) ? 1.0f : 0.25f) * (1.0f + 1e-7f * k[j]);
  } else if (kind == KeyKind::zeros_and_copies) {
    if (rng.chance(0.15)) std::fill(k.begin(), k.end(), 0.0f);
    else if (rng.chance(0.05))  // norms outside [2^-40, 2^40]: the exhaustive search's
      for (float& x : k) x *= rng.chance(0.5) ? 1e-13f : 1e13f;
    else if (!seen.empty() && rng.chance(0.3))
      k = seen[static_cast<std::size_t>(rng.uniform(0, static_cast<long long>(seen.size()) - 1))];
  }
  seen.push_back(k);
  return k;
}

// The bounded search against the exhaustive one (KeyDiff::Config::exhaustive), stepped on
// the same stream: the same rows in the same order at every step, one budget shrink
// (need > 1) midway.
KeyDiff::SearchCounts keydiff_bounded_vs_exhaustive(KeyDiff::Config c, int d, std::size_t cap,
                                                    KeyKind kind, std::uint64_t seed,
                                                    int steps) {
  INFO("seed " << seed << " d " << d << " kind " << static_cast<int>(kind));
  const Geometry g{1, 2, 2, d};
  KeyDiff::Config ce = c;
  ce.exhaustive = true;
  KVCache<KeyDiff> fast(g, Budget::uniform(static_cast<long long>(cap)), KeyDiff(c));
  KVCache<KeyDiff> ref(g, Budget::uniform(static_cast<long long>(cap)), KeyDiff(ce));
  kvtest::Rng rng(seed);
  std::vector<std::vector<float>> seen;
  for (int t = 0; t < steps; ++t) {
    if (t == steps / 2) {
      fast.set_budget(Budget::uniform(static_cast<long long>(cap - 5)));
      ref.set_budget(Budget::uniform(static_cast<long long>(cap - 5)));
    }
    const auto k = keydiff_key(rng, kind, static_cast<std::size_t>(2 * d), seen);
    fast.append(0, t, k, k);
    ref.append(0, t, k, k);
    for (int h = 0; h < 2; ++h) {
      INFO("step " << t << " head " << h);
      const auto a = fast.positions(0, h), b = ref.positions(0, h);
      REQUIRE(std::vector<std::int64_t>(a.begin(), a.end()) ==
              std::vector<std::int64_t>(b.begin(), b.end()));
    }
  }
  return fast.policy().search_counts();
}
}  // namespace

TEST_CASE("KeyDiff's bounded candidate search evicts the exhaustive search's rows", "[scorers]") {
  const KeyDiff::Config configs[] = {KeyDiff::Config{}, KeyDiff::Config{.sinks = 2, .recent = 3},
                                     KeyDiff::Config{.sinks = 1, .recent_fraction = 0.375f}};
  KeyDiff::SearchCounts total{};
  auto add = [&](const KeyDiff::SearchCounts& s) {
    total.bounded += s.bounded;
    total.rebases += s.rebases;
    total.exhaustive += s.exhaustive;
    total.partial += s.partial;
  };
  std::uint64_t seed = 40;
  for (const auto& c : configs) {
    add(keydiff_bounded_vs_exhaustive(c, 2, 48, KeyKind::gaussian, ++seed, 500));
    add(keydiff_bounded_vs_exhaustive(c, 3, 64, KeyKind::gaussian, ++seed, 400));
    add(keydiff_bounded_vs_exhaustive(c, 16, 40, KeyKind::gaussian, ++seed, 300));
    add(keydiff_bounded_vs_exhaustive(c, 8, 30, KeyKind::near_ties, ++seed, 200));
    add(keydiff_bounded_vs_exhaustive(c, 4, 30, KeyKind::zeros_and_copies, ++seed, 300));
    // Wider: partial rebases (head dims off the SIMD widths: the kernels' tails).
    add(keydiff_bounded_vs_exhaustive(c, 20, 160, KeyKind::gaussian, ++seed, 360));
  }
  // Both paths ran: most decisions bounded, the close calls and the shrink exhaustive.
  CHECK(total.bounded > 10 * total.exhaustive);
  CHECK(total.exhaustive > 0);
  CHECK(total.rebases > 0);
  CHECK(total.partial > 0);
}

TEST_CASE("KeyDiff by hand: the key most like the others leaves, not the odd one", "[scorers]") {
  // Capacity 3, d 2: keys e1, e1 (scaled), e2; incoming e1. The anchor points mostly along
  // e1, so an e1 row goes (the older one on the tie: both have cosine exactly equal).
  const Geometry g{1, 1, 1, 2};
  KVCache<KeyDiff> cache(g, Budget::uniform(3), KeyDiff{});
  const std::vector<float> e1{1.0f, 0.0f}, e1b{3.0f, 0.0f}, e2{0.0f, 2.0f};
  cache.append(0, 0, e1, e1);
  cache.append(0, 1, e2, e1);
  cache.append(0, 2, e1b, e1);
  cache.append(0, 3, e1, e1);
  const auto pos = cache.positions(0, 0);
  CHECK(std::set<std::int64_t>(pos.begin(), pos.end()) == std::set<std::int64_t>{1, 2, 3});
  // A zero key has cosine 0 with any anchor: with every other key along the anchor, it stays.
  KVCache<KeyDiff> z(g, Budget::uniform(2), KeyDiff{});
  const std::vector<float> zero{0.0f, 0.0f};
  z.append(0, 0, zero, e1);
  z.append(0, 1, e1, e1);
  z.append(0, 2, e1b, e1);
  const auto zp = z.positions(0, 0);
  CHECK(std::set<std::int64_t>(zp.begin(), zp.end()) == std::set<std::int64_t>{0, 2});
}

TEST_CASE("ExpectedAttention by hand: queries that point at a key keep it", "[scorers]") {
  // No RoPE, mean only, no value norm: the score is the softmax of q_mean . k / sqrt(d).
  const Geometry g{1, 1, 1, 2};
  KVCache<ExpectedAttention> cache(
      g, Budget::uniform(3),
      ExpectedAttention({.sinks = 0, .covariance = ExpectedAttention::Covariance::none,
                         .value_norm = false, .rope = RopeLayout::none}));
  const std::vector<float> q{0.0f, 1.0f}, v{1.0f, 1.0f};
  cache.append(0, 0, std::vector<float>{0.0f, 2.0f}, v, q);   // aligned with the queries
  cache.append(0, 1, std::vector<float>{1.0f, 0.0f}, v, q);   // orthogonal
  cache.append(0, 2, std::vector<float>{0.0f, -1.0f}, v, q);  // opposite: evicted first
  cache.append(0, 3, std::vector<float>{0.0f, 1.0f}, v, q);
  auto pos = cache.positions(0, 0);
  CHECK(std::set<std::int64_t>(pos.begin(), pos.end()) == std::set<std::int64_t>{0, 1, 3});
  cache.append(0, 4, std::vector<float>{0.0f, 1.0f}, v, q);  // then the orthogonal one
  pos = cache.positions(0, 0);
  CHECK(std::set<std::int64_t>(pos.begin(), pos.end()) == std::set<std::int64_t>{0, 3, 4});
}

TEST_CASE("ExpectedAttention un-rotates queries: the statistics do not depend on position",
          "[scorers]") {
  // The same pre-RoPE query at every position, rotated by llama2.c's RoPE: the window's
  // mean must be that query and its covariance zero.
  const Geometry g{1, 2, 1, 4};
  KVCache<ExpectedAttention> cache(g, Budget::uniform(64), ExpectedAttention({.sinks = 0}));
  const std::vector<double> q0{0.5, -1.0, 2.0, 0.25};
  for (int p = 0; p < 40; ++p) {
    const Mat R = rope_matrix(4, p * 7.0, RopeLayout::interleaved, 10000.0);
    const auto y = mul(R, q0);
    std::vector<float> q;
    for (int h = 0; h < 2; ++h)
      for (double x : y) q.push_back(static_cast<float>(x));
    cache.append(0, p * 7, std::vector<float>(4, 1.0f), std::vector<float>(4, 1.0f), q);
  }
  const auto m = cache.policy().moments(0, 1);
  REQUIRE(m.count == 40);
  for (int i = 0; i < 4; ++i) {
    CHECK((*m.sum)[static_cast<std::size_t>(i)] / 40.0 == Approx(q0[static_cast<std::size_t>(i)]).epsilon(1e-5));
    for (int j = 0; j < 4; ++j)
      CHECK((*m.outer)[static_cast<std::size_t>(i * 4 + j)] / 40.0 ==
            Approx(q0[static_cast<std::size_t>(i)] * q0[static_cast<std::size_t>(j)]).epsilon(1e-5).margin(1e-6));
  }
}

TEST_CASE("Bad scorer configurations are rejected with the value", "[scorers]") {
  REQUIRE_THROWS_AS(ExpectedAttention({.query_window = 0}), Error);
  REQUIRE_THROWS_WITH(ExpectedAttention({.query_window = 0}), Catch::Contains("query_window = 0"));
  REQUIRE_THROWS_WITH(ExpectedAttention({.future_positions = 0}),
                      Catch::Contains("future_positions = 0"));
  REQUIRE_THROWS_WITH(ExpectedAttention({.epsilon = -1.0f}), Catch::Contains("epsilon = -1"));
  REQUIRE_THROWS_WITH(ExpectedAttention({.epsilon = NAN}), Catch::Contains("epsilon = nan"));
  REQUIRE_THROWS_WITH(ExpectedAttention({.rope_base = 1.0f}), Catch::Contains("rope_base = 1"));
  REQUIRE_THROWS_WITH(ExpectedAttention({.horizon = -2.0f}), Catch::Contains("horizon = -2"));
  REQUIRE_THROWS_WITH(ExpectedAttention({.recent_fraction = 1.0f}),
                      Catch::Contains("recent_fraction = 1"));
  REQUIRE_THROWS_WITH(KeyDiff({.recent_fraction = -0.5f}), Catch::Contains("recent_fraction = -0.5"));
  // Odd head dim with RoPE: at construction of the cache, the cache unchanged (none made).
  REQUIRE_THROWS_WITH(KVCache<ExpectedAttention>(Geometry{1, 1, 1, 3}, Budget::uniform(8)),
                      Catch::Contains("head_dim = 3"));
  CHECK_NOTHROW(KVCache<ExpectedAttention>(Geometry{1, 1, 1, 3}, Budget::uniform(8),
                                           ExpectedAttention({.rope = RopeLayout::none})));
  // A budget below sinks + recent + 1.
  REQUIRE_THROWS_AS(KVCache<KeyDiff>(Geometry{1, 1, 1, 4}, Budget::uniform(3),
                                     KeyDiff({.sinks = 2, .recent = 1})),
                    Error);
  // sinks + recent + 1 that wraps size_t is refused, not taken as a small minimum.
  constexpr std::size_t huge = std::numeric_limits<std::size_t>::max();
  REQUIRE_THROWS_WITH(KVCache<KeyDiff>(Geometry{1, 1, 1, 4}, Budget::uniform(8),
                                       KeyDiff({.sinks = huge, .recent = 1})),
                      Catch::Contains("overflow"));
  REQUIRE_THROWS_WITH(KVCache<ExpectedAttention>(Geometry{1, 1, 1, 4}, Budget::uniform(8),
                                                 ExpectedAttention({.sinks = 1, .recent = huge})),
                      Catch::Contains("overflow"));
}

TEST_CASE("Scorers shrink a budget without an incoming token", "[scorers]") {
  const Geometry g{1, 4, 2, 8};
  KVCache<ExpectedAttention> ea(g, Budget::uniform(32), ExpectedAttention{});
  KVCache<KeyDiff> kd(g, Budget::uniform(32), KeyDiff({.sinks = 1}));
  kvtest::Rng rng(3);
  for (int t = 0; t < 50; ++t) {
    auto k = rng.normals(16), v = rng.normals(16), q = rng.normals(32);
    ea.append(0, t, k, v, q);
    kd.append(0, t, k, v);
  }
  ea.set_budget(Budget::uniform(10));
  kd.set_budget(Budget::uniform(10));
  for (int h = 0; h < 2; ++h) {
    CHECK(ea.positions(0, h).size() == 10);
    CHECK(kd.positions(0, h).size() == 10);
    const auto p = ea.positions(0, h);
    for (std::int64_t s = 0; s < 4; ++s) CHECK(std::find(p.begin(), p.end(), s) != p.end());  // sinks
  }
}

TEST_CASE("ExpectedAttention rescore_every > 1 agrees with a brute-force amortised rule",
          "[scorers]") {
  // Every R-th decision of a head rescores all rows; rows appended in between are scored on
  // arrival against the last rescoring's moved statistics and normaliser.
  using C = ExpectedAttention::Covariance;
  for (int G : {1, 4}) {
    for (std::size_t R : {2u, 5u}) {
      // kvevict's probability-free variant's shape (decayed, band), RoPE.
      compare_expected({.sinks = 1, .recent_fraction = 0.375f, .query_window = 1,
                        .future_positions = 16, .covariance = C::none, .horizon = 3.0f,
                        .rescore_every = R},
                       G, 16, 600 + G + R);
      // The paper's form with covariance, no band: arrivals matter at once.
      compare_expected({.sinks = 2, .query_window = 16, .future_positions = 32,
                        .rescore_every = R},
                       G, 20, 700 + G + R);
      // No RoPE, no value norm, the float kernel path.
      compare_expected({.sinks = 1, .recent = 2, .query_window = 3, .future_positions = 1,
                        .covariance = C::none, .value_norm = false, .rope = RopeLayout::none,
                        .rescore_every = R, .float_logits = true},
                       G, 24, 800 + G + R);
    }
    // R from the capacity: floor(0.25 x 16) = 4 (rescore_every 1 below it), float logits.
    compare_expected({.sinks = 1, .recent_fraction = 0.375f, .query_window = 1,
                      .future_positions = 16, .covariance = C::none, .horizon = 3.0f,
                      .float_logits = true, .rescore_fraction = 0.25f},
                     G, 16, 850 + G);
  }
}

TEST_CASE("ExpectedAttention rescore_all_up_to: R 1 for small heads, the fraction beyond",
          "[scorers]") {
  // The registry's `probfree` shape (float logits, R = floor(C / 8) beyond the threshold),
  // scaled to small heads: a head of 16 rows at or under the threshold rescores every
  // decision (through the amortised path: float kept scores, arrivals scored), one over it
  // uses floor(0.25 x C). Each against the brute-force rule with the same threshold.
  using C = ExpectedAttention::Covariance;
  for (int G : {1, 4}) {
    // (threshold, capacity): a head at it (R 1), one row over it (R 4), a larger head (R 5).
    for (auto [up_to, cap] : {std::pair<std::size_t, std::size_t>{16, 16}, {15, 16}, {16, 20}})
      compare_expected({.sinks = 1, .recent_fraction = 0.375f, .query_window = 1,
                        .future_positions = 16, .covariance = C::none, .horizon = 3.0f,
                        .float_logits = true, .rescore_fraction = 0.25f,
                        .rescore_all_up_to = up_to},
                       G, cap, 1000 + G + up_to + cap);
  }
  const ExpectedAttention p({.rescore_fraction = 1.0f / 8, .rescore_all_up_to = 128});
  CHECK(p.every(16) == 1);
  CHECK(p.every(128) == 1);
  CHECK(p.every(129) == 16);
  CHECK(p.every(1024) == 128);
  CHECK(p.every(Budget::kUnbounded) == 1);
}

TEST_CASE("The one-pass step between rescorings keeps the brute-force rule's rows on larger heads",
          "[scorers]") {
  // Between rescorings ExpectedAttention (decay and victim: kernels::decay_lowest_open; no
  // horizon: kernels::lowest_open) and KeyDiff (kernels::lowest_open) take their victim in
  // one pass over the kept scores and seqs. Heads of 70 rows (eight 8-row blocks and a
  // tail, the recent band and sinks inside blocks) against the brute-force rules, which
  // decay and pick in plain loops: a fused pass that diverged (value, open range, tie rule)
  // would keep other rows.
  using C = ExpectedAttention::Covariance;
  for (int G : {1, 4}) {
    compare_expected({.sinks = 1, .recent_fraction = 0.375f, .query_window = 1,
                      .future_positions = 16, .covariance = C::none, .horizon = 3.0f,
                      .float_logits = true, .rescore_fraction = 1.0f / 8},
                     G, 70, 1100 + G);
    compare_expected({.sinks = 3, .recent = 5, .query_window = 2, .future_positions = 4,
                      .covariance = C::none, .rope = RopeLayout::none, .rescore_every = 3},
                     G, 70, 1200 + G);
  }
  const KeyDiff::Config c{.sinks = 2, .recent_fraction = 0.375f, .rescore_every = 5};
  compare(Geometry{2, 4, 2, 16}, 70, KeyDiff(c), [&] { return brute_keydiff(c, 70); },
          RopeLayout::none, 10000.0f, 1300);
}

TEST_CASE("ExpectedAttention float_logits keeps the brute-force rule's decisions", "[scorers]") {
  using C = ExpectedAttention::Covariance;
  for (int G : {1, 4}) {
    compare_expected({.sinks = 1, .recent_fraction = 0.375f, .query_window = 1,
                      .future_positions = 16, .covariance = C::none, .horizon = 3.0f,
                      .float_logits = true},
                     G, 16, 900 + G);
    compare_expected({.sinks = 0, .query_window = 5, .future_positions = 7, .covariance = C::none,
                      .rope = RopeLayout::halves, .rope_base = 50.0f, .float_logits = true},
                     G, 16, 950 + G, 16);
  }
}

namespace {
// Two caches on one stream, double and float logits (R = 1): same kept rows after every
// step, and every score of the float path within `tol` (relative) of the double path's.
template <class Scalar>
double float_vs_double(int d, int G, std::size_t cap, std::size_t sinks, int steps,
                       std::uint64_t seed) {
  const Geometry g{1, 2 * G, 2, d};
  ExpectedAttention::Config c{.sinks = sinks, .recent_fraction = 0.375f, .query_window = 1,
                              .future_positions = 16,
                              .covariance = ExpectedAttention::Covariance::none,
                              .horizon = 3.0f};
  KVCache<ExpectedAttention, Scalar> dbl(g, Budget::uniform(static_cast<long long>(cap)),
                                         ExpectedAttention(c));
  c.float_logits = true;
  KVCache<ExpectedAttention, Scalar> flt(g, Budget::uniform(static_cast<long long>(cap)),
                                         ExpectedAttention(c));
  kvtest::Rng rng(seed);
  double worst = 0.0;
  for (int t = 0; t < steps; ++t) {
    auto k = rng.normals(static_cast<std::size_t>(2 * d));
    auto v = rng.normals(static_cast<std::size_t>(2 * d));
    auto q = rng.normals(static_cast<std::size_t>(2 * G * d));
    for (std::size_t i = 0; i < q.size(); ++i) q[i] += (i % 5 == 0) ? 1.0f : 0.0f;
    dbl.append(0, t, k, v, q);
    const auto sd = dbl.policy().last_scores();
    flt.append(0, t, k, v, q);
    const auto& sf = flt.policy().last_scores();
    for (int h = 0; h < 2; ++h) {
      const auto a = dbl.positions(0, h), b = flt.positions(0, h);
      INFO("step " << t << " head " << h);
      REQUIRE(std::vector<std::int64_t>(a.begin(), a.end()) ==
              std::vector<std::int64_t>(b.begin(), b.end()));
    }
    REQUIRE(sd.size() == sf.size());
    for (std::size_t r = 0; r < sd.size(); ++r)
      if (sd[r] != 0.0) worst = std::max(worst, std::abs(sf[r] - sd[r]) / std::abs(sd[r]));
  }
  return worst;
}
}  // namespace

TEST_CASE("ExpectedAttention float logits match the double reference within 1e-5", "[scorers]") {
  // last_scores() is the last KV head's decayed score; relative error over every step
  // (measured: 2e-7 to 5e-7). fp32 keys at d 128 (the bench's shape) and d 8 (stories260K's),
  // and fp16 keys. The error is not 0: the float path ran.
  for (const double e : {float_vs_double<float>(128, 4, 64, 1, 120, 31),
                         float_vs_double<float>(8, 1, 16, 0, 200, 32),
                         float_vs_double<Eigen::half>(64, 2, 32, 1, 100, 33)}) {
    CHECK(e < 1e-5);
    CHECK(e > 0.0);
  }
}

TEST_CASE("KeyDiff rescore_every > 1 agrees with a brute-force amortised rule", "[scorers]") {
  for (std::size_t R : {2u, 7u})
    for (const KeyDiff::Config c :
         {KeyDiff::Config{.rescore_every = R},
          KeyDiff::Config{.sinks = 1, .recent_fraction = 0.375f, .rescore_every = R}}) {
      const Geometry g{2, 4, 2, 16};
      compare(g, 20, KeyDiff(c), [&] { return brute_keydiff(c, 20); }, RopeLayout::none,
              10000.0f, 70 + R + c.sinks);
    }
}

TEST_CASE("rescore_every and float_logits: bad values are errors", "[scorers]") {
  CHECK_THROWS_AS(ExpectedAttention({.rescore_every = 0}), Error);
  CHECK_THROWS_AS(ExpectedAttention({.rescore_every = (1u << 20) + 1}), Error);
  CHECK_THROWS_AS(ExpectedAttention({.covariance = ExpectedAttention::Covariance::full,
                                     .float_logits = true}),
                  Error);
  CHECK_THROWS_AS(ExpectedAttention({.rescore_fraction = 1.0f}), Error);
  CHECK_THROWS_AS(ExpectedAttention({.rescore_fraction = -0.5f}), Error);
  CHECK_THROWS_AS(KeyDiff({.rescore_every = 0}), Error);
}

TEST_CASE("BlockGranular<ExpectedAttention>: the block with the lowest summed or max expected attention leaves (brute force)",
          "[scorers]") {
  // ExpectedAttention::eviction_costs: per row, the score its decision ranks by (decayed
  // when horizon > 0; the kept scores between rescorings), +inf for its sinks and band.
  using C = ExpectedAttention::Covariance;
  for (int G : {1, 4})
    for (bool mx : {false, true}) {
      INFO("G " << G << (mx ? " max" : " sum"));
      // The probability-free shape without its band (the block rows' setting), decayed.
      compare_expected({.sinks = 1, .recent = 1, .query_window = 1, .future_positions = 16,
                        .covariance = C::none, .horizon = 3.0f},
                       G, 24, 900 + G, 8, 4, mx);
      // Its band of 3/8 (protects the blocks it covers), window 4, 8-token blocks.
      compare_expected({.sinks = 1, .recent_fraction = 0.375f, .query_window = 4,
                        .future_positions = 4, .covariance = C::none, .horizon = 3.0f},
                       G, 48, 910 + G, 8, 8, mx);
      // The paper's form (covariance, 2 sinks, no decay).
      compare_expected({.sinks = 2, .query_window = 16, .future_positions = 32}, G, 24, 920 + G, 8, 4, mx);
      // Rescoring every 2nd decision (kept float scores, decayed), float logits.
      compare_expected({.sinks = 1, .recent = 1, .query_window = 1, .future_positions = 16,
                        .covariance = C::none, .horizon = 3.0f, .rescore_every = 2,
                        .float_logits = true},
                       G, 24, 930 + G, 8, 4, mx);
    }
}

TEST_CASE("ExpectedAttention under a pooled budget: eviction_costs then pooled_victims keep choose_victims' rows",
          "[scorers]") {
  // One KV head per layer: the layer's pool is the head's capacity, so the pooled path
  // (eviction_costs, then pooled_victims from its scores) must evict what choose_victims
  // does, step for step, decayed sums and rescoring counts included.
  using C = ExpectedAttention::Covariance;
  const ExpectedAttention::Config cfgs[] = {
      {.sinks = 1, .recent_fraction = 0.375f, .query_window = 1, .future_positions = 16,
       .covariance = C::none, .horizon = 3.0f},
      {.sinks = 1, .recent_fraction = 0.375f, .query_window = 1, .future_positions = 16,
       .covariance = C::none, .horizon = 3.0f, .rescore_every = 3, .float_logits = true},
      {.sinks = 2, .query_window = 16, .future_positions = 32}};
  for (const auto& c : cfgs) {
    const Geometry g{2, 4, 1, 8};
    KVCache<ExpectedAttention> a(g, Budget::uniform(16).pooled(), ExpectedAttention(c));
    KVCache<ExpectedAttention> b(g, Budget::uniform(16), ExpectedAttention(c));
    REQUIRE(a.pooled());
    kvtest::Rng rng(41);
    for (int t = 0; t < 120; ++t)
      for (int l = 0; l < 2; ++l) {
        auto k = rng.normals(8), v = rng.normals(8), q = rng.normals(32);
        a.append(l, t, k, v, q);
        b.append(l, t, k, v, q);
        const auto pa = a.positions(l, 0), pb = b.positions(l, 0);
        INFO("t " << t << " layer " << l);
        REQUIRE(std::vector<std::int64_t>(pa.begin(), pa.end()) == std::vector<std::int64_t>(pb.begin(), pb.end()));
      }
  }
}

TEST_CASE("ExpectedAttention's float rescoring leaves the sinks' scores at +0.0", "[scorers]") {
  // score_rows_float adds every row's probabilities (no per-row sink test, so the loop
  // vectorises) and then sets the sinks back to +0.0, the value the skipped rows had:
  // last_scores() holds exactly +0.0 for them and a positive score for every other row.
  using C = ExpectedAttention::Covariance;
  for (std::size_t sinks : {1u, 3u}) {
    const ExpectedAttention::Config c{.sinks = sinks, .recent_fraction = 0.375f, .query_window = 1,
                                      .future_positions = 16, .covariance = C::none,
                                      .rope = RopeLayout::none, .horizon = 3.0f,
                                      .float_logits = true, .rescore_fraction = 0.125f,
                                      .rescore_all_up_to = 16};
    KVCache<ExpectedAttention> cache(Geometry{1, 4, 1, 16}, Budget::uniform(16), ExpectedAttention(c));
    kvtest::Rng rng(57);
    for (int t = 0; t < 60; ++t) {
      cache.append(0, t, rng.normals(16), rng.normals(16), rng.normals(64));
      if (t < 16) continue;  // a decision (R 1 at 16 rows: a rescoring) from the 17th token on
      const auto& s = cache.policy().last_scores();
      REQUIRE(s.size() == 16);
      INFO("t " << t);
      for (std::size_t r = 0; r < s.size(); ++r) {
        if (r < sinks) CHECK(std::bit_cast<std::uint64_t>(s[r]) == 0);
        else CHECK(s[r] > 0.0);
      }
    }
  }
}

namespace {
// The float rescoring (score_rows_float, then score_rows' group mean and value norm) written
// out in the plain order, one loop per sum, from the rows of (layer 0, KV head 0) before the
// step: the scores the policy must report bit for bit. One-query window, no RoPE, so the
// moved mean of head g is its query (0.0 + q, divided by a count of 1); `incoming` null for
// a budget shrink.
std::vector<double> float_rescoring_reference(const ExpectedAttention::Config& c, int G, int d,
                                              const std::vector<float>& keys,
                                              const std::vector<float>& values,
                                              const std::vector<std::uint64_t>& seqs,
                                              const float* q, const float* incoming) {
  const std::size_t n = seqs.size(), D = static_cast<std::size_t>(d), Gs = static_cast<std::size_t>(G);
  std::vector<float> qf(Gs * D);
  for (std::size_t i = 0; i < qf.size(); ++i) qf[i] = static_cast<float>((0.0 + static_cast<double>(q[i])) / 1.0);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> p(Gs * n);
  REQUIRE(kernels::attention_probs_as<kvevict::detail::kv_format_of<float>()>(
      qf.data(), D, Gs, keys.data(), D, n, D, scale, p.data()));
  std::vector<double> inv(Gs);
  for (std::size_t g = 0; g < Gs; ++g) {
    std::size_t most = 0;
    double total = 0.0;
    for (std::size_t r = 0; r < n; ++r) {
      if (p[g * n + r] > p[g * n + most]) most = r;
      if (seqs[r] >= c.sinks) total += static_cast<double>(p[g * n + r]);
    }
    double zj = 0.0, zin = 0.0;
    for (std::size_t i = 0; i < D; ++i)
      zj += static_cast<double>(qf[g * D + i]) * static_cast<double>(keys[most * D + i]);
    zj *= static_cast<double>(scale);
    if (incoming != nullptr) {
      for (std::size_t i = 0; i < D; ++i)
        zin += static_cast<double>(qf[g * D + i]) * static_cast<double>(incoming[i]);
      zin *= static_cast<double>(scale);
      total += static_cast<double>(p[g * n + most]) * std::exp(zin - zj);
    }
    inv[g] = 1.0 / total;
  }
  std::vector<double> s(n, 0.0);
  for (std::size_t g = 0; g < Gs; ++g)
    for (std::size_t r = 0; r < n; ++r) s[r] += static_cast<double>(p[g * n + r]) * inv[g];
  for (std::size_t r = 0; r < n; ++r) {
    if (seqs[r] < c.sinks) s[r] = 0.0;
    if (c.value_norm) {
      double sq = 0.0;
      for (std::size_t i = 0; i < D; ++i)
        sq += static_cast<double>(values[r * D + i]) * static_cast<double>(values[r * D + i]);
      const auto vn = static_cast<float>(std::sqrt(sq));
      s[r] = (s[r] / static_cast<double>(G) + static_cast<double>(c.epsilon)) * static_cast<double>(vn);
    } else {
      s[r] /= static_cast<double>(G);
    }
  }
  return s;
}
}  // namespace

TEST_CASE("ExpectedAttention's float rescoring equals the rule written out, bit for bit",
          "[scorers]") {
  // Every decision rescores (R 1, no horizon, so last_scores() is the rescoring's output):
  // the reference above against the policy, at group sizes 1, 3, 4 (the compile-time
  // group), 5 and 17 (past the 16 lanes), odd and even head dims, with and without the value
  // norm and epsilon, on appends and on a budget shrink (no incoming key).
  using C = ExpectedAttention::Covariance;
  int checked = 0;
  for (int G : {1, 3, 4, 5, 17})
    for (int d : {16, 13, 128})
      for (int variant = 0; variant < 3; ++variant) {
        const ExpectedAttention::Config c{.sinks = 2, .recent_fraction = 0.25f, .query_window = 1,
                                          .future_positions = 16, .covariance = C::none,
                                          .value_norm = variant != 1,
                                          .epsilon = variant == 2 ? 0.01f : 0.0f,
                                          .rope = RopeLayout::none, .horizon = 0.0f,
                                          .float_logits = true};
        const std::size_t cap = 24, D = static_cast<std::size_t>(d);
        KVCache<ExpectedAttention> cache(Geometry{1, G, 1, d}, Budget::uniform(cap), ExpectedAttention(c));
        kvtest::Rng rng(static_cast<std::uint64_t>(7000 + 100 * G + 10 * d + variant));
        auto snapshot = [&](std::vector<float>& k, std::vector<float>& v, std::vector<std::uint64_t>& s) {
          const auto K = cache.keys(0, 0);
          const auto V = cache.values(0, 0);
          k.assign(K.data(), K.data() + K.size());
          v.assign(V.data(), V.data() + V.size());
          const auto sq = cache.seqs(0, 0);
          s.assign(sq.begin(), sq.end());
        };
        std::vector<float> k0, v0, q_last;
        std::vector<std::uint64_t> s0;
        for (int t = 0; t < 40; ++t) {
          auto k = rng.normals(D), v = rng.normals(D, 1.0f + 0.1f * static_cast<float>(t % 7));
          auto q = rng.normals(static_cast<std::size_t>(G) * D);
          for (std::size_t i = 0; i < q.size(); i += 3) q[i] += 0.8f;
          snapshot(k0, v0, s0);
          cache.append(0, t, k, v, q);
          q_last = q;
          if (s0.size() < cap) continue;  // no decision yet
          const auto want = float_rescoring_reference(c, G, d, k0, v0, s0, q.data(), k.data());
          const auto& got = cache.policy().last_scores();
          INFO("G " << G << " d " << d << " variant " << variant << " t " << t);
          REQUIRE(got.size() == want.size());
          for (std::size_t r = 0; r < want.size(); ++r)
            CHECK(std::bit_cast<std::uint64_t>(got[r]) == std::bit_cast<std::uint64_t>(want[r]));
          ++checked;
        }
        // A budget shrink: no incoming key; the moved mean is still the last query.
        snapshot(k0, v0, s0);
        cache.set_budget(Budget::uniform(cap - 5));
        const auto want = float_rescoring_reference(c, G, d, k0, v0, s0, q_last.data(), nullptr);
        const auto& got = cache.policy().last_scores();
        INFO("shrink G " << G << " d " << d << " variant " << variant);
        REQUIRE(got.size() == want.size());
        for (std::size_t r = 0; r < want.size(); ++r)
          CHECK(std::bit_cast<std::uint64_t>(got[r]) == std::bit_cast<std::uint64_t>(want[r]));
        ++checked;
      }
  CHECK(checked == 5 * 3 * 3 * 17);
}
