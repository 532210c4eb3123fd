#pragma once
// Pieces the policies share: protection by arrival order, per-row side columns that
// follow their rows, and "evict the `need` lowest-ranked eligible rows".
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../bytes.hpp"
#include "../checked.hpp"
#include "../kernels/key_signature.hpp"
#include "../kernels/masked_victim.hpp"
#include "../kernels/select.hpp"
#include "../errors.hpp"
#include "../policy.hpp"

namespace kvevict::policies {

/// How the engine applies rotary position embedding to queries and keys (ExpectedAttention's
/// expected logits; DecayedAttention's key signatures).
enum class RopeLayout {
  none,         ///< no RoPE (or queries and keys are passed un-rotated)
  interleaved,  ///< pairs (2i, 2i+1), as llama2.c / Meta's reference Llama code
  halves,       ///< pairs (i, i + d/2), as Hugging Face transformers / GPT-NeoX
};

/// What a prefill block on a layer that already holds rows does (chunked prefill), for the
/// policies with a prompt selection (SnapKV and its per-layer forms; HashEvict).
enum class ChunkedPrefill {
  reselect,     ///< select again from the held rows plus the block (SnapKV's default)
  first_chunk,  ///< only a layer's first block is selected; later ones take the decode rule
};

}  // namespace kvevict::policies

namespace kvevict::policies::detail {

/// std::llround(x) (halves away from zero) without the library call: for |x| < 2^52 the
/// truncation and the fraction x - trunc(x) are exact, so the result is the same; larger
/// values (already integers) and NaN take std::llround itself.
inline std::int64_t llround_exact(double x) {
  if (!(std::fabs(x) < 4503599627370496.0)) return std::llround(x);
  const std::int64_t q = static_cast<std::int64_t>(x);  // truncates toward zero
  const double f = x - static_cast<double>(q);
  // Branch-free (the signature's fractions are unpredictable): f is in (-1, 1).
  return q + static_cast<std::int64_t>(f >= 0.5) - static_cast<std::int64_t>(f <= -0.5);
}

/// FNV-1a over the 8 bytes of u, least significant first (byte-serial FNV-1a's result for
/// the word), without a step per zero byte: a zero byte leaves the XOR unchanged, so the run
/// of zero bytes above u's highest set byte is one multiply by the prime's power. Small
/// non-negative words (the signature's usual values) take one XOR and one multiply.
inline std::uint64_t fnv1a_word(std::uint64_t h, std::uint64_t u) {
  constexpr std::uint64_t prime = 1099511628211ull;
  constexpr auto powers = [] {
    std::array<std::uint64_t, 9> p{};
    p[0] = 1;
    for (std::size_t i = 1; i < p.size(); ++i) p[i] = p[i - 1] * prime;
    return p;
  }();
  if (u < 256) return (h ^ u) * powers[8];  // u = 0 included: h * prime^8
  const auto bytes = static_cast<std::size_t>((std::bit_width(u) + 7) / 8);
  for (std::size_t b = 0; b < bytes; ++b, u >>= 8) {
    h ^= u & 0xffu;
    h *= prime;
  }
  return h * powers[8 - bytes];
}

/// The kernels' name of a RoPE layout.
inline kernels::KeyPairs key_pairs(RopeLayout rope) {
  return rope == RopeLayout::none          ? kernels::KeyPairs::none
         : rope == RopeLayout::halves      ? kernels::KeyPairs::halves
                                           : kernels::KeyPairs::interleaved;
}

/// A position-free signature of a stored key: RoPE rotates each pair of coordinates by an
/// angle that depends on the position, which leaves the pair's length unchanged. So the
/// lengths of the d / 2 rotated pairs as shares of the key's norm, and the log of the norm,
/// each divided by `step` and rounded to the nearest integer (halves away from zero, as
/// std::llround), are the same for two keys that differ only in position (the same token in
/// the same context, repeated), and hashed into 64 bits: FNV-1a over the 8 little-endian
/// bytes of each rounded value (int64, two's complement), the log's first. With
/// RopeLayout::none (no rotation) the coordinates themselves, as shares of the norm, are
/// rounded. The values are kernels::signature_values' (its file comment defines them:
/// the norm and the pair lengths are IEEE double roots of sums of exact squares in a fixed
/// order; std::hypot's until stop 41). A zero key has signature 0; d must be even unless
/// `rope` is none.
inline std::uint64_t key_signature(const float* k, std::size_t d, RopeLayout rope, float step) {
  constexpr std::size_t kStack = 257;  // 1 + 256 values: head_dim 512 with pairs, 256 without
  double stack[kStack];
  std::int64_t rounded[kStack];
  std::vector<double> heap;
  std::vector<std::int64_t> heap_rounded;
  double* v = stack;
  std::int64_t* q = rounded;
  if (1 + d > kStack) {
    heap.resize(1 + d);
    heap_rounded.resize(1 + d);
    v = heap.data();
    q = heap_rounded.data();
  }
  const std::size_t n = kernels::signature_values(k, d, key_pairs(rope), step, v);
  if (n == 0) return 0;
  // The roundings first (independent of each other), then the hash chain.
  for (std::size_t i = 0; i < n; ++i) q[i] = llround_exact(v[i]);
  std::uint64_t h = 14695981039346656037ull;
  for (std::size_t i = 0; i < n; ++i) h = fnv1a_word(h, static_cast<std::uint64_t>(q[i]));
  return h;
}

/// check_budget of the policies that never evict (FullCache, Oracle): every capacity must
/// be unbounded. `what` names the budget in the message, `why` says why it must be so.
inline void require_unbounded(const CacheShape& shape, const char* what, const char* why) {
  for (std::size_t c : shape.capacity)
    kvevict::detail::require(c == Budget::kUnbounded, what, " of ", c,
                             " tokens, expected Budget::unbounded() (", why, ")");
}

/// A named configuration value (for messages and saved state).
using Field = std::pair<const char*, std::uint64_t>;

/// min_capacity of a policy that protects the rows `parts` count: their sum + 1 (one slot
/// to evict), or a kvevict::Error naming every part when that overflows size_t.
inline std::size_t protected_plus_one(const char* policy, std::initializer_list<Field> parts) {
  std::size_t sum = 1;
  bool overflow = false;
  for (const auto& [name, v] : parts) overflow |= __builtin_add_overflow(sum, v, &sum);
  if (overflow) {
    std::string named;
    for (const auto& [name, v] : parts)
      named += std::string(named.empty() ? "" : ", ") + name + " = " + std::to_string(v);
    kvevict::detail::fail(policy, ": ", named, ": protected rows + 1 overflow size_t, expected a sum < ",
                          std::numeric_limits<std::size_t>::max());
  }
  return sum;
}

/// Saved state of a policy whose state is only its configuration (StreamingLLM, KNorm,
/// HashEvict, Oracle: their side data is rebuilt from the rows): the values in order.
inline void save_config(std::vector<std::uint8_t>& out, const std::vector<Field>& fields) {
  kvevict::detail::ByteWriter w(out);
  for (const auto& f : fields) w.put<std::uint64_t>(f.second);
}
/// Reads what save_config wrote and requires it to equal `fields` (a save from a
/// differently configured policy would decide differently after the restore).
inline void check_config(std::span<const std::uint8_t> in, const char* policy,
                         const std::vector<Field>& fields) {
  kvevict::detail::ByteReader r(in);
  for (const auto& [name, want] : fields) {
    const auto got = r.get<std::uint64_t>(name);
    kvevict::detail::require(got == want, policy, " state: saved with ", name, " = ", got,
                             ", expected ", name, " = ", want, " (this cache's configuration)");
  }
  kvevict::detail::require(r.remaining() == 0, policy, " state: ", r.remaining(),
                           " trailing bytes");
}

/// Sinks are the first `sinks` tokens ever appended to the layer; the recent window is
/// the `recent` tokens that arrived just before the incoming one. Both use arrival index
/// (seq), so they do not depend on the engine's positions or on row order.
struct Protection {
  std::size_t sinks = 0;
  std::size_t recent = 0;
  /// Wrap-safe: compares the distance incoming_seq - seq with `recent` (seq + recent
  /// could wrap for recent near 2^64); a seq at or after the incoming one counts as recent.
  [[nodiscard]] bool is_protected(std::uint64_t seq, std::uint64_t incoming_seq) const {
    return seq < sinks || seq >= incoming_seq || incoming_seq - seq <= recent;
  }
};

/// Recent rows protected in a head of `capacity` rows: max(recent, floor(fraction x
/// capacity)), the fraction's share capped so that one row stays evictable after the sinks
/// (an absolute `recent` is never lowered: min_capacity() covers it). Unbounded: `recent`.
inline std::size_t recent_rows(std::size_t recent, float fraction, std::size_t sinks,
                               std::size_t capacity) {
  if (capacity == Budget::kUnbounded) return recent;
  std::size_t r = std::max(recent, static_cast<std::size_t>(fraction * static_cast<float>(capacity)));
  if (r > recent && capacity > sinks) r = std::min(r, std::max(recent, capacity - sinks - 1));
  return r;
}

/// Throws kvevict::Error unless `value` is a finite fraction in [0, 1).
inline void require_fraction(const char* policy, const char* field, float value) {
  kvevict::detail::require(std::isfinite(value) && value >= 0.0f && value < 1.0f, policy, ": ",
                           field, " = ", value, ", expected in [0, 1)");
}

/// One value per live row of every (layer, KV head), moved in lockstep with the rows.
template <class T>
class RowColumn {
 public:
  void bind(const CacheShape& shape) {
    n_kv_heads_ = shape.geometry.n_kv_heads;
    cols_.assign(shape.capacity.size(), {});
  }
  std::vector<T>& of(int layer, int kv_head) { return cols_[index(layer, kv_head)]; }
  const std::vector<T>& of(int layer, int kv_head) const { return cols_[index(layer, kv_head)]; }
  void set(int layer, int kv_head, std::size_t row, T value) {
    auto& c = of(layer, kv_head);
    if (c.size() == row) {  // the usual append: one entry more
      c.push_back(std::move(value));
      return;
    }
    c.resize(row + 1);  // row is the last live row: drop stale entries beyond it
    c[row] = std::move(value);
  }
  void move(int layer, int kv_head, std::size_t from, std::size_t to) {
    auto& c = of(layer, kv_head);
    c[to] = std::move(c[from]);
    if (c.size() == from + 1)  // the usual swap-remove of the last row
      c.pop_back();
    else
      c.resize(from);
  }
  /// Saved state: every column (for trivially copyable T). load() requires the columns to
  /// have the sizes they have now (the rows restored before it) and throws kvevict::Error.
  void save(kvevict::detail::ByteWriter& w) const {
    w.put<std::uint64_t>(cols_.size());
    for (const auto& c : cols_) {
      w.put<std::uint64_t>(c.size());
      w.put_array(c.data(), c.size());
    }
  }
  template <class Valid = bool (*)(const T&)>
  void load(kvevict::detail::ByteReader& r, const char* policy, Valid valid = [](const T&) { return true; }) {
    const auto n = r.get<std::uint64_t>("column count");
    kvevict::detail::require(n == cols_.size(), policy, " state: ", n, " columns, expected ",
                             cols_.size());
    std::vector<std::vector<T>> fresh(cols_.size());
    for (std::size_t i = 0; i < cols_.size(); ++i) {
      const auto rows = r.get<std::uint64_t>("column rows");
      kvevict::detail::require(rows == cols_[i].size(), policy, " state: column ", i, " has ",
                               rows, " rows, expected ", cols_[i].size());
      fresh[i].resize(cols_[i].size());
      r.get_array(fresh[i].data(), fresh[i].size(), "column values");
      for (const T& x : fresh[i])
        kvevict::detail::require(valid(x), policy, " state: column ", i, " holds an invalid value");
    }
    cols_.swap(fresh);
  }

 private:
  std::size_t index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(n_kv_heads_) +
           static_cast<std::size_t>(kv_head);
  }
  int n_kv_heads_ = 1;
  std::vector<std::vector<T>> cols_;
};

/// The group sum of every row of one step's attention: the container's precomputed sums
/// when it passed them (KVCache/IndexCache::observe), else computed here into `scratch`
/// with the same additions in the same order (AttentionView::summed).
inline const float* group_sums(const AttentionView& a, std::vector<float>& scratch) {
  if (a.sums != nullptr) return a.sums;
  scratch.resize(a.size);
  for (std::size_t r = 0; r < a.size; ++r) scratch[r] = a.summed(r);
  return scratch.data();
}

/// Appends to `out` the `need` eligible rows with the lowest (rank(row), seq) — the
/// oldest first on equal rank — in O(n).
template <class Scalar, class Rank, class Eligible>
void evict_lowest(const HeadView<Scalar>& view, Rank&& rank, Eligible&& eligible,
                  std::vector<std::uint32_t>& out, const char* policy) {
  using Key = std::pair<decltype(rank(std::size_t{})), std::uint64_t>;
  if (view.need == 1) {
    std::size_t best = view.size;
    Key best_key{};
    for (std::size_t r = 0; r < view.size; ++r) {
      if (!eligible(r)) continue;
      Key k{rank(r), view.seqs[r]};
      if (best == view.size || k < best_key) {
        best = r;
        best_key = k;
      }
    }
    if (best == view.size)
      throw std::logic_error(std::string("kvevict: ") + policy + ": no evictable row");
    out.push_back(static_cast<std::uint32_t>(best));
    return;
  }
  std::vector<std::pair<Key, std::uint32_t>> cand;
  for (std::size_t r = 0; r < view.size; ++r)
    if (eligible(r)) cand.push_back({Key{rank(r), view.seqs[r]}, static_cast<std::uint32_t>(r)});
  if (cand.size() < view.need)
    throw std::logic_error(std::string("kvevict: ") + policy + ": " + std::to_string(cand.size()) +
                           " evictable rows, need " + std::to_string(view.need));
  std::nth_element(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(view.need - 1),
                   cand.end());
  for (std::size_t i = 0; i < view.need; ++i) out.push_back(cand[i].second);
}

/// The unprotected row (bit clear in `bits`) with the lowest score, the oldest (lowest
/// seq) among equal scores: one dispatched kernel (kernels::lowest_masked_seq: a masked
/// minimum, then the rows equal to it) where argmin_masked and an equal-score scan took two.
inline std::size_t lowest_masked(const float* sc, const std::uint64_t* seqs, std::size_t n,
                                 const std::uint64_t* bits, const char* policy) {
  const std::size_t best = kernels::lowest_masked_seq(sc, seqs, n, bits);
  if (best == kernels::npos)
    throw std::logic_error(std::string("kvevict: ") + policy + ": no evictable row");
  return best;
}

/// evict_lowest over `score` (indexable by row) with Protection's rule: the first `sinks`
/// rows and the `recent` newest never go.
template <class Scalar, class Scores>
void evict_lowest_protected(const HeadView<Scalar>& view, const Scores& score, std::size_t sinks,
                            std::size_t recent, std::vector<std::uint32_t>& out,
                            const char* policy) {
  const Protection prot{sinks, recent};
  evict_lowest(
      view, [&](std::size_t r) { return score[r]; },
      [&](std::size_t r) { return !prot.is_protected(view.seqs[r], view.incoming_seq); }, out,
      policy);
}

/// The end of the open arrival range [sinks, open_below) under Protection's rule: the rows
/// that arrived before the recent band of `recent` rows (0 when the band covers them all).
template <class Scalar>
std::uint64_t open_below(const HeadView<Scalar>& view, std::size_t recent) {
  return view.incoming_seq >= recent ? view.incoming_seq - recent : 0;
}

/// Sets `bits` (protect_outside's layout, set = never evicted) for the rows of `view`
/// outside [sinks, incoming - recent): the sinks and the recent band (Protection's rule).
/// Sizes `bits` to one bit per row of an n-row head (same size on most steps: no call).
KVEVICT_DEFER inline void size_bits(std::vector<std::uint64_t>& bits, std::size_t n) {
  const std::size_t words = (n + 63) / 64;
  if (bits.size() != words) bits.resize(words);
}

template <class Scalar>
const std::uint64_t* protection_bits(const HeadView<Scalar>& view, std::size_t sinks,
                                     std::size_t recent, std::vector<std::uint64_t>& bits) {
  size_bits(bits, view.size);
  kernels::protect_outside(view.seqs, view.size, sinks, open_below(view, recent), bits.data());
  return bits.data();
}

/// One victim from a kernels::lowest_open / decay_lowest_open result (npos: no open row).
inline std::uint32_t open_victim(std::size_t best, const char* policy) {
  if (best == kernels::npos)
    throw std::logic_error(std::string("kvevict: ") + policy + ": no evictable row");
  return static_cast<std::uint32_t>(best);
}

/// evict_lowest over float scores with the protected rows given as bits (protect_outside's
/// layout): the `view.need` lowest (score, seq) among the open rows; one victim through the
/// dispatched masked argmin (lowest_masked), two to four through its four-row form
/// (kernels::lowest_masked_seq4: the rows lowest_masked would return one after another,
/// each time with the previous ones protected, so the same set; one pass, nothing
/// allocated). Like one victim, rows with a NaN score are never chosen there; when fewer
/// than `need` open rows qualify, the general path below decides (and throws).
template <class Scalar>
void evict_lowest_masked(const HeadView<Scalar>& view, const float* sc, const std::uint64_t* bits,
                         std::vector<std::uint32_t>& out, const char* policy) {
  if (view.need == 1) {
    out.push_back(static_cast<std::uint32_t>(lowest_masked(sc, view.seqs, view.size, bits, policy)));
    return;
  }
  if (view.need <= 4) {
    std::size_t low[4] = {};
    const std::size_t c = kernels::lowest_masked_seq4(sc, view.seqs, view.size, bits, low);
    if (c >= view.need) {
      for (std::size_t i = 0; i < view.need; ++i) out.push_back(static_cast<std::uint32_t>(low[i]));
      return;
    }
  }
  evict_lowest(
      view, [&](std::size_t r) { return sc[r]; },
      [&](std::size_t r) { return ((bits[r >> 6] >> (r & 63)) & 1u) == 0; }, out, policy);
}

}  // namespace kvevict::policies::detail
