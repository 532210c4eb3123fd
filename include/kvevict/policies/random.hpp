#pragma once
// Random eviction: the floor every policy must beat. Seeded, one independent stream per
// (layer, KV head), so results do not depend on the order heads are visited.
#include <sstream>

#include "../random_engine.hpp"
#include "common.hpp"

namespace kvevict::policies {

class Random {
 public:
  struct Config {
    std::uint64_t seed = 0;
    std::size_t sinks = 0;   ///< first rows never evicted
    std::size_t recent = 0;  ///< rows that arrived last, never evicted
  };
  Random() = default;
  KVEVICT_DEFER explicit Random(Config c) : seed(c.seed), sinks(c.sinks), recent(c.recent) {}
  std::uint64_t seed = 0;
  std::size_t sinks = 0;
  std::size_t recent = 0;

  static constexpr Signals signals = Signals::none;
  /// Never reads stored keys/values: IndexCache skips gathering them, and a quantized
  /// KVCache does not dequantise heads for it (docs/quantized.md).
  static constexpr bool reads_stored_rows = false;
  static constexpr const char* name() { return "Random"; }
  [[nodiscard]] std::size_t min_capacity() const {
    return detail::protected_plus_one(name(), {{"sinks", sinks}, {"recent", recent}});
  }
  KVEVICT_LAZY void bind(const CacheShape& shape);
  /// Each victim is the k-th eligible row in arrival order, k uniform (rng() % count).
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    const detail::Protection prot{sinks, recent};
    std::vector<std::pair<std::uint64_t, std::uint32_t>> cand;
    for (std::size_t r = 0; r < v.size; ++r)
      if (!prot.is_protected(v.seqs[r], v.incoming_seq))
        cand.push_back({v.seqs[r], static_cast<std::uint32_t>(r)});
    auto& rng = rngs_[static_cast<std::size_t>(v.layer) * hkv_ + static_cast<std::size_t>(v.kv_head)];
    for (std::size_t i = 0; i < v.need; ++i) {
      const std::size_t k = static_cast<std::size_t>(rng() % (cand.size() - i));
      auto kth = cand.begin() + static_cast<std::ptrdiff_t>(k);
      std::nth_element(cand.begin(), kth, cand.end() - static_cast<std::ptrdiff_t>(i));
      out.push_back(kth->second);
      std::iter_swap(kth, cand.end() - static_cast<std::ptrdiff_t>(i + 1));
    }
  }
  template <class S>
  void on_append(const HeadView<S>&, std::size_t) {}
  void on_move(int, int, std::size_t, std::size_t) {}

  /// Saved state (serialize.hpp): the configuration, checked on load, and every
  /// generator's state, so a restored cache draws the same victims.
  KVEVICT_LAZY void save_state(std::vector<std::uint8_t>& out) const;
  KVEVICT_LAZY void load_state(std::span<const std::uint8_t> in);

  /// SplitMix64 of (seed, stream): well-separated seeds for the per-head generators.
  static std::uint64_t stream_seed(std::uint64_t seed, std::uint64_t stream) {
    std::uint64_t z = seed + 0x9E3779B97F4A7C15ull * (stream + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

 private:
  std::size_t hkv_ = 1;
  std::vector<kvevict::detail::Mt19937_64> rngs_;  ///< std::mt19937_64's sequence
};

// Random's members whose bodies instantiate standard templates (the generator vector, the
// text streams of the saved state): KVEVICT_LAZY header-only, in kvevict_kernels in
// separate-kernels mode (config.hpp).
#if !KVEVICT_KERNELS_DECLARE_ONLY
KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void Random::bind(const CacheShape& shape) {
  hkv_ = static_cast<std::size_t>(shape.geometry.n_kv_heads);
  rngs_.clear();
  for (std::size_t i = 0; i < shape.capacity.size(); ++i) rngs_.emplace_back(stream_seed(seed, i));
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void Random::save_state(std::vector<std::uint8_t>& out) const {
  kvevict::detail::ByteWriter w(out);
  for (std::uint64_t x : {seed, std::uint64_t(sinks), std::uint64_t(recent)}) w.put(x);
  // The one stream left in include/ (docs/ARCHITECTURE.md): the generator's state as the
  // text std::mt19937_64's operator<< writes (random_engine.hpp).
  std::ostringstream os;
  for (const auto& g : rngs_) {
    g.save(os);
    os << ' ';
  }
  w.put_string(os.str());
}

KVEVICT_LAZY_DEF KVEVICT_KERNEL_FN void Random::load_state(std::span<const std::uint8_t> in) {
  kvevict::detail::ByteReader r(in);
  const auto sd = r.get<std::uint64_t>("Random seed");
  const auto sk = r.get<std::uint64_t>("Random sinks");
  const auto rc = r.get<std::uint64_t>("Random recent");
  kvevict::detail::require(sd == seed && sk == sinks && rc == recent,
                           "Random state: saved with seed = ", sd, ", sinks = ", sk,
                           ", recent = ", rc, ", expected seed = ", seed, ", sinks = ", sinks,
                           ", recent = ", recent);
  std::istringstream is(r.get_string("Random generators", in.size()));
  std::vector<kvevict::detail::Mt19937_64> fresh(rngs_.size());
  for (auto& g : fresh) g.load(is);
  kvevict::detail::require(!is.fail() && r.remaining() == 0,
                           "Random state: malformed generator state (", rngs_.size(),
                           " generators expected)");
  rngs_.swap(fresh);
}
#endif  // !KVEVICT_KERNELS_DECLARE_ONLY

}  // namespace kvevict::policies
