#pragma once
// Save a KVCache to a versioned binary file and restore it bit-exactly.
//
// Layout (little-endian, version 1):
//   "KVEVSAVE" | u32 version | u32 scalar tag | u32 scalar bytes | str policy name |
//   i32 n_layers, n_heads, n_kv_heads, head_dim | u64 capacity per (layer, KV head) |
//   per layer: u64 tokens seen, i64 last position |
//   per (layer, KV head): u64 rows, rows x (i64 position, u64 seq), rows x d K, rows x d V |
//   u8 has policy state, [u64 length, bytes] | u64 FNV-1a of everything before it.
// Quantized caches (quantized.hpp) write scalar tag 5, then the key format's code in place
// of the scalar bytes and one more u32, the value format's code (kind << 16 | group size;
// kind 1 Q8, 2 Q4, 3 E4M3), and rows x key_row_bytes K, rows x value_row_bytes V: the
// stored bytes as they are. A restore replays on_append with the dequantised rows (so
// HashEvict's codes are rebuilt from dequantised keys: the float keys are gone).
// Policy state goes through optional policy hooks
//   void save_state(std::vector<std::uint8_t>& out) const;
//   void load_state(std::span<const std::uint8_t> in);  // throws kvevict::Error if invalid
// On restore the policy is rebound and sees every row again through on_append (row order),
// so side data derived from stored rows (KNorm's norms) is rebuilt; load_state then
// restores what cannot be derived (H2O's scores, Random's generators).
// Any invalid, truncated, corrupted or mismatched input throws kvevict::Error and leaves the
// target cache untouched: everything is parsed and checked into new storage first.
#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "bytes.hpp"
#include "cache.hpp"
#include "errors.hpp"
#include "file.hpp"

namespace kvevict {

inline constexpr std::uint32_t kSaveFormatVersion = 1;

namespace detail {

template <class P>
concept HasSaveState = requires(const P& p, std::vector<std::uint8_t>& out) { p.save_state(out); };
template <class P>
concept HasLoadState = requires(P& p, std::span<const std::uint8_t> in) { p.load_state(in); };

/// kind << 16 | group of a quantized format (the save format's code).
template <class C>
constexpr std::uint32_t codec_code() {
  if constexpr (std::is_same_v<C, HalfRowCodec>) return 4u << 16 | 1u;  // a mixed cache's fp16 band
  else return (static_cast<std::uint32_t>(C::desc::kind) + 1) << 16 | static_cast<std::uint32_t>(C::group);
}
inline std::string codec_code_name(std::uint32_t code) {
  const std::uint32_t kind = code >> 16, group = code & 0xFFFF;
  if (kind == 1) return "Q8<" + std::to_string(group) + ">";
  if (kind == 2) return "Q4<" + std::to_string(group) + ">";
  if (kind == 3 && group == 1) return "E4M3";
  if (kind == 4 && group == 1) return "fp16";
  return "unknown format " + std::to_string(code);
}

template <class Scalar>
constexpr std::uint32_t scalar_tag() {
  if constexpr (MixedStorage<Scalar>) return 6;
  else if constexpr (QuantizedStorage<Scalar>) return 5;
  else if constexpr (std::is_same_v<Scalar, float>) return 1;
  else if constexpr (std::is_same_v<Scalar, Eigen::half>) return 2;
  else if constexpr (std::is_same_v<Scalar, Eigen::bfloat16>) return 3;
  else if constexpr (std::is_same_v<Scalar, double>) return 4;
  else return 0;
}
inline const char* scalar_name(std::uint32_t tag) {
  switch (tag) {
    case 1: return "float";
    case 2: return "Eigen::half";
    case 3: return "Eigen::bfloat16";
    case 4: return "double";
    case 5: return "quantized";
    case 6: return "mixed";
    default: return "unknown";
  }
}

inline std::uint64_t fnv1a(std::span<const std::uint8_t> bytes) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
  return h;
}

template <class Cache>
struct CacheAccess {
  using Policy = typename Cache::policy_type;
  using Scalar = typename Cache::scalar_type;

  static void save(const Cache& c, std::vector<std::uint8_t>& out) {
    const Geometry& g = c.shape_.geometry;
    check_live(g, "save");
    require(!c.pooled(), "save: the cache runs a pooled budget (Budget::pooled()), which the save "
            "format does not hold (heads may hold more rows than their nominal capacity); "
            "expected a cache with a per-head budget");
    out.clear();
    ByteWriter w(out);
    w.put_array("KVEVSAVE", 8);
    w.put<std::uint32_t>(kSaveFormatVersion);
    w.put<std::uint32_t>(scalar_tag<Scalar>());
    if constexpr (MixedStorage<Scalar>) {
      for (std::uint32_t code : mixed_codes()) w.put<std::uint32_t>(code);
      w.put<std::uint64_t>(c.hot_rows_);
    } else if constexpr (QuantizedStorage<Scalar>) {
      w.put<std::uint32_t>(codec_code<typename StorageOf<Scalar>::key_codec>());
      w.put<std::uint32_t>(codec_code<typename StorageOf<Scalar>::value_codec>());
    } else {
      w.put<std::uint32_t>(sizeof(Scalar));
    }
    w.put_string(Policy::name());
    for (int x : {g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim}) w.put<std::int32_t>(x);
    for (std::size_t cap : c.shape_.capacity) w.put<std::uint64_t>(cap);
    for (const auto& ls : c.layers_) {
      w.put<std::uint64_t>(ls.next_seq);
      w.put<std::int64_t>(ls.last_position);
    }
    for (const auto& h : c.heads_) {
      w.put<std::uint64_t>(h.size());
      for (std::size_t r = 0; r < h.size(); ++r) {
        w.put<std::int64_t>(h.pos[r]);
        w.put<std::uint64_t>(h.seq[r]);
      }
      if constexpr (MixedStorage<Scalar>) {  // per row: band flag, key bytes, value bytes
        for (std::size_t r = 0; r < h.size(); ++r) {
          const MixedRowRef x = h.row(r, static_cast<std::size_t>(g.head_dim));
          const auto d = static_cast<std::size_t>(g.head_dim);
          using HS = typename Cache::HeadStore;
          w.put<std::uint8_t>(x.hot ? 1 : 0);
          w.put_array(x.key, x.hot ? HS::HK::row_bytes(d) : HS::CK::row_bytes(d));
          w.put_array(x.value, x.hot ? HS::HV::row_bytes(d) : HS::CV::row_bytes(d));
        }
      } else {
        w.put_array(h.k.data(), h.size() * c.key_units());
        w.put_array(h.v.data(), h.size() * c.value_units());
      }
    }
    if constexpr (HasSaveState<Policy>) {
      std::vector<std::uint8_t> state;
      c.policy_.save_state(state);
      w.put<std::uint8_t>(1);
      w.put<std::uint64_t>(state.size());
      w.put_array(state.data(), state.size());
    } else {
      w.put<std::uint8_t>(0);
    }
    w.put<std::uint64_t>(fnv1a(out));
  }

  // Mixed caches: the hot key, hot value, cold key and cold value formats' codes.
  static std::array<std::uint32_t, 4> mixed_codes()
    requires MixedStorage<Scalar>
  {
    using HS = typename Cache::HeadStore;
    return {codec_code<typename HS::HK>(), codec_code<typename HS::HV>(), codec_code<typename HS::CK>(),
            codec_code<typename HS::CV>()};
  }

  // A mixed head's rows (n rows, positions and seqs already read): per row a band flag and
  // its bytes, into the two bands; the band sizes checked against R and the capacity.
  static void read_mixed_rows(ByteReader& r, typename Cache::HeadStore& h, std::size_t n, std::size_t d,
                              std::size_t R, std::size_t cap, std::size_t i)
    requires MixedStorage<Scalar>
  {
    using HS = typename Cache::HeadStore;
    h.where.resize(n);
    for (std::size_t k = 0; k < n; ++k) {
      const auto flag = r.get<std::uint8_t>("band");
      require(flag <= 1, "saved state: head ", i, " row ", k, " band ", int(flag), ", expected 0 (cold) or 1 (hot)");
      auto& kb = flag ? h.hk : h.ck;
      auto& vb = flag ? h.hv : h.cv;
      const std::size_t kn = flag ? HS::HK::row_bytes(d) : HS::CK::row_bytes(d);
      const std::size_t vn = flag ? HS::HV::row_bytes(d) : HS::CV::row_bytes(d);
      auto& owner = flag ? h.hot_owner : h.cold_owner;
      h.where[k] = static_cast<std::uint32_t>(owner.size()) | (flag ? HS::kHot : 0u);
      owner.push_back(static_cast<std::uint32_t>(k));
      if (flag) h.hot_seq.push_back(h.seq[k]);
      kb.resize(kb.size() + kn);
      vb.resize(vb.size() + vn);
      r.get_array(kb.data() + kb.size() - kn, kn, "keys");
      r.get_array(vb.data() + vb.size() - vn, vn, "values");
    }
    require(h.hot_rows() <= R && h.cold_rows() <= cap - std::min(cap, R), "saved state: head ", i,
            " holds ", h.hot_rows(), " hot and ", h.cold_rows(), " cold rows, expected <= ", R,
            " hot and <= ", cap - std::min(cap, R), " cold (capacity - hot_rows)");
    std::uint64_t newest_cold = 0, oldest_hot = ~std::uint64_t{0};
    for (std::size_t k = 0; k < n; ++k)
      (h.where[k] & HS::kHot) ? void(oldest_hot = std::min(oldest_hot, h.seq[k]))
                              : void(newest_cold = std::max(newest_cold, h.seq[k]));
    require(h.cold_rows() == 0 || h.hot_rows() == 0 || newest_cold < oldest_hot, "saved state: head ", i,
            " has a cold row (seq ", newest_cold, ") newer than a hot one (seq ", oldest_hot,
            "), expected the hot band to hold the newest rows");
  }

  // A stored K or V element that is not finite (a row the cache could never have accepted).
  template <class Unit, class Alloc>
  static void check_rows_finite(const std::vector<Unit, Alloc>& x, std::size_t head, const char* what) {
    for (std::size_t j = 0; j < x.size(); ++j)
      require(std::isfinite(static_cast<float>(x[j])), "saved state: head ", head, " ", what,
              " element ", j, " = ", static_cast<float>(x[j]), ", expected a finite value");
  }

  // Every KV head of a layer received each token at the same position, positions increase
  // by at least one per arrival (so between two rows at least their seq gap), and the
  // layer's newest token sits at its last position.
  static void check_arrival_order(const std::vector<typename Cache::HeadStore>& heads,
                                  std::size_t layer, std::size_t hkv,
                                  const typename Cache::LayerState& ls) {
    std::vector<std::pair<std::uint64_t, std::int64_t>> rows;
    for (std::size_t h = layer * hkv; h < (layer + 1) * hkv; ++h)
      for (std::size_t k = 0; k < heads[h].size(); ++k) rows.emplace_back(heads[h].seq[k], heads[h].pos[k]);
    std::sort(rows.begin(), rows.end());
    auto gap = [](std::int64_t hi, std::int64_t lo) {  // hi - lo for hi >= lo, exact
      return static_cast<std::uint64_t>(hi) - static_cast<std::uint64_t>(lo);
    };
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const auto [seq, pos] = rows[i];
      if (seq + 1 == ls.next_seq)
        require(pos == ls.last_position, "saved state: layer ", layer, " newest token (seq ", seq,
                ") at position ", pos, ", expected the layer's last position ", ls.last_position,
                " (positions increase with arrival order)");
      require(gap(ls.last_position, pos) >= ls.next_seq - 1 - seq, "saved state: layer ", layer,
              " seq ", seq, " at position ", pos, " leaves too few positions before the last one (",
              ls.last_position, ") for the ", ls.next_seq - 1 - seq,
              " tokens after it (positions increase with arrival order)");
      if (i == 0) continue;
      const auto [pseq, ppos] = rows[i - 1];
      if (seq == pseq) {
        require(pos == ppos, "saved state: layer ", layer, " seq ", seq, " at positions ", ppos,
                " and ", pos, " in different KV heads, expected one position per token");
        continue;
      }
      require(pos > ppos && gap(pos, ppos) >= seq - pseq, "saved state: layer ", layer, " seq ",
              pseq, " at position ", ppos, " and seq ", seq, " at position ", pos,
              ", expected positions to increase with arrival order");
    }
  }

  // Parses and checks everything into fresh storage, then commits with non-throwing swaps.
  static void load(Cache& c, std::span<const std::uint8_t> in, bool verify_checksum) {
    const auto in_use = c.exclusive_.enter("load");
    check_live(c.shape_.geometry, "load");
    require(!c.pooled(), "load: the target cache runs a pooled budget (Budget::pooled()), which "
            "the save format does not hold; expected a cache with a per-head budget");
    require(in.size() >= 8 + 4 + 8 && std::memcmp(in.data(), "KVEVSAVE", 8) == 0,
            "saved state: bad magic (", in.size(), " bytes), expected a kvevict save file");
    ByteReader hdr(in.subspan(8));
    const auto version = hdr.get<std::uint32_t>("version");
    require(version == kSaveFormatVersion, "saved state: format version ", version,
            ", expected ", kSaveFormatVersion);
    if (verify_checksum) {
      std::uint64_t stored;
      std::memcpy(&stored, in.data() + in.size() - 8, 8);
      const auto actual = fnv1a(in.first(in.size() - 8));
      require(stored == actual, "saved state: checksum mismatch (file corrupt or truncated)");
    }
    ByteReader r(in.first(in.size() - 8).subspan(12));
    const auto tag = r.get<std::uint32_t>("scalar type");
    if constexpr (MixedStorage<Scalar>) {
      require(tag == scalar_tag<Scalar>(), "saved state: scalar type ", scalar_name(tag),
              ", expected mixed");
      const auto want = mixed_codes();
      std::array<std::uint32_t, 4> got{};
      for (auto& code : got) code = r.get<std::uint32_t>("band format");
      require(got == want, "saved state: mixed formats ", codec_code_name(got[0]), " / ",
              codec_code_name(got[1]), " hot, ", codec_code_name(got[2]), " / ", codec_code_name(got[3]),
              " cold, expected ", codec_code_name(want[0]), " / ", codec_code_name(want[1]), " hot, ",
              codec_code_name(want[2]), " / ", codec_code_name(want[3]), " cold (keys / values)");
      const auto R = r.get<std::uint64_t>("hot rows");
      require(R == c.hot_rows_, "saved state: hot_rows ", R, ", expected ", c.hot_rows_,
              " (the target's set_hot_rows)");
    } else if constexpr (QuantizedStorage<Scalar>) {
      require(tag == scalar_tag<Scalar>(), "saved state: scalar type ", scalar_name(tag),
              ", expected quantized");
      const auto kc = r.get<std::uint32_t>("key format");
      const auto vc = r.get<std::uint32_t>("value format");
      constexpr auto want_k = codec_code<typename StorageOf<Scalar>::key_codec>();
      constexpr auto want_v = codec_code<typename StorageOf<Scalar>::value_codec>();
      require(kc == want_k && vc == want_v, "saved state: formats ", codec_code_name(kc), " / ",
              codec_code_name(vc), ", expected ", codec_code_name(want_k), " / ",
              codec_code_name(want_v), " (keys / values)");
    } else {
      const auto bytes = r.get<std::uint32_t>("scalar size");
      require(tag == scalar_tag<Scalar>() && bytes == sizeof(Scalar), "saved state: scalar type ",
              scalar_name(tag), " (", bytes, " bytes), expected ", scalar_name(scalar_tag<Scalar>()),
              " (", sizeof(Scalar), " bytes)");
    }
    const std::string name = r.get_string("policy name", 256);
    require(name == Policy::name(), "saved state: policy ", name, ", expected ", Policy::name());
    Geometry g;
    g.n_layers = r.get<std::int32_t>("n_layers");
    g.n_heads = r.get<std::int32_t>("n_heads");
    g.n_kv_heads = r.get<std::int32_t>("n_kv_heads");
    g.head_dim = r.get<std::int32_t>("head_dim");
    const Geometry& want = c.shape_.geometry;
    require(g == want, "saved state: geometry (layers ", g.n_layers, ", heads ", g.n_heads,
            ", kv heads ", g.n_kv_heads, ", head_dim ", g.head_dim, "), expected (layers ",
            want.n_layers, ", heads ", want.n_heads, ", kv heads ", want.n_kv_heads, ", head_dim ",
            want.head_dim, ")");
    const std::size_t n_heads = c.shape_.capacity.size();
    for (std::size_t i = 0; i < n_heads; ++i) {
      const auto cap = r.get<std::uint64_t>("capacity");
      require(cap == c.shape_.capacity[i], "saved state: capacity of layer ",
              i / static_cast<std::size_t>(g.n_kv_heads), " KV head ",
              i % static_cast<std::size_t>(g.n_kv_heads), " = ", cap, ", expected ",
              c.shape_.capacity[i], " (the target cache's budget)");
    }
    std::vector<typename Cache::LayerState> layers(static_cast<std::size_t>(g.n_layers));
    for (std::size_t l = 0; l < layers.size(); ++l) {
      auto& ls = layers[l];
      ls.next_seq = r.get<std::uint64_t>("tokens seen");
      ls.last_position = r.get<std::int64_t>("last position");
      require(ls.next_seq <= kMaxTokensSeen, "saved state: layer ", l, " has seen ", ls.next_seq,
              " tokens, expected <= ", kMaxTokensSeen);
      require(ls.next_seq > 0 || ls.last_position == 0, "saved state: layer ", l,
              " has seen no tokens but its last position is ", ls.last_position, ", expected 0");
    }
    const std::size_t d = static_cast<std::size_t>(g.head_dim);
    std::vector<typename Cache::HeadStore> heads(n_heads);
    for (std::size_t i = 0; i < n_heads; ++i) {
      auto& h = heads[i];
      const auto& ls = layers[i / static_cast<std::size_t>(g.n_kv_heads)];
      const auto rows = r.get<std::uint64_t>("row count");
      require(rows <= c.shape_.capacity[i] && rows <= ls.next_seq, "saved state: head ", i,
              " holds ", rows, " rows, expected <= capacity ", c.shape_.capacity[i],
              " and <= tokens seen ", ls.next_seq);
      std::size_t row_min = 0;  // the fewest bytes a saved row takes
      if constexpr (MixedStorage<Scalar>) {
        using HS = typename Cache::HeadStore;
        row_min = 1 + std::min(HS::HK::row_bytes(d) + HS::HV::row_bytes(d), HS::CK::row_bytes(d) + HS::CV::row_bytes(d));
      } else {
        row_min = (c.key_units() + c.value_units()) * sizeof(typename Cache::Unit);
      }
      r.need_elems(rows, 16 + row_min, "rows");
      const auto n = static_cast<std::size_t>(rows);
      h.pos.resize(n);
      h.seq.resize(n);
      for (std::size_t k = 0; k < n; ++k) {
        h.pos[k] = r.get<std::int64_t>("position");
        h.seq[k] = r.get<std::uint64_t>("seq");
        require(h.seq[k] < ls.next_seq && h.pos[k] <= ls.last_position, "saved state: head ", i,
                " row ", k, " has seq ", h.seq[k], " and position ", h.pos[k],
                ", expected seq < ", ls.next_seq, " and position <= ", ls.last_position);
      }
      {  // arrival indices and positions are unique within a head
        std::vector<std::uint64_t> s(h.seq);
        std::sort(s.begin(), s.end());
        require(std::adjacent_find(s.begin(), s.end()) == s.end(), "saved state: head ", i,
                " repeats an arrival index");
        std::vector<std::int64_t> p(h.pos);
        std::sort(p.begin(), p.end());
        require(std::adjacent_find(p.begin(), p.end()) == p.end(), "saved state: head ", i,
                " repeats a position");
      }
      if constexpr (MixedStorage<Scalar>) {
        read_mixed_rows(r, h, n, d, c.hot_rows_, c.shape_.capacity[i], i);
      } else {
        const std::size_t kb = c.key_units(), vb = c.value_units();
        h.k.resize(n * kb);
        h.v.resize(n * vb);
        r.get_array(h.k.data(), n * kb, "keys");
        r.get_array(h.v.data(), n * vb, "values");
      }
      if constexpr (QuantizedStorage<Scalar>) {  // scales and E4M3 codes decode finite
        std::vector<float> fk(n * d), fv(n * d);
        c.decode_head(h, true, 0, n, fk.data());
        c.decode_head(h, false, 0, n, fv.data());
        check_rows_finite(fk, i, "dequantised key");
        check_rows_finite(fv, i, "dequantised value");
      } else {
        check_rows_finite(h.k, i, "key");
        check_rows_finite(h.v, i, "value");
      }
      const auto hkv = static_cast<std::size_t>(g.n_kv_heads);
      if (i % hkv == hkv - 1) check_arrival_order(heads, i / hkv, hkv, ls);
    }
    const auto has_state = r.get<std::uint8_t>("policy state flag");
    require(has_state <= 1, "saved state: policy state flag ", int(has_state), ", expected 0 or 1");
    std::span<const std::uint8_t> state;
    if (has_state) state = r.get_bytes(r.get<std::uint64_t>("policy state length"), "policy state");
    require(r.remaining() == 0, "saved state: ", r.remaining(), " unexpected trailing bytes");
    if constexpr (HasLoadState<Policy>)
      require(has_state == 1, "saved state: no state for policy ", Policy::name(),
              ", which saves its state");
    else
      require(has_state == 0, "saved state: carries policy state, but ", Policy::name(),
              " cannot load one");

    // Rebuild the policy's side data on a copy (same configuration, fresh binding).
    Policy p = c.policy_;
    p.bind(c.shape_);
    std::vector<float> key(d), fk, fv;
    for (int l = 0; l < g.n_layers; ++l)
      for (int kh = 0; kh < g.n_kv_heads; ++kh) {
        const auto& h = heads[static_cast<std::size_t>(l * g.n_kv_heads + kh)];
        using View = typename StorageOf<Scalar>::view;
        const View* vk = nullptr;
        const View* vv = nullptr;
        if constexpr (QuantizedStorage<Scalar>) {  // policies read dequantised rows
          fk.resize(h.size() * d);
          fv.resize(h.size() * d);
          c.decode_head(h, true, 0, h.size(), fk.data());
          c.decode_head(h, false, 0, h.size(), fv.data());
          vk = fk.data();
          vv = fv.data();
        } else {
          vk = h.k.data();
          vv = h.v.data();
        }
        for (std::size_t row = 0; row < h.size(); ++row) {
          for (std::size_t j = 0; j < d; ++j) key[j] = static_cast<float>(vk[row * d + j]);
          HeadView<View> v;
          v.layer = l;
          v.kv_head = kh;
          v.head_dim = g.head_dim;
          v.group = g.group();
          v.size = row + 1;
          v.capacity = c.shape_.at(l, kh);
          v.keys = vk;
          v.values = vv;
          v.positions = h.pos.data();
          v.seqs = h.seq.data();
          v.incoming_seq = h.seq[row];
          v.incoming_position = h.pos[row];
          v.incoming_key = key.data();
          p.on_append(v, row);
        }
      }
    if constexpr (HasLoadState<Policy>) p.load_state(state);
    // Commit: nothing below throws.
    c.heads_.swap(heads);
    c.layers_.swap(layers);
    if constexpr (QuantizedStorage<Scalar>) c.forget_view();
    using std::swap;
    swap(c.policy_, p);
  }
};

}  // namespace detail

/// The saved form of `cache` as bytes.
template <class Policy, class Scalar>
std::vector<std::uint8_t> save_bytes(const KVCache<Policy, Scalar>& cache) {
  std::vector<std::uint8_t> out;
  detail::CacheAccess<KVCache<Policy, Scalar>>::save(cache, out);
  return out;
}

/// Restores `cache` from bytes written by save_bytes/save. The target must have the same
/// geometry, capacities, policy and scalar type; its eviction callback is kept.
template <class Policy, class Scalar>
void load_bytes(KVCache<Policy, Scalar>& cache, std::span<const std::uint8_t> bytes) {
  detail::CacheAccess<KVCache<Policy, Scalar>>::load(cache, bytes, true);
}

/// Writes the cache to a file (replaced if it exists).
template <class Policy, class Scalar>
void save(const KVCache<Policy, Scalar>& cache, const std::string& path) {
  const auto bytes = save_bytes(cache);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  detail::require(f.good(), "save: cannot open ", path, " for writing");
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  f.close();
  detail::require(f.good(), "save: writing ", path, " failed");
}

/// Restores the cache from a file written by save().
template <class Policy, class Scalar>
void load(KVCache<Policy, Scalar>& cache, const std::string& path) {
  const std::vector<char> bytes = detail::read_file(path, "load: saved cache");
  load_bytes(cache, std::span<const std::uint8_t>(
                        reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()));
}

}  // namespace kvevict
