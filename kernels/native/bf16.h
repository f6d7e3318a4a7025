// bfloat16 <-> float32 for the CPU kernels: bf16 is the top half of a float32.
#pragma once
#include <cstdint>
#include <cstring>

namespace bf16 {

inline float widen(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t round(float f) {   // to nearest, ties to even (finite values)
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace bf16
