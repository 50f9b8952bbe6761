// k-means' two inner loops (wscompress maths/clustering.py), batched over groups of points.
//
// ``nearest``: for points (B, m, d) and centroids (B, K, d), the index of the nearest centroid
// of each point's group and the squared distance to it (vector Lloyd and error feedback).
//
// The torch path writes the whole (m, K) distance matrix (baddbmm) and reads it again (min):
// with d = 2 or 4 and K = 256 each entry costs a few flops but 8 bytes of memory traffic, so
// Lloyd's iterations ran at the memory's speed. Here 16 points at a time sit in registers while
// every centroid of their group passes by, keeping the running minimum: the distance matrix
// never exists. Ties go to the lowest index, as torch's min does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

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

// k-means++ seeding of one group: K centroids, each a point drawn with probability proportional
// to its weight times its squared distance to the nearest centroid so far (the first by weight
// alone), by inverse CDF at uniforms[s]. The torch path spends four passes and three temporaries
// over the group a step (cumsum, searchsorted, the distances, their minimum). Here the points are
// laid out coordinate by coordinate once, and a step is one vectorised pass that lowers the
// distances and sums the mass of each stretch of S x P points, then a walk over the stretches'
// sums to the stretch holding the draw and over that stretch's points.
void seed_group(const float* p, const float* w, const float* u, int64_t m, int64_t d, int64_t K, float* out) {
  constexpr int64_t S = 16;  // blocks a stretch: its mass is summed across lanes once, off the critical path
  const int64_t blocks = (m + P * S - 1) / (P * S) * S, stretches = blocks / S;
  std::vector<vf> coords(blocks * d), weight(blocks), d2(blocks);  // padding points weigh nothing
  std::vector<double> mass(stretches);
  for (int64_t i = 0; i < blocks * P; ++i) {
    for (int64_t j = 0; j < d; ++j) coords[i / P * d + j][i % P] = i < m ? p[i * d + j] : 0.f;
    weight[i / P][i % P] = i < m ? w[i] : 0.f;
  }
  auto lane_sum = [](vf v) {
    double t = 0.0;
    for (int i = 0; i < P; ++i) t += v[i];
    return t;
  };
  auto draw = [&](auto point_mass, float ui) {  // point_mass(b, i): the mass of point i of block b
    double total = 0.0;
    for (int64_t t = 0; t < stretches; ++t) total += mass[t];
    const float target = ui * static_cast<float>(total);
    double acc = 0.0;
    for (int64_t t = 0; t < stretches; ++t) {
      if (static_cast<float>(acc + mass[t]) > target) {
        for (int64_t b = t * S; b < (t + 1) * S; ++b)
          for (int i = 0; i < P; ++i) {
            acc += point_mass(b, i);
            if (static_cast<float>(acc) > target) return std::min(b * P + i, m - 1);
          }
      } else {
        acc += mass[t];
      }
    }
    return m - 1;  // no mass at all (every point a centroid already): any point
  };
  for (int64_t t = 0; t < stretches; ++t) {
    vf sum = vf{};
    for (int64_t b = t * S; b < (t + 1) * S; ++b) sum += weight[b];
    mass[t] = lane_sum(sum);
  }
  int64_t pick = draw([&](int64_t b, int i) { return weight[b][i]; }, u[0]);
  for (int64_t s = 0; s < K; ++s) {
    const float* c = p + pick * d;
    std::copy(c, c + d, out + s * d);
    if (s + 1 == K) break;
    for (int64_t t = 0; t < stretches; ++t) {
      vf sum = vf{};
      for (int64_t b = t * S; b < (t + 1) * S; ++b) {
        vf dist = vf{};
        for (int64_t j = 0; j < d; ++j) {
          const vf diff = coords[b * d + j] - c[j];
          dist += diff * diff;
        }
        d2[b] = s == 0 ? dist : (dist < d2[b] ? dist : d2[b]);
        sum += d2[b] * weight[b];
      }
      mass[t] = lane_sum(sum);
    }
    pick = draw([&](int64_t b, int i) { return d2[b][i] * weight[b][i]; }, u[s + 1]);
  }
}

}  // namespace

// k-means++ centroids (B, K, d) of float32 points (B, m, d) with weights (B, m), drawn at the
// float32 uniforms (B, K) in [0, 1)
torch::Tensor kmeans_pp(torch::Tensor points, torch::Tensor weights, torch::Tensor uniforms) {
  TORCH_CHECK(points.dim() == 3 && weights.dim() == 2 && uniforms.dim() == 2 && weights.size(0) == points.size(0) &&
                  weights.size(1) == points.size(1) && uniforms.size(0) == points.size(0),
              "kmeans_pp: points (B, m, d), weights (B, m), uniforms (B, K)");
  TORCH_CHECK(points.scalar_type() == torch::kFloat32 && weights.scalar_type() == torch::kFloat32 &&
                  uniforms.scalar_type() == torch::kFloat32, "kmeans_pp: float32 tensors");
  points = points.contiguous();
  weights = weights.contiguous();
  uniforms = uniforms.contiguous();
  const int64_t B = points.size(0), m = points.size(1), d = points.size(2), K = uniforms.size(1);
  auto out = torch::empty({B, K, d}, points.options());
  const float *pp = points.data_ptr<float>(), *wp = weights.data_ptr<float>(), *up = uniforms.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) seed_group(pp + b * m * d, wp + b * m, up + b * K, m, d, K, op + b * K * d);
  });
  return out;
}

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
  m.def("kmeans_pp", &kmeans_pp, "k-means++ seeding, batched over groups");
}
