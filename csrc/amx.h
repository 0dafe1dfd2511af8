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

// The 2 x 2 accumulators of the tile kernels' steps (int8, int4, bf16): C tile 2 i + j holds
// block (i, j), i < RB blocks of 16 weight rows and j < TT blocks of 16 tokens, stored to c[i][j].
template <int RB, int TT>
inline void zero_accumulators() {
    _tile_zero(0);
    if (TT > 1) _tile_zero(1);
    if (RB > 1) _tile_zero(2);
    if (RB > 1 && TT > 1) _tile_zero(3);
}
template <int RB, int TT, typename T>
inline void store_accumulators(T c[2][2][16][16]) {
    _tile_stored(0, c[0][0], 64);
    if (TT > 1) _tile_stored(1, c[0][1], 64);
    if (RB > 1) _tile_stored(2, c[1][0], 64);
    if (RB > 1 && TT > 1) _tile_stored(3, c[1][1], 64);
}

}  // namespace kt
#endif
