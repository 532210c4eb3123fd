// Metrics against hand-computed values and their edge cases.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <kvevict/metrics.hpp>
#include <limits>
#include <vector>

using namespace kvevict;
namespace m = kvevict::metrics;
using Catch::Contains;
using Kept = std::vector<std::uint8_t>;
using Floats = std::vector<float>;

TEST_CASE("mass_recall sums the kept probabilities", "[metrics]") {
  const Floats a{0.5f, 0.25f, 0.125f, 0.125f};
  CHECK(m::mass_recall(a, Kept{1, 0, 1, 0}) == Approx(0.625));
  CHECK(m::mass_recall(a, Kept{1, 1, 1, 1}) == Approx(1.0));
  CHECK(m::mass_recall(a, Kept{0, 0, 0, 0}) == 0.0);
  CHECK(m::mass_recall(Floats{}, Kept{}) == 0.0);
  CHECK(m::mass_recall(Floats{0.2f, 0.8f}, Kept{0, 7}) == Approx(0.8));  // any non-zero keeps
}

TEST_CASE("output_relative_error by hand", "[metrics]") {
  // a = (0.5, 0.25, 0.25), v = e1, e2, e1 + e2 (d = 2).
  // o = (0.5 + 0.25, 0.25 + 0.25) = (0.75, 0.5).
  const Floats a{0.5f, 0.25f, 0.25f};
  const Floats v{1, 0, 0, 1, 1, 1};
  // Keep rows 0 and 1: weights renormalised to (2/3, 1/3), o_S = (2/3, 1/3).
  // ||o - o_S|| = ||(1/12, 1/6)|| = sqrt(5)/12; ||o|| = sqrt(0.8125).
  const double expect = std::sqrt(5.0) / 12.0 / std::sqrt(0.8125);
  CHECK(m::output_relative_error(a, Kept{1, 1, 0}, v, 2) == Approx(expect).epsilon(1e-6));
  CHECK(m::output_relative_error(a, Kept{1, 1, 1}, v, 2) == Approx(0.0).margin(1e-7));
  // Nothing kept: o_S = 0, error 1 by definition.
  CHECK(m::output_relative_error(a, Kept{0, 0, 0}, v, 2) == Approx(1.0));
  // Keeping only row 2 gives o_S = (1, 1): ||(-0.25, -0.5)|| / ||o||.
  CHECK(m::output_relative_error(a, Kept{0, 0, 1}, v, 2) ==
        Approx(std::sqrt(0.3125) / std::sqrt(0.8125)).epsilon(1e-6));
}

TEST_CASE("output_relative_error with a zero output", "[metrics]") {
  const Floats a{0.5f, 0.5f};
  // o = 0 exactly (v rows cancel); keeping both reproduces it: error 0.
  CHECK(m::output_relative_error(a, Kept{1, 1}, Floats{1, -1}, 1) == 0.0);
  // Keeping one row gives o_S = 1 while o = 0: the relative error is unbounded.
  CHECK(std::isinf(m::output_relative_error(a, Kept{1, 0}, Floats{1, -1}, 1)));
  CHECK(m::output_relative_error(a, Kept{1, 1}, Floats{0, 0}, 1) == 0.0);
}

TEST_CASE("topk_recall by hand, ties to the lower index", "[metrics]") {
  const Floats a{0.1f, 0.4f, 0.2f, 0.3f};
  CHECK(m::topk_recall(a, Kept{0, 1, 0, 1}, 2) == Approx(1.0));  // top-2 = {1, 3}
  CHECK(m::topk_recall(a, Kept{0, 1, 1, 0}, 2) == Approx(0.5));
  CHECK(m::topk_recall(a, Kept{1, 0, 0, 0}, 1) == Approx(0.0));
  CHECK(m::topk_recall(a, Kept{1, 0, 0, 0}, 4) == Approx(0.25));  // k = n: plain fraction
  // Ties: rows 0, 2, 3 share 0.25; top-2 = {1, 0} by the lower-index rule.
  const Floats t{0.25f, 0.5f, 0.25f, 0.25f};
  CHECK(m::topk_recall(t, Kept{1, 1, 0, 0}, 2) == Approx(1.0));
  CHECK(m::topk_recall(t, Kept{0, 1, 1, 1}, 2) == Approx(0.5));
}

TEST_CASE("kl_divergence by hand", "[metrics]") {
  // P = softmax(0, ln 3) = (1/4, 3/4), Q = softmax(0, 0) = (1/2, 1/2).
  const double expect = 0.25 * std::log(0.5) + 0.75 * std::log(1.5);
  CHECK(m::kl_divergence(Floats{0.0f, float(std::log(3.0))}, Floats{0, 0}) ==
        Approx(expect).epsilon(1e-6));
  // Identical distributions, including under a constant shift of the logits.
  CHECK(m::kl_divergence(Floats{1, 2, 3}, Floats{1, 2, 3}) == 0.0);
  CHECK(m::kl_divergence(Floats{1, 2, 3}, Floats{11, 12, 13}) == Approx(0.0).margin(1e-12));
  // Asymmetric: KL(P || Q) != KL(Q || P) in general.
  const double pq = m::kl_divergence(Floats{0, 2}, Floats{0, 0});
  const double qp = m::kl_divergence(Floats{0, 0}, Floats{0, 2});
  CHECK(pq != Approx(qp));
  CHECK(pq > 0.0);
  // Large logits do not overflow (log-softmax in double).
  CHECK(std::isfinite(m::kl_divergence(Floats{1000, 0}, Floats{0, 1000})));
  CHECK(m::kl_divergence(Floats{1000, 0}, Floats{0, 1000}) == Approx(1000.0).epsilon(1e-6));
}

TEST_CASE("top1_agreement, argmax and NLL", "[metrics]") {
  CHECK(m::top1_agreement(Floats{1, 3, 2}, Floats{0, 5, 4}));
  CHECK_FALSE(m::top1_agreement(Floats{1, 3, 2}, Floats{0, 4, 5}));
  CHECK(m::argmax(Floats{2, 7, 7, 1}) == 1);  // ties: lowest index
  CHECK(m::top1_agreement(Floats{2, 7, 7}, Floats{0, 1, 1}));
  // NLL of a uniform over 4 tokens is ln 4; of (0, ln 3) token 1 is -ln(3/4).
  CHECK(m::negative_log_likelihood(Floats{5, 5, 5, 5}, 2) == Approx(std::log(4.0)));
  CHECK(m::negative_log_likelihood(Floats{0.0f, float(std::log(3.0))}, 1) ==
        Approx(-std::log(0.75)).epsilon(1e-6));
  const auto ls = m::log_softmax(Floats{1, 2, 3});
  double total = 0;
  for (double x : ls) total += std::exp(x);
  CHECK(total == Approx(1.0));
}

TEST_CASE("Metrics reject mismatched or empty input with a precise message", "[metrics][errors]") {
  CHECK_THROWS_AS(m::mass_recall(Floats{0.5f, 0.5f}, Kept{1}), kvevict::Error);
  CHECK_THROWS_WITH(m::mass_recall(Floats{0.5f, 0.5f}, Kept{1}),
                    Contains("mass_recall") && Contains("sizes 2 and 1"));
  CHECK_THROWS_WITH(m::output_relative_error(Floats{1}, Kept{1}, Floats{1, 2, 3}, 2),
                    Contains("values has 3 floats, expected 2"));
  CHECK_THROWS_WITH(m::output_relative_error(Floats{1}, Kept{1}, Floats{}, 0),
                    Contains("output_relative_error"));
  CHECK_THROWS_WITH(m::topk_recall(Floats{1, 2}, Kept{1, 1}, 0),
                    Contains("k = 0") && Contains("expected 1 <= k <= 2"));
  CHECK_THROWS_WITH(m::topk_recall(Floats{1, 2}, Kept{1, 1}, 3), Contains("k = 3"));
  CHECK_THROWS_WITH(m::topk_recall(Floats{1, 2}, Kept{1}, 1), Contains("sizes 2 and 1"));
  CHECK_THROWS_WITH(m::kl_divergence(Floats{1, 2}, Floats{1}), Contains("kl_divergence"));
  CHECK_THROWS_WITH(m::kl_divergence(Floats{}, Floats{}), Contains("empty logits"));
  CHECK_THROWS_WITH(m::top1_agreement(Floats{1}, Floats{1, 2}), Contains("top1_agreement"));
  CHECK_THROWS_WITH(m::argmax(Floats{}), Contains("empty logits"));
  CHECK_THROWS_WITH(m::negative_log_likelihood(Floats{1, 2}, 2),
                    Contains("token = 2") && Contains("vocabulary size 2"));
}
