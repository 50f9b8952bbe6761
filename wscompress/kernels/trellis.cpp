// The Viterbi search of the trellis code (wscompress maths/trellis.py), batched over rows.
//
// A row of T weights is coded as a walk through 2^L states: state t is the last L bits of the
// row's bit stream after t·k bits, so the next state keeps L - k bits of the one before and
// takes k new ones, and weight t decodes to values[state t]. The search finds the walk of least
// weighted squared error: for each state the cheapest walk ending there, over T steps. A step
// is two passes over the 2^L costs: the least of each state's 2^k predecessors (states
// j·G + r, G = 2^(L-k), for the successors r·2^k + b: contiguous in r) and the new weight's
// error against every state's value; both vectorise. The torch path does the same with tensors
// (0.1-1 s a thousand rows of 64 weights at L = 12; this is ~50x faster).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <limits>
#include <vector>

namespace {

template <int K>
void search_row(const float* w, const float* h, const float* values, int64_t T, int L, int64_t start,
                int32_t* states, std::vector<float>& cost, std::vector<float>& next, std::vector<uint8_t>& back) {
  const int64_t S = int64_t(1) << L, G = S / K;
  const float inf = std::numeric_limits<float>::infinity();
  if (start < 0) {  // the first state is free: all its L bits are stored
    for (int64_t s = 0; s < S; ++s) cost[s] = h[0] * (w[0] - values[s]) * (w[0] - values[s]);
  } else {  // the walk goes on from ``start``, the state the row's previous block ended in
    for (int64_t s = 0; s < S; ++s) cost[s] = inf;
    cost[start] = 0.f;
  }
  for (int64_t t = start < 0 ? 1 : 0; t < T; ++t) {
    uint8_t* arg = back.data() + t * G;
    float* least = next.data();  // each successor group's cheapest predecessor
    for (int64_t r = 0; r < G; ++r) {
      float m = cost[r];
      uint8_t a = 0;
      for (int j = 1; j < K; ++j) {
        const float c = cost[j * G + r];
        a = c < m ? j : a;
        m = c < m ? c : m;
      }
      least[r] = m;
      arg[r] = a;
    }
    const float wt = w[t], ht = h[t];
    for (int64_t r = 0; r < G; ++r) {
      const float m = least[r];
      for (int b = 0; b < K; ++b) {
        const float e = wt - values[r * K + b];
        cost[r * K + b] = m + ht * e * e;
      }
    }
  }
  int64_t s = 0;
  for (int64_t q = 1; q < S; ++q) s = cost[q] < cost[s] ? q : s;
  for (int64_t t = T - 1; t >= 0; --t) {
    states[t] = int32_t(s);
    if (t == 0 && start < 0) break;
    const int64_t r = s >> __builtin_ctz(K);
    s = int64_t(back[t * G + r]) * G + r;
  }
}

// states (B, T) int32 of rows ``w`` (B, T) weighted by ``h`` (B, T), in the code ``values``
// (2^L,), k bits a step; ``start`` (B,) int64: the state each row's walk goes on from, -1 free.
torch::Tensor viterbi(torch::Tensor w, torch::Tensor h, torch::Tensor values, int64_t k, torch::Tensor start) {
  TORCH_CHECK(w.dim() == 2 && h.sizes() == w.sizes() && w.scalar_type() == torch::kFloat32 &&
              h.scalar_type() == torch::kFloat32, "w and h: (B, T) float32");
  TORCH_CHECK(values.dim() == 1 && values.scalar_type() == torch::kFloat32, "values: (2^L,) float32");
  TORCH_CHECK(start.dim() == 1 && start.size(0) == w.size(0) && start.scalar_type() == torch::kInt64, "start: (B,) int64");
  const int64_t S = values.size(0);
  const int L = __builtin_ctzll(S);
  TORCH_CHECK(S == (int64_t(1) << L) && L <= 20 && k >= 1 && k <= 4 && k < L, "2^L values, 1 <= k <= 4, k < L <= 20");
  w = w.contiguous(), h = h.contiguous(), values = values.contiguous(), start = start.contiguous();
  const int64_t B = w.size(0), T = w.size(1);
  auto out = torch::empty({B, T}, torch::kInt32);
  const float *pw = w.data_ptr<float>(), *ph = h.data_ptr<float>(), *pv = values.data_ptr<float>();
  const int64_t* ps = start.data_ptr<int64_t>();
  int32_t* po = out.data_ptr<int32_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> cost(S), next(S >> k);
    std::vector<uint8_t> back(T * (S >> k));
    for (int64_t b = b0; b < b1; ++b) {
      const float *rw = pw + b * T, *rh = ph + b * T;
      TORCH_CHECK(ps[b] < S, "start state out of range");
      switch (k) {
        case 1: search_row<2>(rw, rh, pv, T, L, ps[b], po + b * T, cost, next, back); break;
        case 2: search_row<4>(rw, rh, pv, T, L, ps[b], po + b * T, cost, next, back); break;
        case 3: search_row<8>(rw, rh, pv, T, L, ps[b], po + b * T, cost, next, back); break;
        default: search_row<16>(rw, rh, pv, T, L, ps[b], po + b * T, cost, next, back); break;
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("viterbi", &viterbi, "least-error walks of rows through the trellis code's states");
}
