// The q.K pass of the exact quantized kernels, shared by the SIMD levels. NOT a standalone
// header: included (without include guard) inside attention_quant.hpp's attn_avx2 and
// attn_avx512 namespaces after they defined KVEVICT_QATTN_TARGET, q_chunk<D> (W elements
// without the block scale), q_chunk_scale<D> and q_chunk_scaled<D> (the chunk times it); V, W, kRows, kHeads, vzero, vload, vmul,
// vfma, vreduce_store and softmax_rows come from the level's attention kernel.

#ifndef KVEVICT_QATTN_TARGET
#error "attention_quant_body.hpp is included by attention_quant.hpp only"
#endif

// Scores of R rows x GC heads: per block, the chunk dot products of the R rows are scaled
// by their block scale before accumulating (one multiply per chunk and row). The block loop
// runs at least once (d >= step) and is written so, so that the R x GC accumulators live in
// registers from the zeroing to the reduction (with a zero-trip path the compiler gave them
// a stack home: 16 stores and 16 loads per block of rows at the AVX-512 level).
template <class D, int GC, int R>
KVEVICT_QATTN_TARGET KVEVICT_ALWAYS_INLINE void q_score_block(const float* q, std::size_t q_stride,
                                                              const std::uint8_t* rows, std::size_t row_bytes,
                                                              std::size_t i, std::size_t d, float scale,
                                                              float* s, std::size_t ld) noexcept {
  V acc[GC][R];
  for (int g = 0; g < GC; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = vzero();
  const std::uint8_t* rp[R];
  for (int r = 0; r < R; ++r) rp[r] = rows + (i + static_cast<std::size_t>(r)) * row_bytes;
  constexpr std::size_t step = D::kind == QKind::e4m3 ? W : D::group;
  std::size_t b0 = 0;
  do {
    V sc[R];
    for (int r = 0; r < R; ++r) sc[r] = q_chunk_scale<D>(rp[r], b0);
    for (std::size_t k = 0; k < step / W; ++k) {
      const std::size_t e = b0 + k * W;
      V kv[R];
      for (int r = 0; r < R; ++r) {
        if constexpr (D::kind == QKind::e4m3) kv[r] = q_chunk<D>(rp[r], e);
        else kv[r] = q_chunk_scaled<D>(rp[r], e, sc[r]);
      }
      for (int g = 0; g < GC; ++g) {
        const V qv = vload(q + static_cast<std::size_t>(g) * q_stride + e);
        for (int r = 0; r < R; ++r) acc[g][r] = vfma(qv, kv[r], acc[g][r]);
      }
    }
    b0 += step;
  } while (b0 < d);
  q_reduce_store<GC, R>(s, ld, i, acc, scale);
}

// Rows [i, n) of a run in blocks of R rows (returns where it stopped); per block every
// group of kHeads heads (a key row is read from memory once and reused from L1 by the other
// head groups). Scores go to s[g * ld + row].
template <class D, int R>
KVEVICT_QATTN_TARGET inline std::size_t q_score_rows(const float* q, std::size_t q_stride,
                                                     std::size_t group, const std::uint8_t* rows,
                                                     std::size_t row_bytes, std::size_t i,
                                                     std::size_t n, std::size_t d, float scale,
                                                     float* s, std::size_t ld) noexcept {
  for (; i + R <= n; i += R) {
    for (std::size_t g0 = 0; g0 < group; g0 += kHeads) {
      const float* qg = q + g0 * q_stride;
      float* sg = s + g0 * ld;
      switch (group - g0 < static_cast<std::size_t>(kHeads) ? group - g0 : kHeads) {
        case 1: q_score_block<D, 1, R>(qg, q_stride, rows, row_bytes, i, d, scale, sg, ld); break;
        case 2: q_score_block<D, 2, R>(qg, q_stride, rows, row_bytes, i, d, scale, sg, ld); break;
        case 3: q_score_block<D, 3, R>(qg, q_stride, rows, row_bytes, i, d, scale, sg, ld); break;
        default: q_score_block<D, kHeads, R>(qg, q_stride, rows, row_bytes, i, d, scale, sg, ld); break;
      }
    }
  }
  return i;
}

// The scores of one run of n contiguous stored rows (a block table's run; a dense array is
// one run) into s[g * ld + i], scaled, no softmax. A row's score is summed in the same order
// whatever rows share its block (q_reduce_store), so runs give the dense kernel's scores.
template <class D>
KVEVICT_QATTN_TARGET inline void q_score_run(const float* q, std::size_t q_stride,
                                             std::size_t group, const std::uint8_t* rows,
                                             std::size_t row_bytes, std::size_t n, std::size_t d,
                                             float scale, float* s, std::size_t ld) noexcept {
  if (d == 0) {  // no block: every score is 0 (the block loop above runs at least once)
    for (std::size_t g = 0; g < group; ++g)
      for (std::size_t i = 0; i < n; ++i) s[g * ld + i] = 0.0f;
    return;
  }
  const std::size_t i = q_score_rows<D, kRows>(q, q_stride, group, rows, row_bytes, 0, n, d, scale, s, ld);
  q_score_rows<D, 1>(q, q_stride, group, rows, row_bytes, i, n, d, scale, s, ld);
}
