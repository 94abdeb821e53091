// CUDA XLA FFI handlers for the cgx_jax codec: quantize, dequantize, reduce_requantize.
//
// The same three targets as cpu/cpu_kernels.cc, launched on XLA's CUDA stream, producing
// the same bytes for the same inputs and seeds (docs/design.md sections 2 and 3). Every
// operation that decides a byte comes from codec.h; this file only decides which thread
// touches which bucket, and how buckets' minima and maxima are reduced. A parallel
// reduction finds the same extremes as the CPU's scan (min and max are exact, and
// make_scale stores a zero extreme as +0.0f), and every f32 output goes through
// canonical_nan, since NaN payloads differ between x86 and CUDA arithmetic.
//
// Work layout: a "team" of TEAM threads owns one bucket at a time (8 or 32 lanes of a warp
// for small buckets, the whole 256-thread block for large ones), and teams stride over all
// buckets of the call so a large input fills every SM. Within a bucket a thread handles
// groups of 8 consecutive values, the unit that packs into `bits` whole bytes. A bucket is
// read twice: pass 1 finds min, max and whether anything is non-finite (per-thread, then
// warp shuffles, then shared memory for block teams); pass 2 encodes. The second read of a
// small bucket hits L1/L2.
//
// Runtime operands (seeds, own_index) stay in device memory and are read inside the
// kernels, so a handler never synchronizes with the stream and is safe to capture into a
// CUDA graph (command buffer).
#include <cuda_runtime.h>
// nanobind_add_module puts nanobind's headers on a plain -I path, where nvcc's front end
// warns about a loop in nb_func.h ("pointless comparison of unsigned integer with zero").
#pragma nv_diag_suppress 186
#include <nanobind/nanobind.h>
#pragma nv_diag_default 186

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "codec.h"
#include "module.h"
#include "validate.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace cgx {
namespace {

constexpr int kThreads = 256;  // threads per block for every kernel
constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// reduce_requantize keeps a bucket's sums in shared memory between its two passes, up to
// this many per block (32 KiB, below the 48 KiB that needs no opt-in). Larger buckets are
// summed twice instead (see reduce_requantize_kernel).
constexpr int64_t kStagedSumsPerBlock = 8192;

// ---------------------------------------------------------------------------
// Teams: TEAM threads that own one bucket at a time.
// ---------------------------------------------------------------------------

template <int TEAM>
struct Team {
  static_assert(TEAM == 8 || TEAM == 32 || TEAM == kThreads, "unsupported team size");
  static constexpr bool kIsBlock = TEAM > kWarpSize;
  static constexpr int kPerBlock = kThreads / TEAM;

  int rank;       // 0..TEAM-1
  int index;      // which team of the block
  unsigned mask;  // the team's lanes, for the *_sync intrinsics (sub-warp teams)

  __device__ Team()
      : rank(static_cast<int>(threadIdx.x) % TEAM),
        index(static_cast<int>(threadIdx.x) / TEAM),
        mask(lanes_mask()) {}

  __device__ static unsigned lanes_mask() {
    if constexpr (TEAM >= kWarpSize) {
      return kFullMask;
    } else {
      const int first_lane = static_cast<int>(threadIdx.x) % kWarpSize / TEAM * TEAM;
      return ((1u << TEAM) - 1u) << first_lane;
    }
  }

  // Buckets handled by this team: index, index + teams, ... (the same trip count for all
  // threads of a team, so block teams may call __syncthreads inside the loop).
  __device__ int64_t first_bucket() const {
    return static_cast<int64_t>(blockIdx.x) * kPerBlock + index;
  }
  __device__ int64_t bucket_stride() const {
    return static_cast<int64_t>(gridDim.x) * kPerBlock;
  }
};

// Smallest team that keeps every thread busy for buckets of `groups` groups of 8.
int team_for(int64_t groups, int64_t max_warp_groups) {
  if (groups <= 32) return 8;
  if (groups <= max_warp_groups) return 32;
  return kThreads;
}

// ---------------------------------------------------------------------------
// A bucket's value range
// ---------------------------------------------------------------------------

// min and max are exact, so any reduction order finds the same value; the sign of a zero
// extreme can depend on order (-0.0f == 0.0f), but make_scale stores either as +0.0f.
// Once a NaN or infinity was seen the bucket gets NaN meta and min/max are never used, so
// fminf's NaN handling does not matter.
struct Range {
  float lo;
  float hi;
  bool nonfinite;

  __device__ static Range empty() {
    return {bits_float(0x7F800000u), bits_float(0xFF800000u), false};  // +inf, -inf
  }

  __device__ void add(float v) {
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
    nonfinite |= !is_finite(v);
  }
};

// Combines the team's per-thread ranges; every thread of the team gets the result.
template <int TEAM>
__device__ Range team_reduce(Range r, const Team<TEAM>& team) {
  if constexpr (!Team<TEAM>::kIsBlock) {
#pragma unroll
    for (int offset = TEAM / 2; offset > 0; offset /= 2) {
      r.lo = fminf(r.lo, __shfl_xor_sync(team.mask, r.lo, offset, TEAM));
      r.hi = fmaxf(r.hi, __shfl_xor_sync(team.mask, r.hi, offset, TEAM));
    }
    r.nonfinite = __any_sync(team.mask, r.nonfinite);
    return r;
  } else {
    __shared__ float warp_lo[kWarpsPerBlock];
    __shared__ float warp_hi[kWarpsPerBlock];
    __shared__ int warp_nonfinite[kWarpsPerBlock];
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      r.lo = fminf(r.lo, __shfl_xor_sync(kFullMask, r.lo, offset));
      r.hi = fmaxf(r.hi, __shfl_xor_sync(kFullMask, r.hi, offset));
    }
    r.nonfinite = __any_sync(kFullMask, r.nonfinite);
    const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
    if (threadIdx.x % kWarpSize == 0) {
      warp_lo[warp] = r.lo;
      warp_hi[warp] = r.hi;
      warp_nonfinite[warp] = r.nonfinite;
    }
    __syncthreads();
    Range out{warp_lo[0], warp_hi[0], warp_nonfinite[0] != 0};
#pragma unroll
    for (int w = 1; w < kWarpsPerBlock; ++w) {
      out.lo = fminf(out.lo, warp_lo[w]);
      out.hi = fmaxf(out.hi, warp_hi[w]);
      out.nonfinite |= warp_nonfinite[w] != 0;
    }
    __syncthreads();  // the arrays are reused by the next bucket
    return out;
  }
}

// ---------------------------------------------------------------------------
// Groups of 8 values: loads, stores, encoding
// ---------------------------------------------------------------------------

// Reads values i..i+7 (i a multiple of 8) as f32. `vectorized` says the buffer start is
// 16-byte aligned, which makes every group start 16-byte aligned too.
template <typename Tag>
__device__ __forceinline__ void load8(const typename Tag::storage* __restrict__ p, int64_t i,
                                      bool vectorized, float (&v)[8]) {
  if constexpr (std::is_same<Tag, F32>::value) {
    if (vectorized) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p + i));
      const float4 b = __ldg(reinterpret_cast<const float4*>(p + i + 4));
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
      v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
      return;
    }
  } else {
    if (vectorized) {
      const uint4 w = __ldg(reinterpret_cast<const uint4*>(p + i));
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      uint16_t h[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // little endian: the lower half is the earlier value
        h[2 * k] = static_cast<uint16_t>(words[k] & 0xFFFFu);
        h[2 * k + 1] = static_cast<uint16_t>(words[k] >> 16);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = load_as_float(h, k, Tag{});
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = load_as_float(p, i + k, Tag{});
}

// Writes values i..i+7 (i a multiple of 8), converted with codec.h.
template <typename Tag>
__device__ __forceinline__ void store8(typename Tag::storage* __restrict__ p, int64_t i,
                                       bool vectorized, const float (&v)[8]) {
  if constexpr (std::is_same<Tag, F32>::value) {
    if (vectorized) {
      *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
      *reinterpret_cast<float4*>(p + i + 4) = make_float4(v[4], v[5], v[6], v[7]);
      return;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) store_from_float(p, i + k, v[k], Tag{});
  } else {
    uint16_t h[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) store_from_float(h, k, v[k], Tag{});
    if (vectorized) {
      uint32_t words[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        words[k] = static_cast<uint32_t>(h[2 * k]) | (static_cast<uint32_t>(h[2 * k + 1]) << 16);
      *reinterpret_cast<uint4*>(p + i) = make_uint4(words[0], words[1], words[2], words[3]);
      return;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) p[i + k] = h[k];
  }
}

// Values i..i+7 of a buffer holding `count` (i + 8 > count: the end of a short last row);
// a missing value reads as p[count - 1], the padding of docs/design.md section 2.
template <typename Tag>
__device__ __forceinline__ void load8_clamped(const typename Tag::storage* __restrict__ p,
                                              int64_t i, int64_t count, float (&v)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = load_as_float(p, i + k < count ? i + k : count - 1, Tag{});
}

// Writes those of values i..i+7 that a buffer holding `count` has.
template <typename Tag>
__device__ __forceinline__ void store8_clamped(typename Tag::storage* __restrict__ p, int64_t i,
                                               int64_t count, const float (&v)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (i + k < count) store_from_float(p, i + k, v[k], Tag{});
}

// Meta of one bucket. Packets promise no alignment; when the caller knows every packet's
// meta is 8-byte aligned one load replaces load_meta's byte reads (same bytes, little endian).
__device__ __forceinline__ void read_meta(const uint8_t* __restrict__ packet, int64_t bucket,
                                          bool aligned, float* min, float* unit) {
  if (aligned) {
    const uint2 m = __ldg(reinterpret_cast<const uint2*>(packet + bucket * kMetaBytesPerBucket));
    *min = bits_float(m.x);
    *unit = bits_float(m.y);
  } else {
    load_meta(packet, bucket, min, unit);
  }
}

struct Noise {
  bool stochastic;
  uint32_t seed0;
  uint32_t seed1;
};

template <bool kStochastic, int TEAM, typename Values, typename Levels>
__device__ void encode_groups_with(Values& values, int64_t groups, const BucketScale& s, int bits,
                                   const Noise& noise, uint32_t counter,
                                   uint8_t* __restrict__ codes, int rank, Levels& on_levels) {
  const uint32_t top = max_level(bits);
  for (int64_t g = rank; g < groups; g += TEAM) {
    float v[8];
    values(g, v);
    const uint32_t first = counter + static_cast<uint32_t>(8 * g);
    uint32_t levels[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float u = kStochastic ? uniform01(noise.seed0, noise.seed1, first + k) : 0.5f;
      levels[k] = encode_level(v[k], s, u, top);
    }
    pack8(levels, bits, codes + g * bits);
    on_levels(g, v, levels);
  }
}

// Encodes groups rank, rank + TEAM, ... of `groups`; `values(g, v)` produces group g, whose
// first element has stochastic counter `counter + 8 g`, and whose bytes go to codes + g*bits;
// then `on_levels(g, v, levels)` sees the group's values and levels (quantize's loss).
// The rounding mode is decided once, outside the loop, so nearest rounding never pays for
// the hash.
template <int TEAM, typename Values, typename Levels>
__device__ void encode_groups(Values values, int64_t groups, const BucketScale& s, int bits,
                              const Noise& noise, uint32_t counter, uint8_t* __restrict__ codes,
                              int rank, Levels on_levels) {
  if (noise.stochastic) {
    encode_groups_with<true, TEAM>(values, groups, s, bits, noise, counter, codes, rank,
                                   on_levels);
  } else {
    encode_groups_with<false, TEAM>(values, groups, s, bits, noise, counter, codes, rank,
                                    on_levels);
  }
}

// What encoding lost of one group, x - decode(level) as the CPU's quantize writes it (the
// dequantize kernel's decode): level 0 with the bucket's NaN meta for a non-finite bucket.
__device__ __forceinline__ void lost8(const float (&v)[8], const uint32_t (&levels)[8],
                                      float min, float unit, float (&residual)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k)
    residual[k] = canonical_nan(sub_rn(v[k], canonical_nan(decode_level(levels[k], min, unit))));
}

// Code bytes of a bucket with a NaN or an infinity are all zero (its meta is NaN).
template <int TEAM>
__device__ void zero_codes(uint8_t* __restrict__ codes, int64_t bytes, int rank) {
  for (int64_t b = rank; b < bytes; b += TEAM) codes[b] = 0;
}

__device__ __forceinline__ Noise read_noise(bool stochastic, const uint32_t* __restrict__ seed) {
  return stochastic ? Noise{true, seed[0], seed[1]} : Noise{false, 0u, 0u};
}

// ---------------------------------------------------------------------------
// quantize: x [rows, n] -> packets [rows, P]; residual (x_count values, or null) -> x - decoded
// ---------------------------------------------------------------------------

template <typename Tag, int TEAM>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const typename Tag::storage* __restrict__ x, int64_t x_count, int64_t rows,
                    int64_t n, int bits, int64_t bucket_size, bool stochastic,
                    const uint32_t* __restrict__ seed, const int32_t* __restrict__ skip_row,
                    uint8_t* __restrict__ out, float* __restrict__ residual, bool x_vectorized,
                    bool residual_vectorized) {
  const Team<TEAM> team;
  const Noise noise = read_noise(stochastic, seed);
  const int64_t skipped = static_cast<int64_t>(*skip_row);  // device scalar: read here
  const int64_t nb = n / bucket_size;
  const int64_t pbytes = packet_bytes(n, bits, bucket_size);
  const int64_t cbytes = code_bytes_per_bucket(bits, bucket_size);
  const int64_t groups = bucket_size / 8;
  for (int64_t i = team.first_bucket(); i < rows * nb; i += team.bucket_stride()) {
    const int64_t row = i / nb, bucket = i % nb;
    const int64_t first = row * n + bucket * bucket_size;  // flat index: the noise counter
    const bool cut = first + bucket_size > x_count;  // the end of a short last row
    // Writes group g's loss (the values residual holds of it).
    auto store_lost = [&](int64_t g, const float(&l)[8]) {
      if (cut) {
        store8_clamped<F32>(residual, first + 8 * g, x_count, l);
      } else {
        store8<F32>(residual, first + 8 * g, residual_vectorized, l);
      }
    };
    if (row == skipped) {  // not encoded: zero meta and codes; nothing lost
      uint8_t* packet = out + row * pbytes;
      if (team.rank == 0) store_meta(packet, bucket, 0.0f, 0.0f);
      zero_codes<TEAM>(packet + nb * kMetaBytesPerBucket + bucket * cbytes, cbytes, team.rank);
      if (residual != nullptr && first < x_count) {
        const float zeros[8] = {};
        for (int64_t g = team.rank; g < groups; g += TEAM) store_lost(g, zeros);
      }
      continue;
    }
    const typename Tag::storage* xb = x + first;
    auto values = [&](int64_t g, float(&v)[8]) {
      if (cut) {
        load8_clamped<Tag>(x, first + 8 * g, x_count, v);
      } else {
        load8<Tag>(xb, 8 * g, x_vectorized, v);
      }
    };

    Range r = Range::empty();
    for (int64_t g = team.rank; g < groups; g += TEAM) {
      float v[8];
      values(g, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) r.add(v[k]);
    }
    r = team_reduce(r, team);
    const bool finite = !r.nonfinite;
    const BucketScale s = make_scale(r.lo, r.hi, finite, bits);
    uint8_t* packet = out + row * pbytes;
    uint8_t* codes = packet + nb * kMetaBytesPerBucket + bucket * cbytes;
    if (team.rank == 0) store_meta(packet, bucket, s.min, s.unit);
    if (!finite) {
      zero_codes<TEAM>(codes, cbytes, team.rank);
      if (residual != nullptr) {
        const uint32_t zero_levels[8] = {};
        for (int64_t g = team.rank; g < groups; g += TEAM) {
          float v[8], l[8];
          values(g, v);
          lost8(v, zero_levels, s.min, s.unit, l);
          store_lost(g, l);
        }
      }
      continue;
    }
    encode_groups<TEAM>(values, groups, s, bits, noise, static_cast<uint32_t>(first), codes,
                        team.rank,
                        [&](int64_t g, const float(&v)[8], const uint32_t(&levels)[8]) {
                          if (residual == nullptr) return;
                          float l[8];
                          lost8(v, levels, s.min, s.unit, l);
                          store_lost(g, l);
                        });
  }
}

// ---------------------------------------------------------------------------
// dequantize: packets [rows, P] -> x' [rows, n]
// ---------------------------------------------------------------------------

template <typename Tag, int TEAM>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ in, int64_t row_bytes, int64_t rows, int64_t n,
                      int bits, int64_t bucket_size, typename Tag::storage* __restrict__ out,
                      int64_t out_count, float scale, bool meta_aligned, bool out_vectorized) {
  const Team<TEAM> team;
  const int64_t nb = n / bucket_size;
  const int64_t cbytes = code_bytes_per_bucket(bits, bucket_size);
  const int64_t groups = bucket_size / 8;
  for (int64_t i = team.first_bucket(); i < rows * nb; i += team.bucket_stride()) {
    const int64_t row = i / nb, bucket = i % nb;
    const uint8_t* packet = in + row * row_bytes;
    const uint8_t* codes = packet + nb * kMetaBytesPerBucket + bucket * cbytes;
    float mn, unit;
    read_meta(packet, bucket, meta_aligned, &mn, &unit);
    const int64_t first = row * n + bucket * bucket_size;
    if (first >= out_count) continue;  // past a short last row
    const bool cut = first + bucket_size > out_count;
    for (int64_t g = team.rank; g < groups; g += TEAM) {
      uint32_t levels[8];
      unpack8(codes + g * bits, bits, levels);
      float v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float decoded = decode_level(levels[k], mn, unit);
        v[k] = canonical_nan(scale == 1.0f ? decoded : mul_rn(decoded, scale));
      }
      if (cut) {
        store8_clamped<Tag>(out, first + 8 * g, out_count, v);
      } else {
        store8<Tag>(out, first + 8 * g, out_vectorized, v);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// reduce_requantize: N peers' packets of one chunk (+ this participant's raw chunk) ->
// f32 sum in peer order 0..N-1, re-encoded once.
// ---------------------------------------------------------------------------

struct ReduceArgs {
  const uint8_t* peers;  // peer p's packet at peers + p * row_bytes
  int64_t row_bytes;
  int64_t num_peers;
  int64_t n;
  const int32_t* own_index;  // device scalar
  int64_t own_row_stride;    // n when own holds all N rows (row own_index is read), else 0
  int64_t own_count;         // values in own (its last row may be short)
  const uint32_t* seed;      // device [2]
  int bits;
  int64_t bucket_size;
  bool stochastic;
  int64_t tile;  // elements of a bucket summed per step; == bucket_size when sums are staged
  uint8_t* packet_out;  // nullptr: not wanted
  float* sum_out;       // nullptr: not wanted
  int64_t sum_count;    // values in sum_out (it may be short)
  float scale;          // sum_out = sum * scale (1 / divisor); the packet encodes the sum
  bool meta_aligned;
  bool own_vectorized;
  bool sum_vectorized;
};

// Shared-memory floats per team for staging a tile of sums. Thread `rank` keeps its groups
// rank, rank + TEAM, ... there, value k of its m-th group at (m*8 + k)*TEAM + rank, so a
// warp's stores and loads hit 32 consecutive words.
CGX_HD int64_t staged_floats(int64_t tile, int team) {
  return (tile / 8 + team - 1) / team * team * 8;
}

template <typename Tag, int TEAM>
__global__ void __launch_bounds__(kThreads)
    reduce_requantize_kernel(ReduceArgs a, const typename Tag::storage* __restrict__ own) {
  extern __shared__ float4 stage_storage[];
  const Team<TEAM> team;
  float* stage = reinterpret_cast<float*>(stage_storage) + team.index * staged_floats(a.tile, TEAM);
  const Noise noise = read_noise(a.stochastic, a.seed);
  // The CUDA handler cannot check own_index on the host without synchronizing with the
  // stream, so it cannot return the CPU handler's InvalidArgument for an index outside
  // [0, num_peers): such an index matches no peer and every peer's packet is decoded.
  // The Python wrappers always pass a valid index.
  const int64_t own_peer = own ? static_cast<int64_t>(*a.own_index) : -1;
  int64_t own_count = a.own_count;  // values from `own` on, once it points at the own row
  if (own_peer >= 0 && own_peer < a.num_peers) {
    own += own_peer * a.own_row_stride;
    own_count -= own_peer * a.own_row_stride;
  }
  const int64_t nb = a.n / a.bucket_size;
  const int64_t cbytes = code_bytes_per_bucket(a.bits, a.bucket_size);
  const bool staged = a.bucket_size <= a.tile;

  for (int64_t bucket = team.first_bucket(); bucket < nb; bucket += team.bucket_stride()) {
    // Sum of values e..e+7 of the chunk over all peers, in peer order, from +0.0f.
    auto sum_group = [&](int64_t e, float(&acc)[8]) {
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = 0.0f;
      for (int64_t peer = 0; peer < a.num_peers; ++peer) {
        float v[8];
        if (peer == own_peer) {
          if (e + 8 <= own_count) {
            load8<Tag>(own, e, a.own_vectorized, v);
          } else {  // the end of a short own row
            load8_clamped<Tag>(own, e, own_count, v);
          }
        } else {
          const uint8_t* packet = a.peers + peer * a.row_bytes;
          float mn, unit;
          read_meta(packet, bucket, a.meta_aligned, &mn, &unit);
          uint32_t levels[8];
          unpack8(packet + nb * kMetaBytesPerBucket + bucket * cbytes +
                      (e - bucket * a.bucket_size) / 8 * a.bits,
                  a.bits, levels);
#pragma unroll
          for (int k = 0; k < 8; ++k) v[k] = decode_level(levels[k], mn, unit);
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] = add_rn(acc[k], v[k]);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = canonical_nan(acc[k]);
    };
    auto stage_index = [&](int64_t g, int k) { return (g - team.rank) * 8 + k * TEAM + team.rank; };

    // Pass 1: sums, written out and/or staged, and their range.
    Range r = Range::empty();
    for (int64_t t0 = 0; t0 < a.bucket_size; t0 += a.tile) {
      const int64_t groups = (a.tile < a.bucket_size - t0 ? a.tile : a.bucket_size - t0) / 8;
      for (int64_t g = team.rank; g < groups; g += TEAM) {
        const int64_t e = bucket * a.bucket_size + t0 + 8 * g;
        float acc[8];
        sum_group(e, acc);
        if (a.sum_out) {
          float out[8];
#pragma unroll
          for (int k = 0; k < 8; ++k)
            out[k] = a.scale == 1.0f ? acc[k] : canonical_nan(mul_rn(acc[k], a.scale));
          if (e + 8 <= a.sum_count) {
            store8<F32>(a.sum_out, e, a.sum_vectorized, out);
          } else {  // a short sum
            store8_clamped<F32>(a.sum_out, e, a.sum_count, out);
          }
        }
        if (a.packet_out) {
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            r.add(acc[k]);
            if (staged) stage[stage_index(g, k)] = acc[k];
          }
        }
      }
    }
    if (!a.packet_out) continue;

    // Pass 2: encode.
    r = team_reduce(r, team);
    const bool finite = !r.nonfinite;
    const BucketScale s = make_scale(r.lo, r.hi, finite, a.bits);
    uint8_t* codes = a.packet_out + nb * kMetaBytesPerBucket + bucket * cbytes;
    if (team.rank == 0) store_meta(a.packet_out, bucket, s.min, s.unit);
    if (!finite) {
      zero_codes<TEAM>(codes, cbytes, team.rank);
      continue;
    }
    for (int64_t t0 = 0; t0 < a.bucket_size; t0 += a.tile) {
      const int64_t groups = (a.tile < a.bucket_size - t0 ? a.tile : a.bucket_size - t0) / 8;
      // Each thread reads back only the groups it staged itself, so no barrier is needed;
      // unstaged (very large) buckets recompute the identical sums instead.
      auto values = [&](int64_t g, float(&v)[8]) {
        if (staged) {
#pragma unroll
          for (int k = 0; k < 8; ++k) v[k] = stage[stage_index(g, k)];
        } else {
          sum_group(bucket * a.bucket_size + t0 + 8 * g, v);
        }
      };
      encode_groups<TEAM>(values, groups, s, a.bits, noise,
                          static_cast<uint32_t>(bucket * a.bucket_size + t0),
                          codes + t0 / 8 * a.bits, team.rank,
                          [](int64_t, const float(&)[8], const uint32_t(&)[8]) {});
    }
  }
}

// ---------------------------------------------------------------------------
// Host side: launch configuration and dispatch
// ---------------------------------------------------------------------------

bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Calls f(std::integral_constant<int, TEAM>) for a team size chosen by team_for.
template <typename F>
void with_team(int team, F&& f) {
  switch (team) {
    case 8:
      f(std::integral_constant<int, 8>{});
      break;
    case 32:
      f(std::integral_constant<int, 32>{});
      break;
    default:
      f(std::integral_constant<int, kThreads>{});
      break;
  }
}

// Calls f(Tag{}) for a floating element type; false for any other type.
template <typename F>
bool with_float_type(ffi::DataType type, F&& f) {
  switch (type) {
    case ffi::F32:
      f(F32{});
      return true;
    case ffi::BF16:
      f(BF16{});
      return true;
    case ffi::F16:
      f(F16{});
      return true;
    default:
      return false;
  }
}

// Enough blocks to cover `buckets` with `team`-thread teams, at most about a full device
// of resident blocks (the kernels stride over the rest).
ffi::Error grid_for(int64_t buckets, int team, int* blocks) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("cgx: cannot query the CUDA device: ") +
                                cudaGetErrorString(err));
  const int64_t per_block = kThreads / team;
  const int64_t wanted = (buckets + per_block - 1) / per_block;
  const int64_t resident = static_cast<int64_t>(std::max(sms, 1)) * (2048 / kThreads);
  *blocks = static_cast<int>(std::max<int64_t>(1, std::min(wanted, resident)));
  return ffi::Error::Success();
}

ffi::Error launch_status(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("cgx: launching ") + kernel + " failed: " +
                                cudaGetErrorString(err));
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Handlers (validation identical to the CPU handlers)
// ---------------------------------------------------------------------------

// Both quantize targets; residual is null for cgx_quantize.
ffi::Error QuantizeInto(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                        ffi::Buffer<ffi::S32> skip_row, ffi::ResultBuffer<ffi::U8> packets,
                        float* residual, std::optional<int64_t> residual_count, int64_t bits,
                        int64_t bucket_size, bool stochastic, int64_t n) {
  int64_t rows = 0;
  if (auto e = check_quantize_args(bits, bucket_size, n, x.element_count(),
                                   seed.element_count(), skip_row.element_count(),
                                   packets->dimensions(), residual_count, &rows);
      e.failure())
    return e;
  if (rows * n == 0) return ffi::Error::Success();

  const int team = team_for(bucket_size / 8, 1024);
  int blocks = 0;
  if (auto e = grid_for(rows * (n / bucket_size), team, &blocks); e.failure()) return e;
  const void* data = x.untyped_data();
  const bool supported = with_float_type(x.element_type(), [&](auto tag) {
    using Tag = decltype(tag);
    with_team(team, [&](auto team_size) {
      quantize_kernel<Tag, decltype(team_size)::value><<<blocks, kThreads, 0, stream>>>(
          static_cast<const typename Tag::storage*>(data), x.element_count(), rows, n,
          static_cast<int>(bits),
          bucket_size, stochastic, seed.typed_data(), skip_row.typed_data(),
          packets->typed_data(), residual, aligned_to(data, 16), aligned_to(residual, 16));
    });
  });
  if (!supported) return unsupported_dtype("x");
  return launch_status("quantize");
}

ffi::Error Dequantize(cudaStream_t stream, ffi::Buffer<ffi::U8> packets,
                      ffi::Result<ffi::AnyBuffer> x, int64_t bits, int64_t bucket_size,
                      int64_t offset, int64_t n, int64_t divisor) {
  int64_t rows = 0, row_bytes = 0;
  if (auto e = check_dequantize_args(bits, bucket_size, n, offset, divisor, x->element_count(),
                                     packets.dimensions(), &rows, &row_bytes);
      e.failure())
    return e;
  if (rows * n == 0) return ffi::Error::Success();

  const int team = team_for(bucket_size / 8, 1024);
  int blocks = 0;
  if (auto e = grid_for(rows * (n / bucket_size), team, &blocks); e.failure()) return e;
  const uint8_t* in = packets.typed_data() + offset;
  const bool meta_aligned = aligned_to(in, 8) && (rows == 1 || row_bytes % 8 == 0);
  void* data = x->untyped_data();
  const bool supported = with_float_type(x->element_type(), [&](auto tag) {
    using Tag = decltype(tag);
    with_team(team, [&](auto team_size) {
      dequantize_kernel<Tag, decltype(team_size)::value><<<blocks, kThreads, 0, stream>>>(
          in, row_bytes, rows, n, static_cast<int>(bits), bucket_size,
          static_cast<typename Tag::storage*>(data), x->element_count(),
          reciprocal_of(divisor), meta_aligned, aligned_to(data, 16));
    });
  });
  if (!supported) return unsupported_dtype("output");
  return launch_status("dequantize");
}

// The three reduce targets, writing what `out` says; `seed` is null for the sum alone.
ffi::Error ReduceInto(cudaStream_t stream, ffi::Buffer<ffi::U8> peers, ffi::AnyBuffer own,
                      ffi::Buffer<ffi::S32> own_index, const ffi::Buffer<ffi::U32>* seed,
                      const ReduceOutputs& out, int64_t bits, int64_t bucket_size,
                      bool stochastic, int64_t n, int64_t offset, int64_t divisor) {
  int64_t num_peers = 0, row_bytes = 0;
  const std::optional<int64_t> seed_count =
      seed ? std::optional<int64_t>(seed->element_count()) : std::nullopt;
  if (auto e = check_reduce_args(bits, bucket_size, n, offset, divisor, peers.dimensions(),
                                 seed_count, own_index.element_count(), own.element_count(),
                                 out, &num_peers, &row_bytes);
      e.failure())
    return e;
  // own_index lives in device memory and is not range-checked here, unlike on the CPU:
  // reading it would synchronize with the stream (see reduce_requantize_kernel).
  if (n == 0) return ffi::Error::Success();

  // Buckets of up to 128 groups fit one warp's staging; larger ones take the whole block,
  // staged up to kStagedSumsPerBlock values.
  const int team = team_for(bucket_size / 8, 128);
  const int64_t tile = team == kThreads ? std::min(bucket_size, kStagedSumsPerBlock) : bucket_size;
  int blocks = 0;
  if (auto e = grid_for(n / bucket_size, team, &blocks); e.failure()) return e;
  const bool staged = tile == bucket_size;
  const size_t shared_bytes =
      staged ? static_cast<size_t>(kThreads / team * staged_floats(tile, team)) * sizeof(float)
             : 0;

  const void* own_data = own.element_count() ? own.untyped_data() : nullptr;
  const uint8_t* peer_packets = peers.typed_data() + offset;
  const ReduceArgs args{peer_packets,
                        row_bytes,
                        num_peers,
                        n,
                        own_index.typed_data(),
                        own.element_count() > n ? n : 0,
                        own.element_count(),
                        seed ? seed->typed_data() : nullptr,
                        static_cast<int>(bits),
                        bucket_size,
                        stochastic,
                        tile,
                        out.packet,
                        out.sum,
                        out.sum_count,
                        reciprocal_of(divisor),
                        aligned_to(peer_packets, 8) && (num_peers <= 1 || row_bytes % 8 == 0),
                        aligned_to(own_data, 16),
                        aligned_to(out.sum, 16)};
  const bool supported = with_float_type(own.element_type(), [&](auto tag) {
    using Tag = decltype(tag);
    with_team(team, [&](auto team_size) {
      reduce_requantize_kernel<Tag, decltype(team_size)::value>
          <<<blocks, kThreads, shared_bytes, stream>>>(
              args, static_cast<const typename Tag::storage*>(own_data));
    });
  });
  if (!supported) return unsupported_dtype("own");
  return launch_status("reduce_requantize");
}

}  // namespace

using Stream = ffi::PlatformStream<cudaStream_t>;
using Cuda = TargetHandlers<cudaStream_t, &QuantizeInto, &ReduceInto>;
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_quantize_cuda, Cuda::Quantize, quantize_binding<Stream>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_quantize_with_residual_cuda, Cuda::QuantizeWithResidual,
                              quantize_with_residual_binding<Stream>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_dequantize_cuda, Dequantize, dequantize_binding<Stream>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_reduce_requantize_cuda, Cuda::ReduceRequantize,
                              reduce_requantize_binding<Stream>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_reduce_requantize_with_sum_cuda, Cuda::ReduceRequantizeWithSum,
                              reduce_requantize_with_sum_binding<Stream>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_reduce_sum_cuda, Cuda::ReduceSum, reduce_sum_binding<Stream>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace cgx

NB_MODULE(_cgx_cuda, m) {
  cgx::define_common(m);
  // The CUDA runtime is linked statically (CMakeLists.txt), so this module runs on any driver
  // of its CUDA major or newer, whatever JAX's own runtime is; cgx_jax._src.backends.ffi compares
  // these numbers with the driver and JAX's CUDA plugin before registering the targets.
  m.def("cuda_versions", []() {
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
    return std::make_pair(static_cast<int>(CUDART_VERSION), driver);
  }, "(runtime, driver): the CUDA runtime this module was built with and the installed "
     "driver's CUDA version (1000 * major + 10 * minor; driver 0 when none is installed).");
  m.def("registrations", []() {
    return cgx::registrations({cgx::cgx_quantize_cuda, cgx::cgx_quantize_with_residual_cuda,
                               cgx::cgx_dequantize_cuda, cgx::cgx_reduce_requantize_cuda,
                               cgx::cgx_reduce_requantize_with_sum_cuda, cgx::cgx_reduce_sum_cuda});
  });
}
