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

// A kernel's rows as bf16 (uint16_t bits) or float32: to float32 and back, rounded as torch's casts round.
namespace elem {

inline float to_float(uint16_t h) { return bf16::widen(h); }
inline float to_float(float f) { return f; }

template <typename Elem>
Elem from_float(float f);
template <>
inline uint16_t from_float<uint16_t>(float f) { return bf16::round(f); }
template <>
inline float from_float<float>(float f) { return f; }

template <typename Elem>
float rounded(float f) { return to_float(from_float<Elem>(f)); }

}  // namespace elem
