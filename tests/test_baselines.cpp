// Each baseline against a brute-force re-implementation written plainly here: a list of
// (seq, position, score, norm) per head, sorted and erased by the rule in the papers,
// compared with the cache's kept positions after every step of a random sequence.
#include <catch2/catch.hpp>

#include "support/test_support.hpp"

using namespace kvevict;
using kvtest::Rng;

namespace {

struct RefRow {
  std::uint64_t seq = 0;
  std::int64_t pos = 0;
  float score = 0.0f;  // H2O: accumulated group-summed attention
  float norm = 0.0f;   // KNorm: key L2 norm
  std::vector<float> key;
};
using Rows = std::vector<RefRow>;

// --- the rules, written plainly -----------------------------------------------------------

bool protected_row(const RefRow& r, std::size_t sinks, std::size_t recent, std::uint64_t incoming) {
  return r.seq < sinks || r.seq + recent >= incoming;
}

struct StreamingRule {
  std::size_t sinks;
  std::vector<std::uint64_t> pick(int, int, const Rows& rows, std::size_t need, std::uint64_t) {
    std::vector<std::uint64_t> cand;
    for (const auto& r : rows)
      if (r.seq >= sinks) cand.push_back(r.seq);
    std::sort(cand.begin(), cand.end());  // oldest non-sink first
    cand.resize(need);
    return cand;
  }
};

struct H2ORule {
  std::size_t sinks, recent;
  std::vector<std::uint64_t> pick(int, int, const Rows& rows, std::size_t need,
                                  std::uint64_t incoming) {
    std::vector<std::pair<float, std::uint64_t>> cand;
    for (const auto& r : rows)
      if (!protected_row(r, sinks, recent, incoming)) cand.push_back({r.score, r.seq});
    std::sort(cand.begin(), cand.end());  // lowest score, then oldest
    std::vector<std::uint64_t> out;
    for (std::size_t i = 0; i < need; ++i) out.push_back(cand.at(i).second);
    return out;
  }
};

struct KNormRule {
  std::size_t sinks, recent;
  std::vector<std::uint64_t> pick(int, int, const Rows& rows, std::size_t need,
                                  std::uint64_t incoming) {
    std::vector<std::pair<float, std::uint64_t>> cand;
    for (const auto& r : rows)
      if (!protected_row(r, sinks, recent, incoming)) cand.push_back({-r.norm, r.seq});
    std::sort(cand.begin(), cand.end());  // largest norm, then oldest
    std::vector<std::uint64_t> out;
    for (std::size_t i = 0; i < need; ++i) out.push_back(cand.at(i).second);
    return out;
  }
};

// Documented rule: per (layer, kv head) a mt19937_64 seeded with stream_seed(seed, index);
// each victim is the k-th remaining eligible row in arrival order, k = rng() % count.
struct RandomRule {
  std::uint64_t seed;
  std::size_t sinks, recent;
  int n_kv_heads;
  std::map<int, std::mt19937_64> rngs;
  std::vector<std::uint64_t> pick(int layer, int head, const Rows& rows, std::size_t need,
                                  std::uint64_t incoming) {
    const int index = layer * n_kv_heads + head;
    auto it = rngs.find(index);
    if (it == rngs.end())
      it = rngs.emplace(index, std::mt19937_64(policies::Random::stream_seed(
                                   seed, static_cast<std::uint64_t>(index))))
               .first;
    std::vector<std::uint64_t> cand;
    for (const auto& r : rows)
      if (!protected_row(r, sinks, recent, incoming)) cand.push_back(r.seq);
    std::sort(cand.begin(), cand.end());
    std::vector<std::uint64_t> out;
    for (std::size_t i = 0; i < need; ++i) {
      const std::size_t k = static_cast<std::size_t>(it->second() % cand.size());
      out.push_back(cand[k]);
      cand.erase(cand.begin() + static_cast<std::ptrdiff_t>(k));
    }
    return out;
  }
};

struct NeverRule {
  std::vector<std::uint64_t> pick(int, int, const Rows&, std::size_t need, std::uint64_t) {
    REQUIRE(need == 0);
    return {};
  }
};

/// The whole cache, brute force: per (layer, kv head) an unordered list of rows.
template <class Rule>
class Reference {
 public:
  Reference(const Geometry& g, std::vector<std::size_t> caps, Rule rule)
      : g_(g),
        caps_(std::move(caps)),
        rule_(std::move(rule)),
        heads_(static_cast<std::size_t>(g.n_layers * g.n_kv_heads)),
        next_seq_(static_cast<std::size_t>(g.n_layers)) {}

  void append(int layer, std::int64_t pos, std::span<const float> keys) {
    const auto d = static_cast<std::size_t>(g_.head_dim);
    const std::uint64_t seq = next_seq_[static_cast<std::size_t>(layer)]++;
    for (int h = 0; h < g_.n_kv_heads; ++h) {
      auto& rows = at(layer, h);
      const std::size_t cap = caps_[index(layer, h)];
      if (rows.size() >= cap) evict(layer, h, rows.size() - cap + 1, seq);
      RefRow r;
      r.seq = seq;
      r.pos = pos;
      r.key.assign(keys.begin() + static_cast<std::ptrdiff_t>(h * d),
                   keys.begin() + static_cast<std::ptrdiff_t>((h + 1) * d));
      float s = 0.0f;
      for (float x : r.key) s += x * x;
      r.norm = std::sqrt(s);
      rows.push_back(std::move(r));
    }
  }

  void set_caps(std::vector<std::size_t> caps) {
    caps_ = std::move(caps);
    for (int l = 0; l < g_.n_layers; ++l)
      for (int h = 0; h < g_.n_kv_heads; ++h) {
        auto& rows = at(l, h);
        const std::size_t cap = caps_[index(l, h)];
        if (rows.size() > cap)
          evict(l, h, rows.size() - cap, next_seq_[static_cast<std::size_t>(l)]);
      }
  }

  /// Adds this step's group-summed attention of the row with arrival index `seq`.
  void add_score(int layer, int h, std::uint64_t seq, float summed) {
    for (auto& r : at(layer, h))
      if (r.seq == seq) {
        r.score += summed;
        return;
      }
    FAIL("attention for a row the reference does not hold");
  }
  RefRow& row(int layer, int h, std::uint64_t seq) {
    for (auto& r : at(layer, h))
      if (r.seq == seq) return r;
    FAIL("no such row");
    throw;
  }

  std::vector<std::int64_t> kept(int layer, int h) const {
    std::vector<std::int64_t> p;
    for (const auto& r : heads_[index(layer, h)]) p.push_back(r.pos);
    std::sort(p.begin(), p.end());
    return p;
  }
  Rows& at(int layer, int h) { return heads_[index(layer, h)]; }
  std::size_t evictions = 0;

 private:
  std::size_t index(int layer, int h) const {
    return static_cast<std::size_t>(layer * g_.n_kv_heads + h);
  }
  void evict(int layer, int h, std::size_t need, std::uint64_t incoming) {
    auto& rows = at(layer, h);
    const auto victims = rule_.pick(layer, h, rows, need, incoming);
    REQUIRE(victims.size() == need);
    for (auto seq : victims) {
      auto it =
          std::find_if(rows.begin(), rows.end(), [&](const RefRow& r) { return r.seq == seq; });
      REQUIRE(it != rows.end());
      rows.erase(it);
      ++evictions;
    }
  }

  Geometry g_;
  std::vector<std::size_t> caps_;
  Rule rule_;
  std::vector<Rows> heads_;
  std::vector<std::uint64_t> next_seq_;
};

/// Feeds the same random sequence to the cache and the reference; compares the kept
/// positions of every head after every step.
template <class Policy, class Rule>
void agree(std::uint64_t seed, Policy policy, Rule rule, bool bounded, int steps) {
  Rng rng(seed);
  const Geometry g = kvtest::random_geometry(rng);
  INFO("seed " << seed << " geometry L" << g.n_layers << " H" << g.n_heads << " Hkv" << g.n_kv_heads
               << " d" << g.head_dim);
  const std::size_t lo = policy.min_capacity(), hi = lo + 16;
  std::vector<std::size_t> caps(static_cast<std::size_t>(g.n_layers * g.n_kv_heads),
                                Budget::kUnbounded);
  const Budget budget =
      bounded ? kvtest::random_budget(rng, g, lo, hi, &caps) : Budget::unbounded();
  KVCache<Policy> cache(g, budget, policy);
  Reference<Rule> ref(g, caps, std::move(rule));
  constexpr bool observes = has(Policy::signals, Signals::attention);
  const auto d = static_cast<std::size_t>(g.head_dim);
  const std::size_t kv = static_cast<std::size_t>(g.n_kv_heads) * d;
  const std::size_t qn = static_cast<std::size_t>(g.n_heads) * d;
  const int G = g.group();
  std::vector<std::int64_t> next_pos(static_cast<std::size_t>(g.n_layers), 0);
  double worst_prefill_score_error = 0.0;

  for (int step = 0; step < steps; ++step) {
    INFO("step " << step);
    const int layer = static_cast<int>(rng.uniform(0, g.n_layers - 1));
    auto& pos = next_pos[static_cast<std::size_t>(layer)];
    const auto op = rng.uniform(0, 99);
    if (op < 75) {
      const auto k = rng.normals(kv), v = rng.normals(kv), q = rng.normals(qn);
      cache.append(layer, pos, k, v);
      ref.append(layer, pos, k);
      if (rng.chance(0.85)) {
        // The reference accumulates exactly the probabilities attend() handed over, in the
        // same float order as AttentionView::summed (the probabilities themselves are
        // checked against a naive loop in test_attention).
        const auto r = attend(cache, layer, q);
        for (int h = 0; h < g.n_kv_heads && observes; ++h) {
          const auto& p = r.probs[static_cast<std::size_t>(h)];
          const auto seqs = cache.seqs(layer, h);
          for (std::size_t row = 0; row < seqs.size(); ++row) {
            float s = 0.0f;
            for (int gq = 0; gq < G; ++gq) s += p(gq, static_cast<Eigen::Index>(row));
            ref.add_score(layer, h, seqs[row], s);
          }
        }
      }
      pos += rng.uniform(1, 4);
    } else if (op < 88) {
      const std::size_t t =
          static_cast<std::size_t>(rng.uniform(1, static_cast<long long>(hi) + 6));
      const auto k = rng.normals(t * kv), v = rng.normals(t * kv), q = rng.normals(t * qn);
      cache.prefill(layer, pos, t, k, v, q);
      for (std::size_t i = 0; i < t; ++i) {
        ref.append(layer, pos + static_cast<std::int64_t>(i),
                   std::span<const float>(k).subspan(i * kv, kv));
        if (!observes) continue;
        // Prefill attends causally: token i's queries over the rows held after it arrived.
        for (int h = 0; h < g.n_kv_heads; ++h) {
          auto& rows = ref.at(layer, h);
          std::vector<float> keys;
          for (const auto& r : rows) keys.insert(keys.end(), r.key.begin(), r.key.end());
          const auto p = kvtest::naive_probs(
              keys.data(), rows.size(), d, q.data() + i * qn + static_cast<std::size_t>(h * G) * d,
              G, 1.0 / std::sqrt(double(d)));
          for (std::size_t j = 0; j < rows.size(); ++j) {
            float s = 0.0f;
            for (int gq = 0; gq < G; ++gq)
              s += static_cast<float>(p[static_cast<std::size_t>(gq)][j]);
            rows[j].score += s;
          }
        }
      }
      if constexpr (observes) {
        // Float vs double attention differs in the last bits: compare within tolerance,
        // then adopt the cache's exact scores so later decisions compare like with like.
        for (int h = 0; h < g.n_kv_heads; ++h) {
          const auto& sc = cache.policy().scores(layer, h);
          const auto seqs = cache.seqs(layer, h);
          for (std::size_t row = 0; row < seqs.size(); ++row) {
            auto& rr = ref.row(layer, h, seqs[row]);
            const double rel = std::abs(double(rr.score) - double(sc[row])) /
                               std::max(1.0, std::abs(double(sc[row])));
            worst_prefill_score_error = std::max(worst_prefill_score_error, rel);
            rr.score = sc[row];
          }
        }
      }
      pos += static_cast<std::int64_t>(t);
    } else if (bounded) {
      const Budget b = kvtest::random_budget(rng, g, lo, hi, &caps);
      cache.set_budget(b);
      ref.set_caps(caps);
    }
    bool same = true;
    for (int l = 0; l < g.n_layers; ++l)
      for (int h = 0; h < g.n_kv_heads; ++h)
        if (kvtest::sorted_positions(cache, l, h) != ref.kept(l, h)) {
          INFO("layer " << l << " head " << h);
          CHECK(kvtest::sorted_positions(cache, l, h) == ref.kept(l, h));
          same = false;
        }
    REQUIRE(same);
  }
  CHECK(worst_prefill_score_error < 1e-5);
  if (bounded) CHECK(ref.evictions > 50);
}

const std::uint64_t kSeeds[] = {101, 102, 103, 104, 105, 106};
constexpr int kSteps = 250;

}  // namespace

TEST_CASE("StreamingLLM agrees with the brute-force rule", "[baselines]") {
  for (auto seed : kSeeds) {
    const std::size_t sinks = static_cast<std::size_t>(seed % 5);
    agree(seed, policies::StreamingLLM{sinks}, StreamingRule{sinks}, true, kSteps);
  }
}

TEST_CASE("H2O agrees with the brute-force rule (GQA: summed over the group)", "[baselines]") {
  for (auto seed : kSeeds) {
    const policies::H2O::Config c{static_cast<std::size_t>(seed % 4),
                                  static_cast<std::size_t>(seed % 3)};
    agree(seed, policies::H2O(c), H2ORule{c.sinks, c.recent}, true, kSteps);
  }
}

TEST_CASE("KNorm agrees with the brute-force rule", "[baselines]") {
  for (auto seed : kSeeds) {
    const policies::KNorm::Config c{static_cast<std::size_t>(seed % 3),
                                    static_cast<std::size_t>(seed % 4)};
    agree(seed, policies::KNorm(c), KNormRule{c.sinks, c.recent}, true, kSteps);
  }
}

TEST_CASE("Random agrees with its documented choice rule", "[baselines]") {
  for (auto seed : kSeeds) {
    Rng probe(seed);  // random_geometry's first draws: recover n_kv_heads for the rule
    const Geometry g = kvtest::random_geometry(probe);
    const policies::Random::Config c{seed * 31, static_cast<std::size_t>(seed % 3),
                                     static_cast<std::size_t>(seed % 4)};
    agree(seed, policies::Random(c), RandomRule{c.seed, c.sinks, c.recent, g.n_kv_heads, {}}, true,
          kSteps);
  }
}

TEST_CASE("FullCache and Oracle never evict", "[baselines]") {
  for (auto seed : {107, 108}) {
    agree(seed, policies::FullCache{}, NeverRule{}, false, 120);
    agree(seed, policies::Oracle{4}, NeverRule{}, false, 120);
  }
}

// --- small hand-worked cases ------------------------------------------------------------

namespace {
std::vector<float> filled(std::size_t n, float x) { return std::vector<float>(n, x); }
}  // namespace

TEST_CASE("StreamingLLM by hand: 2 sinks and a window of 3", "[baselines]") {
  KVCache<policies::StreamingLLM> cache({1, 1, 1, 2}, Budget::uniform(5),
                                        policies::StreamingLLM{2});
  for (int t = 0; t < 10; ++t) cache.append(0, 100 + t, filled(2, float(t)), filled(2, 0.0f));
  REQUIRE(kvtest::sorted_positions(cache, 0, 0) ==
          std::vector<std::int64_t>{100, 101, 107, 108, 109});
}

TEST_CASE("H2O sums the G query heads of a group (not max, not one head)", "[baselines]") {
  // G = 4, budget 3, no recent window: the 4th token forces one eviction among rows 0-2.
  // Row 0 takes all of head 0's attention (sum 1.0, max 1.0), row 1 an even share of
  // heads 1-3 (sum 1.2, max 0.4), row 2 the rest (sum 1.8, max 0.6).
  // Summing evicts row 0; a max rule would evict row 1.
  const Geometry g{1, 4, 1, 2};
  KVCache<policies::H2O> cache(g, Budget::uniform(3), policies::H2O({0, 0}));
  for (int t = 0; t < 3; ++t) cache.append(0, t, filled(2, float(t)), filled(2, 0.0f));
  std::vector<float> probs = {1.0f, 0.0f, 0.0f,   // head 0 over rows 0, 1, 2
                              0.0f, 0.4f, 0.6f,   // head 1
                              0.0f, 0.4f, 0.6f,   // head 2
                              0.0f, 0.4f, 0.6f};  // head 3
  // Rows are in arrival order here (no eviction yet).
  REQUIRE(std::vector<std::int64_t>(cache.positions(0, 0).begin(), cache.positions(0, 0).end()) ==
          std::vector<std::int64_t>{0, 1, 2});
  cache.observe(0, 0, probs);
  const auto& sc = cache.policy().scores(0, 0);
  REQUIRE(sc[0] == Approx(1.0f));
  REQUIRE(sc[1] == Approx(1.2f));
  REQUIRE(sc[2] == Approx(1.8f));
  cache.append(0, 3, filled(2, 3.0f), filled(2, 0.0f));
  REQUIRE(kvtest::sorted_positions(cache, 0, 0) == std::vector<std::int64_t>{1, 2, 3});
  // The newcomer starts at 0 and, with no recent window, is the next to go.
  cache.append(0, 4, filled(2, 4.0f), filled(2, 0.0f));
  REQUIRE(kvtest::sorted_positions(cache, 0, 0) == std::vector<std::int64_t>{1, 2, 4});
}

TEST_CASE("H2O's recent window protects the newest rows even with zero score", "[baselines]") {
  KVCache<policies::H2O> cache({1, 1, 1, 1}, Budget::uniform(4), policies::H2O({2, 0}));
  for (int t = 0; t < 4; ++t) cache.append(0, t, filled(1, 0.0f), filled(1, 0.0f));
  cache.observe(0, 0, std::vector<float>{0.7f, 0.1f, 0.1f, 0.1f});
  cache.append(0, 4, filled(1, 0.0f), filled(1, 0.0f));
  // Rows 2 and 3 are recent; among 0 and 1, row 1 has the lower score.
  REQUIRE(kvtest::sorted_positions(cache, 0, 0) == std::vector<std::int64_t>{0, 2, 3, 4});
}

TEST_CASE("KNorm by hand: the largest key norm leaves first, ties oldest first", "[baselines]") {
  KVCache<policies::KNorm> cache({1, 1, 1, 2}, Budget::uniform(3), policies::KNorm({1, 0}));
  cache.append(0, 0, std::vector<float>{9, 9}, filled(2, 0));  // sink: never evicted
  cache.append(0, 1, std::vector<float>{3, 4}, filled(2, 0));  // norm 5
  cache.append(0, 2, std::vector<float>{4, 3}, filled(2, 0));  // norm 5 (a tie)
  cache.append(0, 3, std::vector<float>{0, 1}, filled(2, 0));  // evicts the older of the tie
  REQUIRE(kvtest::sorted_positions(cache, 0, 0) == std::vector<std::int64_t>{0, 2, 3});
  cache.append(0, 4, std::vector<float>{0, 2}, filled(2, 0));  // evicts norm 5 over norm 1
  REQUIRE(kvtest::sorted_positions(cache, 0, 0) == std::vector<std::int64_t>{0, 3, 4});
}

TEST_CASE("Random: same seed, same choices; heads draw from independent streams", "[baselines]") {
  const Geometry g{1, 2, 2, 1};
  auto run = [&](std::uint64_t seed) {
    KVCache<policies::Random> cache(g, Budget::uniform(8), policies::Random({seed, 0, 0}));
    for (int t = 0; t < 64; ++t) cache.append(0, t, filled(2, 1.0f), filled(2, 1.0f));
    return std::pair{kvtest::sorted_positions(cache, 0, 0), kvtest::sorted_positions(cache, 0, 1)};
  };
  const auto a = run(1), b = run(1), c = run(2);
  REQUIRE(a == b);
  REQUIRE(a != c);
  REQUIRE(a.first != a.second);  // identical rows, different per-head streams
}

TEST_CASE("detail::Mt19937_64 draws std::mt19937_64's sequence and reads and writes its text",
          "[baselines]") {
  // Random's and SimHash's generator (random_engine.hpp, issue 19: no <random> in kvevict).
  for (std::uint64_t seed : {std::uint64_t{0}, std::uint64_t{5489}, policies::Random::stream_seed(7, 3),
                             ~std::uint64_t{0}}) {
    std::mt19937_64 want(seed);
    kvevict::detail::Mt19937_64 got(seed);
    for (int i = 0; i < 1000; ++i) REQUIRE(got() == want());  // three twists of the state
    // Mid-block: the same text as std's operator<<, and each reads the other's.
    std::ostringstream a, b;
    a << want;
    got.save(b);
    REQUIRE(a.str() == b.str());
    std::istringstream in(a.str());
    kvevict::detail::Mt19937_64 back;
    back.load(in);
    REQUIRE(!in.fail());
    for (int i = 0; i < 400; ++i) REQUIRE(back() == want());
  }
  kvevict::detail::Mt19937_64 fresh;  // the default seed, saved before the first draw
  std::ostringstream a, b;
  a << std::mt19937_64{};
  fresh.save(b);
  REQUIRE(a.str() == b.str());
}

TEST_CASE("Oracle restricts attention to the top rows by group-summed mass (brute force)",
          "[baselines][oracle]") {
  Rng rng(77);
  for (const auto& [G, rows, limit] :
       {std::tuple{1, 20, 5}, std::tuple{4, 33, 8}, std::tuple{8, 10, 10}, std::tuple{2, 6, 9}}) {
    INFO("G " << G << " rows " << rows << " limit " << limit);
    const int hkv = 2, d = 8;
    const Geometry g{1, G * hkv, hkv, d};
    KVCache<policies::Oracle> cache(g, Budget::unbounded(), policies::Oracle{std::size_t(limit)});
    for (int t = 0; t < rows; ++t)
      cache.append(0, t, rng.normals(std::size_t(hkv * d), 2.0f),
                   rng.normals(std::size_t(hkv * d)));
    const auto q = rng.normals(std::size_t(G * hkv * d), 2.0f);
    const auto r = attend(cache, 0, q);
    for (int h = 0; h < hkv; ++h) {
      const auto k = cache.keys(0, h);
      const auto v = cache.values(0, h);
      const auto p = kvtest::naive_probs(k.data(), std::size_t(rows), d, q.data() + h * G * d, G,
                                         1.0 / std::sqrt(double(d)));
      // Plain top-`limit` by mass summed over the group, ties to the lower row.
      std::vector<std::pair<double, int>> mass;
      for (int i = 0; i < rows; ++i) {
        double m = 0;
        for (int gq = 0; gq < G; ++gq) m += p[gq][i];
        mass.push_back({-m, i});
      }
      std::sort(mass.begin(), mass.end());
      std::vector<bool> keep(std::size_t(rows), false);
      for (int i = 0; i < std::min(limit, rows); ++i) keep[std::size_t(mass[i].second)] = true;
      for (int gq = 0; gq < G; ++gq) {
        double z = 0;
        for (int i = 0; i < rows; ++i) z += keep[i] ? p[gq][i] : 0.0;
        for (int i = 0; i < rows; ++i) {
          const double expect = keep[i] ? p[gq][i] / z : 0.0;
          REQUIRE(r.probs[h](gq, i) == Approx(expect).margin(1e-6));
        }
        for (int j = 0; j < d; ++j) {
          double o = 0;
          for (int i = 0; i < rows; ++i) o += (keep[i] ? p[gq][i] / z : 0.0) * v(i, j);
          REQUIRE(r.out(h * G + gq, j) == Approx(o).margin(1e-5));
        }
      }
    }
  }
}

TEST_CASE("Oracle ceilings of the paged layouts: whole blocks, shared cells (brute force)",
          "[baselines][oracle]") {
  Rng rng(91);
  // (G, rows, limit, block, shared)
  for (const auto& [G, rows, limit, block, shared] :
       {std::tuple{2, 37, 16, 4, false}, std::tuple{4, 40, 19, 8, false}, std::tuple{1, 23, 6, 1, true},
        std::tuple{2, 50, 16, 4, true}, std::tuple{4, 12, 12, 3, true}, std::tuple{2, 9, 8, 8, false}}) {
    INFO("G " << G << " rows " << rows << " limit " << limit << " block " << block << " shared " << shared);
    const int hkv = 3, d = 8;
    const Geometry g{1, G * hkv, hkv, d};
    const policies::Oracle oracle{.rows = std::size_t(limit), .block_tokens = std::size_t(block), .shared = shared};
    KVCache<policies::Oracle> cache(g, Budget::unbounded(), oracle);
    for (int t = 0; t < rows; ++t)
      cache.append(0, t, rng.normals(std::size_t(hkv * d), 2.0f), rng.normals(std::size_t(hkv * d)));
    const auto q = rng.normals(std::size_t(G * hkv * d), 2.0f);
    const auto r = attend(cache, 0, q);
    const auto ref = kvevict::detail::attend_reference(cache, 0, q);
    std::vector<std::vector<std::vector<double>>> p;  // [head][query][row]
    for (int h = 0; h < hkv; ++h)
      p.push_back(kvtest::naive_probs(cache.keys(0, h).data(), std::size_t(rows), d, q.data() + h * G * d,
                                      G, 1.0 / std::sqrt(double(d))));
    const int units = (rows + block - 1) / block, kept = limit / block;
    for (int h = 0; h < hkv; ++h) {
      // Units of `block` rows by mass summed over the group (and over every head when
      // shared); the top limit / block units kept, ties to the lower unit.
      std::vector<std::pair<double, int>> mass;
      for (int u = 0; u < units; ++u) {
        double m = 0;
        for (int hh = 0; hh < hkv; ++hh) {
          if (!shared && hh != h) continue;
          for (int i = u * block; i < std::min(rows, (u + 1) * block); ++i)
            for (int gq = 0; gq < G; ++gq) m += p[std::size_t(hh)][std::size_t(gq)][std::size_t(i)];
        }
        mass.push_back({-m, u});
      }
      std::sort(mass.begin(), mass.end());
      std::vector<bool> keep(std::size_t(rows), kept >= units);
      for (int k = 0; k < std::min(kept, units); ++k)
        for (int i = mass[std::size_t(k)].second * block; i < std::min(rows, (mass[std::size_t(k)].second + 1) * block); ++i)
          keep[std::size_t(i)] = true;
      const auto v = cache.values(0, h);
      for (int gq = 0; gq < G; ++gq) {
        const auto& pg = p[std::size_t(h)][std::size_t(gq)];
        double z = 0;
        for (int i = 0; i < rows; ++i) z += keep[std::size_t(i)] ? pg[std::size_t(i)] : 0.0;
        for (int i = 0; i < rows; ++i) {
          const double expect = keep[std::size_t(i)] ? pg[std::size_t(i)] / z : 0.0;
          REQUIRE(r.probs[std::size_t(h)](gq, i) == Approx(expect).margin(1e-6));
          REQUIRE(ref.probs[std::size_t(h)](gq, i) == Approx(expect).margin(1e-6));
        }
        for (int j = 0; j < d; ++j) {
          double o = 0;
          for (int i = 0; i < rows; ++i) o += (keep[std::size_t(i)] ? pg[std::size_t(i)] / z : 0.0) * v(i, j);
          REQUIRE(r.out(h * G + gq, j) == Approx(o).margin(1e-5));
          REQUIRE(ref.out(h * G + gq, j) == Approx(o).margin(1e-5));
        }
      }
    }
  }
  const Geometry g{1, 2, 2, 4};
  CHECK_THROWS_WITH(KVCache<policies::Oracle>(g, Budget::unbounded(), policies::Oracle{.rows = 4, .block_tokens = 5}),
                    Catch::Contains("Oracle: block_tokens = 5, expected 1..rows (4)"));
}
