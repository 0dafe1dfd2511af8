// GGML block layouts (as stored in GGUF files) and the activation blocks our dot products use.
// Each struct's size is asserted against ggml's; the Python table (weights/ggml_quants.py) is the
// same data, and tests check the two agree.
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kt {

constexpr int QK_K = 256;  // super-block size of the k-quants
constexpr int QK = 32;     // block size of the legacy quants

using fp16_t = uint16_t;
using bf16_t = uint16_t;

struct block_q4_0 { fp16_t d; uint8_t qs[QK / 2]; };
struct block_q8_0 { fp16_t d; int8_t qs[QK]; };
// Q2_K / Q3_K 2-bit planes: qs[32p + j] bits 2i..2i+1 hold value 128p + 32i + j; Q3_K's hmask[j]
// bit (4p + i) holds that value's third bit. Sub-block s (16 values) = 8p + 2i + (j >= 16).
struct block_q2_k { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; fp16_t d, dmin; };
struct block_q3_k { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; fp16_t d; };
struct block_q4_k { fp16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; };
struct block_q5_k { fp16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct block_q6_k { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; fp16_t d; };
struct block_iq4_xs { fp16_t d; uint16_t scales_h; uint8_t scales_l[QK_K / 64]; uint8_t qs[QK_K / 2]; };
// MXFP4 (gpt-oss's experts): value = kMxfp4Values[nibble] * 2^(e - 128), nibbles as block_q4_0's.
struct block_mxfp4 { uint8_t e; uint8_t qs[QK / 2]; };

static_assert(sizeof(block_q4_0) == 18, "q4_0 block");
static_assert(sizeof(block_q8_0) == 34, "q8_0 block");
static_assert(sizeof(block_q2_k) == 84, "q2_k block");
static_assert(sizeof(block_q3_k) == 110, "q3_k block");
static_assert(sizeof(block_q4_k) == 144, "q4_k block");
static_assert(sizeof(block_q5_k) == 176, "q5_k block");
static_assert(sizeof(block_q6_k) == 210, "q6_k block");
static_assert(sizeof(block_iq4_xs) == 136, "iq4_xs block");
static_assert(sizeof(block_mxfp4) == 17, "mxfp4 block");

// MXFP4's e2m1 code book doubled (whole numbers), and its shared exponent byte as the factor
// 2^(e - 128) that goes with it (e = 0, 1: float subnormals, as ggml decodes them).
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr uint8_t kMxfp4Plus12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};  // (unsigned)
inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// 16 rows' Q4_K blocks of one block column, interleaved (2304 bytes = 16 x 144): d, dmin of
// each row; sc[p][r] = bytes 4p..4p+3 of row r's packed scales (unchanged); qs[4j + q] holds,
// in its 32-bit lane r, values 32j + 4q + i (low nibbles) and 32j + 16 + 4q + i (high) of row
// r, i = 0..3: four values of sub-block j for each of the 16 rows, ready for dpbusd.
struct tile_q4_k16 { fp16_t d[16]; fp16_t dmin[16]; uint32_t sc[3][16]; uint8_t qs[32][64]; };
static_assert(sizeof(tile_q4_k16) == 16 * sizeof(block_q4_k), "q4_k tile");

// 16 rows' Q6_K blocks of one block column (3360 bytes = 16 x 210), in the order the kernel reads
// them, every byte after the one before (one forward stream for the prefetchers, which follow
// three interleaved ones or a part's scales read ahead of its first bytes much worse from
// memory): part[p] holds values
// 64p..64p+63 of each row, sub-block pairs j = 2p + s: sc[s][r] = row r's scales of sub-blocks 2j,
// 2j+1 (16 values each); then half[s]: qh[h] byte i of lane r: the high 2 bits of values
// 32j + 8h + i, 32j + 16 + 8h + i, 32j + 8h + 4 + i, 32j + 16 + 8h + 4 + i at bits 0-1, 2-3, 4-5,
// 6-7 (those of ql[2h] lo, hi, then ql[2h + 1] lo, hi); ql[q] as tile_q4_k16's qs (low 4 bits of
// values 32j + 4q + i and 32j + 16 + 4q + i of row r in lane r). Then d of each row.
struct tile_q6_k16 {
    struct { int8_t sc[2][16][2]; struct { uint8_t qh[2][64]; uint8_t ql[4][64]; } half[2]; } part[4];
    fp16_t d[16];
};
static_assert(sizeof(tile_q6_k16) == 16 * sizeof(block_q6_k), "q6_k tile");

// 16 rows' Q5_K blocks of one block column (2816 bytes = 16 x 176): the header as tile_q4_k16's,
// then per sub-block j in reading order the four nibble steps (as tile_q4_k16's qs[4j + q]) and
// qh: byte i of lane r holds at bit q the fifth bit of value 32j + 4q + i (low nibble of step q)
// and at bit 4 + q that of value 32j + 16 + 4q + i (high nibble), q = 0..3.
struct tile_q5_k16 {
    fp16_t d[16], dmin[16];
    uint32_t sc[3][16];
    struct { uint8_t qh[64]; uint8_t qs[4][64]; } part[8];  // (qh first: the kernel reads it first)
};
static_assert(sizeof(tile_q5_k16) == 16 * sizeof(block_q5_k), "q5_k tile");

// 16 rows' Q8_0 blocks of two block columns (64 values; 1088 bytes = 16 x 2 x 34): d[h][r], then
// qs[h][q] lane r = values 32h + 4q .. 32h + 4q + 3 of row r (the order the kernel reads them).
struct tile_q8_0x16 { fp16_t d[2][16]; int8_t qs[2][8][64]; };
static_assert(sizeof(tile_q8_0x16) == 32 * sizeof(block_q8_0), "q8_0 tile");

// 16 rows' MXFP4 blocks of one block column (272 bytes = 16 x 17): e[r], then qs[q] lane r = bytes
// 4q .. 4q + 3 of row r's block (values 4q + i in the low nibbles, 16 + 4q + i in the high ones).
struct tile_mxfp4x16 { uint8_t e[16]; uint8_t qs[4][64]; };
static_assert(sizeof(tile_mxfp4x16) == 16 * sizeof(block_mxfp4), "mxfp4 tile");

// 16 rows' IQ4_XS blocks of one block column (2176 bytes = 16 x 136): d, scales_h and scales_l of
// each row; qs[4j + q] lane r = bytes 16j + 4q .. 16j + 4q + 3 of row r's qs (a byte holds values
// 32j + x and 32j + 16 + x, x = 4q + i: already the pairing the other tiles use).
struct tile_iq4_xs16 { fp16_t d[16]; uint16_t sh[16]; uint32_t sl[16]; uint8_t qs[32][64]; };
static_assert(sizeof(tile_iq4_xs16) == 16 * sizeof(block_iq4_xs), "iq4_xs tile");

// Activations, quantized once per call: per 32 values (for q8_0/q4_0 weights) or per 256 with
// sums of each 16 (for the k-quants and iq4_xs, whose mins/offsets need them).
struct act_q8_0 { float d; int8_t qs[QK]; };
struct act_q8_0s { float d; int32_t sum; int8_t qs[QK]; };  // Q8_0 with the sum of its 32 values
struct act_q8_k { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; };

// ggml type ids (the subset computed on directly).
enum GGMLType : int { F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_XS = 23, BF16 = 30, MXFP4 = 39 };

#if defined(__F16C__)
inline float fp16_to_f32(fp16_t h) { return _cvtsh_ss(h); }
#else
inline float fp16_to_f32(fp16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
#endif

inline float bf16_to_f32(bf16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline bf16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (bf16_t)((bits >> 16) | 64);
    return (bf16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

}  // namespace kt
