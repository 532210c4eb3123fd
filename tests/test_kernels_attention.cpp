// The decode-attention kernel (kernels/attention_decode.hpp) against the Eigen reference it
// replaced (detail::group_probabilities_reference + an Eigen p.V), at every ISA level this
// CPU runs (pinned templates; CTest also reruns the binary with KVEVICT_ISA=scalar / avx2),
// for fp32 / fp16 / bf16 rows, G = 1, 4, 8, n from 1 to 3001 (non-multiples of every vector
// width) and d = 8, 20, 64, 128. Also: attend()'s strong guarantee, scale validation,
// size_t geometry arithmetic, the workspace overload and decode_attention on raw rows.
//
// Tolerances are derived per case from the data, not picked: a float dot product of d terms
// (any summation order) is within d*u*sum_j |q_j k_j| of the exact value (u = 2^-24), so two
// implementations differ by at most twice that in each score, times the scale. A score error
// e moves a softmax probability by a relative exp(2e)-1 (about 2e); exp itself (2 ulp here,
// ~1 ulp in Eigen) and the normalisation add a few u. For the output, row i contributes
// |dp_i| |v_ij| plus the float accumulation over n rows, at most n*u*sum_i p_i |v_ij| per
// implementation.
#include <catch2/catch.hpp>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "support/test_support.hpp"

using namespace kvevict;
namespace kk = kvevict::kernels;
using kk::Isa;
using kk::KvFormat;
using kvtest::Rng;

namespace {

constexpr double u = 1.0 / (1 << 24);

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

template <class S>
std::vector<S> convert(const std::vector<float>& x) {
  std::vector<S> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = static_cast<S>(x[i]);
  return y;
}

template <class S>
double wide(S x) {
  return static_cast<double>(static_cast<float>(x));
}

struct Case {
  std::size_t G, n, d;
  float qscale;  // query magnitude: 1 gives scores ~ N(0, 1); 12 gives a peaked softmax
};

/// Runs one case at one level and checks it against the Eigen reference.
template <Isa I, class S>
void check_case(const Case& c, Rng& rng) {
  const std::size_t G = c.G, n = c.n, d = c.d;
  // Rows with a stride larger than d (an engine's interleaved heads), padding filled with junk.
  const std::size_t stride = d + 3;
  const auto kf = rng.normals(n * stride), vf = rng.normals(n * stride);
  const auto q = rng.normals(G * d, c.qscale);
  const auto K = convert<S>(kf), V = convert<S>(vf);
  std::vector<S> Kd(n * d), Vd(n * d);  // dense copies for the reference
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < d; ++j) {
      Kd[i * d + j] = K[i * stride + j];
      Vd[i * d + j] = V[i * stride + j];
    }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  constexpr KvFormat fmt = detail::kv_format_of<S>();

  std::vector<float> p(G * n, -1.0f), out(G * (d + 1), -7.0f);
  REQUIRE(kk::attention_probs<I>(q.data(), d, G, K.data(), stride, fmt, n, d, scale, p.data()));
  kk::attention_output<I>(p.data(), G, V.data(), stride, fmt, n, d, out.data(), d + 1);

  std::vector<float> pr(G * n);
  detail::group_probabilities_reference(Kd.data(), n, d, q.data(), int(G), pr.data(), scale);
  using M = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const M orf = Eigen::Map<const M>(pr.data(), Eigen::Index(G), Eigen::Index(n)) *
                Eigen::Map<const Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
                    Vd.data(), Eigen::Index(n), Eigen::Index(d))
                    .template cast<float>();

  for (std::size_t g = 0; g < G; ++g) {
    // Per-row score error bound, and the probability bound it implies.
    double worst_s = 0;
    for (std::size_t i = 0; i < n; ++i) {
      double a = 0;
      for (std::size_t j = 0; j < d; ++j) a += std::abs(double(q[g * d + j]) * wide(Kd[i * d + j]));
      worst_s = std::max(worst_s, 2.0 * double(d) * u * a * double(scale));
    }
    const double prel = std::expm1(2.0 * worst_s) + 16.0 * u;
    double sum = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double got = p[g * n + i], ref = pr[g * n + i];
      sum += got;
      const double tol = prel * ref + 2e-38;  // 2e-38: AVX2's exp flushes below FLT_MIN
      if (!(std::abs(got - ref) <= tol)) {
        INFO("g " << g << " row " << i << " kernel " << got << " reference " << ref << " tol " << tol);
        REQUIRE(std::abs(got - ref) <= tol);
      }
    }
    // The kernel's own probabilities sum to 1 up to the float normalisation.
    REQUIRE(std::abs(sum - 1.0) <= double(n + 4) * u);
    for (std::size_t j = 0; j < d; ++j) {
      double tol = 0;
      for (std::size_t i = 0; i < n; ++i)
        tol += (prel * pr[g * n + i] + 2e-38 + 2.0 * double(n) * u * pr[g * n + i]) *
               std::abs(wide(Vd[i * d + j]));
      tol += 1e-30;
      const double got = out[g * (d + 1) + j], ref = orf(Eigen::Index(g), Eigen::Index(j));
      if (!(std::abs(got - ref) <= tol)) {
        INFO("g " << g << " col " << j << " kernel " << got << " reference " << ref << " tol " << tol);
        REQUIRE(std::abs(got - ref) <= tol);
      }
    }
    REQUIRE(out[g * (d + 1) + d] == -7.0f);  // the stride padding of out is not written
  }
}

}  // namespace

TEST_CASE("attention kernel matches the Eigen reference at every level, format and shape",
          "[kernels][attention]") {
  for (const Isa isa : levels())
    for (const std::size_t G : {1, 4, 8})
      for (const std::size_t d : {8, 20, 64, 128})
        for (const std::size_t n : {1, 2, 3, 7, 16, 17, 33, 100, 1000, 3001}) {
          if (n > 1000 && G == 8 && d != 128) continue;  // keep the binary fast
          const float qs = (n % 2) ? 12.0f : 1.0f;        // peaked softmax on odd n
          INFO("isa " << kk::isa_name(isa) << " G " << G << " d " << d << " n " << n << " qscale " << qs);
          Rng rng(G * 100003 + d * 1009 + n);
          const Case c{G, n, d, qs};
          at(isa, [&](auto I) {
            check_case<decltype(I)::value, float>(c, rng);
            check_case<decltype(I)::value, Eigen::half>(c, rng);
            check_case<decltype(I)::value, Eigen::bfloat16>(c, rng);
          });
        }
}

TEST_CASE("attention kernel reports non-finite scores at every level", "[kernels][attention]") {
  const std::size_t d = 24, n = 37;
  for (const Isa isa : levels())
    for (const std::size_t bad_row : {std::size_t(0), std::size_t(17), n - 1}) {
      INFO("isa " << kk::isa_name(isa) << " row " << bad_row);
      std::vector<float> k(n * d, 0.5f), q(4 * d, 1.0f), p(4 * n);
      k[bad_row * d + 5] = 3e38f;  // finite key, but q.k = 3e38 + ... overflows
      k[bad_row * d + 6] = 3e38f;
      const bool ok = at(isa, [&](auto I) {
        return kk::attention_probs<decltype(I)::value>(q.data(), d, 4, k.data(), d, KvFormat::f32,
                                                       n, d, 1.0f, p.data());
      });
      CHECK_FALSE(ok);
    }
}

TEST_CASE("attend: every head is computed and checked before any policy observes",
          "[attention]") {
  // KV head 0 is ordinary, KV head 1 overflows: attend must throw with H2O's scores of
  // head 0 untouched (before the fix head 0 was observed first).
  const Geometry g{1, 4, 2, 16};
  KVCache<policies::H2O> cache(g, Budget::unbounded(), policies::H2O({4, 0}));
  Rng rng(5);
  for (int t = 0; t < 9; ++t) {
    auto k = rng.normals(32);
    if (t == 4)
      for (int j = 16; j < 32; ++j) k[std::size_t(j)] = 2e38f;
    cache.append(0, t, k, rng.normals(32));
  }
  std::vector<float> q(64, 0.1f);
  for (int j = 32; j < 64; ++j) q[std::size_t(j)] = 100.0f;  // head 1's queries
  const auto before0 = cache.policy().scores(0, 0);
  const auto before1 = cache.policy().scores(0, 1);
  REQUIRE_THROWS_AS(attend(cache, 0, q), Error);
  REQUIRE_THROWS_WITH(attend(cache, 0, q), Catch::Contains("KV head 1"));
  CHECK(cache.policy().scores(0, 0) == before0);
  CHECK(cache.policy().scores(0, 1) == before1);
  AttendWorkspace ws;
  std::vector<float> out(64);
  REQUIRE_THROWS_AS(attend(cache, 0, q, out, ws), Error);
  CHECK(cache.policy().scores(0, 0) == before0);
  // The same step without the overflowing head 1 query is fine and observed.
  for (int j = 32; j < 64; ++j) q[std::size_t(j)] = 0.0f;
  attend(cache, 0, q);
  CHECK(cache.policy().scores(0, 0) != before0);
}

TEST_CASE("attend and decode_attention validate the scale", "[attention]") {
  const Geometry g{1, 2, 1, 8};
  KVCache<policies::H2O> cache(g, Budget::unbounded(), policies::H2O({2, 0}));
  Rng rng(6);
  for (int t = 0; t < 5; ++t) cache.append(0, t, rng.normals(8), rng.normals(8));
  const auto q = rng.normals(16);
  const auto before = cache.policy().scores(0, 0);
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), INFINITY, -INFINITY, -0.5f}) {
    INFO("scale " << bad);
    REQUIRE_THROWS_WITH(attend(cache, 0, q, AttendOptions{false, bad}), Catch::Contains("scale"));
    REQUIRE_THROWS_AS(attend(cache, 0, q, AttendOptions{true, bad}), Error);
    std::vector<float> out(16), p(10);
    const auto k = cache.keys(0, 0);
    const auto v = cache.values(0, 0);
    REQUIRE_THROWS_WITH(decode_attention(q.data(), 2, k.data(), 8, v.data(), 8, 5, 8, bad,
                                         out.data(), p.data()),
                        Catch::Contains("scale"));
  }
  CHECK(cache.policy().scores(0, 0) == before);
  // 0 means 1/sqrt(d); an explicit equal scale gives the same bits.
  const auto a = attend(cache, 0, q, AttendOptions{false, 0.0f});
  const auto b = attend(cache, 0, q, AttendOptions{false, 1.0f / std::sqrt(8.0f)});
  CHECK(a.out == b.out);
}

TEST_CASE("attend computes n_heads x head_dim in size_t", "[attention]") {
  // 32768 x 65536 = 2^31 does not fit an int.
  const Geometry g{1, 32768, 1, 65536};
  try {
    KVCache<policies::FullCache> cache(g, Budget::uniform(1));
    const std::vector<float> q(16, 0.0f);
    REQUIRE_THROWS_WITH(attend(cache, 0, q), Catch::Contains("2147483648"));
  } catch (const Error& e) {
    // A geometry bound at construction is an equally valid answer; the message names it.
    SUCCEED(std::string("rejected at construction: ") + e.what());
  }
}

TEST_CASE("attend's workspace overload and decode_attention on raw rows agree with attend",
          "[attention]") {
  const Geometry g{2, 8, 2, 64};
  KVCache<policies::H2O, Eigen::half> a(g, Budget::uniform(40), policies::H2O({4, 4}));
  KVCache<policies::H2O, Eigen::half> b(g, Budget::uniform(40), policies::H2O({4, 4}));
  Rng rng(8);
  AttendWorkspace ws;
  std::vector<float> out(8 * 64);
  const float* first_block = nullptr;
  for (int t = 0; t < 60; ++t)
    for (int l = 0; l < 2; ++l) {
      const auto k = rng.normals(128), v = rng.normals(128), q = rng.normals(512);
      a.append(l, t, k, v);
      b.append(l, t, k, v);
      const auto r = attend(a, l, q);
      attend(b, l, q, out, ws);
      for (int kh = 0; kh < 2; ++kh) {
        const auto p = ws.probs(kh);
        REQUIRE(p.size() == std::size_t(r.probs[std::size_t(kh)].size()));
        REQUIRE(std::equal(p.begin(), p.end(), r.probs[std::size_t(kh)].data()));
      }
      REQUIRE(std::equal(out.begin(), out.end(), r.out.data()));
      REQUIRE(a.policy().scores(l, 1) == b.policy().scores(l, 1));
      // The engine-side entry point on the cache's rows gives the same bits.
      std::vector<float> o2(4 * 64), p2;
      AttendWorkspace ws2;
      const auto kk1 = a.keys(l, 1);
      const auto vv1 = a.values(l, 1);
      decode_attention(q.data() + 4 * 64, 4, kk1.data(), 64, vv1.data(), 64,
                       std::size_t(kk1.rows()), 64, 0.0f, o2.data(), ws2);
      REQUIRE(std::equal(o2.begin(), o2.end(), r.out.data() + 4 * 64));
      REQUIRE(std::equal(ws2.probs(0).begin(), ws2.probs(0).end(), r.probs[1].data()));
      // Once the budget is full the workspace stops growing: no allocation per step.
      if (t == 45 && l == 0) first_block = ws.probs(0).data();
      if (t > 45 && l == 0) REQUIRE(ws.probs(0).data() == first_block);
    }
}

TEST_CASE("decode_attention rejects bad arguments with a message naming them", "[attention]") {
  std::vector<float> q(8, 1.0f), k(16, 1.0f), v(16, 1.0f), out(8), p(2);
  REQUIRE_THROWS_WITH(decode_attention(q.data(), 0, k.data(), 8, v.data(), 8, 2, 8, 0.0f,
                                       out.data(), p.data()),
                      Catch::Contains("group = 0"));
  REQUIRE_THROWS_WITH(decode_attention(q.data(), 1, k.data(), 4, v.data(), 8, 2, 8, 0.0f,
                                       out.data(), p.data()),
                      Catch::Contains("key_stride = 4"));
  REQUIRE_THROWS_WITH(decode_attention(q.data(), 1, static_cast<const float*>(nullptr), 8,
                                       v.data(), 8, 2, 8, 0.0f, out.data(), p.data()),
                      Catch::Contains("null"));
  REQUIRE_THROWS_WITH(decode_attention(q.data(), 1, k.data(), 8, v.data(), 8, 2, 8, 0.0f,
                                       out.data(), static_cast<float*>(nullptr)),
                      Catch::Contains("probs is null"));
  q[3] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(decode_attention(q.data(), 1, k.data(), 8, v.data(), 8, 2, 8, 0.0f,
                                       out.data(), p.data()),
                      Catch::Contains("queries[3]"));
  // n = 0: zeros out, no probabilities needed.
  q[3] = 1.0f;
  decode_attention(q.data(), 1, k.data(), 8, v.data(), 8, 0, 8, 0.0f, out.data(),
                   static_cast<float*>(nullptr));
  for (float x : out) CHECK(x == 0.0f);
}

TEST_CASE("attend over Oracle still restricts attention to its limit", "[attention]") {
  const Geometry g{1, 4, 1, 32};
  KVCache<policies::Oracle> cache(g, Budget::unbounded(), policies::Oracle{5});
  Rng rng(9);
  for (int t = 0; t < 30; ++t) cache.append(0, t, rng.normals(32), rng.normals(32));
  const auto q = rng.normals(128, 3.0f);
  const auto r = attend(cache, 0, q);
  const auto ref = detail::attend_reference(cache, 0, q);
  int nonzero = 0;
  for (int i = 0; i < 30; ++i) nonzero += r.probs[0].col(i).sum() > 0.0f;
  CHECK(nonzero == 5);
  for (int gq = 0; gq < 4; ++gq) {
    CHECK(r.probs[0].row(gq).sum() == Approx(1.0f).margin(1e-5));
    for (int i = 0; i < 30; ++i)
      CHECK((r.probs[0](gq, i) > 0.0f) == (ref.probs[0](gq, i) > 0.0f));
  }
  CHECK((r.out - ref.out).cwiseAbs().maxCoeff() < 1e-5f);
}

namespace {
/// A table of `used` blocks of a pool of `blocks` (> used + 2) that mixes runs of consecutive
/// pool blocks with jumps: b -> 7b + 3 mod blocks, every third step consecutive.
std::vector<std::uint32_t> mixed_table(std::size_t used, std::size_t blocks) {
  std::vector<std::uint32_t> table;
  std::uint32_t next = static_cast<std::uint32_t>(blocks - 1);
  for (std::size_t b = 0; b < used; ++b) {
    if (b % 3 == 2 && table.back() + 1 < blocks) next = table.back() + 1;
    table.push_back(next);
    next = static_cast<std::uint32_t>((next * 7 + 3) % blocks);
  }
  return table;
}

/// A pool of `blocks` blocks of `rows` rows (row stride `stride`, padding junk), a table that
/// mixes runs of consecutive pool blocks with jumps, and the same rows gathered densely.
template <class S>
struct PagedCase {
  std::size_t rows, stride, d, n;
  std::vector<S> K, V, Kd, Vd;
  std::vector<std::uint32_t> table;
  PagedCase(std::size_t rows_, std::size_t d_, std::size_t n_, Rng& rng)
      : rows(rows_), stride(d_ + 5), d(d_), n(n_) {
    const std::size_t used = (n + rows - 1) / rows;
    const std::size_t blocks = 2 * used + 3;
    K = convert<S>(rng.normals(blocks * rows * stride));
    V = convert<S>(rng.normals(blocks * rows * stride));
    table = mixed_table(used, blocks);
    Kd.resize(n * d);
    Vd.resize(n * d);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < d; ++j) {
        const std::size_t at = (table[i / rows] * rows + i % rows) * stride + j;
        Kd[i * d + j] = K[at];
        Vd[i * d + j] = V[at];
      }
  }
};
}  // namespace

// The per-level internals (kernels::detail) are not visible to a separate-kernels TU; there
// the public front end below runs at the dispatched level (and CTest's KVEVICT_ISA reruns).
#if !KVEVICT_KERNELS_DECLARE_ONLY
TEST_CASE("paged attention reads block tables in place, bit for bit the dense kernel's result",
          "[kernels][attention][paged]") {
  Rng rng(4242);
  for (const Isa isa : levels())
    at(isa, [&](auto lv) {
      constexpr Isa I = decltype(lv)::value;
      auto run = [&](auto tag) {
        using S = decltype(tag);
        constexpr KvFormat F = detail::kv_format_of<S>();
        for (std::size_t rows : {1u, 3u, 16u})
          for (std::size_t n : {0u, 1u, 5u, 16u, 17u, 100u, 301u})
            for (std::size_t d : {8u, 20u, 128u})
              for (std::size_t G : {1u, 4u, 5u}) {
                PagedCase<S> c(rows, d, n, rng);
                const auto q = rng.normals(G * d, 2.0f);
                const float scale = 0.3f;
                std::vector<float> pd(G * n + 1, -1.0f), pp(G * n + 1, -2.0f);
                std::vector<float> od(G * d, -1.0f), op(G * d, -2.0f);
                REQUIRE(kk::detail::attention_probs_at<I, F>(q.data(), d, G, c.Kd.data(), d, n, d,
                                                             scale, pd.data()));
                kk::detail::attention_output_at<I, F>(pd.data(), G, c.Vd.data(), d, n, d,
                                                      od.data(), d);
                const kk::BlockTable t{c.table.data(), rows, rows * c.stride};
                REQUIRE(kk::detail::attention_probs_at<I, F>(q.data(), d, G, c.K.data(), c.stride,
                                                             t, n, d, scale, pp.data()));
                kk::detail::attention_output_at<I, F>(pp.data(), G, c.V.data(), c.stride, t, n, d,
                                                      op.data(), d);
                INFO("level " << kk::isa_name(I) << " rows " << rows << " n " << n << " d " << d
                              << " G " << G);
                REQUIRE(std::memcmp(pd.data(), pp.data(), G * n * sizeof(float)) == 0);
                REQUIRE(pp[G * n] == -2.0f);  // nothing written past group x n
                REQUIRE(std::memcmp(od.data(), op.data(), G * d * sizeof(float)) == 0);
              }
      };
      run(float{});
      run(Eigen::half{});
      run(Eigen::bfloat16{});
    });
}

#endif  // !KVEVICT_KERNELS_DECLARE_ONLY

namespace {
/// A pool of quantized rows of storage S (quantized.hpp: keys and values in S's formats):
/// blocks of `rows` rows, row strides of a stored row's bytes + 3 junk bytes, rows encoded
/// from normal floats, and a mixed_table over max_n rows (a prefix of it serves any
/// n <= max_n). gather copies the first n rows of the table into one array each.
template <class S>
struct QuantPool {
  using KC = typename detail::StorageOf<S>::key_codec;
  using VC = typename detail::StorageOf<S>::value_codec;
  std::size_t rows, d, kb, vb, ks, vs;
  std::vector<std::uint8_t> K, V;
  std::vector<std::uint32_t> table;
  QuantPool(std::size_t rows_, std::size_t d_, std::size_t max_n, Rng& rng)
      : rows(rows_), d(d_), kb(KC::row_bytes(d_)), vb(VC::row_bytes(d_)), ks(kb + 3), vs(vb + 3) {
    const std::size_t used = (max_n + rows - 1) / rows, blocks = 2 * used + 3;
    K.assign(blocks * rows * ks, 0xA5);
    V.assign(blocks * rows * vs, 0x5A);
    for (std::size_t r = 0; r < blocks * rows; ++r) {
      KC::encode(rng.normals(d).data(), d, K.data() + r * ks);
      VC::encode(rng.normals(d).data(), d, V.data() + r * vs);
    }
    table = mixed_table(used, blocks);
  }
  void gather(std::size_t n, std::vector<std::uint8_t>& Kd, std::vector<std::uint8_t>& Vd) const {
    Kd.resize(n * kb);
    Vd.resize(n * vb);
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t at = table[i / rows] * rows + i % rows;
      std::memcpy(Kd.data() + i * kb, K.data() + at * ks, kb);
      std::memcpy(Vd.data() + i * vb, V.data() + at * vs, vb);
    }
  }
  [[nodiscard]] kk::BlockTable key_table() const { return {table.data(), rows, rows * ks}; }
  [[nodiscard]] kk::BlockTable value_table() const { return {table.data(), rows, rows * vs}; }
};
}  // namespace

#if !KVEVICT_KERNELS_DECLARE_ONLY
// Q8 / Q4 at two group sizes each (8: the AVX2 level's shapes, also at the AVX-512 level;
// 32: the AVX-512 level, Q4 in span order, and the integer q.K), Q4<16> keys beside Q8<16>
// values (AVX-512 Q4 in element order), E4M3; exact and integer q.K.
TEST_CASE("paged quantized attention reads block tables in place, bit for bit the dense kernel's",
          "[kernels][attention][paged][quantized]") {
  Rng rng(5151);
  auto run = [&](auto storage, std::initializer_list<std::size_t> dims) {
    using S = decltype(storage);
    using KD = typename QuantPool<S>::KC::desc;
    using VD = typename QuantPool<S>::VC::desc;
    for (std::size_t d : dims)
      for (std::size_t rows : {1u, 3u, 16u}) {
        const QuantPool<S> pool(rows, d, 150, rng);
        std::vector<std::uint8_t> Kd, Vd;
        // 150 rows cross the AVX-512 p.V's 119-row tile of Q8<32> at d 128.
        for (std::size_t n : {0u, 1u, 5u, 16u, 17u, 150u})
          for (std::size_t G : {1u, 4u}) {
            pool.gather(n, Kd, Vd);
            const auto q = rng.normals(G * d, 2.0f);
            const float scale = 0.3f;
            for (const Isa isa : levels())
              at(isa, [&](auto lv) {
                constexpr Isa I = decltype(lv)::value;
                for (const bool qint : {false, true}) {
                  if (qint && !kk::detail::qint_shape<KD>(d)) continue;
                  std::vector<float> pd(G * n + 1, -1.0f), pp(G * n + 1, -2.0f);
                  std::vector<float> od(G * d, -1.0f), op(G * d, -2.0f);
                  const std::uint8_t* kd = Kd.data();
                  const std::uint8_t* kp = pool.K.data();
                  if (qint) {
                    REQUIRE(kk::quant_attention_probs_qint_at<I, KD>(q.data(), d, G, kd, pool.kb, n,
                                                                     d, scale, pd.data()));
                    REQUIRE(kk::quant_attention_probs_qint_at<I, KD>(q.data(), d, G, kp, pool.ks,
                                                                     pool.key_table(), n, d, scale,
                                                                     pp.data()));
                  } else {
                    REQUIRE(kk::quant_attention_probs_at<I, KD>(q.data(), d, G, kd, pool.kb, n, d,
                                                                scale, pd.data()));
                    REQUIRE(kk::quant_attention_probs_at<I, KD>(q.data(), d, G, kp, pool.ks,
                                                                pool.key_table(), n, d, scale,
                                                                pp.data()));
                  }
                  kk::quant_attention_output_at<I, VD>(pd.data(), G, Vd.data(), pool.vb, n, d,
                                                       od.data(), d);
                  kk::quant_attention_output_at<I, VD>(pp.data(), G, pool.V.data(), pool.vs,
                                                       pool.value_table(), n, d, op.data(), d);
                  INFO("level " << kk::isa_name(I) << " " << QuantPool<S>::KC::name() << " / "
                                << QuantPool<S>::VC::name() << (qint ? " integer q.K" : "")
                                << " rows " << rows << " n " << n << " d " << d << " G " << G);
                  REQUIRE(std::memcmp(pd.data(), pp.data(), G * n * sizeof(float)) == 0);
                  REQUIRE(pp[G * n] == -2.0f);  // nothing written past group x n
                  REQUIRE(std::memcmp(od.data(), op.data(), G * d * sizeof(float)) == 0);
                }
              });
          }
      }
  };
  run(Q8<8>{}, {8, 128});
  run(Q8<32>{}, {128});
  run(Q4<8>{}, {8, 128});
  run(Q4<32>{}, {128});
  run(KV<Q4<16>, Q8<16>>{}, {128});
  run(E4M3{}, {8, 128});
}
#endif  // !KVEVICT_KERNELS_DECLARE_ONLY

TEST_CASE("decode_attention_paged: shared cells in place, and bad arguments refused",
          "[attention][paged]") {
  // llama.cpp's layout: a block holds `rows` tokens of all Hkv heads side by side.
  constexpr std::size_t Hkv = 3, d = 16, rows = 4, G = 2, blocks = 9;
  Rng rng(77);
  const auto K = convert<Eigen::half>(rng.normals(blocks * rows * Hkv * d));
  const auto V = convert<Eigen::half>(rng.normals(blocks * rows * Hkv * d));
  const std::vector<std::uint32_t> table{6, 7, 2, 0, 8, 4};
  const std::size_t n = 22, w = Hkv * d;
  const auto q = rng.normals(G * d);
  for (std::size_t h = 0; h < Hkv; ++h) {
    std::vector<Eigen::half> Kd(n * d), Vd(n * d);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < d; ++j) {
        Kd[i * d + j] = K[(table[i / rows] * rows + i % rows) * w + h * d + j];
        Vd[i * d + j] = V[(table[i / rows] * rows + i % rows) * w + h * d + j];
      }
    std::vector<float> od(G * d), pd(G * n), op(G * d), pp(G * n);
    decode_attention(q.data(), G, Kd.data(), d, Vd.data(), d, n, d, 0.0f, od.data(), pd.data());
    const PagedRows<Eigen::half> kr{K.data() + h * d, rows * w, w}, vr{V.data() + h * d, rows * w, w};
    decode_attention_paged(q.data(), G, kr, vr, table, rows, n, d, 0.0f, op.data(), pp.data());
    REQUIRE(std::memcmp(od.data(), op.data(), sizeof(float) * od.size()) == 0);
    REQUIRE(std::memcmp(pd.data(), pp.data(), sizeof(float) * pd.size()) == 0);
  }

  std::vector<float> out(G * d, 5.0f), p(G * n, 5.0f);
  const PagedRows<Eigen::half> kr{K.data(), rows * w, w}, vr{V.data(), rows * w, w};
  auto untouched = [&] {
    for (float x : out) REQUIRE(x == 5.0f);
    for (float x : p) REQUIRE(x == 5.0f);
  };
  REQUIRE_THROWS_WITH(decode_attention_paged(q.data(), G, kr, vr, table, 0, n, d, 0.0f,
                                             out.data(), p.data()),
                      Catch::Contains("block_rows = 0"));
  REQUIRE_THROWS_WITH(decode_attention_paged(q.data(), G, kr, vr, std::span(table).first(5), rows,
                                             n, d, 0.0f, out.data(), p.data()),
                      Catch::Contains("5 blocks for n = 22") && Catch::Contains("at least 6"));
  const PagedRows<Eigen::half> narrow{K.data(), rows * w, d - 1};
  REQUIRE_THROWS_WITH(decode_attention_paged(q.data(), G, narrow, vr, table, rows, n, d, 0.0f,
                                             out.data(), p.data()),
                      Catch::Contains("key_stride = 15"));
  const PagedRows<Eigen::half> huge{K.data(), std::numeric_limits<std::size_t>::max() / 4, w};
  REQUIRE_THROWS_WITH(decode_attention_paged(q.data(), G, huge, vr, table, rows, n, d, 0.0f,
                                             out.data(), p.data()),
                      Catch::Contains("overflows size_t"));
  auto bad_q = q;
  bad_q[1] = std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_WITH(decode_attention_paged(bad_q.data(), G, kr, vr, table, rows, n, d, 0.0f,
                                             out.data(), p.data()),
                      Catch::Contains("decode_attention_paged: queries[1]"));
  REQUIRE_THROWS_WITH(decode_attention_paged(q.data(), G, kr, vr, table, rows, n, d, 0.0f,
                                             out.data(), static_cast<float*>(nullptr)),
                      Catch::Contains("probs is null"));
  untouched();
}

TEST_CASE("decode_attention_paged over quantized rows: the dense kernels' result; bad arguments "
          "refused", "[attention][paged][quantized]") {
  Rng rng(99);
  constexpr std::size_t G = 4;
  auto run = [&](auto storage, std::size_t d, QuantQK qk) {
    using S = decltype(storage);
    using KD = typename QuantPool<S>::KC::desc;
    using VD = typename QuantPool<S>::VC::desc;
    for (std::size_t rows : {3u, 16u}) {
      const QuantPool<S> pool(rows, d, 70, rng);
      for (std::size_t n : {0u, 37u, 70u}) {
        std::vector<std::uint8_t> Kd, Vd;
        pool.gather(n, Kd, Vd);
        const auto q = rng.normals(G * d, 2.0f);
        std::vector<float> pd(G * n), pp(G * n), od(G * d), op(G * d);
        if (n > 0) {
          if (qk == QuantQK::integer_query)
            REQUIRE(kk::quant_attention_probs_qint<KD>(q.data(), d, G, Kd.data(), pool.kb, n, d,
                                                       0.25f, pd.data()));
          else
            REQUIRE(kk::quant_attention_probs<KD>(q.data(), d, G, Kd.data(), pool.kb, n, d, 0.25f,
                                                  pd.data()));
        }
        kk::quant_attention_output<VD>(pd.data(), G, Vd.data(), pool.vb, n, d, od.data(), d);
        decode_attention_paged<S>(q.data(), G, PagedRows<std::uint8_t>{pool.K.data(), rows * pool.ks, pool.ks},
                                  PagedRows<std::uint8_t>{pool.V.data(), rows * pool.vs, pool.vs},
                                  pool.table, rows, n, d, 0.25f, op.data(), pp.data(), qk);
        INFO(QuantPool<S>::KC::name() << " rows " << rows << " n " << n << " d " << d);
        REQUIRE((n == 0 || std::memcmp(pd.data(), pp.data(), sizeof(float) * pd.size()) == 0));
        REQUIRE(std::memcmp(od.data(), op.data(), sizeof(float) * od.size()) == 0);
      }
    }
  };
  run(Q8<32>{}, 128, QuantQK::exact);
  run(Q8<32>{}, 128, QuantQK::integer_query);
  run(Q4<32>{}, 128, QuantQK::integer_query);
  run(KV<Q8<8>, Q4<8>>{}, 8, QuantQK::exact);
  run(E4M3{}, 8, QuantQK::exact);

  // Bad arguments: a kvevict::Error naming the value, nothing written.
  constexpr std::size_t d = 128, rows = 4, n = 22;
  const QuantPool<Q8<32>> pool(rows, d, n, rng);
  const auto q = rng.normals(G * d);
  std::vector<float> out(G * d, 5.0f), p(G * n, 5.0f);
  const std::span<const std::uint32_t> table = pool.table;
  const PagedRows<std::uint8_t> kr{pool.K.data(), rows * pool.ks, pool.ks},
      vr{pool.V.data(), rows * pool.vs, pool.vs};
  auto call = [&](auto storage, const float* qq, PagedRows<std::uint8_t> k,
                  std::span<const std::uint32_t> t, std::size_t block_rows, std::size_t dim,
                  float* probs, QuantQK qk = QuantQK::exact) {
    decode_attention_paged<decltype(storage)>(qq, G, k, vr, t, block_rows, n, dim, 0.0f,
                                              out.data(), probs, qk);
  };
  REQUIRE_THROWS_WITH(call(Q8<32>{}, q.data(), kr, table, 0, d, p.data()),
                      Catch::Contains("block_rows = 0"));
  REQUIRE_THROWS_WITH(call(Q8<32>{}, q.data(), kr, table.first(5), rows, d, p.data()),
                      Catch::Contains("5 blocks for n = 22") && Catch::Contains("at least 6"));
  const PagedRows<std::uint8_t> narrow{pool.K.data(), rows * pool.ks, pool.kb - 1};
  REQUIRE_THROWS_WITH(call(Q8<32>{}, q.data(), narrow, table, rows, d, p.data()),
                      Catch::Contains("key_stride = 135") && Catch::Contains(">= 136"));
  REQUIRE_THROWS_WITH(call(Q8<32>{}, q.data(), kr, table, rows, 48, p.data()),
                      Catch::Contains("group size 32 does not divide head_dim 48"));
  REQUIRE_THROWS_WITH(call(Q8<8>{}, q.data(), kr, table, rows, d, p.data(),
                           QuantQK::integer_query),
                      Catch::Contains("integer_query needs") && Catch::Contains("Q8<8>"));
  REQUIRE_THROWS_WITH(call(Q8<32>{}, q.data(), kr, table, rows, d, p.data(),
                           static_cast<QuantQK>(7)),
                      Catch::Contains("quant_qk = 7"));
  const PagedRows<std::uint8_t> huge{pool.K.data(), std::numeric_limits<std::size_t>::max() / 4,
                                     pool.ks};
  REQUIRE_THROWS_WITH(call(Q8<32>{}, q.data(), huge, table, rows, d, p.data()),
                      Catch::Contains("overflows size_t"));
  auto bad_q = q;
  bad_q[1] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(call(Q8<32>{}, bad_q.data(), kr, table, rows, d, p.data()),
                      Catch::Contains("decode_attention_paged: queries[1]"));
  REQUIRE_THROWS_WITH(call(Q8<32>{}, q.data(), kr, table, rows, d, static_cast<float*>(nullptr)),
                      Catch::Contains("probs is null"));
  for (float x : out) REQUIRE(x == 5.0f);
  for (float x : p) REQUIRE(x == 5.0f);
}
