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
// (row_ptr, pos, delta: the exact weight minus its codebook value). Each row adds its own few
// while its sums are still in registers, so decoding pays for them in the same pass instead of
// in a separate gather-and-scatter over the output (which cost more than the kernel saved).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

// Index widths in bits: 4 (two per byte, low nibble first), 8, and 6: pairs of the 3-bit recipe
// read as stored (four in three bytes, least significant bits first, as modeling_wscompress.pack
// writes them), so its indices are held once, in 3 bits a weight, instead of also as a byte each.
template <int W>
inline int64_t index_at(const uint8_t* row, int64_t j) {
  if constexpr (W == 4) return (row[j >> 1] >> ((j & 1) * 4)) & 15;
  else if constexpr (W == 6) {
    const uint8_t* p = row + (j >> 2) * 3;
    return ((p[0] | p[1] << 8 | p[2] << 16) >> ((j & 3) * 6)) & 63;
  } else return row[j];
}

// 8 6-bit indices (the low 48 bits of v) as 8 bytes
inline uint64_t spread6(uint64_t v) {
#ifdef __BMI2__
  return _pdep_u64(v, 0x3F3F3F3F3F3F3F3FULL);
#else
  uint64_t out = 0;
  for (int i = 0; i < 8; ++i) out |= ((v >> (6 * i)) & 63) << (8 * i);
  return out;
#endif
}

// The outliers' corrections, CSR by weight row; row_ptr null: none. Their positions are flat in
// the (out, in) weight: the stored ones, read as they are (a column more a row costs bytes).
// The corrections are float16 where the layer stores its values so, else float32. The byte
// products also end each row here with its scale (`scale`, float16 or float32, as the layer
// holds them; null: none): one multiply in the row's store, not one more operator a call.
struct Sparse {
  const int32_t* row_ptr;
  const int32_t* pos;
  const void* delta;
  bool half;
  int64_t in;
  const void* scale = nullptr;
  bool scale_half = false;
  int64_t col(int64_t p, int64_t r) const { return pos[p] - r * in; }
  float d(int64_t p) const {
    return half ? static_cast<float>(static_cast<const at::Half*>(delta)[p]) : static_cast<const float*>(delta)[p];
  }
  float s(int64_t r) const {
    return scale_half ? static_cast<float>(static_cast<const at::Half*>(scale)[r]) : static_cast<const float*>(scale)[r];
  }
};

// One weight row's indices and its codebook: `block(j)` decodes weights j .. j+15 (AVX-512) or
// j .. j+7 (AVX2) into a register, `at(j)` one weight. Index q names the D-vector of weights
// q*D .. q*D+D-1, entry D*index+c of the row's table. Tables small enough for registers are
// read by permutes (16 floats: D 1 with nibbles; 32: D 2 with nibbles, AVX-512 only), larger
// ones (in L1: at most 256 x 4 floats) by one load a vector (64 or 128 bits): on the AMD core
// measured (docs/runtime.md) AVX-512 gathers, whose cost grows with their elements, were slower
// than the dense product. On Intel cores (WSCOMPRESS_GATHER_PAIRS, set by the loader) pairs are
// one gather (8 of them on AVX-512, 4 on AVX2, where loads and the gather timed alike).
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

  // n / D indices from index q on (n / D <= 16; for 6 bits, <= 8 from a multiple of 4) as bytes,
  // one index a byte, in order
  static inline __m128i index_bytes(const uint8_t* row, int64_t q, int n) {
    const int count = n / D, bytes = count * W / 8;
    __m128i b = _mm_setzero_si128();
    if constexpr (W == 6) {  // 8 indices (AVX-512) or 4 (AVX2), read by whole loads combined in a register:
      // copying 6 bytes into a 64-bit variable stored it in parts and read it back whole, a
      // store-forwarding stall that made the float product 9x slower
      const uint8_t* p = row + q / 4 * 3;
      uint64_t v;
      if (count == 8) {
        uint32_t lo;
        uint16_t hi;
        std::memcpy(&lo, p, 4), std::memcpy(&hi, p + 4, 2);
        v = lo | static_cast<uint64_t>(hi) << 32;
      } else {
        uint16_t lo;
        std::memcpy(&lo, p, 2);
        v = lo | static_cast<uint64_t>(p[2]) << 16;
      }
      return _mm_cvtsi64_si128(static_cast<int64_t>(spread6(v)));
    }
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
#ifdef WSCOMPRESS_GATHER_PAIRS  // one gather of 4 pairs (Intel)
      return _mm256_castsi256_ps(_mm256_i32gather_epi64(reinterpret_cast<const long long*>(table),
                                                        _mm_cvtepu8_epi32(bytes), 8));
#else  // 4 loads of 64 bits, as AVX-512 does where gathers are slow (AMD)
      const uint32_t q = static_cast<uint32_t>(_mm_cvtsi128_si32(bytes));
      const double* t = reinterpret_cast<const double*>(table);
      const __m128d lo = _mm_loadh_pd(_mm_load_sd(t + (q & 255)), t + ((q >> 8) & 255));
      const __m128d hi = _mm_loadh_pd(_mm_load_sd(t + ((q >> 16) & 255)), t + (q >> 24));
      return _mm256_castpd_ps(_mm256_set_m128d(hi, lo));
#endif
    } else {  // 2 indices, 4 floats each
      const uint32_t q = static_cast<uint32_t>(_mm_cvtsi128_si32(bytes));
      return _mm256_set_m128(_mm_loadu_ps(table + 4 * ((q >> 8) & 255)), _mm_loadu_ps(table + 4 * (q & 255)));
    }
  }
#endif
};

// Asks for the cache line holding p (the rows after the block in work, at the same column): the
// hardware prefetchers stop at every 4 KB page and start again slowly, which made a token's
// layers, each a few pages read once from L3, take 1.4x as long as the same products repeated
// (docs/runtime.md). A prefetch past the end of the indices is harmless.
inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

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
      if ((j / D * W / 8) % 64 == 0)
        for (int i = 0; i < R; ++i) prefetch(idx + (r + i + R) * row_bytes + j / D * W / 8);
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
      if ((j / D * W / 8) % 64 == 0)
        for (int i = 0; i < R; ++i) prefetch(idx + (r + i + R) * row_bytes + j / D * W / 8);
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
          for (int m = 0; m < M; ++m) sums[i][m] += sp.d(p) * x[m * in + sp.col(p, r + i)];
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
      for (int64_t p = sp.row_ptr[r]; p < sp.row_ptr[r + 1]; ++p) out[sp.col(p, r)] += sp.d(p);
  }
}

template <int W, int D, int M>
void gemv(const float* x, const uint8_t* idx, const float* tables, int64_t k, int64_t gs, int64_t in, int64_t out,
          Sparse sp, float* y) {
  constexpr int R = M == 1 || M == 2 ? 4 : M <= 4 ? 2 : 1;
  at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) { gemv_rows<W, D, M, R>(x, idx, tables, k, gs, in, out, sp, y, r0, r1); });
}

// f(M, m0) for each chunk of at most 8 input rows from row m0, M (a compile-time constant) its rows
template <typename F>
void by_chunks(int64_t batch, F&& f) {
  for (int64_t m0 = 0; m0 < batch; m0 += 8) {
    switch (std::min<int64_t>(8, batch - m0)) {
      case 1: f(std::integral_constant<int, 1>{}, m0); break;
      case 2: f(std::integral_constant<int, 2>{}, m0); break;
      case 3: f(std::integral_constant<int, 3>{}, m0); break;
      case 4: f(std::integral_constant<int, 4>{}, m0); break;
      case 5: f(std::integral_constant<int, 5>{}, m0); break;
      case 6: f(std::integral_constant<int, 6>{}, m0); break;
      case 7: f(std::integral_constant<int, 7>{}, m0); break;
      default: f(std::integral_constant<int, 8>{}, m0);
    }
  }
}

template <int W, int D>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& tables, int64_t group_size,
                  int64_t out, Sparse sp) {
  const int64_t in = x.size(1), k = tables.size(1);
  const float* xp = x.data_ptr<float>();
  const uint8_t* ip = idx.data_ptr<uint8_t>();
  const float* tp = tables.data_ptr<float>();
  auto y = torch::empty({x.size(0), out}, x.options());
  float* yp = y.data_ptr<float>();
  by_chunks(x.size(0), [&](auto M, int64_t m0) {
    gemv<W, D, decltype(M)::value>(xp + m0 * in, ip, tp, k, group_size, in, out, sp, yp + m0 * out);
  });
  return y;
}

// ---- Decoding with byte products (lut_linear_q8) ----
// The float path above spends its time looking up tables that do not fit in registers (a
// dependent load or gather per index), not reading memory. Here each group's table comes
// rounded to 12-bit integers with a scale, split into a high byte and a low nibble
// (modeling_wscompress.round_tables: 8 bits cost 1 % of perplexity, docs/runtime.md), each input
// row as two signed bytes a value with a scale per block of 32 (Q8X), and every product is of
// bytes, as in llama.cpp's Q4_0 x Q8_0 product. On AVX-512 (BW, VBMI, VNNI) a 256-entry byte
// table sits in four registers and two two-source byte permutes and a blend look up 64 indices
// (a nibble table: one register, a byte shuffle per 64), and VPDPBUSD multiplies 64 bytes into
// the sums in one instruction. On AVX2 a nibble table takes one VPSHUFB, a 64-entry one (6-bit
// pairs) four and three blends, and VPMADDUBSW multiplies; byte indices keep the float path. Layouts:
// scalar nibble tables (width 4, D 1), 6-bit indices of pairs (the 3-bit recipe, spread to bytes
// by a byte permute and VPMULTISHIFTQB, on AVX2 by shifts), and on AVX-512 byte indices of
// single weights (5-8-bit scalar tables), of pairs (the 4-bit recipe) and of 4-d vectors (the
// 2-bit recipe); rows of a multiple of 32 weights.
constexpr int QBLOCK = 32;  // weights an activation scale covers

// Components an index byte's products take: the two weights of a nibble byte, or the D weights a
// byte index names (D 1: every weight in order).
template <int W, int D>
constexpr int components() { return W == 4 ? 2 : D; }

// Entries of a table as round_tables lays it out: what the index width reaches (6 bits: 64)
constexpr int entries(int64_t width) { return width == 4 ? 16 : width == 6 ? 64 : 256; }

// Whether a layout's tables keep 16 bits (256 hi + lo, a lo byte a component) rather than 12
// (16 hi + lo, two lo nibbles a byte): 4-d vectors, whose one table a matrix spans its extreme
// centroids (see round_tables)
constexpr bool wide(int64_t d) { return d == 4; }

// Rows of lo bytes a byte-indexed table has (after its D rows of hi bytes)
constexpr int lo_rows(int64_t d) { return wide(d) ? d : (d + 1) / 2; }

// Bytes a group's rounded table takes: D rows of hi bytes and lo_rows(D) of lo bytes, K entries
// each (nibbles: 16 hi and 16 lo)
constexpr int64_t table_bytes(int64_t width, int64_t d) { return width == 4 ? 32 : entries(width) * (d + lo_rows(d)); }

#if defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define WSCOMPRESS_Q8_512
#define WSCOMPRESS_Q8
constexpr int QSTEP = 64;  // index bytes a step
constexpr bool Q8_OFFSET = true;  // VPDPBUSD takes the tables' hi bytes unsigned: Q8X.sum1, sum2 correct it
#elif defined(__AVX2__)
#define WSCOMPRESS_Q8
constexpr int QSTEP = 32;
constexpr bool Q8_OFFSET = false;  // VPMADDUBSW takes them signed (the sign trick)
#endif

#ifdef WSCOMPRESS_Q8
// The largest magnitude of a block of QBLOCK inputs, and the block as q1 = round(v), q2 =
// round(256 (v - q1)) clamped to +-127 for v = x inv: vectorised, as each decode call
// quantises its inputs on one thread before the product's threads start (at 2048 inputs the
// scalar loop took about as long as 64 rows of the product), with the scalar loop's results.
inline float block_amax(const float* xb) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)), _mm512_abs_ps(_mm512_loadu_ps(xb + 16))));
#else
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb));
  for (int k = 8; k < QBLOCK; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + k)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
#endif
}

inline void quantize_block(const float* xb, float inv, int8_t* q1, int8_t* q2) {
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#ifdef __AVX512F__
  const __m512 k = _mm512_set1_ps(inv), step = _mm512_set1_ps(256.f), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int j = 0; j < QBLOCK; j += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xb + j), k), r = _mm512_roundscale_ps(v, nearest);
    const __m512 f = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, r), step), nearest), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(f)));
  }
#else
  const __m256 k = _mm256_set1_ps(inv), step = _mm256_set1_ps(256.f), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  auto bytes = [](__m256 v) {  // 8 integral floats in -127..127 to 8 bytes
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    return _mm_packs_epi16(w, w);
  };
  for (int j = 0; j < QBLOCK; j += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + j), k), r = _mm256_round_ps(v, nearest);
    const __m256 f = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(v, r), step), nearest), lo), hi);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q1 + j), bytes(r));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q2 + j), bytes(f));
  }
#endif
}

// Input rows as the kernel reads them: each value x is s (q1 + q2 / 256) with q1, q2 signed bytes
// (q2 rounds what q1 left, so the row keeps about 16 bits: 8 alone cost 0.15 % of perplexity,
// docs/runtime.md) and s the largest magnitude / 127 of the row (AVX-512: one scale, so that
// q8_block's sums stay integers to the row's end) or of each block of 32 (AVX2, whose 16-bit
// pair sums VPMADDUBSW makes are scaled into floats a block at a time). at(c, t, m): term t (q1,
// q2) of row m for component c of C: the weights that component of an index byte multiplies
// (x[C q + c]: nibble layouts hold weights 2q and 2q + 1 in byte q, pairs and 4-d vectors are
// the C weights index q names, a byte a weight (C 1) is every weight in order); zero-padded to
// whole steps. `lane` (AVX2): s / 256 for each sum lane (4 index bytes: 4 C weights); `row`
// (AVX-512): s / 256 of each row, and `sum1`, `sum2` its q1 and q2 summed, which the tables'
// hi bytes (taken unsigned by VPDPBUSD, hi + 128) add 128 times to the hi sums.
struct Q8X {
  int64_t span, lanes, parts;
  std::vector<int8_t> bytes;
  std::vector<float> lane;  // AVX2 only
  std::vector<float> row;  // AVX-512 only: s / 256 of each row
  std::vector<int64_t> sum1, sum2;  // AVX-512 only: each row's q1 and q2 summed (what hi + 128 adds)

  Q8X(const float* x, int64_t M, int64_t in, int C)
      : span((in / C + QSTEP - 1) / QSTEP * QSTEP), lanes(span / 4), parts(C), bytes(M * 2 * parts * span),
        lane(Q8_OFFSET ? 0 : M * lanes), row(Q8_OFFSET ? M : 0), sum1(Q8_OFFSET ? M : 0), sum2(Q8_OFFSET ? M : 0) {
    const int per_block = QBLOCK / (4 * C);  // lanes a block
    std::vector<int8_t> q1(in), q2(in);
    for (int64_t m = 0; m < M; ++m) {
      if constexpr (Q8_OFFSET) {  // one scale a row, so that its sums stay integers to its end (q8_block)
        float amax = 0.f;
        for (int64_t b = 0; b < in / QBLOCK; ++b) amax = std::max(amax, block_amax(x + m * in + b * QBLOCK));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int64_t b = 0; b < in / QBLOCK; ++b)
          quantize_block(x + m * in + b * QBLOCK, inv, q1.data() + b * QBLOCK, q2.data() + b * QBLOCK);
        row[m] = amax / 127.f / 256.f;
        int64_t s1 = 0, s2 = 0;
        for (int64_t j = 0; j < in; ++j) s1 += q1[j], s2 += q2[j];
        sum1[m] = s1, sum2[m] = s2;
      } else {
        for (int64_t b = 0; b < in / QBLOCK; ++b) {
          const float* xb = x + m * in + b * QBLOCK;
          const float amax = block_amax(xb);
          const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
          quantize_block(xb, inv, q1.data() + b * QBLOCK, q2.data() + b * QBLOCK);
          for (int l = 0; l < per_block; ++l) lane[m * lanes + b * per_block + l] = scale / 256.f;
        }
      }
      for (int t = 0; t < 2; ++t) {
        const int8_t* q = t ? q2.data() : q1.data();
        for (int c = 0; c < C; ++c) {
          int8_t* dst = at(c, t, m);
          for (int64_t j = 0; j < in / C; ++j) dst[j] = q[C * j + c];
        }
      }
    }
  }

  int8_t* at(int c, int t, int64_t m) { return bytes.data() + ((m * 2 + t) * parts + c) * span; }
  const int8_t* at(int c, int t, int64_t m) const { return bytes.data() + ((m * 2 + t) * parts + c) * span; }
};

// y[r] = sum plus row r's outlier corrections (on the float input row x)
inline void q8_store(float sum, Sparse sp, const float* x, float* y, int64_t r) {
  if (sp.row_ptr)
    for (int64_t p = sp.row_ptr[r]; p < sp.row_ptr[r + 1]; ++p) sum += sp.d(p) * x[sp.col(p, r)];
  y[r] = sp.scale ? sum * sp.s(r) : sum;
}

#ifdef WSCOMPRESS_Q8_512
// A group's table in registers: each value v (12 bits, see round_tables) as 16 hi + lo, hi a
// signed byte held unsigned (hi + 128: VPDPBUSD's unsigned operand) and lo in 0..15. Byte
// indices (K = 256 entries, or 64 for 6 bits: R = K / 64 registers a row of the table):
// component c of entry e is byte e of hi[R c .. R c + R - 1], its lo nibble byte e of
// lo[R (c / 2) ..] at bit 4 (c % 2) (two components a byte); nibbles: entry e is byte e of every
// 128-bit lane of hi[0] and lo[0].
template <int W, int D>
struct Q8Table {
  static constexpr int LO = lo_rows(D);  // lo bytes an entry
  static constexpr int R = W != 4 ? entries(W) / 64 : 1;
  __m512i hi[R * D], lo[R * LO];
  float scale;

  // q: the group's hi bytes (component-major, D x K, or 16 for nibbles), then its lo bytes (LO x K, or 16)
  void load(const int8_t* q, float scale_) {
    scale = wide(D) ? 256.f * scale_ : scale_;  // wide sums are counted in units of 256 (q8_block)
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    if constexpr (W != 4) {
      for (int i = 0; i < R * D; ++i) hi[i] = _mm512_xor_si512(_mm512_loadu_si512(q + 64 * i), offset);
      for (int i = 0; i < R * LO; ++i) lo[i] = _mm512_loadu_si512(q + 64 * (R * D + i));
    } else {
      hi[0] = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), offset);
      lo[0] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    }
  }

  // the hi and lo bytes of the components of 64 index bytes (n of them real, the rest read as 0;
  // 6-bit indices: 64 indices from 48 bytes, n of them real): components<W, D>() of them
  inline void decode(const uint8_t* p, int64_t n, __m512i (&h)[components<W, D>()],
                     __m512i (&l)[components<W, D>()]) const {
    __m512i id;
    if constexpr (W == 6) {  // bytes 6k .. 6k + 5 to quadword k, then each index's 6 bits to a byte of its own
      alignas(64) static constexpr uint8_t gather[64] = {
          0, 1, 2, 3, 4, 5, 0, 0, 6, 7, 8, 9, 10, 11, 0, 0, 12, 13, 14, 15, 16, 17, 0, 0,
          18, 19, 20, 21, 22, 23, 0, 0, 24, 25, 26, 27, 28, 29, 0, 0, 30, 31, 32, 33, 34, 35, 0, 0,
          36, 37, 38, 39, 40, 41, 0, 0, 42, 43, 44, 45, 46, 47, 0, 0};
      const int64_t bytes = n >= 64 ? 48 : (n * 6 + 7) / 8;
      const __m512i packed = _mm512_maskz_loadu_epi8((1ULL << bytes) - 1, p);
      const __m512i words = _mm512_permutexvar_epi8(_mm512_load_si512(gather), packed);
      const __m512i shifts = _mm512_set1_epi64(0x2A241E18120C0600LL);  // bit offsets 0, 6, .., 42
      id = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, words), _mm512_set1_epi8(63));
    } else {
      id = n >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ULL << n) - 1, p);
    }
    if constexpr (W != 4) {
      const __mmask64 high = _mm512_movepi8_mask(id);  // index >= 128
      auto look = [&](const __m512i* t) {
        // 6-bit indices reach 64 entries, one register: one single-source permute (VPERMB, one
        // uop) instead of two two-source ones and a blend
        if constexpr (W == 6) return _mm512_permutexvar_epi8(id, t[0]);
        else return _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t[0], id, t[1]), _mm512_permutex2var_epi8(t[2], id, t[3]));
      };
      for (int c = 0; c < D; ++c) h[c] = look(hi + R * c);
      if constexpr (D == 1) {
        l[0] = look(lo);  // its high nibble is zero
      } else if constexpr (wide(D)) {
        for (int c = 0; c < D; ++c) l[c] = look(lo + R * c);
      } else {
        const __m512i nibble = _mm512_set1_epi8(15);
        for (int b = 0; b < LO; ++b) {
          const __m512i both = look(lo + R * b);
          l[2 * b] = _mm512_and_si512(both, nibble), l[2 * b + 1] = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
        }
      }
    } else {
      const __m512i nibble = _mm512_set1_epi8(15);
      const __m512i a = _mm512_and_si512(id, nibble), b = _mm512_and_si512(_mm512_srli_epi16(id, 4), nibble);
      h[0] = _mm512_shuffle_epi8(hi[0], a), h[1] = _mm512_shuffle_epi8(hi[0], b);
      l[0] = _mm512_shuffle_epi8(lo[0], a), l[1] = _mm512_shuffle_epi8(lo[0], b);
    }
  }
};

// Weight rows ahead whose lines a block asks for (the same column): one block of N ahead (4 KB at
// TinyLlama's 2048 inputs) left the products waiting on memory, 32 rows ahead measured slower
// than 16 (the sweep: docs/kernels.md)
constexpr int64_t Q8_AHEAD = 16;

template <int W, int D, int M, int N>
inline void q8_block(const Q8Table<W, D>& tab, const Q8X& x, const uint8_t* idx, int64_t row_bytes, Sparse sp,
                     const float* xf, int64_t in, int64_t out, float* y, int64_t r) {
  // the three products' sums, each exact in int32 over a whole row (|hi + 128| <= 255, |q| <= 127:
  // 16 lanes of 4 bytes reach 2^31 past a million inputs): hi q1, lo q1 and hi q2. Kept apart to
  // the row's end, they cost the step only its byte products (a block's sums scaled into floats
  // took 8 more instructions a row and step than its 6 products at 4 bits)
  __m512i s1[N][M], s2[N][M], s3[N][M];
  for (int i = 0; i < N; ++i)
    for (int m = 0; m < M; ++m) s1[i][m] = s2[i][m] = s3[i][m] = _mm512_setzero_si512();
  constexpr int C = components<W, D>();
  const int64_t units = W == 6 ? row_bytes / 3 * 4 : row_bytes;  // index bytes a row as decoded (6 bits: one a byte)
  for (int64_t q = 0; q < units; q += 64) {
    const int64_t at = W == 6 ? q / 4 * 3 : q;  // where they are stored
    __m512i xs[M][2][C];  // term, component
    for (int m = 0; m < M; ++m)
      for (int t = 0; t < 2; ++t)
        for (int c = 0; c < C; ++c) xs[m][t][c] = _mm512_loadu_si512(x.at(c, t, m) + q);
    for (int i = 0; i < N; ++i) {
      __m512i h[C], l[C];
      tab.decode(idx + (r + i) * row_bytes + at, units - q, h, l);
      prefetch(idx + (r + i + Q8_AHEAD) * row_bytes + at);
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) {
          s1[i][m] = _mm512_dpbusd_epi32(s1[i][m], h[c], xs[m][0][c]);
          s2[i][m] = _mm512_dpbusd_epi32(s2[i][m], l[c], xs[m][0][c]);
          s3[i][m] = _mm512_dpbusd_epi32(s3[i][m], h[c], xs[m][1][c]);
        }
    }
  }
  // (16 hi + lo)(256 q1 + q2) without lo q2, which stays below 2^-12 of the largest product;
  // wide: (256 hi + lo)(256 q1 + q2) / 256 without lo q2 / 256 (2^-16). The tables' hi + 128 added
  // 128 q to each hi sum: taken away in integers, where it would cancel against the sum's digits.
  for (int i = 0; i < N; ++i)
    for (int m = 0; m < M; ++m) {
      const int64_t hq1 = _mm512_reduce_add_epi32(s1[i][m]) - 128 * x.sum1[m];
      const int64_t lq1 = _mm512_reduce_add_epi32(s2[i][m]), hq2 = _mm512_reduce_add_epi32(s3[i][m]) - 128 * x.sum2[m];
      const double d = wide(D) ? 256. * hq1 + lq1 + hq2 : 4096. * hq1 + 256. * lq1 + 16. * hq2;
      q8_store(static_cast<float>(d * x.row[m]) * tab.scale, sp, xf + m * in, y + m * out, r + i);
    }
}
#else
// AVX2: tables VPSHUFB reaches, hi signed and lo in 0..15, each 16 entries in both 128-bit
// lanes of a register: nibbles (16 entries: hi, lo) and pairs' 6-bit indices (64 entries: four
// registers a row, picked by three blends, for the rows hi of component 0, hi of 1, and lo, two
// nibbles a byte). Byte indices keep the float path: 256 entries cost sixteen shuffles and
// fifteen blends a row, more than the float path's gather.
template <int W, int D>
struct Q8Table {
  static constexpr int REGS = W == 6 ? 12 : 2;
  __m256i t[REGS];
  float scale;

  void load(const int8_t* q, float scale_) {
    scale = scale_;
    for (int i = 0; i < REGS; ++i) t[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i)));
  }

  // the hi and lo bytes of both components of 32 index units (n of them real: 32, or 16 at a
  // row's end): nibble bytes (weights 2q, 2q + 1) or 6-bit indices of pairs, four in three bytes
  inline void decode(const uint8_t* p, int64_t n, __m256i (&h)[2], __m256i (&l)[2]) const {
    const __m256i nibble = _mm256_set1_epi8(15);
    if constexpr (W == 6) {
      alignas(32) uint8_t tail[32] = {};
      if (n < 32) std::memcpy(tail, p, n / 4 * 3), p = tail;  // never read past the indices
      // bytes 0..11 to the low lane, 12..23 to the high, each three to a dword, each 6 bits to a byte
      const __m256i packed = _mm256_set_m128i(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16)),
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256i lanes = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 1, 2, 0, 3, 4, 5, 0));
      const __m256i v = _mm256_shuffle_epi8(lanes, _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,
                                                                    0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1));
      const __m256i id = _mm256_or_si256(
          _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0x3F)), _mm256_and_si256(_mm256_slli_epi32(v, 2), _mm256_set1_epi32(0x3F00))),
          _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(v, 4), _mm256_set1_epi32(0x3F0000)),
                          _mm256_and_si256(_mm256_slli_epi32(v, 6), _mm256_set1_epi32(0x3F000000))));
      const __m256i bit4 = _mm256_slli_epi16(id, 3), bit5 = _mm256_slli_epi16(id, 2);  // to each byte's bit 7, what blends read
      auto look = [&](const __m256i* r) {
        const __m256i a = _mm256_blendv_epi8(_mm256_shuffle_epi8(r[0], id), _mm256_shuffle_epi8(r[1], id), bit4);
        const __m256i b = _mm256_blendv_epi8(_mm256_shuffle_epi8(r[2], id), _mm256_shuffle_epi8(r[3], id), bit4);
        return _mm256_blendv_epi8(a, b, bit5);
      };
      h[0] = look(t), h[1] = look(t + 4);
      const __m256i both = look(t + 8);
      l[0] = _mm256_and_si256(both, nibble), l[1] = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
    } else {
      const __m256i id = n >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                 : _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256i a = _mm256_and_si256(id, nibble), b = _mm256_and_si256(_mm256_srli_epi16(id, 4), nibble);
      h[0] = _mm256_shuffle_epi8(t[0], a), h[1] = _mm256_shuffle_epi8(t[0], b);
      l[0] = _mm256_shuffle_epi8(t[1], a), l[1] = _mm256_shuffle_epi8(t[1], b);
    }
  }
};

// VPMADDUBSW multiplies unsigned by signed bytes: |hi| by x with hi's sign (a pair's sum fits 16
// bits), lo (0..15) by x as they are.
inline __m256i q8_dot_signed(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

template <int W, int D, int M, int N>
inline void q8_block(const Q8Table<W, D>& tab, const Q8X& x, const uint8_t* idx, int64_t row_bytes, Sparse sp,
                     const float* xf, int64_t in, int64_t out, float* y, int64_t r) {
  __m256 acc[N][M];
  for (int i = 0; i < N; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t units = W == 6 ? row_bytes / 3 * 4 : row_bytes;  // index units a row (6 bits: four in three bytes)
  for (int64_t q = 0; q < units; q += 32) {  // 64 weights a step; the last may hold 32
    __m256i xs[M][2][2];  // term, component
    __m256 sc[M];
    for (int m = 0; m < M; ++m) {
      for (int t = 0; t < 2; ++t)
        for (int c = 0; c < 2; ++c) xs[m][t][c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.at(c, t, m) + q));
      sc[m] = _mm256_loadu_ps(x.lane.data() + m * x.lanes + q / 4);
    }
    for (int i = 0; i < N; ++i) {
      const uint8_t* p = idx + (r + i) * row_bytes + (W == 6 ? q / 4 * 3 : q);
      if (q % 64 == 0) prefetch(p + N * row_bytes);
      __m256i h[2], l[2];
      tab.decode(p, units - q, h, l);
      for (int m = 0; m < M; ++m) {
        auto hi = [&](int t) { return _mm256_add_epi32(q8_dot_signed(h[0], xs[m][t][0]), q8_dot_signed(h[1], xs[m][t][1])); };
        const __m256i lo = _mm256_madd_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(l[0], xs[m][0][0]), _mm256_maddubs_epi16(l[1], xs[m][0][1])), ones);
        // (16 hi + lo)(256 q1 + q2) without lo q2, which stays below 2^-12 of the largest product
        const __m256i first = _mm256_add_epi32(_mm256_slli_epi32(hi(0), 4), lo);
        const __m256i d = _mm256_add_epi32(_mm256_slli_epi32(first, 8), _mm256_slli_epi32(hi(1), 4));
        acc[i][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc[m], acc[i][m]);
      }
    }
  }
  for (int i = 0; i < N; ++i)
    for (int m = 0; m < M; ++m) q8_store(tab.scale * sum8(acc[i][m]), sp, xf + m * in, y + m * out, r + i);
}
#endif

// Rows r0 .. r1: R at a time where they share a table, one at a time across a group's edge.
template <int W, int D, int M, int R>
void q8_rows(const Q8X& x, const float* xf, const uint8_t* idx, const int8_t* tables, const float* scales, int64_t gs,
             int64_t in, int64_t out, Sparse sp, float* y, int64_t r0, int64_t r1) {
  constexpr int64_t size = table_bytes(W, D);
  const int64_t row_bytes = in * W / 8 / D;
  Q8Table<W, D> tab;
  int64_t loaded = -1;
  for (int64_t r = r0; r < r1;) {
    const int64_t g = r / gs;
    if (g != loaded) tab.load(tables + g * size, scales[g]), loaded = g;
    if (r + R <= r1 && (r + R - 1) / gs == g) {
      q8_block<W, D, M, R>(tab, x, idx, row_bytes, sp, xf, in, out, y, r);
      r += R;
    } else {
      q8_block<W, D, M, 1>(tab, x, idx, row_bytes, sp, xf, in, out, y, r);
      r += 1;
    }
  }
}

template <int W, int D, int M>
void q8_gemv(const float* xf, const uint8_t* idx, const int8_t* tables, const float* scales, int64_t gs, int64_t in,
             int64_t out, Sparse sp, float* y) {
  constexpr int R = M == 1 || M == 2 ? 4 : M <= 4 ? 2 : 1;
  const Q8X x(xf, M, in, components<W, D>());
  at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) { q8_rows<W, D, M, R>(x, xf, idx, tables, scales, gs, in, out, sp, y, r0, r1); });
}
#endif  // WSCOMPRESS_Q8

// ---- Prefill's integer weights (lut_dense_q8, and the 16-bit path's rows) ----
// Prefill multiplies the weight as decoding's byte products see it (the rounded tables: v = 16 hi
// + lo, or 256 hi + lo for 4-d vectors), decoded in weight order: as 16-bit values (linear_i16),
// or for torch._int_mm as two int8 planes, the hi bytes and lo (0..15; 4-d vectors: lo - 128, so
// that it is signed too). Decoding and prefill then multiply the same values; 8-bit tables alone
// cost 0.8-1.1 % of perplexity.

// Weight j of a row: its value's hi and lo parts, from its group's table (scalar: builds without
// AVX-512 VBMI)
template <int W, int D>
inline void q8_weight(const uint8_t* row, const int8_t* table, int64_t j, int8_t& hi, int8_t& lo) {
  constexpr int64_t K = entries(W);
  const int c = static_cast<int>(j % D);
  const int64_t e = index_at<W>(row, j / D);
  const uint8_t l = static_cast<uint8_t>(table[(D + (wide(D) ? c : c / 2)) * K + e]);
  hi = table[c * K + e];
  lo = static_cast<int8_t>(wide(D) ? l ^ 0x80 : (l >> (4 * (c % 2))) & 15);
}

#ifdef WSCOMPRESS_Q8_512
// Permute indices that zip two registers of N elements: element j of the first result is element
// j / 2 of source j % 2, of the second element N / 2 + j / 2
template <typename T, int N>
struct Zip {
  T first[N], second[N];
};
template <typename T, int N>
constexpr Zip<T, N> zip() {
  Zip<T, N> z{};
  for (int j = 0; j < N; ++j)
    z.first[j] = static_cast<T>(j % 2 * N + j / 2), z.second[j] = static_cast<T>(j % 2 * N + N / 2 + j / 2);
  return z;
}

// The C registers of a step's components (byte i of v[c]: component c of index i) in weight order
// (byte C i + c of the C registers in turn): bytes zipped, then (C 4) 16-bit words
template <int C>
inline void in_order(__m512i (&v)[C]) {
  if constexpr (C > 1) {
    static constexpr Zip<uint8_t, 64> b = zip<uint8_t, 64>();
    static constexpr Zip<uint16_t, 32> w = zip<uint16_t, 32>();
    const __m512i b1 = _mm512_loadu_si512(b.first), b2 = _mm512_loadu_si512(b.second);
    const __m512i a0 = _mm512_permutex2var_epi8(v[0], b1, v[1]), a1 = _mm512_permutex2var_epi8(v[0], b2, v[1]);
    if constexpr (C == 2) {
      v[0] = a0, v[1] = a1;
    } else {
      const __m512i c0 = _mm512_permutex2var_epi8(v[2], b1, v[3]), c1 = _mm512_permutex2var_epi8(v[2], b2, v[3]);
      const __m512i w1 = _mm512_loadu_si512(w.first), w2 = _mm512_loadu_si512(w.second);
      v[0] = _mm512_permutex2var_epi16(a0, w1, c0), v[1] = _mm512_permutex2var_epi16(a0, w2, c0);
      v[2] = _mm512_permutex2var_epi16(a1, w1, c1), v[3] = _mm512_permutex2var_epi16(a1, w2, c1);
    }
  }
}

// A row's in weights from its `units` indices, 64 indices a step through the decode products use:
// store(at, n, h, l) takes weights at .. at + n - 1 (n <= 64) as signed hi bytes and lo bytes
template <int W, int D, typename Store>
void q8_dense_row(const Q8Table<W, D>& tab, const uint8_t* row, int64_t units, int64_t in, Store&& store) {
  constexpr int C = components<W, D>();
  constexpr int64_t per = W == 4 ? 2 : D;  // weights an index byte (nibbles: two) or index names
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t q = 0; q < units; q += 64) {
    __m512i h[C], l[C];
    tab.decode(row + (W == 6 ? q / 4 * 3 : q), units - q, h, l);
    for (int c = 0; c < C; ++c) {
      h[c] = _mm512_xor_si512(h[c], flip);  // the table holds hi + 128, VPDPBUSD's unsigned operand
      if constexpr (wide(D)) l[c] = _mm512_xor_si512(l[c], flip);
    }
    in_order(h), in_order(l);
    for (int k = 0; k < C; ++k) {
      const int64_t at = q * per + 64 * k, n = std::min<int64_t>(64, in - at);
      if (n <= 0) break;
      store(at, n, h[k], l[k]);
    }
  }
}

inline __mmask64 first_bytes(int64_t n) { return n >= 64 ? ~0ULL : (1ULL << n) - 1; }
#endif

template <int W, int D>
void q8_dense_rows(const uint8_t* idx, const int8_t* tables, int64_t gs, int64_t in, int64_t out, int8_t* dense,
                   int64_t r0, int64_t r1) {
  const int64_t row_bytes = in / D * W / 8;
#ifdef WSCOMPRESS_Q8_512
  Q8Table<W, D> tab;
  int64_t loaded = -1;
#endif
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = idx + r * row_bytes;
    const int8_t* table = tables + r / gs * table_bytes(W, D);
    int8_t *hi = dense + r * in, *lo = dense + (out + r) * in;
#ifdef WSCOMPRESS_Q8_512
    if (r / gs != loaded) tab.load(table, 1.f), loaded = r / gs;
    q8_dense_row<W, D>(tab, row, W == 4 ? row_bytes : in / D, in, [&](int64_t at, int64_t n, __m512i h, __m512i l) {
      _mm512_mask_storeu_epi8(hi + at, first_bytes(n), h), _mm512_mask_storeu_epi8(lo + at, first_bytes(n), l);
    });
#else
    for (int64_t j = 0; j < in; ++j) q8_weight<W, D>(row, table, j, hi[j], lo[j]);
#endif
  }
}

#ifdef WSCOMPRESS_Q8
template <int W, int D>
torch::Tensor run_q8(const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& tables,
                     const torch::Tensor& scales, int64_t group_size, int64_t out, Sparse sp) {
  const int64_t in = x.size(1);
  const float* xp = x.data_ptr<float>();
  const uint8_t* ip = idx.data_ptr<uint8_t>();
  const int8_t* tp = tables.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  auto y = torch::empty({x.size(0), out}, x.options());
  float* yp = y.data_ptr<float>();
  by_chunks(x.size(0), [&](auto M, int64_t m0) {
    q8_gemv<W, D, decltype(M)::value>(xp + m0 * in, ip, tp, sc, group_size, in, out, sp, yp + m0 * out);
  });
  return y;
}
#endif

// f<W, D>(...) for the runtime width and vector length
template <template <int, int> class F, typename... A>
auto dispatch(int64_t width, int64_t d, A&&... a) {
  if (width == 4) {
    if (d == 1) return F<4, 1>{}(a...);
    if (d == 2) return F<4, 2>{}(a...);
    return F<4, 4>{}(a...);
  }
  if (width == 6) return F<6, 2>{}(a...);  // pairs only (vector_length checks)
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

Sparse sparse(const torch::Tensor& row_ptr, const torch::Tensor& pos, const torch::Tensor& delta, int64_t out,
              int64_t in) {
  if (row_ptr.numel() == 0) return {nullptr, nullptr, nullptr, false, in};
  TORCH_CHECK(row_ptr.scalar_type() == torch::kInt && row_ptr.is_contiguous() && row_ptr.numel() == out + 1,
              "row_ptr: contiguous int32 (out + 1)");
  TORCH_CHECK(pos.scalar_type() == torch::kInt && pos.is_contiguous() && pos.numel() == row_ptr.data_ptr<int32_t>()[out],
              "pos: contiguous int32, one per outlier");
  const bool half = delta.scalar_type() == torch::kHalf;
  TORCH_CHECK((half || delta.scalar_type() == torch::kFloat) && delta.is_contiguous() && delta.numel() == pos.numel(),
              "delta: contiguous float16 or float32, one per pos");
  return {row_ptr.data_ptr<int32_t>(), pos.data_ptr<int32_t>(), delta.data_ptr(), half, in};
}

}  // namespace

// The vector length D of tables (groups, k) (D 1) or (groups, k, D), checked.
int64_t vector_length(const torch::Tensor& tables, int64_t width, int64_t group_size, int64_t out, int64_t in,
                      const torch::Tensor& idx) {
  TORCH_CHECK(tables.is_contiguous(), "tables: contiguous");
  TORCH_CHECK(idx.scalar_type() == torch::kUInt8 && idx.is_contiguous(), "idx: contiguous uint8");
  TORCH_CHECK(width == 4 || width == 6 || width == 8, "width must be 4, 6 or 8");
  const int64_t d = tables.dim() == 3 ? tables.size(2) : 1;
  TORCH_CHECK(tables.dim() == 2 || tables.dim() == 3, "tables: (groups, k) or (groups, k, D)");
  TORCH_CHECK(d == 1 || d == 2 || d == 4, "vector length D must be 1, 2 or 4");
  TORCH_CHECK(width != 4 || tables.size(1) == 16, "width 4 reads tables of 16 entries (pad them)");
  TORCH_CHECK(width != 6 || d == 2, "width 6 holds pairs only (D 2)");
  TORCH_CHECK(in % d == 0 && in / d * width % 8 == 0 && (width != 6 || in / d % 4 == 0),
              "a row's indices must fill whole bytes (6 bits: four in three)");
  TORCH_CHECK(idx.numel() * 8 == out * in / d * width, "idx size does not match (out, in / D)");
  TORCH_CHECK(group_size > 0 && out % group_size == 0 && tables.size(0) == out / group_size,
              "tables: one per group of group_size rows");
  return d;
}

// x (batch, in) float32; idx (out * in / D * width / 8) uint8; tables (groups, k) or
// (groups, k, D) float32, k = 16 for width 4 (padded), 2^bits for width 8; row_ptr (out + 1)
// int32, pos int32 (flat, ascending), delta float16 or float32: the outliers' corrections (row_ptr empty: none).
// Returns x @ W^T (batch, out).
torch::Tensor lut_linear(torch::Tensor x, torch::Tensor idx, torch::Tensor tables, int64_t width, int64_t group_size,
                         int64_t out, torch::Tensor row_ptr, torch::Tensor pos, torch::Tensor delta) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (batch, in)");
  TORCH_CHECK(tables.scalar_type() == torch::kFloat, "tables: float32");
  const int64_t d = vector_length(tables, width, group_size, out, x.size(1), idx);
  return dispatch<Linear>(width, d, x, idx, tables, group_size, out, sparse(row_ptr, pos, delta, out, x.size(1)));
}

// Whether this build multiplies 8-bit activations for tables of this index width (lut_linear_q8).
bool lut_q8(int64_t width) {
#ifdef WSCOMPRESS_Q8_512
  return width == 4 || width == 6 || width == 8;
#elif defined(WSCOMPRESS_Q8)
  return width == 4 || width == 6;
#else
  return false;
#endif
}

// The vector length D of rounded tables (round_tables; scales (groups) float32) for this index
// width, checked with idx: hi bytes (D, K) and lo nibbles (two components a byte: ceil(D / 2),
// K; 4-d vectors: lo bytes (4, K), 16 bits a value), K = 16 for nibbles (width 4, D 1), 64 for
// pairs' 6-bit indices (width 6), 256 for byte indices (width 8) of D = 1, 2 or 4 weights.
int64_t q8_vector_length(const torch::Tensor& idx, const torch::Tensor& tables, const torch::Tensor& scales,
                         int64_t width, int64_t group_size, int64_t out, int64_t in) {
  TORCH_CHECK(width == 4 || width == 6 || width == 8, "width must be 4, 6 or 8");
  TORCH_CHECK(group_size > 0 && out % group_size == 0, "group_size must divide out");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == out / group_size,
              "scales: contiguous float32, one per group");
  const int64_t per_group = tables.numel() / std::max<int64_t>(out / group_size, 1);
  int64_t d = width == 4 ? 1 : 0;  // byte indices: the D whose hi and lo rows fill a group's table
  for (const int64_t c : {1, 2, 4})
    if (width != 4 && per_group == table_bytes(width, c)) d = c;
  TORCH_CHECK(tables.scalar_type() == torch::kChar && tables.is_contiguous() &&
                  tables.numel() == out / group_size * per_group && (width == 4 ? per_group == 32 : d > 0) &&
                  (width != 6 || d == 2 && in / 2 % 4 == 0),
              "tables: contiguous int8, (groups, 32) for width 4, (groups, (D + ceil(D / 2)) x 256) with D 1 or 2, "
              "(groups, 8 x 256) with D 4 for width 8, (groups, 3 x 64) for width 6");
  TORCH_CHECK(idx.scalar_type() == torch::kUInt8 && idx.is_contiguous() && in % d == 0 &&
                  idx.numel() * 8 * d == out * in * width,
              "idx: contiguous uint8, one index per ", d, " weights");
  return d;
}

// lut_linear on 8-bit activations, tables and scales from round_tables (see q8_vector_length);
// rows of a multiple of 32 weights (see lut_q8).
torch::Tensor lut_linear_q8(torch::Tensor x, torch::Tensor idx, torch::Tensor tables, torch::Tensor scales,
                            int64_t width, int64_t group_size, int64_t out, torch::Tensor row_ptr, torch::Tensor pos,
                            torch::Tensor delta, const c10::optional<torch::Tensor>& row_scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (batch, in)");
  const int64_t in = x.size(1);
  TORCH_CHECK(lut_q8(width), "this build has no 8-bit path for width ", width, " (see lut_q8)");
  TORCH_CHECK(in % QBLOCK == 0, "rows of a multiple of 32 weights");
  const int64_t d = q8_vector_length(idx, tables, scales, width, group_size, out, in);
  Sparse sp = sparse(row_ptr, pos, delta, out, in);
  if (row_scale.has_value()) {
    const torch::Tensor& s = *row_scale;
    sp.scale_half = s.scalar_type() == torch::kHalf;
    TORCH_CHECK((sp.scale_half || s.scalar_type() == torch::kFloat) && s.is_contiguous() && s.numel() == out,
                "row_scale: contiguous float16 or float32, one per output row");
    sp.scale = s.data_ptr();
  }
#ifdef WSCOMPRESS_Q8
  if (width == 6) return run_q8<6, 2>(x, idx, tables, scales, group_size, out, sp);
#endif
#ifdef WSCOMPRESS_Q8_512
  if (width == 8) return d == 1 ? run_q8<8, 1>(x, idx, tables, scales, group_size, out, sp)
                       : d == 2 ? run_q8<8, 2>(x, idx, tables, scales, group_size, out, sp)
                                : run_q8<8, 4>(x, idx, tables, scales, group_size, out, sp);
#endif
#ifdef WSCOMPRESS_Q8
  return run_q8<4, 1>(x, idx, tables, scales, group_size, out, sp);
#else
  return {};  // unreachable: lut_q8 said no
#endif
}

// The weight lut_linear_q8 multiplies, for prefill's integer product: (2 out, in) int8, rows
// 0 .. out - 1 the hi parts of its rounded values, rows out .. 2 out - 1 the lo parts (0..15;
// 4-d vectors: lo - 128), so that row r is scales[r / group_size] (16 hi + lo), or for 4-d vectors
// (256 hi + lo + 128); outliers not applied. Every build (vectorised with AVX-512 VBMI).
// (d: the tables' vector length, as q8_vector_length found it)
torch::Tensor dense_q8(const torch::Tensor& idx, const torch::Tensor& tables, int64_t width, int64_t group_size,
                       int64_t out, int64_t in, int64_t d) {
  auto dense = torch::empty({2 * out, in}, tables.options());
  const uint8_t* ip = idx.data_ptr<uint8_t>();
  const int8_t* tp = tables.data_ptr<int8_t>();
  int8_t* dp = dense.data_ptr<int8_t>();
  auto rows = [&](auto decode) { at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) { decode(r0, r1); }); };
  if (width == 4) rows([&](int64_t r0, int64_t r1) { q8_dense_rows<4, 1>(ip, tp, group_size, in, out, dp, r0, r1); });
  else if (width == 6) rows([&](int64_t r0, int64_t r1) { q8_dense_rows<6, 2>(ip, tp, group_size, in, out, dp, r0, r1); });
  else if (d == 1) rows([&](int64_t r0, int64_t r1) { q8_dense_rows<8, 1>(ip, tp, group_size, in, out, dp, r0, r1); });
  else if (d == 2) rows([&](int64_t r0, int64_t r1) { q8_dense_rows<8, 2>(ip, tp, group_size, in, out, dp, r0, r1); });
  else rows([&](int64_t r0, int64_t r1) { q8_dense_rows<8, 4>(ip, tp, group_size, in, out, dp, r0, r1); });
  return dense;
}

torch::Tensor lut_dense_q8(torch::Tensor idx, torch::Tensor tables, torch::Tensor scales, int64_t width,
                           int64_t group_size, int64_t out, int64_t in) {
  return dense_q8(idx, tables, width, group_size, out, in, q8_vector_length(idx, tables, scales, width, group_size, out, in));
}

// The outliers' corrections to prefill's products, (out, rows): each against whole input columns,
// the input transposed once so that a column is contiguous (a loop gathering one input value at
// a time cost 4x this; torch's sparse CSR product as much, beta API aside). Undefined: none.
torch::Tensor outlier_products(const torch::Tensor& x, const Sparse& sp, int64_t out) {
  if (!sp.row_ptr) return {};
  const int64_t rows = x.size(0);
  auto corrections = torch::empty({out, rows}, x.options());
  const torch::Tensor xt = x.t().contiguous();
  const float* xtp = xt.data_ptr<float>();
  float* by_row = corrections.data_ptr<float>();
  at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* c = by_row + r * rows;
      for (int64_t k = sp.row_ptr[r]; k < sp.row_ptr[r + 1]; ++k) {
        const float d = sp.d(k), *column = xtp + sp.col(k, r) * rows;
        if (k == sp.row_ptr[r])
          for (int64_t m = 0; m < rows; ++m) c[m] = d * column[m];
        else
          for (int64_t m = 0; m < rows; ++m) c[m] += d * column[m];
      }
    }
  });
  return corrections;
}

// y (rows, out): fill(m0, m1, row_scale, y) writes input rows m0 .. m1 - 1 (16 at a time) of the
// products with their scales (the input row's and row_scale[r], its weight row's group's), then
// the outliers' corrections are added, in one pass over y: the element-wise passes torch would
// make over the products cost a fifth of the layer at 1.1B. 16 input rows at a time: a cache line
// of a weight row's corrections serves them all (one row at a time read a line per output, 10x
// the corrections' cost).
template <typename Fill>
torch::Tensor finish(const torch::Tensor& x, const Sparse& sp, const torch::Tensor& scales, int64_t group_size,
                     int64_t out, Fill&& fill) {
  const int64_t rows = x.size(0);
  const torch::Tensor corrections = outlier_products(x, sp, out);
  const float* cp = sp.row_ptr ? corrections.data_ptr<float>() : nullptr;
  const float* sc = scales.data_ptr<float>();
  std::vector<float> row_scale(out + 16);  // whole vectors past the last row
  for (int64_t r = 0; r < out; ++r) row_scale[r] = sc[r / group_size];
  auto y = torch::empty({rows, out}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (rows + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 16 * b0; m0 < std::min(rows, 16 * b1); m0 += 16) {
      const int64_t m1 = std::min(rows, m0 + 16);
      fill(m0, m1, row_scale.data(), yp);
      if (cp)
        for (int64_t r = 0; r < out; ++r)
          if (sp.row_ptr[r + 1] > sp.row_ptr[r])
            for (int64_t m = m0; m < m1; ++m) yp[m * out + r] += cp[r * rows + m];
    }
  });
  return y;
}

// Prefill's product in 8-bit integers through torch's own integer matmul (at::_int_mm: oneDNN's
// VNNI or AVX2 kernels): the weight as lut_dense_q8's hi and lo planes, each input row split into
// two 8-bit parts, x = s (a + b / 254) with s the row's largest magnitude / 127 (about 15 bits:
// one part alone cost 2.7 % of perplexity), and three products, a hi, a lo and b hi (b lo stays
// below 2^-12 of the sum). 4-d vectors' 16-bit tables take this path everywhere, the others where
// the build has no 16-bit one.
torch::Tensor linear_i8(const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& tables,
                        const torch::Tensor& scales, int64_t width, int64_t group_size, int64_t out, const Sparse& sp,
                        int64_t d) {
  const int64_t rows = x.size(0), in = x.size(1);
  const torch::Tensor planes = dense_q8(idx, tables, width, group_size, out, in, d);
  auto a = torch::empty({rows, in}, tables.options()), b = torch::empty({rows, in}, tables.options());
  std::vector<float> s(rows), a_sum(rows);
  const float* xp = x.data_ptr<float>();
  int8_t *ap = a.data_ptr<int8_t>(), *bp = b.data_ptr<int8_t>();
  at::parallel_for(0, rows, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = xp + m * in;
      float amax = 0.f, sum = 0.f;
      for (int64_t j = 0; j < in; ++j) amax = std::max(amax, std::fabs(row[j]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t j = 0; j < in; ++j) {
        const float v = row[j] * inv, r = std::nearbyint(v);
        ap[m * in + j] = static_cast<int8_t>(r), bp[m * in + j] = static_cast<int8_t>(std::nearbyint((v - r) * 254.f));
        sum += r;
      }
      s[m] = amax / 127.f, a_sum[m] = sum;
    }
  });
  const torch::Tensor both = at::_int_mm(a, planes.t()), hi_b = at::_int_mm(b, planes.narrow(0, 0, out).t());
  const float unit = wide(d) ? 256.f : 16.f, offset = wide(d) ? 128.f : 0.f;  // 4-d vectors' lo plane holds lo - 128
  const int32_t *pp = both.data_ptr<int32_t>(), *qp = hi_b.data_ptr<int32_t>();
  return finish(x, sp, scales, group_size, out, [&](int64_t m0, int64_t m1, const float* row_scale, float* y) {
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t *p = pp + m * 2 * out, *q = qp + m * out;
      const float base = offset * a_sum[m];
      float* ym = y + m * out;
      for (int64_t r = 0; r < out; ++r) ym[r] = (unit * p[r] + p[out + r] + unit / 254.f * q[r] + base) * s[m] * row_scale[r];
    }
  });
}

#ifdef WSCOMPRESS_Q8_512
// ---- Prefill in 16-bit integers (12-bit tables) ----
// VPDPWSSD multiplies 32 pairs of 16-bit integers at the rate VPDPBUSD multiplies 64 pairs of
// bytes: a weight's whole 12-bit value (16 hi + lo) by an input of 14 bits (a row's largest
// magnitude is 8191) in one product, where the 8-bit path makes three. Sums of I16_PAIRS pairs
// stay exact in int32 (2048 x 8191 x 128 < 2^31), then are added as floats. Tiles broadcast a
// pair of a weight row and multiply it into 16 input rows a register, so the weight rows are read
// in the order decoding writes them and only the input is rearranged (once a call, pair-major in
// blocks of I16_INPUTS rows).
constexpr int64_t I16_PAIRS = 64;  // input pairs an int32 sum spans
constexpr float I16_MAX = 8191.f;
constexpr int I16_TILE = 6;  // weight rows a tile: 6 x 4 registers of sums, each broadcast pair used 4 times
constexpr int64_t I16_ROWS = 48;  // weight rows a thread decodes at once (a few hundred KB, in L2)
constexpr int64_t I16_INPUTS = 128;  // input rows whose pairs stay in L1 across a block's tiles

// acc += the 16 dot products of b's and x's pairs of 16-bit integers. Written as the one instruction
// that updates acc in place: GCC 12 compiled the intrinsic through a copy of acc and a store of it
// each product (half the tile's speed), and keeps an array of sums in memory, so the tile names
// its 24 sums.
inline void dpwssd(__m512i& acc, __m512i b, __m512i x) { asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(b), "v"(x)); }

// p = s (the first span of pairs) or p + s, as floats
inline void add_sums(float* p, __m512i s, bool first) {
  const __m512 v = _mm512_cvtepi32_ps(s);
  _mm512_storeu_ps(p, first ? v : _mm512_add_ps(_mm512_loadu_ps(p), v));
}

// c[r][m] (+)= sum over pairs t0 .. t1 - 1 of w[r] . x[m] for I16_TILE weight rows (w: row stride
// in) and 16 ZM input rows (xp: pair t of row m at t * xs + m; c: row stride mp), `=` where t0 is 0
template <int ZM>
inline void i16_tile(const int16_t* w, int64_t in, const int32_t* xp, int64_t xs, int64_t mp, int64_t t0, int64_t t1,
                     float* c) {
  static_assert(I16_TILE == 6, "the tile names 6 rows of sums");
  __m512i s00{}, s01{}, s02{}, s03{}, s10{}, s11{}, s12{}, s13{}, s20{}, s21{}, s22{}, s23{},
      s30{}, s31{}, s32{}, s33{}, s40{}, s41{}, s42{}, s43{}, s50{}, s51{}, s52{}, s53{};
  for (int64_t t = t0; t < t1; ++t) {
    const int32_t* xt = xp + t * xs;
    __m512i x0 = _mm512_loadu_si512(xt), x1{}, x2{}, x3{};
    if constexpr (ZM > 1) x1 = _mm512_loadu_si512(xt + 16);
    if constexpr (ZM > 2) x2 = _mm512_loadu_si512(xt + 32);
    if constexpr (ZM > 3) x3 = _mm512_loadu_si512(xt + 48);
    auto row = [&](int r, __m512i& a0, __m512i& a1, __m512i& a2, __m512i& a3) {
      int32_t pair;
      std::memcpy(&pair, w + r * in + 2 * t, 4);
      const __m512i b = _mm512_set1_epi32(pair);
      dpwssd(a0, b, x0);
      if constexpr (ZM > 1) dpwssd(a1, b, x1);
      if constexpr (ZM > 2) dpwssd(a2, b, x2);
      if constexpr (ZM > 3) dpwssd(a3, b, x3);
    };
    row(0, s00, s01, s02, s03), row(1, s10, s11, s12, s13), row(2, s20, s21, s22, s23);
    row(3, s30, s31, s32, s33), row(4, s40, s41, s42, s43), row(5, s50, s51, s52, s53);
  }
  auto store = [&](int r, __m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    float* p = c + r * mp;
    add_sums(p, a0, t0 == 0);
    if constexpr (ZM > 1) add_sums(p + 16, a1, t0 == 0);
    if constexpr (ZM > 2) add_sums(p + 32, a2, t0 == 0);
    if constexpr (ZM > 3) add_sums(p + 48, a3, t0 == 0);
  };
  store(0, s00, s01, s02, s03), store(1, s10, s11, s12, s13), store(2, s20, s21, s22, s23);
  store(3, s30, s31, s32, s33), store(4, s40, s41, s42, s43), store(5, s50, s51, s52, s53);
}

// Weight rows r0 .. r1 (at most I16_ROWS) decoded to 16 hi + lo, times every input row, into c
// (the products transposed, (out, mp); xp: linear_i16's blocks of input rows)
template <int W, int D>
void i16_rows(const uint8_t* idx, const int8_t* tables, int64_t gs, int64_t in, const int32_t* xp, int64_t mp,
              int64_t r0, int64_t r1, int16_t* w, float* c) {
  const int64_t row_bytes = in / D * W / 8, pairs = in / 2;
  Q8Table<W, D> tab;
  int64_t loaded = -1;
  for (int64_t r = r0; r < r1; ++r) {
    if (r / gs != loaded) tab.load(tables + r / gs * table_bytes(W, D), 1.f), loaded = r / gs;
    int16_t* row = w + (r - r0) * in;
    q8_dense_row<W, D>(tab, idx + r * row_bytes, W == 4 ? row_bytes : in / D, in, [&](int64_t at, int64_t n, __m512i h, __m512i l) {
      for (int half = 0; half < 2 && 32 * half < n; ++half) {
        const __m512i hi = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(h, half ? 1 : 0));
        const __m512i lo = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(l, half ? 1 : 0));
        const int64_t k = std::min<int64_t>(32, n - 32 * half);
        _mm512_mask_storeu_epi16(row + at + 32 * half, static_cast<__mmask32>(first_bytes(k)),
                                 _mm512_add_epi16(_mm512_slli_epi16(hi, 4), lo));
      }
    });
  }
  // a last block of fewer rows also fills whole tiles: the rows after r1 (w's earlier rows or
  // zeros) land in c's padding
  for (int64_t m0 = 0; m0 < mp; m0 += I16_INPUTS) {
    const int64_t m1 = std::min(mp, m0 + I16_INPUTS), xs = m1 - m0;
    const int32_t* xb = xp + m0 * pairs;  // this block's inputs
    for (int64_t t0 = 0; t0 < pairs; t0 += I16_PAIRS) {
      const int64_t t1 = std::min(pairs, t0 + I16_PAIRS);
      for (int64_t r = r0; r < r1; r += I16_TILE) {
        const int16_t* wr = w + (r - r0) * in;
        float* cr = c + r * mp;
        for (int64_t m = m0; m < m1; m += 64) {
          const int64_t left = std::min<int64_t>(64, m1 - m) / 16;
          const int32_t* xm = xb + (m - m0);
          if (left == 4) i16_tile<4>(wr, in, xm, xs, mp, t0, t1, cr + m);
          else if (left == 3) i16_tile<3>(wr, in, xm, xs, mp, t0, t1, cr + m);
          else if (left == 2) i16_tile<2>(wr, in, xm, xs, mp, t0, t1, cr + m);
          else i16_tile<1>(wr, in, xm, xs, mp, t0, t1, cr + m);
        }
      }
    }
  }
}

// Index vectors of transpose16's steps: step b swaps bit b of the row with bit b of the column
struct Butterfly {
  int32_t first[4][16], second[4][16];
};
constexpr Butterfly butterfly() {
  Butterfly f{};
  for (int k = 0; k < 4; ++k)
    for (int j = 0, b = 1 << k; j < 16; ++j)
      f.first[k][j] = j & b ? 16 + (j ^ b) : j, f.second[k][j] = j & b ? 16 + j : j ^ b;
  return f;
}

// The 16 x 16 floats of v transposed (lane j of v[i] to lane i of v[j]), in 64 two-source permutes
inline void transpose16(__m512 (&v)[16]) {
  static constexpr Butterfly f = butterfly();
  for (int k = 0; k < 4; ++k) {
    const int b = 1 << k;
    const __m512i first = _mm512_loadu_si512(f.first[k]), second = _mm512_loadu_si512(f.second[k]);
    for (int i = 0; i < 16; ++i)
      if (!(i & b)) {
        const __m512 lo = v[i], hi = v[i | b];
        v[i] = _mm512_permutex2var_ps(lo, first, hi), v[i | b] = _mm512_permutex2var_ps(lo, second, hi);
      }
  }
}

torch::Tensor linear_i16(const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& tables,
                         const torch::Tensor& scales, int64_t width, int64_t group_size, int64_t out, const Sparse& sp,
                         int64_t d) {
  const int64_t rows = x.size(0), in = x.size(1), pairs = in / 2, mp = (rows + 15) / 16 * 16;
  // the input, 14 bits a value, pair-major in blocks of I16_INPUTS rows, so that a tile's span of
  // pairs is contiguous (pair-major over all rows put each of its pairs on a page of its own once
  // rows reached the thousands): pair t of row m at m0 pairs + t b + m - m0, m0 and b its block's
  // first row and rows; rows beyond `rows` are 0. Neither this nor c is zeroed whole (a serial
  // pass over megabytes of fresh pages): the tiles write every element before it is read, and
  // only c's padding rows, which finish's 16-row blocks may read unwritten, are zeroed.
  std::unique_ptr<int32_t[]> packed(new int32_t[pairs * mp]);
  std::vector<float> s(rows);
  const float* xf = x.data_ptr<float>();
  at::parallel_for(0, mp / 16, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int16_t> q(16 * in);  // 16 rows rounded, then moved pair-major 16 x 16 pairs at a time
    for (int64_t m0 = 16 * b0; m0 < std::min(rows, 16 * b1); m0 += 16) {
      const int64_t n = std::min<int64_t>(16, rows - m0);
      for (int64_t i = 0; i < n; ++i) {
        const float* row = xf + (m0 + i) * in;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t j = 0; j < in; j += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(row + j)));
        const float largest = _mm512_reduce_max_ps(amax), inv = largest > 0.f ? I16_MAX / largest : 0.f;
        for (int64_t j = 0; j < in; j += 16)  // rounded to nearest even, as nearbyint
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(&q[i * in + j]),
                              _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + j), _mm512_set1_ps(inv)))));
        s[m0 + i] = largest / I16_MAX;
      }
      std::fill(q.begin() + n * in, q.end(), int16_t{0});
      const int64_t first = m0 / I16_INPUTS * I16_INPUTS, block = std::min(I16_INPUTS, mp - first);
      int32_t* to = packed.get() + first * pairs + (m0 - first);
      for (int64_t t0 = 0; t0 < pairs; t0 += 16) {  // in is a multiple of 32: whole steps
        __m512 v[16];
        for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(&q[i * in + 2 * t0]));  // 16 pairs as bits
        transpose16(v);
        for (int j = 0; j < 16; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(to + (t0 + j) * block), v[j]);
      }
    }
  });
  std::unique_ptr<float[]> c(new float[(out + 16) * mp]);  // whole tiles and 16-row blocks past the last row
  std::fill(c.get() + out * mp, c.get() + (out + 16) * mp, 0.f);
  const uint8_t* ip = idx.data_ptr<uint8_t>();
  const int8_t* tp = tables.data_ptr<int8_t>();
  at::parallel_for(0, (out + I16_ROWS - 1) / I16_ROWS, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int16_t> w(I16_ROWS * in);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * I16_ROWS, r1 = std::min(out, r0 + I16_ROWS);
      auto run = [&](auto rows_of) { rows_of(ip, tp, group_size, in, packed.get(), mp, r0, r1, w.data(), c.get()); };
      if (width == 4) run(i16_rows<4, 1>);
      else if (width == 6) run(i16_rows<6, 2>);
      else if (d == 1) run(i16_rows<8, 1>);
      else run(i16_rows<8, 2>);
    }
  });
  // c's 16 x 16 blocks transposed in registers: y's rows written whole (a column at a time wrote
  // 16 rows' lines each step, which share an L1 set where a row is a multiple of 4 KB)
  return finish(x, sp, scales, group_size, out, [&](int64_t m0, int64_t m1, const float* row_scale, float* y) {
    for (int64_t r0 = 0; r0 < out; r0 += 16) {
      __m512 v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(c.get() + (r0 + i) * mp + m0);
      transpose16(v);
      const __mmask16 mask = static_cast<__mmask16>(out - r0 >= 16 ? 0xFFFF : (1u << (out - r0)) - 1);
      const __m512 rs = _mm512_loadu_ps(row_scale + r0);
      for (int64_t m = m0; m < m1; ++m)
        _mm512_mask_storeu_ps(y + m * out + r0, mask, _mm512_mul_ps(_mm512_mul_ps(v[m - m0], rs), _mm512_set1_ps(s[m])));
    }
  });
}

// ---- Prefill on AMX tiles: bfloat16 products, float32 sums ----
// Where the CPU has AMX (lut_amx), oneDNN's brgemm micro-kernel through torch's own
// at::native::cpublas::brgemm multiplies bfloat16 tiles into float32 sums at about six times the
// float32 BLAS's rate; the 16-bit integer path above reaches less than half of that. Each thread
// decodes BF16_ROWS weight rows (the rounded tables' values times their group's scale, outliers
// added, rounded to bfloat16) into the pair-interleaved layout the tiles read (VNNI: pair t of
// row n at t * BF16_ROWS + n), a few hundred KB that stay in L2 while the input's rows stream
// past them BF16_INPUTS at a time. The input is rounded to bfloat16 once a call; the sums stay
// float32 up to the output.
constexpr int64_t BF16_ROWS = 64;
constexpr int64_t BF16_INPUTS = 256;

// v rounded to bfloat16 (nearest even; the weights and inputs are finite), 16 values as 16 bits
inline __m256i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
}

// Weight rows r0 .. r0 + n - 1 (n <= BF16_ROWS) in bfloat16, pair-interleaved into vnni
// (f: a row of floats, rows: 16 rows of bfloat16, the buffers a thread reuses)
template <int W, int D>
void bf16_rows(const uint8_t* idx, const int8_t* tables, const float* scales, int64_t gs, int64_t in, const Sparse& sp,
               int64_t r0, int64_t n, float* f, uint16_t* rows, uint32_t* vnni) {
  const int64_t row_bytes = in / D * W / 8, pairs = in / 2;
  const __m512 unit = _mm512_set1_ps(wide(D) ? 256.f : 16.f);  // v = unit hi + lo (see round_tables)
  Q8Table<W, D> tab;
  int64_t loaded = -1;
  for (int64_t s0 = 0; s0 < n; s0 += 16) {
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t r = r0 + s0 + i;
      uint16_t* b = rows + i * in;
      if (s0 + i >= n) {  // past the last row: zeros, which the product leaves out (its N is n)
        std::fill(b, b + in, uint16_t{0});
        continue;
      }
      if (r / gs != loaded) tab.load(tables + r / gs * table_bytes(W, D), 1.f), loaded = r / gs;
      const __m512 scale = _mm512_set1_ps(scales[r / gs]);
      q8_dense_row<W, D>(tab, idx + r * row_bytes, W == 4 ? row_bytes : in / D, in, [&](int64_t at, int64_t k, __m512i h, __m512i l) {
        alignas(64) int8_t hb[64], lb[64];
        _mm512_store_si512(hb, h), _mm512_store_si512(lb, l);
        for (int64_t q = 0; 16 * q < k; ++q) {
          const __m128i hq = _mm_load_si128(reinterpret_cast<const __m128i*>(hb + 16 * q));
          const __m128i lq = _mm_load_si128(reinterpret_cast<const __m128i*>(lb + 16 * q));
          // 4-d vectors' lo bytes come signed (lo - 128), the others' as 0..15
          const __m512 lo = wide(D) ? _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lq)), _mm512_set1_ps(128.f))
                                    : _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lq));
          const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hq)), unit, lo);
          _mm512_storeu_ps(f + at + 16 * q, _mm512_mul_ps(v, scale));
        }
      });
      if (sp.row_ptr)
        for (int64_t p = sp.row_ptr[r]; p < sp.row_ptr[r + 1]; ++p) f[sp.col(p, r)] += sp.d(p);
      for (int64_t j = 0; j < in; j += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(b + j), bf16_bits(_mm512_loadu_ps(f + j)));
    }
    // 16 rows' pairs (32 bits each) transposed 16 x 16 at a time into their columns of vnni
    for (int64_t t0 = 0; t0 < pairs; t0 += 16) {  // in is a multiple of 32: whole steps
      __m512 v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(rows + i * in + 2 * t0));
      transpose16(v);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(vnni + (t0 + j) * BF16_ROWS + s0), v[j]);
    }
  }
}

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& tables,
                          const torch::Tensor& scales, int64_t width, int64_t group_size, int64_t out, const Sparse& sp,
                          int64_t d) {
  const int64_t rows = x.size(0), in = x.size(1);
  const torch::Tensor xb = x.to(torch::kBFloat16).contiguous();
  auto y = torch::empty({rows, out}, x.options());
  const at::BFloat16* xp = xb.data_ptr<at::BFloat16>();
  const uint8_t* ip = idx.data_ptr<uint8_t>();
  const int8_t* tp = tables.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (out + BF16_ROWS - 1) / BF16_ROWS, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> f(in);
    std::vector<uint16_t> rows16(16 * in);
    std::vector<uint32_t> vnni(in / 2 * BF16_ROWS);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * BF16_ROWS, n = std::min(BF16_ROWS, out - r0);
      auto run = [&](auto rows_of) { rows_of(ip, tp, sc, group_size, in, sp, r0, n, f.data(), rows16.data(), vnni.data()); };
      if (width == 4) run(bf16_rows<4, 1>);
      else if (width == 6) run(bf16_rows<6, 2>);
      else if (d == 1) run(bf16_rows<8, 1>);
      else if (d == 2) run(bf16_rows<8, 2>);
      else run(bf16_rows<8, 4>);
      const auto* w = reinterpret_cast<const at::BFloat16*>(vnni.data());
      for (int64_t m0 = 0; m0 < rows; m0 += BF16_INPUTS)
        at::native::cpublas::brgemm(std::min(BF16_INPUTS, rows - m0), n, in, in, BF16_ROWS, out, false, xp + m0 * in, w,
                                    yp + m0 * out + r0, true);
    }
    at::native::cpublas::brgemm_release(true);  // the thread's tile configuration
  });
  return y;
}
#endif

// Prefill's product on the weight decoding multiplies, in integers, with the scales and the
// outliers' float corrections joined in one pass: 16-bit products where the build has VPDPWSSD
// (AVX-512 VNNI) and the tables 12 bits, else three 8-bit ones (linear_i8)
torch::Tensor lut_linear_i8(torch::Tensor x, torch::Tensor idx, torch::Tensor tables, torch::Tensor scales,
                            int64_t width, int64_t group_size, int64_t out, torch::Tensor row_ptr, torch::Tensor pos,
                            torch::Tensor delta) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (batch, in)");
  const int64_t d = q8_vector_length(idx, tables, scales, width, group_size, out, x.size(1));
  const Sparse sp = sparse(row_ptr, pos, delta, out, x.size(1));
#ifdef WSCOMPRESS_Q8_512
  if (!wide(d)) return linear_i16(x, idx, tables, scales, width, group_size, out, sp, d);
#endif
  return linear_i8(x, idx, tables, scales, width, group_size, out, sp, d);
}

// Whether prefill can multiply on AMX tiles (lut_linear_bf16): a build with AVX-512 VBMI and VNNI
// (its table decoding) on a CPU whose AMX oneDNN's brgemm micro-kernel runs.
bool lut_amx() {
#ifdef WSCOMPRESS_Q8_512
  return at::native::cpublas::could_pack(at::kBFloat16);
#else
  return false;
#endif
}

// Prefill's product on AMX tiles (see linear_bf16): x @ W^T with W the rounded tables' values
// (round_tables, as lut_linear_i8 reads them) and the outliers, in bfloat16 with float32 sums.
torch::Tensor lut_linear_bf16(torch::Tensor x, torch::Tensor idx, torch::Tensor tables, torch::Tensor scales,
                              int64_t width, int64_t group_size, int64_t out, torch::Tensor row_ptr, torch::Tensor pos,
                              torch::Tensor delta) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 (batch, in)");
  TORCH_CHECK(lut_amx(), "no AMX here (see lut_amx)");
  TORCH_CHECK(x.size(1) % 32 == 0, "rows of a multiple of 32 weights");
  const int64_t d = q8_vector_length(idx, tables, scales, width, group_size, out, x.size(1));
  TORCH_CHECK(width != 4 || d == 1, "nibble vectors have no bfloat16 path");
#ifdef WSCOMPRESS_Q8_512
  return linear_bf16(x, idx, tables, scales, width, group_size, out, sparse(row_ptr, pos, delta, out, x.size(1)), d);
#else
  return {};  // unreachable: lut_amx said no
#endif
}

// The dense (out, in) weight, outliers included (prefill decodes it and hands it to the BLAS).
torch::Tensor lut_dense(torch::Tensor idx, torch::Tensor tables, int64_t width, int64_t group_size, int64_t out,
                        int64_t in, torch::Tensor row_ptr, torch::Tensor pos, torch::Tensor delta) {
  TORCH_CHECK(tables.scalar_type() == torch::kFloat, "tables: float32");
  const int64_t d = vector_length(tables, width, group_size, out, in, idx);
  return dispatch<Dense>(width, d, idx, tables, group_size, out, in, sparse(row_ptr, pos, delta, out, in));
}

// Registered as PyTorch operators (torch.ops.wscompress.lut_linear: x @ W^T for a palettized W;
// lut_dense: its dense weight), not a Python module: a compiled graph (torch.compile) calls them
// like any aten op; wscompress/kernels gives their shape rules.
TORCH_LIBRARY_FRAGMENT(wscompress, m) {
  m.def("lut_linear(Tensor x, Tensor idx, Tensor tables, int width, int group_size, int out, Tensor row_ptr, "
        "Tensor pos, Tensor delta) -> Tensor");
  m.def("lut_linear_q8(Tensor x, Tensor idx, Tensor tables, Tensor scales, int width, int group_size, int out, "
        "Tensor row_ptr, Tensor pos, Tensor delta, Tensor? row_scale=None) -> Tensor");
  m.def("lut_q8(int width) -> bool", &lut_q8);
  m.def("lut_amx() -> bool", &lut_amx);
  m.def("lut_dense(Tensor idx, Tensor tables, int width, int group_size, int out, int in_features, Tensor row_ptr, "
        "Tensor pos, Tensor delta) -> Tensor");
  m.def("lut_dense_q8(Tensor idx, Tensor tables, Tensor scales, int width, int group_size, int out, int in_features) "
        "-> Tensor");
  m.def("lut_linear_i8(Tensor x, Tensor idx, Tensor tables, Tensor scales, int width, int group_size, int out, "
        "Tensor row_ptr, Tensor pos, Tensor delta) -> Tensor");
  m.def("lut_linear_bf16(Tensor x, Tensor idx, Tensor tables, Tensor scales, int width, int group_size, int out, "
        "Tensor row_ptr, Tensor pos, Tensor delta) -> Tensor");
}

TORCH_LIBRARY_IMPL(wscompress, CPU, m) {
  m.impl("lut_linear", &lut_linear);
  m.impl("lut_linear_q8", &lut_linear_q8);
  m.impl("lut_dense", &lut_dense);
  m.impl("lut_dense_q8", &lut_dense_q8);
  m.impl("lut_linear_i8", &lut_linear_i8);
  m.impl("lut_linear_bf16", &lut_linear_bf16);
}
