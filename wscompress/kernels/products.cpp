// C += Xᵀ·Y of a bfloat16 batch into a float64 sum, for calibration's Gram matrices and cross
// products (wscompress.maths.linalg.add_gram / add_product).
//
// A product of two bfloat16 numbers is exact in float32, so a float32 sum of them is what the
// BLAS gives on the batch cast to float32; but the BLAS (OpenBLAS's ssyrk, MKL's sgemm) then works
// at float32 speed, and on AMD CPUs MKL's own bfloat16 product does not use the bfloat16
// instructions. AVX-512 BF16's VDPBF16PS multiplies 32 bfloat16 pairs and adds them to 16 float32
// sums in one instruction, twice float32's rate. Each tile's float32 sum over the batch is added to
// the float64 C once, as linalg adds the BLAS's float32 product, without a float32 copy of C. Rows of X are paired (tokens 2p, 2p+1), columns are
// packed in blocks of 32 so that each tile streams its operands in order, and for a Gram matrix
// only the tiles that touch the lower triangle are formed (linalg.symmetrize completes the rest).
// Loaded only on CPUs with AVX-512 BF16; elsewhere linalg uses the BLAS.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#ifndef __AVX512BF16__
#error "products.cpp needs AVX-512 BF16 (-march=native on a CPU that has it)"
#endif

#include <vector>

namespace {

constexpr int64_t NB = 32;     // packed column block: two 16-float vectors of a tile's columns
constexpr int64_t MR = 8;      // rows of C per tile: 8 x 2 accumulators + 2 operands stay in registers
constexpr int64_t KS = 256;   // token pairs summed in registers before joining the tile's float32 sum (rounding as ssyrk's)
constexpr int64_t KC = 2048;  // token pairs per pass over C: a 32-column block's panel (256 KiB) stays in L2

// q (blocks, pairs, NB) int32: q[b][p][c] = bf16 x[2p][32b + c] in the low half, x[2p + 1][...] in
// the high half, zeros past the last row or column.
torch::Tensor pack(const torch::Tensor& x) {
  const int64_t k = x.size(0), n = x.size(1), pairs = (k + 1) / 2, blocks = (n + NB - 1) / NB;
  auto q = torch::empty({blocks, pairs, NB}, x.options().dtype(torch::kInt));
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  int32_t* dst = q.data_ptr<int32_t>();
  at::parallel_for(0, blocks * pairs, 256, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t b = s / pairs, p = s % pairs, c0 = b * NB;
      const uint16_t* lo = src + 2 * p * n + c0;
      const bool odd = 2 * p + 1 < k;
      for (int64_t h = 0; h < NB; h += 16) {
        const int64_t left = n - c0 - h;
        const __mmask16 mask = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
        __m512i a = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, lo + h));
        __m512i c = odd ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, lo + n + h)) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + s * NB + h, _mm512_or_si512(a, _mm512_slli_epi32(c, 16)));
      }
    }
  });
  return q;
}

// C[i0 .. i0+MR, j0 .. j0+NB] += the products of pairs p0 .. p1; a: x's packed block holding rows
// i0.. at offset i0 % NB, b: y's packed block j0 / NB. Runs of KS pairs are summed in registers and
// then added to a sum in L1, so no float32 sum takes more than KS + (p1 - p0) / KS additions.
void tile(const int32_t* a, const int32_t* b, int64_t p0, int64_t p1, double* c, int64_t ldc, int64_t rows,
          int64_t cols) {
  __m512 sum[MR][2];
  for (int r = 0; r < MR; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
  for (int64_t s0 = p0; s0 < p1; s0 += KS) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = s0, s1 = std::min(s0 + KS, p1); p < s1; ++p) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * NB), b1 = (__m512bh)_mm512_loadu_si512(b + p * NB + 16);
      for (int r = 0; r < MR; ++r) {
        const __m512bh av = (__m512bh)_mm512_set1_epi32(a[p * NB + r]);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) sum[r][h] = _mm512_add_ps(sum[r][h], acc[r][h]);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int q = 0; q < 4; ++q) {  // four runs of 8 doubles
      const int64_t left = cols - 8 * q;
      if (left <= 0) break;
      const __mmask8 mask = left >= 8 ? 0xFF : static_cast<__mmask8>((1u << left) - 1);
      const __m256 half = q % 2 ? _mm512_extractf32x8_ps(sum[r][q / 2], 1) : _mm512_castps512_ps256(sum[r][q / 2]);
      double* out = c + r * ldc + 8 * q;
      _mm512_mask_storeu_pd(out, mask, _mm512_add_pd(_mm512_maskz_loadu_pd(mask, out), _mm512_cvtps_pd(half)));
    }
}

// c (dx, dy) float64 += xᵀ·y; with `lower`, x is y and only tiles reaching the lower triangle are formed.
void add_products(torch::Tensor& c, const torch::Tensor& x, const torch::Tensor& y, bool lower) {
  const int64_t dx = x.size(1), dy = y.size(1);
  const torch::Tensor qx = pack(x), qy = lower ? qx : pack(y);
  const int64_t pairs = qx.size(1);
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (row, column block), column-block-major: a block's panel is reused
  for (int64_t j = 0; j < dy; j += NB)
    for (int64_t i = lower ? j / MR * MR : 0; i < dx; i += MR) tiles.emplace_back(i, j);
  const int32_t *px = qx.data_ptr<int32_t>(), *py = qy.data_ptr<int32_t>();
  double* pc = c.data_ptr<double>();
  for (int64_t p0 = 0; p0 < pairs; p0 += KC) {
    const int64_t p1 = std::min(p0 + KC, pairs);
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const auto [i, j] = tiles[t];
        tile(px + (i / NB) * pairs * NB + i % NB, py + (j / NB) * pairs * NB, p0, p1, pc + i * dy + j, dy,
             std::min(MR, dx - i), std::min(NB, dy - j));
      }
    });
  }
}

void check(const torch::Tensor& c, const torch::Tensor& x, const torch::Tensor& y) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && y.scalar_type() == torch::kBFloat16, "x, y: bfloat16");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x (tokens, dx), y (tokens, dy)");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && x.device().is_cpu() && y.device().is_cpu(), "x, y: contiguous, CPU");
  TORCH_CHECK(c.scalar_type() == torch::kDouble && c.is_contiguous() && c.size(0) == x.size(1) && c.size(1) == y.size(1),
              "c: contiguous float64 (dx, dy)");
}

}  // namespace

// c += the lower triangle of xᵀx (tiles crossing the diagonal are formed whole; entries wholly above it untouched).
void add_gram(torch::Tensor c, torch::Tensor x) {
  check(c, x, x);
  add_products(c, x, x, true);
}

// c += xᵀy.
void add_product(torch::Tensor c, torch::Tensor x, torch::Tensor y) {
  check(c, x, y);
  add_products(c, x, y, false);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_gram", &add_gram, "c += lower triangle of xᵀx (bfloat16 x, float64 c)");
  m.def("add_product", &add_product, "c += xᵀy (bfloat16 x, y, float64 c)");
}
