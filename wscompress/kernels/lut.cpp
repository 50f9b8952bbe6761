// Look-up-table matmul for palettized weights (wscompress PalettizedLinear, scalar codebooks and
// vector codebooks of 2 or 4 weights a centroid).
//
// Weight row r reads codebook r / group_size (a table of up to 16 centroids for nibble indices,
// up to 256 for byte indices). The weight is never materialised for small batches: each block
// of 16 weights (16 / D indices) is decoded into one register (AVX-512 permutes for tables that
// fit in registers, gathers otherwise; on AVX2, 8 at a time) and is multiplied into up to 8
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

// One weight row's indices and its codebook: `block(j)` decodes weights j .. j+15 (AVX-512) or
// j .. j+7 (AVX2) into a register, `at(j)` one weight. Index q names the D-vector of weights
// q*D .. q*D+D-1, entry D*index+c of the row's table. Tables small enough for registers are
// read by permutes (16 floats: D 1 with nibbles; 32: D 2 with nibbles, AVX-512 only), larger
// ones (in L1: at most 256 x 4 floats) by one load a vector (64 or 128 bits; AVX2 pairs: one
// 4-element 64-bit gather): on the AMD core measured (docs/runtime.md) AVX-512 gathers, whose
// cost grows with their elements, were slower than the dense product. On Intel cores
// (WSCOMPRESS_GATHER_PAIRS, set by the loader) AVX-512 pairs are one 8-element gather.
template <int W, int D>
struct Row {
  const uint8_t* idx;
  const float* table;
#ifdef __AVX512F__
  __m512 t0, t1;
#elif defined(__AVX2__)
  __m256 t0, t1;
#endif

  Row() = default;
  Row(const uint8_t* idx_, const float* table_) : idx(idx_), table(table_) {
#ifdef __AVX512F__
    t0 = W == 4 && D <= 2 ? _mm512_loadu_ps(table) : _mm512_setzero_ps();
    t1 = W == 4 && D == 2 ? _mm512_loadu_ps(table + 16) : _mm512_setzero_ps();
#elif defined(__AVX2__)
    t0 = W == 4 && D == 1 ? _mm256_loadu_ps(table) : _mm256_setzero_ps();
    t1 = W == 4 && D == 1 ? _mm256_loadu_ps(table + 8) : _mm256_setzero_ps();
#endif
  }

  float at(int64_t j) const { return table[index_at<W>(idx, j / D) * D + j % D]; }

  // n / D indices from index q on (n / D <= 16) as bytes, one index a byte, in order
  static inline __m128i index_bytes(const uint8_t* row, int64_t q, int n) {
    const int count = n / D, bytes = W == 4 ? count / 2 : count;
    __m128i b = _mm_setzero_si128();
    std::memcpy(&b, row + (W == 4 ? q >> 1 : q), bytes);
    if constexpr (W == 4) {
      __m128i mask = _mm_set1_epi8(0x0F);
      b = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    }
    return b;
  }

#ifdef __AVX512F__
  inline __m512 block(int64_t j) const {
    const __m128i bytes = index_bytes(idx, j / D, 16);
    if constexpr (D == 1) {
      const __m512i id = _mm512_cvtepu8_epi32(bytes);
      return W == 4 ? _mm512_permutexvar_ps(id, t0) : _mm512_i32gather_ps(id, table, 4);
    } else if constexpr (D == 2) {  // 8 indices, each a pair of floats
      if constexpr (W == 4) {  // entry 2 id + c of the 32 floats in t0, t1
        const __m512i id = _mm512_cvtepu8_epi32(bytes);
        alignas(64) static constexpr int32_t spread[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
        alignas(64) static constexpr int32_t part[16] = {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1};
        __m512i lane = _mm512_permutexvar_epi32(_mm512_load_si512(spread), id);
        lane = _mm512_add_epi32(_mm512_slli_epi32(lane, 1), _mm512_load_si512(part));
        return _mm512_permutex2var_ps(t0, lane, t1);
      } else {
#ifdef WSCOMPRESS_GATHER_PAIRS  // one gather of 8 pairs (Intel)
        return _mm512_castpd_ps(_mm512_i32gather_pd(_mm256_cvtepu8_epi32(bytes), reinterpret_cast<const double*>(table), 8));
#else  // 8 loads of 64 bits, two to a 128-bit lane
        const uint64_t q = static_cast<uint64_t>(_mm_cvtsi128_si64(bytes));
        const double* t = reinterpret_cast<const double*>(table);
        auto two = [&](int s) { return _mm_castpd_ps(_mm_loadh_pd(_mm_load_sd(t + ((q >> s) & 255)), t + ((q >> (s + 8)) & 255))); };
        const __m512 a = _mm512_insertf32x4(_mm512_castps128_ps512(two(0)), two(16), 1);
        return _mm512_insertf32x4(_mm512_insertf32x4(a, two(32), 2), two(48), 3);
#endif
      }
    } else {  // 4 indices, each 4 floats: 4 loads of 128 bits
      const uint32_t q = static_cast<uint32_t>(_mm_cvtsi128_si32(bytes));
      const __m512 a = _mm512_castps128_ps512(_mm_loadu_ps(table + 4 * (q & 255)));
      const __m512 b = _mm512_insertf32x4(a, _mm_loadu_ps(table + 4 * ((q >> 8) & 255)), 1);
      const __m512 c = _mm512_insertf32x4(b, _mm_loadu_ps(table + 4 * ((q >> 16) & 255)), 2);
      return _mm512_insertf32x4(c, _mm_loadu_ps(table + 4 * (q >> 24)), 3);
    }
  }
#elif defined(__AVX2__)
  // bit 3 of a nibble index picks the half of a 16-entry table held in two registers
  inline __m256 block(int64_t j) const {
    const __m128i bytes = index_bytes(idx, j / D, 8);
    if constexpr (D == 1) {
      const __m256i id = _mm256_cvtepu8_epi32(bytes);
      if constexpr (W == 4) {
        __m256 from_lo = _mm256_permutevar8x32_ps(t0, id), from_hi = _mm256_permutevar8x32_ps(t1, id);
        return _mm256_blendv_ps(from_lo, from_hi, _mm256_castsi256_ps(_mm256_slli_epi32(id, 28)));
      } else {
        return _mm256_i32gather_ps(table, id, 4);
      }
    } else if constexpr (D == 2) {  // 4 indices, a pair of floats each
      return _mm256_castsi256_ps(_mm256_i32gather_epi64(reinterpret_cast<const long long*>(table),
                                                        _mm_cvtepu8_epi32(bytes), 8));
    } else {  // 2 indices, 4 floats each
      const uint32_t q = static_cast<uint32_t>(_mm_cvtsi128_si32(bytes));
      return _mm256_set_m128(_mm_loadu_ps(table + 4 * ((q >> 8) & 255)), _mm_loadu_ps(table + 4 * (q & 255)));
    }
  }
#endif
};

#ifdef __AVX2__
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

// y[m, r] = sum_j W[r, j] x[m, j] for M <= 8 input rows, R weight rows at a time (independent
// accumulators keep the FMA units busy when M is small).
template <int W, int D, int M, int R>
void gemv_rows(const float* x, const uint8_t* idx, const float* tables, int64_t k, int64_t group_size,
               int64_t in, int64_t out, Sparse sp, float* y, int64_t r0, int64_t r1) {
  const int64_t row_bytes = in / D * W / 8;
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    Row<W, D> row[R];
    for (int i = 0; i < R; ++i) row[i] = Row<W, D>(idx + (r + i) * row_bytes, tables + ((r + i) / group_size) * k * D);
    float sums[R][M];
    int64_t j = 0;
#ifdef __AVX512F__
    __m512 acc[R][M];
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
    for (; j + 16 <= in; j += 16) {
      __m512 xs[M];
      for (int m = 0; m < M; ++m) xs[m] = _mm512_loadu_ps(x + m * in + j);
      for (int i = 0; i < R; ++i) {
        __m512 w = row[i].block(j);
        for (int m = 0; m < M; ++m) acc[i][m] = _mm512_fmadd_ps(w, xs[m], acc[i][m]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = _mm512_reduce_add_ps(acc[i][m]);
#elif defined(__AVX2__)
    __m256 acc[R][M];
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
    for (; j + 8 <= in; j += 8) {
      __m256 xs[M];
      for (int m = 0; m < M; ++m) xs[m] = _mm256_loadu_ps(x + m * in + j);
      for (int i = 0; i < R; ++i) {
        __m256 w = row[i].block(j);
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
        float w = row[i].at(j);
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
    if (r < r1) gemv_rows<W, D, M, 1>(x, idx, tables, k, group_size, in, out, sp, y, r, r1);
  }
}

template <int W, int D>
void decode_rows(const uint8_t* idx, const float* tables, int64_t k, int64_t group_size, int64_t in, Sparse sp,
                 float* dense, int64_t r0, int64_t r1) {
  const int64_t row_bytes = in / D * W / 8;
  for (int64_t r = r0; r < r1; ++r) {
    const Row<W, D> row(idx + r * row_bytes, tables + (r / group_size) * k * D);
    float* out = dense + (r - r0) * in;
    int64_t j = 0;
#ifdef __AVX512F__
    for (; j + 16 <= in; j += 16) _mm512_storeu_ps(out + j, row.block(j));
#elif defined(__AVX2__)
    for (; j + 8 <= in; j += 8) _mm256_storeu_ps(out + j, row.block(j));
#endif
    for (; j < in; ++j) out[j] = row.at(j);
    if (sp.row_ptr)
      for (int64_t p = sp.row_ptr[r]; p < sp.row_ptr[r + 1]; ++p) out[sp.col[p]] += sp.delta[p];
  }
}

template <int W, int D, int M>
void gemv(const float* x, const uint8_t* idx, const float* tables, int64_t k, int64_t gs, int64_t in, int64_t out,
          Sparse sp, float* y) {
  constexpr int R = M == 1 || M == 2 ? 4 : M <= 4 ? 2 : 1;
  at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) { gemv_rows<W, D, M, R>(x, idx, tables, k, gs, in, out, sp, y, r0, r1); });
}

template <int W, int D>
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
      case 1: gemv<W, D, 1>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 2: gemv<W, D, 2>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 3: gemv<W, D, 3>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 4: gemv<W, D, 4>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 5: gemv<W, D, 5>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 6: gemv<W, D, 6>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      case 7: gemv<W, D, 7>(xm, ip, tp, k, group_size, in, out, sp, ym); break;
      default: gemv<W, D, 8>(xm, ip, tp, k, group_size, in, out, sp, ym);
    }
  }
  return y;
}

// f<W, D>(...) for the runtime width and vector length
template <template <int, int> class F, typename... A>
auto dispatch(int64_t width, int64_t d, A&&... a) {
  if (width == 4) {
    if (d == 1) return F<4, 1>{}(a...);
    if (d == 2) return F<4, 2>{}(a...);
    return F<4, 4>{}(a...);
  }
  if (d == 1) return F<8, 1>{}(a...);
  if (d == 2) return F<8, 2>{}(a...);
  return F<8, 4>{}(a...);
}

template <int W, int D>
struct Linear {
  torch::Tensor operator()(const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& tables,
                           int64_t group_size, int64_t out, Sparse sp) const {
    return run<W, D>(x, idx, tables, group_size, out, sp);
  }
};

template <int W, int D>
struct Dense {
  torch::Tensor operator()(const torch::Tensor& idx, const torch::Tensor& tables, int64_t group_size, int64_t out,
                           int64_t in, Sparse sp) const {
    auto dense = torch::empty({out, in}, tables.options());
    const uint8_t* ip = idx.data_ptr<uint8_t>();
    const float* tp = tables.data_ptr<float>();
    float* dp = dense.data_ptr<float>();
    const int64_t k = tables.size(1);
    at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) { decode_rows<W, D>(ip, tp, k, group_size, in, sp, dp + r0 * in, r0, r1); });
    return dense;
  }
};

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

// The vector length D of tables (groups, k) (D 1) or (groups, k, D), checked.
int64_t vector_length(const torch::Tensor& tables, int64_t width, int64_t group_size, int64_t out, int64_t in,
                      const torch::Tensor& idx) {
  TORCH_CHECK(tables.scalar_type() == torch::kFloat && tables.is_contiguous(), "tables: contiguous float32");
  TORCH_CHECK(idx.scalar_type() == torch::kUInt8 && idx.is_contiguous(), "idx: contiguous uint8");
  TORCH_CHECK(width == 4 || width == 8, "width must be 4 or 8");
  const int64_t d = tables.dim() == 3 ? tables.size(2) : 1;
  TORCH_CHECK(tables.dim() == 2 || tables.dim() == 3, "tables: (groups, k) or (groups, k, D)");
  TORCH_CHECK(d == 1 || d == 2 || d == 4, "vector length D must be 1, 2 or 4");
  TORCH_CHECK(width == 8 || tables.size(1) == 16, "width 4 reads tables of 16 entries (pad them)");
  TORCH_CHECK(in % d == 0 && (width == 8 || in / d % 2 == 0), "a row's indices must fill whole bytes");
  TORCH_CHECK(idx.numel() * (width == 4 ? 2 : 1) == out * in / d, "idx size does not match (out, in / D)");
  TORCH_CHECK(group_size > 0 && out % group_size == 0 && tables.size(0) == out / group_size,
              "tables: one per group of group_size rows");
  return d;
}

// x (batch, in) float32; idx (out * in / D / 2 or out * in / D) uint8; tables (groups, k) or
// (groups, k, D) float32, k = 16 for width 4 (padded), 2^bits for width 8; row_ptr (out + 1)
// int64, col int32, delta float32: the outliers' corrections (row_ptr empty: none).
// Returns x @ W^T (batch, out).
torch::Tensor lut_linear(torch::Tensor x, torch::Tensor idx, torch::Tensor tables, int64_t width, int64_t group_size,
                         int64_t out, torch::Tensor row_ptr, torch::Tensor col, torch::Tensor delta) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (batch, in)");
  const int64_t d = vector_length(tables, width, group_size, out, x.size(1), idx);
  return dispatch<Linear>(width, d, x, idx, tables, group_size, out, sparse(row_ptr, col, delta, out));
}

// The dense (out, in) weight, outliers included (prefill decodes it and hands it to the BLAS).
torch::Tensor lut_dense(torch::Tensor idx, torch::Tensor tables, int64_t width, int64_t group_size, int64_t out,
                        int64_t in, torch::Tensor row_ptr, torch::Tensor col, torch::Tensor delta) {
  const int64_t d = vector_length(tables, width, group_size, out, in, idx);
  return dispatch<Dense>(width, d, idx, tables, group_size, out, in, sparse(row_ptr, col, delta, out));
}

// Registered as PyTorch operators (torch.ops.wscompress.lut_linear: x @ W^T for a palettized W;
// lut_dense: its dense weight), not a Python module: a compiled graph (torch.compile) calls them
// like any aten op; wscompress/kernels gives their shape rules.
TORCH_LIBRARY_FRAGMENT(wscompress, m) {
  m.def("lut_linear(Tensor x, Tensor idx, Tensor tables, int width, int group_size, int out, Tensor row_ptr, "
        "Tensor col, Tensor delta) -> Tensor");
  m.def("lut_dense(Tensor idx, Tensor tables, int width, int group_size, int out, int in_features, Tensor row_ptr, "
        "Tensor col, Tensor delta) -> Tensor");
}

TORCH_LIBRARY_IMPL(wscompress, CPU, m) {
  m.impl("lut_linear", &lut_linear);
  m.impl("lut_dense", &lut_dense);
}
