// AMX tile setup shared by the int8 and int4 prefill kernels (AMX builds only).
#pragma once
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <immintrin.h>

#include <cstdint>

namespace kt {

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// All 8 tiles 16 rows x 64 bytes (C is 16 x 16 int32, A and B 16 x 64 bytes), once a thread.
inline void configure_tiles() {
    thread_local bool configured = false;
    if (configured) return;
    TileConfig c;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
    configured = true;
}

// The int8 GEMMs' 2x2 step on tiles 0-7: C tile 2 rb + tt (0-3) += A tile 4 + tt (16 activation
// rows from `a`, row stride `stride`, the second 16 rows below) x B tile 6 + rb (the weight block
// of 16 x 64 bytes at b0, and at b1 for RB 2), so up to four accumulations are in flight (each
// tdpbusd waits for the last one into its C) and each weight tile loaded serves both token groups.
template <int RB, int TT>
inline void tiles_zero() {
    _tile_zero(0);
    if (TT > 1) _tile_zero(1);
    if (RB > 1) _tile_zero(2);
    if (RB > 1 && TT > 1) _tile_zero(3);
}

template <int RB, int TT>
inline void tiles_step(const void* b0, const void* b1, const uint8_t* a, size_t stride) {
    _tile_loadd(6, b0, 64);
    if (RB > 1) _tile_loadd(7, b1, 64);
    _tile_loadd(4, a, stride);
    if (TT > 1) _tile_loadd(5, a + 16 * stride, stride);
    _tile_dpbusd(0, 4, 6);
    if (TT > 1) _tile_dpbusd(1, 5, 6);
    if (RB > 1) _tile_dpbusd(2, 4, 7);
    if (RB > 1 && TT > 1) _tile_dpbusd(3, 5, 7);
}

template <int RB, int TT>
inline void tiles_store(int32_t c[2][2][16][16]) {  // c[rb][tt] = C tile 2 rb + tt
    _tile_stored(0, c[0][0], 64);
    if (TT > 1) _tile_stored(1, c[0][1], 64);
    if (RB > 1) _tile_stored(2, c[1][0], 64);
    if (RB > 1 && TT > 1) _tile_stored(3, c[1][1], 64);
}

}  // namespace kt
#endif
