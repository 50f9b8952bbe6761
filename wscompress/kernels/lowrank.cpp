// Dense products for decoding (up to 8 input rows), each weight row read once:
// - lowrank_linear (LowRankLinear / SharedBasisLinear): y = coeff (basis x) + bias in one call;
// - half_linear (HalfLinear, e.g. a tied head stored in float16): y = W x + bias with W in 16 bits
//   and float32 sums, which reads half the bytes of the float32 product;
// - int8_linear (Int8Linear: int8 weights, a float16 scale per 32 of a row): the same in 8.5 bits a
//   weight. The activations stay float32: decoding streams the weight from memory, and converting
//   bytes to floats costs less than the time their cache lines take to arrive.
//
// At batch 1 these are matrix-vector products that stream their weight from memory once; the
// BLAS call chain (linear -> matmul -> t -> mm) costs more than the work on thin factors, and its
// gemv reaches a lower fraction of the memory bandwidth on short rows (and takes no float16
// weight with float32 activations). Here each weight row is read once, 4 rows at a time with
// independent accumulators, and multiplied into every input row while it is in registers.
// Longer inputs (prefill) use the BLAS, which is compute-bound there and faster.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <type_traits>

namespace {

// Asks for the cache line at p (the rows after the block in work, at the same column): the
// hardware prefetchers stop at every 4 KB page and start again slowly, and a few rows of a
// short-rowed matrix (a head of 576 columns) fill a page: there it doubled the rate. Past the
// end of w it is harmless.
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// 16 (AVX-512) or 8 (AVX2) weights from p as floats: float32 as they are, float16 converted
// (F16C), the rest one at a time
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#elif defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

// y[m, r] = sum_j w[r, j] * x[m, j] (+ bias[r]) for rows r0..r1 of w, M input rows, R weight rows at a time.
template <int M, int R, typename T>
void gemv_rows(const float* x, const T* w, const float* bias, int64_t k, int64_t out, float* y, int64_t r0,
               int64_t r1) {
  const bool short_rows = k * sizeof(T) < 4096;  // rows of a page or more keep the prefetchers going (measured slower with)
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    float sums[R][M];
    int64_t j = 0;
#ifdef __AVX512F__
    __m512 acc[R][M];
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
    for (; j + 16 <= k; j += 16) {
      __m512 xs[M];
      for (int m = 0; m < M; ++m) xs[m] = _mm512_loadu_ps(x + m * k + j);
      if (short_rows && j * sizeof(T) % 64 == 0)
        for (int i = 0; i < R; ++i) prefetch(w + (r + i + R) * k + j);
      for (int i = 0; i < R; ++i) {
        __m512 wv = load16(w + (r + i) * k + j);
        for (int m = 0; m < M; ++m) acc[i][m] = _mm512_fmadd_ps(wv, xs[m], acc[i][m]);
      }
    }
    if constexpr (std::is_same_v<T, float>) {  // float16 rows (whole multiples here) take the scalar tail
      if (j < k) {  // the last k % 16 columns with masked loads: ranks are rarely multiples of 16, and
                    // on coefficient rows of 100-300 floats a scalar tail kept svd 40 % at 1.24x dense (now 1.31x)
        const __mmask16 mask = static_cast<__mmask16>((1u << (k - j)) - 1);
        __m512 xs[M];
        for (int m = 0; m < M; ++m) xs[m] = _mm512_maskz_loadu_ps(mask, x + m * k + j);
        for (int i = 0; i < R; ++i) {
          __m512 wv = _mm512_maskz_loadu_ps(mask, w + (r + i) * k + j);
          for (int m = 0; m < M; ++m) acc[i][m] = _mm512_fmadd_ps(wv, xs[m], acc[i][m]);
        }
        j = k;
      }
    }
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = _mm512_reduce_add_ps(acc[i][m]);
#elif defined(__AVX2__)
    __m256 acc[R][M];
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
    for (; j + 8 <= k; j += 8) {
      __m256 xs[M];
      for (int m = 0; m < M; ++m) xs[m] = _mm256_loadu_ps(x + m * k + j);
      if (short_rows && j * sizeof(T) % 64 == 0)
        for (int i = 0; i < R; ++i) prefetch(w + (r + i + R) * k + j);
      for (int i = 0; i < R; ++i) {
        __m256 wv = load8(w + (r + i) * k + j);
        for (int m = 0; m < M; ++m) acc[i][m] = _mm256_fmadd_ps(wv, xs[m], acc[i][m]);
      }
    }
    if constexpr (std::is_same_v<T, float>) {  // float16 rows (whole multiples here) take the scalar tail
      if (j < k) {  // the last k % 8 columns with masked loads (lanes below k - j)
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k - j)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 xs[M];
        for (int m = 0; m < M; ++m) xs[m] = _mm256_maskload_ps(x + m * k + j, mask);
        for (int i = 0; i < R; ++i) {
          __m256 wv = _mm256_maskload_ps(w + (r + i) * k + j, mask);
          for (int m = 0; m < M; ++m) acc[i][m] = _mm256_fmadd_ps(wv, xs[m], acc[i][m]);
        }
        j = k;
      }
    }
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = sum8(acc[i][m]);
#else
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = 0.f;
#endif
    for (; j < k; ++j)
      for (int i = 0; i < R; ++i)
        for (int m = 0; m < M; ++m) sums[i][m] += static_cast<float>(w[(r + i) * k + j]) * x[m * k + j];
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) y[m * out + r + i] = sums[i][m] + (bias ? bias[r + i] : 0.f);
  }
  if constexpr (R > 1) {
    if (r < r1) gemv_rows<M, 1, T>(x, w, bias, k, out, y, r, r1);
  }
}

template <int M, typename T>
void gemv(const float* x, const T* w, const float* bias, int64_t k, int64_t out, float* y) {
  constexpr int R = M <= 2 ? 4 : M <= 4 ? 2 : 1;  // accumulators R x M stay within the 16 vector registers
  at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) { gemv_rows<M, R, T>(x, w, bias, k, out, y, r0, r1); });
}

template <typename T>
void gemv_any(int64_t m, const float* x, const T* w, const float* bias, int64_t k, int64_t out, float* y) {
  switch (m) {
    case 1: gemv<1, T>(x, w, bias, k, out, y); break;
    case 2: gemv<2, T>(x, w, bias, k, out, y); break;
    case 3: gemv<3, T>(x, w, bias, k, out, y); break;
    case 4: gemv<4, T>(x, w, bias, k, out, y); break;
    case 5: gemv<5, T>(x, w, bias, k, out, y); break;
    case 6: gemv<6, T>(x, w, bias, k, out, y); break;
    case 7: gemv<7, T>(x, w, bias, k, out, y); break;
    default: gemv<8, T>(x, w, bias, k, out, y);
  }
}

// y[m, r] = sum_b s[r, b] sum_{j in block b} q[r, j] x[m, j] (+ bias[r]) for rows r0..r1, blocks of 32:
// each block's sum in float32 lanes, times its scale into the row's accumulator.
template <int M, int R>
void gemv_q8_rows(const float* x, const int8_t* q, const at::Half* s, const float* bias, int64_t k, int64_t out,
                  float* y, int64_t r0, int64_t r1) {
  const int64_t nb = k / 32;
  const bool short_rows = k < 4096;  // as in gemv_rows: ask for the next rows' lines ahead of the prefetchers
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    float sums[R][M];
    if (short_rows) for (int i = 0; i < R; ++i) prefetch(s + (r + i + R) * nb);
#ifdef __AVX512F__
    __m512 acc[R][M];
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t j = 32 * b;
      __m512 x0[M], x1[M];
      for (int m = 0; m < M; ++m) x0[m] = _mm512_loadu_ps(x + m * k + j), x1[m] = _mm512_loadu_ps(x + m * k + j + 16);
      if (short_rows && b % 2 == 0)
        for (int i = 0; i < R; ++i) prefetch(q + (r + i + R) * k + j);
      for (int i = 0; i < R; ++i) {
        const int8_t* p = q + (r + i) * k + j;
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
        const __m512 scale = _mm512_set1_ps(static_cast<float>(s[(r + i) * nb + b]));
        for (int m = 0; m < M; ++m)
          acc[i][m] = _mm512_fmadd_ps(_mm512_fmadd_ps(w1, x1[m], _mm512_mul_ps(w0, x0[m])), scale, acc[i][m]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = _mm512_reduce_add_ps(acc[i][m]);
#elif defined(__AVX2__)
    __m256 acc[R][M];
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t j = 32 * b;
      if (short_rows && b % 2 == 0)
        for (int i = 0; i < R; ++i) prefetch(q + (r + i + R) * k + j);
      for (int i = 0; i < R; ++i) {
        const int8_t* p = q + (r + i) * k + j;
        __m256 w[4];
        for (int c = 0; c < 4; ++c)
          w[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * c))));
        const __m256 scale = _mm256_set1_ps(static_cast<float>(s[(r + i) * nb + b]));
        for (int m = 0; m < M; ++m) {  // x from L1 each time: 4 M registers of it would not fit beside R M sums
          const float* xm = x + m * k + j;
          __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xm));
          for (int c = 1; c < 4; ++c) t = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(xm + 8 * c), t);
          acc[i][m] = _mm256_fmadd_ps(t, scale, acc[i][m]);
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = sum8(acc[i][m]);
#else
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) {
        float total = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          float part = 0.f;
          for (int64_t j = 32 * b; j < 32 * b + 32; ++j) part += q[(r + i) * k + j] * x[m * k + j];
          total += part * static_cast<float>(s[(r + i) * nb + b]);
        }
        sums[i][m] = total;
      }
#endif
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) y[m * out + r + i] = sums[i][m] + (bias ? bias[r + i] : 0.f);
  }
  if constexpr (R > 1) {
    if (r < r1) gemv_q8_rows<M, 1>(x, q, s, bias, k, out, y, r, r1);
  }
}

template <int M>
void gemv_q8(const float* x, const int8_t* q, const at::Half* s, const float* bias, int64_t k, int64_t out, float* y) {
  constexpr int R = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) { gemv_q8_rows<M, R>(x, q, s, bias, k, out, y, r0, r1); });
}

// What every product here takes and returns: x's rows (at most 8, float32) as one contiguous
// (m, in) matrix, the bias ((out,) float32) or an undefined tensor, and y (..., out) to fill.
struct Call {
  torch::Tensor flat, bias, y;
  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
};

Call prepare(const char* name, const torch::Tensor& x, int64_t out, const c10::optional<torch::Tensor>& bias) {
  Call call{x.reshape({-1, x.size(-1)}).contiguous(), {}, {}};
  TORCH_CHECK(call.flat.size(0) <= 8, name, ": at most 8 rows");
  TORCH_CHECK(call.flat.scalar_type() == torch::kFloat, name, ": x must be float32");
  if (bias.has_value()) {
    call.bias = bias->contiguous();
    TORCH_CHECK(call.bias.scalar_type() == torch::kFloat && call.bias.numel() == out, name, ": bias must be (out,) float32");
  }
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  call.y = torch::empty(sizes, x.options());
  return call;
}

}  // namespace

// x (..., in) with at most 8 rows, basis (rank, in), coeff (out, rank), bias (out) or None; float32,
// basis and coeff contiguous. Returns coeff (basis x) + bias, (..., out). The reshapes happen here,
// not in Python: at batch 1 each dispatcher call costs as much as the matmul of a small factor.
torch::Tensor lowrank_linear(torch::Tensor x, torch::Tensor basis, torch::Tensor coeff, c10::optional<torch::Tensor> bias) {
  const int64_t in = x.size(-1), rank = basis.size(0), out = coeff.size(0);
  Call call = prepare("lowrank_linear", x, out, bias);
  for (const auto* t : {&basis, &coeff})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous(), "operands: contiguous float32");
  TORCH_CHECK(basis.size(1) == in && coeff.size(1) == rank, "shapes do not chain");
  const int64_t m = call.flat.size(0);
  auto t = torch::empty({m, rank}, x.options());
  gemv_any(m, call.flat.data_ptr<float>(), basis.data_ptr<float>(), nullptr, in, rank, t.data_ptr<float>());
  gemv_any(m, t.data_ptr<float>(), coeff.data_ptr<float>(), call.bias_ptr(), rank, out, call.y.data_ptr<float>());
  return call.y;
}

// x (..., in) with at most 8 rows (float32), w (out, in) float16, bias (out) float32 or None:
// x w^T + bias in float32, (..., out).
torch::Tensor half_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  const int64_t in = x.size(-1), out = w.size(0);
  Call call = prepare("half_linear", x, out, bias);
  TORCH_CHECK(w.scalar_type() == torch::kHalf && w.is_contiguous() && w.dim() == 2 && w.size(1) == in,
              "half_linear: w must be a contiguous (out, in) float16 matrix");
  gemv_any(call.flat.size(0), call.flat.data_ptr<float>(), w.data_ptr<at::Half>(), call.bias_ptr(), in, out,
           call.y.data_ptr<float>());
  return call.y;
}

// x (..., in) with at most 8 rows (float32), q (out, in) int8 and s (out, in / 32) float16 (Int8Linear),
// bias (out) float32 or None: x (q * s)^T + bias in float32, (..., out).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s, c10::optional<torch::Tensor> bias) {
  const int64_t in = x.size(-1), out = q.size(0);
  Call call = prepare("int8_linear", x, out, bias);
  TORCH_CHECK(q.scalar_type() == torch::kChar && q.is_contiguous() && q.dim() == 2 && q.size(1) == in && in % 32 == 0,
              "int8_linear: q must be a contiguous (out, in) int8 matrix, in a multiple of 32");
  TORCH_CHECK(s.scalar_type() == torch::kHalf && s.is_contiguous() && s.dim() == 2 && s.size(0) == out &&
                  s.size(1) == in / 32,
              "int8_linear: s must be a contiguous (out, in / 32) float16 matrix");
  const float* xp = call.flat.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const at::Half* sp = s.data_ptr<at::Half>();
  const float* bp = call.bias_ptr();
  float* yp = call.y.data_ptr<float>();
  switch (call.flat.size(0)) {
    case 0: break;
    case 1: gemv_q8<1>(xp, qp, sp, bp, in, out, yp); break;
    case 2: gemv_q8<2>(xp, qp, sp, bp, in, out, yp); break;
    case 3: gemv_q8<3>(xp, qp, sp, bp, in, out, yp); break;
    case 4: gemv_q8<4>(xp, qp, sp, bp, in, out, yp); break;
    case 5: gemv_q8<5>(xp, qp, sp, bp, in, out, yp); break;
    case 6: gemv_q8<6>(xp, qp, sp, bp, in, out, yp); break;
    case 7: gemv_q8<7>(xp, qp, sp, bp, in, out, yp); break;
    default: gemv_q8<8>(xp, qp, sp, bp, in, out, yp);
  }
  return call.y;
}

// Registered as a PyTorch operator (torch.ops.wscompress.lowrank_linear), not a Python module: a
// compiled graph (torch.compile) calls it like any aten op; wscompress/kernels gives its shape rule.
TORCH_LIBRARY_FRAGMENT(wscompress, m) {
  m.def("lowrank_linear(Tensor x, Tensor basis, Tensor coeff, Tensor? bias) -> Tensor");
  m.def("half_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor s, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(wscompress, CPU, m) {
  m.impl("lowrank_linear", &lowrank_linear);
  m.impl("half_linear", &half_linear);
  m.impl("int8_linear", &int8_linear);
}
