// Random operation sequences on a paged pool (paged.hpp): sequences added (with valid and
// invalid budgets) and released (known and unknown ids), tokens appended (bad sequence,
// layer, position, sizes and non-finite values included), attention observed. After every
// operation the pool accounting must hold (in use + free = total, every block in a table
// owned by that sequence and listed once, tables within budget); a call that throws
// kvevict::Error must leave everything unchanged. Any other exception aborts.
//
// Inputs whose first byte is >= 0xC0 drive PagedCache (paged_cache.hpp) instead: up to 3
// sequences of one policy (StreamingLLM, H2O, SnapKV with chunked prefill) over one
// BlockPool of float or a quantized format (Q8<2>, Q4<2>, E4M3, KV<Q8<2>, Q4<2>>), each
// beside a KVCache<Policy, F> fed the same stream (decode steps with queries, prefill
// chunks of random sizes, observed attention, malformed rows, release and re-admission).
// After every operation each sequence holds the same rows as its KVCache (arrival indices
// and positions in row order) and the pool's bytes of each row equal the KVCache's stored
// bytes; the pool accounting holds (in use = the sequences' blocks, every table block owned
// by its sequence and listed once, each table exactly ceil(rows / block_tokens) blocks).
// When the pool is exhausted the call is a kvevict::Error only if the rows the KVCache now
// holds would need more new blocks than are free, and the sequence, its table and the pool
// are unchanged (the KVCache is put back from its save).
#include <kvevict/attention.hpp>
#include <kvevict/cache.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/paged_cache.hpp>
#include <kvevict/policies/h2o.hpp>
#include <kvevict/policies/snapkv.hpp>
#include <kvevict/policies/streaming_llm.hpp>
#include <kvevict/serialize.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
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


namespace pol = kvevict::policies;

// One PagedCache sequence and its KVCache twin.
template <class Policy, class F>
struct Twin {
  std::uint32_t id;
  std::unique_ptr<kvevict::PagedCache<Policy, F>> paged;
  std::unique_ptr<kvevict::KVCache<Policy, F>> dense;
  std::vector<std::int64_t> next;  // next free position per layer
};

// The same rows in the same order, the pool's bytes equal to the KVCache's stored bytes,
// tables of exactly ceil(rows / block_tokens) blocks owned by the sequence. Returns the
// blocks the sequence holds; `seen` marks blocks (none listed twice across sequences).
template <class Policy, class F>
std::size_t check_twin(const Twin<Policy, F>& t, const kvevict::BlockPool<F>& pool, std::vector<std::uint8_t>& seen) {
  const auto& p = *t.paged;
  const auto& d = *t.dense;
  const auto& g = d.geometry();
  const std::size_t bt = pool.block_tokens(), ku = pool.key_row_units(), vu = pool.value_row_units();
  std::size_t blocks = 0;
  for (int l = 0; l < g.n_layers; ++l) {
    KVFUZZ_ASSERT(p.tokens_seen(l) == d.tokens_seen(l));
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const auto ps = p.seqs(l, h), ds = d.seqs(l, h);
      KVFUZZ_ASSERT(std::equal(ps.begin(), ps.end(), ds.begin(), ds.end()));
      const auto pp = p.positions(l, h), dp = d.positions(l, h);
      KVFUZZ_ASSERT(std::equal(pp.begin(), pp.end(), dp.begin(), dp.end()));
      KVFUZZ_ASSERT(p.size(l, h) <= p.capacity(l, h));
      const auto table = p.table(l, h);
      const std::size_t n = p.size(l, h);
      KVFUZZ_ASSERT(table.size() == (n + bt - 1) / bt);
      for (auto b : table) {
        KVFUZZ_ASSERT(b < seen.size() && seen[b] == 0);
        seen[b] = 1;
        KVFUZZ_ASSERT(pool.allocator().owner(b) == t.id);
      }
      blocks += table.size();
      const auto sk = d.stored_keys(l, h), sv = d.stored_values(l, h);
      for (std::size_t r = 0; r < n; ++r) {
        const auto* k = pool.key_block(table[r / bt]) + (r % bt) * ku;
        const auto* v = pool.value_block(table[r / bt]) + (r % bt) * vu;
        KVFUZZ_ASSERT(std::memcmp(k, sk.data() + r * ku, pool.key_row_bytes()) == 0);
        KVFUZZ_ASSERT(std::memcmp(v, sv.data() + r * vu, pool.value_row_bytes()) == 0);
      }
    }
  }
  KVFUZZ_ASSERT(p.blocks_in_use() == blocks);
  return blocks;
}

// The paged sequence's observable state (rows, positions, tables, stored bytes): an
// operation that threw must leave it identical.
template <class Policy, class F>
void snapshot(const Twin<Policy, F>& t, const kvevict::BlockPool<F>& pool, std::vector<std::uint8_t>& out) {
  out.clear();
  const auto& p = *t.paged;
  const auto& g = p.geometry();
  auto put = [&](const void* x, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(x);
    out.insert(out.end(), b, b + n);
  };
  const std::size_t bt = pool.block_tokens(), ku = pool.key_row_units(), vu = pool.value_row_units();
  for (int l = 0; l < g.n_layers; ++l) {
    const auto seen = p.tokens_seen(l);
    put(&seen, sizeof seen);
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const auto s = p.seqs(l, h);
      const auto ps = p.positions(l, h);
      const auto tb = p.table(l, h);
      const std::size_t n = s.size();
      put(&n, sizeof n);
      put(s.data(), n * sizeof(s[0]));
      put(ps.data(), n * sizeof(ps[0]));
      put(tb.data(), tb.size() * sizeof(tb[0]));
      for (std::size_t r = 0; r < n; ++r) {
        put(pool.key_block(tb[r / bt]) + (r % bt) * ku, pool.key_row_bytes());
        put(pool.value_block(tb[r / bt]) + (r % bt) * vu, pool.value_row_bytes());
      }
    }
  }
  const auto used = pool.allocator().in_use();
  put(&used, sizeof used);
}

template <class Policy, class F>
void run_cache(kvfuzz::Input& in, const Policy& policy) {
  using kvevict::Budget;
  kvevict::Geometry g{in.range(1, 2), 0, in.range(1, 2), 2 * in.range(1, 4)};
  g.n_heads = g.n_kv_heads * in.range(1, 2);
  const auto bt = std::uint32_t{1} << in.range(0, 3);
  const auto total = static_cast<std::uint32_t>(in.range(1, 24));
  const int cap = in.range(4, 14);
  const Budget budget = in.byte() & 1 ? Budget::uniform(cap) : Budget::per_layer([&] {
    std::vector<long long> b(static_cast<std::size_t>(g.n_layers));
    for (auto& x : b) x = cap + in.range(0, 6);
    return b;
  }());
  std::optional<kvevict::BlockPool<F>> pool_store;
  try {
    pool_store.emplace(total, bt, g.head_dim);
    // the budget and policy must be accepted by a KVCache first (else nothing to fuzz)
    kvevict::KVCache<Policy, F> probe(g, budget, policy);
  } catch (const kvevict::Error&) {
    return;
  }
  auto& pool = *pool_store;
  const std::size_t kv = static_cast<std::size_t>(g.n_kv_heads * g.head_dim);
  const std::size_t qn = static_cast<std::size_t>(g.n_heads * g.head_dim);
  std::vector<Twin<Policy, F>> seqs;
  std::uint32_t next_id = 0;
  std::vector<std::uint8_t> seen, before, after, saved;
  std::vector<float> k, v, q;
  auto admit = [&] {
    Twin<Policy, F> t{next_id++, nullptr, nullptr, std::vector<std::int64_t>(static_cast<std::size_t>(g.n_layers), 0)};
    t.paged = std::make_unique<kvevict::PagedCache<Policy, F>>(g, budget, pool, t.id, policy);
    t.dense = std::make_unique<kvevict::KVCache<Policy, F>>(g, budget, policy);
    seqs.push_back(std::move(t));
  };
  admit();
  for (int ops = 0; ops < 48 && !in.done(); ++ops) {
    const int what = in.range(0, 7);
    if (what == 7) {  // release a sequence (its blocks return) and admit another
      if (seqs.size() > 1 || in.byte() & 1) {
        const auto used = pool.allocator().in_use();
        const std::size_t i = static_cast<std::size_t>(in.range(0, static_cast<int>(seqs.size()) - 1));
        const std::size_t held = seqs[i].paged->blocks_in_use();
        seqs.erase(seqs.begin() + static_cast<std::ptrdiff_t>(i));
        KVFUZZ_ASSERT(pool.allocator().in_use() == used - held);
      }
      if (seqs.size() < 3) admit();
      continue;
    }
    if (seqs.empty()) admit();
    auto& t = seqs[static_cast<std::size_t>(in.range(0, static_cast<int>(seqs.size()) - 1))];
    const int l = in.range(0, g.n_layers - 1);
    const auto ul = static_cast<std::size_t>(l);
    if (what == 6) {  // attention from the KVCache, observed by both
      in.fill(q, qn);
      const auto r = kvevict::attend(*t.dense, l, q, kvevict::AttendOptions{false});
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const auto& p = r.probs[static_cast<std::size_t>(h)];
        const std::span<const float> ps(p.data(), static_cast<std::size_t>(p.size()));
        t.dense->observe(l, h, ps);
        t.paged->observe(l, h, ps);
      }
    } else {
      // 0-3: decode step; 4-5: a prefill chunk of 1-10 tokens. Now and then a bad row.
      const std::size_t n = what < 4 ? 1 : static_cast<std::size_t>(in.range(1, 10));
      in.fill(k, n * kv), in.fill(v, n * kv), in.fill(q, n * qn);
      const std::uint8_t bad = in.byte();
      if (bad >= 240) (bad & 1 ? k : v)[static_cast<std::size_t>(in.range(0, static_cast<int>(n * kv) - 1))] =
          bad & 2 ? std::nanf("") : 1e30f;  // NaN, or past every quantized format's range
      const std::int64_t pos = t.next[ul];
      snapshot(t, pool, before);
      saved = kvevict::save_bytes(*t.dense);
      // The same call on the dense twin and the paged sequence: whether each accepted it.
      const auto accepts = [&](auto& cache) {
        try {
          if (n == 1 && what < 4) cache.append(l, pos, k, v, q);
          else cache.prefill(l, pos, n, k, v, q);
        } catch (const kvevict::Error&) {
          return false;
        }
        return true;
      };
      const bool dense_ok = accepts(*t.dense);
      const bool paged_ok = accepts(*t.paged);
      if (!paged_ok) {  // unchanged; an exhausted pool only when the rows need more blocks than are free
        snapshot(t, pool, after);
        KVFUZZ_ASSERT(after == before);
        if (dense_ok) {
          std::size_t need = 0;
          for (int h = 0; h < g.n_kv_heads; ++h) {
            const std::size_t want = (t.dense->size(l, h) + bt - 1) / bt, have = t.paged->table(l, h).size();
            if (want > have) need += want - have;
          }
          KVFUZZ_ASSERT(need > pool.allocator().free_blocks());
          kvevict::load_bytes(*t.dense, saved);  // the twin goes back to where the sequence is
        }
      } else {
        KVFUZZ_ASSERT(dense_ok);  // what the pool accepted, the KVCache accepted
        t.next[ul] = pos + static_cast<std::int64_t>(n);
      }
    }
    seen.assign(pool.allocator().total(), 0);
    std::size_t blocks = 0;
    for (const auto& s : seqs) blocks += check_twin(s, pool, seen);
    KVFUZZ_ASSERT(blocks == pool.allocator().in_use());
    KVFUZZ_ASSERT(pool.allocator().in_use() + pool.allocator().free_blocks() == pool.allocator().total());
  }
  seqs.clear();
  KVFUZZ_ASSERT(pool.allocator().in_use() == 0);
}

template <class F>
void run_format(kvfuzz::Input& in) {
  switch (in.range(0, 2)) {
    case 0: return run_cache<pol::StreamingLLM, F>(in, pol::StreamingLLM{static_cast<std::size_t>(in.range(0, 2))});
    case 1: return run_cache<pol::H2O, F>(in, pol::H2O(pol::H2O::Config{static_cast<std::size_t>(in.range(0, 2)), 1}));
    default: {
      pol::SnapKV::Config c;
      c.window = static_cast<std::size_t>(in.range(1, 3));
      c.kernel = 3;
      c.decode_reserve = static_cast<std::size_t>(in.range(0, 2));
      if (in.byte() & 1) c.chunked = pol::ChunkedPrefill::first_chunk;
      return run_cache<pol::SnapKV, F>(in, pol::SnapKV(c));
    }
  }
}

// Every configuration drawn here is valid: any kvevict::Error escaping is a finding.
void paged_cache(kvfuzz::Input& in) {
  switch (in.range(0, 4)) {
    case 0: return run_format<float>(in);
    case 1: return run_format<kvevict::Q8<2>>(in);
    case 2: return run_format<kvevict::Q4<2>>(in);
    case 3: return run_format<kvevict::E4M3>(in);
    default: return run_format<kvevict::KV<kvevict::Q8<2>, kvevict::Q4<2>>>(in);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > 0 && data[0] >= 0xC0) {
    kvfuzz::Input pin(data + 1, size - 1);
    paged_cache(pin);
    return 0;
  }
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
