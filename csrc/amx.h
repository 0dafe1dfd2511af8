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

}  // namespace kt
#endif
