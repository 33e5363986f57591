// Routed experts of one MoE layer on the CPU, reading EXL2 codes as stored (2..8 bits per weight), and the
// CPU engine's dense projections; the integer kernels are in qdot.cpp (qdot.h: layout and entries).
//
// Letters: T rows (1..8), H hidden, I expert width, K input features of a projection, N its outputs,
// G its groups, Q its packed rows (int32 words per column), X experts used by the T rows.
//
// Store (built by runtime/cpu/experts.py and path.py; lossless, the bits of the EXL2 tensors):
//   qw    int32 [N/16, Q, 16]   tiles of 16 columns, each tile contiguous (one sequential stream of Q*64
//                               bytes), codes in qdot's layout (to_planes)
//   sc    fp16  [N/16, G, 16]   exllamav2's scale of group g and column n (fp16, exact)
//   grp   int32 [G, 4]          (bits, first packed row, first input row, rows) of each group
//   perm  int32 [K]             packed row k multiplies input feature perm[k]
//   desc  int64 [E, 3, 8]       per expert and projection (gate, up, down): offsets of the above
//                               (qw, sc, grp, G, perm, K, N, Q); a dense layer's: [P, 8], P projections
// Per call, each row's input to a projection is quantized to int8 per group of its codes (qdot::quantize),
// then each tile of 16 columns reads its codes once for all T rows (qdot::tile). The vector path
// (AVX-512 VNNI, AVX2, scalar) is chosen at run time from one build (qdot::active).
// Threads: one OpenMP team per call, torch.set_num_threads of the calling thread. The GIL is released
// by the binding, so a dedicated Python thread runs it while others drive the GPU.
// Second entry: moedesk_cpu_experts_host(ctx) (plain C, raw pointers, no torch call, no Python), run
// by a worker thread that a decode step feeds, through a doorbell in pinned memory or host nodes
// (below), between its copies to and from pinned memory; both entries share run_pairs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <cmath>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cctype>
#include <fstream>
#include <string>

#include "attention.h"
#include "qdot.h"

namespace {

using qdot::TILE;
constexpr int MAX_T = 8;          // rows of an experts call (decode, or verifying a few drafted tokens)

struct Layer {
  const uint32_t* qw;
  const at::Half* sc;
  const int32_t* grp;
  const int32_t* perm;
  const int64_t* desc;
  // Projection p of expert e (of a dense layer: e = 0, p its index), its pointers at their offsets.
  qdot::Codes proj(int64_t e, int p, int per = 3) const {
    const int64_t* d = desc + (e * per + p) * 8;
    return {qw + d[0], (const uint16_t*)sc + d[1], grp + d[2] * 4, perm + d[4], d[3], d[3], d[5], d[6], d[7]};
  }
};

// Quantized activations of up to MAX_T rows for one projection (qdot::quantize's output).
struct Acts {
  std::vector<int8_t> xa;
  std::vector<float> sx;
  std::vector<int32_t> sq;
  int64_t XB = 0;                  // bytes of xa per row
  void fill(const qdot::Codes& c, const void* src, bool bf16, int64_t ld, const int64_t* rows, int R) {
    XB = qdot::act_bytes(c);
    xa.resize((size_t)R * XB);
    sx.resize((size_t)R * c.G);
    sq.resize((size_t)R * c.G);
    qdot::quantize(c, src, bf16, ld, rows, R, xa.data(), sx.data(), sq.data());
  }
  void tile(int isa, const qdot::Codes& c, int64_t t, int R, float res[][TILE]) const {
    qdot::tile(isa, c, t, xa.data(), XB, sx.data(), sq.data(), R, res);
  }
};

static inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// The experts the rows use, and for each the rows that use it and their routing weights (summed when
// a row picks an expert twice): one read of an expert serves all its rows.
struct Pairs {
  std::vector<int64_t> used;
  std::vector<std::vector<int64_t>> rows;
  std::vector<std::vector<float>> rws;
  void add(int t, int64_t e, float w) {
    size_t j = 0;
    while (j < used.size() && used[j] != e) ++j;
    if (j == used.size()) { used.push_back(e); rows.emplace_back(); rws.emplace_back(); }
    if (!rows[j].empty() && rows[j].back() == t) { rws[j].back() += w; return; }
    rows[j].push_back(t);
    rws[j].push_back(w);
  }
};

// Index of the first used expert whose projections do not chain with x [T, H], or -1.
static int64_t bad_shapes(const Layer& L, const Pairs& S, int64_t H) {
  const int64_t I = L.proj(S.used[0], 0).N;
  for (size_t j = 0; j < S.used.size(); ++j) {
    qdot::Codes g = L.proj(S.used[j], 0), u = L.proj(S.used[j], 1), d = L.proj(S.used[j], 2);
    if (!(g.K == H && u.K == H && g.N == I && u.N == I && d.K == I && d.N == H)) return (int64_t)j;
  }
  return -1;
}

// Scratch of run_pairs, kept by the calling thread between calls (grown, never shrunk): no allocation
// per call once warm. The team reads it through the caller's pointers.
struct PairScratch {
  std::vector<Acts> acts;          // per expert: activations for gate, up and down
  std::vector<float> g, h;         // gate's outputs, then silu(gate) * up: [X, T, I]
};

// [lo, hi) of n items for member t of a team of nt: equal contiguous shares.
static inline void share(int64_t n, int t, int nt, int64_t* lo, int64_t* hi) {
  *lo = n * t / nt;
  *hi = n * (t + 1) / nt;
}

// y [T, H] (zeroed by the caller) += sum over S's pairs of w * down(silu(gate(x)) * up(x)).
// Shapes checked by the caller (bad_shapes); no torch, no Python, no exception: it also runs on the
// CUDA driver's host-function thread (moedesk_cpu_experts_host).
// cut > 0: only the first `cut` intermediate features of every expert (gate/up columns, down rows; a
// multiple of down's groups in the store), the rest being computed elsewhere (the GPU).
// Work is split by columns, statically: member t of the team takes the same contiguous share of the
// tiles of every projection (all tiles of a projection are the same size, so the shares are equal in
// bytes) and reads each expert's share as one sequential stream. Three barriers: after x's quantization,
// after gate/up (down's input needs whole rows), after down's input's quantization. Each member owns its
// columns of y and adds the experts into them in the order of S.used, as the sum always was.
static void run_pairs(const Layer& L, const float* xd, int T, int64_t H, const Pairs& S, float* y, int threads,
                      int64_t cut = 0) {
  const int64_t X = (int64_t)S.used.size();
  if (X == 0) return;
  const auto& used = S.used;
  const auto& rows = S.rows;
  const auto& rws = S.rws;
  const int isa = qdot::active();
  const int64_t I = cut > 0 ? std::min(cut, L.proj(used[0], 0).N) : L.proj(used[0], 0).N;
  // down limited to its first I rows: whole groups (the store cuts its groups at every possible cut)
  auto down = [&](int64_t e) {
    qdot::Codes d = L.proj(e, 2);
    if (I < d.K) {
      int64_t g = 0;
      while (g < d.G && d.grp[g * 4 + 2] < I) ++g;
      d.K = I;
      d.Gu = g;
    }
    return d;
  };
  static thread_local PairScratch scratch;
  if ((int64_t)scratch.acts.size() < X * 3) scratch.acts.resize(X * 3);
  if ((int64_t)scratch.g.size() < X * T * I) { scratch.g.resize(X * T * I); scratch.h.resize(X * T * I); }
  Acts* acts = scratch.acts.data();
  float* gbuf = scratch.g.data();
  float* hbuf = scratch.h.data();
  const int64_t tiles_i = (I + TILE - 1) / TILE, tiles_h = (H + TILE - 1) / TILE;

#pragma omp parallel num_threads(std::max(1, threads))
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    float res[MAX_T][TILE];
    int64_t ident[MAX_T];
    for (int r = 0; r < MAX_T; ++r) ident[r] = r;
    int64_t lo, hi;
    // 1. x quantized for each gate/up (each has its own input order).
    share(X * 2, t, nt, &lo, &hi);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t j = i / 2; const int p = (int)(i % 2);
      acts[j * 3 + p].fill(L.proj(used[j], p), xd, false, H, rows[j].data(), (int)rows[j].size());
    }
#pragma omp barrier
    // 2. gate then up over this member's tiles of each expert; h = silu(gate) * up on those columns.
    share(tiles_i, t, nt, &lo, &hi);
    for (int64_t j = 0; j < X; ++j) {
      const int R = (int)rows[j].size();
      float* g = gbuf + j * T * I;
      float* h = hbuf + j * T * I;
      const qdot::Codes cg = L.proj(used[j], 0), cu = L.proj(used[j], 1);
      for (int64_t tile = lo; tile < hi; ++tile) {
        acts[j * 3].tile(isa, cg, tile, R, res);
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < TILE && tile * TILE + c < I; ++c) g[r * I + tile * TILE + c] = res[r][c];
      }
      for (int64_t tile = lo; tile < hi; ++tile) {
        acts[j * 3 + 1].tile(isa, cu, tile, R, res);
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < TILE && tile * TILE + c < I; ++c) {
            const int64_t k = r * I + tile * TILE + c;
            h[k] = silu(g[k]) * res[r][c];
          }
      }
    }
#pragma omp barrier
    // 3. h quantized for down, expert by expert.
    share(X, t, nt, &lo, &hi);
    for (int64_t j = lo; j < hi; ++j)
      acts[j * 3 + 2].fill(down(used[j]), hbuf + j * T * I, false, I, ident, (int)rows[j].size());
#pragma omp barrier
    // 4. down over this member's tiles of H, expert after expert, added into y with the routing weights.
    share(tiles_h, t, nt, &lo, &hi);
    for (int64_t j = 0; j < X; ++j) {
      const int R = (int)rows[j].size();
      const qdot::Codes cd = down(used[j]);
      for (int64_t tile = lo; tile < hi; ++tile) {
        acts[j * 3 + 2].tile(isa, cd, tile, R, res);
        for (int r = 0; r < R; ++r) {
          float* dst = y + rows[j][r] * H + tile * TILE;
          const float wgt = rws[j][r];
          for (int c = 0; c < TILE && tile * TILE + c < H; ++c) dst[c] += wgt * res[r][c];
        }
      }
    }
  }
}

// The projections of a dense layer (P of them, one input, outputs side by side) for R <= qdot::MAX_T rows of
// x (float32 [R, ldx]): y [R, sum N] (row stride ldy), float32 or bfloat16, written or (add) added to.
static void run_dense(const Layer& L, int P, const float* x, int64_t ldx, int R, void* y, int64_t ldy, bool bf16,
                      bool add, int threads) {
  const int isa = qdot::active();
  std::vector<Acts> acts(P);
  std::vector<int64_t> first(P + 1, 0), col(P + 1, 0), ident(R);
  for (int r = 0; r < R; ++r) ident[r] = r;
  for (int p = 0; p < P; ++p) {
    const qdot::Codes c = L.proj(0, p, P);
    first[p + 1] = first[p] + (c.N + TILE - 1) / TILE;
    col[p + 1] = col[p] + c.N;
  }
#pragma omp parallel num_threads(std::max(1, threads))
  {
#pragma omp for schedule(dynamic, 1)
    for (int p = 0; p < P; ++p) acts[p].fill(L.proj(0, p, P), x, false, ldx, ident.data(), R);
    float res[qdot::MAX_T][TILE];
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < first[P]; ++i) {
      int p = 0;
      while (i >= first[p + 1]) ++p;
      const qdot::Codes c = L.proj(0, p, P);
      const int64_t tile = i - first[p];
      acts[p].tile(isa, c, tile, R, res);
      const int n = (int)std::min<int64_t>(TILE, c.N - tile * TILE);
      const int64_t c0 = col[p] + tile * TILE;
      for (int r = 0; r < R; ++r) {
        if (bf16) {
          at::BFloat16* d = (at::BFloat16*)y + r * ldy + c0;
          for (int j = 0; j < n; ++j) d[j] = at::BFloat16(add ? (float)d[j] + res[r][j] : res[r][j]);
        } else {
          float* d = (float*)y + r * ldy + c0;
          for (int j = 0; j < n; ++j) d[j] = add ? d[j] + res[r][j] : res[r][j];
        }
      }
    }
  }
}

// Rows of x (float32 or bfloat16 [R, W], row stride W) -> float32 [R, K], the projections' input: x itself
// (W = K), RMS-normalised and scaled by norm [K] (float32; eps), or silu(x[:, :K]) * x[:, K:] (W = 2K).
static void dense_input(const void* x, bool bf16, int64_t W, int R, int64_t K, const float* norm, double eps,
                        bool silu_mul, float* out) {
  for (int r = 0; r < R; ++r) {
    float* o = out + r * K;
    for (int64_t k = 0; k < W && k < (silu_mul ? 2 * K : K); ++k) {
      const float v = bf16 ? (float)((const at::BFloat16*)x)[r * W + k] : ((const float*)x)[r * W + k];
      if (silu_mul && k >= K) o[k - K] *= v;
      else o[k] = silu_mul ? silu(v) : v;
    }
    if (norm) {
      double ss = 0;
      for (int64_t k = 0; k < K; ++k) ss += (double)o[k] * o[k];
      const float inv = (float)(1.0 / std::sqrt(ss / K + eps));
      for (int64_t k = 0; k < K; ++k) o[k] = o[k] * inv * norm[k];
    }
  }
}

}  // namespace

// x float32 [T, H], ids int64 [T, A] (indices into the store's experts), weights float32 [T, A]
// -> float32 [T, H] = sum_a weights[t, a] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, a].
torch::Tensor experts_forward(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor qw,
                              torch::Tensor sc, torch::Tensor grp, torch::Tensor perm, torch::Tensor desc) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: float32 [T, H] contiguous");
  const int T = (int)x.size(0);
  const int64_t H = x.size(1);
  TORCH_CHECK(T >= 1 && T <= MAX_T, "x: T must be 1..", MAX_T, ", got ", T);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == torch::kInt64, "ids: int64 [T, A]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat32, "weights: float32 [T, A]");
  const int64_t A = ids.size(1), E = desc.size(0);
  Layer L{(const uint32_t*)qw.data_ptr<int32_t>(), sc.data_ptr<at::Half>(), grp.data_ptr<int32_t>(),
          perm.data_ptr<int32_t>(), desc.data_ptr<int64_t>()};
  auto idc = ids.contiguous();
  auto wc = weights.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  const float* rw = wc.data_ptr<float>();
  Pairs S;
  for (int t = 0; t < T; ++t)
    for (int64_t a = 0; a < A; ++a) {
      int64_t e = id[t * A + a];
      TORCH_CHECK(e >= 0 && e < E, "ids[", t, ", ", a, "] = ", e, " is outside the store's ", E, " experts");
      S.add(t, e, rw[t * A + a]);
    }
  auto out = torch::zeros({T, H}, x.options());
  if (S.used.empty()) return out;
  const int64_t bad = bad_shapes(L, S, H);
  TORCH_CHECK(bad < 0, "expert ", bad < 0 ? 0 : S.used[bad], ": shapes do not chain with x [", T, ", ", H, "]");
  // Built with -fopenmp; torch ships libgomp.so.1, which the dynamic linker shares with this module.
  // The team size is torch's thread count of the calling thread (torch.set_num_threads).
  run_pairs(L, x.data_ptr<float>(), T, H, S, out.data_ptr<float>(), at::get_num_threads());
  return out;
}

// x [T, K] float32 or bfloat16 (any T: blocks of qdot::MAX_T rows) -> [T, sum N] of the same dtype: the P
// projections of desc [P, 8] (one input K, outputs side by side), a dense layer of the CPU engine. A
// projection's packed rows may exceed K by padding to a multiple of 32 (zero weights whose perm reads input 0).
// The input may first be RMS-normalised (norm: weight [K] float32, eps) or be silu(gate) * up (act
// "silu_mul": x [T, 2K], gate then up); with `residual` [T, sum N] (x's dtype) the result is added to it in
// place and it is returned. Both save the engine a torch operation (and its allocation) per use.
torch::Tensor linear_forward(torch::Tensor x, torch::Tensor qw, torch::Tensor sc, torch::Tensor grp,
                             torch::Tensor perm, torch::Tensor desc, c10::optional<torch::Tensor> norm, double eps,
                             const std::string& act, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == torch::kFloat32 ||
              x.scalar_type() == torch::kBFloat16), "x: float32 or bfloat16 [T, K] contiguous");
  TORCH_CHECK(desc.dim() == 2 && desc.size(1) == 8 && desc.size(0) >= 1 && desc.scalar_type() == torch::kInt64,
              "desc: int64 [P, 8]");
  TORCH_CHECK(act == "none" || act == "silu_mul", "act: none or silu_mul, got '", act, "'");
  const bool silu_mul = act == "silu_mul";
  const int64_t K = silu_mul ? x.size(1) / 2 : x.size(1);
  TORCH_CHECK(!silu_mul || x.size(1) % 2 == 0, "act silu_mul: x has an odd width ", x.size(1));
  const int P = (int)desc.size(0);
  Layer L{(const uint32_t*)qw.data_ptr<int32_t>(), sc.data_ptr<at::Half>(), grp.data_ptr<int32_t>(),
          perm.data_ptr<int32_t>(), desc.data_ptr<int64_t>()};
  int64_t N = 0;
  for (int p = 0; p < P; ++p) {
    const qdot::Codes c = L.proj(0, p, P);
    TORCH_CHECK(c.K >= K && c.K < K + qdot::CHUNK, "projection ", p, " takes ", c.K, " packed rows, its input has ",
                K);      // rows past the inputs: zero weights
    N += c.N;
  }
  const float* nw = nullptr;
  if (norm) {
    TORCH_CHECK(norm->dim() == 1 && norm->size(0) == K && norm->scalar_type() == torch::kFloat32 && norm->is_contiguous(),
                "norm: float32 [", K, "]");
    nw = norm->data_ptr<float>();
  }
  const int64_t T = x.size(0);
  torch::Tensor y;
  if (residual) {
    TORCH_CHECK(residual->sizes() == torch::IntArrayRef({T, N}) && residual->scalar_type() == x.scalar_type() &&
                residual->is_contiguous(), "residual: contiguous [", T, ", ", N, "] of x's dtype");
    y = *residual;
  } else {
    y = torch::empty({T, N}, x.options());
  }
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const int64_t es = x.element_size();
  std::vector<float> xin((size_t)std::min<int64_t>(qdot::MAX_T, T) * K);
  for (int64_t t = 0; t < T; t += qdot::MAX_T) {
    const int R = (int)std::min<int64_t>(qdot::MAX_T, T - t);
    dense_input((const char*)x.data_ptr() + t * x.size(1) * es, bf16, x.size(1), R, K, nw, eps, silu_mul, xin.data());
    run_dense(L, P, xin.data(), K, R, (char*)y.data_ptr() + t * N * es, N, bf16, residual.has_value(),
              at::get_num_threads());
  }
  return y;
}

// q [T, NH, D] bfloat16 (contiguous), k and v one layer's cache [KVH, S, D] bfloat16 (contiguous), the
// new rows at positions start .. start + T - 1 already in it -> [T, NH * D] bfloat16: attention of a few
// rows (attention.cpp), causal, window > 0 a sliding window.
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kBFloat16 && q.is_contiguous(), "q: contiguous bfloat16 [T, NH, D]");
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == torch::kBFloat16 && k.is_contiguous() && v.sizes() == k.sizes() &&
              v.scalar_type() == torch::kBFloat16 && v.is_contiguous(), "k, v: contiguous bfloat16 [KVH, S, D]");
  const int64_t T = q.size(0), NH = q.size(1), D = q.size(2), KVH = k.size(0), S = k.size(1);
  TORCH_CHECK(D >= 1 && D <= 256, "head size ", D, ": 1 to 256");
  TORCH_CHECK(k.size(2) == D && KVH > 0 && NH % KVH == 0, "q [", T, ", ", NH, ", ", D, "] and k [", KVH, ", ", S,
              ", ", k.size(2), "]: heads or head size disagree");
  TORCH_CHECK(start >= 0 && start + T <= S && T >= 1, "rows at ", start, "..", start + T - 1, " outside the cache's ", S);
  auto out = torch::empty({T, NH * D}, q.options());
  attn::decode((const uint16_t*)q.data_ptr(), T, NH, KVH, D, (const uint16_t*)k.data_ptr(), (const uint16_t*)v.data_ptr(),
               S, start, window, (uint16_t*)out.data_ptr(), at::get_num_threads());
  return out;
}

// The attention of a decoder layer for a few new rows from its q/k/v projection qkv [T, (NH + 2 KVH) * D]
// bfloat16: q and k heads normalised (qk_norm [NH + KVH, D] float32, or none) and rotated (cos, sin [T, D]
// bfloat16, the rows' positions), k and v written into one layer's cache k, v [KVH, S, D] at start..,
// then `attend`'s -> [T, NH * D] bfloat16.
torch::Tensor attend_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v,
                         int64_t start, int64_t window, c10::optional<torch::Tensor> qk_norm, double eps) {
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == torch::kBFloat16 && k.is_contiguous() && v.sizes() == k.sizes() &&
              v.scalar_type() == torch::kBFloat16 && v.is_contiguous(), "k, v: contiguous bfloat16 [KVH, S, D]");
  const int64_t KVH = k.size(0), S = k.size(1), D = k.size(2), T = qkv.size(0);
  TORCH_CHECK(D >= 2 && D <= 256 && D % 2 == 0, "head size ", D, ": even, 2 to 256");
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kBFloat16 && qkv.is_contiguous() &&
              qkv.size(1) % D == 0 && qkv.size(1) / D > 2 * KVH, "qkv: contiguous bfloat16 [T, (NH + 2 KVH) * ", D, "]");
  const int64_t NH = qkv.size(1) / D - 2 * KVH;
  TORCH_CHECK(NH % KVH == 0, NH, " query heads do not share ", KVH, " kv heads evenly");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == D && t->scalar_type() == torch::kBFloat16 &&
                t->is_contiguous(), "cos, sin: contiguous bfloat16 [", T, ", ", D, "]");
  TORCH_CHECK(start >= 0 && start + T <= S && T >= 1, "rows at ", start, "..", start + T - 1, " outside the cache's ", S);
  const float* qn = nullptr;
  if (qk_norm) {
    TORCH_CHECK(qk_norm->dim() == 2 && qk_norm->size(0) == NH + KVH && qk_norm->size(1) == D &&
                qk_norm->scalar_type() == torch::kFloat32 && qk_norm->is_contiguous(), "qk_norm: float32 [", NH + KVH,
                ", ", D, "]");
    qn = qk_norm->data_ptr<float>();
  }
  auto out = torch::empty({T, NH * D}, qkv.options());
  attn::decode_qkv((const uint16_t*)qkv.data_ptr(), T, NH, KVH, D, (const uint16_t*)cos.data_ptr(),
                   (const uint16_t*)sin.data_ptr(), qn, (float)eps, (uint16_t*)k.data_ptr(), (uint16_t*)v.data_ptr(), S,
                   start, window, (uint16_t*)out.data_ptr(), at::get_num_threads());
  return out;
}

// The cold-expert CPU path of one decode step, as a CUDA host function (runtime/cpu/path.py
// enqueues it with cuLaunchHostFunc, inside the step's CUDA graph). Every pointer is host memory the
// caller keeps at a fixed address for the life of the layer; x, ids, weights and owned were copied from
// the device just before, y is copied back just after. Mirrored by cpu_path.HostCtx (ctypes): keep
// the field order and types identical.
extern "C" {
struct MoedeskCpuCtx {
  const void* x;               // [T, H] float16 (x_fp16 = 1) or float32
  const void* ids;             // [T, A] int32 (ids_int64 = 0) or int64: the layer's expert ids
  const float* weights;        // [T, A] routing weights
  const uint8_t* owned;        // [E] nonzero: this expert is computed here (the GPU skips it)
  const int32_t* store_index;  // [E] the expert's index in the store, -1 when not in it
  const uint32_t* qw;          // the store (runtime/cpu/experts.CpuExperts, format exl2)
  const uint16_t* sc;
  const int32_t* grp;
  const int32_t* perm;
  const int64_t* desc;         // [store_experts, 3, 8]
  float* y;                    // [T, H] output (zeros when no pair is owned)
  int64_t H;
  int64_t E;
  int64_t store_experts;
  int32_t T;
  int32_t A;
  int32_t x_fp16;
  int32_t ids_int64;
  int32_t threads;
  int32_t status;              // 0 ok; 1 an owned expert is not in the store or out of range; 2 shapes
  int32_t cut;                 // > 0: the first `cut` intermediate features of each owned expert only
  int32_t pad;
  uint64_t ns_total;           // wall time of every call so far
  uint64_t calls;
  uint64_t pairs;              // (row, expert) pairs computed so far
  uint64_t submitted;          // calls handed to the worker (moedesk_cpu_submit) ...
  uint64_t done;               // ... and finished by it (moedesk_cpu_wait waits for done == submitted)
  uint64_t t_submit;           // steady-clock ns of the last submit
  uint64_t ns_wake;            // sums over calls: submit -> the worker starts the context,
  uint64_t ns_gpu;             // submit -> wait is called (the GPU's kernels in between, host-node latency),
  uint64_t ns_stall;           // wait called -> returns (the stream held for the CPU)
  uint64_t cpu_first;          // doorbell only: contexts the CPU finished before the stream reached its
  uint64_t gpu_first;          // wait (the GPU's kernels took longer), and after it (the CPU took longer)
  uint64_t ns_cpu_idle;        // the worker waiting for the stream to reach the wait, when the CPU was first
};

void moedesk_cpu_experts_host(void* p) {
  auto* c = static_cast<MoedeskCpuCtx*>(p);
  const auto t0 = std::chrono::steady_clock::now();
  const int T = c->T;
  const int64_t H = c->H, A = c->A;
  std::fill(c->y, c->y + (int64_t)T * H, 0.f);
  Pairs S;
  bool ok = T >= 1 && T <= MAX_T;
  for (int t = 0; ok && t < T; ++t)
    for (int64_t a = 0; a < A; ++a) {
      const int64_t i = t * A + a;
      const int64_t e = c->ids_int64 ? ((const int64_t*)c->ids)[i] : ((const int32_t*)c->ids)[i];
      if (e < 0 || e >= c->E || !c->owned[e]) continue;
      const int64_t s = c->store_index[e];
      if (s < 0 || s >= c->store_experts) { c->status = 1; ok = false; break; }
      S.add(t, s, c->weights[i]);
    }
  if (ok && !S.used.empty()) {
    Layer L{c->qw, (const at::Half*)c->sc, c->grp, c->perm, c->desc};
    if (bad_shapes(L, S, H) >= 0) {
      c->status = 2;
    } else {
      std::vector<float> xf((size_t)T * H);
      if (c->x_fp16) {
        const at::Half* xh = (const at::Half*)c->x;
        for (int64_t k = 0; k < (int64_t)T * H; ++k) xf[k] = (float)xh[k];
      } else {
        std::copy((const float*)c->x, (const float*)c->x + (int64_t)T * H, xf.begin());
      }
      run_pairs(L, xf.data(), T, H, S, c->y, c->threads, c->cut);
      for (const auto& r : S.rows) c->pairs += r.size();
    }
  }
  c->ns_total += (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now() - t0).count();
  c->calls += 1;
}

void moedesk_cpu_submit(void* p);
void moedesk_cpu_wait(void* p);
}

// Two ways a decode step hands a layer to the worker (runtime/cpu/path.py picks one):
// - Stream memory operations (the default where the driver takes them): after its copies into pinned
//   memory, the step's stream writes the context's slot + 1 into the doorbell (cuStreamWriteValue32,
//   whose memory barrier orders the copies before it), runs the GPU's kernels for the other cold
//   experts, then waits until `done` reads 1 (cuStreamWaitValue32, polled by the GPU) and writes 0
//   back. The worker polls the doorbell. Nothing in the step calls back into the host.
// - Host nodes: moedesk_cpu_submit hands the context to the worker and returns at once, the GPU's
//   kernels run, moedesk_cpu_wait holds the stream until the worker is done (the pattern of
//   KTransformers' CPUInfer). Each host node costs the stream a round trip through the driver's
//   callback thread (~45 us measured on the H200 machine, four per layer), hence the doorbell.
// The worker is one persistent thread (the master of its OpenMP team); contexts run one at a time in
// order. It spins while work keeps coming (layers follow each other within a millisecond); after
// 20 ms without any it polls the doorbell once a millisecond until kicked (`kick`, at the start of a
// forward) or fed a context.
namespace {
inline uint64_t steady_ns() {
  return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr uint32_t MAX_SLOTS = 4096;
std::atomic<MoedeskCpuCtx*> g_slots[MAX_SLOTS];      // doorbell value v -> context of slot v - 1
std::atomic<uint32_t*> g_bell{nullptr};               // written by the stream, cleared by the worker
std::atomic<uint32_t*> g_done{nullptr};               // written 1 by the worker, 0 by the stream
std::atomic<uint32_t*> g_arrive{nullptr};             // the stream writes the context's value on reaching
                                                      // its wait; the worker reads and clears it

struct Worker {
  std::mutex m;
  std::condition_variable cv;
  std::deque<MoedeskCpuCtx*> q;
  std::atomic<int64_t> pending{0};
  bool kicked = false;
};

inline void cpu_pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// The next context: from the host nodes' queue, or rung at the doorbell (*rung = true; may be null if
// the slot was released while a captured step still rang it: answered all the same).
// Which side of a rung context finished first: the stream writes the context's doorbell value into
// `arrive` just before its wait. Seen already: the GPU waited for the CPU. Not yet: the worker waits
// for it (it has nothing else to do: the next doorbell comes after that wait), at most 5 ms or until
// the doorbell rings again, and counts the time as CPU idle. The balance the CPU path's cut is tuned by.
void balance(MoedeskCpuCtx* c, uint32_t value) {
  uint32_t* a = g_arrive.load(std::memory_order_acquire);
  if (!a) return;
  if (__atomic_load_n(a, __ATOMIC_ACQUIRE) == value) {
    c->gpu_first += 1;
  } else {
    const uint64_t t0 = steady_ns();
    uint32_t* b = g_bell.load(std::memory_order_acquire);
    while (__atomic_load_n(a, __ATOMIC_ACQUIRE) != value && !(b && __atomic_load_n(b, __ATOMIC_ACQUIRE)) &&
           steady_ns() - t0 < 5000000ull)
      cpu_pause();
    c->cpu_first += 1;
    c->ns_cpu_idle += steady_ns() - t0;
  }
  __atomic_store_n(a, 0u, __ATOMIC_RELAXED);
}

MoedeskCpuCtx* next_context(Worker* nw, bool* rung, uint32_t* value) {
  auto idle = std::chrono::steady_clock::now();
  for (;;) {
    if (nw->pending.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lk(nw->m);
      if (!nw->q.empty()) {
        MoedeskCpuCtx* c = nw->q.front();
        nw->q.pop_front();
        *rung = false;
        return c;
      }
    }
    if (uint32_t* b = g_bell.load(std::memory_order_acquire)) {
      const uint32_t v = __atomic_load_n(b, __ATOMIC_ACQUIRE);
      if (v) {
        __atomic_store_n(b, 0u, __ATOMIC_RELAXED);       // the stream rings again only after `done`
        *rung = true;
        *value = v;
        return v <= MAX_SLOTS ? g_slots[v - 1].load(std::memory_order_acquire) : nullptr;
      }
    }
    if (std::chrono::steady_clock::now() - idle < std::chrono::milliseconds(20)) {
      cpu_pause();
    } else {
      std::unique_lock<std::mutex> lk(nw->m);
      nw->cv.wait_for(lk, std::chrono::milliseconds(1));
      if (nw->kicked || !nw->q.empty()) {
        nw->kicked = false;
        idle = std::chrono::steady_clock::now();
      }
    }
  }
}

Worker* worker() {
  static Worker* w = [] {
    auto* nw = new Worker();                       // never destroyed: the thread outlives static destructors
    std::thread([nw] {
      for (;;) {
        bool rung = false;
        uint32_t value = 0;
        MoedeskCpuCtx* c = next_context(nw, &rung, &value);
        if (rung) {
          if (c) {
            c->t_submit = steady_ns();
            c->submitted += 1;
            moedesk_cpu_experts_host(c);
            c->done = c->submitted;
          }
          __atomic_store_n(g_done.load(std::memory_order_acquire), 1u, __ATOMIC_RELEASE);
          if (c) balance(c, value);
          continue;
        }
        const uint64_t seq = __atomic_load_n(&c->submitted, __ATOMIC_ACQUIRE);
        c->ns_wake += steady_ns() - c->t_submit;
        moedesk_cpu_experts_host(c);
        nw->pending.fetch_sub(1, std::memory_order_acq_rel);
        __atomic_store_n(&c->done, seq, __ATOMIC_RELEASE);
      }
    }).detach();
    return nw;
  }();
  return w;
}
}  // namespace

extern "C" {
void moedesk_cpu_submit(void* p) {
  auto* c = static_cast<MoedeskCpuCtx*>(p);
  Worker* w = worker();
  c->t_submit = steady_ns();
  __atomic_store_n(&c->submitted, c->submitted + 1, __ATOMIC_RELEASE);
  w->pending.fetch_add(1, std::memory_order_acq_rel);    // before the push: pending >= queued
  {
    std::lock_guard<std::mutex> lk(w->m);
    w->q.push_back(c);
  }
  w->cv.notify_one();
}

void moedesk_cpu_wait(void* p) {
  auto* c = static_cast<MoedeskCpuCtx*>(p);
  const uint64_t want = __atomic_load_n(&c->submitted, __ATOMIC_ACQUIRE);
  const uint64_t t0 = steady_ns();
  c->ns_gpu += t0 - c->t_submit;
  for (uint32_t spins = 1; __atomic_load_n(&c->done, __ATOMIC_ACQUIRE) < want; ++spins) {
    cpu_pause();
    if (spins % 64 == 0) std::this_thread::yield();   // give the core up if the team needs it
  }
  c->ns_stall += steady_ns() - t0;
}
}

namespace {
// The doorbell's words (page-locked host memory the stream writes and polls), once per process;
// (0, 0, 0): none; arrive 0: no balance counts. The worker may still read the old words once after this returns: keep them allocated.
void set_doorbell(int64_t bell, int64_t done, int64_t arrive) {
  TORCH_CHECK((bell == 0) == (done == 0) && bell % 4 == 0 && done % 4 == 0 && arrive % 4 == 0,
              "doorbell: aligned 32-bit words, or (0, 0, 0)");
  worker();
  g_arrive.store((uint32_t*)(uintptr_t)arrive, std::memory_order_release);
  g_done.store((uint32_t*)(uintptr_t)done, std::memory_order_release);
  g_bell.store((uint32_t*)(uintptr_t)bell, std::memory_order_release);
}

// A context's doorbell value (its slot + 1); released with release_slot when its layer goes.
int64_t register_slot(int64_t ctx) {
  TORCH_CHECK(ctx, "register_slot: null context");
  for (uint32_t i = 0; i < MAX_SLOTS; ++i) {
    MoedeskCpuCtx* expected = nullptr;
    if (g_slots[i].compare_exchange_strong(expected, (MoedeskCpuCtx*)(uintptr_t)ctx)) return (int64_t)i + 1;
  }
  TORCH_CHECK(false, "register_slot: all ", MAX_SLOTS, " doorbell slots are taken");
  return 0;
}

void release_slot(int64_t value) {
  TORCH_CHECK(value >= 1 && value <= (int64_t)MAX_SLOTS, "release_slot: ", value, " is not a doorbell value");
  g_slots[value - 1].store(nullptr, std::memory_order_release);
}

// A forward is starting: the worker spins again (it polls once a millisecond after 20 ms idle).
void kick() {
  Worker* w = worker();
  {
    std::lock_guard<std::mutex> lk(w->m);
    w->kicked = true;
  }
  w->cv.notify_one();
}
}  // namespace

// One expert projection's codes as the GPU kernels keep them (runtime/experts/pack.py: int32 [Qp, N];
// bits 4 and 8 a little-endian stream of codes per column, bits 3 two planes: K/16 words of low 2-bit
// pairs then K/32 of high bits) -> this kernel's qw layout, int32 [N/16, Q, 16] with Q = K * bits / 32,
// each column a stream of `bits`-bit codes (one group width). Lossless; at load, for the CPU path.
// The work goes tile by tile, so every tile's Q * 64 bytes are written in order; pack_tiles_into
// hands out (expert, tile) items of a whole layer to torch's thread pool.
namespace {

// Masks for moving fields of `width` bits from position width * i to 3 * i, one bit of i per step
// (step s moves the fields whose i has bit 3 - s by (3 - width) << (3 - s)); fields only move up and
// keep a gap of at least `width` bits, so no step overlaps another field.
struct Spread {
  uint64_t mask[4];
  int shift[4];
  constexpr Spread(int width) : mask{}, shift{} {
    for (int s = 0; s < 4; ++s) {
      const int b = 3 - s;
      shift[s] = (3 - width) << b;
      for (int i = 0; i < 16; ++i) {
        if (!((i >> b) & 1)) continue;
        int pos = width * i;                              // where field i is before step s
        for (int d = 3; d > b; --d) pos += ((i >> d) & 1) * ((3 - width) << d);
        for (int k = 0; k < width; ++k) mask[s] |= 1ull << (pos + k);
      }
    }
  }
};
constexpr Spread LO2(2), HI1(1);

template <const Spread& S>
static inline uint64_t spread(uint64_t x) {
#pragma GCC unroll 4
  for (int s = 0; s < 4; ++s) x = (x & ~S.mask[s]) | ((x & S.mask[s]) << S.shift[s]);
  return x;
}

// 32 3-bit codes of one column from the GPU's planes (lo0: low bits of codes 0..15, lo1: of 16..31,
// hi: high bits of all 32) -> r[0..2], a little-endian stream of 3-bit codes.
static inline void pack3(uint32_t lo0, uint32_t lo1, uint32_t hi, uint32_t* r0, uint32_t* r1, uint32_t* r2) {
  const uint64_t a = spread<LO2>(lo0) | (spread<HI1>(hi & 0xFFFFu) << 2);     // codes 0..15, 48 bits
  const uint64_t b = spread<LO2>(lo1) | (spread<HI1>(hi >> 16) << 2);         // codes 16..31
  *r0 = (uint32_t)a;
  *r1 = (uint32_t)(a >> 32) | (uint32_t)(b << 16);
  *r2 = (uint32_t)(b >> 16);
}

// The same, one code at a time: the reference the tests hold pack3 to.
static inline void pack3_plain(uint32_t lo0, uint32_t lo1, uint32_t hi, uint32_t* r0, uint32_t* r1, uint32_t* r2) {
  uint32_t r[3] = {0, 0, 0};
  for (int i = 0; i < 32; ++i) {
    const uint32_t lo = ((i < 16 ? lo0 : lo1) >> (2 * (i & 15))) & 3u;
    const uint32_t u = lo | (((hi >> i) & 1u) << 2);
    const int bit = 3 * i, wi = bit >> 5, sh = bit & 31;
    r[wi] |= u << sh;
    if (sh + 3 > 32) r[wi + 1] |= u >> (32 - sh);
  }
  *r0 = r[0]; *r1 = r[1]; *r2 = r[2];
}

// Tile `tile` of one projection: words w [Qp, N] -> o [Q, 16] (the tile's place in the output).
template <bool PLAIN>
static void pack_tile(const uint32_t* w, int64_t bits, int64_t K, int64_t N, int64_t tile, uint32_t* o) {
  const int64_t n0 = tile * TILE;
  if (bits != 3) {
    for (int64_t q = 0; q < K * bits / 32; ++q) std::memcpy(o + q * TILE, w + q * N + n0, TILE * sizeof(uint32_t));
    return;
  }
  for (int64_t c = 0; c < K / 32; ++c) {
    const uint32_t* lo0 = w + (2 * c) * N + n0;
    const uint32_t* lo1 = lo0 + N;
    const uint32_t* hi = w + (K / 16 + c) * N + n0;
    uint32_t* r = o + 3 * c * TILE;
    for (int j = 0; j < TILE; ++j) {
      if constexpr (PLAIN) pack3_plain(lo0[j], lo1[j], hi[j], r + j, r + TILE + j, r + 2 * TILE + j);
      else pack3(lo0[j], lo1[j], hi[j], r + j, r + TILE + j, r + 2 * TILE + j);
    }
  }
}

static void check_words(const torch::Tensor& words, int64_t bits, int64_t K, int64_t N, int64_t j) {
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == torch::kInt32 && words.device().is_cpu(),
              "words[", j, "]: int32 [Qp, N] on the CPU");
  TORCH_CHECK(words.size(1) == N, "words[", j, "]: ", words.size(1), " columns, words[0] has ", N);
  TORCH_CHECK(words.size(0) == K * bits / 32, "words[", j, "]: ", words.size(0), " rows for K ", K, " at ",
              bits, " bits (want ", K * bits / 32, ")");
}

}  // namespace

// words: S projections, each int32 [Qp, N] (CPU) -> out int32 [S, Q * N] (rows may be strided, e.g.
// a column slice of a layer's flat buffer): row j holds words[j] as tiles [N/16, Q, 16].
void pack_tiles_into(std::vector<torch::Tensor> words, int64_t bits, int64_t K, torch::Tensor out, bool plain) {
  TORCH_CHECK(bits == 3 || bits == 4 || bits == 8, "bits: 3, 4 or 8, got ", bits);
  TORCH_CHECK(!words.empty(), "words: no projections");
  TORCH_CHECK(words[0].dim() == 2, "words[0]: int32 [Qp, N], got ", words[0].dim(), " dimensions");
  const int64_t S = (int64_t)words.size(), N = words[0].size(1), Q = K * bits / 32;
  TORCH_CHECK(K > 0 && K % 32 == 0 && N > 0 && N % TILE == 0, "K ", K, " must be a multiple of 32 and N ", N,
              " of ", TILE);
  std::vector<torch::Tensor> wc(S);
  std::vector<const uint32_t*> src(S);
  for (int64_t j = 0; j < S; ++j) {
    check_words(words[j], bits, K, N, j);
    wc[j] = words[j].contiguous();
    src[j] = (const uint32_t*)wc[j].data_ptr<int32_t>();
  }
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kInt32 && out.device().is_cpu() && out.size(0) == S &&
              out.size(1) == Q * N && out.stride(1) == 1,
              "out: int32 [", S, ", ", Q * N, "] on the CPU with unit column stride, got ", out.sizes(), " ",
              out.scalar_type());
  uint32_t* dst = (uint32_t*)out.data_ptr<int32_t>();
  const int64_t ld = out.stride(0), tiles = N / TILE;
  const int32_t whole[4] = {(int32_t)bits, 0, 0, (int32_t)K};       // one group: the layout is per chunk
  at::parallel_for(0, S * tiles, 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t j = i / tiles, t = i % tiles;
      uint32_t* o = dst + j * ld + t * Q * TILE;
      if (plain) pack_tile<true>(src[j], bits, K, N, t, o);
      else pack_tile<false>(src[j], bits, K, N, t, o);
      qdot::to_planes(o, whole, 1);
    }
  });
}

// One projection -> a new int32 [N/16, Q, 16].
torch::Tensor pack_tiles(torch::Tensor words, int64_t bits, int64_t K, bool plain) {
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == torch::kInt32, "words: int32 [Qp, N]");
  TORCH_CHECK(bits == 3 || bits == 4 || bits == 8, "bits: 3, 4 or 8, got ", bits);
  const int64_t N = words.size(1), Q = K * bits / 32;
  TORCH_CHECK(K % 32 == 0 && N % TILE == 0, "K ", K, " must be a multiple of 32 and N ", N, " of ", TILE);
  TORCH_CHECK(words.size(0) == Q, "words: ", words.size(0), " rows for K ", K, " at ", bits, " bits (want ", Q, ")");
  auto out = torch::empty({N / TILE, Q, TILE}, words.options());
  pack_tiles_into({words}, bits, K, out.view({1, Q * N}), plain);
  return out;
}

int64_t host_entry_address() { return (int64_t)(uintptr_t)&moedesk_cpu_experts_host; }
int64_t submit_entry_address() { return (int64_t)(uintptr_t)&moedesk_cpu_submit; }
int64_t wait_entry_address() { return (int64_t)(uintptr_t)&moedesk_cpu_wait; }

int64_t host_ctx_size() { return (int64_t)sizeof(MoedeskCpuCtx); }

namespace {
void check_store(const torch::Tensor& qw, const torch::Tensor& grp) {
  TORCH_CHECK(qw.dim() == 3 && qw.size(2) == TILE && qw.scalar_type() == torch::kInt32 && qw.is_contiguous() &&
              qw.device().is_cpu(), "qw: contiguous int32 [N/16, Q, 16] on the CPU");
  TORCH_CHECK(grp.dim() == 2 && grp.size(1) == 4 && grp.scalar_type() == torch::kInt32 && grp.is_contiguous(),
              "grp: contiguous int32 [G, 4]");
  const int32_t* g = grp.data_ptr<int32_t>();
  int64_t q = 0;
  for (int64_t i = 0; i < grp.size(0); ++i) {
    TORCH_CHECK(qdot::valid_bits(g[i * 4]) && g[i * 4 + 3] > 0 && g[i * 4 + 3] % qdot::CHUNK == 0 && g[i * 4 + 1] == q,
                "grp[", i, "] = (", g[i * 4], ", ", g[i * 4 + 1], ", ", g[i * 4 + 2], ", ", g[i * 4 + 3],
                "): want 2..8 bits (not 7), rows a multiple of 32, packed rows following the group before");
    q += (int64_t)g[i * 4 + 3] * g[i * 4] / 32;
  }
  TORCH_CHECK(q == qw.size(1), "grp: its groups take ", q, " packed rows, qw has ", qw.size(1));
}
}  // namespace

// One projection's tiles [N/16, Q, 16], EXL2 column streams -> the kernel's layout, in place (and back).
void to_planes(torch::Tensor qw, torch::Tensor grp, bool back) {
  check_store(qw, grp);
  uint32_t* w = (uint32_t*)qw.data_ptr<int32_t>();
  const int32_t* g = grp.data_ptr<int32_t>();
  const int64_t tiles = qw.size(0), Q = qw.size(1), G = grp.size(0);
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (back) qdot::from_planes(w + t * Q * TILE, g, G);
      else qdot::to_planes(w + t * Q * TILE, g, G);
    }
  });
}

// NUMA nodes online (Linux sysfs "0-1,3" lists), as a bit mask; 1 (node 0) where it cannot tell.
uint64_t online_nodes() {
  std::ifstream f("/sys/devices/system/node/online");
  std::string text;
  uint64_t mask = 0;
  if (f && std::getline(f, text)) {
    size_t i = 0;
    while (i < text.size()) {
      size_t j = i;
      while (j < text.size() && isdigit((unsigned char)text[j])) ++j;
      if (j == i) break;
      int lo = std::stoi(text.substr(i, j - i)), hi = lo;
      if (j < text.size() && text[j] == '-') {
        size_t k = ++j;
        while (k < text.size() && isdigit((unsigned char)text[k])) ++k;
        hi = k > j ? std::stoi(text.substr(j, k - j)) : lo;
        j = k;
      }
      for (int n = lo; n <= hi && n < 64; ++n) mask |= 1ull << n;
      i = j + (j < text.size() && text[j] == ',');
      if (j < text.size() && text[j] != ',') break;
    }
  }
  return mask ? mask : 1;
}

// A store's pages spread round-robin over every NUMA node online (mbind MPOL_INTERLEAVE; pages already
// touched are moved), so that a team on all sockets reads from every memory controller instead of the
// one where the loading thread ran. -> nodes spread over, 0 where the kernel refused (or not Linux).
int64_t interleave_pages(torch::Tensor t) {
#if defined(__linux__) && defined(SYS_mbind)
  const uint64_t mask = online_nodes();
  const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  const uintptr_t a = ((uintptr_t)t.data_ptr() + page - 1) & ~(page - 1);
  const uintptr_t b = ((uintptr_t)t.data_ptr() + t.nbytes()) & ~(page - 1);
  if (b <= a) return __builtin_popcountll(mask);
  const long MPOL_INTERLEAVE_ = 3, MPOL_MF_MOVE_ = 1 << 1;
  if (syscall(SYS_mbind, (void*)a, (unsigned long)(b - a), MPOL_INTERLEAVE_, &mask, 64UL, MPOL_MF_MOVE_) != 0) return 0;
  return __builtin_popcountll(mask);
#else
  (void)t;
  return 0;
#endif
}

int64_t numa_nodes() { return __builtin_popcountll(online_nodes()); }

// The vector path calls take ("avx512_vnni", "avx2", "scalar"); isa_supported: the best this CPU runs.
std::string isa() { return qdot::isa_name(qdot::active()); }
std::string isa_supported() { return qdot::isa_name(qdot::supported()); }

// Force a path by name ("auto": the best supported); false when this CPU cannot run it.
bool set_isa(const std::string& name) {
  for (int i = qdot::SCALAR; i <= qdot::AVX512_VNNI; ++i)
    if (name == qdot::isa_name(i)) return qdot::force(i);
  TORCH_CHECK(name == "auto", "isa: auto, avx512_vnni, avx2 or scalar, got '", name, "'");
  return qdot::force(-1);
}

double read_gbps(int64_t threads, int64_t bytes, int64_t reps) {
  TORCH_CHECK(threads >= 1 && bytes >= 64 && reps >= 1, "read_gbps: threads >= 1, bytes >= 64, reps >= 1");
  return qdot::read_gbps((int)threads, bytes, (int)reps);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("experts_forward", &experts_forward, "EXL2 experts of one layer on the CPU",
        py::call_guard<py::gil_scoped_release>());
  m.def("host_entry_address", &host_entry_address,
        "address of moedesk_cpu_experts_host (void(*)(void*)), for cuLaunchHostFunc");
  m.def("submit_entry_address", &submit_entry_address,
        "address of moedesk_cpu_submit (void(*)(void*)): hand a context to the worker thread");
  m.def("wait_entry_address", &wait_entry_address,
        "address of moedesk_cpu_wait (void(*)(void*)): return when the worker has finished the context");
  m.def("pack_tiles", &pack_tiles, "GPU-layout codes of one expert projection -> the CPU kernel's tiles",
        py::arg("words"), py::arg("bits"), py::arg("K"), py::arg("plain") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_tiles_into", &pack_tiles_into, "pack_tiles of several projections into rows of one buffer",
        py::arg("words"), py::arg("bits"), py::arg("K"), py::arg("out"), py::arg("plain") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("set_doorbell", &set_doorbell, "addresses of the doorbell's words (bell, done, arrive; 0: none), page-locked",
        py::arg("bell"), py::arg("done"), py::arg("arrive") = 0);
  m.def("register_slot", &register_slot, "a context's doorbell value (slot + 1)", py::arg("ctx"));
  m.def("release_slot", &release_slot, "free a doorbell value", py::arg("value"));
  m.def("kick", &kick, "wake the worker into spinning (a forward is starting)");
  m.def("host_ctx_size", &host_ctx_size, "sizeof(MoedeskCpuCtx), to check its ctypes mirror");
  m.def("isa", &isa, "the vector path the kernels take: avx512_vnni, avx2 or scalar");
  m.def("isa_supported", &isa_supported, "the best vector path this CPU runs");
  m.def("set_isa", &set_isa, "force a vector path by name (auto: the best); false if this CPU lacks it", py::arg("name"));
  m.def("linear_forward", &linear_forward, "a dense layer's projections (desc [P, 8]) for x [T, K]",
        py::arg("x"), py::arg("qw"), py::arg("sc"), py::arg("grp"), py::arg("perm"), py::arg("desc"),
        py::arg("norm") = py::none(), py::arg("eps") = 1e-6, py::arg("act") = "none", py::arg("residual") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("attend", &attend, "attention of a few new rows over a bfloat16 KV cache", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("start"), py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("attend_qkv", &attend_qkv, "a layer's attention of a few new rows from its q/k/v projection",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k"), py::arg("v"), py::arg("start"),
        py::arg("window") = 0, py::arg("qk_norm") = py::none(), py::arg("eps") = 1e-6,
        py::call_guard<py::gil_scoped_release>());
  m.def("to_planes", &to_planes, "one projection's tiles: EXL2 column streams -> the kernel's layout (back: reverse)",
        py::arg("qw"), py::arg("grp"), py::arg("back") = false, py::call_guard<py::gil_scoped_release>());
  m.def("interleave_pages", &interleave_pages, "spread a tensor's pages over the NUMA nodes online; -> nodes",
        py::arg("t"));
  m.def("numa_nodes", &numa_nodes, "NUMA nodes online");
  m.def("read_gbps", &read_gbps, "read bandwidth of a team of `threads` streaming `bytes` (best of `reps`), GB/s",
        py::arg("threads"), py::arg("bytes"), py::arg("reps") = 3, py::call_guard<py::gil_scoped_release>());
}
