// An engine that owns its K/V memory and asks kvevict only what to drop.
//
// The engine keeps, per layer, a llama.cpp-style cell array: K and V of shape
// [cells][n_kv_heads][head_dim] in fp16, sized to the budget (cells = capacity), plus its
// own attention kernel over those cells. kvevict::IndexCache runs the eviction policy
// (H2O here) over row indices: each token, the engine hands it the new K (and the queries
// and attention probabilities the policy declares) and applies the returned decisions:
// `place` writes the new token into a cell, `evict` frees a cell (here: offload count).
// Usage: kvevict_engine_owned [TOKENS=2000] [BUDGET=256] [--policy NAME] (any bounded
// policy of the registry; default h2o with 32 recent rows and 4 sinks).
#include <Eigen/Core>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <kvevict/index_cache.hpp>
#include <random>
#include <vector>

#include "cli.hpp"
#include "policy_registry.hpp"
#include <fmt/format.h>

namespace {

using Half = Eigen::half;

// The engine's own storage for one layer: cell c, KV head h at (c * Hkv + h) * d.
struct LayerCells {
  std::vector<Half> k, v;
};

// The engine's attention kernel over its cells, in the IndexCache's row order, for the G
// query heads of KV head h; writes probs (G x rows) and accumulates the output.
void attend_cells(const LayerCells& m, std::span<const std::uint32_t> cells, int h, int hkv, int d,
                  const float* q, int group, std::vector<float>& probs, float* out) {
  const std::size_t n = cells.size();
  probs.assign(static_cast<std::size_t>(group) * n, 0.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int g = 0; g < group; ++g) {
    float* p = probs.data() + static_cast<std::size_t>(g) * n;
    float mx = -INFINITY;
    for (std::size_t r = 0; r < n; ++r) {
      const Half* kr =
          m.k.data() + (std::size_t(cells[r]) * std::size_t(hkv) + std::size_t(h)) * std::size_t(d);
      float s = 0.0f;
      for (int j = 0; j < d; ++j) s += q[g * d + j] * static_cast<float>(kr[j]);
      p[r] = s * scale;
      mx = std::max(mx, p[r]);
    }
    float z = 0.0f;
    for (std::size_t r = 0; r < n; ++r) z += (p[r] = std::exp(p[r] - mx));
    for (std::size_t r = 0; r < n; ++r) {
      p[r] /= z;
      const Half* vr =
          m.v.data() + (std::size_t(cells[r]) * std::size_t(hkv) + std::size_t(h)) * std::size_t(d);
      for (int j = 0; j < d; ++j) out[g * d + j] += p[r] * static_cast<float>(vr[j]);
    }
  }
}

template <class Policy>
int run(Policy policy, const kvevict::Budget& budget_rows, int tokens, int budget) {
  const kvevict::Geometry geo{4, 8, 2, 64};  // layers, query heads, KV heads, head dim
  const int hkv = geo.n_kv_heads, d = geo.head_dim, group = geo.group();
  // cells_per_head = budget: IndexCache allocates cells itself (a victim's cell is reused),
  // so the engine never needs more cells than the budget.
  kvevict::IndexCache<Policy, Half> index(geo, budget_rows, std::move(policy),
                                          std::uint32_t(budget));
  const std::size_t cells = index.cells_per_head();
  std::vector<LayerCells> mem(std::size_t(geo.n_layers));
  for (auto& m : mem) {
    m.k.resize(cells * std::size_t(hkv * d));
    m.v.resize(cells * std::size_t(hkv * d));
  }

  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(std::size_t(hkv * d)), v(k.size()), q(std::size_t(geo.n_heads * d)),
      out(q.size()), probs;
  long long evicted = 0, placed = 0;
  for (int pos = 0; pos < tokens; ++pos) {
    for (int l = 0; l < geo.n_layers; ++l) {
      // A model would project the hidden state (and apply RoPE) here.
      for (auto* x : {&k, &v, &q})
        for (auto& f : *x) f = normal(gen);
      auto& m = mem[std::size_t(l)];
      // Where the engine's rows are, for the policy to read during the call.
      const kvevict::CellRows<Half> krows{m.k.data(), std::size_t(hkv * d), std::size_t(d)};
      const kvevict::CellRows<Half> vrows{m.v.data(), std::size_t(hkv * d), std::size_t(d)};
      for (const kvevict::Decision& e : index.append(l, pos, k, krows, q, {}, v, vrows)) {
        if (e.kind == kvevict::Decision::Kind::evict) {
          ++evicted;  // cell e.cell is free now; an engine could offload it first
        } else if (e.kind == kvevict::Decision::Kind::place) {
          ++placed;
          const std::size_t off =
              (std::size_t(e.cell) * std::size_t(hkv) + std::size_t(e.kv_head)) * std::size_t(d);
          for (int j = 0; j < d; ++j) {
            m.k[off + std::size_t(j)] = static_cast<Half>(k[std::size_t(e.kv_head * d + j)]);
            m.v[off + std::size_t(j)] = static_cast<Half>(v[std::size_t(e.kv_head * d + j)]);
          }
        }  // move records only matter to engines that keep rows dense in row order
      }
      // The engine's own attention, then the probabilities (for policies that declare them).
      std::fill(out.begin(), out.end(), 0.0f);
      for (int h = 0; h < hkv; ++h) {
        attend_cells(m, index.cells(l, h), h, hkv, d, q.data() + h * group * d, group, probs,
                     out.data() + h * group * d);
        index.observe(l, h, probs);
      }
    }
  }
  const double bytes = double(geo.n_layers) * double(cells) * hkv * d * 2 * sizeof(Half);
  fmt::print("tokens {}, budget {}, policy {}\n", tokens, budget, Policy::name());
  fmt::print("rows kept per (layer, KV head): {} (layer 0 head 0), cells allocated {}\n",
              index.size(0, 0), cells);
  fmt::print("placed {} rows, evicted {}; engine K/V memory {:.1f} KiB (fp16)\n", placed,
              evicted, bytes / 1024.0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return kvevict::cli::main_guard("kvevict_engine_owned", [&]() -> int {
    using kvevict::cli::Range;
    std::string tokens_text, budget_text, policy = "h2o";
    kvevict::registry::Knobs knobs;
    knobs.h2o_recent = 32;
    knobs.h2o_sinks = 4;
    knobs.rope = kvevict::policies::RopeLayout::none;  // this demo's keys carry no rotation
    kvevict::cli::Parser p(
        "kvevict_engine_owned",
        "An engine with its own fp16 cell array driving a policy via IndexCache.");
    p.positional("TOKENS", "tokens to run (default 2000)", tokens_text);
    p.positional("BUDGET", "rows per layer and KV head = cells (default 256)", budget_text);
    p.custom("--policy", "NAME", "a bounded policy of the registry (default h2o; see --list)",
             [&](const std::string& v) {
               kvevict::registry::check_names({v}, "--policy", false);
               const auto* i = kvevict::registry::find(v);
               if (i->sizing != kvevict::registry::Sizing::budget)
                 throw kvevict::cli::UsageError(
                     "--policy " + v +
                     ": keeps every row, but this engine's cells are sized to the budget");
               policy = v;
             });
    kvevict::registry::add_knob_options(p, knobs);
    p.info("--list", "list the policies, then exit",
           [] { fmt::print("policies:\n{}", kvevict::registry::listing()); });
    if (!p.parse(argc, argv)) return 0;
    const int tokens = tokens_text.empty()
                           ? 2000
                           : kvevict::cli::parse_number<int>("TOKENS", tokens_text, Range<int>{1});
    const int budget = budget_text.empty() ? 256
                                           : kvevict::cli::parse_number<int>(
                                                 "BUDGET", budget_text, Range<int>{1, 1 << 20});
    int rc = 0;
    kvevict::registry::with_policy(
        policy, kvevict::registry::Args{std::size_t(budget), knobs, nullptr},
        [&](auto pol, const kvevict::Budget& b) { rc = run(std::move(pol), b, tokens, budget); });
    return rc;
  });
}
