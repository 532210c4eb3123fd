// The reference-exact options of the seed methods (issue 21), each against an independent
// transcription of the reference implementation's decision rule, written here from the
// rule's description (ALGORITHMS.md and the policy docs), not from the library:
//  - BUZZ, reference_timing: one arrival-ordered list per head; per step append, attend
//    (add the probabilities), then rebuild if the sample region exceeds T;
//  - HashEvict, reference_slots: a fixed array of slots; empty slots fill in order, the
//    farthest unprotected slot (lowest slot on ties) is overwritten by the new token;
//  - XKV, reference: the wait-list allocation over per-query-head sorted scores, with
//    Python's slice arithmetic, no floor and no stop when every candidate is taken;
//  - PyramidKV, pyramid_budgets_reference: the schedule with Python's integer division.
// Inputs are generated deterministically from fixed seeds (splitmix64 / mt19937 streams), so every
// run replays the same recorded streams; the expected decisions are computed by the
// transcriptions. The test cases tagged [measure] (hidden; run with
// `kvevict_test_reference_exact "[measure]"`) print the size of each default-mode
// difference from the reference on the same streams: the figures in docs/policies/*.md.
#include <algorithm>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <kvevict/cache.hpp>
#include <kvevict/kernels/simhash.hpp>
#include <kvevict/policies/buzz.hpp>
#include <kvevict/policies/hash_evict.hpp>
#include <kvevict/policies/xkv.hpp>
#include <kvevict/serialize.hpp>
#include <random>
#include <set>
#include <vector>

#include "support/test_support.hpp"

using kvevict::Budget;
using kvevict::Geometry;
using kvevict::KVCache;

namespace {

using kvtest::splitmix;
using Rng = kvtest::Rng;

// Share of identical (step, head) sets and the mean overlap |lib ∩ ref| / |ref|.
struct Agreement {
  std::size_t steps = 0, identical = 0;
  double overlap = 0.0;
  void add(std::vector<std::uint64_t> lib, std::vector<std::uint64_t> ref) {
    std::sort(lib.begin(), lib.end());
    std::sort(ref.begin(), ref.end());
    std::vector<std::uint64_t> both;
    std::set_intersection(lib.begin(), lib.end(), ref.begin(), ref.end(), std::back_inserter(both));
    ++steps;
    identical += lib == ref ? 1 : 0;
    overlap += ref.empty() ? 1.0 : static_cast<double>(both.size()) / static_cast<double>(ref.size());
  }
  [[nodiscard]] double identical_share() const {
    return static_cast<double>(identical) / static_cast<double>(steps);
  }
  [[nodiscard]] double mean_overlap() const { return overlap / static_cast<double>(steps); }
};

// ---------------------------------------------------------------------------------------
// BUZZ: the reference's per-step order (append, attention, rebuild check), per query head.
struct BuzzRef {
  std::size_t S, W, T, s;
  struct Row {
    std::uint64_t seq;
    float score;
  };
  std::vector<Row> rows;  // arrival order, as the reference's tensors
  std::size_t cur = 0;    // the reference's cur_sample_size
  std::size_t rebuilds = 0;

  void after_attention() {
    if (rows.size() - S - W <= T || rows.size() < S + W) return;
    const std::size_t f = (s + 1) / 2, n = rows.size();
    std::vector<Row> out(rows.begin(), rows.begin() + static_cast<long>(S));
    for (auto& r : out) r.score = 0.0f;  // sinks restart at 0
    std::size_t kept = 0;
    for (std::size_t i = S; i < S + cur; i += f, ++kept) out.push_back({rows[i].seq, 0.0f});
    for (std::size_t lo = S + cur; lo < n - W; lo += s, ++kept) {
      const std::size_t hi = std::min(n - W, lo + s);
      std::size_t best = lo;
      for (std::size_t i = lo + 1; i < hi; ++i)
        if (rows[i].score > rows[best].score) best = i;  // first maximum wins
      out.push_back(rows[best]);
    }
    out.insert(out.end(), rows.end() - static_cast<long>(W), rows.end());
    rows = std::move(out);
    cur = kept;
    ++rebuilds;
  }
};

// Probabilities of query head g at step t over the attended seqs: small integers (exact
// float sums, frequent ties) or, with `softmax`, a softmax of random logits.
std::vector<float> buzz_probs(std::uint64_t salt, std::uint64_t t, std::vector<std::uint64_t> seqs,
                              int kh, int g, bool softmax) {
  std::vector<float> p(seqs.size());
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const std::uint64_t h = splitmix(salt ^ splitmix(t * 1000003u + seqs[i]) ^ splitmix(kh * 131u + g));
    p[i] = softmax ? static_cast<float>(h >> 40) / static_cast<float>(1ull << 24) * 6.0f
                   : static_cast<float>(h % 4);
  }
  if (softmax) {  // normalised in seq order, so both sides get the same floats
    std::vector<std::size_t> order(p.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](auto a, auto b) { return seqs[a] < seqs[b]; });
    float mx = *std::max_element(p.begin(), p.end()), z = 0.0f;
    for (auto& x : p) x = std::exp(x - mx);
    for (std::size_t i : order) z += p[i];
    for (auto& x : p) x /= z;
  }
  return p;
}

// Runs the library (both timings) and the transcription on the same stream; the set each
// query attends over and the scores are compared at every step.
Agreement buzz_run(const kvevict::policies::BuzzBeehive::Config& base, int group, std::size_t steps,
                   std::uint64_t salt, bool reference_timing, bool softmax,
                   std::size_t* rebuilds = nullptr) {
  using kvevict::policies::BuzzBeehive;
  const Geometry g{1, 2 * group, 2, 4};
  BuzzBeehive::Config c = base;
  c.reference_timing = reference_timing;
  KVCache<BuzzBeehive> cache(g, Budget::unbounded(), BuzzBeehive(c));
  std::vector<BuzzRef> ref(2, BuzzRef{c.sinks, c.window, c.threshold, c.stride, {}, 0, 0});
  Rng rng(salt);
  Agreement agree;
  for (std::uint64_t t = 0; t < steps; ++t) {
    const auto k = rng.normals(8), v = rng.normals(8);
    cache.append(0, static_cast<std::int64_t>(t), k, v);
    for (int kh = 0; kh < 2; ++kh) {
      BuzzRef& r = ref[static_cast<std::size_t>(kh)];
      r.rows.push_back({t, 0.0f});
      const auto seqs = cache.seqs(0, kh);
      std::vector<std::uint64_t> want;
      for (const auto& row : r.rows) want.push_back(row.seq);
      agree.add({seqs.begin(), seqs.end()}, want);
      // Attention over each side's own rows, the same probability for the same token.
      std::vector<float> probs;
      for (int j = 0; j < group; ++j) {
        const auto p = buzz_probs(salt, t, {seqs.begin(), seqs.end()}, kh, j, softmax);
        probs.insert(probs.end(), p.begin(), p.end());
      }
      cache.observe(0, kh, probs);
      std::vector<float> add(r.rows.size(), 0.0f);
      for (int j = 0; j < group; ++j) {
        const auto p = buzz_probs(salt, t, want, kh, j, softmax);
        for (std::size_t i = 0; i < add.size(); ++i) add[i] += p[i];  // group sum, then add
      }
      for (std::size_t i = 0; i < add.size(); ++i) r.rows[i].score += add[i];
      if (reference_timing) {  // same rows: the scores must agree bit for bit
        std::vector<std::pair<std::uint64_t, float>> lib, exp;
        const auto& sc = cache.policy().scores(0, kh);
        for (std::size_t i = 0; i < seqs.size(); ++i) lib.push_back({seqs[i], sc[i]});
        for (const auto& row : r.rows) exp.push_back({row.seq, row.score});
        std::sort(lib.begin(), lib.end());
        INFO("step " << t << " kv head " << kh);
        if (lib != exp)
          for (std::size_t i = 0; i < std::min(lib.size(), exp.size()); ++i)
            if (lib[i] != exp[i])
              UNSCOPED_INFO("seq " << lib[i].first << " lib " << lib[i].second << " / seq "
                                   << exp[i].first << " ref " << exp[i].second);
        REQUIRE(lib == exp);
      }
      r.after_attention();
    }
  }
  if (rebuilds != nullptr) *rebuilds = ref[0].rebuilds;
  return agree;
}

// ---------------------------------------------------------------------------------------
// HashEvict: the reference's fixed slot array.
struct HashRef {
  struct Slot {
    std::uint64_t seq;
    std::vector<std::uint8_t> code;
  };
  std::size_t cap, sinks, recent;
  std::vector<Slot> slots;
  std::size_t evictions = 0, tied = 0;

  void step(std::uint64_t seq, std::vector<std::uint8_t> code) {
    if (slots.size() < cap) {
      slots.push_back({seq, std::move(code)});
      return;
    }
    int best = -1;
    std::size_t at = 0, ties = 0;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const std::uint64_t q = slots[i].seq;
      if (q < sinks || q + recent >= seq) continue;  // first tokens and the last `recent`
      int d = 0;
      for (std::size_t b = 0; b < code.size(); ++b)
        d += std::popcount(static_cast<unsigned>(slots[i].code[b] ^ code[b]));
      if (d > best) {
        best = d;
        at = i;
        ties = 1;
      } else if (d == best) {
        ++ties;
      }
    }
    ++evictions;
    tied += ties > 1 ? 1 : 0;
    slots[at] = {seq, std::move(code)};  // the new token takes the evicted slot
  }
  [[nodiscard]] std::vector<std::uint64_t> seqs() const {
    std::vector<std::uint64_t> s;
    for (const auto& x : slots) s.push_back(x.seq);
    return s;
  }
};

using HashKey = kvevict::policies::HashEvictKey;

struct HashStats {
  Agreement agree;
  std::size_t evictions = 0, tied = 0;
};

// With `prompt` > 0 the stream opens with a prompt of that many tokens through prefill
// (PrefillRule::keep_ends when it exceeds C: the reference keeps the first sinks and the
// last C - sinks tokens, in token order, in slots 0..C-1), then decodes.
HashStats hash_run(int bits, std::size_t cap, std::size_t steps, int dim, std::uint64_t seed,
                   bool reference_slots, std::size_t prompt = 0) {
  const Geometry g{1, 4, 2, dim};
  HashKey::Config c;
  c.bits = bits;
  c.reference_slots = reference_slots;
  KVCache<HashKey> cache(g, Budget::uniform(static_cast<long long>(cap)), HashKey(c));
  kvevict::kernels::SimHashProjection proj(dim, bits < 8 ? 8 : bits,
                                           HashKey::layer_seed(c.seed, 0));
  std::vector<HashRef> ref(2, HashRef{cap, c.sinks, c.recent, {}, 0, 0});
  Rng rng(seed);
  HashStats st;
  auto code_of = [&](const float* x) {
    std::vector<std::uint8_t> code(static_cast<std::size_t>(bits / 8));
    proj.hash_one(x, code.data());
    return code;
  };
  if (prompt > 0) {
    const auto pk = rng.normals(prompt * static_cast<std::size_t>(2 * dim));
    const auto pv = rng.normals(prompt * static_cast<std::size_t>(2 * dim));
    cache.prefill(0, 0, prompt, pk, pv);
    for (int kh = 0; kh < 2; ++kh)
      for (std::size_t t = 0; t < prompt; ++t)
        if (prompt <= cap || t < c.sinks || t >= prompt - (cap - c.sinks))
          ref[static_cast<std::size_t>(kh)].slots.push_back(
              {t, code_of(pk.data() + (t * 2 + static_cast<std::size_t>(kh)) * dim)});
  }
  for (std::uint64_t t = prompt; t < prompt + steps; ++t) {
    const auto k = rng.normals(static_cast<std::size_t>(2 * dim));
    const auto v = rng.normals(static_cast<std::size_t>(2 * dim));
    cache.append(0, static_cast<std::int64_t>(t), k, v);
    for (int kh = 0; kh < 2; ++kh) {
      auto& r = ref[static_cast<std::size_t>(kh)];
      r.step(t, code_of(k.data() + kh * dim));
      const auto seqs = cache.seqs(0, kh);
      st.agree.add({seqs.begin(), seqs.end()}, r.seqs());
    }
  }
  for (const auto& r : ref) {
    st.evictions += r.evictions;
    st.tied += r.tied;
  }
  return st;
}

// ---------------------------------------------------------------------------------------
// XKV: the reference's wait list over per-head scores sorted ascending; slices follow
// Python's rules for negative indices (clamped at the front, empty when stop <= start).
struct XkvRef {
  std::vector<std::vector<std::vector<float>>> distri;  // [layer][head] ascending
  std::vector<double> layer_sum;

  explicit XkvRef(const std::vector<std::vector<std::vector<float>>>& pooled) {
    for (const auto& layer : pooled) {
      double sum = 0.0;
      distri.emplace_back();
      for (const auto& head : layer) {
        auto a = head;
        std::sort(a.begin(), a.end());
        distri.back().push_back(a);
      }
      // The layer's mass; summed in the order the library's prefix sums use (largest
      // per-rank gains first) so the divisor is the same double.
      const std::size_t n = layer[0].size();
      for (std::size_t k = 0; k < n; ++k) sum += slice(distri.back(), k + 1, k) * 1.0;
      layer_sum.push_back(sum);
    }
  }
  // Sum over heads of a[-(p+1):-p] (p >= 1), or a[-1:] for p = 0.
  static double slice(const std::vector<std::vector<float>>& heads, std::size_t hi_from_end,
                      std::size_t p) {
    double s = 0.0;
    for (const auto& a : heads) {
      const long long n = static_cast<long long>(a.size());
      long long lo = std::max(n - static_cast<long long>(hi_from_end), 0LL);
      long long hi = p == 0 ? n : std::max(n - static_cast<long long>(p), 0LL);
      for (long long i = lo; i < hi; ++i) s += a[static_cast<std::size_t>(i)];
    }
    return s;
  }
  double wait(std::size_t l, std::size_t position) const {
    if (layer_sum[l] <= 0.0) return 0.0;
    return slice(distri[l], position + 1, position) / layer_sum[l];
  }
  std::vector<long long> by_n(long long total) const {
    const std::size_t L = distri.size();
    std::vector<double> w(L);
    std::vector<long long> len(L, 0);
    for (std::size_t j = 0; j < L; ++j) w[j] = wait(j, 0);
    for (long long i = 0; i < total; ++i) {
      const auto id = static_cast<std::size_t>(std::max_element(w.begin(), w.end()) - w.begin());
      ++len[id];
      w[id] = wait(id, static_cast<std::size_t>(len[id]));
    }
    return len;
  }
  std::vector<long long> by_r(double target) const {
    const std::size_t L = distri.size();
    std::vector<double> w(L);
    std::vector<long long> len(L, 0);
    for (std::size_t j = 0; j < L; ++j) w[j] = wait(j, 0);
    double r = 0.0;
    while (target * static_cast<double>(L) > r) {
      const auto it = std::max_element(w.begin(), w.end());
      REQUIRE(*it > 0.0);  // the reference would loop forever
      r += *it;
      const auto id = static_cast<std::size_t>(it - w.begin());
      ++len[id];
      w[id] = wait(id, static_cast<std::size_t>(len[id]));
    }
    return len;
  }
};

// Random pooled scores [layer][head][token]; some layers get many zeros (exhausted gains).
std::vector<std::vector<std::vector<float>>> xkv_scores(std::mt19937& rng, int L, int H,
                                                        std::size_t n) {
  std::vector<std::vector<std::vector<float>>> s(static_cast<std::size_t>(L));
  std::exponential_distribution<float> e(1.0f);
  for (int l = 0; l < L; ++l) {
    const float scale = 0.2f + static_cast<float>(rng() % 100) / 25.0f;
    for (int h = 0; h < H; ++h) {
      std::vector<float> v(n);
      for (auto& x : v) x = (rng() % 7 == 0) ? 0.0f : std::pow(e(rng), 1.0f + scale);
      s[static_cast<std::size_t>(l)].push_back(v);
    }
  }
  return s;
}

kvevict::policies::XkvLayerAllocator xkv_allocator(
    const std::vector<std::vector<std::vector<float>>>& s, int H, int Hkv, bool reference) {
  kvevict::policies::XkvLayerAllocator::Config c;
  c.reference = reference;
  const Geometry g{static_cast<int>(s.size()), H, Hkv, 8};
  kvevict::policies::XkvLayerAllocator a(g, c);
  for (std::size_t l = 0; l < s.size(); ++l) a.set_layer_scores(static_cast<int>(l), s[l]);
  return a;
}

// ---------------------------------------------------------------------------------------
// PyramidKV: the schedule with Python's integer arithmetic.
long long pydiv(long long a, long long b) {
  long long q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
std::vector<long long> pyramid_ref(long long L, long long C, long long W, long long T,
                                   long long beta) {
  long long min_num = pydiv(C - W, beta);
  long long max_num = (C - W) * 2 - min_num;
  if (max_num >= T - W) {
    max_num = T - W;
    min_num = (C - W) * 2 - max_num;
  }
  const long long steps = pydiv(max_num - min_num, L - 1);
  std::vector<long long> out;
  for (long long l = 0; l < L; ++l) {
    if (T < C)
      out.push_back(std::max(T - W, 0LL));  // the whole prompt stays
    else if (T < (C - W) * 2)
      out.push_back(C - W);  // top-(C - W) in every layer
    else
      out.push_back(max_num - l * steps);
  }
  return out;
}

}  // namespace

// =======================================================================================

TEST_CASE("BUZZ reference_timing attends over the reference's rows at every step") {
  using kvevict::policies::BuzzBeehive;
  SECTION("reference defaults, MHA and GQA, integer and softmax probabilities") {
    for (int group : {1, 4})
      for (bool softmax : {false, true}) {
        std::size_t rebuilds = 0;
        const auto a = buzz_run(BuzzBeehive::Config{}, group, 2200, 7u + group + softmax, true,
                                softmax, &rebuilds);
        REQUIRE(a.identical == a.steps);
        REQUIRE(rebuilds >= 5);
      }
  }
  SECTION("small shapes, strides 3..6: many rebuilds") {
    for (std::size_t s : {3u, 4u, 5u, 6u}) {
      BuzzBeehive::Config c;
      c.sinks = 1 + s % 3;
      c.window = 2 + s;
      c.threshold = 8 + 3 * s;
      c.stride = s;
      std::size_t rebuilds = 0;
      const auto a = buzz_run(c, 1, 2500, 41u * s, true, s % 2 == 0, &rebuilds);
      REQUIRE(a.identical == a.steps);
      REQUIRE(rebuilds >= 50);
    }
  }
  SECTION("the default timing differs (the option changes decisions)") {
    const auto a = buzz_run(BuzzBeehive::Config{}, 1, 2200, 8u, false, true);
    REQUIRE(a.identical < a.steps);
  }
}

TEST_CASE("BUZZ reference_timing: configuration and save/restore") {
  using kvevict::policies::BuzzBeehive;
  BuzzBeehive::Config c;
  c.reference_timing = true;
  c.log_n = true;
  REQUIRE_THROWS_AS(BuzzBeehive(c), kvevict::Error);
  c.log_n = false;
  c.budget_mode = true;
  REQUIRE_THROWS_AS(BuzzBeehive(c), kvevict::Error);
  c.budget_mode = false;
  const Geometry g{1, 2, 2, 4};
  KVCache<BuzzBeehive> a(g, Budget::unbounded(), BuzzBeehive(c));
  Rng rng(3);
  auto step = [&](KVCache<BuzzBeehive>& x, std::int64_t t, const std::vector<float>& k,
                  const std::vector<float>& v) {
    x.append(0, t, k, v);
    for (int kh = 0; kh < 2; ++kh) {
      const auto seqs = x.seqs(0, kh);
      x.observe(0, kh, buzz_probs(5, static_cast<std::uint64_t>(t), {seqs.begin(), seqs.end()},
                                  kh, 0, true));
    }
  };
  // Save right after the step that triggers the first rebuild (seq 564): the head holds the
  // 565 not-yet-rebuilt rows and the rebuild is pending for the next append.
  std::int64_t t = 0;
  for (; t <= 564; ++t) step(a, t, rng.normals(8), rng.normals(8));
  REQUIRE(a.size(0, 0) == 565);
  KVCache<BuzzBeehive> b(g, Budget::unbounded(), BuzzBeehive(c));
  REQUIRE_NOTHROW(kvevict::load_bytes(b, kvevict::save_bytes(a)));
  for (; t < 1500; ++t) {
    const auto k = rng.normals(8), v = rng.normals(8);
    step(a, t, k, v);
    step(b, t, k, v);
    for (int kh = 0; kh < 2; ++kh) {
      const auto sa = a.seqs(0, kh), sb = b.seqs(0, kh);
      REQUIRE(std::vector<std::uint64_t>(sa.begin(), sa.end()) ==
              std::vector<std::uint64_t>(sb.begin(), sb.end()));
      REQUIRE(a.policy().scores(0, kh) == b.policy().scores(0, kh));
    }
  }
  REQUIRE(a.policy().rebuilds(0, 0) >= 3);
  KVCache<BuzzBeehive> plain(g, Budget::unbounded(), BuzzBeehive{});
  REQUIRE_THROWS_AS(kvevict::load_bytes(plain, kvevict::save_bytes(a)), kvevict::Error);
  REQUIRE(plain.size(0, 0) == 0);  // unchanged
  KVCache<BuzzBeehive> plain_saved(g, Budget::unbounded(), BuzzBeehive{});
  KVCache<BuzzBeehive> ref_target(g, Budget::unbounded(), BuzzBeehive(c));
  REQUIRE_THROWS_AS(kvevict::load_bytes(ref_target, kvevict::save_bytes(plain_saved)),
                    kvevict::Error);
}

TEST_CASE("HashEvict reference_slots keeps the reference's slots at every step, ties included") {
  // 16 and 8 bits over low-dimensional keys: many evictions have tied maxima.
  for (int bits : {8, 16})
    for (std::size_t cap : {24u, 64u}) {
      const auto st = hash_run(bits, cap, 700, 6, 100u + static_cast<unsigned>(bits) + cap, true);
      INFO("bits " << bits << " capacity " << cap);
      REQUIRE(st.agree.identical == st.agree.steps);
      REQUIRE(st.evictions >= 2 * (700 - cap));
      REQUIRE(st.tied * 10 >= st.evictions);  // ties are exercised (>= 10% of evictions)
    }
  // A prompt longer than the budget (keep_ends), then decoding.
  for (std::size_t prompt : {40u, 200u}) {
    const auto st = hash_run(16, 64, 600, 6, 300u + prompt, true, prompt);
    INFO("prompt " << prompt);
    REQUIRE(st.agree.identical == st.agree.steps);
    REQUIRE(st.tied * 10 >= st.evictions);
  }
  // Without the option, tie-breaking by row differs.
  const auto d = hash_run(16, 64, 700, 6, 180u, false);
  REQUIRE(d.agree.identical < d.agree.steps);
}

TEST_CASE("HashEvict reference_slots: slots are a permutation, saved and restored") {
  const Geometry g{1, 2, 2, 6};
  HashKey::Config c;
  c.reference_slots = true;
  KVCache<HashKey> a(g, Budget::uniform(32), HashKey(c));
  Rng rng(9);
  auto step = [&](KVCache<HashKey>& x, std::int64_t t, const std::vector<float>& k,
                  const std::vector<float>& v) { x.append(0, t, k, v); };
  std::int64_t t = 0;
  for (; t < 300; ++t) step(a, t, rng.normals(12), rng.normals(12));
  auto slots = a.policy().slots(0, 1);
  std::sort(slots.begin(), slots.end());
  for (std::size_t i = 0; i < slots.size(); ++i) REQUIRE(slots[i] == i);
  KVCache<HashKey> b(g, Budget::uniform(32), HashKey(c));
  kvevict::load_bytes(b, kvevict::save_bytes(a));
  REQUIRE(b.policy().slots(0, 1) == a.policy().slots(0, 1));
  for (; t < 600; ++t) {
    const auto k = rng.normals(12), v = rng.normals(12);
    step(a, t, k, v);
    step(b, t, k, v);
    for (int kh = 0; kh < 2; ++kh) {
      const auto sa = a.seqs(0, kh), sb = b.seqs(0, kh);
      REQUIRE(std::vector<std::uint64_t>(sa.begin(), sa.end()) ==
              std::vector<std::uint64_t>(sb.begin(), sb.end()));
    }
  }
  KVCache<HashKey> plain(g, Budget::uniform(32), HashKey{});
  REQUIRE_THROWS_AS(kvevict::load_bytes(plain, kvevict::save_bytes(a)), kvevict::Error);
  REQUIRE(plain.size(0, 0) == 0);
  // A budget shrink frees slots; the next appends fill the lowest free slots first.
  a.set_budget(Budget::uniform(20));
  for (; t < 640; ++t) step(a, t, rng.normals(12), rng.normals(12));
  auto after = a.policy().slots(0, 0);
  REQUIRE(after.size() == 20);
  std::sort(after.begin(), after.end());
  REQUIRE(std::adjacent_find(after.begin(), after.end()) == after.end());
}

TEST_CASE("XKV reference allocation equals the wait-list transcription in both modes") {
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 40; ++trial) {
    const int L = 2 + static_cast<int>(rng() % 7), H = 1 + static_cast<int>(rng() % 4);
    const std::size_t n = 3 + rng() % 30;
    const auto s = xkv_scores(rng, L, H, n);
    const auto a = xkv_allocator(s, H, H, true);
    const XkvRef ref(s);
    INFO("trial " << trial << " L " << L << " H " << H << " n " << n);
    // Budget mode, including totals past every candidate (the overflow goes to layer 0).
    for (long long total : {0LL, 1LL, static_cast<long long>(L), static_cast<long long>(n),
                            static_cast<long long>(n) * L / 3, static_cast<long long>(n) * L,
                            static_cast<long long>(n) * L + 5})
      REQUIRE(a.allocate(total).tokens == ref.by_n(total));
    for (double r : {0.05, 0.1, 0.3, 0.5, 0.9})
      REQUIRE(a.allocate_for_retention(r).tokens == ref.by_r(r));
  }
}

TEST_CASE("XKV reference: GQA ranks per query head after repeating K/V") {
  // A GQA layer observed in reference mode equals an MHA layer whose keys are the GQA keys
  // repeated to every query head; the default (group-summed) ranking differs.
  const int L = 3, H = 4, Hkv = 2, d = 8;
  const std::size_t T = 40;
  Rng rng(77);
  kvevict::policies::XkvLayerAllocator::Config c;
  c.reference = true;
  kvevict::policies::XkvLayerAllocator gqa(Geometry{L, H, Hkv, d}, c), mha(Geometry{L, H, H, d}, c);
  for (int l = 0; l < L; ++l) {
    auto k = rng.normals(T * Hkv * d), q = rng.normals(T * H * d);
    for (auto& x : q) x *= 2.0f + static_cast<float>(l);
    std::vector<float> rep(T * H * d);
    for (std::size_t t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h)
        std::copy_n(k.data() + (t * Hkv + static_cast<std::size_t>(h / 2)) * d, d,
                    rep.data() + (t * H + static_cast<std::size_t>(h)) * d);
    gqa.observe_layer(l, T, k, q);
    mha.observe_layer(l, T, rep, q);
  }
  for (long long total : {5LL, 20LL, 60LL, 200LL})
    REQUIRE(gqa.allocate(total).tokens == mha.allocate(total).tokens);
  for (double r : {0.1, 0.5, 0.9})
    REQUIRE(gqa.allocate_for_retention(r).tokens == mha.allocate_for_retention(r).tokens);
  // set_layer_scores takes one vector per query head in reference mode.
  REQUIRE_THROWS_AS(gqa.set_layer_scores(0, std::vector<std::vector<float>>(Hkv, {1.0f})),
                    kvevict::Error);
}

TEST_CASE("XKV reference: zero allocations, overflow to layer 0, unreachable target") {
  // Layer 1 has all the mass: layer 0 gets nothing until layer 1 is exhausted, then every
  // further token goes to layer 0 (gains all zero, lowest layer wins).
  const std::vector<std::vector<std::vector<float>>> s = {{{0.0f, 0.0f, 0.0f}},
                                                           {{3.0f, 2.0f, 1.0f}}};
  const auto a = xkv_allocator(s, 1, 1, true);
  REQUIRE(a.allocate(2).tokens == std::vector<long long>{0, 2});
  REQUIRE(a.allocate(7).tokens == std::vector<long long>{4, 3});
  // Past every candidate the overflow is added at once, not one token per iteration.
  REQUIRE(a.allocate(1'000'000'000'000LL).tokens ==
          std::vector<long long>{1'000'000'000'000LL - 3, 3});
  // Default mode: one-token floor and a stop when every candidate is taken.
  const auto b = xkv_allocator(s, 1, 1, false);
  REQUIRE(b.allocate(2).tokens == std::vector<long long>{1, 1});
  REQUIRE(b.allocate(7).total() <= 6);
  // Target 1.0 with layer 0 contributing 0: out of reach, an Error instead of a hang.
  REQUIRE_THROWS_AS(a.allocate_for_retention(1.0), kvevict::Error);
  REQUIRE(a.allocate_for_retention(0.4).tokens == std::vector<long long>{0, 2});
}

TEST_CASE("PyramidKV reference schedule equals the transcription over a grid") {
  using kvevict::policies::pyramid_budgets_reference;
  std::size_t cases = 0, uniform = 0;
  for (long long L : {2LL, 3LL, 4LL, 5LL, 8LL, 32LL})
    for (long long B : {1LL, 7LL, 20LL, 64LL, 100LL, 256LL})
      for (long long W : {0LL, 1LL, 8LL, 32LL})
        for (long long T : {0LL, 1LL, 9LL, 63LL, 64LL, 127LL, 128LL, 200LL, 513LL, 1000LL, 4096LL})
          for (long long beta : {1LL, 5LL, 20LL}) {
            const long long C = B + W;
            const auto want = pyramid_ref(L, C, W, T, beta);
            INFO("L " << L << " B " << B << " W " << W << " T " << T << " beta " << beta);
            if (*std::min_element(want.begin(), want.end()) < 0) {
              REQUIRE_THROWS_AS(pyramid_budgets_reference(static_cast<int>(L), C, W, T, beta),
                                kvevict::Error);
              continue;
            }
            REQUIRE(pyramid_budgets_reference(static_cast<int>(L), C, W, T, beta) == want);
            ++cases;
            uniform += (T >= C && T < 2 * B) ? 1 : 0;
          }
  REQUIRE(cases > 4000);
  REQUIRE(uniform > 100);
  // The example: L = 4, C - W = 64, T = 127 is the uniform branch.
  REQUIRE(pyramid_budgets_reference(4, 64 + 9, 9, 127) == std::vector<long long>(4, 64));
  // ... where the default clips the pyramid at the T - W = 118 candidates instead.
  REQUIRE(kvevict::policies::pyramid_budgets(4, 4 * 64, 127 - 9) ==
          std::vector<long long>{118, 82, 46, 10});
  REQUIRE_THROWS_AS(pyramid_budgets_reference(1, 80, 8, 500), kvevict::Error);
  REQUIRE_THROWS_AS(pyramid_budgets_reference(4, 8, 8, 500), kvevict::Error);
}

// --- measurements (hidden: run with "[measure]") ---------------------------------------

TEST_CASE("measure: default-mode differences from the reference", "[.][measure]") {
  using kvevict::policies::BuzzBeehive;
  std::printf("BUZZ default timing vs reference (S=4 W=160 T=400 s=5, 2 KV heads, G=1, softmax):\n");
  for (std::uint64_t salt : {1u, 2u, 3u}) {
    std::size_t rebuilds = 0;
    const auto a = buzz_run(BuzzBeehive::Config{}, 1, 2500, salt, false, true, &rebuilds);
    const auto e = buzz_run(BuzzBeehive::Config{}, 1, 2500, salt, true, true);
    std::printf("  stream %llu: %zu steps x 2 heads, %zu rebuilds: identical %.1f%%, mean overlap "
                "%.4f; reference_timing identical %.1f%%\n",
                static_cast<unsigned long long>(salt), a.steps / 2, rebuilds,
                100.0 * a.identical_share(), a.mean_overlap(), 100.0 * e.identical_share());
  }
  std::printf("HashEvict default tie-breaking vs reference slots (key mode, d = 6, 2 KV heads):\n");
  for (int bits : {8, 16})
    for (std::size_t cap : {64u, 256u}) {
      const auto d = hash_run(bits, cap, 2000, 6, 500u + cap, false);
      const auto e = hash_run(bits, cap, 2000, 6, 500u + cap, true);
      std::printf("  bits %d C %zu: %zu evictions, %.1f%% tied; identical %.1f%%, mean overlap "
                  "%.4f; reference_slots identical %.1f%%\n",
                  bits, cap, d.evictions, 100.0 * static_cast<double>(d.tied) / d.evictions,
                  100.0 * d.agree.identical_share(), d.agree.mean_overlap(),
                  100.0 * e.agree.identical_share());
    }
  std::printf("XKV default vs reference allocation (observe_layer on random prompts, W=8, k=7):\n");
  for (auto [H, Hkv] : {std::pair{4, 4}, std::pair{8, 2}}) {
    const int L = 8, d = 16;
    Rng rng(static_cast<std::uint64_t>(31 * H + Hkv));
    int matched_budget = 0, matched_target = 0, prompts = 20, with_zero = 0;
    long long tot_def = 0, tot_ref = 0, moved = 0, handed = 0;
    for (int p = 0; p < prompts; ++p) {
      const std::size_t T = static_cast<std::size_t>(64 + rng.uniform(0, 191));
      kvevict::policies::XkvLayerAllocator::Config c;
      kvevict::policies::XkvLayerAllocator def(Geometry{L, H, Hkv, d}, c);
      c.reference = true;
      kvevict::policies::XkvLayerAllocator ref(Geometry{L, H, Hkv, d}, c);
      for (int l = 0; l < L; ++l) {
        auto k = rng.normals(T * static_cast<std::size_t>(Hkv * d));
        auto q = rng.normals(T * static_cast<std::size_t>(H * d));
        const float sharp = 0.3f + 0.4f * static_cast<float>(l);
        for (auto& x : q) x *= sharp;
        def.observe_layer(l, T, k, q);
        ref.observe_layer(l, T, k, q);
      }
      const long long total = static_cast<long long>(T) * L / 10;
      const auto bd = def.allocate(total), br = ref.allocate(total);
      matched_budget += bd.tokens == br.tokens ? 1 : 0;
      with_zero += std::count(br.tokens.begin(), br.tokens.end(), 0LL) > 0 ? 1 : 0;
      for (int l = 0; l < L; ++l)
        moved += std::abs(bd.tokens[static_cast<std::size_t>(l)] - br.tokens[static_cast<std::size_t>(l)]);
      handed += 2 * total;
      const auto ad = def.allocate_for_retention(0.1), ar = ref.allocate_for_retention(0.1);
      matched_target += ad.tokens == ar.tokens ? 1 : 0;
      tot_def += ad.total();
      tot_ref += ar.total();
    }
    std::printf("  H %d Hkv %d, 8 layers: budget mode (N = T L / 10) matched %d/%d (reference gives "
                "some layer 0 tokens in %d/%d; tokens placed differently %.1f%%); target R = 0.1 "
                "matched %d/%d, mean total %.1f (default) vs %.1f (reference)\n",
                H, Hkv, matched_budget, prompts, with_zero, prompts,
                100.0 * static_cast<double>(moved) / static_cast<double>(handed), matched_target,
                prompts, static_cast<double>(tot_def) / prompts, static_cast<double>(tot_ref) / prompts);
  }
  std::printf("PyramidKV default (pyramid_budgets, exact total) vs reference schedule:\n");
  std::size_t cases = 0, same = 0, uni = 0, uni_same = 0;
  for (long long L : {4LL, 8LL, 16LL, 32LL})
    for (long long B : {32LL, 64LL, 128LL, 256LL, 512LL})
      for (long long W : {8LL, 32LL})
        for (long long T = B + W; T <= 8 * B; T += 7) {
          const auto ref = kvevict::policies::pyramid_budgets_reference(static_cast<int>(L), B + W, W, T);
          const auto def = kvevict::policies::pyramid_budgets(static_cast<int>(L), L * B, T - W);
          ++cases;
          same += def == ref ? 1 : 0;
          if (T < 2 * B) {
            ++uni;
            uni_same += def == ref ? 1 : 0;
          }
        }
  std::printf("  %zu cases (L 4..32, B 32..512, W 8/32, T from C to 8B step 7): identical %zu; "
              "uniform branch (C <= T < 2B) %zu cases, identical %zu\n",
              cases, same, uni, uni_same);
}
