// Attention of a few new rows (decode, verify) over a bfloat16 KV cache: the CPU engine's decode step,
// where torch's fused CPU attention spends ~190 us a layer on 3 query rows (measured at 512 cached tokens
// on the demo model, 2-core AMD EPYC) for ~0.4 MB of keys and values.
//
// Per kv head h and each of its G query heads and T rows: scores over the keys the row sees (causal; a
// sliding window keeps the last `window`), softmax in float32, the weighted sum of values. One item per
// (kv head, block of its query heads, row, block of 256 keys), the blocks' softmax merged after, so a small
// team stays balanced on a long cache. AVX-512 where qdot's path is AVX-512 (head sizes 32, 64, 128, 256), plain
// C++ otherwise.
#include "attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "qdot.h"

namespace attn {
namespace {

inline float bf16(uint16_t h) {
  const uint32_t f = (uint32_t)h << 16;
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

inline uint16_t to_bf16(float v) {                 // round to nearest even (no NaNs here)
  uint32_t f;
  std::memcpy(&f, &v, 4);
  return (uint16_t)((f + 0x7FFFu + ((f >> 16) & 1u)) >> 16);
}

// exp(x) for x <= 0 (softmax's shifted scores), within a few float ulps: 2**(x log2 e) as 2**n times a
// polynomial of the fraction f in [0, 1).
constexpr float C[7] = {1.f, 6.93147182e-1f, 2.40226507e-1f, 5.55041087e-2f, 9.61812911e-3f, 1.33335582e-3f,
                        1.53533712e-4f};

inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.44269504f, n = std::floor(t), f = t - n;
  float p = C[6];
  for (int i = 5; i >= 0; --i) p = p * f + C[i];
  const int32_t e = ((int32_t)n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &e, 4);
  return p * two_n;
}

constexpr int MAX_G = 16;        // query heads per kv head handled together (more: in blocks of 16)
constexpr int64_t SPLIT = 256;   // keys per item: long caches are shared out between the team

// G query heads (q [G][D] float32, scaled) over keys/values [n, D] (bf16, row stride D): for each head
// its largest score m[g], sum of exp(score - m) l[g] and unnormalised output acc[g][D]. s: [G][n] scratch.
void part_scalar(const float* q, int G, const uint16_t* k, const uint16_t* v, int64_t n, int64_t D, float* s,
                 float* m, float* l, float* acc) {
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      float d = 0.f;
      for (int64_t i = 0; i < D; ++i) d += q[g * D + i] * bf16(k[j * D + i]);
      s[g * n + j] = d;
      m[g] = std::max(m[g], d);
    }
    l[g] = 0.f;
    for (int64_t j = 0; j < n; ++j) l[g] += (s[g * n + j] = exp_neg(s[g * n + j] - m[g]));
    for (int64_t i = 0; i < D; ++i) acc[g * D + i] = 0.f;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < D; ++i) acc[g * D + i] += s[g * n + j] * bf16(v[j * D + i]);
  }
}

#if defined(__x86_64__)
#define ATTN_512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define ATTN_256 __attribute__((target("avx2,fma")))

ATTN_512 inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

ATTN_512 inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(C[6]);
  for (int i = 5; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C[i]));
  return _mm512_scalef_ps(p, n);
}

// D = 16 V (V of 1 .. 16): the key's and value's vectors stay in registers.
template <int V>
ATTN_512 void part_512(const float* q, int G, const uint16_t* k, const uint16_t* v, int64_t n, float* s, float* m,
                       float* l, float* acc) {
  constexpr int64_t D = 16 * V;
  __m512 kv[V];
  for (int g = 0; g < G; ++g) m[g] = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    for (int i = 0; i < V; ++i) kv[i] = load16(k + j * D + i * 16);
    for (int g = 0; g < G; ++g) {
      __m512 d = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), kv[0]);
      for (int i = 1; i < V; ++i) d = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + i * 16), kv[i], d);
      const float sc = _mm512_reduce_add_ps(d);
      s[g * n + j] = sc;
      m[g] = std::max(m[g], sc);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * n;
    const __m512 mg = _mm512_set1_ps(m[g]);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), mg));
      _mm512_storeu_ps(sg + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    float tail = 0.f;
    for (; j < n; ++j) tail += (sg[j] = exp_neg(sg[j] - m[g]));
    l[g] = _mm512_reduce_add_ps(sum) + tail;
    __m512 a[V];
    for (int i = 0; i < V; ++i) a[i] = _mm512_setzero_ps();
    for (j = 0; j < n; ++j) {                     // the values: from L1 after the first head of the block
      const __m512 p = _mm512_set1_ps(sg[j]);
      for (int i = 0; i < V; ++i) a[i] = _mm512_fmadd_ps(p, load16(v + j * D + i * 16), a[i]);
    }
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc + g * D + i * 16, a[i]);
  }
}
#endif

void part(const float* q, int G, const uint16_t* k, const uint16_t* v, int64_t n, int64_t D, float* s, float* m,
          float* l, float* acc) {
#if defined(__x86_64__)
  if (qdot::active() == qdot::AVX512_VNNI) {
    switch (D) {
      case 64: return part_512<4>(q, G, k, v, n, s, m, l, acc);
      case 128: return part_512<8>(q, G, k, v, n, s, m, l, acc);
      case 256: return part_512<16>(q, G, k, v, n, s, m, l, acc);
      case 32: return part_512<2>(q, G, k, v, n, s, m, l, acc);
      default: break;
    }
  }
#endif
  part_scalar(q, G, k, v, n, D, s, m, l, acc);
}

// q [T, NH, D] float32, scaled by D**-0.5 -> out (decode's).
void core(const float* q, int64_t T, int64_t NH, int64_t KVH, int64_t D, const uint16_t* k, const uint16_t* v,
          int64_t ld, int64_t start, int64_t window, uint16_t* out, int threads) {
  const int64_t G = NH / KVH, GB = (G + MAX_G - 1) / MAX_G;             // query heads in blocks of MAX_G
  const int64_t NS = (start + T + SPLIT - 1) / SPLIT, items = KVH * GB * T * NS;
  // per item: m, l [MAX_G], acc [MAX_G][D]
  std::vector<float> parts(items * MAX_G * (2 + D));
  std::vector<int64_t> used(items, 0);
#pragma omp parallel num_threads(std::max(1, threads))
  {
    std::vector<float> merged(D), s(MAX_G * SPLIT);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t sp = it % NS, t = (it / NS) % T, gb = (it / (NS * T)) % GB, h = it / (NS * T * GB);
      const int64_t pos = start + t, lo = window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
      const int64_t j0 = std::max(lo, sp * SPLIT), j1 = std::min(pos + 1, (sp + 1) * SPLIT);
      if (j1 <= j0) continue;
      const int g0 = (int)(gb * MAX_G), ng = (int)std::min<int64_t>(MAX_G, G - g0);
      float* pm = parts.data() + it * MAX_G * (2 + D);
      part(q + (t * NH + h * G + g0) * D, ng, k + (h * ld + j0) * D, v + (h * ld + j0) * D, j1 - j0, D, s.data(), pm, pm + MAX_G,
           pm + 2 * MAX_G);
      used[it] = 1;
    }
    // merge the splits of each (kv head, head block, row): rescale to the largest max
#pragma omp for schedule(static)
    for (int64_t o = 0; o < KVH * GB * T; ++o) {
      const int64_t t = o % T, gb = (o / T) % GB, h = o / (T * GB);
      const int g0 = (int)(gb * MAX_G), ng = (int)std::min<int64_t>(MAX_G, G - g0);
      for (int g = 0; g < ng; ++g) {
        float M = -INFINITY, L = 0.f;
        for (int64_t sp = 0; sp < NS; ++sp)
          if (used[o * NS + sp]) M = std::max(M, parts[(o * NS + sp) * MAX_G * (2 + D) + g]);
        std::vector<float>& a = merged;
        for (int64_t i = 0; i < D; ++i) a[i] = 0.f;
        for (int64_t sp = 0; sp < NS; ++sp) {
          if (!used[o * NS + sp]) continue;
          const float* pm = parts.data() + (o * NS + sp) * MAX_G * (2 + D);
          const float w = exp_neg(pm[g] - M);
          L += w * pm[MAX_G + g];
          for (int64_t i = 0; i < D; ++i) a[i] += w * pm[2 * MAX_G + g * D + i];
        }
        uint16_t* dst = out + (t * NH + h * G + g0 + g) * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = to_bf16(a[i] / L);
      }
    }
  }
}


// Rotate one head x [D] (float32) by position's cos, sin [D] (bf16): x * cos + (-x2, x1) * sin.
void rope(float* x, const uint16_t* cos, const uint16_t* sin, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    x[i] = a * bf16(cos[i]) - b * bf16(sin[i]);
    x[i + h] = b * bf16(cos[i + h]) + a * bf16(sin[i + h]);
  }
}

void rms(float* x, const float* w, int64_t D, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < D; ++i) ss += (double)x[i] * x[i];
  const float inv = (float)(1.0 / std::sqrt(ss / D + eps));
  for (int64_t i = 0; i < D; ++i) x[i] = x[i] * inv * w[i];
}

}  // namespace

void decode(const uint16_t* q, int64_t T, int64_t NH, int64_t KVH, int64_t D, const uint16_t* k, const uint16_t* v,
            int64_t ld, int64_t start, int64_t window, uint16_t* out, int threads) {
  const float scale = 1.f / std::sqrt((float)D);
  std::vector<float> qf(T * NH * D);
  for (int64_t i = 0; i < T * NH * D; ++i) qf[i] = bf16(q[i]) * scale;
  core(qf.data(), T, NH, KVH, D, k, v, ld, start, window, out, threads);
}

void decode_qkv(const uint16_t* qkv, int64_t T, int64_t NH, int64_t KVH, int64_t D, const uint16_t* cos,
                const uint16_t* sin, const float* qk_norm, float eps, uint16_t* k, uint16_t* v, int64_t ld,
                int64_t start, int64_t window, uint16_t* out, int threads) {
  const float scale = 1.f / std::sqrt((float)D);
  const int64_t W = (NH + 2 * KVH) * D;
  std::vector<float> qf(T * NH * D), head(D);
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* row = qkv + t * W;
    for (int64_t n = 0; n < NH + KVH; ++n) {               // q heads, then k heads: normed, rotated
      for (int64_t i = 0; i < D; ++i) head[i] = bf16(row[n * D + i]);
      if (qk_norm) rms(head.data(), qk_norm + n * D, D, eps);
      rope(head.data(), cos + t * D, sin + t * D, D);
      if (n < NH) {
        for (int64_t i = 0; i < D; ++i) qf[(t * NH + n) * D + i] = head[i] * scale;
      } else {
        uint16_t* dst = k + ((n - NH) * ld + start + t) * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = to_bf16(head[i]);
      }
    }
    for (int64_t h = 0; h < KVH; ++h)
      std::memcpy(v + (h * ld + start + t) * D, row + (NH + KVH + h) * D, D * sizeof(uint16_t));
  }
  core(qf.data(), T, NH, KVH, D, k, v, ld, start, window, out, threads);
}

}  // namespace attn
