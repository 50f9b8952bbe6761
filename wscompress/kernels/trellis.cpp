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
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int P = 16;  // walks searched together, one a lane: every step is the same for all of them
// GCC's vector types: the compiler emits the widest instructions the CPU has (-march=native)
typedef float vf __attribute__((vector_size(P * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(P * sizeof(int32_t))));
typedef uint8_t vb __attribute__((vector_size(P)));

// Walks b0 .. b0 + n (n <= P) of w, h (B, T) into states (B, T); ``overlap`` (B): where not
// -1, the walk's first state begins with these L - k bits and its last state ends with them
// (the walk bites its tail); the buffers are the caller's.
template <int K>
void search_block(const float* w, const float* h, const float* values, const int64_t* overlap, int64_t b0, int64_t n,
                  int64_t T, int L, int32_t* states, std::vector<vf>& cost, std::vector<vf>& least,
                  std::vector<vb>& back, std::vector<vf>& wt, std::vector<vf>& ht) {
  const int64_t S = int64_t(1) << L, G = S / K;
  const float inf = std::numeric_limits<float>::infinity();
  vi ov;
  for (int64_t t = 0; t < T; ++t)
    for (int p = 0; p < P; ++p) {  // lanes past the last walk repeat it: their results are dropped
      const int64_t row = b0 + (p < n ? p : n - 1);
      wt[t][p] = w[row * T + t];
      ht[t][p] = h[row * T + t];
      ov[p] = int32_t(overlap[row]);
    }
  const vi free = ov < 0;
  for (int64_t s = 0; s < S; ++s) {
    const vf e = wt[0] - values[s];
    const vi allowed = free | (vi{} + int32_t(s / K)) == ov;  // the first state's top L - k bits
    cost[s] = allowed ? ht[0] * e * e : vf{} + inf;
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
  vf best = vf{} + inf;
  vi end = vi{};
  for (int64_t s = 0; s < S; ++s) {
    const vi allowed = free | (vi{} + int32_t(s % G)) == ov;  // the last state's low L - k bits
    const vi lower = allowed & (cost[s] < best);
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
// (2^L,), k bits a step; ``overlap`` (B,) int64: -1 (the walk free) or the L - k bits its first
// state begins and its last state ends with.
torch::Tensor viterbi(torch::Tensor w, torch::Tensor h, torch::Tensor values, int64_t k, torch::Tensor overlap) {
  TORCH_CHECK(w.dim() == 2 && h.sizes() == w.sizes() && w.scalar_type() == torch::kFloat32 &&
              h.scalar_type() == torch::kFloat32, "w and h: (B, T) float32");
  TORCH_CHECK(values.dim() == 1 && values.scalar_type() == torch::kFloat32, "values: (2^L,) float32");
  const int64_t S = values.size(0);
  const int L = __builtin_ctzll(S);
  TORCH_CHECK(S == (int64_t(1) << L) && L <= 20 && k >= 1 && k <= 4 && k < L, "2^L values, 1 <= k <= 4, k < L <= 20");
  TORCH_CHECK(overlap.dim() == 1 && overlap.size(0) == w.size(0) && overlap.scalar_type() == torch::kInt64,
              "overlap: (B,) int64");
  TORCH_CHECK(overlap.numel() == 0 || overlap.max().item<int64_t>() < (S >> k), "overlap has more than L - k bits");
  w = w.contiguous(), h = h.contiguous(), values = values.contiguous(), overlap = overlap.contiguous();
  const int64_t B = w.size(0), T = w.size(1);
  const int64_t* po_ = overlap.data_ptr<int64_t>();
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
        case 1: search_block<2>(pw, ph, pv, po_, b0, n, T, L, po, cost, least, back, wt, ht); break;
        case 2: search_block<4>(pw, ph, pv, po_, b0, n, T, L, po, cost, least, back, wt, ht); break;
        case 3: search_block<8>(pw, ph, pv, po_, b0, n, T, L, po, cost, least, back, wt, ht); break;
        default: search_block<16>(pw, ph, pv, po_, b0, n, T, L, po, cost, least, back, wt, ht); break;
      }
    }
  });
  return out;
}


// ----------------------------------------------------------------------------- decoding
//
// A layer's stream (out / 16, in / 16, tile bytes) holds a walk a 16 x 16 tile, down each column
// in turn (wscompress_trellis.to_tiles), its stream of 256·k bits read circularly (the walk
// bites its tail): the 8 states of half a tile column start on a byte (bit 8k·m) and fit one
// big-endian 64-bit word (7k + L <= 45 bits), from which one variable shift a lane takes each. A state's value is QTIP's 1MAD: the byte sum of
// a·s + b, less 510 (from each value: taken out of the sums once, it cancelled digits), over
// its standard deviation (folded into the row scale). A tile is copied to a buffer followed by
// its first 8 bytes again, so the words read past its end read its beginning.

constexpr int TILE = 16;
constexpr uint32_t MAD_A = 34038481u, MAD_B = 76625530u;  // wscompress_trellis.ONE_MAD
constexpr int PAD = 136;  // bytes a buffered tile takes: a tile's stream is at most 256·4 / 8 = 128, +8 read past
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));
typedef uint64_t v8q __attribute__((vector_size(8 * sizeof(uint64_t))));
typedef uint32_t v8u __attribute__((vector_size(8 * sizeof(uint32_t))));

struct Reader {
  const uint8_t* tile;  // PAD bytes
  int bits, L;
  v8q lane_shift;  // r·k for lanes r = 0..7

  Reader(const uint8_t* tile_, int bits_, int L_) : tile(tile_), bits(bits_), L(L_) {
    for (int r = 0; r < 8; ++r) lane_shift[r] = uint64_t(r * bits_);
  }

  // the 1MAD byte sums (0 .. 1020) of the 8 states from state index t0 on, t0 a multiple of 8:
  // its walk's bits start on a byte (8k bits a run of 8 states)
  v8u sums(int t0) const {
    uint64_t word;
    std::memcpy(&word, tile + t0 * bits / 8, 8);
    word = __builtin_bswap64(word);  // the walk's bits from t0 on, most significant first
    const v8q states = ((v8q{} + word) << lane_shift) >> (64 - L);
    const v8u x = __builtin_convertvector(states, v8u) * MAD_A + MAD_B;
    return (x & 0xFF) + (x >> 8 & 0xFF) + (x >> 16 & 0xFF) + (x >> 24);
  }

  v8f values(int t0) const { return __builtin_convertvector(sums(t0), v8f) - 510.f; }
};

// y (n, out) = x (n, in) Wᵀ for small n (decoding): row groups of 16 in parallel, each tile's
// values computed once and multiplied into all n rows.
torch::Tensor trellis_linear(torch::Tensor x, torch::Tensor stream, torch::Tensor scale, int64_t bits,
                             int64_t state_bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: (n, in) float32");
  TORCH_CHECK(stream.dim() == 3 && stream.scalar_type() == torch::kUInt8, "stream: (out / 16, in / 16, bytes) uint8");
  const int64_t n = x.size(0), groups = stream.size(0), cols = stream.size(1), bytes = stream.size(2);
  TORCH_CHECK(x.size(1) == cols * TILE && scale.numel() == groups * TILE && bytes * 8 == TILE * TILE * bits &&
              bytes + 8 <= PAD, "shapes disagree");
  x = x.contiguous(), stream = stream.contiguous();
  auto sc = scale.to(torch::kFloat32).contiguous();
  auto y = torch::empty({n, groups * TILE}, torch::kFloat32);
  const float* px = x.data_ptr<float>();
  const float* ps = sc.data_ptr<float>();
  const uint8_t* pt = stream.data_ptr<uint8_t>();
  float* py = y.data_ptr<float>();
  const int64_t in = cols * TILE;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) uint8_t tile[PAD] = {};
    const Reader reader(tile, int(bits), int(state_bits));
    std::vector<v8f> acc(2 * n);
    for (int64_t g = g0; g < g1; ++g) {
      std::fill(acc.begin(), acc.end(), v8f{});
      for (int64_t c = 0; c < cols; ++c) {
        std::memcpy(tile, pt + (g * cols + c) * bytes, bytes);
        std::memcpy(tile + bytes, tile, 8);
        for (int j = 0; j < TILE; ++j) {
          const v8f lo = reader.values(j * TILE), hi = reader.values(j * TILE + 8);
          for (int64_t i = 0; i < n; ++i) {
            const float xv = px[i * in + c * TILE + j];
            acc[2 * i] += lo * xv;
            acc[2 * i + 1] += hi * xv;
          }
        }
      }
      for (int64_t i = 0; i < n; ++i)
        for (int r = 0; r < TILE; ++r)
          py[i * groups * TILE + g * TILE + r] = acc[2 * i + r / 8][r % 8] * ps[g * TILE + r];
    }
  });
  return y;
}

// The dense weight (out, in) float32 times the row scales (prefill multiplies it with the BLAS).
torch::Tensor trellis_dense(torch::Tensor stream, torch::Tensor scale, int64_t bits, int64_t state_bits) {
  TORCH_CHECK(stream.dim() == 3 && stream.scalar_type() == torch::kUInt8, "stream: (out / 16, in / 16, bytes) uint8");
  const int64_t groups = stream.size(0), cols = stream.size(1), bytes = stream.size(2);
  TORCH_CHECK(scale.numel() == groups * TILE && bytes * 8 == TILE * TILE * bits && bytes + 8 <= PAD,
              "shapes disagree");
  stream = stream.contiguous();
  auto sc = scale.to(torch::kFloat32).contiguous();
  auto w = torch::empty({groups * TILE, cols * TILE}, torch::kFloat32);
  const float* ps = sc.data_ptr<float>();
  const uint8_t* pt = stream.data_ptr<uint8_t>();
  float* pw = w.data_ptr<float>();
  const int64_t in = cols * TILE;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) uint8_t tile[PAD] = {};
    const Reader reader(tile, int(bits), int(state_bits));
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < cols; ++c) {
        std::memcpy(tile, pt + (g * cols + c) * bytes, bytes);
        std::memcpy(tile + bytes, tile, 8);
        for (int j = 0; j < TILE; ++j) {
          const v8f lo = reader.values(j * TILE), hi = reader.values(j * TILE + 8);
          for (int r = 0; r < TILE; ++r)
            pw[(g * TILE + r) * in + c * TILE + j] = (r < 8 ? lo[r] : hi[r - 8]) * ps[g * TILE + r];
        }
      }
  });
  return w;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wscompress, m) {
  m.def("trellis_viterbi(Tensor w, Tensor h, Tensor values, int bits, Tensor overlap) -> Tensor");
  m.def("trellis_linear(Tensor x, Tensor stream, Tensor scale, int bits, int state_bits) -> Tensor");
  m.def("trellis_dense(Tensor stream, Tensor scale, int bits, int state_bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(wscompress, CPU, m) {
  m.impl("trellis_viterbi", &viterbi);
  m.impl("trellis_linear", &trellis_linear);
  m.impl("trellis_dense", &trellis_dense);
}
