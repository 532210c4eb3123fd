#pragma once
// Drives PagedKV (paged.hpp) from the llama2.c Transformer so the end-to-end protocol
// (e2e.hpp) measures block-granular eviction: Transformer<PagedSpec> stores each token's
// K/V in a one-sequence PagedKV<float> and attends over the blocks its tables list, in
// table order (a paged attention kernel's loop). When `observe` is set, each step's
// attention probabilities go back to PagedTables::observe, so block scores are the
// decayed attention each token drew; unset, every score stays 0 and eviction takes the
// oldest unprotected block (StreamingLLM at block granularity).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "kvevict/attention.hpp"
#include "kvevict/paged.hpp"
#include "llama2c.hpp"

namespace kvevict::llama2c {

/// The "policy" of Transformer<PagedSpec>: the pool's block size and layout and the one
/// sequence's block budget. Budget arguments of Transformer are ignored (the budget is
/// `budget` here, in blocks per table).
struct PagedSpec {
  std::uint32_t block_tokens = 16;
  BlockLayout layout = BlockLayout::per_kv_head;
  SequenceBudget budget;     ///< blocks == 0: unbounded
  bool observe = true;       ///< feed attention back as block scores
  std::uint32_t max_tokens = 4096;  ///< pool sizing when unbounded
};

class PagedStore {
 public:
  PagedStore(const Geometry& g, const Budget& /*ignored*/, const PagedSpec& spec)
      : spec_(spec), kv_(pool_config(g, spec)) {
    seq_ = kv_.add_sequence(spec.budget);
  }
  [[nodiscard]] const PagedKV<float>& paged() const { return kv_; }
  [[nodiscard]] std::uint32_t sequence() const { return seq_; }
  [[nodiscard]] const PagedSpec& spec() const { return spec_; }

  void append(int layer, int pos, std::span<const float> k, std::span<const float> v,
              std::span<const float> /*queries*/) {
    kv_.append(seq_, layer, pos, k, v);
  }

  /// Attention of every query head over its table's tokens; observes when asked.
  AttentionResult attend_layer(int layer, std::span<const float> q) {
    const Geometry& g = kv_.config().geometry;
    const int G = g.group();
    const auto d = static_cast<std::size_t>(g.head_dim);
    const std::size_t w = kv_.row_width();
    const std::size_t B = kv_.block_tokens();
    const bool shared = kv_.config().layout == BlockLayout::shared_cells;
    const float scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
    AttentionResult r;
    r.out.setZero(g.n_heads, g.head_dim);
    r.probs.resize(static_cast<std::size_t>(g.n_kv_heads));
    for (int kvh = 0; kvh < g.n_kv_heads; ++kvh) {
      const int table = shared ? 0 : kvh;
      const std::size_t col = shared ? static_cast<std::size_t>(kvh) * d : 0;
      const auto blocks = kv_.table(seq_, layer, table);
      const std::size_t n = kv_.tokens(seq_, layer, table);
      auto& P = r.probs[static_cast<std::size_t>(kvh)];
      P.resize(G, static_cast<Eigen::Index>(n));
      for (int j = 0; j < G; ++j) {
        const int h = kvh * G + j;
        const float* qh = q.data() + static_cast<std::size_t>(h) * d;
        float m = -std::numeric_limits<float>::infinity();
        for (std::size_t i = 0; i < n; ++i) {
          const float* krow = kv_.key_block(blocks[i / B]) + (i % B) * w + col;
          float s = 0.0f;
          for (std::size_t x = 0; x < d; ++x) s += qh[x] * krow[x];
          P(j, static_cast<Eigen::Index>(i)) = s * scale;
          m = std::max(m, s * scale);
        }
        float sum = 0.0f;
        for (std::size_t i = 0; i < n; ++i) {
          float& p = P(j, static_cast<Eigen::Index>(i));
          p = std::exp(p - m);
          sum += p;
        }
        for (std::size_t i = 0; i < n; ++i) {
          const float p = P(j, static_cast<Eigen::Index>(i)) /= sum;
          const float* vrow = kv_.value_block(blocks[i / B]) + (i % B) * w + col;
          for (std::size_t x = 0; x < d; ++x) r.out(h, static_cast<Eigen::Index>(x)) += p * vrow[x];
        }
      }
    }
    if (spec_.observe) {
      if (shared) {
        // Every query head reads the layer's one table: rows of all KV heads' groups.
        const std::size_t n = kv_.tokens(seq_, layer, 0);
        scratch_.resize(static_cast<std::size_t>(g.n_heads) * n);
        for (int kvh = 0; kvh < g.n_kv_heads; ++kvh) {
          const auto& P = r.probs[static_cast<std::size_t>(kvh)];
          std::copy(P.data(), P.data() + P.size(),
                    scratch_.data() + static_cast<std::size_t>(kvh * G) * n);
        }
        kv_.observe(seq_, layer, 0, scratch_);
      } else {
        for (int kvh = 0; kvh < g.n_kv_heads; ++kvh) {
          const auto& P = r.probs[static_cast<std::size_t>(kvh)];
          kv_.observe(seq_, layer, kvh,
                      std::span<const float>(P.data(), static_cast<std::size_t>(P.size())));
        }
      }
    }
    return r;
  }

 private:
  static PoolConfig pool_config(const Geometry& g, const PagedSpec& s) {
    PoolConfig c;
    c.geometry = g;
    c.block_tokens = s.block_tokens;
    c.layout = s.layout;
    const std::uint32_t per_table =
        s.budget.blocks != 0 ? s.budget.blocks : s.max_tokens / s.block_tokens + 1;
    c.blocks = per_table * static_cast<std::uint32_t>(c.tables_per_sequence());
    return c;
  }
  PagedSpec spec_;
  PagedKV<float> kv_;
  std::uint32_t seq_ = 0;
  std::vector<float> scratch_;
};

template <>
struct CacheFor<PagedSpec> {
  using type = PagedStore;
};

/// Found by Transformer::forward's unqualified attend(cache_, layer, queries).
inline AttentionResult attend(PagedStore& store, int layer, std::span<const float> queries) {
  return store.attend_layer(layer, queries);
}

}  // namespace kvevict::llama2c
