// Integer dot products of EXL2 codes with int8 activations (qdot.h says what goes in and out).
//
// Layout. A chunk of 32 rows of one column is b words (b bits a code). Codes of 2, 4 and 8 bits stay as
// EXL2 packs them: a little-endian stream of b-bit codes. 5 and 6 bits are split into two planes, low
// bits then high bits (5 = 4 + 1, 6 = 4 + 2), each a stream of its own width. 3 bits: two words of
// 2-bit fields and one word of the third bits, placed so that one AND and one ternary logic op give a
// whole code in a byte (chunk3 below). Same bits, same bytes, only their order differs (to_planes, at load):
// no code straddles a byte.
//
// Extractions. In a word of a stream of width w, byte j holds the values of 8/w codes at bit offsets
// w * m. Masking the word with the bytes' field m (AVX-512: an AND, the value stays in place, times
// 2**(w*m); AVX2: a shift and an AND) gives four unsigned bytes per column: one integer dot product
// (vpdpbusd; vpmaddubsw + vpmaddwd) multiplies them with four int8 activations. The activations are
// laid out per chunk in the order of the extractions (quantize), 32 bytes per block (one block per
// plane; 3 bits: one).
//
// Exact sums. AVX-512 keeps one int32 accumulator per power of two e of the extractions (the field's
// offset less the plane's offset in the code) and adds them shifted at the end of a group (every term of
// accumulator e is a multiple of 2**e, so the shift is exact). AVX2 shifts every value down and sums a
// block's extractions of a chunk in int16 (at most 8 products of 2 x 15 x 127 = 30480), then widens.
// Either way the group's sum over its rows of code * q is exact; the zero offset (2**(b-1) * sum q) is
// taken off in integers, and the group's scales (the column's, fp16, and the row's activation scale)
// applied in fp32.
#include "qdot.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define QDOT_X86 1
#define QDOT_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define QDOT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QDOT_INLINE inline __attribute__((always_inline))
#endif

namespace qdot {
namespace {

// The streams of a chunk: their widths and offsets in the code (3 bits: one block of its own).
struct Planes {
  int n;
  int pw[2];
  int sh[2];
};

constexpr Planes planes_of(int b) {
  return b == 5 ? Planes{2, {4, 1}, {0, 4}} : b == 6 ? Planes{2, {4, 2}, {0, 4}} : Planes{1, {b, 0}, {0, 0}};
}

constexpr int blocks_of(int b) { return planes_of(b).n; }   // 32-byte activation blocks per chunk

// Row (0..31) of the chunk whose activation goes to byte `pos` of a block of width w (3 bits: w = 2):
// extraction x = pos / 4 (word i = x / (8/w), field m = x % (8/w)), byte j = pos % 4 of the word.
constexpr int row_of(int w, int pos) {
  const int per = 8 / w, x = pos >> 2, j = pos & 3;
  return (x / per) * (32 / w) + j * per + x % per;
}

struct RowTables {
  int8_t t[9][32];
  RowTables() : t{} {
    for (int w : {1, 2, 4, 8})
      for (int pos = 0; pos < 32; ++pos) t[w][pos] = (int8_t)row_of(w, pos);
  }
};
const RowTables ROWS;

inline int block_width(int bits, int p) { return bits == 3 ? 2 : planes_of(bits).pw[p]; }

// 3 bits, one column's chunk: words L0, L1 (2-bit fields) and H (the third bits). Code k of field m of
// byte j of L_i (k = 16 i + 4 j + m, the 2-bit stream's order):
//   m < 3: its bits 0-1 at 2m of L_i's byte j, its bit 2 at 2m + 2 + i of H's byte j:
//          (L_i & 3 << 2m) | (H >> i & 4 << 2m) = code << 2m
//   m = 3: its bits 1-2 at 6 of L_i's byte j, its bit 0 at i of H's byte j:
//          (L_i & 0xC0) | (H << 5 - i & 0x20) = code << 5
void read3(const uint32_t* w, uint32_t* codes) {
  const uint32_t H = w[2 * TILE];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j)
      for (int m = 0; m < 4; ++m) {
        const uint32_t L = w[i * TILE] >> (8 * j), h = H >> (8 * j);
        codes[16 * i + 4 * j + m] = m < 3 ? ((L >> 2 * m) & 3) | (((h >> (2 * m + 2 + i)) & 1) << 2)
                                          : (((L >> 6) & 3) << 1) | ((h >> i) & 1);
      }
}

void write3(uint32_t* w, const uint32_t* codes) {
  uint32_t L[2] = {0, 0}, H = 0;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j)
      for (int m = 0; m < 4; ++m) {
        const uint32_t c = codes[16 * i + 4 * j + m];
        if (m < 3) {
          L[i] |= (c & 3) << (8 * j + 2 * m);
          H |= (c >> 2) << (8 * j + 2 * m + 2 + i);
        } else {
          L[i] |= (c >> 1) << (8 * j + 6);
          H |= (c & 1) << (8 * j + i);
        }
      }
  w[0] = L[0];
  w[TILE] = L[1];
  w[2 * TILE] = H;
}

// Codes of a chunk, one column: from / to its b words (stride TILE) as an EXL2 stream.
void read_stream(const uint32_t* w, int b, uint32_t* codes) {
  for (int k = 0; k < 32; ++k) {
    const int bit = b * k, wi = bit >> 5, s = bit & 31;
    uint64_t v = w[wi * TILE];
    if (s + b > 32) v |= (uint64_t)w[(wi + 1) * TILE] << 32;
    codes[k] = (uint32_t)(v >> s) & ((1u << b) - 1);
  }
}

void write_stream(uint32_t* w, int b, const uint32_t* codes) {
  for (int j = 0; j < b; ++j) w[j * TILE] = 0;
  for (int k = 0; k < 32; ++k) {
    const int bit = b * k, wi = bit >> 5, s = bit & 31;
    w[wi * TILE] |= codes[k] << s;
    if (s + b > 32) w[(wi + 1) * TILE] |= codes[k] >> (32 - s);
  }
}

// ... and as this kernel keeps them.
void read_chunk(const uint32_t* w, int b, uint32_t* codes) {
  if (b == 3) return read3(w, codes);
  const Planes P = planes_of(b);
  for (int k = 0; k < 32; ++k) codes[k] = 0;
  int word = 0;
  for (int p = 0; p < P.n; ++p) {
    uint32_t part[32];
    read_stream(w + word * TILE, P.pw[p], part);
    for (int k = 0; k < 32; ++k) codes[k] |= part[k] << P.sh[p];
    word += P.pw[p];
  }
}

void write_chunk(uint32_t* w, int b, const uint32_t* codes) {
  if (b == 3) return write3(w, codes);
  const Planes P = planes_of(b);
  int word = 0;
  for (int p = 0; p < P.n; ++p) {
    uint32_t part[32];
    for (int k = 0; k < 32; ++k) part[k] = (codes[k] >> P.sh[p]) & ((1u << P.pw[p]) - 1);
    write_stream(w + word * TILE, P.pw[p], part);
    word += P.pw[p];
  }
}

inline float half_to_float(uint16_t h) {
  const uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  uint32_t f;
  if (e == 0x1F) {
    f = s | 0x7F800000u | (m << 13);
  } else if (e) {
    f = s | ((e + 112) << 23) | (m << 13);
  } else if (m) {                          // subnormal: normalise
    int sh = 0;
    uint32_t mm = m;
    while (!(mm & 0x400)) { mm <<= 1; ++sh; }
    f = s | ((uint32_t)(113 - sh) << 23) | ((mm & 0x3FF) << 13);
  } else {
    f = s;
  }
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t f = (uint32_t)h << 16;
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

inline int64_t group_act_bytes(int bits, int rows) { return (int64_t)(rows / CHUNK) * blocks_of(bits) * 32; }

// -- scalar path: the reference the vector paths are held to, and the path of CPUs without AVX2 ---------

void group_scalar(int bits, const uint32_t* w, const int8_t* x, int chunks, int32_t out[TILE]) {
  const Planes P = planes_of(bits);
  const int nb = blocks_of(bits);
  for (int c = 0; c < chunks; ++c, w += bits * TILE, x += nb * 32)
    for (int n = 0; n < TILE; ++n) {
      uint32_t codes[32];
      read_chunk(w + n, bits, codes);
      int32_t acc = 0;
      for (int p = 0; p < nb; ++p) {
        const int8_t* rows = ROWS.t[block_width(bits, p)];
        const uint32_t mask = nb == 1 ? 0xFFu : ((1u << P.pw[p]) - 1) << P.sh[p];
        for (int pos = 0; pos < 32; ++pos) acc += (int32_t)(codes[rows[pos]] & mask) * x[p * 32 + pos];
      }
      out[n] += acc;
    }
}

void tile_scalar(const Codes& c, int64_t tile, const int8_t* xa, int64_t XB, const float* sx, const int32_t* sq, int R,
                 float res[][TILE]) {
  const uint32_t* tw = c.qw + tile * c.Q * TILE;
  const uint16_t* ts = c.sc + tile * c.G * TILE;
  for (int r = 0; r < R; ++r) std::fill(res[r], res[r] + TILE, 0.f);
  int64_t xo = 0;
  for (int64_t g = 0; g < c.Gu; ++g) {
    const int32_t* gr = c.grp + g * 4;
    const int bits = gr[0], chunks = gr[3] / CHUNK;
    for (int r = 0; r < R; ++r) {
      int32_t s[TILE] = {};
      group_scalar(bits, tw + (int64_t)gr[1] * TILE, xa + r * XB + xo, chunks, s);
      const int32_t zero = sq[r * c.G + g] << (bits - 1);
      for (int n = 0; n < TILE; ++n)
        res[r][n] += (float)(s[n] - zero) * (half_to_float(ts[g * TILE + n]) * sx[r * c.G + g]);
    }
    xo += group_act_bytes(bits, gr[3]);
  }
}

#if QDOT_X86
// -- AVX-512 VNNI ---------------------------------------------------------------------------------------

constexpr uint32_t bytes_of(uint32_t v) { return v * 0x01010101u; }
constexpr int MAX_E = 9;      // powers of two per row at most (5 bits: -4..4)
constexpr int MAX_CP = 4;

template <int B>
struct Exps {                 // the range of e over B's extractions
  static constexpr Planes P = planes_of(B);
  static constexpr int lo() {
    int e = 0;
    for (int p = 0; p < P.n; ++p) e = std::min(e, -P.sh[p]);
    return e;
  }
  static constexpr int hi() {
    if (B == 3) return 5;
    int e = 0;
    for (int p = 0; p < P.n; ++p) e = std::max(e, P.pw[p] * (8 / P.pw[p] - 1) - P.sh[p]);
    return e;
  }
  static constexpr int MIN = lo(), N = hi() - lo() + 1;
};

// Copies of each accumulator, so that a row's chain of dependent vpdpbusd (latency 4 cycles) stays
// short: 8, 4 and 2 bits add into few powers of two.
template <int B, int RB>
constexpr int copies() { return RB == 4 ? 1 : RB == 2 ? (B == 8 ? 2 : 1) : (B == 8 ? 4 : B == 4 || B == 2 ? 2 : 1); }

typedef __m512i Acc[MAX_E * MAX_CP];

template <int EMIN, int RB, int CP>
QDOT_VNNI QDOT_INLINE void dot(Acc* acc, int e, int copy, __m512i val, const int8_t* const* x, int pos) {
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) {
    int32_t xv;
    std::memcpy(&xv, x[r] + pos, 4);
    const int i = (e - EMIN) * CP + copy % CP;
    acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], val, _mm512_set1_epi32(xv));
  }
}

template <int PW, int SH, int EMIN, int RB, int CP>
QDOT_VNNI QDOT_INLINE void stream_vnni(const uint32_t* w, const int8_t* const* x, Acc* acc) {
  constexpr int PER = 8 / PW;
#pragma GCC unroll 8
  for (int i = 0; i < PW; ++i) {
    const __m512i v = _mm512_load_si512(w + i * TILE);
#pragma GCC unroll 8
    for (int m = 0; m < PER; ++m) {
      const __m512i val = PW == 8 ? v : _mm512_and_si512(v, _mm512_set1_epi32((int)bytes_of(((1u << PW) - 1) << (PW * m))));
      dot<EMIN, RB, CP>(acc, PW * m - SH, i, val, x, (i * PER + m) * 4);
    }
  }
}

template <int RB, int CP>
QDOT_VNNI QDOT_INLINE void chunk3_vnni(const uint32_t* w, const int8_t* const* x, Acc* acc) {
  const __m512i H = _mm512_load_si512(w + 2 * TILE);
  const __m512i hi[2] = {H, _mm512_srli_epi32(H, 1)}, top[2] = {_mm512_slli_epi32(H, 5), _mm512_slli_epi32(H, 4)};
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    const __m512i L = _mm512_load_si512(w + i * TILE);
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) {
      const __m512i lo = _mm512_and_si512(L, _mm512_set1_epi32((int)bytes_of(m < 3 ? 3u << 2 * m : 0xC0u)));
      const __m512i val = _mm512_ternarylogic_epi32(lo, m < 3 ? hi[i] : top[i],      // lo | (h & mask)
                                                    _mm512_set1_epi32((int)bytes_of(m < 3 ? 4u << 2 * m : 0x20u)), 0xF8);
      dot<0, RB, CP>(acc, m < 3 ? 2 * m : 5, i, val, x, (i * 4 + m) * 4);
    }
  }
}

// Exact sums over `chunks` chunks of one group for RB rows (x[r]: row r's activations of the group).
template <int B, int RB>
QDOT_VNNI QDOT_INLINE void group_vnni(const uint32_t* w, const int8_t* const* x, int chunks, __m512i* out) {
  constexpr Planes P = planes_of(B);
  constexpr int EMIN = Exps<B>::MIN, NE = Exps<B>::N, CP = copies<B, RB>(), NB = blocks_of(B);
  Acc acc[RB];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int e = 0; e < NE * CP; ++e) acc[r][e] = _mm512_setzero_si512();
  for (int c = 0; c < chunks; ++c, w += B * TILE) {
    const int8_t* xc[RB];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) xc[r] = x[r] + c * NB * 32;
    if constexpr (B == 3) {
      chunk3_vnni<RB, CP>(w, xc, acc);
    } else {
      stream_vnni<P.pw[0], P.sh[0], EMIN, RB, CP>(w, xc, acc);
      if constexpr (P.n == 2) {
        const int8_t* xh[RB];
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) xh[r] = xc[r] + 32;
        stream_vnni<P.pw[1], P.sh[1], EMIN, RB, CP>(w + P.pw[0] * TILE, xh, acc);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) {
    __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int i = 0; i < NE; ++i) {
      const int e = i + EMIN;
      __m512i a = acc[r][i * CP];
#pragma GCC unroll 4
      for (int j = 1; j < CP; ++j) a = _mm512_add_epi32(a, acc[r][i * CP + j]);
      s = _mm512_add_epi32(s, e > 0 ? _mm512_srai_epi32(a, e) : e < 0 ? _mm512_slli_epi32(a, -e) : a);
    }
    out[r] = s;
  }
}

// Groups g0 .. g1 - 1 of one width (EXL2 sorts a projection's groups by width: a few runs) for RB rows,
// x[r] pointing at the run's first activations: tot[r] += sum over the groups of their exact sums less
// the zero offset, times the column's and the row's scales.
template <int B, int RB>
QDOT_VNNI void run_vnni(const Codes& c, const uint32_t* tw, const uint16_t* ts, int64_t g0, int64_t g1,
                        const int8_t* const* x0, const float* sx, const int32_t* sq, __m512* tot) {
  const int8_t* x[RB];
  for (int r = 0; r < RB; ++r) x[r] = x0[r];
  for (int64_t g = g0; g < g1; ++g) {
    const int32_t* gr = c.grp + g * 4;
    const int chunks = gr[3] / CHUNK;
    __m512i sums[RB];
    group_vnni<B, RB>(tw + (int64_t)gr[1] * TILE, x, chunks, sums);
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ts + g * TILE)));
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m512i z = _mm512_sub_epi32(sums[r], _mm512_set1_epi32(sq[r * c.G + g] << (B - 1)));
      tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z), _mm512_mul_ps(s, _mm512_set1_ps(sx[r * c.G + g])), tot[r]);
      x[r] += chunks * blocks_of(B) * 32;
    }
  }
}

// run_vnni for RB rows; 5 and 6 bits (up to 9 powers of two a row) take 4 rows as two pairs (registers).
template <int B, int RB>
QDOT_VNNI QDOT_INLINE void run_rows(const Codes& c, const uint32_t* tw, const uint16_t* ts, int64_t g0, int64_t g1,
                                    const int8_t* const* x, const float* sx, const int32_t* sq, __m512* tot) {
  if constexpr (RB == 4 && (B == 5 || B == 6)) {
    run_vnni<B, 2>(c, tw, ts, g0, g1, x, sx, sq, tot);
    run_vnni<B, 2>(c, tw, ts, g0, g1, x + 2, sx + 2 * c.G, sq + 2 * c.G, tot + 2);
  } else {
    run_vnni<B, RB>(c, tw, ts, g0, g1, x, sx, sq, tot);
  }
}

template <int RB>
QDOT_VNNI void rows_vnni(const Codes& c, int64_t tile, const int8_t* xa, int64_t XB, const float* sx,
                         const int32_t* sq, float res[][TILE]) {
  const uint32_t* tw = c.qw + tile * c.Q * TILE;
  const uint16_t* ts = c.sc + tile * c.G * TILE;
  __m512 tot[RB];
  const int8_t* x[RB];
  for (int r = 0; r < RB; ++r) {
    tot[r] = _mm512_setzero_ps();
    x[r] = xa + r * XB;
  }
  for (int64_t g0 = 0, g1; g0 < c.Gu; g0 = g1) {
    const int bits = c.grp[g0 * 4];
    int64_t n = 0;
    for (g1 = g0; g1 < c.Gu && c.grp[g1 * 4] == bits; ++g1) n += group_act_bytes(bits, c.grp[g1 * 4 + 3]);
    switch (bits) {
      case 2: run_rows<2, RB>(c, tw, ts, g0, g1, x, sx, sq, tot); break;
      case 3: run_rows<3, RB>(c, tw, ts, g0, g1, x, sx, sq, tot); break;
      case 4: run_rows<4, RB>(c, tw, ts, g0, g1, x, sx, sq, tot); break;
      case 5: run_rows<5, RB>(c, tw, ts, g0, g1, x, sx, sq, tot); break;
      case 6: run_rows<6, RB>(c, tw, ts, g0, g1, x, sx, sq, tot); break;
      default: run_rows<8, RB>(c, tw, ts, g0, g1, x, sx, sq, tot); break;
    }
    for (int r = 0; r < RB; ++r) x[r] += n;
  }
  for (int r = 0; r < RB; ++r) _mm512_storeu_ps(res[r], tot[r]);
}

// Rows in fours, pairs and ones: they share each extraction (the codes of a tile stay in L1 between them).
QDOT_VNNI void tile_vnni(const Codes& c, int64_t tile, const int8_t* xa, int64_t XB, const float* sx, const int32_t* sq,
                         int R, float res[][TILE]) {
  for (int r = 0, rb; r < R; r += rb) {
    rb = R - r >= 4 ? 4 : R - r >= 2 ? 2 : 1;
    const int8_t* x = xa + r * XB;
    if (rb == 4) rows_vnni<4>(c, tile, x, XB, sx + r * c.G, sq + r * c.G, res + r);
    else if (rb == 2) rows_vnni<2>(c, tile, x, XB, sx + r * c.G, sq + r * c.G, res + r);
    else rows_vnni<1>(c, tile, x, XB, sx + r * c.G, sq + r * c.G, res + r);
  }
}

// -- AVX2 -----------------------------------------------------------------------------------------------

// int16 sums a16[half][slot] of one chunk's products, both halves of the tile (columns 0-7, 8-15).
QDOT_AVX2 QDOT_INLINE void madd16(__m256i& a, __m256i val, const int8_t* x) {
  int32_t xv;
  std::memcpy(&xv, x, 4);
  a = _mm256_add_epi16(a, _mm256_maddubs_epi16(val, _mm256_set1_epi32(xv)));
}

template <int PW, int SLOT>
QDOT_AVX2 QDOT_INLINE void stream_avx2(const uint32_t* w, const int8_t* x, __m256i (*a16)[2]) {
  constexpr int PER = 8 / PW;
  const __m256i low = _mm256_set1_epi8((char)(PW == 8 ? 0x0F : (1 << PW) - 1));
#pragma GCC unroll 8
  for (int i = 0; i < PW; ++i)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_load_si256((const __m256i*)(w + i * TILE + h * 8));
#pragma GCC unroll 8
      for (int m = 0; m < PER; ++m) {
        const int8_t* xp = x + (i * PER + m) * 4;
        if constexpr (PW == 8) {                 // low and high nibbles: unsigned bytes under 16
          madd16(a16[h][0], _mm256_and_si256(v, low), xp);
          madd16(a16[h][1], _mm256_and_si256(_mm256_srli_epi16(v, 4), low), xp);
        } else {
          madd16(a16[h][SLOT], _mm256_and_si256(m ? _mm256_srli_epi32(v, PW * m) : v, low), xp);
        }
      }
    }
}

QDOT_AVX2 QDOT_INLINE void chunk3_avx2(const uint32_t* w, const int8_t* x, __m256i (*a16)[2]) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m256i H = _mm256_load_si256((const __m256i*)(w + 2 * TILE + h * 8));
    const __m256i hi[2] = {H, _mm256_srli_epi32(H, 1)}, top[2] = {_mm256_slli_epi32(H, 5), _mm256_slli_epi32(H, 4)};
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
      const __m256i L = _mm256_load_si256((const __m256i*)(w + i * TILE + h * 8));
#pragma GCC unroll 4
      for (int m = 0; m < 4; ++m) {
        const __m256i lo = _mm256_and_si256(L, _mm256_set1_epi32((int)bytes_of(m < 3 ? 3u << 2 * m : 0xC0u)));
        const __m256i hb = _mm256_and_si256(m < 3 ? hi[i] : top[i], _mm256_set1_epi32((int)bytes_of(m < 3 ? 4u << 2 * m : 0x20u)));
        const __m256i val = _mm256_or_si256(lo, hb);          // code << 2m (m < 3) or << 5
        madd16(a16[h][0], m == 0 ? val : _mm256_srli_epi32(val, m < 3 ? 2 * m : 5), x + (i * 4 + m) * 4);
      }
    }
  }
}

template <int B>
QDOT_AVX2 QDOT_INLINE void group_avx2(const uint32_t* w, const int8_t* x, int chunks, __m256i out[2]) {
  constexpr Planes P = planes_of(B);
  constexpr bool TWO = P.n == 2 || B == 8;       // a second int16 slot: the high plane, the high nibbles
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[2][2];
  for (int h = 0; h < 2; ++h) acc[h][0] = acc[h][1] = _mm256_setzero_si256();
  for (int c = 0; c < chunks; ++c, w += B * TILE, x += blocks_of(B) * 32) {
    __m256i a16[2][2];
    for (int h = 0; h < 2; ++h) a16[h][0] = a16[h][1] = _mm256_setzero_si256();
    if constexpr (B == 3) {
      chunk3_avx2(w, x, a16);
    } else {
      stream_avx2<P.pw[0], 0>(w, x, a16);
      if constexpr (P.n == 2) stream_avx2<P.pw[1], 1>(w + P.pw[0] * TILE, x + 32, a16);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      acc[h][0] = _mm256_add_epi32(acc[h][0], _mm256_madd_epi16(a16[h][0], ones));
      if constexpr (TWO) acc[h][1] = _mm256_add_epi32(acc[h][1], _mm256_madd_epi16(a16[h][1], ones));
    }
  }
  constexpr int SH1 = B == 8 ? 4 : P.sh[1];
  for (int h = 0; h < 2; ++h) out[h] = TWO ? _mm256_add_epi32(acc[h][0], _mm256_slli_epi32(acc[h][1], SH1)) : acc[h][0];
}

QDOT_AVX2 void tile_avx2(const Codes& c, int64_t tile, const int8_t* xa, int64_t XB, const float* sx, const int32_t* sq,
                         int R, float res[][TILE]) {
  const uint32_t* tw = c.qw + tile * c.Q * TILE;
  const uint16_t* ts = c.sc + tile * c.G * TILE;
  __m256 tot[MAX_T][2];
  for (int r = 0; r < R; ++r) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
  int64_t xo = 0;
  for (int64_t g = 0; g < c.Gu; ++g) {
    const int32_t* gr = c.grp + g * 4;
    const int bits = gr[0], chunks = gr[3] / CHUNK;
    const uint32_t* w = tw + (int64_t)gr[1] * TILE;
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ts + g * TILE)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ts + g * TILE + 8)));
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xa + r * XB + xo;
      __m256i sums[2];
      switch (bits) {
        case 2: group_avx2<2>(w, x, chunks, sums); break;
        case 3: group_avx2<3>(w, x, chunks, sums); break;
        case 4: group_avx2<4>(w, x, chunks, sums); break;
        case 5: group_avx2<5>(w, x, chunks, sums); break;
        case 6: group_avx2<6>(w, x, chunks, sums); break;
        default: group_avx2<8>(w, x, chunks, sums); break;
      }
      const int64_t i = r * c.G + g;
      const __m256i zero = _mm256_set1_epi32(sq[i] << (bits - 1));
      const __m256 xs = _mm256_set1_ps(sx[i]);
      tot[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums[0], zero)), _mm256_mul_ps(s0, xs), tot[r][0]);
      tot[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums[1], zero)), _mm256_mul_ps(s1, xs), tot[r][1]);
    }
    xo += group_act_bytes(bits, gr[3]);
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(res[r], tot[r][0]);
    _mm256_storeu_ps(res[r] + 8, tot[r][1]);
  }
}
#endif  // QDOT_X86

Isa detect() {
#if QDOT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return AVX512_VNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return AVX2;
#endif
  return SCALAR;
}

std::atomic<int> g_forced{-1};

template <bool TO>
void convert(uint32_t* tw, const int32_t* grp, int64_t G) {
  for (int64_t g = 0; g < G; ++g) {
    const int b = grp[g * 4];
    if (b != 3 && planes_of(b).n == 1) continue;     // 2, 4 and 8 bits: the stream is the layout
    uint32_t* w = tw + (int64_t)grp[g * 4 + 1] * TILE;
    for (int c = 0; c < grp[g * 4 + 3] / CHUNK; ++c, w += b * TILE)
      for (int n = 0; n < TILE; ++n) {
        uint32_t codes[32];
        if (TO) { read_stream(w + n, b, codes); write_chunk(w + n, b, codes); }
        else { read_chunk(w + n, b, codes); write_stream(w + n, b, codes); }
      }
  }
}

template <bool BF16>
void quantize_rows(const Codes& c, const void* src, int64_t ld, const int64_t* rows, int R, int8_t* xa, float* sx,
                   int32_t* sq) {
  const int64_t XB = act_bytes(c);
  std::vector<float> xp(c.K);
  std::vector<int8_t> q(c.K);
  for (int r = 0; r < R; ++r) {
    if (BF16) {
      const uint16_t* s = (const uint16_t*)src + rows[r] * ld;
      for (int64_t k = 0; k < c.K; ++k) xp[k] = bf16_to_float(s[c.perm[k]]);
    } else {
      const float* s = (const float*)src + rows[r] * ld;
      for (int64_t k = 0; k < c.K; ++k) xp[k] = s[c.perm[k]];
    }
    int8_t* d = xa + r * XB;
    for (int64_t g = 0; g < c.Gu; ++g) {
      const int32_t* gr = c.grp + g * 4;
      const int bits = gr[0], r0 = gr[2], n = gr[3];
      float amax = 0.f;
      for (int k = 0; k < n; ++k) amax = std::max(amax, std::fabs(xp[r0 + k]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int k = 0; k < n; ++k) {
        const float f = xp[r0 + k] * inv;                // rounded half away from zero, inline
        const int v = (int)(f + (f >= 0.f ? 0.5f : -0.5f));
        q[k] = (int8_t)std::max(-127, std::min(127, v));
        sum += q[k];
      }
      sx[r * c.G + g] = amax / 127.f;
      sq[r * c.G + g] = sum;
      const Planes P = planes_of(bits);
      for (int ch = 0; ch < n / CHUNK; ++ch)
        for (int p = 0; p < P.n; ++p, d += 32)
          for (int pos = 0; pos < 32; ++pos) d[pos] = q[ch * CHUNK + ROWS.t[block_width(bits, p)][pos]];
    }
  }
}

}  // namespace

bool valid_bits(int bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8; }

int64_t act_bytes(const Codes& c) {
  int64_t n = 0;
  for (int64_t g = 0; g < c.Gu; ++g) n += group_act_bytes(c.grp[g * 4], c.grp[g * 4 + 3]);
  return n;
}

void quantize(const Codes& c, const void* src, bool bf16, int64_t ld, const int64_t* rows, int R, int8_t* xa,
              float* sx, int32_t* sq) {
  if (bf16) quantize_rows<true>(c, src, ld, rows, R, xa, sx, sq);
  else quantize_rows<false>(c, src, ld, rows, R, xa, sx, sq);
}

void tile(int isa, const Codes& c, int64_t t, const int8_t* xa, int64_t XB, const float* sx, const int32_t* sq, int R,
          float res[][TILE]) {
#if QDOT_X86
  if (isa == AVX512_VNNI) return tile_vnni(c, t, xa, XB, sx, sq, R, res);
  if (isa == AVX2) return tile_avx2(c, t, xa, XB, sx, sq, R, res);
#endif
  tile_scalar(c, t, xa, XB, sx, sq, R, res);
}

Isa supported() {
  static const Isa best = detect();
  return best;
}

Isa active() {
  const int f = g_forced.load(std::memory_order_relaxed);
  return f < 0 ? supported() : (Isa)f;
}

bool force(int isa) {
  if (isa > (int)supported() || isa < -1) return false;
  g_forced.store(isa, std::memory_order_relaxed);
  return true;
}

const char* isa_name(int isa) {
  return isa == AVX512_VNNI ? "avx512_vnni" : isa == AVX2 ? "avx2" : "scalar";
}

void to_planes(uint32_t* tw, const int32_t* grp, int64_t G) { convert<true>(tw, grp, G); }
void from_planes(uint32_t* tw, const int32_t* grp, int64_t G) { convert<false>(tw, grp, G); }

double read_gbps(int threads, int64_t bytes, int reps) {
  const int64_t n = std::max<int64_t>(bytes / 64, 1);
  uint64_t* buf = (uint64_t*)std::aligned_alloc(64, n * 64);
  if (!buf) return 0.0;
  const int T = std::max(1, threads);
#pragma omp parallel for num_threads(T) schedule(static)
  for (int64_t i = 0; i < n; ++i)
    for (int j = 0; j < 8; ++j) buf[i * 8 + j] = (uint64_t)(i + j);
  double best = 0.0;
  std::atomic<uint64_t> sink{0};
  for (int rep = 0; rep < std::max(1, reps); ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(T)
    {
      uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {       // eight independent sums of one 64-byte line
        const uint64_t* l = buf + i * 8;
        a0 += l[0]; a1 += l[1]; a2 += l[2]; a3 += l[3]; a4 += l[4]; a5 += l[5]; a6 += l[6]; a7 += l[7];
      }
      sink.fetch_add(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7, std::memory_order_relaxed);
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, (double)(n * 64) / dt / 1e9);
  }
  std::free(buf);
  return sink.load() == 1 ? best + 0.0 : best;    // (keeps the sums alive)
}

}  // namespace qdot
