#pragma once
// Continuous batching over one fixed BlockPool: requests wait in a FIFO queue; a request
// is admitted when the pool's unreserved blocks cover its worst-case footprint (for every
// (layer, KV head): ceil(min(capacity, tokens) / block_tokens) blocks), so a running
// sequence can never hit "pool exhausted" and nothing is preempted. Each scheduler step
// feeds one token to every running sequence; a finished sequence releases its blocks to
// the pool at once and the queue is admitted again.
//
// Every request is a token stream sampled from the full model with its full-cache logits
// (e2e.hpp's protocol): the sequence is teacher-forced on the stream and KL(full || served)
// of every next-token distribution is recorded, so every configuration is compared with
// the full cache on the same tokens.
#include <fmt/format.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "e2e.hpp"
#include "kvevict/metrics.hpp"
#include "pooled_store.hpp"

namespace kvevict::serving {

/// One request: the first `tokens` tokens of `stream` (teacher-forced).
struct Request {
  const llama2c::Stream* stream = nullptr;
  std::size_t tokens = 0;
};

struct ServeOptions {
  std::uint32_t pool_blocks = 2560;
  std::uint32_t block_tokens = 16;
  std::string label;  ///< shown in the progress line
  bool progress = true;
};

/// What one serving run measured.
struct ServeResult {
  std::size_t footprint_max = 0;   ///< largest reserved blocks of one request
  std::size_t max_concurrent = 0;  ///< most sequences running at once
  double mean_concurrent = 0.0;    ///< running sequences averaged over scheduler steps
  std::size_t peak_blocks = 0;     ///< most pool blocks in use at once (after any token)
  std::size_t steps = 0;           ///< scheduler steps
  std::size_t tokens = 0;          ///< tokens fed, all requests
  double cpu_seconds = 0.0;        ///< serving loop, process CPU time, KL bookkeeping excluded
  double wall_seconds = 0.0;       ///< the same, wall clock
  std::vector<double> kl;          ///< per request: mean KL(full || served) over its positions
};

inline double cpu_now() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
inline double wall_now() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// Serves `requests` with `policy` under `budget` (per sequence) from one pool of
/// options.pool_blocks blocks whose rows are stored as Scalar (float, Eigen::half or a
/// quantized format of quantized.hpp). Throws kvevict::Error when one request alone needs more
/// blocks than the pool has, or when the pool's accounting breaks (a block leaked or
/// held past the reservation).
template <class Policy, class Scalar = float>
ServeResult serve(const std::shared_ptr<const llama2c::Model>& model,
                  std::span<const Request> requests, const Budget& budget, const Policy& policy,
                  const ServeOptions& options) {
  using Tf = llama2c::Transformer<Pooled<Policy, Scalar>>;
  const Geometry g = model->config().geometry();
  BlockPool<Scalar> pool(options.pool_blocks, options.block_tokens, g.head_dim);
  const std::size_t B = options.block_tokens;

  struct Running {
    std::unique_ptr<Tf> tf;
    std::size_t request = 0;
    std::size_t t = 0;
    std::size_t reserved = 0;
    double kl_sum = 0.0;
  };
  // The worst case of a sequence over `tokens` tokens: every head at min(capacity, tokens).
  auto footprint = [&](const PagedCache<Policy, Scalar>& c, std::size_t tokens) {
    std::size_t blocks = 0;
    for (int l = 0; l < g.n_layers; ++l)
      for (int h = 0; h < g.n_kv_heads; ++h)
        blocks += (std::min(c.capacity(l, h), tokens) + B - 1) / B;
    return blocks;
  };

  ServeResult res;
  res.kl.assign(requests.size(), 0.0);
  std::deque<std::size_t> queue;
  for (std::size_t i = 0; i < requests.size(); ++i) queue.push_back(i);
  std::vector<Running> running;
  std::unique_ptr<Tf> next;  // the queue head, constructed (it holds no blocks yet)
  std::size_t next_blocks = 0, reserved = 0, done = 0, concurrent_sum = 0;
  const bool tty = isatty(fileno(stderr)) != 0;
  double kl_cpu = 0.0, kl_wall = 0.0, last_print = 0.0;
  const double cpu0 = cpu_now(), wall0 = wall_now();

  while (!queue.empty() || !running.empty()) {
    // Admit from the queue head while its worst case fits the unreserved blocks.
    while (!queue.empty()) {
      const std::size_t r = queue.front();
      if (!next) {
        next = std::make_unique<Tf>(
            model, budget, Pooled<Policy, Scalar>{policy, &pool, static_cast<std::uint32_t>(r)});
        next_blocks = footprint(next->cache().paged(), requests[r].tokens);
        res.footprint_max = std::max(res.footprint_max, next_blocks);
        kvevict::detail::require(next_blocks <= pool.allocator().total(), "serve: request ", r,
                                 " needs ", next_blocks, " blocks at worst, the pool has ",
                                 pool.allocator().total(), " (expected a larger --pool-blocks)");
      }
      if (reserved + next_blocks > pool.allocator().total()) break;
      reserved += next_blocks;
      running.push_back(Running{std::move(next), r, 0, next_blocks, 0.0});
      queue.pop_front();
    }
    // One token for every running sequence.
    for (auto& s : running) {
      const auto& req = requests[s.request];
      const auto logits = s.tf->forward(req.stream->tokens[s.t], static_cast<int>(s.t));
      res.peak_blocks = std::max<std::size_t>(res.peak_blocks, pool.allocator().in_use());
      const double c0 = cpu_now(), w0 = wall_now();
      s.kl_sum += metrics::kl_divergence(req.stream->logits(s.t), logits);
      kl_cpu += cpu_now() - c0;
      kl_wall += wall_now() - w0;
      ++s.t;
    }
    ++res.steps;
    concurrent_sum += running.size();
    res.max_concurrent = std::max(res.max_concurrent, running.size());
    kvevict::detail::require(pool.allocator().in_use() <= reserved, "serve: ",
                             pool.allocator().in_use(), " blocks in use, expected <= the ",
                             reserved, " reserved");
    // Retire finished sequences: their blocks go back to the pool now.
    for (std::size_t i = 0; i < running.size();) {
      auto& s = running[i];
      if (s.t < requests[s.request].tokens) {
        ++i;
        continue;
      }
      const std::size_t held = s.tf->cache().paged().blocks_in_use();
      const std::uint32_t before = pool.allocator().in_use();
      res.tokens += s.t;
      res.kl[s.request] = s.kl_sum / static_cast<double>(s.t);
      s.tf.reset();
      kvevict::detail::require(before - pool.allocator().in_use() == held, "serve: request ",
                               s.request, " held ", held, " blocks but released ",
                               before - pool.allocator().in_use());
      reserved -= s.reserved;
      ++done;
      running[i] = std::move(running.back());
      running.pop_back();
    }
    if (options.progress) {
      const double now = wall_now();
      if (now - last_print > (tty ? 0.25 : 5.0) || (queue.empty() && running.empty())) {
        last_print = now;
        const double cpu = cpu_now() - cpu0 - kl_cpu;
        std::size_t fed = res.tokens;
        for (const auto& s : running) fed += s.t;
        fmt::print(stderr, "{}[{}] done {}/{}  running {}  queued {}  blocks {}/{}  {:.0f} tok/s{}",
                   tty ? "\r" : "", options.label, done, requests.size(), running.size(),
                   queue.size(), pool.allocator().in_use(), pool.allocator().total(),
                   cpu > 0 ? static_cast<double>(fed) / cpu : 0.0, tty ? "   " : "\n");
        std::fflush(stderr);
      }
    }
  }
  if (options.progress && tty) fmt::print(stderr, "\n");
  res.cpu_seconds = cpu_now() - cpu0 - kl_cpu;
  res.wall_seconds = wall_now() - wall0 - kl_wall;
  res.mean_concurrent =
      res.steps ? static_cast<double>(concurrent_sum) / static_cast<double>(res.steps) : 0.0;
  kvevict::detail::require(pool.allocator().in_use() == 0, "serve: ", pool.allocator().in_use(),
                           " blocks still in use after every request finished, expected 0");
  return res;
}

}  // namespace kvevict::serving
