// Integer dot products of EXL2 codes (2..8 bits) with int8 activations: the CPU's projections.
// No torch here (qdot.cpp builds and runs alone); exl2_cpu.cpp binds it.
//
// Codes of one projection (K inputs, N outputs, G groups) as the store keeps them:
//   qw  uint32 [N/16][Q][16]  tiles of 16 columns; in a tile, group by group, chunk by chunk of 32 rows:
//                             b words per column holding the chunk's 32 codes as planes (see qdot.cpp)
//   sc  fp16   [N/16][G][16]  the group's scale per column (exllamav2's, exact)
//   grp int32  [G][4]         (bits, first packed row (word row), first input row, rows) per group
//   perm int32 [K]            packed row k multiplies input feature perm[k]
// W[n, perm[k]] = (code[k, n] - 2**(b-1)) * sc[g(k), n].
#pragma once
#include <cstdint>

namespace qdot {

constexpr int TILE = 16;   // columns per tile: one 512-bit vector of int32 lanes
constexpr int MAX_T = 64;  // rows per tile call
constexpr int CHUNK = 32;  // rows per chunk: b words of one column

// Vector paths, chosen at run time from one build (per-function target attributes, CPUID).
enum Isa : int { SCALAR = 0, AVX2 = 1, AVX512_VNNI = 2 };
Isa supported();              // the best path this CPU and OS run
Isa active();                 // the path calls take: supported(), unless force() chose a lower one
bool force(int isa);          // -1: back to supported(); false (nothing changed) when the CPU lacks it
const char* isa_name(int isa);

struct Codes {
  const uint32_t* qw;   // this projection's tiles
  const uint16_t* sc;
  const int32_t* grp;
  const int32_t* perm;
  int64_t G;            // groups (the scales' stride per tile)
  int64_t Gu;           // groups used (fewer for a projection cut to its first rows)
  int64_t K, N, Q;
};

// Quantized activations of R rows for one projection, per row: act_bytes(c) int8 values laid out for
// the kernel, and per group a scale (max |x| / 127) and the sum of the int8 values.
int64_t act_bytes(const Codes& c);
// Row r of x is src + rows[r] * ld, in input order (float32, or bfloat16 when `bf16`).
void quantize(const Codes& c, const void* src, bool bf16, int64_t ld, const int64_t* rows, int R, int8_t* xa,
              float* sx, int32_t* sq);
// res[r][j] = sum_k W[tile * 16 + j, k] * x[r, k], r < R (R <= MAX_T), from quantize's output (XB: act_bytes).
void tile(int isa, const Codes& c, int64_t tile, const int8_t* xa, int64_t XB, const float* sx, const int32_t* sq,
          int R, float res[][TILE]);

// One tile's words (EXL2 column streams, group by group) -> the kernel's planes, in place; and back.
bool valid_bits(int bits);
void to_planes(uint32_t* tile_words, const int32_t* grp, int64_t G);
void from_planes(uint32_t* tile_words, const int32_t* grp, int64_t G);

// Read bandwidth of a team of `threads` streaming `bytes` (best of `reps` passes), GB/s; the buffer is
// first touched by the team that reads it (each thread's pages on its own node).
double read_gbps(int threads, int64_t bytes, int reps);

}  // namespace qdot
