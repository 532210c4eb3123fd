// Paged K/V (paged.hpp): pool accounting under long random operation sequences, block
// eviction rules, bad input, and the K/V a PagedKV stores.
#include <catch2/catch.hpp>
#include <kvevict/paged.hpp>

#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

using kvevict::BlockEvent;
using kvevict::BlockLayout;
using kvevict::BlockScore;
using kvevict::Geometry;
using kvevict::PagedKV;
using kvevict::PagedTables;
using kvevict::PoolConfig;
using kvevict::SequenceBudget;

namespace {

// Everything observable about the pool and its sequences, for "unchanged" checks.
struct Snapshot {
  std::uint32_t in_use = 0, free = 0;
  std::vector<std::vector<std::uint32_t>> tables;
  std::vector<std::vector<std::int64_t>> positions;
  std::vector<std::size_t> tokens;
  std::vector<std::uint64_t> seen;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const PagedTables& p, const std::vector<std::uint32_t>& seqs) {
  Snapshot s;
  s.in_use = p.pool().in_use();
  s.free = p.pool().free_blocks();
  const auto& c = p.config();
  for (auto id : seqs)
    for (int l = 0; l < c.geometry.n_layers; ++l) {
      s.seen.push_back(p.tokens_seen(id, l));
      for (int g = 0; g < c.groups(); ++g) {
        auto t = p.table(id, l, g);
        s.tables.emplace_back(t.begin(), t.end());
        const std::size_t n = p.tokens(id, l, g);
        auto pos = p.positions(id, l, g);
        s.positions.emplace_back(pos.begin(), pos.begin() + static_cast<std::ptrdiff_t>(n));
        s.tokens.push_back(n);
      }
    }
  return s;
}

// in use + free = total; every block in a live table is owned by that sequence and
// listed once; the pool's in-use count equals the blocks in tables; tables respect budgets.
void check_accounting(const PagedTables& p, const std::vector<std::uint32_t>& seqs) {
  const auto& pool = p.pool();
  REQUIRE(pool.in_use() + pool.free_blocks() == pool.total());
  std::set<std::uint32_t> seen;
  const auto& c = p.config();
  for (auto id : seqs)
    for (int l = 0; l < c.geometry.n_layers; ++l)
      for (int g = 0; g < c.groups(); ++g) {
        const auto t = p.table(id, l, g);
        if (p.budget(id).blocks != 0) REQUIRE(t.size() <= p.budget(id).blocks);
        for (auto b : t) {
          REQUIRE(seen.insert(b).second);  // no block owned twice
          REQUIRE(pool.owner(b) == id);
        }
        const std::size_t n = p.tokens(id, l, g);
        REQUIRE(n <= t.size() * p.block_tokens());
        if (!t.empty()) REQUIRE(n > (t.size() - 1) * p.block_tokens());
      }
  REQUIRE(seen.size() == pool.in_use());
  for (std::uint32_t b = 0; b < pool.total(); ++b)
    if (!seen.count(b)) REQUIRE(pool.owner(b) == kvevict::BlockAllocator::kFree);
}

template <class F>
void require_error_unchanged(PagedTables& p, const std::vector<std::uint32_t>& seqs, F&& f,
                             const std::string& needle) {
  const Snapshot before = snapshot(p, seqs);
  try {
    f();
    FAIL("expected kvevict::Error containing '" << needle << "'");
  } catch (const kvevict::Error& e) {
    INFO(e.what());
    REQUIRE(std::string(e.what()).find(needle) != std::string::npos);
  }
  REQUIRE(snapshot(p, seqs) == before);
}

}  // namespace

TEST_CASE("pool accounting holds under long random operation sequences") {
  for (BlockLayout layout : {BlockLayout::per_kv_head, BlockLayout::shared_cells})
    for (std::uint32_t bt : {1u, 2u, 4u, 16u}) {
      CAPTURE(int(layout), bt);
      PoolConfig cfg{Geometry{2, 4, 2, 8}, bt, 96 * std::max(1u, bt / 4), layout};
      PagedTables p(cfg);
      std::mt19937 gen(bt * 7 + static_cast<unsigned>(layout));
      std::vector<std::uint32_t> live;
      std::map<std::uint32_t, std::vector<std::int64_t>> next_pos;
      std::size_t exhausted = 0, evictions = 0, appends = 0;
      for (unsigned op = 0; op < 4000u * std::max(1u, bt / 8); ++op) {
        const int kind = static_cast<int>(gen() % 100);
        if (kind < 4 || live.empty()) {  // add
          SequenceBudget b;
          b.blocks = gen() % 8 == 0 ? 0u : 4u + gen() % 4;
          b.sink_blocks = gen() % 2;
          b.recent_blocks = 1 + gen() % 2;
          b.score = static_cast<BlockScore>(gen() % 3);
          b.decay = gen() % 2 ? 1.0f : 0.9f;
          const auto id = p.add_sequence(b);
          REQUIRE(std::find(live.begin(), live.end(), id) == live.end());
          live.push_back(id);
          next_pos[id].assign(static_cast<std::size_t>(cfg.geometry.n_layers), 0);
        } else if (kind < 6) {  // release
          const std::size_t i = gen() % live.size();
          const std::uint32_t before = p.pool().in_use();
          std::size_t held = 0;
          for (int l = 0; l < cfg.geometry.n_layers; ++l)
            for (int g = 0; g < cfg.groups(); ++g) held += p.table(live[i], l, g).size();
          p.release_sequence(live[i]);
          REQUIRE(p.pool().in_use() + held == before);  // nothing leaked
          REQUIRE_FALSE(p.has_sequence(live[i]));
          next_pos.erase(live[i]);
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        } else if (kind < 12) {  // observe
          const auto id = live[gen() % live.size()];
          const int l = static_cast<int>(gen() % 2), g = static_cast<int>(gen() % static_cast<unsigned>(cfg.groups()));
          const std::size_t n = p.tokens(id, l, g);
          if (n == 0) continue;
          std::vector<float> probs(static_cast<std::size_t>(p.query_heads_per_table()) * n);
          for (auto& x : probs) x = std::uniform_real_distribution<float>(0, 1)(gen);
          p.observe(id, l, g, probs);
        } else {  // append
          const auto id = live[gen() % live.size()];
          const int l = static_cast<int>(gen() % 2);
          auto& np = next_pos[id][static_cast<std::size_t>(l)];
          const Snapshot before = snapshot(p, live);
          try {
            const auto events = p.append(id, l, np);
            for (std::size_t i = 0; i < events.size(); ++i) {
              const BlockEvent& e = events[i];
              REQUIRE(e.layer == l);
              if (e.kind != BlockEvent::Kind::evict) continue;
              ++evictions;
              // Back in the pool at once: free now, or the very block the group's new
              // token was placed in.
              REQUIRE(i + 1 < events.size());
              REQUIRE(events[i + 1].kind == BlockEvent::Kind::place);
              REQUIRE(events[i + 1].group == e.group);
              if (p.pool().owner(e.block) != kvevict::BlockAllocator::kFree)
                REQUIRE(events[i + 1].block == e.block);
            }
            ++appends;
            np += 1 + static_cast<std::int64_t>(gen() % 3);
          } catch (const kvevict::Error& e) {
            REQUIRE(std::string(e.what()).find("pool exhausted") != std::string::npos);
            REQUIRE(snapshot(p, live) == before);
            ++exhausted;
            // Preempt, as a server would: release a random sequence.
            const std::size_t i = gen() % live.size();
            p.release_sequence(live[i]);
            next_pos.erase(live[i]);
            live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
          }
        }
        check_accounting(p, live);
      }
      for (auto id : live) p.release_sequence(id);
      REQUIRE(p.pool().in_use() == 0);
      REQUIRE(p.pool().free_blocks() == p.pool().total());
      CHECK(appends > 1000);
      CHECK(evictions > 0);
      CHECK(exhausted > 0);  // the random run reached the pool's limit and recovered
    }
}

TEST_CASE("without observed attention, eviction keeps the sink block and the newest blocks") {
  PagedTables p(PoolConfig{Geometry{1, 2, 1, 4}, 4, 16, BlockLayout::per_kv_head});
  SequenceBudget b;
  b.blocks = 4;
  b.sink_blocks = 1;
  b.recent_blocks = 1;
  const auto id = p.add_sequence(b);
  for (int t = 0; t < 40; ++t) p.append(id, 0, t);
  REQUIRE(p.table(id, 0, 0).size() == 4);
  REQUIRE(p.tokens(id, 0, 0) == 16);
  const auto pos = p.positions(id, 0, 0);
  // sink block 0..3, then the three newest blocks 28..39
  std::vector<std::int64_t> want = {0, 1, 2, 3};
  for (int t = 28; t < 40; ++t) want.push_back(t);
  REQUIRE(std::vector<std::int64_t>(pos.begin(), pos.begin() + 16) == want);
}

TEST_CASE("a block that drew attention survives; the least attended one is evicted") {
  for (BlockScore score : {BlockScore::sum, BlockScore::mean, BlockScore::max}) {
    CAPTURE(kvevict::to_string(score));
    PagedTables p(PoolConfig{Geometry{1, 2, 1, 4}, 2, 16, BlockLayout::per_kv_head});
    SequenceBudget b;
    b.blocks = 4;
    b.sink_blocks = 0;
    b.recent_blocks = 1;
    b.score = score;
    const auto id = p.add_sequence(b);
    for (int t = 0; t < 8; ++t) p.append(id, 0, t);  // four full blocks: 0-1, 2-3, 4-5, 6-7
    // Two query heads: token 1 (block 0) and token 4 (block 2) draw the attention.
    std::vector<float> probs(2 * 8, 0.0f);
    probs[1] = 0.6f;
    probs[8 + 4] = 0.4f;
    p.observe(id, 0, 0, probs);
    const auto events = p.append(id, 0, 8);  // needs a fifth block: evicts block 1 (2-3)
    REQUIRE(events.size() == 2);
    REQUIRE(events[0].kind == BlockEvent::Kind::evict);
    REQUIRE(events[0].tokens == 2);
    const auto pos = p.positions(id, 0, 0);
    REQUIRE(std::vector<std::int64_t>(pos.begin(), pos.begin() + 7) ==
            std::vector<std::int64_t>{0, 1, 4, 5, 6, 7, 8});
  }
}

TEST_CASE("observe: a non-finite probability is an error naming it; scores stay unchanged") {
  // Two identical tables; one is also handed a bad step (NaN, then +inf, in the second of
  // three query heads). Both then see the same good steps and appends: every eviction must
  // match, so the rejected step changed no score. Group sizes 3 (not unrolled) and 1.
  for (BlockLayout layout : {BlockLayout::shared_cells, BlockLayout::per_kv_head}) {
    CAPTURE(static_cast<int>(layout));
    const PoolConfig cfg{Geometry{1, 3, layout == BlockLayout::shared_cells ? 1 : 3, 4}, 2, 64, layout};
    PagedTables a(cfg), b(cfg);
    SequenceBudget budget;
    budget.blocks = 5;
    budget.score = BlockScore::sum;
    budget.decay = 0.9f;
    const auto ia = a.add_sequence(budget), ib = b.add_sequence(budget);
    std::mt19937 gen(11);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    const std::size_t heads = static_cast<std::size_t>(a.query_heads_per_table());
    for (int t = 0; t < 60; ++t) {
      const auto ea = a.append(ia, 0, t);
      const auto eb = b.append(ib, 0, t);
      REQUIRE(ea.size() == eb.size());
      for (std::size_t i = 0; i < ea.size(); ++i) REQUIRE(ea[i].block == eb[i].block);
      for (int g = 0; g < cfg.groups(); ++g) {
        const std::size_t n = a.tokens(ia, 0, g);
        std::vector<float> probs(heads * n);
        for (auto& x : probs) x = u(gen);
        if (t % 7 == 3) {
          auto bad = probs;
          const std::size_t at = std::min(heads - 1, std::size_t{1}) * n + n / 2;
          bad[at] = t % 2 ? std::numeric_limits<float>::infinity() : std::nanf("");
          REQUIRE_THROWS_WITH(a.observe(ia, 0, g, bad),
                              Catch::Contains("observe: probs[" + std::to_string(at) + "]"));
        }
        a.observe(ia, 0, g, probs);
        b.observe(ib, 0, g, probs);
      }
      for (int g = 0; g < cfg.groups(); ++g) {
        const auto pa = a.positions(ia, 0, g), pb = b.positions(ib, 0, g);
        REQUIRE(std::vector<std::int64_t>(pa.begin(), pa.end()) ==
                std::vector<std::int64_t>(pb.begin(), pb.end()));
      }
    }
  }
}

TEST_CASE("shared cells: one table per layer for all KV heads, scores combined over all query heads") {
  PagedTables p(PoolConfig{Geometry{2, 4, 2, 8}, 4, 8, BlockLayout::shared_cells});
  const auto id = p.add_sequence(SequenceBudget::tokens(12, 4, 1, 1));
  REQUIRE(p.budget(id).blocks == 3);
  REQUIRE(p.query_heads_per_table() == 4);
  const auto ev = p.append(id, 1, 0);
  REQUIRE(ev.size() == 1);  // one place for all KV heads of the layer
  REQUIRE(ev[0].group == 0);
  REQUIRE(p.pool().in_use() == 1);
  REQUIRE_THROWS_WITH(p.table(id, 1, 1), Catch::Contains("group = 1"));
}

TEST_CASE("PagedKV stores what was appended, bit for bit, where the table says") {
  for (BlockLayout layout : {BlockLayout::per_kv_head, BlockLayout::shared_cells}) {
    const Geometry g{1, 4, 2, 3};
    PagedKV<float> kv(PoolConfig{g, 2, 8, layout});
    const auto id = kv.add_sequence(SequenceBudget::tokens(8, 2, 1, 1));
    std::mt19937 gen(3);
    std::normal_distribution<float> nd;
    std::map<std::int64_t, std::vector<float>> keys, values;
    for (int t = 0; t < 20; ++t) {
      std::vector<float> k(6), v(6);
      for (auto& x : k) x = nd(gen);
      for (auto& x : v) x = nd(gen);
      keys[t] = k;
      values[t] = v;
      kv.append(id, 0, t, k, v);
    }
    const std::size_t w = kv.row_width();
    for (int grp = 0; grp < kv.config().groups(); ++grp) {
      const auto table = kv.table(id, 0, grp);
      const auto pos = kv.positions(id, 0, grp);
      for (std::size_t i = 0; i < kv.tokens(id, 0, grp); ++i) {
        const float* kr = kv.key_block(table[i / 2]) + (i % 2) * w;
        const float* vr = kv.value_block(table[i / 2]) + (i % 2) * w;
        for (std::size_t j = 0; j < w; ++j) {
          REQUIRE(kr[j] == keys[pos[i]][static_cast<std::size_t>(grp) * w + j]);
          REQUIRE(vr[j] == values[pos[i]][static_cast<std::size_t>(grp) * w + j]);
        }
      }
    }
  }
}

TEST_CASE("bad input is a kvevict::Error naming the value; the pool is unchanged") {
  const Geometry g{2, 4, 2, 8};
  for (std::uint32_t bt : {0u, 3u, 12u, 512u})
    REQUIRE_THROWS_WITH(PagedTables(PoolConfig{g, bt, 8, BlockLayout::per_kv_head}),
                        Catch::Contains("block_tokens = " + std::to_string(bt)) &&
                            Catch::Contains("power of two"));
  REQUIRE_THROWS_WITH(PagedTables(PoolConfig{g, 4, 0, BlockLayout::per_kv_head}),
                      Catch::Contains("blocks = 0"));

  PagedKV<float> p(PoolConfig{g, 2, 6, BlockLayout::per_kv_head});
  SequenceBudget tight;
  tight.blocks = 2;
  tight.sink_blocks = 1;
  tight.recent_blocks = 1;
  REQUIRE_THROWS_WITH(p.add_sequence(tight), Catch::Contains("budget: 2 blocks") &&
                                                  Catch::Contains("expected > 2"));
  SequenceBudget bad_decay;
  bad_decay.decay = 0.0f;
  REQUIRE_THROWS_WITH(p.add_sequence(bad_decay), Catch::Contains("decay = 0"));
  REQUIRE(p.sequences() == 0);

  const auto a = p.add_sequence(SequenceBudget{});  // unbounded
  std::vector<std::uint32_t> seqs{a};
  const std::vector<float> kv(16, 0.5f);
  for (int t = 0; t < 4; ++t) p.append(a, 0, t, kv, kv);  // 2 blocks per KV head: 4 of 6
  require_error_unchanged(p, seqs, [&] { p.append(7, 0, 4, kv, kv); }, "sequence 7 is unknown");
  require_error_unchanged(p, seqs, [&] { p.append(a, 2, 4, kv, kv); }, "layer = 2");
  require_error_unchanged(p, seqs, [&] { p.append(a, 0, 3, kv, kv); }, "position = 3");
  require_error_unchanged(p, seqs, [&] { p.append(a, 0, 9, std::vector<float>(15), kv); },
                          "keys has 15 floats");
  std::vector<float> nan = kv;
  nan[5] = std::nanf("");
  require_error_unchanged(p, seqs, [&] { p.append(a, 0, 9, kv, nan); }, "values[5]");
  require_error_unchanged(p, seqs, [&] { p.observe(a, 0, 0, std::vector<float>(3)); },
                          "probs has 3 floats, expected 8");
  for (int t = 4; t < 6; ++t) p.append(a, 1, t, kv, kv);  // layer 1: 2 more blocks, 6 of 6
  // A full pool: layer 0 needs two new blocks (one per KV head), none free.
  require_error_unchanged(p, seqs, [&] { p.append(a, 0, 4, kv, kv); }, "pool exhausted");
  // A bounded sequence at its budget evicts instead of asking the pool... but cannot start.
  SequenceBudget b3;
  b3.blocks = 3;
  const auto b = p.add_sequence(b3);
  seqs.push_back(b);
  require_error_unchanged(p, seqs, [&] { p.append(b, 0, 0, kv, kv); }, "pool exhausted");
  p.release_sequence(a);
  seqs = {b};
  REQUIRE(p.pool().in_use() == 0);
  require_error_unchanged(p, seqs, [&] { p.release_sequence(a); }, "sequence 0 is unknown");
  REQUIRE_NOTHROW(p.append(b, 0, 0, kv, kv));
  REQUIRE(p.pool().in_use() == 2);
}

// fuzz_paged_pool once asserted that ids stay below 64; a long run added 65 sequences (the
// harness was wrong, the pool right). The pool has no such limit: ids are dense, released
// ids are reused, and a sequence past id 64 works like any other.
TEST_CASE("more sequences than blocks: ids are dense, released ids reused, ids past 64 work") {
  PagedKV<float> p(PoolConfig{Geometry{1, 1, 1, 1}, 1, 4, BlockLayout::per_kv_head});
  for (std::uint32_t i = 0; i < 70; ++i) REQUIRE(p.add_sequence(SequenceBudget{}) == i);
  REQUIRE(p.sequences() == 70);
  p.release_sequence(5);
  p.release_sequence(64);
  const auto x = p.add_sequence(SequenceBudget{}), y = p.add_sequence(SequenceBudget{});
  REQUIRE(std::set<std::uint32_t>{x, y} == std::set<std::uint32_t>{5, 64});
  REQUIRE(p.add_sequence(SequenceBudget{}) == 70);
  REQUIRE(p.sequences() == 71);
  const std::vector<float> kv{0.5f};
  p.append(69, 0, 0, kv, kv);
  REQUIRE(p.tokens(69, 0, 0) == 1);
  REQUIRE(p.pool().owner(p.table(69, 0, 0)[0]) == 69);
  p.release_sequence(69);
  REQUIRE(p.pool().in_use() == 0);
}
