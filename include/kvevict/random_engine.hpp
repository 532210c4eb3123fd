#pragma once
// detail::Mt19937_64: the 64-bit Mersenne Twister exactly as the standard defines
// std::mt19937_64 ([rand.predef]: w 64, n 312, m 156, r 31, the same seeding), so the same
// seed draws the same numbers (tested against std::mt19937_64, tests/test_baselines.cpp).
// kvevict's Random policy and SimHash's Gaussian draw use it instead of std::mt19937_64 to
// keep <random> out of every translation unit that includes kvevict (issue 19's include
// cost, ~0.25 s per TU at -O2). save / load write and read the text libstdc++'s operator<<
// and operator>> use for std::mt19937_64 (the 312 state words, then the position, separated
// by spaces), so saved Random state reads back either way.
#include <cstddef>
#include <cstdint>

namespace kvevict::detail {

class Mt19937_64 {
 public:
  using result_type = std::uint64_t;
  static constexpr std::size_t state_size = 312;
  static constexpr std::uint64_t default_seed = 5489u;

  Mt19937_64() noexcept { seed(default_seed); }
  explicit Mt19937_64(std::uint64_t s) noexcept { seed(s); }

  void seed(std::uint64_t s) noexcept {
    x_[0] = s;
    for (std::size_t i = 1; i < state_size; ++i)
      x_[i] = 6364136223846793005ull * (x_[i - 1] ^ (x_[i - 1] >> 62)) + i;
    p_ = state_size;
  }

  static constexpr std::uint64_t min() noexcept { return 0; }
  static constexpr std::uint64_t max() noexcept { return ~std::uint64_t{0}; }

  std::uint64_t operator()() noexcept {
    if (p_ >= state_size) twist();
    std::uint64_t z = x_[p_++];
    z ^= (z >> 29) & 0x5555555555555555ull;
    z ^= (z << 17) & 0x71D67FFFEDA60000ull;
    z ^= (z << 37) & 0xFFF7EEE000000000ull;
    return z ^ (z >> 43);
  }

  /// The state as text: the 312 words then the position, space-separated (OS: an ostream).
  template <class OS>
  void save(OS& os) const {
    for (std::size_t i = 0; i < state_size; ++i) os << x_[i] << ' ';
    os << p_;
  }
  /// Reads what save wrote (IS: an istream; on failure the stream's failbit is set).
  template <class IS>
  void load(IS& is) {
    for (std::size_t i = 0; i < state_size; ++i) is >> x_[i];
    is >> p_;
  }

 private:
  void twist() noexcept {
    constexpr std::uint64_t upper = ~std::uint64_t{0} << 31, lower = ~upper;
    constexpr std::uint64_t a = 0xB5026F5AA96619E9ull;
    constexpr std::size_t n = state_size, m = 156;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t y = (x_[i] & upper) | (x_[(i + 1) % n] & lower);
      x_[i] = x_[(i + m) % n] ^ (y >> 1) ^ ((y & 1) ? a : 0);
    }
    p_ = 0;
  }

  std::uint64_t x_[state_size];
  std::size_t p_ = state_size;
};

}  // namespace kvevict::detail
