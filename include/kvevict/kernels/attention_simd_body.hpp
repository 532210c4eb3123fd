// The decode-attention algorithm shared by the SIMD levels. NOT a standalone header: it is
// included (deliberately without include guard) inside the namespace of attention_avx2.hpp
// and attention_avx512.hpp, after they defined V, W, kRows, kHeads, kVecs, the v* primitives
// and KVEVICT_ATTN_TARGET, so each level compiles the same code under its own target
// attribute and symbols.
//
// Pass 1 (scores): blocks of kRows K rows x kHeads query heads, one vector accumulator per
//   (row, head): every K row is loaded (and widened) once per block of heads and used by all
//   of them; the kRows x kHeads sums are reduced together and scaled. Each block prefetches
//   the K rows kPrefetchRows ahead. Measured (docs/benchmarks.md, "Decode step", stop 36):
//   without it, with K+V in DRAM (16K rows, Hkv 8, fp32), pass 1 took 42% of the step's
//   samples against pass 2's 26% over as many bytes and FMAs, and the step 1.1-1.5x the
//   hand anchor's; with it 21% against 23%. The same prefetch of V rows in pass 2 (whole
//   rows 4, 8 or 16 ahead, or the next tile) gained nothing and is not done.
// Softmax per query head: max (with a non-finite check folded in), exp and sum, normalise.
// Pass 2 (output): tiles of rows sized for L1; per tile, column blocks of kVecs vectors x
//   kHeads heads held in registers; a V row is read from memory once and reused from L1 by
//   the other column blocks.
// Both passes work on one run of contiguous rows (score_rows, accumulate_rows); the softmax
// on the whole score array. attention_decode.hpp walks a block table's runs (a dense cache
// is one run).

#ifndef KVEVICT_ATTN_TARGET
#error "attention_simd_body.hpp is included by attention_avx2.hpp / attention_avx512.hpp only"
#endif

/// Rows ahead of the current q.K block that pass 1 prefetches (8 rows: 4 KiB of fp32 rows at
/// d = 128; 4, 8, 16 and 24 were measured, 8 and 16 best).
inline constexpr std::size_t kPrefetchRows = 8;

template <KvFormat F, int GC, int R>
KVEVICT_ATTN_TARGET inline void score_block(const float* q, std::size_t q_stride,
                                            const void* keys, std::size_t k_stride,
                                            std::size_t i, std::size_t d, float scale, float* s,
                                            std::size_t ld) noexcept {
  V acc[GC][R];
  for (int g = 0; g < GC; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = vzero();
  std::size_t c = 0;
  for (; c + W <= d; c += W) {
    V kv[R];
    for (int r = 0; r < R; ++r) kv[r] = vwiden<F>(keys, (i + static_cast<std::size_t>(r)) * k_stride + c);
    for (int g = 0; g < GC; ++g) {
      const V qv = vload(q + static_cast<std::size_t>(g) * q_stride + c);
      for (int r = 0; r < R; ++r) acc[g][r] = vfma(qv, kv[r], acc[g][r]);
    }
  }
  if (c < d) {
    const std::size_t cnt = d - c;
    V kv[R];
    for (int r = 0; r < R; ++r)
      kv[r] = vwiden_tail<F>(keys, (i + static_cast<std::size_t>(r)) * k_stride + c, cnt);
    for (int g = 0; g < GC; ++g) {
      const V qv = vload_tail(q + static_cast<std::size_t>(g) * q_stride + c, cnt);
      for (int r = 0; r < R; ++r) acc[g][r] = vfma(qv, kv[r], acc[g][r]);
    }
  }
  for (int g = 0; g < GC; ++g) vreduce_store<R>(s + static_cast<std::size_t>(g) * ld + i, acc[g], scale);
}

template <KvFormat F, int R>
KVEVICT_ATTN_TARGET inline void score_heads(const float* q, std::size_t q_stride,
                                            std::size_t group, const void* keys,
                                            std::size_t k_stride, std::size_t i, std::size_t d,
                                            float scale, float* s, std::size_t ld) noexcept {
  for (std::size_t g0 = 0; g0 < group; g0 += kHeads) {
    const float* qg = q + g0 * q_stride;
    float* sg = s + g0 * ld;
    switch (group - g0 < static_cast<std::size_t>(kHeads) ? group - g0 : kHeads) {
      case 1: score_block<F, 1, R>(qg, q_stride, keys, k_stride, i, d, scale, sg, ld); break;
      case 2: score_block<F, 2, R>(qg, q_stride, keys, k_stride, i, d, scale, sg, ld); break;
      case 3: score_block<F, 3, R>(qg, q_stride, keys, k_stride, i, d, scale, sg, ld); break;
      default: score_block<F, kHeads, R>(qg, q_stride, keys, k_stride, i, d, scale, sg, ld); break;
    }
  }
}

/// Softmax of one head's scores in place; false if a score is not finite.
KVEVICT_ATTN_TARGET inline bool softmax_row(float* p, std::size_t n) noexcept {
  V mv = vset1(-INFINITY), bad = vzero();
  std::size_t i = 0;
  for (; i + W <= n; i += W) {
    const V x = vload(p + i);
    mv = vmax(mv, x);
    bad = vnonfinite_or(bad, x);
  }
  float m = vhmax(mv);
  std::uint32_t bad_tail = 0;
  for (std::size_t j = i; j < n; ++j) {
    bad_tail |= nonfinite_bit(p[j]);
    m = p[j] > m ? p[j] : m;
  }
  if (vany_sign(bad) || bad_tail) return false;
  const V mb = vset1(m);
  V zv = vzero();
  for (i = 0; i + W <= n; i += W) {
    const V e = vexp(vsub(vload(p + i), mb));
    vstore(p + i, e);
    zv = vadd(zv, e);
  }
  if (i < n) {  // the lanes past n are dropped by the tail store and reloaded as zeros
    vstore_tail(p + i, vexp(vsub(vload_tail(p + i, n - i), mb)), n - i);
    zv = vadd(zv, vload_tail(p + i, n - i));
  }
  const V inv = vset1(1.0f / vhsum(zv));
  for (i = 0; i + W <= n; i += W) vstore(p + i, vmul(vload(p + i), inv));
  if (i < n) vstore_tail(p + i, vmul(vload_tail(p + i, n - i), inv), n - i);
  return true;
}

/// Softmax of the group's score rows (group x n) in place; false if a score is not finite.
KVEVICT_ATTN_TARGET inline bool softmax_rows(float* probs, std::size_t group, std::size_t n) noexcept {
  bool ok = true;
  for (std::size_t g = 0; g < group; ++g) ok = softmax_row(probs + g * n, n) && ok;
  return ok;
}

/// Scores of n contiguous K rows (row i at keys + i * k_stride) into s[g * ld + i], scaled,
/// no softmax: one run of a block table (kernels/attention_decode.hpp; a dense cache is one
/// run).
template <KvFormat F>
KVEVICT_ATTN_TARGET inline void score_rows(const float* q, std::size_t q_stride, std::size_t group,
                                           const void* keys, std::size_t k_stride, std::size_t n,
                                           std::size_t d, float scale, float* s,
                                           std::size_t ld) noexcept {
  const std::size_t row_bytes = d * kv_format_bytes(F);
  const std::size_t stride_bytes = k_stride * kv_format_bytes(F);
  const char* ahead = static_cast<const char*>(keys) + kPrefetchRows * stride_bytes;
  std::size_t i = 0;
  for (; i + kRows <= n; i += kRows) {
    if (i + kPrefetchRows + kRows <= n)
      for (int r = 0; r < kRows; ++r) {
        const char* p = ahead + (i + static_cast<std::size_t>(r)) * stride_bytes;
        for (std::size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o);
      }
    score_heads<F, kRows>(q, q_stride, group, keys, k_stride, i, d, scale, s, ld);
  }
  for (; i < n; ++i) score_heads<F, 1>(q, q_stride, group, keys, k_stride, i, d, scale, s, ld);
}

template <KvFormat F, int GC, int NV, bool Tail>
KVEVICT_ATTN_TARGET inline void output_block(const float* probs, std::size_t ld,
                                             const void* values, std::size_t v_stride,
                                             std::size_t i0, std::size_t i1, std::size_t c0,
                                             std::size_t tail, float* out,
                                             std::size_t out_stride) noexcept {
  V acc[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v) {
      const float* o = out + static_cast<std::size_t>(g) * out_stride + c0 + static_cast<std::size_t>(v) * W;
      acc[g][v] = (Tail && v == NV - 1) ? vload_tail(o, tail) : vload(o);
    }
  for (std::size_t i = i0; i < i1; ++i) {
    V x[NV];
    const std::size_t row = i * v_stride + c0;
    for (int v = 0; v < NV; ++v)
      x[v] = (Tail && v == NV - 1) ? vwiden_tail<F>(values, row + static_cast<std::size_t>(v) * W, tail)
                                   : vwiden<F>(values, row + static_cast<std::size_t>(v) * W);
    for (int g = 0; g < GC; ++g) {
      const V pb = vset1(probs[static_cast<std::size_t>(g) * ld + i]);
      for (int v = 0; v < NV; ++v) acc[g][v] = vfma(pb, x[v], acc[g][v]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v) {
      float* o = out + static_cast<std::size_t>(g) * out_stride + c0 + static_cast<std::size_t>(v) * W;
      if (Tail && v == NV - 1) vstore_tail(o, acc[g][v], tail);
      else vstore(o, acc[g][v]);
    }
}

template <KvFormat F, int GC, int NV>
KVEVICT_ATTN_TARGET inline void output_block_t(bool tail_block, const float* probs, std::size_t ld,
                                               const void* values, std::size_t v_stride,
                                               std::size_t i0, std::size_t i1, std::size_t c0,
                                               std::size_t tail, float* out,
                                               std::size_t out_stride) noexcept {
  if constexpr (NV <= kVecs) {
    if (tail_block)
      output_block<F, GC, NV, true>(probs, ld, values, v_stride, i0, i1, c0, tail, out, out_stride);
    else
      output_block<F, GC, NV, false>(probs, ld, values, v_stride, i0, i1, c0, tail, out, out_stride);
  }
}

template <KvFormat F, int GC>
KVEVICT_ATTN_TARGET inline void output_block_nv(std::size_t nv, bool tail_block,
                                                const float* probs, std::size_t ld,
                                                const void* values, std::size_t v_stride,
                                                std::size_t i0, std::size_t i1, std::size_t c0,
                                                std::size_t tail, float* out,
                                                std::size_t out_stride) noexcept {
  switch (nv) {
    case 1: output_block_t<F, GC, 1>(tail_block, probs, ld, values, v_stride, i0, i1, c0, tail, out, out_stride); break;
    case 2: output_block_t<F, GC, 2>(tail_block, probs, ld, values, v_stride, i0, i1, c0, tail, out, out_stride); break;
    case 3: output_block_t<F, GC, 3>(tail_block, probs, ld, values, v_stride, i0, i1, c0, tail, out, out_stride); break;
    default: output_block_t<F, GC, 4>(tail_block, probs, ld, values, v_stride, i0, i1, c0, tail, out, out_stride); break;
  }
}

/// out[g * out_stride + j] += sum_i probs[g * ld + i] * v_i[j] over n contiguous V rows (row
/// i at values + i * v_stride): one run of a block table. Rows are added in order, one at a
/// time, whatever the tiling, so the sum over a table's runs equals the sum over the same
/// rows copied into one array, bit for bit.
template <KvFormat F>
KVEVICT_ATTN_TARGET inline void accumulate_rows(const float* probs, std::size_t ld,
                                                std::size_t group, const void* values,
                                                std::size_t v_stride, std::size_t n,
                                                std::size_t d, float* out,
                                                std::size_t out_stride) noexcept {
  const std::size_t tail = d % W;
  const std::size_t nvec = d / W + (tail ? 1 : 0);
  // Rows per tile: about 16 KiB of V, so the column blocks after the first read it from L1.
  std::size_t tile = 16384 / (d * kv_format_bytes(F) + 1);
  if (tile < 8) tile = 8;
  for (std::size_t i0 = 0; i0 < n; i0 += tile) {
    const std::size_t i1 = n - i0 < tile ? n : i0 + tile;
    for (std::size_t g0 = 0; g0 < group; g0 += kHeads) {
      const std::size_t gc = group - g0 < static_cast<std::size_t>(kHeads) ? group - g0 : kHeads;
      const float* pg = probs + g0 * ld;
      float* og = out + g0 * out_stride;
      for (std::size_t cv = 0; cv < nvec; cv += kVecs) {
        const std::size_t nv = nvec - cv < static_cast<std::size_t>(kVecs) ? nvec - cv : kVecs;
        const bool tail_block = tail != 0 && cv + nv == nvec;
        const std::size_t c0 = cv * W;
        switch (gc) {
          case 1: output_block_nv<F, 1>(nv, tail_block, pg, ld, values, v_stride, i0, i1, c0, tail, og, out_stride); break;
          case 2: output_block_nv<F, 2>(nv, tail_block, pg, ld, values, v_stride, i0, i1, c0, tail, og, out_stride); break;
          case 3: output_block_nv<F, 3>(nv, tail_block, pg, ld, values, v_stride, i0, i1, c0, tail, og, out_stride); break;
          default: output_block_nv<F, kHeads>(nv, tail_block, pg, ld, values, v_stride, i0, i1, c0, tail, og, out_stride); break;
        }
      }
    }
  }
}
