#pragma once
// StreamingLLM (Xiao et al. 2023): S attention sinks plus a sliding window of the most
// recent tokens; the window is whatever the budget leaves after the sinks.
//
// O(1) per step: each head keeps the row of every non-sink arrival in arrival order (a
// queue indexed by seq, updated by on_append / on_move), so the oldest non-sink row is the
// front of the queue instead of the result of a scan over every row. Entries whose row no
// longer holds that seq (the row was evicted) are dropped lazily when they reach the front.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.hpp"

namespace kvevict::policies {

namespace detail {

/// StreamingLLM's per-head arrival-order index of the non-sink rows (see the header
/// comment). A class of its own so that StreamingLLM stays an aggregate
/// (StreamingLLM{.sinks = 1}).
class OldestFirst {
 public:
  KVEVICT_DEFER void bind(const CacheShape& shape) {
    heads_.assign(shape.capacity.size(), {});
    seqs_.bind(shape);
    hkv_ = static_cast<std::size_t>(shape.geometry.n_kv_heads);
  }
  /// Appends the `need` oldest rows with seq >= sinks to `out`.
  template <class S>
  void oldest(const HeadView<S>& v, std::vector<std::uint32_t>& out, const char* policy) {
    Queue& q = heads_[index(v.layer, v.kv_head)];
    // Drop stale entries at the front (their row was evicted); they are garbage either way,
    // so an append that throws later leaves the decisions unchanged.
    const auto live = [&](std::size_t i) {
      const std::uint32_t r = q.rows[i];
      return r != kNone && r < v.size && v.seqs[r] == q.first + (i - q.head);
    };
    while (q.head < q.rows.size() && !live(q.head)) {
      ++q.head;
      ++q.first;
    }
    std::size_t found = 0;
    for (std::size_t i = q.head; i < q.rows.size() && found < v.need; ++i)
      if (live(i)) {
        out.push_back(q.rows[i]);
        ++found;
      }
    if (found < v.need) {
      if (v.need == 1) throw std::logic_error(std::string("kvevict: ") + policy + ": no evictable row");
      throw std::logic_error(std::string("kvevict: ") + policy + ": " + std::to_string(found) +
                             " evictable rows, need " + std::to_string(v.need));
    }
  }
  KVEVICT_DEFER void appended(int layer, int kv_head, std::size_t row, std::uint64_t seq, std::size_t sinks) {
    seqs_.set(layer, kv_head, row, seq);
    if (seq >= sinks) heads_[index(layer, kv_head)].put(seq, static_cast<std::uint32_t>(row));
  }
  KVEVICT_DEFER void moved(int layer, int kv_head, std::size_t from, std::size_t to, std::size_t sinks) {
    const std::uint64_t seq = seqs_.of(layer, kv_head)[from];
    seqs_.move(layer, kv_head, from, to);
    if (seq >= sinks) heads_[index(layer, kv_head)].put(seq, static_cast<std::uint32_t>(to));
  }

 private:
  static constexpr std::uint32_t kNone = 0xFFFFFFFFu;
  /// rows[head + j] is the row holding seq first + j (kNone: none recorded). Entries before
  /// `head` are consumed; the buffer is compacted when more than half of it is.
  struct Queue {
    std::vector<std::uint32_t> rows;
    std::size_t head = 0;
    std::uint64_t first = 0;

    KVEVICT_DEFER void put(std::uint64_t seq, std::uint32_t row) {
      if (head == rows.size()) {  // empty: restart at this seq
        rows.clear();
        head = 0;
        first = seq;
      }
      if (seq < first) {  // out of order (a restored cache replays rows in row order)
        const std::size_t gap = static_cast<std::size_t>(first - seq);
        if (gap <= head) {
          head -= gap;
        } else {
          const std::size_t grow = std::max(gap - head, rows.size() - head);
          rows.insert(rows.begin(), grow, kNone);
          head += grow - gap;
        }
        for (std::size_t i = head + 1; i < head + gap; ++i) rows[i] = kNone;
        first = seq;
      }
      const std::size_t i = head + static_cast<std::size_t>(seq - first);
      if (i >= rows.size()) {
        if (head > 0 && head >= rows.size() / 2) {  // compact the consumed prefix
          rows.erase(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(head));
          return put_at(static_cast<std::size_t>(seq - first), row);
        }
        rows.resize(i + 1, kNone);
      }
      rows[i] = row;
    }
    KVEVICT_DEFER void put_at(std::size_t j, std::uint32_t row) {
      head = 0;
      if (j >= rows.size()) rows.resize(j + 1, kNone);
      rows[j] = row;
    }
  };
  std::size_t index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * hkv_ + static_cast<std::size_t>(kv_head);
  }
  std::vector<Queue> heads_;
  RowColumn<std::uint64_t> seqs_;  ///< arrival index of each row, for moved()
  std::size_t hkv_ = 1;
};

}  // namespace detail

struct StreamingLLM {
  std::size_t sinks = 4;
  detail::OldestFirst order{};  ///< internal: arrival-order index, built at bind()

  static constexpr Signals signals = Signals::none;
  static constexpr const char* name() { return "StreamingLLM"; }
  /// Never reads stored keys/values: IndexCache need not gather them.
  static constexpr bool reads_stored_rows = false;
  [[nodiscard]] std::size_t min_capacity() const {
    return detail::protected_plus_one(name(), {{"sinks", sinks}});
  }
  KVEVICT_DEFER void bind(const CacheShape& shape) { order.bind(shape); }
  /// Evicts the oldest non-sink rows: O(need) amortised, no scan over the rows.
  template <class S>
  void choose_victims(const HeadView<S>& v, std::vector<std::uint32_t>& out) {
    order.oldest(v, out, name());
  }
  template <class S>
  void on_append(const HeadView<S>& v, std::size_t row) {
    order.appended(v.layer, v.kv_head, row, v.seqs[row], sinks);
  }
  KVEVICT_DEFER void on_move(int layer, int kv_head, std::size_t from, std::size_t to) {
    order.moved(layer, kv_head, from, to, sinks);
  }
  /// Saved state (serialize.hpp): the configuration, checked on load.
  KVEVICT_DEFER void save_state(std::vector<std::uint8_t>& out) const {
    detail::save_config(out, {{"sinks", sinks}});
  }
  KVEVICT_DEFER void load_state(std::span<const std::uint8_t> in) const {
    detail::check_config(in, name(), {{"sinks", sinks}});
  }
};

}  // namespace kvevict::policies

// Compiled-kernels mode: extern template declarations of the common caches (extern_templates.hpp).
#define KVEVICT_HAVE_STREAMING_LLM_HPP 1
#include "../extern_templates.hpp"
