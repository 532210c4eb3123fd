// Random operation sequences on a paged pool (paged.hpp): sequences added (with valid and
// invalid budgets) and released (known and unknown ids), tokens appended (bad sequence,
// layer, position, sizes and non-finite values included), attention observed. After every
// operation the pool accounting must hold (in use + free = total, every block in a table
// owned by that sequence and listed once, tables within budget); a call that throws
// kvevict::Error must leave everything unchanged. Any other exception aborts.
#include <kvevict/paged.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <vector>

#include "fuzz_input.hpp"

namespace {

#define KVFUZZ_ASSERT(x)    \
  do {                      \
    if (!(x)) std::abort(); \
  } while (0)

using kvevict::BlockAllocator;
using kvevict::PagedKV;
using kvevict::PoolConfig;

// Everything an operation may change, flattened into vectors that are refilled in place
// (no allocation per operation: allocations dominate under ASan): live ids, per-layer
// tokens seen, every table's block ids and its tokens' positions (ends mark each table).
struct State {
  std::uint32_t in_use = 0;
  std::vector<std::uint32_t> ids;
  std::vector<std::uint64_t> seen;
  std::vector<std::uint32_t> blocks;
  std::vector<std::size_t> block_ends;
  std::vector<std::int64_t> pos;
  std::vector<std::size_t> pos_ends;
  bool operator==(const State&) const = default;
};

// Fills `s` with the pool's state; with `owned` also checks the pool accounting against
// the tables in the same pass: in use + free = total, every block in a table owned by that
// sequence and listed once (a bitmap over the pool's blocks), tables within budget.
void state(const PagedKV<float>& p, std::uint32_t max_id, State& s, std::vector<std::uint8_t>* owned) {
  const auto& pool = p.pool();
  s.in_use = pool.in_use();
  s.ids.clear(), s.seen.clear(), s.blocks.clear(), s.block_ends.clear(), s.pos.clear(), s.pos_ends.clear();
  if (owned) {
    KVFUZZ_ASSERT(pool.in_use() + pool.free_blocks() == pool.total());
    owned->assign(pool.total(), 0);
  }
  const auto& c = p.config();
  for (std::uint32_t id = 0; id < max_id; ++id) {
    if (!p.has_sequence(id)) continue;
    s.ids.push_back(id);
    const std::uint32_t budget = p.budget(id).blocks;
    for (int l = 0; l < c.geometry.n_layers; ++l) {
      s.seen.push_back(p.tokens_seen(id, l));
      for (int g = 0; g < c.groups(); ++g) {
        const auto t = p.table(id, l, g);
        s.blocks.insert(s.blocks.end(), t.begin(), t.end());
        s.block_ends.push_back(s.blocks.size());
        const auto ps = p.positions(id, l, g);
        s.pos.insert(s.pos.end(), ps.begin(), ps.begin() + static_cast<std::ptrdiff_t>(p.tokens(id, l, g)));
        s.pos_ends.push_back(s.pos.size());
        if (!owned) continue;
        if (budget != 0) KVFUZZ_ASSERT(t.size() <= budget);
        for (auto b : t) {
          KVFUZZ_ASSERT(b < owned->size() && (*owned)[b] == 0);
          (*owned)[b] = 1;
          KVFUZZ_ASSERT(pool.owner(b) == id);
        }
      }
    }
  }
  if (owned) KVFUZZ_ASSERT(s.blocks.size() == pool.in_use());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvfuzz::Input in(data, size);
  PoolConfig cfg;
  cfg.geometry = kvevict::Geometry{in.range(1, 3), 0, in.range(1, 2), in.range(1, 4)};
  cfg.geometry.n_heads = cfg.geometry.n_kv_heads * in.range(1, 2);
  cfg.block_tokens = static_cast<std::uint32_t>(in.range(0, 9));  // 0, 3, 5, 6, 7, 9: invalid
  cfg.block_tokens = cfg.block_tokens == 9 ? 512u : (cfg.block_tokens == 8 ? 256u : cfg.block_tokens);
  cfg.blocks = static_cast<std::uint32_t>(in.range(0, 48));
  // 256-token blocks: at most 8 (0 still invalid). 48 of them are 768 KB of K/V per input,
  // fresh pages from the OS under ASan each time (a fifth of the run's time in page faults),
  // and 400 operations fill at most two such blocks per table: 8 still exhaust the pool.
  if (cfg.block_tokens == 256) cfg.blocks %= 9;
  cfg.layout = in.byte() % 2 ? kvevict::BlockLayout::per_kv_head : kvevict::BlockLayout::shared_cells;
  std::unique_ptr<PagedKV<float>> pp;
  try {
    pp = std::make_unique<PagedKV<float>>(cfg);
  } catch (const kvevict::Error&) {
    const auto bt = cfg.block_tokens;
    KVFUZZ_ASSERT(cfg.blocks == 0 || bt == 0 || bt > 256 || (bt & (bt - 1)) != 0);
    return 0;
  }
  PagedKV<float>& p = *pp;
  const std::size_t kv = static_cast<std::size_t>(cfg.geometry.n_kv_heads * cfg.geometry.head_dim);
  std::vector<std::int64_t> last(64 * 4, -1);
  std::uint32_t max_id = 0;
  int ops = 0;
  // One state pass and check per operation: `before` is the state after the previous
  // operation; an operation that threw fills `after` instead, which must equal it.
  static State before, after;
  static std::vector<std::uint8_t> owned;
  static std::vector<float> k, v, probs;
  state(p, max_id, before, &owned);
  while (!in.done() && ops++ < 400) {
    try {
      switch (in.range(0, 5)) {
        case 0: {
          kvevict::SequenceBudget b;
          b.blocks = static_cast<std::uint32_t>(in.range(0, 8));
          b.sink_blocks = static_cast<std::uint32_t>(in.range(0, 2));
          b.recent_blocks = static_cast<std::uint32_t>(in.range(0, 2));
          b.score = static_cast<kvevict::BlockScore>(in.range(0, 2));
          b.decay = in.byte() % 8 == 0 ? 0.0f : 1.0f;
          const auto id = p.add_sequence(b);
          // A new id: a released one or the next unused (ids are dense). An input may add
          // more than 64 sequences (up to 400 adds; only ids 0-8 are ever released): the
          // harness once asserted id < 64 here, which a long run hit (seed many_sequences).
          KVFUZZ_ASSERT(id <= max_id && !std::binary_search(before.ids.begin(), before.ids.end(), id));
          max_id = std::max(max_id, id + 1);
          if (last.size() < (static_cast<std::size_t>(id) + 1) * 4) last.resize((static_cast<std::size_t>(id) + 1) * 4);
          for (int l = 0; l < 4; ++l) last[static_cast<std::size_t>(id) * 4 + static_cast<std::size_t>(l)] = -1;
          break;
        }
        case 1:
          p.release_sequence(static_cast<std::uint32_t>(in.range(0, 8)));
          break;
        case 2:
        case 3:
        case 4: {
          const auto id = static_cast<std::uint32_t>(in.range(0, 8));
          const int layer = in.range(0, 3);
          const std::size_t slot = static_cast<std::size_t>(id) * 4 + static_cast<std::size_t>(layer);
          const std::int64_t position = (slot < last.size() ? last[slot] : 0) + in.range(0, 3);
          in.fill(k, kv + (in.byte() % 16 == 0 ? 1 : 0));
          in.fill(v, kv);
          if (in.byte() % 32 == 0) v[0] = std::nanf("");
          p.append(id, layer, position, k, v);
          if (slot < last.size()) last[slot] = position;
          break;
        }
        default: {
          const auto id = static_cast<std::uint32_t>(in.range(0, 8));
          const int layer = in.range(0, 3), group = in.range(0, 2);
          // Mostly the right size for the table, sometimes not.
          std::size_t n = static_cast<std::size_t>(in.range(0, 64));
          if (in.byte() % 4 != 0 && p.has_sequence(id) && layer < cfg.geometry.n_layers &&
              group < cfg.groups())
            n = static_cast<std::size_t>(p.query_heads_per_table()) * p.tokens(id, layer, group);
          probs.resize(n);
          for (auto& x : probs) x = std::fabs(in.value());
          p.observe(id, layer, group, probs);
          break;
        }
      }
    } catch (const kvevict::Error&) {
      state(p, max_id, after, &owned);
      KVFUZZ_ASSERT(after == before);
      continue;  // nothing changed: `before` is still the state (and `after` was checked)
    }
    state(p, max_id, before, &owned);
  }
  for (std::uint32_t id = 0; id < max_id; ++id)
    if (p.has_sequence(id)) p.release_sequence(id);
  KVFUZZ_ASSERT(p.pool().in_use() == 0);
  return 0;
}
