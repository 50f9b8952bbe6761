// RMSNorm of bfloat16 activations in one pass, for calibration's bfloat16 layer passes
// (wscompress.pipeline.layerwise.computing_in).
//
// LLaMA-style RMSNorm (transformers' LlamaRMSNorm and its copies) casts the input to float32,
// squares, averages, takes rsqrt, multiplies, casts back and multiplies by the weight: seven
// passes over a tensor that does not fit in cache, ~7.5 ms for 8 x 512 x 576 values on this
// machine's 2 cores. Here each row is read once and written once with the same arithmetic:
// y = bf16(w * bf16(x * rsqrt(mean(x²) + eps))), float32 inside, round-to-nearest-even casts.
// Only the order of the float32 sum of squares differs from torch's. Loaded only on CPUs with
// AVX-512 BF16; elsewhere the module's own forward runs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

#ifndef __AVX512BF16__
#error "norms.cpp needs AVX-512 BF16 (-march=native on a CPU that has it)"
#endif

namespace {

inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 round_bf16(__m512 v) { return widen((__m256i)_mm512_cvtneps_pbh(v)); }

}  // namespace

// x (..., d) bfloat16 contiguous, weight (d) bfloat16; returns the normalised x, (..., d) bfloat16.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16, "x, weight: bfloat16");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.device().is_cpu(), "x, weight: contiguous, CPU");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(weight.numel() == d, "weight: (d,)");
  auto y = torch::empty_like(x);
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* in = src + r * d;
      uint16_t* out = dst + r * d;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < d; j += 16) {
        const __mmask16 mask = d - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (d - j)) - 1);
        const __m512 v = widen(_mm256_maskz_loadu_epi16(mask, in + j));
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float variance = _mm512_reduce_add_ps(acc) / static_cast<float>(d);
      const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(variance + epsf));
      for (int64_t j = 0; j < d; j += 16) {
        const __mmask16 mask = d - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (d - j)) - 1);
        const __m512 v = round_bf16(_mm512_mul_ps(widen(_mm256_maskz_loadu_epi16(mask, in + j)), scale));
        const __m512 o = _mm512_mul_ps(widen(_mm256_maskz_loadu_epi16(mask, w + j)), v);
        _mm256_mask_storeu_epi16(out + j, mask, (__m256i)_mm512_cvtneps_pbh(o));
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "bf16(w * bf16(x * rsqrt(mean(x²) + eps))) of bfloat16 x, w");
}
