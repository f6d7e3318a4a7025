// What the C++ kernels share over GCC/Clang vector types of any width: broadcasts, loads and stores,
// exp by range reduction, and the name of the instruction set a build targets.
#pragma once
#include <cstdint>
#include <cstring>

namespace simd {

template <typename V>
constexpr int lanes() {
    return (int)(sizeof(V) / sizeof(float));
}

// A broadcast (V{} + x would add +0.0 first, and -0.0 + 0.0 is +0.0).
template <typename V>
inline V splat(float x) {
    V v;
    for (int i = 0; i < lanes<V>(); ++i) v[i] = x;
    return v;
}

template <typename V>
inline V load(const void *p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

template <typename V>
inline void store(float *p, V v) {
    std::memcpy(p, &v, sizeof v);
}

// exp(x) = 2^n exp(r) with nf = n a whole number near x log2 e and r = x - n ln 2 (|r| <= ln 2 / 2): exp(r) by its
// Taylor series to r^7 (relative error ~2e-7), 2^n put into the exponent bits (n must keep it a normal number).
template <typename VF, typename VI>
inline VF exp_reduced(VF x, VF nf) {
    const VF r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;   // ln 2 in two parts
    VF p = splat<VF>(1.0f / 5040.0f);
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return (VF)((VI)p + (__builtin_convertvector(nf, VI) << 23));
}

// The vector instructions the build targets.
inline const char *isa_name() {
#if defined(__AVX512F__)
    return "AVX-512";
#elif defined(__AVX2__)
    return "AVX2";
#elif defined(__ARM_NEON)
    return "NEON";
#else
    return "no wide vectors";
#endif
}

}  // namespace simd
