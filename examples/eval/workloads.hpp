#pragma once
// Workloads for kvevict-eval: per-layer Q, K, V streams (synthetic or read from a trace)
// that the runner feeds through a KVCache one token at a time.
//
// The synthetic generators build every key and query from a few named components whose
// strengths are given in logit units (the contribution to q.k / sqrt(d)), so a reader
// can judge each workload from its parameters alone. docs/quality.md describes them.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <kvevict/errors.hpp>
#include <kvevict/geometry.hpp>
#include <numbers>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::eval {

/// Q, K, V of one layer, token-major: q is T x H x d, k and v are T x Hkv x d.
struct LayerTrace {
  std::vector<float> q, k, v;
};

/// A key planted at token `needle` of (layer, kv_head) that the query at token `probe`
/// looks for: retrieved when that query's attention (summed over the group) peaks on it.
struct NeedleProbe {
  int layer = 0;
  int kv_head = 0;
  std::size_t needle = 0;
  std::size_t probe = 0;
};

/// A whole stream: `prompt` tokens prefilled, then tokens - prompt decode steps measured.
struct Workload {
  std::string name;
  std::string description;
  Geometry geometry;
  std::size_t tokens = 0;
  std::size_t prompt = 0;
  std::vector<LayerTrace> layers;
  std::vector<NeedleProbe> needles;

  [[nodiscard]] const float* q(int layer, std::size_t t) const {
    return layers[static_cast<std::size_t>(layer)].q.data() +
           t * static_cast<std::size_t>(geometry.n_heads * geometry.head_dim);
  }
  [[nodiscard]] const float* k(int layer, std::size_t t) const {
    return layers[static_cast<std::size_t>(layer)].k.data() +
           t * static_cast<std::size_t>(geometry.n_kv_heads * geometry.head_dim);
  }
  [[nodiscard]] const float* v(int layer, std::size_t t) const {
    return layers[static_cast<std::size_t>(layer)].v.data() +
           t * static_cast<std::size_t>(geometry.n_kv_heads * geometry.head_dim);
  }

  /// Checks sizes and that the prompt leaves at least one decode step.
  void validate() const {
    geometry.validate();
    detail::require(tokens >= 2, "workload ", name, ": tokens = ", tokens, ", expected >= 2");
    detail::require(prompt < tokens, "workload ", name, ": prompt = ", prompt,
                    " tokens, expected < tokens = ", tokens, " (at least one decode step)");
    detail::require(layers.size() == static_cast<std::size_t>(geometry.n_layers), "workload ", name,
                    ": ", layers.size(), " layers of data, expected ", geometry.n_layers);
    const std::size_t d = static_cast<std::size_t>(geometry.head_dim);
    for (const auto& l : layers) {
      detail::require(
          l.q.size() == tokens * static_cast<std::size_t>(geometry.n_heads) * d &&
              l.k.size() == tokens * static_cast<std::size_t>(geometry.n_kv_heads) * d &&
              l.v.size() == l.k.size(),
          "workload ", name, ": layer data does not match ", tokens, " tokens");
    }
    for (const auto& n : needles)
      detail::require(n.layer >= 0 && n.layer < geometry.n_layers && n.kv_head >= 0 &&
                          n.kv_head < geometry.n_kv_heads && n.needle < n.probe &&
                          n.probe < tokens && n.probe >= prompt,
                      "workload ", name, ": needle probe out of range");
  }
};

/// Parameters of the synthetic generators. Strengths are in logit units: the amount a
/// component adds to q.k / sqrt(d) for the tokens that carry it.
struct SyntheticConfig {
  // Llama-like shape: Llama-2/3 use head dim 128 and GQA with 8 KV heads of 4 queries.
  int layers = 2;
  int n_heads = 32;
  int n_kv_heads = 8;
  int head_dim = 128;
  std::size_t prompt = 256;  ///< tokens prefilled before the measured decode steps
  std::size_t steps = 768;   ///< decode steps (tokens after the prompt)
  std::uint64_t seed = 1;

  float noise = 1.0f;  ///< std of the logit between unrelated query and key
  // Sinks: token 0 lacks the key bias every other key carries (queries are anti-aligned
  // with it), tokens 1..3 carry half of it.
  float sink_boost = 6.0f;
  // Recency: RoPE-like rotating pairs; the kernel is `recency_boost` at distance 0 and
  // fades over about recency_period tokens (periods geometric from 8 to recency_period).
  float recency_boost = 4.0f;
  float recency_period = 256.0f;
  // Persistent heavy hitters: each token (after the sinks) is one with this probability;
  // every query of the head attends to them.
  float heavy_fraction = 0.02f;
  float heavy_boost = 4.0f;
  // Needles: planted in the prompt, probed once at a late decode step by every query head
  // of the group at full strength; needles with an even index are also asked once in the
  // prompt's last 8 tokens (a question at the end of the prompt).
  int needles_per_head = 2;
  float needle_boost = 16.0f;
  // Drifting topics: segments of about topic_segment tokens, each on one of `topics`
  // directions (revisits allowed), cross-faded over topic_fade tokens.
  int topics = 8;
  float topic_boost = 3.0f;
  std::size_t topic_segment = 64;
  std::size_t topic_fade = 16;

  [[nodiscard]] std::size_t tokens() const { return prompt + steps; }
};

/// The built-in synthetic workloads, in report order. "mixed" is the default.
inline const std::vector<std::string>& synthetic_workload_names() {
  static const std::vector<std::string> names{"mixed", "sinks",  "recency",
                                              "heavy", "needle", "drift"};
  return names;
}

namespace detail {

enum Component : unsigned {
  kSinks = 1u << 0,
  kRecency = 1u << 1,
  kHeavy = 1u << 2,
  kNeedles = 1u << 3,
  kTopics = 1u << 4,
};

// Component set of (layer, kv head) for a workload. "mixed" gives each KV head a role,
// as real models have local, heavy-hitter, retrieval and topical heads side by side.
inline unsigned components_of(std::string_view workload, int layer, int kv_head, int n_kv_heads) {
  if (workload == "sinks") return kSinks;
  if (workload == "recency") return kSinks | kRecency;
  if (workload == "heavy") return kSinks | kHeavy;
  if (workload == "needle") return kSinks | kRecency | kNeedles;
  if (workload == "drift") return kSinks | kTopics;
  static constexpr unsigned roles[4] = {kRecency, kHeavy, kRecency | kNeedles, kTopics};
  return kSinks | roles[(layer * n_kv_heads + kv_head) % 4];
}

inline std::uint64_t mix_seed(std::uint64_t seed, std::uint64_t a, std::uint64_t b) {
  std::uint64_t z = seed ^ (0x9E3779B97F4A7C15ull * (a + 1)) ^ (0xC2B2AE3D27D4EB4Full * (b + 1));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A random unit vector supported on dims [lo, d).
inline std::vector<float> random_direction(std::mt19937_64& rng, int lo, int d) {
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> e(static_cast<std::size_t>(d), 0.0f);
  double s = 0.0;
  for (int i = lo; i < d; ++i) {
    e[static_cast<std::size_t>(i)] = n01(rng);
    s += static_cast<double>(e[static_cast<std::size_t>(i)]) * e[static_cast<std::size_t>(i)];
  }
  const auto inv = static_cast<float>(1.0 / std::sqrt(s));
  for (auto& x : e) x *= inv;
  return e;
}

inline void axpy(float a, const std::vector<float>& x, float* y) {
  for (std::size_t i = 0; i < x.size(); ++i) y[i] += a * x[i];
}

}  // namespace detail

/// Generates one of synthetic_workload_names(). Deterministic in (name, config).
///
/// Layout of a head's d dims (d >= 64): [0, d/16) the key-bias direction (sinks),
/// [d/16, d/16 + d/4) the rotating position pairs (recency), the rest carries content
/// directions (heavy hitters, needles, topics: random unit vectors, nearly orthogonal).
/// Every key and query also carries isotropic Gaussian noise. A component of strength s
/// puts amplitude sqrt(s) * d^(1/4) on both the key and the query side, so it adds s to
/// q.k / sqrt(d). Each of the G query heads of a group scales its components by its own
/// factor in [0.75, 1.25]; heavy-hitter attention also varies per step in [0.5, 1.5].
/// Values are N(0, 1) per dim for every token.
inline Workload make_synthetic(const std::string& name, const SyntheticConfig& c) {
  const auto& names = synthetic_workload_names();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    kvevict::detail::fail("unknown synthetic workload '", name, "', expected one of: ", list);
  }
  kvevict::detail::require(c.head_dim >= 64 && c.head_dim % 16 == 0,
                           "synthetic workload: head_dim = ", c.head_dim,
                           ", expected a multiple of 16 and >= 64");
  kvevict::detail::require(c.prompt >= 16, "synthetic workload: prompt = ", c.prompt,
                           " tokens, expected >= 16 (needles are planted in the prompt)");
  kvevict::detail::require(c.steps >= 8, "synthetic workload: steps = ", c.steps,
                           ", expected >= 8");
  kvevict::detail::require(c.topics >= 2 && c.topic_segment >= 2 && c.topic_fade >= 1,
                           "synthetic workload: topics >= 2, topic_segment >= 2 and "
                           "topic_fade >= 1 expected");
  Workload w;
  w.name = name;
  w.geometry = Geometry{c.layers, c.n_heads, c.n_kv_heads, c.head_dim};
  w.geometry.validate();
  w.tokens = c.tokens();
  w.prompt = c.prompt;
  w.description = "synthetic '" + name + "', seed " + std::to_string(c.seed);

  const int d = c.head_dim, hkv = c.n_kv_heads, G = w.geometry.group();
  const std::size_t T = w.tokens, ud = static_cast<std::size_t>(d);
  const int bias_dims = d / 16, pos_lo = bias_dims, pairs = d / 8, content_lo = pos_lo + 2 * pairs;
  const float root = std::sqrt(std::sqrt(static_cast<float>(d)));
  auto amp = [&](float strength) { return std::sqrt(std::max(strength, 0.0f)) * root; };
  // Noise: key N(0,1), query N(0, noise^2) per dim, so their logit has std `noise`.
  std::vector<float> bias(ud, 0.0f);
  for (int i = 0; i < bias_dims; ++i)
    bias[static_cast<std::size_t>(i)] = 1.0f / std::sqrt(float(bias_dims));
  std::vector<double> omega(static_cast<std::size_t>(pairs));
  for (int j = 0; j < pairs; ++j) {
    const double period =
        8.0 * std::pow(std::max(1.0, c.recency_period / 8.0), double(j) / std::max(1, pairs - 1));
    omega[static_cast<std::size_t>(j)] = 2.0 * std::numbers::pi / period;
  }

  w.layers.resize(static_cast<std::size_t>(c.layers));
  for (int l = 0; l < c.layers; ++l) {
    auto& L = w.layers[static_cast<std::size_t>(l)];
    L.q.assign(T * static_cast<std::size_t>(c.n_heads) * ud, 0.0f);
    L.k.assign(T * static_cast<std::size_t>(hkv) * ud, 0.0f);
    L.v.assign(L.k.size(), 0.0f);
    for (int kh = 0; kh < hkv; ++kh) {
      std::mt19937_64 rng(
          detail::mix_seed(c.seed, static_cast<std::uint64_t>(l), static_cast<std::uint64_t>(kh)));
      std::normal_distribution<float> n01(0.0f, 1.0f);
      std::uniform_real_distribution<float> u01(0.0f, 1.0f);
      const unsigned comp = detail::components_of(name, l, kh, hkv);
      auto kp = [&](std::size_t t) { return L.k.data() + (t * hkv + kh) * ud; };
      auto vp = [&](std::size_t t) { return L.v.data() + (t * hkv + kh) * ud; };
      auto qp = [&](std::size_t t, int g) {
        return L.q.data() + (t * static_cast<std::size_t>(c.n_heads) + kh * G + g) * ud;
      };
      // Per-query-head scale of each component: the group agrees, not identically.
      std::vector<std::array<float, 5>> scale(static_cast<std::size_t>(G));
      for (auto& s : scale)
        for (auto& x : s) x = 0.75f + 0.5f * u01(rng);

      for (std::size_t t = 0; t < T; ++t) {
        for (std::size_t i = 0; i < ud; ++i) kp(t)[i] = n01(rng);
        for (std::size_t i = 0; i < ud; ++i) vp(t)[i] = n01(rng);
        for (int g = 0; g < G; ++g)
          for (std::size_t i = 0; i < ud; ++i) qp(t, g)[i] = c.noise * n01(rng);
      }
      // Sinks: every key but the first carries the bias; queries are anti-aligned with it.
      if (comp & detail::kSinks) {
        const float a = amp(c.sink_boost);
        for (std::size_t t = 1; t < T; ++t) detail::axpy(t < 4 ? 0.5f * a : a, bias, kp(t));
        for (std::size_t t = 0; t < T; ++t)
          for (int g = 0; g < G; ++g)
            detail::axpy(-a * scale[static_cast<std::size_t>(g)][0], bias, qp(t, g));
      }
      if (comp & detail::kRecency) {
        const float a = amp(c.recency_boost) / std::sqrt(static_cast<float>(pairs));
        for (std::size_t t = 0; t < T; ++t) {
          for (int j = 0; j < pairs; ++j) {
            const double ph = omega[static_cast<std::size_t>(j)] * static_cast<double>(t);
            const auto cs = static_cast<float>(std::cos(ph)), sn = static_cast<float>(std::sin(ph));
            const std::size_t i0 = static_cast<std::size_t>(pos_lo + 2 * j);
            kp(t)[i0] += a * cs;
            kp(t)[i0 + 1] += a * sn;
            for (int g = 0; g < G; ++g) {
              const float s = scale[static_cast<std::size_t>(g)][1];
              qp(t, g)[i0] += s * a * cs;
              qp(t, g)[i0 + 1] += s * a * sn;
            }
          }
        }
      }
      if (comp & detail::kHeavy) {
        const auto e = detail::random_direction(rng, content_lo, d);
        const float a = amp(c.heavy_boost);
        for (std::size_t t = 4; t < T; ++t)
          if (u01(rng) < c.heavy_fraction) detail::axpy(a * (0.75f + 0.5f * u01(rng)), e, kp(t));
        for (std::size_t t = 0; t < T; ++t) {
          const float step = 0.5f + u01(rng);
          for (int g = 0; g < G; ++g)
            detail::axpy(a * step * scale[static_cast<std::size_t>(g)][2], e, qp(t, g));
        }
      }
      if (comp & detail::kTopics) {
        std::vector<std::vector<float>> topic;
        for (int i = 0; i < c.topics; ++i)
          topic.push_back(detail::random_direction(rng, content_lo, d));
        const float a = amp(c.topic_boost);
        std::size_t cur = 0, prev = 0, seg_start = 0;
        std::size_t seg_len = c.topic_segment / 2 + rng() % (c.topic_segment + 1);
        std::vector<float> dir(ud);
        for (std::size_t t = 0; t < T; ++t) {
          if (t - seg_start >= seg_len) {
            prev = cur;
            cur = (cur + 1 + rng() % static_cast<std::size_t>(c.topics - 1)) %
                  static_cast<std::size_t>(c.topics);
            seg_start = t;
            seg_len = c.topic_segment / 2 + rng() % (c.topic_segment + 1);
          }
          const std::size_t into = t - seg_start;
          const float wt = (t < c.topic_fade || into >= c.topic_fade)
                               ? 1.0f
                               : float(into + 1) / float(c.topic_fade);
          double n2 = 0.0;
          for (std::size_t i = 0; i < ud; ++i) {
            dir[i] = wt * topic[cur][i] + (1.0f - wt) * topic[prev][i];
            n2 += static_cast<double>(dir[i]) * dir[i];
          }
          const auto inv = static_cast<float>(1.0 / std::sqrt(n2));
          detail::axpy(a * inv, dir, kp(t));
          for (int g = 0; g < G; ++g)
            detail::axpy(a * inv * scale[static_cast<std::size_t>(g)][3], dir, qp(t, g));
        }
      }
      if (comp & detail::kNeedles) {
        const float a = amp(c.needle_boost);
        const std::size_t late = T - std::max<std::size_t>(1, c.steps / 4);
        std::vector<std::size_t> used_needles, used_probes;
        for (int i = 0; i < c.needles_per_head; ++i) {
          std::size_t at, probe;
          do at = 4 + rng() % (c.prompt - 12);
          while (std::count(used_needles.begin(), used_needles.end(), at));
          do probe = late + rng() % (T - late);
          while (std::count(used_probes.begin(), used_probes.end(), probe) &&
                 used_probes.size() < T - late);
          used_needles.push_back(at);
          used_probes.push_back(probe);
          const auto e = detail::random_direction(rng, content_lo, d);
          detail::axpy(a, e, kp(at));
          for (int g = 0; g < G; ++g) detail::axpy(a, e, qp(probe, g));
          if (i % 2 == 0) {
            const std::size_t ask = c.prompt - 1 - rng() % 8;
            for (int g = 0; g < G; ++g) detail::axpy(a, e, qp(ask, g));
          }
          w.needles.push_back(NeedleProbe{l, kh, at, probe});
        }
      }
    }
  }
  w.validate();
  return w;
}

}  // namespace kvevict::eval
