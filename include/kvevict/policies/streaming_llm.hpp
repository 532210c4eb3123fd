#pragma once
// StreamingLLM (Xiao et al. 2023): S attention sinks plus a sliding window of the most
// recent tokens; the window is whatever the budget leaves after the sinks.
#include "common.hpp"

namespace kvevict::policies {

struct StreamingLLM {
  std::size_t sinks = 4;

  static constexpr Signals signals = Signals::none;
  static constexpr const char* name() { return "StreamingLLM"; }
  [[nodiscard]] std::size_t min_capacity() const {
    return detail::protected_plus_one(name(), {{"sinks", sinks}});
  }
  void bind(const CacheShape&) {}
  /// Evicts the oldest non-sink rows.
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    detail::evict_lowest(
        v, [&](std::size_t r) { return v.seqs[r]; },
        [&](std::size_t r) { return v.seqs[r] >= sinks; }, out, name());
  }
  template <class S>
  void on_append(const HeadView<S>&, std::size_t) {}
  void on_move(int, int, std::size_t, std::size_t) {}
  /// Saved state (serialize.hpp): the configuration, checked on load.
  void save_state(std::vector<std::uint8_t>& out) const {
    detail::save_config(out, {{"sinks", sinks}});
  }
  void load_state(std::span<const std::uint8_t> in) const {
    detail::check_config(in, name(), {{"sinks", sinks}});
  }
};

}  // namespace kvevict::policies
