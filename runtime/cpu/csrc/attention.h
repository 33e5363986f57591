// Attention of a few new rows over a bfloat16 KV cache (attention.cpp).
#pragma once
#include <cstdint>

namespace attn {

// q [T, NH, D] bf16 (rotated), keys and values of one layer [KVH, ld, D] bf16 (positions 0 .. start + T - 1
// filled, the new rows' included), row t at position start + t; window > 0: it sees its last `window`
// keys only. -> out [T, NH, D] bf16, query head n reading kv head n / (NH / KVH), scores scaled by D**-0.5.
void decode(const uint16_t* q, int64_t T, int64_t NH, int64_t KVH, int64_t D, const uint16_t* k, const uint16_t* v,
            int64_t ld, int64_t start, int64_t window, uint16_t* out, int threads);

// The same from the q/k/v projection's output qkv [T, (NH + 2 KVH) * D] bf16 (q heads, k heads, v heads):
// q and k heads RMS-normalised per head (qk_norm [NH + KVH, D] float32, eps; null: not), rotated by the
// rows' cos, sin [T, D] bf16 (rotate-half), k and v written into the cache at start .. start + T - 1.
void decode_qkv(const uint16_t* qkv, int64_t T, int64_t NH, int64_t KVH, int64_t D, const uint16_t* cos,
                const uint16_t* sin, const float* qk_norm, float eps, uint16_t* k, uint16_t* v, int64_t ld,
                int64_t start, int64_t window, uint16_t* out, int threads);

}  // namespace attn
