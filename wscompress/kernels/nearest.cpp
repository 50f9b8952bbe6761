// Nearest centroid for vector k-means (wscompress maths/clustering.py ``_nearest``): for points
// (B, m, d) and centroids (B, K, d), the index of the nearest centroid of each point's group and
// the squared distance to it.
//
// The torch path writes the whole (m, K) distance matrix (baddbmm) and reads it again (min):
// with d = 2 or 4 and K = 256 each entry costs a few flops but 8 bytes of memory traffic, so
// Lloyd's iterations ran at the memory's speed. Here 16 points at a time sit in registers while
// every centroid of their group passes by, keeping the running minimum: the distance matrix
// never exists. Ties go to the lowest index, as torch's min does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <limits>

namespace {

constexpr int P = 16;  // points a block: one AVX-512 register (two AVX2 ones) per coordinate
// GCC's vector types: the compiler emits the widest instructions the CPU has (-march=native)
typedef float vf __attribute__((vector_size(P * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(P * sizeof(int32_t))));

template <int D>
void block_nearest(const float* p, int64_t n, const float* c, const float* c2, int64_t K, int64_t* idx, float* dist) {
  vf px[D];
  for (int j = 0; j < D; ++j)
    for (int i = 0; i < P; ++i) px[j][i] = i < n ? p[i * D + j] : 0.f;
  vf best = vf{} + std::numeric_limits<float>::infinity();
  vi arg = vi{};
  for (int32_t k = 0; k < K; ++k) {
    vf s = vf{} + c2[k];
    for (int j = 0; j < D; ++j) s += px[j] * (-2.f * c[k * D + j]);
    const vi lower = s < best;  // all ones where this centroid is nearer
    best = lower ? s : best;
    arg = lower ? (vi{} + k) : arg;
  }
  for (int i = 0; i < n; ++i) {
    float norm = 0.f;
    for (int j = 0; j < D; ++j) norm += px[j][i] * px[j][i];
    idx[i] = arg[i];
    dist[i] = best[i] + norm;
  }
}

template <int D>
void run(const float* p, const float* c, const float* c2, int64_t B, int64_t m, int64_t K, int64_t* idx, float* dist) {
  const int64_t blocks = (m + P - 1) / P;
  at::parallel_for(0, B * blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / blocks, i0 = (t % blocks) * P, n = std::min<int64_t>(P, m - i0);
      block_nearest<D>(p + (b * m + i0) * D, n, c + b * K * D, c2 + b * K, K, idx + b * m + i0, dist + b * m + i0);
    }
  });
}

}  // namespace

// (indices (B, m) int64, squared distances (B, m) float32) for float32 points (B, m, d) and
// centroids (B, K, d), d in 1..8
std::vector<torch::Tensor> nearest(torch::Tensor points, torch::Tensor centroids) {
  TORCH_CHECK(points.dim() == 3 && centroids.dim() == 3 && points.size(0) == centroids.size(0) &&
                  points.size(2) == centroids.size(2),
              "nearest: points (B, m, d), centroids (B, K, d)");
  TORCH_CHECK(points.scalar_type() == torch::kFloat32 && centroids.scalar_type() == torch::kFloat32,
              "nearest: float32 tensors");
  points = points.contiguous();
  centroids = centroids.contiguous();
  const int64_t B = points.size(0), m = points.size(1), d = points.size(2), K = centroids.size(1);
  auto c2 = centroids.pow(2).sum(-1).contiguous();
  auto idx = torch::empty({B, m}, points.options().dtype(torch::kInt64));
  auto dist = torch::empty({B, m}, points.options());
  const float *pp = points.data_ptr<float>(), *cp = centroids.data_ptr<float>(), *c2p = c2.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  float* dp = dist.data_ptr<float>();
  switch (d) {
    case 1: run<1>(pp, cp, c2p, B, m, K, ip, dp); break;
    case 2: run<2>(pp, cp, c2p, B, m, K, ip, dp); break;
    case 3: run<3>(pp, cp, c2p, B, m, K, ip, dp); break;
    case 4: run<4>(pp, cp, c2p, B, m, K, ip, dp); break;
    case 5: run<5>(pp, cp, c2p, B, m, K, ip, dp); break;
    case 6: run<6>(pp, cp, c2p, B, m, K, ip, dp); break;
    case 7: run<7>(pp, cp, c2p, B, m, K, ip, dp); break;
    case 8: run<8>(pp, cp, c2p, B, m, K, ip, dp); break;
    default: TORCH_CHECK(false, "nearest: d in 1..8, got ", d);
  }
  return {idx, dist};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("nearest", &nearest, "nearest centroid of each point, and the squared distance to it");
}
