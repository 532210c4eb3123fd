#pragma once
// Shared helpers for kvevict's tests: seeded random streams, a ledger of every appended
// row (the ground truth kept and evicted rows are checked against), full-state snapshots
// of a cache (for the strong exception guarantee) and a naive attention reference.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <kvevict/kvevict.hpp>
#include <map>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace kvtest {

/// Seeded stream of test data; every test names its seed so a failure reproduces.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : gen_(seed) {}
  float normal(float scale = 1.0f) {
    return scale * std::normal_distribution<float>(0.0f, 1.0f)(gen_);
  }
  std::vector<float> normals(std::size_t n, float scale = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = normal(scale);
    return v;
  }
  /// Uniform integer in [lo, hi].
  long long uniform(long long lo, long long hi) {
    return std::uniform_int_distribution<long long>(lo, hi)(gen_);
  }
  bool chance(double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(gen_) < p; }
  std::mt19937_64& engine() { return gen_; }

 private:
  std::mt19937_64 gen_;
};

/// splitmix64's finaliser: a stateless hash of an integer, for test data indexed by
/// (step, token, head) that must not depend on the order it is drawn in.
inline std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// The text of an ostringstream reached through operator<< (which returns std::ostream&).
inline std::string str(std::ostream& os) { return static_cast<std::ostringstream&>(os).str(); }

using RowId = std::tuple<int, int, std::int64_t>;  // layer, kv head, position

/// Every row ever appended, by (layer, kv head, position), and every row the eviction
/// callback reported. Checks bit-exactness and "exactly once" as rows are reported.
class Ledger {
 public:
  struct Row {
    std::vector<float> key, value;
    std::uint64_t seq = 0;
  };

  /// Records one token (n_kv_heads x d keys/values) of `layer` at `position`.
  void record(const kvevict::Geometry& g, int layer, std::int64_t position, std::uint64_t seq,
              std::span<const float> keys, std::span<const float> values) {
    const auto d = static_cast<std::size_t>(g.head_dim);
    for (int h = 0; h < g.n_kv_heads; ++h) {
      Row r;
      r.key.assign(keys.begin() + static_cast<std::ptrdiff_t>(h * d),
                   keys.begin() + static_cast<std::ptrdiff_t>((h + 1) * d));
      r.value.assign(values.begin() + static_cast<std::ptrdiff_t>(h * d),
                     values.begin() + static_cast<std::ptrdiff_t>((h + 1) * d));
      r.seq = seq;
      const bool fresh = appended.emplace(RowId{layer, h, position}, std::move(r)).second;
      REQUIRE(fresh);
    }
  }

  /// Callback to install on a cache; counts every evicted row and checks its contents.
  template <class Scalar>
  auto callback() {
    return [this](const kvevict::EvictedRow<Scalar>& e) {
      const RowId id{e.layer, e.kv_head, e.position};
      if (++evicted[id] > 1) ++repeated_evictions;
      auto it = appended.find(id);
      if (it == appended.end()) {
        ++unknown_evictions;
        return;
      }
      if (e.seq != it->second.seq || !same(e.key, it->second.key) ||
          !same(e.value, it->second.value))
        ++corrupt_evictions;
    };
  }

  template <class Scalar>
  static bool same(std::span<const Scalar> a, const std::vector<float>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (a[i] != static_cast<Scalar>(b[i])) return false;
    return true;
  }

  std::map<RowId, Row> appended;
  std::map<RowId, int> evicted;
  int unknown_evictions = 0;
  int corrupt_evictions = 0;
  int repeated_evictions = 0;
};

/// Checks the kept rows of every head against the ledger: sizes within capacity and
/// allocation, unique positions, bit-exact rows, and (optionally) kept ∪ evicted = appended
/// with no row both kept and evicted, no row evicted twice. Returns the first violation
/// found ("" when none): one assertion per call keeps long sequences fast in Debug.
template <class Cache>
std::string ledger_violation(const Cache& cache, const Ledger& ledger, bool check_partition) {
  using S = typename Cache::scalar_type;
  const auto& g = cache.geometry();
  const auto d = static_cast<std::size_t>(g.head_dim);
  std::set<RowId> kept;
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) {
      auto fail = [&](auto&&... parts) {
        std::ostringstream os;
        os << "layer " << l << " head " << h << ": ";
        (os << ... << parts);
        return os.str();
      };
      const std::size_t n = cache.size(l, h);
      // Pooled budgets (Budget::pooled()): a head may hold up to max_rows, and its storage
      // may run one growth chunk past that.
      const std::size_t cap = cache.max_rows(l, h);
      const std::size_t slack = cache.pooled() ? kvevict::detail::pool_chunk(cache.capacity(l, h)) : 0;
      const std::size_t alloc = cache.allocated_rows(l, h);
      if (n > cap) return fail("size ", n, " > capacity ", cap);
      if (alloc > cap + slack || alloc < n)
        return fail("allocated ", alloc, " outside [size ", n, ", capacity ", cap, " + ", slack, "]");
      const auto pos = cache.positions(l, h);
      const auto seq = cache.seqs(l, h);
      const auto k = cache.keys(l, h);
      const auto v = cache.values(l, h);
      if (pos.size() != n || seq.size() != n || static_cast<std::size_t>(k.rows()) != n ||
          static_cast<std::size_t>(v.rows()) != n)
        return fail("views disagree with size ", n);
      for (std::size_t r = 0; r < n; ++r) {
        const RowId id{l, h, pos[r]};
        if (!kept.insert(id).second) return fail("position ", pos[r], " repeated");
        if (ledger.evicted.count(id) != 0) return fail("position ", pos[r], " kept and evicted");
        auto it = ledger.appended.find(id);
        if (it == ledger.appended.end()) return fail("position ", pos[r], " never appended");
        if (seq[r] != it->second.seq)
          return fail("position ", pos[r], " has seq ", seq[r], ", appended as ", it->second.seq);
        const S* kr = k.data() + r * d;
        const S* vr = v.data() + r * d;
        for (std::size_t j = 0; j < d; ++j)
          if (kr[j] != static_cast<S>(it->second.key[j]) ||
              vr[j] != static_cast<S>(it->second.value[j]))
            return fail("position ", pos[r], " differs from what was appended at column ", j);
      }
    }
  std::ostringstream err;
  if (ledger.unknown_evictions != 0)
    return str(err << ledger.unknown_evictions << " evicted rows were never appended");
  if (ledger.corrupt_evictions != 0)
    return str(err << ledger.corrupt_evictions << " evicted rows differ from the appended ones");
  if (ledger.repeated_evictions != 0)
    return str(err << ledger.repeated_evictions << " rows reached the callback more than once");
  // kept and evicted are disjoint subsets of appended (checked above): sizes settle equality.
  if (check_partition && kept.size() + ledger.evicted.size() != ledger.appended.size())
    return str(err << kept.size() << " kept + " << ledger.evicted.size()
                   << " evicted != " << ledger.appended.size() << " appended");
  return "";
}

template <class Cache>
void check_against_ledger(const Cache& cache, const Ledger& ledger, bool check_partition) {
  const std::string v = ledger_violation(cache, ledger, check_partition);
  INFO(v);
  REQUIRE(v.empty());
}

/// A random budget kind (uniform, per-layer, per-head) with counts in [lo, hi]; the
/// resolved capacity of every (layer, kv head) goes to *caps.
inline kvevict::Budget random_budget(Rng& rng, const kvevict::Geometry& g, std::size_t lo,
                                     std::size_t hi, std::vector<std::size_t>* caps = nullptr) {
  auto pick = [&] { return static_cast<long long>(rng.uniform((long long)lo, (long long)hi)); };
  std::vector<std::size_t> c;
  const auto kind = rng.uniform(0, 2);
  kvevict::Budget b = kvevict::Budget::unbounded();
  if (kind == 0) {
    const long long t = pick();
    b = kvevict::Budget::uniform(t);
    c.assign(static_cast<std::size_t>(g.n_layers * g.n_kv_heads), static_cast<std::size_t>(t));
  } else if (kind == 1) {
    std::vector<long long> v;
    for (int l = 0; l < g.n_layers; ++l) v.push_back(pick());
    b = kvevict::Budget::per_layer(v);
    for (int l = 0; l < g.n_layers; ++l)
      for (int h = 0; h < g.n_kv_heads; ++h) c.push_back(static_cast<std::size_t>(v[l]));
  } else {
    std::vector<std::vector<long long>> v(static_cast<std::size_t>(g.n_layers));
    for (auto& row : v)
      for (int h = 0; h < g.n_kv_heads; ++h) row.push_back(pick());
    b = kvevict::Budget::per_head(v);
    for (auto& row : v)
      for (auto x : row) c.push_back(static_cast<std::size_t>(x));
  }
  if (caps) *caps = c;
  return b;
}

/// A small random geometry: 1-3 layers, 1-3 KV heads, G in {1, 2, 4}, d in {1, 3, 8, 16}.
inline kvevict::Geometry random_geometry(Rng& rng) {
  kvevict::Geometry g;
  g.n_layers = static_cast<int>(rng.uniform(1, 3));
  g.n_kv_heads = static_cast<int>(rng.uniform(1, 3));
  const int groups[] = {1, 2, 4};
  g.n_heads = g.n_kv_heads * groups[rng.uniform(0, 2)];
  const int dims[] = {1, 3, 8, 16};
  g.head_dim = dims[rng.uniform(0, 3)];
  return g;
}

/// Positions kept in (layer, kv head), sorted.
template <class Cache>
std::vector<std::int64_t> sorted_positions(const Cache& cache, int layer, int kv_head) {
  auto p = cache.positions(layer, kv_head);
  std::vector<std::int64_t> v(p.begin(), p.end());
  std::sort(v.begin(), v.end());
  return v;
}

/// Everything observable about a cache, compared whole for the strong exception guarantee.
struct Snapshot {
  struct Head {
    std::size_t size = 0, capacity = 0, allocated = 0;
    std::vector<double> keys, values;
    std::vector<std::int64_t> positions;
    std::vector<std::uint64_t> seqs;
    bool operator==(const Head&) const = default;
  };
  std::vector<Head> heads;
  std::vector<std::uint64_t> seen;
  std::size_t bytes = 0;
  bool operator==(const Snapshot&) const = default;
};

template <class Cache>
Snapshot snapshot(const Cache& cache) {
  Snapshot s;
  const auto& g = cache.geometry();
  for (int l = 0; l < g.n_layers; ++l) {
    s.seen.push_back(cache.tokens_seen(l));
    for (int h = 0; h < g.n_kv_heads; ++h) {
      Snapshot::Head hd;
      hd.size = cache.size(l, h);
      hd.capacity = cache.capacity(l, h);
      hd.allocated = cache.allocated_rows(l, h);
      const auto k = cache.keys(l, h);
      const auto v = cache.values(l, h);
      for (Eigen::Index i = 0; i < k.size(); ++i) hd.keys.push_back(double(k.data()[i]));
      for (Eigen::Index i = 0; i < v.size(); ++i) hd.values.push_back(double(v.data()[i]));
      auto p = cache.positions(l, h);
      hd.positions.assign(p.begin(), p.end());
      auto q = cache.seqs(l, h);
      hd.seqs.assign(q.begin(), q.end());
      s.heads.push_back(std::move(hd));
    }
  }
  s.bytes = cache.allocated_bytes();
  return s;
}

/// Naive attention of the G query heads of one KV head over n rows (double precision):
/// probs[g][i] = softmax_i(q_g . k_i * scale).
inline std::vector<std::vector<double>> naive_probs(const float* keys, std::size_t n, std::size_t d,
                                                    const float* queries, int group, double scale) {
  std::vector<std::vector<double>> p(static_cast<std::size_t>(group), std::vector<double>(n));
  for (int g = 0; g < group; ++g) {
    auto& row = p[static_cast<std::size_t>(g)];
    double m = -INFINITY;
    for (std::size_t i = 0; i < n; ++i) {
      double s = 0.0;
      for (std::size_t j = 0; j < d; ++j)
        s += double(queries[static_cast<std::size_t>(g) * d + j]) * double(keys[i * d + j]);
      row[i] = s * scale;
      m = std::max(m, row[i]);
    }
    double z = 0.0;
    for (std::size_t i = 0; i < n; ++i) z += (row[i] = std::exp(row[i] - m));
    for (std::size_t i = 0; i < n; ++i) row[i] /= z;
  }
  return p;
}

}  // namespace kvtest
