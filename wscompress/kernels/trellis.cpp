// The Viterbi search of the trellis code (wscompress maths/trellis.py), batched over rows.
//
// A run of T weights (a tile) is coded as a walk through 2^L states: state t is the L bits of
// the stream from bit t·k on, so the next state keeps L - k bits of the one before and takes k
// new ones, and weight t decodes to values[state t]. The search finds the walk of least
// weighted squared error: for each state the cheapest walk ending there, over T steps. A step
// is two passes over the 2^L costs: the least of each state's 2^k predecessors (states
// j·G + r, G = 2^(L-k), for the successors r·2^k + b) and the new weight's error against every
// state's value. 16 walks go through them together, one a vector lane, so every operation is
// the same for all lanes and nothing is shuffled (a walk a thread, vectorised over states,
// needed the successors' scattered stores and ran 10x slower).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int P = 16;  // walks searched together, one a lane: every step is the same for all of them
// GCC's vector types: the compiler emits the widest instructions the CPU has (-march=native)
typedef float vf __attribute__((vector_size(P * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(P * sizeof(int32_t))));
typedef uint8_t vb __attribute__((vector_size(P)));

// Walks b0 .. b0 + n (n <= P) of w, h (B, T) into states (B, T); the buffers are the caller's.
template <int K>
void search_block(const float* w, const float* h, const float* values, int64_t b0, int64_t n, int64_t T, int L,
                  int32_t* states, std::vector<vf>& cost, std::vector<vf>& least, std::vector<vb>& back,
                  std::vector<vf>& wt, std::vector<vf>& ht) {
  const int64_t S = int64_t(1) << L, G = S / K;
  for (int64_t t = 0; t < T; ++t)
    for (int p = 0; p < P; ++p) {  // lanes past the last walk repeat it: their results are dropped
      const int64_t row = b0 + (p < n ? p : n - 1);
      wt[t][p] = w[row * T + t];
      ht[t][p] = h[row * T + t];
    }
  for (int64_t s = 0; s < S; ++s) {  // the first state is free: all its bits are stored
    const vf e = wt[0] - values[s];
    cost[s] = ht[0] * e * e;
  }
  for (int64_t t = 1; t < T; ++t) {
    vb* arg = back.data() + t * G;
    for (int64_t r = 0; r < G; ++r) {  // the cheapest of the K predecessors j·G + r of successors r·K + b
      vf m = cost[r];
      vi a = vi{};
      for (int j = 1; j < K; ++j) {
        const vf c = cost[j * G + r];
        const vi lower = c < m;
        a = lower ? (vi{} + j) : a;
        m = lower ? c : m;
      }
      least[r] = m;
      arg[r] = __builtin_convertvector(a, vb);
    }
    const vf wv = wt[t], hv = ht[t];
    for (int64_t r = 0; r < G; ++r)
      for (int b = 0; b < K; ++b) {
        const vf e = wv - values[r * K + b];
        cost[r * K + b] = least[r] + hv * e * e;
      }
  }
  vf best = cost[0];
  vi end = vi{};
  for (int64_t s = 1; s < S; ++s) {
    const vi lower = cost[s] < best;
    end = lower ? (vi{} + int32_t(s)) : end;
    best = lower ? cost[s] : best;
  }
  for (int p = 0; p < n; ++p) {
    int64_t s = end[p];
    int32_t* out = states + (b0 + p) * T;
    for (int64_t t = T - 1; t > 0; --t) {
      out[t] = int32_t(s);
      const int64_t r = s >> __builtin_ctz(K);
      s = int64_t(back[t * G + r][p]) * G + r;
    }
    out[0] = int32_t(s);
  }
}

// states (B, T) int32 of rows ``w`` (B, T) weighted by ``h`` (B, T), in the code ``values``
// (2^L,), k bits a step, each walk's first state free.
torch::Tensor viterbi(torch::Tensor w, torch::Tensor h, torch::Tensor values, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && h.sizes() == w.sizes() && w.scalar_type() == torch::kFloat32 &&
              h.scalar_type() == torch::kFloat32, "w and h: (B, T) float32");
  TORCH_CHECK(values.dim() == 1 && values.scalar_type() == torch::kFloat32, "values: (2^L,) float32");
  const int64_t S = values.size(0);
  const int L = __builtin_ctzll(S);
  TORCH_CHECK(S == (int64_t(1) << L) && L <= 20 && k >= 1 && k <= 4 && k < L, "2^L values, 1 <= k <= 4, k < L <= 20");
  w = w.contiguous(), h = h.contiguous(), values = values.contiguous();
  const int64_t B = w.size(0), T = w.size(1);
  auto out = torch::empty({B, T}, torch::kInt32);
  if (B == 0 || T == 0) return out;
  const float *pw = w.data_ptr<float>(), *ph = h.data_ptr<float>(), *pv = values.data_ptr<float>();
  int32_t* po = out.data_ptr<int32_t>();
  at::parallel_for(0, (B + P - 1) / P, 1, [&](int64_t g0, int64_t g1) {
    std::vector<vf> cost(S), least(S >> k), wt(T), ht(T);
    std::vector<vb> back(T * (S >> k));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * P, n = std::min<int64_t>(P, B - b0);
      switch (k) {
        case 1: search_block<2>(pw, ph, pv, b0, n, T, L, po, cost, least, back, wt, ht); break;
        case 2: search_block<4>(pw, ph, pv, b0, n, T, L, po, cost, least, back, wt, ht); break;
        case 3: search_block<8>(pw, ph, pv, b0, n, T, L, po, cost, least, back, wt, ht); break;
        default: search_block<16>(pw, ph, pv, b0, n, T, L, po, cost, least, back, wt, ht); break;
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("viterbi", &viterbi, "least-error walks of rows through the trellis code's states");
}
