// The token rows and attention probabilities of bench_policy_step (and of
// policy_step_count.cpp, its callgrind driver): one pool, so both step the same data.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <kvevict/geometry.hpp>
#include <random>
#include <span>
#include <vector>

namespace policy_step {

using kvevict::Geometry;

constexpr int kDim = 128;
constexpr int kGroup = 4;

inline Geometry geometry(int hkv) { return Geometry{1, kGroup * hkv, hkv, kDim}; }

// Random token rows (keys, values, queries), reused cyclically.
struct Pool {
  static constexpr std::size_t kTokens = 509;
  std::vector<float> k, v, q;
  Pool() {
    std::mt19937 rng(7);
    std::normal_distribution<float> d;
    k.resize(kTokens * 8 * kDim);
    v.resize(k.size());
    q.resize(kTokens * 8 * kGroup * kDim);
    for (auto* vec : {&k, &v, &q})
      for (auto& x : *vec) x = d(rng);
  }
  std::span<const float> key(std::size_t t, int hkv) const {
    const std::size_t w = static_cast<std::size_t>(hkv) * kDim;
    return {k.data() + (t % kTokens) * 8 * kDim, w};
  }
  std::span<const float> value(std::size_t t, int hkv) const {
    const std::size_t w = static_cast<std::size_t>(hkv) * kDim;
    return {v.data() + (t % kTokens) * 8 * kDim, w};
  }
  std::span<const float> query(std::size_t t, int hkv) const {
    const std::size_t w = static_cast<std::size_t>(hkv) * kGroup * kDim;
    return {q.data() + ((t * 7 + 3) % kTokens) * 8 * kGroup * kDim, w};
  }
};

// A step's attention probabilities (one window of `width` floats, G = 4 rows of n, read by
// every KV head): fresh draws every step, 1e-4 x Exp(1) as the fixed pool had. Until stop
// 37 the window was a slice of a fixed 2 MB pool at offset 37 t, so rows 37 apart saw the
// same four values one step apart; spikes (running maxima of those group sums) then tied
// exactly: at 1K rows 27-28 rows equalled DecayedAttention's 128th-largest spike, where
// continuous data gives ties only by chance (bench/results/policy_step_ties36.txt).
//
// Draws are made in batches outside the timed region (refill(), between PauseTiming and
// ResumeTiming): a batch holds as many windows as fit in kBatchFloats (64 KB; at least
// one), so the probabilities a step reads were written at most a few steps earlier, warm
// in cache as an attention kernel's output would be. Generator: 1024 xorshift32 lanes; u
// from 31 bits; -ln u from the float's exponent and a cubic in its mantissa (least squares,
// within 0.0011 of log2; deterministic, so runs repeat exactly).
class ProbStream {
 public:
  static constexpr std::size_t kBatchFloats = 16384;
  static constexpr std::size_t kLanes = 1024;

  ProbStream() : lanes_(kLanes) {
    std::uint32_t s = 0x9E3779B9u;
    for (auto& x : lanes_) {
      s = s * 1664525u + 1013904223u;
      x = s | 1u;  // xorshift states must be non-zero
    }
  }
  /// True when the next step needs refill(width) first.
  [[nodiscard]] bool due(std::size_t width) const { return width != width_ || next_ == steps_; }
  /// Draws a batch of windows of `width` floats.
  [[gnu::noinline]] void refill(std::size_t width) {
    width_ = width;
    steps_ = std::max<std::size_t>(1, kBatchFloats / std::max<std::size_t>(width, 1));
    next_ = 0;
    buf_.resize(steps_ * width);
    float* out = buf_.data();
    const std::size_t total = buf_.size();
    for (std::size_t base = 0; base < total; base += kLanes) {
      const std::size_t m = std::min(kLanes, total - base);
      for (std::size_t j = 0; j < m; ++j) {  // independent lanes: vectorises
        std::uint32_t x = lanes_[j];
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        lanes_[j] = x;
        out[base + j] = 1e-4f * neg_ln_unit(x);
      }
    }
  }
  /// This step's window, `floats` long (<= width); then advance().
  [[nodiscard]] std::span<const float> window(std::size_t floats) const {
    return {buf_.data() + next_ * width_, floats};
  }
  void advance() { ++next_; }

 private:
  // -ln u for u = (x / 2 + 0.5) / 2^31 in (0, 1).
  static float neg_ln_unit(std::uint32_t x) {
    const float u = (static_cast<float>(static_cast<std::int32_t>(x >> 1)) + 0.5f) *
                    4.656612873077393e-10f;
    std::uint32_t b;
    std::memcpy(&b, &u, 4);
    const float e = static_cast<float>(static_cast<std::int32_t>(b >> 23) - 127);
    const std::uint32_t mb = (b & 0x007FFFFFu) | 0x3F800000u;
    float m;
    std::memcpy(&m, &mb, 4);
    const float f = m - 1.0f;  // log2(1 + f), f in [0, 1): cubic through 0 and 1
    const float l2 = e + f * (1.4208645f + f * (-0.5772507f + f * 0.1563862f));
    return -0.6931472f * l2;
  }
  std::vector<std::uint32_t> lanes_;
  std::vector<float> buf_;
  std::size_t width_ = 0, steps_ = 0, next_ = 0;
};

inline const Pool& pool() {
  static const Pool p;
  return p;
}

}  // namespace policy_step
