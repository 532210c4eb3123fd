#pragma once
// Mixed<Hot, Cold>: a KVCache storage type with two row arrays per (layer, KV head), as
// engines with cold pages store K/V: a recent band of at most R rows in the Hot format and
// every older kept row in the Cold format (docs/quantized.md, "Mixed layouts").
//   Hot, Cold: Eigen::half (fp16 bytes) or a quantized format of quantized.hpp (Q8<G>,
//   Q4<G>, E4M3, KV<KF, VF>). R is set at run time (KVCache::set_hot_rows, default 0: every
//   row is stored Cold).
// A row is encoded in Hot when it arrives. When a row arrives and R rows are held in Hot,
// the Hot row with the lowest arrival index is re-encoded into Cold (decoded from its Hot
// bytes, encoded in Cold): its bytes change once, by design. The bit-exact guarantee then
// holds per stored format: a Hot row is the Hot encoding of the appended vector, a Cold row
// is the Cold encoding of what its Hot bytes decode to (with R = 0 or a float-exact Hot
// format, the Cold encoding of the appended vector). A Cold row is never promoted back.
// Memory per head: R Hot rows + (capacity - R) Cold rows (the Cold band never holds more).
// Both bands are kept compact (a removed slot takes its band's last slot), so attention
// runs the dispatched kernel of each format over each band as one matrix; the softmax
// spans both bands (each band's probabilities rescaled by its share of the normaliser).
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "container_core.hpp"
#include "errors.hpp"
#include "kernels/attention_decode.hpp"
#include "kernels/quant_format.hpp"
#include "quantized.hpp"
#if !KVEVICT_KERNELS_DECLARE_ONLY
#include "kernels/attention_quant.hpp"  // separate-kernels mode: compiled (quant_format.hpp)
#endif

namespace kvevict {

/// Recent band (at most KVCache::hot_rows() rows per head) in Hot, older rows in Cold.
template <class Hot, class Cold>
struct Mixed {
  using hot_format = Hot;
  using cold_format = Cold;
};

namespace detail {

/// fp16 as a band format: 2 bytes per element, the IEEE half bits.
struct HalfRowCodec {
  static constexpr std::size_t group = 1;
  static std::string name() { return "fp16"; }
  static std::size_t row_bytes(std::size_t d) noexcept { return 2 * d; }
  /// 65520 and above round to infinity in fp16.
  static float limit() noexcept { return 65520.0f; }
  static void encode(const float* x, std::size_t d, std::uint8_t* out) noexcept {
    for (std::size_t j = 0; j < d; ++j) {
      const std::uint16_t b = fp16_bits(x[j]);
      std::memcpy(out + 2 * j, &b, 2);
    }
  }
  static void decode(const std::uint8_t* in, std::size_t d, float* out) noexcept {
    for (std::size_t j = 0; j < d; ++j) out[j] = fp16_value(in + 2 * j);
  }
};

/// The key and value codecs of one band's format.
template <class F>
struct BandCodecs {
  static_assert(StorageOf<F>::quantized,
                "Mixed<Hot, Cold>: each band is Eigen::half or a quantized format (Q8<G>, Q4<G>, "
                "E4M3, KV<KF, VF>)");
  using key = typename StorageOf<F>::key_codec;
  using value = typename StorageOf<F>::value_codec;
};
template <>
struct BandCodecs<Eigen::half> {
  using key = HalfRowCodec;
  using value = HalfRowCodec;
};

/// Probabilities of one band (n rows of codec C, back to back) for G query heads.
template <class C>
bool band_probs(const float* q, std::size_t G, const std::uint8_t* rows, std::size_t n,
                std::size_t d, float scale, float* p) {
  if constexpr (std::is_same_v<C, HalfRowCodec>)
    return kernels::attention_probs_as<kernels::KvFormat::f16>(q, d, G, rows, d, n, d, scale, p);
  else {
    kernels::require_quant_kernels<typename C::desc>();
    return kernels::quant_attention_probs<typename C::desc>(q, d, G, rows, C::row_bytes(d), n, d,
                                                            scale, p);
  }
}
/// out (G x d) = p (G x n) . the band's n value rows.
template <class C>
void band_output(const float* p, std::size_t G, const std::uint8_t* rows, std::size_t n,
                 std::size_t d, float* out) {
  if constexpr (std::is_same_v<C, HalfRowCodec>)
    kernels::attention_output_as<kernels::KvFormat::f16>(p, G, rows, d, n, d, out, d);
  else {
    kernels::require_quant_kernels<typename C::desc>();
    kernels::quant_attention_output<typename C::desc>(p, G, rows, C::row_bytes(d), n, d, out, d);
  }
}

/// One stored row of a mixed head: its band and its bytes.
struct MixedRowRef {
  bool hot = false;
  const std::uint8_t* key = nullptr;
  const std::uint8_t* value = nullptr;
};

/// One (layer, KV head) of a mixed KVCache: the core's positions and arrival indices (in
/// the core's row order) beside two compact bands of rows.
template <class Hot, class Cold>
struct MixedHead : HeadRows {
  using HK = typename BandCodecs<Hot>::key;
  using HV = typename BandCodecs<Hot>::value;
  using CK = typename BandCodecs<Cold>::key;
  using CV = typename BandCodecs<Cold>::value;
  static constexpr std::uint32_t kHot = 0x80000000u;
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  std::vector<std::uint8_t> hk, hv, ck, cv;        ///< band rows, in slot order
  std::vector<std::uint32_t> where;                 ///< per core row: slot | kHot
  std::vector<std::uint32_t> hot_owner, cold_owner;  ///< per slot: core row
  std::vector<std::uint64_t> hot_seq;                ///< per hot slot: arrival index

  static void check_dim(std::size_t d) {
    check_codec_dim<HK>(d, "hot key");
    check_codec_dim<HV>(d, "hot value");
    check_codec_dim<CK>(d, "cold key");
    check_codec_dim<CV>(d, "cold value");
  }
  /// Values a row must satisfy to be stored in either band (it arrives Hot and may go Cold).
  static void check_stored(std::span<const float> x, const char* what, bool is_key) {
    if (is_key) {
      check_encodable<HK>(x.data(), x.size(), what);
      check_encodable<CK>(x.data(), x.size(), what);
    } else {
      check_encodable<HV>(x.data(), x.size(), what);
      check_encodable<CV>(x.data(), x.size(), what);
    }
  }
  [[nodiscard]] std::size_t hot_rows() const { return hot_owner.size(); }
  [[nodiscard]] std::size_t cold_rows() const { return cold_owner.size(); }

  /// Room for n rows with a hot band of R rows (the cold band never exceeds n - R).
  void reserve(std::size_t n, std::size_t R, std::size_t d) {
    const std::size_t h = std::min(n, R), c = n > R ? n - R : 0;
    hk.reserve(h * HK::row_bytes(d));
    hv.reserve(h * HV::row_bytes(d));
    hot_owner.reserve(h);
    hot_seq.reserve(h);
    ck.reserve(c * CK::row_bytes(d));
    cv.reserve(c * CV::row_bytes(d));
    cold_owner.reserve(c);
    where.reserve(n);
  }
  /// Calls shrink(vector, elements) for every array, sized for `cap` rows.
  template <class Shrink>
  void shrink(std::size_t cap, std::size_t R, std::size_t d, Shrink&& shrink) {
    const std::size_t h = std::min(cap, R), c = cap > R ? cap - R : 0;
    shrink(hk, h * HK::row_bytes(d));
    shrink(hv, h * HV::row_bytes(d));
    shrink(hot_owner, h);
    shrink(hot_seq, h);
    shrink(ck, c * CK::row_bytes(d));
    shrink(cv, c * CV::row_bytes(d));
    shrink(cold_owner, c);
    shrink(where, cap);
  }
  [[nodiscard]] std::size_t allocated_bytes() const {
    return hk.capacity() + hv.capacity() + ck.capacity() + cv.capacity();
  }

  [[nodiscard]] MixedRowRef row(std::size_t r, std::size_t d) const {
    const std::uint32_t w = where[r];
    const std::size_t s = w & ~kHot;
    if (w & kHot) return {true, hk.data() + s * HK::row_bytes(d), hv.data() + s * HV::row_bytes(d)};
    return {false, ck.data() + s * CK::row_bytes(d), cv.data() + s * CV::row_bytes(d)};
  }
  void decode_row(bool is_key, std::size_t r, std::size_t d, float* out) const {
    const MixedRowRef x = row(r, d);
    if (is_key) x.hot ? HK::decode(x.key, d, out) : CK::decode(x.key, d, out);
    else x.hot ? HV::decode(x.value, d, out) : CV::decode(x.value, d, out);
  }
  void decode_rows(bool is_key, std::size_t first, std::size_t rows, std::size_t d, float* out) const {
    for (std::size_t r = 0; r < rows; ++r) decode_row(is_key, first + r, d, out + r * d);
  }

  /// Core row r leaves; the core's last row moves into it (the core moves pos / seq).
  void remove(std::size_t r, std::size_t last, std::size_t d) noexcept {
    const std::uint32_t w = where[r];
    const std::size_t s = w & ~kHot;
    if (w & kHot) {
      drop_slot(hk, hv, hot_owner, HK::row_bytes(d), HV::row_bytes(d), s, kHot);
      const std::size_t t = hot_owner.size();  // the slot that moved into s (if any) was t
      if (s != t) hot_seq[s] = hot_seq[t];
      hot_seq.resize(t);
    } else {
      drop_slot(ck, cv, cold_owner, CK::row_bytes(d), CV::row_bytes(d), s, 0);
    }
    if (r != last) {
      where[r] = where[last];
      const std::size_t m = where[r] & ~kHot;
      ((where[r] & kHot) ? hot_owner : cold_owner)[m] = static_cast<std::uint32_t>(r);
    }
    where.resize(last);
  }

  /// Writes a new row (core row where.size(), arrival index seq), re-encoding the oldest hot
  /// row into the cold band first when R rows are hot. Storage was reserved (no allocation).
  /// Returns the core row that went cold, or npos. tmp: 2 x d floats.
  std::size_t push(const float* key, const float* value, std::uint64_t seq, std::size_t R,
                   std::size_t d, float* tmp) noexcept {
    const auto r = static_cast<std::uint32_t>(where.size());
    if (R == 0) {
      where.push_back(append_cold(key, value, r, d));
      return npos;
    }
    std::size_t demoted = npos, s = hot_owner.size();
    if (s == R) {
      s = static_cast<std::size_t>(std::min_element(hot_seq.begin(), hot_seq.end()) - hot_seq.begin());
      demoted = hot_owner[s];
      HK::decode(hk.data() + s * HK::row_bytes(d), d, tmp);
      HV::decode(hv.data() + s * HV::row_bytes(d), d, tmp + d);
      where[demoted] = append_cold(tmp, tmp + d, static_cast<std::uint32_t>(demoted), d);
      hot_owner[s] = r;
      hot_seq[s] = seq;
    } else {
      hk.resize(hk.size() + HK::row_bytes(d));
      hv.resize(hv.size() + HV::row_bytes(d));
      hot_owner.push_back(r);
      hot_seq.push_back(seq);
    }
    HK::encode(key, d, hk.data() + s * HK::row_bytes(d));
    HV::encode(value, d, hv.data() + s * HV::row_bytes(d));
    where.push_back(static_cast<std::uint32_t>(s) | kHot);
    return demoted;
  }

  /// Softmax over both bands into p (G x size, core row order). scratch grows as needed.
  bool probs(const float* q, std::size_t G, std::size_t d, float scale, float* p,
             std::vector<float>& scratch) const {
    const std::size_t nh = hot_rows(), nc = cold_rows(), n = size();
    scratch.resize(G * n + d);
    float* ph = scratch.data();
    float* pc = ph + G * nh;
    float* krow = pc + G * nc;
    if (nh > 0 && !band_probs<HK>(q, G, hk.data(), nh, d, scale, ph)) return false;
    if (nc > 0 && !band_probs<CK>(q, G, ck.data(), nc, d, scale, pc)) return false;
    for (std::size_t g = 0; g < G; ++g) {
      const float* qg = q + g * d;
      const double lh = nh > 0 ? log_normaliser<HK>(qg, ph + g * nh, nh, hk.data(), d, scale, krow)
                               : -std::numeric_limits<double>::infinity();
      const double lc = nc > 0 ? log_normaliser<CK>(qg, pc + g * nc, nc, ck.data(), d, scale, krow)
                               : -std::numeric_limits<double>::infinity();
      const double m = std::max(lh, lc);
      const double eh = nh > 0 ? std::exp(lh - m) : 0.0, ec = nc > 0 ? std::exp(lc - m) : 0.0;
      const auto wh = static_cast<float>(eh / (eh + ec)), wc = static_cast<float>(ec / (eh + ec));
      float* pg = p + g * n;
      for (std::size_t s = 0; s < nh; ++s) pg[hot_owner[s]] = nc > 0 ? wh * ph[g * nh + s] : ph[g * nh + s];
      for (std::size_t s = 0; s < nc; ++s) pg[cold_owner[s]] = nh > 0 ? wc * pc[g * nc + s] : pc[g * nc + s];
    }
    return true;
  }
  /// o (G x d) = p (G x size, core row order) . the stored values of both bands.
  void output(const float* p, std::size_t G, std::size_t d, float* o, std::vector<float>& scratch) const {
    const std::size_t nh = hot_rows(), nc = cold_rows(), n = size();
    if (n == 0) {
      std::fill(o, o + G * d, 0.0f);
      return;
    }
    scratch.resize(G * n + G * d);
    float* ph = scratch.data();
    float* pc = ph + G * nh;
    float* oc = pc + G * nc;
    for (std::size_t g = 0; g < G; ++g) {
      for (std::size_t s = 0; s < nh; ++s) ph[g * nh + s] = p[g * n + hot_owner[s]];
      for (std::size_t s = 0; s < nc; ++s) pc[g * nc + s] = p[g * n + cold_owner[s]];
    }
    if (nh == 0) return band_output<CV>(pc, G, cv.data(), nc, d, o);
    band_output<HV>(ph, G, hv.data(), nh, d, o);
    if (nc == 0) return;
    band_output<CV>(pc, G, cv.data(), nc, d, oc);
    for (std::size_t i = 0; i < G * d; ++i) o[i] += oc[i];
  }

 private:
  // log sum_i exp(scale q.k_i) of a band from its normalised probabilities: at the row of
  // largest probability i, log Z = scale q.k_i - log p_i (p_i >= 1/n, so no underflow).
  template <class C>
  static double log_normaliser(const float* qg, const float* pg, std::size_t n,
                               const std::uint8_t* rows, std::size_t d, float scale, float* krow) {
    const std::size_t i = static_cast<std::size_t>(std::max_element(pg, pg + n) - pg);
    C::decode(rows + i * C::row_bytes(d), d, krow);
    double dot = 0.0;
    for (std::size_t j = 0; j < d; ++j) dot += static_cast<double>(qg[j]) * krow[j];
    return static_cast<double>(scale) * dot - std::log(static_cast<double>(pg[i]));
  }
  // Removes slot s of a band: its last slot moves into s (bytes and owner).
  void drop_slot(std::vector<std::uint8_t>& k, std::vector<std::uint8_t>& v,
                 std::vector<std::uint32_t>& owner, std::size_t kb, std::size_t vb, std::size_t s,
                 std::uint32_t tag) noexcept {
    const std::size_t t = owner.size() - 1;
    if (s != t) {
      std::memcpy(k.data() + s * kb, k.data() + t * kb, kb);
      std::memcpy(v.data() + s * vb, v.data() + t * vb, vb);
      owner[s] = owner[t];
      where[owner[s]] = static_cast<std::uint32_t>(s) | tag;
    }
    owner.resize(t);
    k.resize(t * kb);
    v.resize(t * vb);
  }
  std::uint32_t append_cold(const float* key, const float* value, std::uint32_t r, std::size_t d) noexcept {
    const std::size_t c = cold_owner.size();
    ck.resize(ck.size() + CK::row_bytes(d));
    cv.resize(cv.size() + CV::row_bytes(d));
    CK::encode(key, d, ck.data() + c * CK::row_bytes(d));
    CV::encode(value, d, cv.data() + c * CV::row_bytes(d));
    cold_owner.push_back(r);
    return static_cast<std::uint32_t>(c);
  }
};

template <class S>
struct IsMixed : std::false_type {};
template <class H, class C>
struct IsMixed<Mixed<H, C>> : std::true_type {};

/// Mixed caches store bytes and hand policies dequantised float rows, as quantized ones.
template <class H, class C>
struct StorageOf<Mixed<H, C>> {
  static constexpr bool quantized = true;
  using unit = std::uint8_t;
  using view = float;
};

template <class S>
concept MixedStorage = QuantizedStorage<S> && IsMixed<S>::value;

}  // namespace detail
}  // namespace kvevict
