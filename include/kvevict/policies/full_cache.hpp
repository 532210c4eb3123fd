#pragma once
// FullCache: keeps every row. The reference every quality figure is measured against.
#include "common.hpp"

namespace kvevict::policies {

struct FullCache {
  static constexpr Signals signals = Signals::none;
  /// Never reads stored keys/values: IndexCache skips gathering them, and a quantized
  /// KVCache does not dequantise heads for it (docs/quantized.md).
  static constexpr bool reads_stored_rows = false;
  static constexpr const char* name() { return "FullCache"; }
  [[nodiscard]] std::size_t min_capacity() const { return 1; }
  void bind(const CacheShape& shape) { check_budget(shape); }
  void check_budget(const CacheShape& shape) const {
    detail::require_unbounded(shape, "FullCache: budget", "FullCache never evicts");
  }
  template <class S>
  void choose_victims(const HeadView<S>&, std::vector<std::uint32_t>&) {}
  template <class S>
  void on_append(const HeadView<S>&, std::size_t) {}
  void on_move(int, int, std::size_t, std::size_t) {}
};

}  // namespace kvevict::policies

// Compiled-kernels mode: extern template declarations of the common caches (extern_templates.hpp).
#define KVEVICT_HAVE_FULL_CACHE_HPP 1
#include "../extern_templates.hpp"
