// Geometry and Budget: validation, GQA group, and how budgets resolve to per-(layer, KV
// head) capacities in a cache.
#include <catch2/catch.hpp>

#include "support/test_support.hpp"

using namespace kvevict;
using Catch::Contains;

TEST_CASE("Geometry validates and reports the GQA group", "[geometry]") {
  const Geometry g{4, 32, 8, 128};
  REQUIRE_NOTHROW(g.validate());
  CHECK(g.group() == 4);
  CHECK(Geometry{1, 8, 8, 64}.group() == 1);
  CHECK(Geometry{1, 8, 1, 64}.group() == 8);
  CHECK(g == Geometry{4, 32, 8, 128});
  CHECK_FALSE(g == Geometry{4, 32, 4, 128});
  CHECK_THROWS_WITH((Geometry{4, 32, 8, 0}.validate()), Contains("head_dim = 0, expected > 0"));
  CHECK_THROWS_WITH((Geometry{-1, 32, 8, 64}.validate()), Contains("n_layers = -1"));
  CHECK_THROWS_WITH((Geometry{1, 0, 8, 64}.validate()), Contains("n_heads = 0"));
  CHECK_THROWS_WITH((Geometry{1, 12, 8, 64}.validate()),
                    Contains("n_heads = 12 is not a multiple of n_kv_heads = 8"));
}

TEST_CASE("Budgets resolve to per-(layer, KV head) capacities", "[geometry][budget]") {
  const Geometry g{3, 4, 2, 8};
  auto caps = [&](const Budget& b) {
    KVCache<policies::StreamingLLM> cache(g, b, policies::StreamingLLM{1});
    std::vector<std::size_t> c;
    for (int l = 0; l < 3; ++l)
      for (int h = 0; h < 2; ++h) {
        c.push_back(cache.capacity(l, h));
        CHECK(cache.shape().at(l, h) == c.back());
      }
    return c;
  };
  using V = std::vector<std::size_t>;
  CHECK(caps(Budget::uniform(7)) == V{7, 7, 7, 7, 7, 7});
  CHECK(caps(Budget::per_layer({2, 5, 9})) == V{2, 2, 5, 5, 9, 9});
  CHECK(caps(Budget::per_head({{2, 3}, {4, 5}, {6, 7}})) == V{2, 3, 4, 5, 6, 7});
  CHECK(caps(Budget::unbounded()) == V(6, Budget::kUnbounded));
  CHECK(Budget::unbounded().is_unbounded());
  CHECK_FALSE(Budget::uniform(3).is_unbounded());
}

TEST_CASE("Ratio budgets round to nearest and keep at least one token", "[geometry][budget]") {
  const Geometry g{1, 1, 1, 1};
  auto cap = [&](const Budget& b) { return b.capacity(0, 0, g.n_kv_heads); };
  CHECK(cap(Budget::ratio(0.25, 1000)) == 250);
  CHECK(cap(Budget::ratio(0.25, 10)) == 3);  // 2.5 rounds away from zero
  CHECK(cap(Budget::ratio(0.24, 10)) == 2);
  CHECK(cap(Budget::ratio(1.0, 17)) == 17);
  CHECK(cap(Budget::ratio(1e-6, 100)) == 1);  // never a zero budget
}

TEST_CASE("Budget::validate checks the shape against the geometry", "[geometry][budget]") {
  const Geometry g{2, 4, 2, 8};
  CHECK_NOTHROW(Budget::uniform(3).validate(g));
  CHECK_NOTHROW(Budget::per_layer({1, 2}).validate(g));
  CHECK_THROWS_WITH(Budget::per_layer({1, 2, 3}).validate(g),
                    Contains("per-layer vector has 3 entries, expected 2 (one per layer)"));
  CHECK_THROWS_WITH(Budget::per_head({{1, 2}, {3}}).validate(g),
                    Contains("row 1 has 1 entries, expected 2 (one per KV head)"));
  CHECK_THROWS_WITH(Budget::per_head({{1, 2}}).validate(g),
                    Contains("per-head table has 1 rows, expected 2"));
}
