// Look-up-table matmul for palettized weights (wscompress PalettizedLinear, cluster_dim 1).
//
// Weight row r reads codebook r / group_size (a table of up to 16 floats for nibble indices,
// up to 256 for byte indices). The weight is never materialised for small batches: each block
// of 16 indices becomes 16 weights in one register (AVX-512 permute for nibbles, gather for
// bytes; on AVX2, 8 at a time with two permutes and a blend) and is multiplied into up to 8
// input rows at once. For long inputs (prefill) the caller
// decodes the dense weight with lut_dense, one layer at a time, and uses the BLAS.
//
// Weights kept aside from the codebook (outliers) come as a sparse correction in CSR form
// (row_ptr, col, delta: the exact weight minus its codebook value). Each row adds its own few
// while its sums are still in registers, so decoding pays for them in the same pass instead of
// in a separate gather-and-scatter over the output (which cost more than the kernel saved).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace {

template <int W>  // index width in bits: 4 (two per byte, low nibble first) or 8
inline int64_t index_at(const uint8_t* row, int64_t j) {
  if constexpr (W == 4) return (row[j >> 1] >> ((j & 1) * 4)) & 15;
  else return row[j];
}

// The outliers' corrections, CSR by weight row; row_ptr null: none.
struct Sparse {
  const int64_t* row_ptr;
  const int32_t* col;
  const float* delta;
};

#ifdef __AVX512F__
template <int W>
inline __m512 decode16(const uint8_t* row, int64_t j, const float* table, __m512 t16) {
  if constexpr (W == 4) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (j >> 1)));
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i idx = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(idx), t16);
  } else {
    __m128i idx = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j));
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(idx), table, 4);
  }
}
#elif defined(__AVX2__)
// 8 weights a step: two 8-entry permutes cover a 16-entry table, bit 3 of the index picks the half
template <int W>
inline __m256 decode8(const uint8_t* row, int64_t j, const float* table, __m256 lo, __m256 hi) {
  if constexpr (W == 4) {
    uint32_t packed;
    std::memcpy(&packed, row + (j >> 1), 4);
    __m128i b = _mm_cvtsi32_si128(static_cast<int>(packed));
    __m128i mask = _mm_set1_epi8(0x0F);
    __m256i idx = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask)));
    __m256 from_lo = _mm256_permutevar8x32_ps(lo, idx), from_hi = _mm256_permutevar8x32_ps(hi, idx);
    return _mm256_blendv_ps(from_lo, from_hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
  } else {
    __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j)));
    return _mm256_i32gather_ps(table, idx, 4);
  }
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

// y[m, r] = sum_j table[r][idx[r, j]] * x[m, j] for M <= 8 input rows, R weight rows at a
// time (independent accumulators keep the FMA units busy when M is small).
template <int W, int M, int R>
void gemv_rows(const float* x, const uint8_t* idx, const float* tables, int64_t k, int64_t group_size,
               int64_t in, int64_t out, Sparse sp, float* y, int64_t r0, int64_t r1) {
  const int64_t row_bytes = W == 4 ? in / 2 : in;
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    const uint8_t* row[R];
    const float* table[R];
    for (int i = 0; i < R; ++i) {
      row[i] = idx + (r + i) * row_bytes;
      table[i] = tables + ((r + i) / group_size) * k;
    }
    float sums[R][M];
    int64_t j = 0;
#ifdef __AVX512F__
    __m512 t16[R];
    __m512 acc[R][M];
    for (int i = 0; i < R; ++i) {
      t16[i] = W == 4 ? _mm512_loadu_ps(table[i]) : _mm512_setzero_ps();
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
    }
    for (; j + 16 <= in; j += 16) {
      __m512 xs[M];
      for (int m = 0; m < M; ++m) xs[m] = _mm512_loadu_ps(x + m * in + j);
      for (int i = 0; i < R; ++i) {
        __m512 w = decode16<W>(row[i], j, table[i], t16[i]);
        for (int m = 0; m < M; ++m) acc[i][m] = _mm512_fmadd_ps(w, xs[m], acc[i][m]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = _mm512_reduce_add_ps(acc[i][m]);
#elif defined(__AVX2__)
    __m256 lo[R], hi[R];
    __m256 acc[R][M];
    for (int i = 0; i < R; ++i) {
      lo[i] = W == 4 ? _mm256_loadu_ps(table[i]) : _mm256_setzero_ps();
      hi[i] = W == 4 ? _mm256_loadu_ps(table[i] + 8) : _mm256_setzero_ps();
      for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
    }
    for (; j + 8 <= in; j += 8) {
      __m256 xs[M];
      for (int m = 0; m < M; ++m) xs[m] = _mm256_loadu_ps(x + m * in + j);
      for (int i = 0; i < R; ++i) {
        __m256 w = decode8<W>(row[i], j, table[i], lo[i], hi[i]);
        for (int m = 0; m < M; ++m) acc[i][m] = _mm256_fmadd_ps(w, xs[m], acc[i][m]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = sum8(acc[i][m]);
#else
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = 0.f;
#endif
    for (; j < in; ++j)
      for (int i = 0; i < R; ++i) {
        float w = table[i][index_at<W>(row[i], j)];
        for (int m = 0; m < M; ++m) sums[i][m] += w * x[m * in + j];
      }
    if (sp.row_ptr)
      for (int i = 0; i < R; ++i)
        for (int64_t p = sp.row_ptr[r + i]; p < sp.row_ptr[r + i + 1]; ++p)
          for (int m = 0; m < M; ++m) sums[i][m] += sp.delta[p] * x[m * in + sp.col[p]];
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) y[m * out + r + i] = sums[i][m];
  }
  if constexpr (R > 1) {
    if (r < r1) gemv_rows<W, M, 1>(x, idx, tables, k, group_size, in, out, sp, y, r, r1);
  }
}

template <int W>
void decode_rows(const uint8_t* idx, const float* tables, int64_t k, int64_t group_size, int64_t in, Sparse sp,
                 float* dense, int64_t r0, int64_t r1) {
  const int64_t row_bytes = W == 4 ? in / 2 : in;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = idx + r * row_bytes;
    const float* table = tables + (r / group_size) * k;
    float* out = dense + (r - r0) * in;
    int64_t j = 0;
#ifdef __AVX512F__
    __m512 t16 = W == 4 ? _mm512_loadu_ps(table) : _mm512_setzero_ps();
    for (; j + 16 <= in; j += 16) _mm512_storeu_ps(out + j, decode16<W>(row, j, table, t16));
#elif defined(__AVX2__)
    __m256 lo = W == 4 ? _mm256_loadu_ps(table) : _mm256_setzero_ps();
    __m256 hi = W == 4 ? _mm256_loadu_ps(table + 8) : _mm256_setzero_ps();
    for (; j + 8 <= in; j += 8) _mm256_storeu_ps(out + j, decode8<W>(row, j, table, lo, hi));
#endif
    for (; j < in; ++j) out[j] = table[index_at<W>(row, j)];
    if (sp.row_ptr)
      for (int64_t p = sp.row_ptr[r]; p < sp.row_ptr[r + 1]; ++p) out[sp.col[p]] += sp.delta[p];
  }
}

template <int W, int M>
void gemv(const float* x, const uint8_t* idx, const float* tables, int64_t k, int64_t gs, int64_t in, int64_t out,
          Sparse sp, float* y) {
  constexpr int R = M == 1 || M == 2 ? 4 : M <= 4 ? 2 : 1;
  at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) { gemv_rows<W, M, R>(x, idx, tables, k, gs, in, out, sp, y, r0, r1); });
}

template <int W>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& tables, int64_t group_size,
                  int64_t out, Sparse sp) {
  const int64_t batch = x.size(0), in = x.size(1), k = tables.size(1);
  const float* xp = x.data_ptr<float>();
  const uint8_t* ip = idx.data_ptr<uint8_t>();
  const float* tp = tables.data_ptr<float>();
  auto y = torch::empty({batch, out}, x.options());
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < batch; m0 += 8) {
    const int64_t m = std::min<int64_t>(8, batch - m0);
    const float* xm = xp + m0 * in;
    float* ym = yp + m0 * out;
    switch (m) {
      case 1: gemv<W, 1>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 2: gemv<W, 2>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 3: gemv<W, 3>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 4: gemv<W, 4>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 5: gemv<W, 5>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 6: gemv<W, 6>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 7: gemv<W, 7>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      default: gemv<W, 8>(xm, ip, tp, k, group_size, in, out, sp, ym);
    }
  }
  return y;
}

Sparse sparse(const torch::Tensor& row_ptr, const torch::Tensor& col, const torch::Tensor& delta, int64_t out) {
  if (row_ptr.numel() == 0) return {nullptr, nullptr, nullptr};
  TORCH_CHECK(row_ptr.scalar_type() == torch::kLong && row_ptr.is_contiguous() && row_ptr.numel() == out + 1,
              "row_ptr: contiguous int64 (out + 1)");
  TORCH_CHECK(col.scalar_type() == torch::kInt && col.is_contiguous(), "col: contiguous int32");
  TORCH_CHECK(delta.scalar_type() == torch::kFloat && delta.is_contiguous() && delta.numel() == col.numel(),
              "delta: contiguous float32, one per col");
  return {row_ptr.data_ptr<int64_t>(), col.data_ptr<int32_t>(), delta.data_ptr<float>()};
}

}  // namespace

// x (batch, in) float32; idx (out * in / 2 or out * in) uint8; tables (groups, k) float32, k = 16
// for width 4 (padded), 2^bits for width 8; row_ptr (out + 1) int64, col int32, delta float32: the
// outliers' corrections (row_ptr empty: none). Returns x @ W^T (batch, out).
torch::Tensor lut_linear(torch::Tensor x, torch::Tensor idx, torch::Tensor tables, int64_t width, int64_t group_size,
                         int64_t out, torch::Tensor row_ptr, torch::Tensor col, torch::Tensor delta) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (batch, in)");
  TORCH_CHECK(idx.scalar_type() == torch::kUInt8 && idx.is_contiguous(), "idx: contiguous uint8");
  TORCH_CHECK(tables.scalar_type() == torch::kFloat && tables.is_contiguous(), "tables: contiguous float32");
  TORCH_CHECK(width == 4 || width == 8, "width must be 4 or 8");
  TORCH_CHECK(idx.numel() * (width == 4 ? 2 : 1) == out * x.size(1), "idx size does not match (out, in)");
  const Sparse sp = sparse(row_ptr, col, delta, out);
  return width == 4 ? run<4>(x, idx, tables, group_size, out, sp) : run<8>(x, idx, tables, group_size, out, sp);
}

// The dense (out, in) weight, outliers included (prefill decodes it and hands it to the BLAS).
torch::Tensor lut_dense(torch::Tensor idx, torch::Tensor tables, int64_t width, int64_t group_size, int64_t out,
                        int64_t in, torch::Tensor row_ptr, torch::Tensor col, torch::Tensor delta) {
  const Sparse sp = sparse(row_ptr, col, delta, out);
  auto dense = torch::empty({out, in}, tables.options());
  const uint8_t* ip = idx.data_ptr<uint8_t>();
  const float* tp = tables.data_ptr<float>();
  float* dp = dense.data_ptr<float>();
  const int64_t k = tables.size(1);
  at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) {
    if (width == 4) decode_rows<4>(ip, tp, k, group_size, in, sp, dp + r0 * in, r0, r1);
    else decode_rows<8>(ip, tp, k, group_size, in, sp, dp + r0 * in, r0, r1);
  });
  return dense;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lut_linear", &lut_linear, "x @ W^T for a palettized W (look-up-table matmul)");
  m.def("lut_dense", &lut_dense, "the dense weight of a palettized layer");
}
