#pragma once
// Consumes a fuzzer's bytes as small integers and floats; past the end it yields zeros,
// so every input is a complete, deterministic program.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvfuzz {

class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : p_(data), n_(size) {}
  std::uint8_t byte() { return at_ < n_ ? p_[at_++] : 0; }
  bool done() const { return at_ >= n_; }
  /// Uniform-ish integer in [lo, hi].
  int range(int lo, int hi) { return lo + static_cast<int>(byte() % static_cast<unsigned>(hi - lo + 1)); }
  /// A finite float in [-8, 8) (one byte: fast to mutate), occasionally one at the edge
  /// of what every storage type holds: +-65504 (the largest half), a denormal, -0.
  float value() {
    const std::uint8_t b = byte();
    switch (b) {
      case 255: return 6.0e4f;
      case 254: return 65504.0f;
      case 253: return -65504.0f;
      case 252: return 1e-40f;
      case 251: return -0.0f;
      default: return (static_cast<float>(b) - 128.0f) / 16.0f;
    }
  }
  std::vector<float> values(std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = value();
    return v;
  }
  /// The same values written into `v` (resized to n), reusing its memory: a harness
  /// stepping many times allocates nothing per step (allocations dominate under ASan).
  std::vector<float>& fill(std::vector<float>& v, std::size_t n) {
    v.resize(n);
    for (auto& x : v) x = value();
    return v;
  }

 private:
  const std::uint8_t* p_;
  std::size_t n_;
  std::size_t at_ = 0;
};

}  // namespace kvfuzz
