// Selection kernels at every supported level vs sort-based references.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvevict/kernels/kernels.hpp"

namespace kk = kvevict::kernels;
using kk::Isa;

namespace {

std::vector<Isa> levels() {
  std::vector<Isa> v{Isa::scalar};
  if (kk::isa_supported(Isa::avx2)) v.push_back(Isa::avx2);
  if (kk::isa_supported(Isa::avx512)) v.push_back(Isa::avx512);
  return v;
}

template <class F>
auto at(Isa isa, F&& f) {
  switch (isa) {
    case Isa::avx512: return f(std::integral_constant<Isa, Isa::avx512>{});
    case Isa::avx2: return f(std::integral_constant<Isa, Isa::avx2>{});
    default: return f(std::integral_constant<Isa, Isa::scalar>{});
  }
}

// k best under `better` with ties by lower index, returned in ascending index order.
template <class K, class Better>
std::vector<std::uint32_t> ref_select(const std::vector<K>& v, std::size_t k, Better better) {
  std::vector<std::uint32_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0u);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](std::uint32_t a, std::uint32_t b) { return better(v[a], v[b]); });
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

bool float_better(float a, float b) {  // larger first, NaN last, -0 == +0
  if (std::isnan(a)) return false;
  if (std::isnan(b)) return true;
  return a > b;
}

std::size_t ref_argbest(const std::vector<float>& s, const std::uint64_t* prot, bool top) {
  std::size_t best = kk::npos;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (prot && ((prot[i / 64] >> (i % 64)) & 1)) continue;
    if (std::isnan(s[i])) continue;
    if (best == kk::npos || (top ? s[i] > s[best] : s[i] < s[best])) best = i;
  }
  return best;
}

const std::size_t kSizes[] = {0,    1,    2,    15,   16,   17,   63,   64,   65,   127, 128,  129,
                               255,  256,  257,  1000, 2048, 4095, 4096, 4097, 8191, 8192, 33000};

}  // namespace

TEST_CASE("counting_topk/bottomk match a stable sort at every level", "[kernels][select]") {
  std::mt19937_64 rng(31);
  for (Isa isa : levels())
    for (std::size_t n : kSizes)
      for (int dist = 0; dist < 4; ++dist) {
        std::vector<std::uint16_t> k16(n);
        std::vector<std::uint8_t> k8(n);
        for (std::size_t i = 0; i < n; ++i) {
          std::uint64_t r = rng();
          if (dist == 1) r %= 17;        // Hamming-like small range: many ties
          if (dist == 2) r = 9;          // all equal
          if (dist == 3) r = i % 2 ? 0xFFFF : 0x0100;  // extreme values, threshold on a byte edge
          k16[i] = static_cast<std::uint16_t>(r);
          k8[i] = static_cast<std::uint8_t>(r);
        }
        for (std::size_t k : {std::size_t{0}, std::size_t{1}, n / 3, n / 2, n > 0 ? n - 1 : 0, n}) {
          if (k > n) continue;
          INFO("isa " << kk::isa_name(isa) << " n " << n << " k " << k << " dist " << dist);
          std::vector<std::uint32_t> out(k + 1, 0xDEADBEEF);
          at(isa, [&](auto I) { kk::counting_topk<I()>(k16.data(), n, k, out.data()); });
          REQUIRE(out[k] == 0xDEADBEEF);
          out.resize(k);
          REQUIRE(out == ref_select(k16, k, std::greater<>()));
          out.assign(k, 0);
          at(isa, [&](auto I) { kk::counting_bottomk<I()>(k16.data(), n, k, out.data()); });
          REQUIRE(out == ref_select(k16, k, std::less<>()));
          at(isa, [&](auto I) { kk::counting_topk<I()>(k8.data(), n, k, out.data()); });
          REQUIRE(out == ref_select(k8, k, std::greater<>()));
          at(isa, [&](auto I) { kk::counting_bottomk<I()>(k8.data(), n, k, out.data()); });
          REQUIRE(out == ref_select(k8, k, std::less<>()));
        }
      }
}

TEST_CASE("counting select fed by hamming_histogram", "[kernels][select][hamming]") {
  std::mt19937_64 rng(8);
  for (Isa isa : levels())
    for (int bits : {8, 16, 64, 256}) {
      const std::size_t n = 3001;
      std::vector<std::uint8_t> q(bits / 8), c(n * bits / 8);
      for (auto& x : q) x = static_cast<std::uint8_t>(rng());
      for (auto& x : c) x = static_cast<std::uint8_t>(rng());
      std::vector<std::uint16_t> d(n);
      std::vector<std::uint32_t> h(bits + 1);
      kk::hamming_histogram(q.data(), c.data(), n, bits, d.data(), h.data());
      for (std::size_t k : {std::size_t{0}, std::size_t{7}, n / 2, n}) {
        std::vector<std::uint32_t> out(k);
        at(isa, [&](auto I) {
          kk::counting_topk<I()>(d.data(), n, k, h.data(), h.size(), out.data());
        });
        REQUIRE(out == ref_select(d, k, std::greater<>()));
        at(isa, [&](auto I) {
          kk::counting_bottomk<I()>(d.data(), n, k, h.data(), h.size(), out.data());
        });
        REQUIRE(out == ref_select(d, k, std::less<>()));
      }
      std::vector<std::uint32_t> out(1);
      h[0] += 1;  // inconsistent histogram
      REQUIRE_THROWS_WITH(kk::counting_topk(d.data(), n, 1, h.data(), h.size(), out.data()),
                          Catch::Contains("histogram counts"));
    }
}

/// topk_indices at `isa` selects ref_select's set (or *ref, in index order, when given) and
/// writes nothing past out[k).
void check_topk(Isa isa, const std::vector<float>& s, std::size_t k,
                const std::vector<std::uint32_t>* ref = nullptr) {
  std::vector<std::uint32_t> out(k + 1, 0xDEADBEEF);
  at(isa, [&](auto I) { kk::topk_indices<I()>(s.data(), s.size(), k, out.data()); });
  REQUIRE(out[k] == 0xDEADBEEF);
  out.resize(k);
  std::sort(out.begin(), out.end());
  REQUIRE(out == (ref ? *ref : ref_select(s, k, float_better)));
}

#if KVEVICT_X86
/// avx512::topk_scaled itself: when it takes the input, ref_select's set (or *ref) and
/// nothing past out[k); when it refuses, nothing written. Returns whether it took it.
// avx512::topk_scaled and, on a CPU with VBMI2 (whatever KVEVICT_ISA says),
// topk_scaled_vbmi2: the same refusals, the same set, nothing written past k (or at all
// when refused).
bool check_scaled(const std::vector<float>& s, std::size_t k,
                  const std::vector<std::uint32_t>* ref = nullptr) {
  std::vector<std::uint32_t> out(k + 1, 0xDEADBEEF);
  const bool ok = kk::detail::avx512::topk_scaled(s.data(), s.size(), k, out.data());
  REQUIRE(out[ok ? k : 0] == 0xDEADBEEF);
  std::vector<std::uint32_t> want;
  if (ok) {
    out.resize(k);
    std::sort(out.begin(), out.end());
    want = ref ? *ref : ref_select(s, k, float_better);
    REQUIRE(out == want);
  }
  if (kk::detail::cpu_has_avx512_vbmi2()) {
    std::vector<std::uint32_t> o2(k + 1, 0xDEADBEEF);
    const bool ok2 = kk::detail::avx512::topk_scaled_vbmi2(s.data(), s.size(), k, o2.data());
    REQUIRE(ok2 == ok);
    REQUIRE(o2[ok2 ? k : 0] == 0xDEADBEEF);
    if (ok2) {
      o2.resize(k);
      std::sort(o2.begin(), o2.end());
      REQUIRE(o2 == want);
    }
  }
  return ok;
}
#endif

TEST_CASE("topk_indices selects the k largest (ties to lower index, NaN last)",
          "[kernels][select]") {
  std::mt19937_64 rng(77);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (Isa isa : levels())
    for (std::size_t n : kSizes)
      for (int dist = 0; dist < 10; ++dist) {
        std::vector<float> s(n);
        std::normal_distribution<float> g;
        for (std::size_t i = 0; i < n; ++i) {
          switch (dist) {
            case 0: s[i] = g(rng); break;
            case 1: s[i] = static_cast<float>(rng() % 5); break;  // heavy ties
            case 2: s[i] = 1.5f; break;                           // all equal
            case 3: s[i] = static_cast<float>(i); break;          // sorted ascending
            case 4: s[i] = rng() % 3 ? g(rng) : nan; break;       // NaNs sprinkled
            case 5: {                                             // specials
              const float sp[] = {inf, -inf, 0.0f, -0.0f, nan, 1.0f};
              s[i] = sp[rng() % 6];
              break;
            }
            case 6: s[i] = nan; break;  // all NaN
            case 7:  // keys equal in their high bytes, differing in the low ones (radix levels)
              s[i] = std::bit_cast<float>(0x3F800000u + static_cast<std::uint32_t>(rng() % 700));
              break;
            default: s[i] = g(rng); break;
          }
        }
        if (dist >= 8)  // the rows the AVX2 path samples first are the best (8) or the worst
          for (std::size_t j = 0; j < 64 && n > 128; ++j)  // (9) ones: its bracket misses
            s[((2 * j + 1) * n) >> 7] = (dist == 8 ? 1000.0f : -1000.0f) + static_cast<float>(j);
        for (std::size_t k : {std::size_t{0}, std::size_t{1}, std::size_t{10}, std::size_t{64},
                              n / 2, n - n / 10, n - 1, n}) {
          if (k > n) continue;
          INFO("isa " << kk::isa_name(isa) << " n " << n << " k " << k << " dist " << dist);
          check_topk(isa, s, k);
        }
      }
}

TEST_CASE("topk_indices from 1 to 1100 rows: the small-n path's bracket and its misses",
          "[kernels][select]") {
  // Every size to 300, then every 37th to 1100 and the sizes around 512 and 1024 (the
  // threshold search up to 512 rows; beyond, the float-compare first round and its two
  // miss recoveries), with ties, NaNs and signed zeros; k = 0, 1, 64, n/2, n-1, n.
  std::mt19937_64 rng(1100);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::size_t> sizes;
  for (std::size_t n = 1; n <= 1100; n += n < 300 ? 1 : 37) sizes.push_back(n);
  for (std::size_t n : {511, 512, 513, 1023, 1024, 1025}) sizes.push_back(n);
  for (Isa isa : levels())
    for (std::size_t n : sizes)
      for (int dist = 0; dist < 6; ++dist) {
        std::vector<float> s(n);
        std::normal_distribution<float> g;
        for (auto& v : s) {
          switch (dist) {
            case 0: v = g(rng); break;
            case 1: v = static_cast<float>(rng() % 7) - 3.0f; break;  // ties, +0 only
            case 2: v = rng() % 4 ? g(rng) : nan; break;
            case 3: v = rng() % 2 ? 0.0f : (rng() % 2 ? -0.0f : g(rng)); break;  // -0 == +0
            case 4: v = rng() % 8 ? -5.0f - static_cast<float>(rng() % 3) : g(rng); break;
            default:  // equal high 16 key bits, differing low ones (the low-half selection)
              v = std::bit_cast<float>(0x3F800000u + static_cast<std::uint32_t>(rng() % 90));
              break;
          }
        }
        for (std::size_t k : {std::size_t{0}, std::size_t{1}, std::size_t{64}, n / 2, n - 1, n}) {
          if (k > n) continue;
          INFO("isa " << kk::isa_name(isa) << " n " << n << " k " << k << " dist " << dist);
          check_topk(isa, s, k);
        }
      }
}

// Score shapes for the lower-bound paths (topk_filter, topk_group_max): spread, ties at the
// bound, ascending / descending (the best in a few groups), fewer numbers than k,
// infinities and zeros, the best in one group, -inf and NaN, every row a candidate (too
// many), and (dist 9) one of 128 row groups without a number.
static std::vector<float> bound_shape(int dist, std::size_t n, std::mt19937_64& rng) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> s(n);
  std::normal_distribution<float> g;
  for (std::size_t i = 0; i < n; ++i) {
    switch (dist) {
      case 0: s[i] = g(rng); break;
      case 1: s[i] = static_cast<float>(rng() % 3); break;  // ties at the bound
      case 2: s[i] = static_cast<float>(i); break;          // ascending: few candidates
      case 3: s[i] = static_cast<float>(n - i); break;      // descending
      case 4: s[i] = i % 37 == 0 ? g(rng) : nan; break;     // fewer numbers than k
      case 5: {                                             // infinities, zeros, NaN
        const float sp[] = {inf, -inf, 0.0f, -0.0f, nan, 1.0f, -1.0f};
        s[i] = sp[rng() % 7];
        break;
      }
      case 6: s[i] = i % 32 == 5 ? 100.0f + g(rng) : g(rng); break;  // best in one group
      case 7: s[i] = rng() % 2 ? -inf : (rng() % 4 ? nan : g(rng)); break;
      case 8: s[i] = 2.0f; break;  // every row a candidate: too many
      default: s[i] = i % 128 == 3 ? nan : g(rng); break;  // group 3 has no number
    }
  }
  return s;
}

TEST_CASE("topk_indices above 512 rows: the group bound (k <= 64), the band, their fallbacks",
          "[kernels][select]") {
  // At AVX-512 (avx512::topk_filter) the 32 groups' second-best scores bound the k-th from
  // below; shapes put the bound on ties, NaN and infinities, leave fewer than k numbers (the
  // k-th is NaN), or leave too many candidates (clustered scores): both fall back.
  std::mt19937_64 rng(64);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (Isa isa : levels())
    for (std::size_t n : {513, 530, 1000, 1024, 1531, 4096, 8200})
      for (int dist = 0; dist < 9; ++dist) {
        const std::vector<float> s = bound_shape(dist, n, rng);
        for (std::size_t k : {1, 2, 31, 32, 33, 63, 64}) {
          INFO("isa " << kk::isa_name(isa) << " n " << n << " k " << k << " dist " << dist);
          check_topk(isa, s, k);
        }
      }
  for (Isa isa : levels())  // k > 64 up to 4096 rows (avx512::topk_band) on the same shapes
    for (std::size_t n : {600, 1024, 3000, 4096})
      for (int dist = 0; dist < 9; ++dist) {
        std::vector<float> s(n);
        std::normal_distribution<float> g;
        for (std::size_t i = 0; i < n; ++i)
          s[i] = dist == 0 ? g(rng)
               : dist == 1 ? static_cast<float>(rng() % 3)
               : dist == 2 ? static_cast<float>(i)
               : dist == 3 ? (i % 5 == 0 ? nan : g(rng))
               : dist == 4 ? (rng() % 2 ? 0.0f : -0.0f)
               : dist == 5 ? (i % 3 == 0 ? inf : (i % 3 == 1 ? -inf : g(rng)))
               : dist == 6 ? (((2 * (i / (n / 64)) + 1) * n) >> 7 == i ? 1e6f : g(rng))
               : dist == 7 ? g(rng) * 1e-3f + (i < n / 2 ? 5.0f : 0.0f)
                           : static_cast<float>(n - i) + (i % 2 ? 0.5f : 0.0f);
        for (std::size_t k : {std::size_t{65}, std::size_t{100}, n / 3, n / 2, n - 65, n - 1}) {
          INFO("isa " << kk::isa_name(isa) << " n " << n << " k " << k << " dist " << dist);
          check_topk(isa, s, k);
        }
      }
  for (Isa isa : levels())  // k = the numbers: the sample's lower key is NaN's, the band all
    for (std::size_t n : {1024, 4096}) {  // numbers not above hi (every band row taken)
      std::vector<float> s(n, nan);
      std::normal_distribution<float> g;
      for (std::size_t i = 0; i < n / 2; ++i) s[i] = g(rng);
      INFO("isa " << kk::isa_name(isa) << " n " << n);
      check_topk(isa, s, n / 2);
    }
  for (Isa isa : levels())  // exactly k - 1, k or k + 1 numbers, the rest NaN
    for (std::size_t k : {32, 64})
      for (std::size_t cnt : {k - 1, k, k + 1})
        for (std::size_t stride : {1, 7, 32}) {
          std::vector<float> s(2100, nan);
          std::normal_distribution<float> g;
          for (std::size_t j = 0; j < cnt; ++j) s[j * stride] = g(rng);
          INFO("isa " << kk::isa_name(isa) << " k " << k << " numbers " << cnt << " stride " << stride);
          check_topk(isa, s, k);
        }
#if KVEVICT_X86
  if (kk::isa_supported(Isa::avx512)) {  // each branch of topk_filter is taken
    std::vector<float> s(2048);
    std::vector<std::uint32_t> out(64);
    std::normal_distribution<float> g;
    for (auto& v : s) v = g(rng);
    CHECK(kk::detail::avx512::topk_filter(s.data(), s.size(), 64, out.data()));
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<float>(i);
    CHECK(kk::detail::avx512::topk_filter(s.data(), s.size(), 64, out.data()));  // rank path
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = i % 64 == 0 ? 1.0f : nan;
    CHECK_FALSE(kk::detail::avx512::topk_filter(s.data(), s.size(), 64, out.data()));  // < k
    for (auto& v : s) v = 2.0f;
    CHECK_FALSE(kk::detail::avx512::topk_filter(s.data(), s.size(), 64, out.data()));  // > max
  }
#endif
}

TEST_CASE("topk_indices at small k by 128 groups' maxima (topk_group_max)", "[kernels][select]") {
  // avx512::topk_group_max (AVX-512 level, 256-512 rows when 24 k <= n, or 16 k <= n and
  // k <= 16 (k <= 20 from 384 rows), above
  // 512 rows k <= 32, to 16K rows k <= 64 from 2048): the k-th largest of 128 group maxima
  // (scaled bins over the maxima; up to 512 rows at k <= 12 each lane's two best) bounds the k-th score from below; the rows at or above it
  // are ranked. On bound_shape's shapes (a group without a number: the bound falls to -inf;
  // every row equal: too many candidates, refused), the dispatched path for k up to 64 and
  // topk_group_max itself against the reference.
  std::mt19937_64 rng(36);
  std::size_t taken = 0, refused = 0;
  for (std::size_t n : {256, 257, 300, 383, 512, 513, 777, 1024, 2048, 2100, 5000})
    for (int dist = 0; dist < 10; ++dist) {
      const std::vector<float> s = bound_shape(dist, n, rng);
      std::vector<std::uint32_t> order(n);
      std::iota(order.begin(), order.end(), 0u);
      std::stable_sort(order.begin(), order.end(),
                       [&](std::uint32_t a, std::uint32_t b) { return float_better(s[a], s[b]); });
      for (std::size_t k = 1; k <= 64; k += (k < 8 ? 1 : 7)) {
        std::vector<std::uint32_t> ref(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k));
        std::sort(ref.begin(), ref.end());
        INFO("n " << n << " k " << k << " dist " << dist);
        for (Isa isa : levels()) check_topk(isa, s, k, &ref);
#if KVEVICT_X86
        if (kk::isa_supported(Isa::avx512)) {
          std::vector<std::uint32_t> out(k + 1, 0xDEADBEEF);
          const bool ok = kk::detail::avx512::topk_group_max(s.data(), n, k, out.data());
          REQUIRE(out[ok ? k : 0] == 0xDEADBEEF);
          ++(ok ? taken : refused);
          if (ok) {
            out.resize(k);
            std::sort(out.begin(), out.end());
            REQUIRE(out == ref);
          }
        }
#endif
      }
    }
#if KVEVICT_X86
  if (kk::isa_supported(Isa::avx512)) {
    CHECK(taken > 500);
    CHECK(refused > 50);
    // Taken on spread scores; refused when every row is a candidate (more than kFilterMaxM).
    std::vector<float> s(1024);
    std::normal_distribution<float> g;
    for (auto& v : s) v = g(rng);
    std::vector<std::uint32_t> out(8);
    CHECK(kk::detail::avx512::topk_group_max(s.data(), s.size(), 8, out.data()));
    for (auto& v : s) v = 2.0f;
    CHECK_FALSE(kk::detail::avx512::topk_group_max(s.data(), s.size(), 8, out.data()));
  }
#endif
}

TEST_CASE("topk_drop_worst: k best of up to 32 candidates by removing the worst", "[kernels][select]") {
  // avx512::topk_drop_worst (stop 37: topk_group_max's and topk_filter's finish when the
  // candidates are at most 32 and at most 4 past k): the m - k worst (smallest, the highest
  // index among equal) removed. Candidates in index order with their ids (every third row),
  // few distinct values (ties), -0 / +0, infinities, and m from 2 to 32, against the
  // stable-sort reference; and topk_group_max on inputs whose bound leaves a few extra rows.
#if KVEVICT_X86
  if (!kk::isa_supported(Isa::avx512)) return;
  std::mt19937_64 rng(37);
  const float inf = std::numeric_limits<float>::infinity();
  for (int shape = 0; shape < 4; ++shape)
    for (std::size_t m = 2; m <= 32; ++m)
      for (std::size_t d = 1; d <= 4 && d < m; ++d)
        for (int rep = 0; rep < 20; ++rep) {
          const std::size_t k = m - d;
          std::vector<float> cf(m + 16);
          std::vector<std::uint32_t> ci(m + 16);
          std::uniform_int_distribution<int> few(0, 3);
          std::normal_distribution<float> g;
          for (std::size_t j = 0; j < m; ++j) {
            ci[j] = static_cast<std::uint32_t>(3 * j + 1);
            const int v = few(rng);
            cf[j] = shape == 0   ? g(rng)
                    : shape == 1 ? static_cast<float>(v)
                    : shape == 2 ? (v == 0 ? -0.0f : v == 1 ? 0.0f : v == 2 ? -1.0f : 1.0f)
                                 : (v == 0 ? inf : v == 1 ? -inf : static_cast<float>(v));
          }
          std::vector<std::uint32_t> order(m);
          std::iota(order.begin(), order.end(), 0u);
          std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
            return float_better(cf[a], cf[b]);
          });
          std::vector<std::uint32_t> ref(k);
          for (std::size_t j = 0; j < k; ++j) ref[j] = ci[order[j]];
          std::sort(ref.begin(), ref.end());
          std::vector<std::uint32_t> out(k + 1, 0xDEADBEEF);
          kk::detail::avx512::topk_drop_worst<2>(cf.data(), ci.data(), m, k, out.data());
          INFO("shape " << shape << " m " << m << " k " << k);
          REQUIRE(out[k] == 0xDEADBEEF);
          out.resize(k);
          REQUIRE(std::is_sorted(out.begin(), out.end()));  // index order
          REQUIRE(out == ref);
          if (m <= 16) {
            std::vector<std::uint32_t> out1(k);
            kk::detail::avx512::topk_drop_worst<1>(cf.data(), ci.data(), m, k, out1.data());
            REQUIRE(out1 == ref);
          }
        }
  // topk_group_max where two of the k best share a group (rows g and g + 128): the bound
  // is below the k-th score and the candidates exceed k by a few (the drop path), with ties.
  for (std::size_t n : {256, 320, 384, 450, 512})
    for (std::size_t k : {2, 8, 16, 20, 31})
      for (int rep = 0; rep < 20; ++rep) {
        if (16 * k > n + 200) continue;
        std::vector<float> s(n);
        std::normal_distribution<float> g;
        for (auto& v : s) v = std::round(g(rng) * 8.0f) / 8.0f;  // ties
        for (int e = 0; e < rep % 4 + 1; ++e) {
          const std::size_t r = rng() % 128;
          s[r] = 9.0f + static_cast<float>(e);
          s[r + 128] = 9.0f + static_cast<float>(e);
        }
        const std::vector<std::uint32_t> ref = ref_select(s, k, float_better);
        std::vector<std::uint32_t> out(k);
        INFO("n " << n << " k " << k << " rep " << rep);
        REQUIRE(kk::detail::avx512::topk_group_max(s.data(), n, k, out.data()));
        std::sort(out.begin(), out.end());
        REQUIRE(out == ref);
        check_topk(Isa::avx512, s, k, &ref);
      }
  // Up to 512 rows at k <= kGroupTop2MaxK the bound is the k-th of each lane's two best
  // maxima (sorted in registers): never above the k-th score, so never refused on numbers
  // (a bound too high would leave fewer than k candidates), and the same set; every n
  // 256-512 (tails), k 1-12, spread and tied scores, a group of NaN (its maximum -inf).
  for (std::size_t n = 256; n <= 512; n += 7)
    for (std::size_t k = 1; k <= kk::detail::avx512::kGroupTop2MaxK; ++k) {
      std::vector<float> s(n);
      std::normal_distribution<float> g;
      const int shape = static_cast<int>(n + k) % 3;
      for (auto& v : s) v = shape == 1 ? std::round(g(rng) * 4.0f) : g(rng);
      if (shape == 2)
        for (std::size_t i = 5; i < n; i += 128) s[i] = std::numeric_limits<float>::quiet_NaN();
      const std::vector<std::uint32_t> ref = ref_select(s, k, float_better);
      std::vector<std::uint32_t> out(k);
      INFO("n " << n << " k " << k << " shape " << shape);
      REQUIRE(kk::detail::avx512::topk_group_max(s.data(), n, k, out.data()));
      std::sort(out.begin(), out.end());
      REQUIRE(out == ref);
    }
#endif
}

TEST_CASE("topk_indices by scaled bins: every n to 1100, spread, clustered and special scores",
          "[kernels][select]") {
  // avx512::topk_scaled (AVX-512 level, 33-512 rows, and k > 64 to 1024 rows): the range
  // pass, the k-th bin, the rank of bin t's rows (up to 8 in scalar code, up to 32 by
  // topk_rank), the k-th key of a crowded bin
  // (clustered or outlier-stretched scores), every row of a crowded bin taken, and its
  // refusals (an infinity, fewer than two distinct numbers, the k-th row a NaN). Each shape
  // at every n from 1 to 1100 and k in {1, 2, 63, 64, 65, n/2, n-1}, the dispatched path
  // and topk_scaled itself against the stable-sort reference.
  std::mt19937_64 rng(384);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Isa isa = kk::isa_supported(Isa::avx512) ? Isa::avx512
                  : kk::isa_supported(Isa::avx2) ? Isa::avx2 : Isa::scalar;
  std::size_t scaled_true = 0, scaled_false = 0;
  for (std::size_t n = 1; n <= 1100; ++n)
    for (int dist = 0; dist < 8; ++dist) {
      std::vector<float> s(n);
      std::normal_distribution<float> g;
      for (std::size_t i = 0; i < n; ++i) {
        switch (dist) {
          case 0: s[i] = g(rng); break;
          case 1: s[i] = std::exp(3.0f * g(rng)); break;  // heavy tail: crowded low bins
          case 2: s[i] = static_cast<float>(rng() % 7) - 3.0f; break;  // ties
          case 3: s[i] = rng() % 4 ? g(rng) : nan; break;
          case 4: s[i] = rng() % 2 ? (rng() % 2 ? 0.0f : -0.0f) : g(rng); break;  // -0 == +0
          case 5: s[i] = i == n / 3 ? inf : g(rng); break;  // no finite range
          case 6: s[i] = i == n / 2 ? 1e30f : (i == n / 5 ? -1e30f : g(rng)); break;  // one bin
          default: s[i] = i % 3 == 0 ? 1000.0f + g(rng) : g(rng); break;  // two clusters
        }
      }
      // Reference: one stable sort, then each k's prefix in index order.
      std::vector<std::uint32_t> order(n);
      std::iota(order.begin(), order.end(), 0u);
      std::stable_sort(order.begin(), order.end(),
                       [&](std::uint32_t a, std::uint32_t b) { return float_better(s[a], s[b]); });
      for (std::size_t k : {std::size_t{1}, std::size_t{2}, std::size_t{63}, std::size_t{64},
                            std::size_t{65}, n / 2, n - 1}) {
        if (k == 0 || k >= n) continue;
        std::vector<std::uint32_t> ref(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k));
        std::sort(ref.begin(), ref.end());
        INFO("n " << n << " k " << k << " dist " << dist);
        check_topk(isa, s, k, &ref);
#if KVEVICT_X86
        if (isa == Isa::avx512 && n <= kk::detail::avx512::kScaledMaxN)
          ++(check_scaled(s, k, &ref) ? scaled_true : scaled_false);
#endif
      }
    }
#if KVEVICT_X86
  if (isa == Isa::avx512) {
    CHECK(scaled_true > 20000);
    CHECK(scaled_false > 1000);
    // Each branch taken, with the set checked: rank path (a few rows per bin), the k-th key
    // of a crowded bin, a crowded bin taken whole; refusals.
    auto run = [](const std::vector<float>& s, std::size_t k) { return check_scaled(s, k); };
    std::normal_distribution<float> g;
    std::vector<float> s(512);
    for (auto& v : s) v = g(rng);
    CHECK(run(s, 64));
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = 1.0f + 1e-6f * static_cast<float>(i % 97);
    s[7] = 1e6f;  // every other row in bin 254: its k-th key
    CHECK(run(s, 64));
    CHECK(run(s, 300));
    // Bin t with a few rows ranked in scalar code (kScaledScalarRankMaxM), the cut among
    // equal floats (lowest index first) and among -0 / +0.
    std::vector<float> w(200);
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i);
    w[10] = w[50] = w[90] = 100.0f;  // four rows at 100; k = 101 takes rows 10 and 50
    CHECK(run(w, 101));
    CHECK(run(w, 100));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) - 100.0f;
    w[30] = w[170] = -0.0f;  // rows 30, 100 (+0), 170 at zero; k = 100 takes 30 and 100
    CHECK(run(w, 100));
    CHECK(run(w, 99));
    std::vector<float> c(100);
    for (std::size_t i = 0; i < c.size(); ++i)  // 30 rows in bin 0, all taken at k = 30
      c[i] = i < 30 ? 1000.0f + 0.01f * static_cast<float>(i) : 0.01f * static_cast<float>(i);
    CHECK(run(c, 30));
    c[50] = -inf;
    CHECK_FALSE(run(c, 30));  // no finite range
    std::vector<float> e(100, 2.0f);
    CHECK_FALSE(run(e, 30));  // one distinct number
    for (std::size_t i = 0; i < 50; ++i) e[2 * i] = nan;
    e[1] = 3.0f;
    CHECK_FALSE(run(e, 60));  // the 60th row is a NaN
  }
#endif
}

TEST_CASE("topk_scaled: packed bin order, bin t's rows gathered one by one or by compresses",
          "[kernels][select]") {
#if KVEVICT_X86
  // The packed bins' mask bit 16 L + 4 q + i is row 16 q + 4 L + i (VPACKUSDW + VPACKUSWB):
  // scaled_pack_rows puts each bit at its row.
  for (unsigned L = 0; L < 4; ++L)
    for (unsigned q = 0; q < 4; ++q)
      for (unsigned i = 0; i < 4; ++i)
        REQUIRE(kk::detail::avx512::scaled_pack_rows(std::uint64_t{1} << (16 * L + 4 * q + i)) ==
                std::uint64_t{1} << (16 * q + 4 * L + i));
  if (!kk::isa_supported(Isa::avx512)) return;
  // Bin t holding c equal rows (ties, scattered over the 64-row blocks) and a few spread
  // neighbours: above 384 rows up to 16 rows are gathered one at a time by their mask
  // bits, otherwise by compresses; the cut among the ties goes to the lowest indices (and
  // the ranking after either gather: scalar up to 8 rows, topk_rank to 32, binning again
  // beyond).
  std::mt19937_64 rng(38);
  std::normal_distribution<float> g;
  for (std::size_t n : {std::size_t{100}, std::size_t{384}, std::size_t{512}, std::size_t{1000}})
    for (std::size_t c : {std::size_t{2}, std::size_t{7}, std::size_t{9}, std::size_t{15},
                          std::size_t{16}, std::size_t{17}, std::size_t{31}, std::size_t{40}}) {
      std::vector<float> s(n);
      for (auto& v : s) v = g(rng);
      std::vector<std::size_t> rows(n);
      std::iota(rows.begin(), rows.end(), std::size_t{0});
      std::shuffle(rows.begin(), rows.end(), rng);
      for (std::size_t j = 0; j < c; ++j) s[rows[j]] = 1.0f;
      std::size_t above = 0;
      for (float v : s) above += v > 1.0f;
      for (std::size_t k : {above + 1, above + c / 2, above + c - 1, above + c}) {
        if (k == 0 || k >= n) continue;
        INFO("n " << n << " ties " << c << " k " << k);
        CHECK(check_scaled(s, k));
      }
    }
#endif
}

#if KVEVICT_X86
// emit_lanes is always_inline with the VBMI2 target: called from a function of that target.
KVEVICT_TARGET_AVX512_VBMI2 std::size_t emit_lanes_vbmi2(std::uint32_t* dst, std::size_t pos,
                                                         std::size_t cap, std::uint64_t sel,
                                                         std::size_t base) {
  return kk::detail::avx512::emit_lanes(dst, pos, cap, _cvtu64_mask64(sel), base);
}
#endif

TEST_CASE("topk_scaled_vbmi2: lane compresses, row order, dense blocks, KVEVICT_ISA sub-level",
          "[kernels][select]") {
  // has_avx512_vbmi2(): the CPU's VBMI + VBMI2, unless KVEVICT_ISA caps below the sub-level
  // (CTest reruns this binary with KVEVICT_ISA=avx512: the plain topk_scaled behind
  // topk_indices; the default run takes topk_scaled_vbmi2 on such a CPU).
  const char* env = std::getenv("KVEVICT_ISA");
  const bool capped = env != nullptr && *env != '\0' && std::string(env) != "avx512vbmi2";
  REQUIRE(kk::has_avx512_vbmi2() == (kk::detail::cpu_has_avx512_vbmi2() && !capped));
  REQUIRE(kk::detail::parse_isa("avx512vbmi2") == Isa::avx512);
  if (kk::detail::cpu_has_avx512_vbmi2()) REQUIRE(kk::isa_supported(Isa::avx512));
#if KVEVICT_X86
  UNSCOPED_INFO("VBMI2 " << kk::detail::cpu_has_avx512_vbmi2() << ", used "
                         << kk::has_avx512_vbmi2());
  if (!kk::detail::cpu_has_avx512_vbmi2()) return;
  std::mt19937_64 rng(39);
  // emit_lanes: base + the set bits of a 64-bit mask in order, 0 to 64 of them (the 16-id
  // parts past 16, 32, 48), whole stores only below cap, nothing written at or past cap.
  for (int trial = 0; trial < 2000; ++trial) {
    const int want_bits = trial % 65;
    std::uint64_t sel = 0;
    while (std::popcount(sel) < want_bits) sel |= std::uint64_t{1} << (rng() % 64);
    const std::size_t pos = rng() % 20, base = 64 * (rng() % 16);
    const std::size_t cap = pos + static_cast<std::size_t>(want_bits) + (trial % 3 == 0 ? 0 : rng() % 40);
    std::vector<std::uint32_t> dst(cap + 64, 0xDEADBEEF);
    const std::size_t end = emit_lanes_vbmi2(dst.data(), pos, cap, sel, base);
    REQUIRE(end == pos + static_cast<std::size_t>(want_bits));
    std::size_t j = pos;
    for (std::uint64_t e = sel; e != 0; e &= e - 1)
      REQUIRE(dst[j++] == base + static_cast<std::size_t>(std::countr_zero(e)));
    for (std::size_t i = cap; i < dst.size(); ++i) REQUIRE(dst[i] == 0xDEADBEEF);
    for (std::size_t i = 0; i < pos; ++i) REQUIRE(dst[i] == 0xDEADBEEF);
  }
  // Whole 64-row blocks below the k-th bin (sorted scores: up to 64 ids per block from one
  // byte compress), a block of 64 rows tied at the cut, ties scattered at the cut (bin t's
  // rows in index order after the VPERMB), against the stable sort (check_scaled runs both
  // forms).
  std::normal_distribution<float> g;
  for (std::size_t n : {std::size_t{64}, std::size_t{100}, std::size_t{512}, std::size_t{777},
                        std::size_t{1024}}) {
    std::vector<float> s(n);
    for (int shape = 0; shape < 4; ++shape) {
      for (std::size_t i = 0; i < n; ++i) s[i] = g(rng);
      if (shape == 0) std::sort(s.begin(), s.end(), std::greater<>());
      if (shape == 1) std::sort(s.begin(), s.end());
      if (shape == 2)
        for (std::size_t i = 0; i < std::min<std::size_t>(n, 128); ++i) s[i] = i >= 64 ? 0.5f : 2.0f + g(rng);
      if (shape == 3)
        for (std::size_t i = 0; i < n; i += 7) s[i] = 0.25f;
      for (std::size_t k : {std::size_t{1}, std::size_t{17}, std::size_t{33}, std::size_t{49},
                            std::size_t{63}, std::size_t{64}, std::size_t{65}, std::size_t{70},
                            std::size_t{100}, n / 2, n - 1}) {
        if (k == 0 || k >= n) continue;
        INFO("n " << n << " shape " << shape << " k " << k);
        CHECK(check_scaled(s, k));
      }
    }
  }
#endif
}

TEST_CASE("argmax_masked / argmin_masked: lowest index on ties, NaN skipped, npos",
          "[kernels][select]") {
  std::mt19937_64 rng(4);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (Isa isa : levels())
    for (std::size_t n : kSizes)
      for (int mode = 0; mode < 8; ++mode) {
        std::vector<float> s(n);
        for (auto& v : s) v = static_cast<float>(rng() % 50) - 25.0f;
        std::vector<std::uint64_t> prot((n + 63) / 64 + 1, 0);
        const std::uint64_t* p = prot.data();
        switch (mode) {
          case 0: p = nullptr; break;
          case 1: for (auto& w : prot) w = rng() & rng(); break;
          case 2: for (auto& w : prot) w = ~std::uint64_t{0}; break;  // all protected
          case 3: for (auto& v : s) v = 2.0f; break;                  // all equal
          case 4: for (auto& v : s) v = nan; break;                   // all NaN
          case 5: for (auto& v : s) if (rng() % 2) v = nan; break;
          case 6: for (auto& v : s) v = rng() % 2 ? inf : -inf; break;
          case 7: for (auto& v : s) v = rng() % 2 ? 0.0f : -0.0f; break;
        }
        INFO("isa " << kk::isa_name(isa) << " n " << n << " mode " << mode);
        const std::size_t mx = at(isa, [&](auto I) { return kk::argmax_masked<I()>(s.data(), n, p); });
        const std::size_t mn = at(isa, [&](auto I) { return kk::argmin_masked<I()>(s.data(), n, p); });
        REQUIRE(mx == ref_argbest(s, p, true));
        REQUIRE(mn == ref_argbest(s, p, false));
        if (mode == 2 || mode == 4 || n == 0) {
          REQUIRE(mx == kk::npos);
          REQUIRE(mn == kk::npos);
        }
        if ((mode == 3 || mode == 7) && n > 0) REQUIRE((mx == 0 && mn == 0));
      }
}

TEST_CASE("argmax_masked on -inf only rows still finds an eligible row", "[kernels][select]") {
  for (Isa isa : levels()) {
    std::vector<float> s(3000, -std::numeric_limits<float>::infinity());
    std::vector<std::uint64_t> prot((s.size() + 63) / 64, ~std::uint64_t{0});
    prot[2500 / 64] &= ~(std::uint64_t{1} << (2500 % 64));
    REQUIRE(at(isa, [&](auto I) { return kk::argmax_masked<I()>(s.data(), s.size(), prot.data()); }) == 2500);
    REQUIRE(at(isa, [&](auto I) { return kk::argmin_masked<I()>(s.data(), s.size(), prot.data()); }) == 2500);
  }
}

TEST_CASE("selection API rejects bad arguments with precise messages", "[kernels][select]") {
  std::uint16_t k16[4] = {1, 2, 3, 4};
  float s[4] = {1, 2, 3, 4};
  std::uint32_t out[8];
  REQUIRE_THROWS_WITH(kk::counting_topk(k16, 4, 5, out),
                      Catch::Contains("k = 5") && Catch::Contains("n = 4"));
  REQUIRE_THROWS_WITH(kk::topk_indices(s, 4, 9, out), Catch::Contains("k = 9"));
  REQUIRE_THROWS_WITH(kk::topk_indices(nullptr, 4, 1, out), Catch::Contains("keys"));
  REQUIRE_THROWS_WITH(kk::topk_indices(s, 4, 1, nullptr), Catch::Contains("out"));
  REQUIRE_THROWS_AS(kk::argmax_masked(nullptr, 3, nullptr), std::invalid_argument);
  REQUIRE(kk::argmin_masked(nullptr, 0, nullptr) == kk::npos);
  REQUIRE_NOTHROW(kk::topk_indices(nullptr, 0, 0, nullptr));
}

// The policies' per-step helpers (protect_outside, find_equal_masked, group_sum_checked),
// scalar and AVX2 bodies, against plain loops.
TEST_CASE("policy step kernels match plain loops at every level", "[kernels][select]") {
  std::mt19937_64 rng(77);
  const bool avx2 = kk::isa_supported(Isa::avx2);
  for (std::size_t n : {0u, 1u, 5u, 63u, 64u, 65u, 200u, 1000u, 4099u}) {
    // protect_outside: bit set unless lo <= seq < hi (seqs shuffled, as rows are).
    std::vector<std::uint64_t> seqs(n);
    std::iota(seqs.begin(), seqs.end(), std::uint64_t{3});
    std::shuffle(seqs.begin(), seqs.end(), rng);
    for (auto [lo, hi] : {std::pair<std::uint64_t, std::uint64_t>{0, 0}, {4, 4 + n / 2},
                          {0, ~std::uint64_t{0}}, {10, 5}, {n / 3, n}}) {
      const std::size_t words = (n + 63) / 64;
      std::vector<std::uint64_t> want(words, ~std::uint64_t{0}), got(words, 0), got2(words, 0);
      for (std::size_t i = 0; i < n; ++i)
        if (seqs[i] >= lo && seqs[i] < hi) want[i / 64] &= ~(std::uint64_t{1} << (i % 64));
      kk::detail::scalar::protect_outside(seqs.data(), n, lo, hi, got.data());
      CHECK(got == want);
      kk::protect_outside(seqs.data(), n, lo, hi, got2.data());
      CHECK(got2 == want);
#if KVEVICT_X86
      if (avx2) {
        std::vector<std::uint64_t> got3(words, 0);
        kk::detail::avx2::protect_outside(seqs.data(), n, lo, hi, got3.data());
        CHECK(got3 == want);
      }
#endif
    }
    // find_equal_masked: first eligible index >= from with s[i] == v.
    std::vector<float> s(n);
    for (auto& x : s) x = static_cast<float>(rng() % 7) - 3.0f;
    if (n > 2) s[n / 2] = -0.0f;
    std::vector<std::uint64_t> prot((n + 63) / 64);
    for (auto& w : prot) w = rng() & rng();
    for (float v : {0.0f, 2.0f, 9.0f})
      for (std::size_t from : {std::size_t{0}, n / 3, n}) {
        std::size_t want = kk::npos;
        for (std::size_t i = from; i < n; ++i)
          if (!((prot[i / 64] >> (i % 64)) & 1u) && s[i] == v) {
            want = i;
            break;
          }
        CHECK(kk::detail::scalar::find_eq(s.data(), n, from, prot.data(), v) == want);
        CHECK(kk::find_equal_masked(s.data(), n, from, prot.data(), v) == want);
#if KVEVICT_X86
        if (avx2) CHECK(kk::detail::avx2::find_eq(s.data(), n, from, prot.data(), v) == want);
#endif
      }
    // group_sum_checked: bit-identical to 0 + p0 + p1 + ..., false on any non-finite value.
    for (std::size_t g : {1u, 4u, 7u}) {
      std::vector<float> p(g * n);
      std::uniform_real_distribution<float> u(0.0f, 1.0f);
      for (auto& x : p) x = u(rng) * u(rng);
      std::vector<float> want(n), got(n, -1.0f), got2(n, -1.0f);
      for (std::size_t r = 0; r < n; ++r) {
        float acc = 0.0f;
        for (std::size_t k = 0; k < g; ++k) acc += p[k * n + r];
        want[r] = acc;
      }
      CHECK(kk::detail::scalar::group_sum(p.data(), g, n, got.data()));
      CHECK((n == 0 || std::memcmp(got.data(), want.data(), n * sizeof(float)) == 0));
      CHECK(kk::group_sum_checked(p.data(), g, n, got2.data()));
      CHECK((n == 0 || std::memcmp(got2.data(), want.data(), n * sizeof(float)) == 0));
      if (n > 0) {
        for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()}) {
          auto q = p;
          q[(g - 1) * n + n - 1] = bad;
          CHECK_FALSE(kk::detail::scalar::group_sum(q.data(), g, n, got.data()));
          CHECK_FALSE(kk::group_sum_checked(q.data(), g, n, got.data()));
        }
        auto q = p;
        q[0] = std::numeric_limits<float>::max();  // the largest finite value passes
        CHECK(kk::group_sum_checked(q.data(), g, n, got.data()));
      }
    }
  }
}

// observe's fused kernels (group_sum_bounded, decay_spike) and the recall reserve's
// candidate gather (gather_open): scalar and AVX2 bodies against plain loops, bit for bit.
TEST_CASE("observe and reserve kernels match plain loops at every level", "[kernels][select]") {
  std::mt19937_64 rng(91);
  const bool avx2 = kk::isa_supported(Isa::avx2);
  const bool avx512 = kk::isa_supported(Isa::avx512);
  const float hi = 1.0f + 1.0f / 64;
  const auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  };
  for (std::size_t n : {0u, 1u, 7u, 8u, 9u, 63u, 64u, 65u, 200u, 1000u, 4099u}) {
    // group_sum_bounded: the sums of 0 + p0 + p1 + ...; true iff every value is +-0 or in (0, hi].
    for (std::size_t g : {1u, 2u, 3u, 4u, 8u, 9u}) {
      std::vector<float> p(g * n);
      std::uniform_real_distribution<float> u(0.0f, 1.0f);
      for (auto& x : p) x = u(rng) * u(rng);
      if (n > 3) p[n / 2] = -0.0f, p[n / 3] = hi, p[1] = 1.0f;
      std::vector<float> want(n);
      for (std::size_t r = 0; r < n; ++r) {
        float acc = 0.0f;
        for (std::size_t k = 0; k < g; ++k) acc += p[k * n + r];
        want[r] = acc;
      }
      std::vector<float> got(n, -1.0f), got2(n, -1.0f), got3(n, -1.0f), got4(n, -1.0f);
      CHECK(kk::detail::scalar::group_sum_bounded(p.data(), g, n, hi, got.data()));
      CHECK(same(got, want));
      CHECK(kk::group_sum_bounded(p.data(), g, n, hi, got2.data()));
      CHECK(same(got2, want));
#if KVEVICT_X86
      if (avx2) {
        CHECK(kk::detail::avx2::group_sum_bounded(p.data(), g, n, hi, got3.data()));
        CHECK(same(got3, want));
      }
      if (avx512) {
        CHECK(kk::detail::avx512::group_sum_bounded(p.data(), g, n, hi, got4.data()));
        CHECK(same(got4, want));
      }
#endif
      if (n == 0) continue;
      const float bads[] = {std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::nextafter(hi, 2.0f),
                            -std::numeric_limits<float>::denorm_min(),
                            -0.5f,
                            2.0f};
      for (float bad : bads)
        for (std::size_t at : {std::size_t{0}, n / 2, g * n - 1}) {
          auto q = p;
          q[at] = bad;
          CHECK_FALSE(kk::detail::scalar::group_sum_bounded(q.data(), g, n, hi, got.data()));
          CHECK_FALSE(kk::group_sum_bounded(q.data(), g, n, hi, got.data()));
#if KVEVICT_X86
          if (avx2) CHECK_FALSE(kk::detail::avx2::group_sum_bounded(q.data(), g, n, hi, got.data()));
          if (avx512) CHECK_FALSE(kk::detail::avx512::group_sum_bounded(q.data(), g, n, hi, got.data()));
#endif
        }
    }
    // decay_spike: score = decay * score + x (multiply, then add), spike = max(spike, x)
    // where latest - seq >= band (unsigned; seqs above latest wrap and count as old).
    std::vector<std::uint64_t> seqs(n);
    std::iota(seqs.begin(), seqs.end(), std::uint64_t{100});
    std::shuffle(seqs.begin(), seqs.end(), rng);
    if (n > 5) seqs[3] = 100 + n + 7;  // newer than `latest`
    std::vector<float> x(n), score0(n), spike0(n);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (std::size_t r = 0; r < n; ++r) {
      x[r] = u(rng) * u(rng) * 4.0f;
      score0[r] = u(rng);
      spike0[r] = (rng() % 3 == 0) ? x[r] : u(rng) * 2.0f;  // some ties with x
    }
    if (n > 2) x[1] = 0.0f, spike0[1] = -0.0f;  // max(-0, +0) keeps the spike's -0
    for (float decay : {0.0f, 0.75f, 0.99609375f, 1.0f})
      for (std::uint64_t band : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{n / 3},
                                 std::uint64_t{n + 200}, ~std::uint64_t{0}}) {
        const std::uint64_t latest = 100 + n;
        std::vector<float> ws = score0, wp = spike0;
        for (std::size_t r = 0; r < n; ++r) {
          volatile float prod = decay * ws[r];  // no contraction into an FMA
          ws[r] = prod + x[r];
          if (latest - seqs[r] >= band) wp[r] = std::max(wp[r], x[r]);
        }
        std::vector<float> s1 = score0, p1 = spike0;
        kk::detail::scalar::decay_spike(s1.data(), p1.data(), x.data(), seqs.data(), n, decay,
                                        latest, band);
        CHECK(same(s1, ws));
        CHECK(same(p1, wp));
        std::vector<float> s2 = score0, p2 = spike0;
        kk::decay_spike(s2.data(), p2.data(), x.data(), seqs.data(), n, decay, latest, band);
        CHECK(same(s2, ws));
        CHECK(same(p2, wp));
#if KVEVICT_X86
        if (avx2) {
          std::vector<float> s3 = score0, p3 = spike0;
          kk::detail::avx2::decay_spike(s3.data(), p3.data(), x.data(), seqs.data(), n, decay,
                                        latest, band);
          CHECK(same(s3, ws));
          CHECK(same(p3, wp));
        }
#endif
      }
    // gather_open: unprotected rows with s > 0 and s >= lo, in index order.
    std::vector<float> s(n);
    for (auto& v : s) v = static_cast<float>(rng() % 9) * 0.25f - 0.5f;  // -0.5 .. 1.5, ties
    if (n > 4) s[2] = std::numeric_limits<float>::quiet_NaN(), s[4] = -0.0f;
    std::vector<std::uint64_t> prot((n + 63) / 64);
    for (auto& w : prot) w = rng() & rng();
    if (!prot.empty() && n % 64) prot.back() |= ~std::uint64_t{0} << (n % 64);  // past n: set
    for (float lo : {0.0f, -1.0f, 0.25f, 0.5f, 2.0f}) {
      std::vector<float> wv;
      std::vector<std::uint32_t> wi;
      for (std::size_t i = 0; i < n; ++i)
        if (!((prot[i / 64] >> (i % 64)) & 1u) && s[i] > 0.0f && s[i] >= lo) {
          wv.push_back(s[i]);
          wi.push_back(static_cast<std::uint32_t>(i));
        }
      const auto check = [&](auto fn) {
        std::vector<float> gv(n, -7.0f);
        std::vector<std::uint32_t> gi(n, 99);
        const std::size_t c = fn(gv.data(), gi.data());
        REQUIRE(c == wv.size());
        gv.resize(c);
        gi.resize(c);
        CHECK(same(gv, wv));
        CHECK(gi == wi);
      };
      check([&](float* v, std::uint32_t* i) {
        return kk::detail::scalar::gather_open(s.data(), n, prot.data(), lo, v, i);
      });
      check([&](float* v, std::uint32_t* i) {
        return kk::gather_open(s.data(), n, prot.data(), lo, v, i);
      });
#if KVEVICT_X86
      if (avx2)
        check([&](float* v, std::uint32_t* i) {
          return kk::detail::avx2::gather_open(s.data(), n, prot.data(), lo, v, i);
        });
#endif
    }
  }
}

// lowest_open / decay_lowest_open (ExpectedAttention's and KeyDiff's step between
// rescorings): the same scores, bit for bit, and the same row as the four passes they
// replace (the decay loop, protect_outside, argmin_masked, the equal-score scan for the
// lowest seq), at every level; ties, NaN, +-0, infinities, empty and full open ranges.
TEST_CASE("lowest_open is the decay loop, protection bits, masked argmin and tie scan in one pass",
          "[kernels][select]") {
  std::mt19937_64 rng(17);
  const bool avx2 = kk::isa_supported(Isa::avx2);
  const bool avx512 = kk::isa_supported(Isa::avx512);
  const float inf = std::numeric_limits<float>::infinity();
  for (std::size_t n : {0u, 1u, 5u, 8u, 9u, 15u, 16u, 17u, 31u, 63u, 64u, 65u, 130u, 1000u, 1024u}) {
    std::vector<std::uint64_t> seqs(n);
    std::iota(seqs.begin(), seqs.end(), std::uint64_t{0});
    std::shuffle(seqs.begin(), seqs.end(), rng);
    for (int variant = 0; variant < 5; ++variant) {
      std::vector<float> s0(n), x(n);
      for (std::size_t r = 0; r < n; ++r) {
        // variant 0: distinct-ish values; 1: few values (many ties); 2: specials; 3: all
        // equal; 4: full-mantissa values (a fused multiply-add would round differently)
        s0[r] = variant == 3 ? 0.5f : variant == 1 ? static_cast<float>(rng() % 3) * 0.25f
                                                   : std::ldexp(static_cast<float>(rng() % 1000), -9);
        x[r] = variant == 3 ? 0.25f : variant == 1 ? static_cast<float>(rng() % 2) * 0.5f
                                                   : std::ldexp(static_cast<float>(rng() % 977), -10);
        if (variant == 4) {
          s0[r] = std::ldexp(static_cast<float>(rng() & 0xffffff), -20);
          x[r] = std::ldexp(static_cast<float>(rng() & 0xffffff), -25);
        }
        if (variant == 2) {
          const std::uint64_t k = rng() % 8;
          if (k == 0) s0[r] = std::numeric_limits<float>::quiet_NaN();
          if (k == 1) s0[r] = -0.0f, x[r] = 0.0f;
          if (k == 2) s0[r] = 0.0f, x[r] = -0.0f;
          if (k == 3) s0[r] = inf;
          if (k == 4) x[r] = -inf;
        }
      }
      for (float decay : {0.0f, 0.75f, 0.99609375f, 1.0f, 0.9921875f + 0x1p-20f})
        for (auto [lo, hi] : {std::pair<std::uint64_t, std::uint64_t>{0, n}, {1, n > 3 ? n - 3 : 0},
                              {4, n / 2}, {n / 2, n / 2}, {n, 0}, {0, ~std::uint64_t{0}}}) {
          // The four passes, written out.
          std::vector<float> want = s0;
          for (std::size_t r = 0; r < n; ++r) {
            volatile float prod = decay * want[r];  // no contraction into an FMA
            want[r] = prod + x[r];
          }
          std::vector<std::uint64_t> bits((n + 63) / 64 + 1);
          kk::detail::scalar::protect_outside(seqs.data(), n, lo, hi, bits.data());
          std::size_t best = kk::argmin_masked<Isa::scalar>(want.data(), n, bits.data());
          if (best != kk::npos)
            for (std::size_t j = best;
                 (j = kk::detail::scalar::find_eq(want.data(), n, j + 1, bits.data(), want[best])) != kk::npos;)
              if (seqs[j] < seqs[best]) best = j;
          std::size_t still = kk::argmin_masked<Isa::scalar>(s0.data(), n, bits.data());
          if (still != kk::npos)
            for (std::size_t j = still;
                 (j = kk::detail::scalar::find_eq(s0.data(), n, j + 1, bits.data(), s0[still])) != kk::npos;)
              if (seqs[j] < seqs[still]) still = j;
          const auto same = [&](const std::vector<float>& a) {
            return n == 0 || std::memcmp(a.data(), want.data(), n * sizeof(float)) == 0;
          };
          // Every form on seqs (64-bit) or keys (32-bit), with their bounds.
          const auto forms = [&](const auto& k, auto klo, auto khi) {
            std::vector<float> a = s0;
            CHECK(kk::detail::scalar::lowest_open<true>(a.data(), x.data(), k.data(), n, decay, klo, khi) == best);
            CHECK(same(a));
            a = s0;
            CHECK(kk::decay_lowest_open(a.data(), x.data(), k.data(), n, decay, klo, khi) == best);
            CHECK(same(a));
            CHECK(kk::lowest_open(s0.data(), k.data(), n, klo, khi) == still);
#if KVEVICT_X86
            if (avx2) {
              a = s0;
              CHECK(kk::detail::avx2::lowest_open<true>(a.data(), x.data(), k.data(), n, decay, klo, khi) == best);
              CHECK(same(a));
              a = s0;
              CHECK(kk::detail::avx2::lowest_open<false>(a.data(), nullptr, k.data(), n, 0.0f, klo, khi) == still);
            }
            if (avx512) {
              a = s0;
              CHECK(kk::detail::avx512::lowest_open<true>(a.data(), x.data(), k.data(), n, decay, klo, khi) == best);
              CHECK(same(a));
              a = s0;
              CHECK(kk::detail::avx512::lowest_open<false>(a.data(), nullptr, k.data(), n, 0.0f, klo, khi) == still);
              CHECK((n == 0 || std::memcmp(a.data(), s0.data(), n * sizeof(float)) == 0));
            }
#endif
          };
          forms(seqs, lo, hi);
          // The 32-bit form on keys = seq + offset (offsets that put the keys below, across
          // and at the top of the signed range; bounds clamped to n, which all seqs are
          // below): the same scores and rows.
          for (std::uint64_t offset : {std::uint64_t{0}, std::uint64_t{0x7ffffff0u},
                                       std::uint64_t{0xffffffffu} - n}) {
            std::vector<std::uint32_t> keys(n);
            for (std::size_t r = 0; r < n; ++r) keys[r] = static_cast<std::uint32_t>(seqs[r] + offset);
            forms(keys, static_cast<std::uint32_t>(std::min<std::uint64_t>(lo, n) + offset),
                  static_cast<std::uint32_t>(std::min<std::uint64_t>(hi, n) + offset));
          }
        }
    }
  }
}

// KeyDiff's bounded search kernels (row_dots.hpp): the gather of open rows at or below a
// threshold is the same set in index order at every level; the scaled dot products are
// within the d-term float bound of the double dot product at every level, for all rows or
// the rows of an index list (out written at those rows only).
// gather_at_most (pooled_victim_counts' guessed-bound gather): the rows at or below the
// threshold in index order and the count of finite values (not +inf, not NaN), at every level.
TEST_CASE("gather_at_most agrees with its definition at every level", "[kernels][select]") {
  std::mt19937_64 rng(29);
  const bool avx2 = kk::isa_supported(Isa::avx2), avx512 = kk::isa_supported(Isa::avx512);
  constexpr float inf = std::numeric_limits<float>::infinity();
  constexpr float top = std::numeric_limits<float>::max();
  for (std::size_t n : {0u, 1u, 7u, 8u, 15u, 16u, 17u, 31u, 33u, 100u, 1000u}) {
    std::vector<float> s(n);
    for (auto& x : s) {
      const auto k = rng() % 10;
      x = k == 0 ? inf : k == 1 ? top : k == 2 ? std::numeric_limits<float>::quiet_NaN()
                                               : static_cast<float>(rng() % 7) - 3.0f;
    }
    if (n > 4) s[3] = -0.0f, s[n - 1] = inf;
    std::size_t finite_want = 0;
    for (float x : s) finite_want += x <= top ? 1 : 0;
    for (float t : {-4.0f, 0.0f, 1.0f, 5.0f, top, inf}) {
      std::vector<std::uint32_t> want;
      for (std::size_t r = 0; r < n; ++r)
        if (s[r] <= t) want.push_back(static_cast<std::uint32_t>(r));
      std::vector<std::uint32_t> idx(n + 1);
      const auto got = [&](std::size_t m) { return std::vector<std::uint32_t>(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(m)); };
      std::size_t fin = 12345;
      CHECK(got(kk::gather_at_most(s.data(), n, t, idx.data(), &fin)) == want);
      CHECK(fin == finite_want);
      fin = 12345;
      CHECK(got(kk::detail::scalar::gather_at_most_body(s.data(), n, t, idx.data(), &fin, 0, 0, 0)) == want);
      CHECK(fin == finite_want);
#if KVEVICT_X86
      if (avx2) {
        fin = 12345;
        CHECK(got(kk::detail::avx2::gather_at_most(s.data(), n, t, idx.data(), &fin)) == want);
        CHECK(fin == finite_want);
      }
      if (avx512) {
        fin = 12345;
        CHECK(got(kk::detail::avx512::gather_at_most(s.data(), n, t, idx.data(), &fin)) == want);
        CHECK(fin == finite_want);
      }
#endif
    }
  }
}

TEST_CASE("gather_open_at_most and scaled_row_dots agree with their definitions at every level",
          "[kernels][select]") {
  std::mt19937_64 rng(23);
  std::normal_distribution<float> nd;
  const bool avx2 = kk::isa_supported(Isa::avx2), avx512 = kk::isa_supported(Isa::avx512);
  for (std::size_t n : {0u, 1u, 7u, 8u, 15u, 16u, 17u, 100u, 1000u}) {
    std::vector<std::uint64_t> seqs(n);
    std::iota(seqs.begin(), seqs.end(), std::uint64_t{3});
    std::shuffle(seqs.begin(), seqs.end(), rng);
    std::vector<float> s(n);
    for (auto& x : s) x = static_cast<float>(rng() % 7) - 3.0f;
    if (n > 4) s[2] = std::numeric_limits<float>::quiet_NaN(), s[3] = -0.0f;
    for (float t : {-4.0f, 0.0f, 1.0f, 5.0f})
      for (auto [lo, hi] : {std::pair<std::uint64_t, std::uint64_t>{0, ~std::uint64_t{0}},
                            {5, n / 2 + 3}, {n, 2}}) {
        std::vector<std::uint32_t> want;
        for (std::size_t r = 0; r < n; ++r)
          if (s[r] <= t && seqs[r] >= lo && seqs[r] < hi) want.push_back(static_cast<std::uint32_t>(r));
        std::vector<std::uint32_t> idx(n + 1);
        const auto got = [&](std::size_t m) { return std::vector<std::uint32_t>(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(m)); };
        CHECK(got(kk::gather_open_at_most(s.data(), seqs.data(), n, lo, hi, t, idx.data())) == want);
        const std::uint64_t span = hi > lo ? hi - lo : 0;
        CHECK(got(kk::detail::scalar::gather_open_at_most_body(s.data(), seqs.data(), n, lo, span, t, idx.data(), 0, 0)) == want);
#if KVEVICT_X86
        if (avx2) CHECK(got(kk::detail::avx2::gather_open_at_most(s.data(), seqs.data(), n, lo, span, t, idx.data())) == want);
        if (avx512) CHECK(got(kk::detail::avx512::gather_open_at_most(s.data(), seqs.data(), n, lo, span, t, idx.data())) == want);
#endif
      }
  }
  for (std::size_t d : {1u, 8u, 16u, 20u, 33u, 128u}) {
    const std::size_t n = 37;
    std::vector<float> rows(n * d), a(d);
    std::vector<double> scale(n);
    for (auto& x : rows) x = nd(rng);
    for (auto& x : a) x = nd(rng) * 10.0f;
    for (auto& x : scale) x = 0.5 + static_cast<double>(rng() % 100) / 64.0;
    const std::vector<std::uint32_t> some{3, 0, 36, 17, 18, 5};
    using Fn = void (*)(const float*, std::size_t, std::size_t, const float*, const double*, float,
                        float*, const std::uint32_t*);
    std::vector<Fn> levels{&kk::detail::scalar::scaled_row_dots};
#if KVEVICT_X86
    if (avx2) levels.push_back(&kk::detail::avx2::scaled_row_dots);
    if (avx512) levels.push_back(&kk::detail::avx512::scaled_row_dots);
#endif
    auto check = [&](const std::vector<float>& out, const std::vector<std::uint32_t>* only) {
      for (std::size_t r = 0; r < n; ++r) {
        const bool in = only == nullptr || std::find(only->begin(), only->end(), r) != only->end();
        if (!in) {
          CHECK(out[r] == 7.0f);  // untouched
          continue;
        }
        double dot = 0.0, mag = 0.0;
        for (std::size_t j = 0; j < d; ++j) {
          dot += static_cast<double>(rows[r * d + j]) * a[j];
          mag += std::fabs(static_cast<double>(rows[r * d + j]) * a[j]);
        }
        const double f = static_cast<double>(static_cast<float>(scale[r]));
        CHECK(std::fabs(static_cast<double>(out[r]) - (-dot * f)) <=
              (static_cast<double>(d) + 4.0) * 0x1p-23 * mag * f + 1e-30);
      }
    };
    for (Fn fn : levels) {
      std::vector<float> out(n, 7.0f);
      fn(rows.data(), n, d, a.data(), scale.data(), -1.0f, out.data(), nullptr);
      check(out, nullptr);
      std::fill(out.begin(), out.end(), 7.0f);
      fn(rows.data(), some.size(), d, a.data(), scale.data(), -1.0f, out.data(), some.data());
      check(out, &some);
    }
    std::vector<float> out(n, 7.0f);
    kk::scaled_row_dots(rows.data(), n, d, a.data(), scale.data(), -1.0f, out.data());
    check(out, nullptr);
    std::fill(out.begin(), out.end(), 7.0f);
    kk::scaled_row_dots_at(rows.data(), d, some.data(), some.size(), a.data(), scale.data(), -1.0f, out.data());
    check(out, &some);
  }
}

TEST_CASE("arrival_dots: the squared norm and G dot products in 8 lanes at every level",
          "[kernels][select]") {
  std::mt19937_64 rng(29);
  std::normal_distribution<float> nd;
  const bool avx2 = kk::isa_supported(Isa::avx2);
  const bool avx512 = kk::isa_supported(Isa::avx512);
  for (std::size_t d : {1u, 7u, 8u, 9u, 16u, 33u, 128u, 129u})
    for (std::size_t G : {1u, 2u, 3u, 4u, 8u, 16u}) {
      std::vector<float> key(d), val(d);
      std::vector<double> means(G * d);
      for (auto& x : key) x = nd(rng);
      for (auto& x : val) x = nd(rng) * 3.0f;
      for (auto& x : means) x = static_cast<double>(nd(rng)) * (1.0 + 1.0 / 3.0);  // full mantissas
      // The definition: coordinate i into lane i % 8 in order, then the tree.
      auto lanes = [&](auto a, auto b) {
        double l[8] = {};
        for (std::size_t i = 0; i < d; ++i) {
          const double p = static_cast<double>(a[i]) * static_cast<double>(b[i]);
          l[i % 8] += p;
        }
        return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
      };
      std::vector<double> want(G);
      for (std::size_t g = 0; g < G; ++g) want[g] = lanes(means.data() + g * d, key.data());
      const double want_sq = lanes(val.data(), val.data());
      // Within rounding of the ordered sums (what the lanes replace).
      for (std::size_t g = 0; g < G; ++g) {
        double ordered = 0.0, mag = 0.0;
        for (std::size_t i = 0; i < d; ++i) {
          ordered += means[g * d + i] * static_cast<double>(key[i]);
          mag += std::fabs(means[g * d + i] * static_cast<double>(key[i]));
        }
        CHECK(std::fabs(want[g] - ordered) <= 2.0 * static_cast<double>(d) * 0x1p-52 * mag);
      }
      using Fn = double (*)(const float*, const float*, const double*, std::size_t, std::size_t,
                            double*);
      std::vector<Fn> levels{&kk::detail::scalar::arrival_dots, &kk::arrival_dots};
#if KVEVICT_X86
      if (avx2) levels.push_back(&kk::detail::avx2::arrival_dots);
      if (avx512 && kk::detail::avx512::arrival_dots_fused_group(G))
        levels.push_back(&kk::detail::avx512::arrival_dots);
#endif
      for (std::size_t at = 0; at < levels.size(); ++at) {
        const Fn fn = levels[at];
        INFO("d " << d << ", G " << G << ", level " << at);
        std::vector<double> lin(G + 1, 7.0);
        CHECK(fn(key.data(), val.data(), means.data(), G, d, lin.data()) == want_sq);
        for (std::size_t g = 0; g < G; ++g) CHECK(lin[g] == want[g]);
        CHECK(lin[G] == 7.0);  // untouched
      }
    }
}

// abs_below (the input checks of an append or prefill): scalar, AVX2 and AVX-512 bodies
// against a plain per-value test, for 1-6 arrays of unequal lengths (the SIMD forms read up
// to four at once, in proportion to their lengths, then each array's rest), every bound kind, and
// one bad value planted at each kind of place (first, inside a round, in the rest, last).
TEST_CASE("abs_below matches a per-value test at every level", "[kernels][select]") {
  std::mt19937_64 rng(417);
  const bool avx2 = kk::isa_supported(Isa::avx2);
  const bool avx512 = kk::isa_supported(Isa::avx512);
  const float inf = std::numeric_limits<float>::infinity();
  const float half_limit = 65520.0f;  // fp16: |x| >= 65520 rounds to infinity
  const auto bits = [](float x) { return std::bit_cast<std::uint32_t>(x); };
  const std::uint32_t limits[] = {bits(inf), bits(half_limit), bits(1.0f), 0x80000000u, 0u};
  // reference: every |x| has a bit pattern below the array's limit
  const auto want = [&](const std::vector<std::vector<float>>& a, const std::vector<std::uint32_t>& lim) {
    for (std::size_t j = 0; j < a.size(); ++j)
      for (float x : a[j])
        if ((bits(x) & 0x7fffffffu) >= lim[j]) return false;
    return true;
  };
  const auto run = [&](const std::vector<std::vector<float>>& a, const std::vector<std::uint32_t>& lim,
                       bool expect) {
    std::vector<const float*> xs;
    std::vector<std::size_t> ns;
    for (const auto& v : a) xs.push_back(v.data()), ns.push_back(v.size());
    REQUIRE(want(a, lim) == expect);
    CHECK(kk::detail::scalar::abs_below(xs.data(), ns.data(), lim.data(), a.size()) == expect);
    CHECK(kk::abs_below(xs.data(), ns.data(), lim.data(), a.size()) == expect);
#if KVEVICT_X86
    if (avx2) CHECK(kk::detail::avx2::abs_below(xs.data(), ns.data(), lim.data(), a.size()) == expect);
    if (avx512) CHECK(kk::detail::avx512::abs_below(xs.data(), ns.data(), lim.data(), a.size()) == expect);
#endif
  };
  const std::vector<std::vector<std::size_t>> shapes = {
      {0}, {1}, {7}, {31}, {32}, {33}, {63}, {64}, {65}, {129, 40}, {1024, 1024, 4096}, {1024, 0, 4096}, {128, 128, 512},
      {100, 1000, 37}, {64, 96, 65, 200}, {5, 300, 300, 7, 1000}, {2048, 2048, 8192, 64, 3, 999}};
  for (const auto& shape : shapes)
    for (std::uint32_t limit : limits) {
      if (limit == 0) continue;  // every value fails: checked below
      std::vector<std::vector<float>> a;
      std::vector<std::uint32_t> lim;
      // values strictly inside the bound (the largest magnitude below it included)
      const float top = limit == 0x80000000u ? inf : std::bit_cast<float>(limit - 1);
      for (std::size_t j = 0; j < shape.size(); ++j) {
        std::vector<float> v(shape[j]);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (auto& x : v) x = u(rng) * (limit == bits(1.0f) ? 0.999f : 1000.0f);
        if (!v.empty()) v[v.size() / 2] = -top, v.back() = top, v.front() = -0.0f;
        a.push_back(std::move(v));
        lim.push_back(j == shape.size() - 1 && limit != 0x80000000u ? bits(inf) : limit);
      }
      if (lim.back() == bits(inf) && !a.back().empty()) a.back().back() = std::nextafter(inf, 0.0f);
      run(a, lim, true);
      if (limit == 0x80000000u) {  // nothing fails this bound, not even NaN
        for (auto& v : a)
          if (!v.empty()) v[0] = std::numeric_limits<float>::quiet_NaN();
        run(a, lim, true);
        continue;
      }
      const float bads[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                            inf, -inf, std::bit_cast<float>(lim[0]), -std::bit_cast<float>(lim[0])};
      for (std::size_t j = 0; j < a.size(); ++j) {
        const std::size_t n = a[j].size();
        if (n == 0) continue;
        for (std::size_t at : {std::size_t{0}, n / 3, n - n % 32 + (n % 32) / 2, n - n % 64 + (n % 64) / 2,
                               n - n % 16 + (n % 16) / 2, n - 1}) {
          if (at >= n) continue;
          for (float bad : bads) {
            if ((bits(bad) & 0x7fffffffu) < lim[j]) continue;  // not bad for this array
            auto b = a;
            b[j][at] = bad;
            run(b, lim, false);
          }
        }
      }
    }
  // limit 0 rejects every value, +-0 included; empty arrays pass any bound
  run({{0.0f}}, {0u}, false);
  run({{}, {}}, {0u, 0u}, true);
  // a bound above 0x80000000 is an error, not a silently wrong test
  const float one = 1.0f;
  const float* x1 = &one;
  const std::size_t n1 = 1;
  const std::uint32_t too_big = 0x80000001u;
  CHECK_THROWS_AS(kk::abs_below(&x1, &n1, &too_big, 1), std::invalid_argument);
}
