// Fused low-rank matmul for decoding (wscompress LowRankLinear / SharedBasisLinear):
// y = coeff (basis x) + bias in one call for up to 8 input rows.
//
// At batch 1 both products are matrix-vector products that stream their weight from memory
// once; the BLAS call chain (linear -> matmul -> t -> mm, twice) costs more than the work on
// the thin factors, and its gemv reaches a lower fraction of the memory bandwidth on short
// rows. Here each weight row is read once, 4 rows at a time with independent accumulators,
// and multiplied into every input row while it is in registers. Longer inputs (prefill) use
// the BLAS, which is compute-bound there and faster.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

#if defined(__AVX2__) && !defined(__AVX512F__)
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

// y[m, r] = sum_j w[r, j] * x[m, j] (+ bias[r]) for rows r0..r1 of w, M input rows, R weight rows at a time.
template <int M, int R>
void gemv_rows(const float* x, const float* w, const float* bias, int64_t k, int64_t out, float* y, int64_t r0,
               int64_t r1) {
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
      for (int i = 0; i < R; ++i) {
        __m512 wv = _mm512_loadu_ps(w + (r + i) * k + j);
        for (int m = 0; m < M; ++m) acc[i][m] = _mm512_fmadd_ps(wv, xs[m], acc[i][m]);
      }
    }
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
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = _mm512_reduce_add_ps(acc[i][m]);
#elif defined(__AVX2__)
    __m256 acc[R][M];
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
    for (; j + 8 <= k; j += 8) {
      __m256 xs[M];
      for (int m = 0; m < M; ++m) xs[m] = _mm256_loadu_ps(x + m * k + j);
      for (int i = 0; i < R; ++i) {
        __m256 wv = _mm256_loadu_ps(w + (r + i) * k + j);
        for (int m = 0; m < M; ++m) acc[i][m] = _mm256_fmadd_ps(wv, xs[m], acc[i][m]);
      }
    }
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
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = sum8(acc[i][m]);
#else
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) sums[i][m] = 0.f;
#endif
    for (; j < k; ++j)
      for (int i = 0; i < R; ++i)
        for (int m = 0; m < M; ++m) sums[i][m] += w[(r + i) * k + j] * x[m * k + j];
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) y[m * out + r + i] = sums[i][m] + (bias ? bias[r + i] : 0.f);
  }
  if constexpr (R > 1) {
    if (r < r1) gemv_rows<M, 1>(x, w, bias, k, out, y, r, r1);
  }
}

template <int M>
void gemv(const float* x, const float* w, const float* bias, int64_t k, int64_t out, float* y) {
  constexpr int R = M <= 2 ? 4 : M <= 4 ? 2 : 1;  // accumulators R x M stay within the 16 vector registers
  at::parallel_for(0, out, 64, [&](int64_t r0, int64_t r1) { gemv_rows<M, R>(x, w, bias, k, out, y, r0, r1); });
}

void gemv_any(int64_t m, const float* x, const float* w, const float* bias, int64_t k, int64_t out, float* y) {
  switch (m) {
    case 1: gemv<1>(x, w, bias, k, out, y); break;
    case 2: gemv<2>(x, w, bias, k, out, y); break;
    case 3: gemv<3>(x, w, bias, k, out, y); break;
    case 4: gemv<4>(x, w, bias, k, out, y); break;
    case 5: gemv<5>(x, w, bias, k, out, y); break;
    case 6: gemv<6>(x, w, bias, k, out, y); break;
    case 7: gemv<7>(x, w, bias, k, out, y); break;
    default: gemv<8>(x, w, bias, k, out, y);
  }
}

}  // namespace

// x (..., in) with at most 8 rows, basis (rank, in), coeff (out, rank), bias (out) or None; float32,
// basis and coeff contiguous. Returns coeff (basis x) + bias, (..., out). The reshapes happen here,
// not in Python: at batch 1 each dispatcher call costs as much as the matmul of a small factor.
torch::Tensor lowrank_linear(torch::Tensor x, torch::Tensor basis, torch::Tensor coeff, c10::optional<torch::Tensor> bias) {
  const int64_t in = x.size(-1), rank = basis.size(0), out = coeff.size(0);
  torch::Tensor flat = x.reshape({-1, in}).contiguous();
  const int64_t m = flat.size(0);
  TORCH_CHECK(m <= 8, "lowrank_linear: at most 8 rows");
  for (const auto* t : {&flat, &basis, &coeff})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous(), "operands: contiguous float32");
  TORCH_CHECK(basis.size(1) == in && coeff.size(1) == rank, "shapes do not chain");
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat && b.numel() == out, "bias: (out,) float32");
  }
  auto t = torch::empty({m, rank}, x.options());
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  auto y = torch::empty(sizes, x.options());
  gemv_any(m, flat.data_ptr<float>(), basis.data_ptr<float>(), nullptr, in, rank, t.data_ptr<float>());
  gemv_any(m, t.data_ptr<float>(), coeff.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr, rank, out,
           y.data_ptr<float>());
  return y;
}

// Registered as a PyTorch operator (torch.ops.wscompress.lowrank_linear), not a Python module: a
// compiled graph (torch.compile) calls it like any aten op; wscompress/kernels gives its shape rule.
TORCH_LIBRARY_FRAGMENT(wscompress, m) {
  m.def("lowrank_linear(Tensor x, Tensor basis, Tensor coeff, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(wscompress, CPU, m) { m.impl("lowrank_linear", &lowrank_linear); }
