// cgx_jax wire format and rounding arithmetic, shared by the CPU and CUDA kernels.
//
// Everything that decides a byte of a packet lives here, written once, so the two
// platforms cannot drift apart (docs/design.md section 2):
//   packet = [ meta: nb x (min f32, unit f32) ][ codes: nb x (B*b/8) bytes ]
//   unit   = max/(2^b-1) - min/(2^b-1)
//   level  = min(floor((x - min) * inv + u), 2^b - 1),  inv = 1/unit (0 when unit == 0)
//   x'     = min + level * unit
// Every float operation is a separately rounded IEEE f32 operation: the CPU build uses
// -ffp-contract=off and the CUDA build uses the explicit _rn intrinsics below, so neither
// compiler may fuse a multiply and an add.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CGX_HD __host__ __device__ __forceinline__
#else
#define CGX_HD inline
#endif

namespace cgx {

constexpr int kMinBits = 1;
constexpr int kMaxBits = 8;
constexpr int64_t kMetaBytesPerBucket = 8;  // min and unit, two little-endian f32

// ---------------------------------------------------------------------------
// Sizes
// ---------------------------------------------------------------------------

CGX_HD int64_t code_bytes_per_bucket(int bits, int64_t bucket_size) {
  return bucket_size * bits / 8;
}

// Bytes of one packet that encodes `n` elements (n a multiple of bucket_size).
CGX_HD int64_t packet_bytes(int64_t n, int bits, int64_t bucket_size) {
  const int64_t nb = n / bucket_size;
  return nb * (kMetaBytesPerBucket + code_bytes_per_bucket(bits, bucket_size));
}

// ---------------------------------------------------------------------------
// Exactly rounded f32 arithmetic (no contraction on either platform)
// ---------------------------------------------------------------------------

CGX_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

CGX_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

CGX_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

CGX_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

CGX_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

CGX_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

CGX_HD bool is_finite(float f) { return (float_bits(f) & 0x7F800000u) != 0x7F800000u; }

constexpr uint32_t kQuietNaNBits = 0x7FC00000u;
constexpr float kMaxFloat = 3.40282346638528859812e+38f;

// ---------------------------------------------------------------------------
// 16-bit floats, converted with integer code so both platforms round the same way
// (round to nearest even; NaN becomes the canonical quiet NaN of the target type).
// ---------------------------------------------------------------------------

CGX_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

CGX_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x7FC0u);
  const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

CGX_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24 is exact in f32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

CGX_HD uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to infinity
  if (a < 0x38800000u) {                         // below 2^-14: subnormal half or zero
    if (a < 0x33000000u) return sign;            // <= 2^-25 rounds to zero
    const uint32_t mantissa = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - (a >> 23);     // 14..24
    uint32_t r = mantissa >> shift;
    const uint32_t rem = mantissa & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  const uint32_t rebased = a - (112u << 23);
  uint32_t r = rebased >> 13;
  const uint32_t rem = rebased & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return sign | static_cast<uint16_t>(r);
}

// Element types the kernels read and write, as tags for templates.
struct F32 { using storage = float; };
struct BF16 { using storage = uint16_t; };
struct F16 { using storage = uint16_t; };

CGX_HD float load_as_float(const float* p, int64_t i, F32) { return p[i]; }
CGX_HD float load_as_float(const uint16_t* p, int64_t i, BF16) { return bf16_to_float(p[i]); }
CGX_HD float load_as_float(const uint16_t* p, int64_t i, F16) { return f16_to_float(p[i]); }
CGX_HD void store_from_float(float* p, int64_t i, float v, F32) { p[i] = v; }
CGX_HD void store_from_float(uint16_t* p, int64_t i, float v, BF16) { p[i] = float_to_bf16(v); }
CGX_HD void store_from_float(uint16_t* p, int64_t i, float v, F16) { p[i] = float_to_f16(v); }

// ---------------------------------------------------------------------------
// Counter-based randomness for stochastic rounding: 32-bit integer operations only,
// so the jnp backend reproduces it exactly.
// ---------------------------------------------------------------------------

// The "lowbias32" integer mixer (public-domain constants by C. Wellons). The CPU's SSE2 lanes
// (cpu/bucket_loops_sse2.inc) compute the same steps with these constants.
constexpr uint32_t kMixFactor1 = 0x7FEB352Du;
constexpr uint32_t kMixFactor2 = 0x846CA68Bu;
constexpr float kUniformUnit = 5.9604644775390625e-8f;  // 2^-24: 24 random bits -> [0, 1)

CGX_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMixFactor1;
  x ^= x >> 15;
  x *= kMixFactor2;
  x ^= x >> 16;
  return x;
}

// Uniform in [0, 1) with 24 random bits: exact in f32, never reaches 1. One mixer round per
// element: (counter ^ seed0) + seed1 is a bijection of the counter for each seed, so the
// elements of a call get distinct mixer inputs, and the mixer's avalanche decorrelates
// neighbours. (A second round cost a quarter of a 4-bit quantize on CPU.)
CGX_HD float uniform01(uint32_t seed0, uint32_t seed1, uint32_t counter) {
  const uint32_t h = mix32((counter ^ seed0) + seed1);
  return static_cast<float>(static_cast<int32_t>(h >> 8)) * kUniformUnit;
}

// ---------------------------------------------------------------------------
// One bucket's scale and the per-element rounding
// ---------------------------------------------------------------------------

struct BucketScale {
  float min;
  float unit;
  float inv;  // 1/unit, 0 when unit is 0 (constant bucket: every level is 0, decodes exactly)
};

CGX_HD uint32_t max_level(int bits) { return (1u << bits) - 1u; }

// `finite` is false when the bucket held a NaN or an infinity: such a bucket's min and
// unit are NaN so it decodes to NaN and bad values stay visible downstream.
CGX_HD BucketScale make_scale(float mn, float mx, bool finite, int bits) {
  BucketScale s;
  if (!finite) {
    s.min = s.unit = bits_float(kQuietNaNBits);
    s.inv = 0.0f;
    return s;
  }
  const float levels = static_cast<float>(max_level(bits));
  // -0 and +0 compare equal, so which one a scan finds depends on its order; store +0 so
  // every implementation writes the same meta bytes.
  if (mn == 0.0f) mn = 0.0f;
  if (mx == 0.0f) mx = 0.0f;
  // Dividing each end first keeps the difference finite for bits >= 2; at 1 bit a range
  // wider than the largest float saturates to it, so finite input never yields inf.
  s.min = mn;
  s.unit = sub_rn(div_rn(mx, levels), div_rn(mn, levels));
  if (!is_finite(s.unit)) s.unit = kMaxFloat;
  s.inv = s.unit > 0.0f ? div_rn(1.0f, s.unit) : 0.0f;
  return s;
}

// t clamped to [0, top], for a float or a vector of floats (the CPU's SSE2 lanes). A NaN t
// (0 * inf when the unit is a tiny subnormal) gives 0: `t > 0` is false for NaN. Written as
// two selects (max, then min) so the CPU loops vectorize into plain max/min instructions.
template <typename F>
CGX_HD F clamp_level(F t, F top) {
  t = t > F{} ? t : F{};
  return t < top ? t : top;
}

// floor(t) clamped to [0, top] (the truncation is the floor of the clamped, non-negative t).
CGX_HD uint32_t level_of(float t, uint32_t top) {
  return static_cast<uint32_t>(static_cast<int32_t>(clamp_level(t, static_cast<float>(top))));
}

// (x - min) * inv for a bucket whose range max - min is finite (then x - min is too).
CGX_HD float scaled_offset_in_range(float x, const BucketScale& s) {
  return mul_rn(sub_rn(x, s.min), s.inv);
}

// level = min(floor((x - min) * inv + u), top). In a bucket wider than the largest float,
// x - min overflows; then it is taken at half scale (exact for such magnitudes) and the
// scaled offset doubled.
CGX_HD uint32_t encode_level(float x, const BucketScale& s, float u, uint32_t top) {
  float offset;
  if (is_finite(sub_rn(x, s.min))) {
    offset = scaled_offset_in_range(x, s);
  } else {
    offset = mul_rn(mul_rn(sub_rn(mul_rn(x, 0.5f), mul_rn(s.min, 0.5f)), s.inv), 2.0f);
  }
  return level_of(add_rn(offset, u), top);
}

// min + level * unit for a bucket where that cannot overflow (see decode_level).
CGX_HD float decode_level_in_range(uint32_t level, float min, float unit) {
  return add_rn(min, mul_rn(static_cast<float>(level), unit));
}

// x' = min + level * unit. When the bucket spans more than the largest float (say
// -3e38..3e38) the product overflows although x' does not; then the same sum is taken at
// half scale (exact for such large magnitudes) and doubled. A finite bucket never decodes
// to infinity: rounding past the largest float saturates to it.
CGX_HD float decode_level(uint32_t level, float min, float unit) {
  if (!is_finite(unit)) return bits_float(kQuietNaNBits);
  const float offset = mul_rn(static_cast<float>(level), unit);
  float x;
  if (is_finite(offset)) {
    x = decode_level_in_range(level, min, unit);
  } else {
    const float half =
        add_rn(mul_rn(min, 0.5f), mul_rn(static_cast<float>(level), mul_rn(unit, 0.5f)));
    x = mul_rn(half, 2.0f);
  }
  if (!is_finite(x) && x == x) x = x > 0.0f ? kMaxFloat : -kMaxFloat;
  return x;
}

// NaN payloads differ between CPUs and GPUs (and with operand order); outputs that may hold
// a NaN are written with the one canonical quiet NaN so all implementations agree.
CGX_HD float canonical_nan(float v) {
  return (float_bits(v) & 0x7FFFFFFFu) > 0x7F800000u ? bits_float(kQuietNaNBits) : v;
}

// ---------------------------------------------------------------------------
// Bit packing: 8 levels of `bits` bits -> `bits` bytes, LSB first.
// ---------------------------------------------------------------------------

CGX_HD void pack8(const uint32_t* levels, int bits, uint8_t* out) {
  uint64_t word = 0;
  for (int k = 0; k < 8; ++k) word |= static_cast<uint64_t>(levels[k]) << (k * bits);
  for (int byte = 0; byte < bits; ++byte) out[byte] = static_cast<uint8_t>(word >> (8 * byte));
}

CGX_HD void unpack8(const uint8_t* in, int bits, uint32_t* levels) {
  uint64_t word = 0;
  for (int byte = 0; byte < bits; ++byte) word |= static_cast<uint64_t>(in[byte]) << (8 * byte);
  const uint64_t mask = (uint64_t{1} << bits) - 1u;
  for (int k = 0; k < 8; ++k) levels[k] = static_cast<uint32_t>((word >> (k * bits)) & mask);
}

// Meta of bucket `bucket` in a packet; read/written bytewise (packets are uint8 buffers
// with no alignment promise).
CGX_HD void store_meta(uint8_t* packet, int64_t bucket, float min, float unit) {
  memcpy(packet + bucket * kMetaBytesPerBucket, &min, 4);
  memcpy(packet + bucket * kMetaBytesPerBucket + 4, &unit, 4);
}

CGX_HD void load_meta(const uint8_t* packet, int64_t bucket, float* min, float* unit) {
  memcpy(min, packet + bucket * kMetaBytesPerBucket, 4);
  memcpy(unit, packet + bucket * kMetaBytesPerBucket + 4, 4);
}

}  // namespace cgx
