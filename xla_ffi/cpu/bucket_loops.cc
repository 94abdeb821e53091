// Bucket loops of the CPU kernels (see bucket_loops.h). This file is compiled several
// times with CGX_ISA set to the namespace of one instruction set and the matching -m flags;
// the loops are written in groups of eight values so the compiler vectorizes them.
#include "bucket_loops.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

#if defined(__SSE2__) && !defined(__AVX2__)
#include <emmintrin.h>
#endif

#include "codec.h"

#ifndef CGX_ISA
#error "compile with -DCGX_ISA=isa_generic|isa_avx2|isa_avx512"
#endif

namespace cgx {
namespace CGX_ISA {
namespace {

// One native vector of floats (GCC/Clang vector extensions), written out because compilers
// do not vectorize a float min/max reduction on their own: eight lanes in the AVX2 and
// AVX-512 variants, four in the generic one (SSE2 on x86-64, NEON on aarch64), whose
// registers are 16 bytes wide; a wider type there would be split and spilled to the stack
// on every iteration. Buckets hold a multiple of 8 values, so of kLanes too.
#if defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float Floats __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));
typedef int32_t Ints __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef uint32_t Uints __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef uint16_t Halves __attribute__((vector_size(2 * kLanes), aligned(2), may_alias));

template <typename Tag>
Floats load_floats(const typename Tag::storage* x, int64_t j) {
  Floats v;
  for (int k = 0; k < kLanes; ++k) v[k] = load_as_float(x, j + k, Tag{});
  return v;
}

// An unaligned vector load (the type is only 4-byte aligned and may alias floats).
template <>
Floats load_floats<F32>(const float* x, int64_t j) {
  return *reinterpret_cast<const Floats*>(x + j);
}

// bf16 is the top half of an f32: widen and shift, lane by lane in one vector.
template <>
Floats load_floats<BF16>(const uint16_t* x, int64_t j) {
  const Uints wide = __builtin_convertvector(*reinterpret_cast<const Halves*>(x + j), Uints) << 16;
  return reinterpret_cast<const Floats&>(wide);
}

// Asks for the cache line holding x[j + size], the same place in the next bucket, once per
// 64-byte line of x[j]. The first pass over a bucket streams it from memory and the
// arithmetic between passes leaves the memory bus idle; fetching one bucket ahead overlaps
// the two (docs/performance.md, section "Kernels", has the measurement). A
// prefetch never faults, so the line past the last bucket costs nothing but the request.
template <typename T>
void prefetch_next_bucket(const T* x, int64_t j, int64_t size) {
  if ((j * sizeof(T)) % 64 == 0) __builtin_prefetch(x + j + size, 0, 0);
}

// Min, max and finiteness of one bucket. The min and max of finite values do not depend on
// the order they are taken in (make_scale stores a zero extreme as +0), and a bucket with a
// NaN or an infinity is marked non-finite whatever its min and max.
template <typename Tag, bool kPrefetchNext = false>
void bucket_range(const typename Tag::storage* x, int64_t size, float* mn_out, float* mx_out,
                  bool* finite_out) {
  // Four sets of accumulators, so the min/max latency chains of consecutive vectors
  // overlap (with one set the loop ran at the latency of minps, not its throughput).
  constexpr int kChains = 4;
  const Ints exponent = Ints{} + 0x7F800000;
  Floats lo[kChains], hi[kChains];
  Ints nonfinite = {};
  for (int c = 0; c < kChains; ++c) lo[c] = hi[c] = load_floats<Tag>(x, 0);
  int64_t j = 0;
  for (; j + kChains * kLanes <= size; j += kChains * kLanes) {
    for (int c = 0; c < kChains; ++c) {
      if (kPrefetchNext) prefetch_next_bucket(x, j + c * kLanes, size);
      const Floats v = load_floats<Tag>(x, j + c * kLanes);
      lo[c] = v < lo[c] ? v : lo[c];
      hi[c] = v > hi[c] ? v : hi[c];
      nonfinite |= (reinterpret_cast<const Ints&>(v) & exponent) == exponent;
    }
  }
  for (; j < size; j += kLanes) {  // the last vectors of a bucket of 8, 16 or 24 values
    const Floats v = load_floats<Tag>(x, j);
    lo[0] = v < lo[0] ? v : lo[0];
    hi[0] = v > hi[0] ? v : hi[0];
    nonfinite |= (reinterpret_cast<const Ints&>(v) & exponent) == exponent;
  }
  for (int c = 1; c < kChains; ++c) {
    lo[0] = lo[c] < lo[0] ? lo[c] : lo[0];
    hi[0] = hi[c] > hi[0] ? hi[c] : hi[0];
  }
  float mn = lo[0][0], mx = hi[0][0];
  int32_t bad = nonfinite[0];
  for (int k = 1; k < kLanes; ++k) {
    mn = lo[0][k] < mn ? lo[0][k] : mn;
    mx = hi[0][k] > mx ? hi[0][k] : mx;
    bad |= nonfinite[k];
  }
  *mn_out = mn;
  *mx_out = mx;
  *finite_out = bad == 0;
}

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "packets are packed little-endian");

// ---------------------------------------------------------------------------
// Bit packing of a whole bucket, one level per byte <-> LSB-first bit stream, eight levels
// (one 64-bit word of level bytes) <-> kBits bytes at a time.
//
// No pext/pdep: AMD family 17h (Zen 1, Zen+, Zen 2) microcodes them at tens to hundreds of
// cycles each (docs/performance.md). Three shift-and-mask steps do the same with shifts,
// ANDs and ORs, which are one cycle on every x86-64 and aarch64 core and vectorize on both
// (SSE2, AVX2, NEON): each step halves the number of fields by merging neighbours.
// ---------------------------------------------------------------------------

// The 64-bit word repeating `field` in every `period`-bit lane.
constexpr uint64_t repeat(uint64_t field, int period) {
  uint64_t word = 0;
  for (int shift = 0; shift < 64; shift += period) word |= field << shift;
  return word;
}

constexpr uint64_t low_mask(int bits) { return bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1; }

// One merge step: in every 2*half-bit lane, the field of `width` bits at bit `half` moves
// down to bit `width`, next to the field at bit 0. Bits outside the fields must be zero.
template <int kHalf, int kWidth>
uint64_t merge_pairs(uint64_t w) {
  constexpr uint64_t low = repeat(low_mask(kWidth), 2 * kHalf);
  constexpr uint64_t high = low << kHalf;
  return (w & low) | ((w & high) >> (kHalf - kWidth));
}

// The inverse: in every 2*half-bit lane, the field of `width` bits at bit `width` moves up
// to bit `half`. Bits outside the 2*width-bit fields are ignored (the masks drop them).
template <int kHalf, int kWidth>
uint64_t split_pairs(uint64_t w) {
  constexpr uint64_t low = repeat(low_mask(kWidth), 2 * kHalf);
  constexpr uint64_t high = low << kHalf;
  return (w & low) | ((w << (kHalf - kWidth)) & high);
}

// Eight levels, one per byte of `word`, each below 2^kBits -> their 8*kBits-bit stream.
template <int kBits>
uint64_t pack_group(uint64_t word) {
  if (kBits == 8) return word;
  word = merge_pairs<8, kBits>(word);
  word = merge_pairs<16, 2 * kBits>(word);
  return merge_pairs<32, 4 * kBits>(word);
}

// A stream of eight kBits-bit levels in the low 8*kBits bits (higher bits are ignored) ->
// one level per byte.
template <int kBits>
uint64_t unpack_group(uint64_t stream) {
  if (kBits == 8) return stream;
  stream = split_pairs<32, 4 * kBits>(stream);
  stream = split_pairs<16, 2 * kBits>(stream);
  return split_pairs<8, kBits>(stream);
}

// The unsigned integer of `bytes` bytes (1, 2, 4 or 8), for loops over whole groups.
template <int kBytes>
using Word = std::conditional_t<kBytes == 1, uint8_t,
             std::conditional_t<kBytes == 2, uint16_t,
             std::conditional_t<kBytes == 4, uint32_t, uint64_t>>>;

constexpr bool is_power_of_two(int bits) { return (bits & (bits - 1)) == 0; }

template <int kBits>
void pack_bucket(const uint8_t* __restrict levels, int64_t size, uint8_t* __restrict codes) {
  const int64_t groups = size / 8;
  for (int64_t g = 0; g < groups; ++g) {
    uint64_t word;
    memcpy(&word, levels + 8 * g, 8);
    const uint64_t packed = pack_group<kBits>(word);
    if constexpr (is_power_of_two(kBits)) {
      // A store of a whole 1/2/4/8-byte word, so the loop vectorizes.
      const Word<kBits> out = static_cast<Word<kBits>>(packed);
      memcpy(codes + g * kBits, &out, kBits);
    } else {
      memcpy(codes + g * kBits, &packed, kBits);
    }
  }
}

// Group g of a bucket's codes -> its eight levels, one per byte. kLoad bytes are read: a
// whole power-of-two group, or 8 bytes for other widths (unpack_group ignores the next
// group's bits) except for the last group, whose 8 bytes would reach past the codes.
template <int kBits, int kLoad>
void unpack_one_group(const uint8_t* __restrict codes, int64_t g, uint8_t* __restrict levels) {
  Word<kLoad> in = 0;
  memcpy(&in, codes + g * kBits, kLoad);
  const uint64_t word = unpack_group<kBits>(in);
  memcpy(levels + 8 * g, &word, 8);
}

template <int kBits>
void unpack_bucket(const uint8_t* __restrict codes, int64_t size, uint8_t* __restrict levels) {
  const int64_t groups = size / 8;
  if constexpr (is_power_of_two(kBits)) {
    for (int64_t g = 0; g < groups; ++g) unpack_one_group<kBits, kBits>(codes, g, levels);
  } else {
    int64_t g = 0;
    for (; g + 1 < groups; ++g) unpack_one_group<kBits, 8>(codes, g, levels);
    for (; g < groups; ++g) unpack_one_group<kBits, kBits>(codes, g, levels);
  }
}

void pack_levels(int bits, const uint8_t* levels, int64_t size, uint8_t* codes) {
  switch (bits) {
    case 1: return pack_bucket<1>(levels, size, codes);
    case 2: return pack_bucket<2>(levels, size, codes);
    case 3: return pack_bucket<3>(levels, size, codes);
    case 4: return pack_bucket<4>(levels, size, codes);
    case 5: return pack_bucket<5>(levels, size, codes);
    case 6: return pack_bucket<6>(levels, size, codes);
    case 7: return pack_bucket<7>(levels, size, codes);
    default: return pack_bucket<8>(levels, size, codes);
  }
}

void unpack_levels(int bits, const uint8_t* codes, int64_t size, uint8_t* levels) {
  switch (bits) {
    case 1: return unpack_bucket<1>(codes, size, levels);
    case 2: return unpack_bucket<2>(codes, size, levels);
    case 3: return unpack_bucket<3>(codes, size, levels);
    case 4: return unpack_bucket<4>(codes, size, levels);
    case 5: return unpack_bucket<5>(codes, size, levels);
    case 6: return unpack_bucket<6>(codes, size, levels);
    case 7: return unpack_bucket<7>(codes, size, levels);
    default: return unpack_bucket<8>(codes, size, levels);
  }
}

// ---------------------------------------------------------------------------
// Encoding and decoding one bucket
// ---------------------------------------------------------------------------

#if defined(__SSE2__) && !defined(__AVX2__)
#include "bucket_loops_sse2.inc"
#endif

// Levels of `size` values with a known scale; `counter` is the element index of x[0],
// which keys the stochastic noise. kInRange: the bucket's max - min is finite, so
// x - min cannot overflow and encode_level's first branch is the whole story; that keeps
// the loop free of branches and vectorized, with the same result.
template <bool kStochastic, bool kInRange, typename Tag>
void compute_levels(const typename Tag::storage* __restrict x, int64_t size,
                    const BucketScale scale, const CodecParams& p, uint32_t counter,
                    uint8_t* __restrict levels) {
#if defined(__SSE2__) && !defined(__AVX2__)
  if constexpr (kInRange) {
    return compute_levels_in_range<kStochastic, Tag>(x, size, scale, p, counter, levels);
  }
#endif
  // Locals, not references: otherwise the compiler must assume `levels` may alias them.
  const BucketScale s = scale;
  const uint32_t top = max_level(p.bits), seed0 = p.seed0, seed1 = p.seed1;
  // A 32-bit index (buckets hold at most 2^24 values) keeps the counter vector 32-bit wide.
  const uint32_t count = static_cast<uint32_t>(size);
  for (uint32_t j = 0; j < count; ++j) {
    const float u = kStochastic ? uniform01(seed0, seed1, counter + j) : 0.5f;
    const float v = load_as_float(x, j, Tag{});
    const uint32_t level = kInRange ? level_of(add_rn(scaled_offset_in_range(v, s), u), top)
                                    : encode_level(v, s, u, top);
    levels[j] = static_cast<uint8_t>(level);
  }
}

// Quantizes one bucket into meta slot `bucket` of `packet`, codes at `codes`; `levels` is
// scratch of bucket_size bytes. kPrefetchNext: the next bucket follows x in memory.
template <typename Tag, bool kPrefetchNext = false>
void quantize_bucket(const typename Tag::storage* x, const CodecParams& p, uint32_t counter,
                     int64_t bucket, uint8_t* packet, uint8_t* codes, uint8_t* levels) {
  float mn, mx;
  bool finite;
  bucket_range<Tag, kPrefetchNext>(x, p.bucket_size, &mn, &mx, &finite);
  const BucketScale s = make_scale(mn, mx, finite, p.bits);
  store_meta(packet, bucket, s.min, s.unit);
  if (!finite) {
    std::fill(codes, codes + code_bytes_per_bucket(p.bits, p.bucket_size), uint8_t{0});
    return;
  }
  const bool in_range = is_finite(sub_rn(mx, s.min));
  if (p.stochastic) {
    if (in_range) compute_levels<true, true, Tag>(x, p.bucket_size, s, p, counter, levels);
    else compute_levels<true, false, Tag>(x, p.bucket_size, s, p, counter, levels);
  } else {
    if (in_range) compute_levels<false, true, Tag>(x, p.bucket_size, s, p, counter, levels);
    else compute_levels<false, false, Tag>(x, p.bucket_size, s, p, counter, levels);
  }
  pack_levels(p.bits, levels, p.bucket_size, codes);
}

// Decodes one bucket, handing each value to emit(index_in_bucket, value); `levels` is
// scratch of bucket_size bytes. When min + top * unit is finite no level can overflow and
// decode_level reduces to decode_level_in_range: a branch-free, vectorized loop.
template <typename Emit>
void dequantize_bucket(const uint8_t* packet, int64_t bucket, const uint8_t* codes, int bits,
                       int64_t bucket_size, uint8_t* levels, Emit emit) {
  float mn, unit;
  load_meta(packet, bucket, &mn, &unit);
  unpack_levels(bits, codes, bucket_size, levels);
  const uint32_t top = max_level(bits);
  const bool in_range = is_finite(unit) && is_finite(mul_rn(static_cast<float>(top), unit)) &&
                        is_finite(decode_level_in_range(top, mn, unit));
  if (in_range) {
    for (int64_t j = 0; j < bucket_size; ++j) emit(j, decode_level_in_range(levels[j], mn, unit));
  } else {
    for (int64_t j = 0; j < bucket_size; ++j) emit(j, decode_level(levels[j], mn, unit));
  }
}

// The codes of bucket `bucket` of a packet of nb buckets (after the nb meta slots).
template <typename Byte>
Byte* codes_of(Byte* packet, int64_t nb, int64_t bucket, int64_t cbytes) {
  return packet + nb * kMetaBytesPerBucket + bucket * cbytes;
}

// Values first..first+size-1 of x, which holds `count`: those past it read as x[count - 1]
// (the padding of docs/design.md section 2), copied bit for bit into `padded`.
template <typename T>
const T* padded_bucket(const T* x, int64_t first, int64_t count, int64_t size, T* padded) {
  const int64_t have = std::max<int64_t>(0, std::min(size, count - first));
  std::copy(x + first, x + first + have, padded);
  std::fill(padded + have, padded + size, x[count - 1]);
  return padded;
}

template <typename Tag>
void quantize_range(const QuantizeJob& job, int64_t begin, int64_t end) {
  const CodecParams& p = job.codec;
  const auto* x = static_cast<const typename Tag::storage*>(job.x);
  const int64_t nb = job.n / p.bucket_size;
  const int64_t pbytes = packet_bytes(job.n, p.bits, p.bucket_size);
  const int64_t cbytes = code_bytes_per_bucket(p.bits, p.bucket_size);
  std::unique_ptr<uint8_t[]> levels(new uint8_t[p.bucket_size]);
  std::unique_ptr<typename Tag::storage[]> padded;  // for buckets past a short last row
  for (int64_t i = begin; i < end; ++i) {
    const int64_t row = i / nb, bucket = i % nb;
    uint8_t* packet = job.packets + row * pbytes;
    const int64_t first = row * job.n + bucket * p.bucket_size;
    // The values of this bucket that x (and residual) hold: fewer at the end of a short last row.
    const int64_t keep = std::max<int64_t>(0, std::min(p.bucket_size, job.x_count - first));
    if (row == job.skip_row) {
      store_meta(packet, bucket, 0.0f, 0.0f);
      uint8_t* codes = codes_of(packet, nb, bucket, cbytes);
      std::fill(codes, codes + cbytes, uint8_t{0});
      if (job.residual) std::fill(job.residual + first, job.residual + first + keep, 0.0f);
      continue;
    }
    const typename Tag::storage* values = x + first;
    if (keep < p.bucket_size) {
      if (!padded) padded.reset(new typename Tag::storage[p.bucket_size]);
      values = padded_bucket(x, first, job.x_count, p.bucket_size, padded.get());
    }
    uint8_t* codes = codes_of(packet, nb, bucket, cbytes);
    quantize_bucket<Tag, true>(values, p, static_cast<uint32_t>(first), bucket, packet, codes,
                               levels.get());
    if (job.residual) {
      // Decoded from the bytes just written (still in cache) by the dequantize loop's own
      // code, so the loss is bitwise x - dequantize(packet) without a second pass over memory.
      float* residual = job.residual + first;
      dequantize_bucket(packet, bucket, codes, p.bits, p.bucket_size, levels.get(),
                        [&](int64_t j, float v) {
                          if (j < keep) {
                            residual[j] = canonical_nan(
                                sub_rn(load_as_float(values, j, Tag{}), canonical_nan(v)));
                          }
                        });
    }
  }
}

// A decoded value times the mean's scale (1 / divisor in f32); a template flag so the
// common unscaled loop carries no multiplication.
template <bool kScale>
float scaled(float v, float scale) {
  return canonical_nan(kScale ? mul_rn(v, scale) : v);
}

template <typename Tag, bool kScale>
void dequantize_rows_range(const DequantizeJob& job, int64_t begin, int64_t end) {
  auto* out = static_cast<typename Tag::storage*>(job.out);
  const float scale = job.scale;
  const int64_t nb = job.n / job.bucket_size;
  const int64_t cbytes = code_bytes_per_bucket(job.bits, job.bucket_size);
  std::unique_ptr<uint8_t[]> levels(new uint8_t[job.bucket_size]);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t row = i / nb, bucket = i % nb;
    const uint8_t* packet = job.packets + row * job.row_bytes;
    const int64_t first = row * job.n + bucket * job.bucket_size;
    if (first >= job.out_count) continue;  // past a short last row
    typename Tag::storage* dst = out + first;
    const uint8_t* codes = codes_of(packet, nb, bucket, cbytes);
    if (first + job.bucket_size <= job.out_count) {
      dequantize_bucket(packet, bucket, codes, job.bits, job.bucket_size, levels.get(),
                        [&](int64_t j, float v) {
                          store_from_float(dst, j, scaled<kScale>(v, scale), Tag{});
                        });
    } else {
      const int64_t keep = job.out_count - first;
      dequantize_bucket(packet, bucket, codes, job.bits, job.bucket_size, levels.get(),
                        [&](int64_t j, float v) {
                          if (j < keep) store_from_float(dst, j, scaled<kScale>(v, scale), Tag{});
                        });
    }
  }
}

template <typename Tag>
void dequantize_range(const DequantizeJob& job, int64_t begin, int64_t end) {
  if (job.scale == 1.0f) {
    dequantize_rows_range<Tag, false>(job, begin, end);
  } else {
    dequantize_rows_range<Tag, true>(job, begin, end);
  }
}

template <typename Tag>
void reduce_range(const ReduceJob& job, int64_t begin, int64_t end) {
  const CodecParams& p = job.codec;
  const auto* own = static_cast<const typename Tag::storage*>(job.own);
  const int64_t nb = job.n / p.bucket_size;
  const int64_t cbytes = code_bytes_per_bucket(p.bits, p.bucket_size);
  std::unique_ptr<float[]> scratch(new float[p.bucket_size]);
  std::unique_ptr<uint8_t[]> levels(new uint8_t[p.bucket_size]);
  std::unique_ptr<typename Tag::storage[]> padded;  // for buckets past a short own row
  for (int64_t bucket = begin; bucket < end; ++bucket) {
    const int64_t first = bucket * p.bucket_size;
    // The sum goes straight to sum_out, except for a bucket a short sum_out cuts.
    const bool sum_in_place = job.sum_out && first + p.bucket_size <= job.sum_count;
    float* acc = sum_in_place ? job.sum_out + first : scratch.get();
    std::fill(acc, acc + p.bucket_size, 0.0f);
    for (int64_t peer = 0; peer < job.num_peers; ++peer) {
      if (own != nullptr && peer == job.own_index) {
        const typename Tag::storage* values = own + first;
        if (first + p.bucket_size > job.own_count) {
          if (!padded) padded.reset(new typename Tag::storage[p.bucket_size]);
          values = padded_bucket(own, first, job.own_count, p.bucket_size, padded.get());
        }
        for (int64_t j = 0; j < p.bucket_size; j += kLanes) {
          prefetch_next_bucket(values, j, p.bucket_size);
          Floats& sum = *reinterpret_cast<Floats*>(acc + j);
          sum = sum + load_floats<Tag>(values, j);  // separately rounded f32 additions
        }
      } else {
        const uint8_t* packet = job.peers + peer * job.row_bytes;
        dequantize_bucket(packet, bucket, codes_of(packet, nb, bucket, cbytes), p.bits,
                          p.bucket_size, levels.get(), [&](int64_t j, float v) { acc[j] = add_rn(acc[j], v); });
      }
    }
    if (job.sum_out) {
      for (int64_t j = 0; j < p.bucket_size; ++j) acc[j] = canonical_nan(acc[j]);
    }
    if (job.packet_out) {
      quantize_bucket<F32>(acc, p, static_cast<uint32_t>(first), bucket, job.packet_out,
                           codes_of(job.packet_out, nb, bucket, cbytes), levels.get());
    }
    if (job.sum_out) {  // scaled only now: the packet carries the sum itself
      if (job.scale != 1.0f) {
        for (int64_t j = 0; j < p.bucket_size; ++j) acc[j] = scaled<true>(acc[j], job.scale);
      }
      if (!sum_in_place && first < job.sum_count)
        std::copy(acc, acc + (job.sum_count - first), job.sum_out + first);
    }
  }
}

// Calls f(tag) with the tag of `type` (F32, BF16 or F16), as the CUDA file's
// with_float_type: one entry point per operation, dispatching once per range.
template <typename F>
void with_float_type(ElementType type, F&& f) {
  switch (type) {
    case ElementType::kF32:
      return f(F32{});
    case ElementType::kBF16:
      return f(BF16{});
    case ElementType::kF16:
      return f(F16{});
  }
}

void quantize(const QuantizeJob& job, int64_t begin, int64_t end) {
  with_float_type(job.type, [&](auto tag) { quantize_range<decltype(tag)>(job, begin, end); });
}
void dequantize(const DequantizeJob& job, int64_t begin, int64_t end) {
  with_float_type(job.type, [&](auto tag) { dequantize_range<decltype(tag)>(job, begin, end); });
}
void reduce_requantize(const ReduceJob& job, int64_t begin, int64_t end) {
  with_float_type(job.own_type, [&](auto tag) { reduce_range<decltype(tag)>(job, begin, end); });
}

}  // namespace

#define CGX_STRINGIFY2(x) #x
#define CGX_STRINGIFY(x) CGX_STRINGIFY2(x)
extern const BucketLoops loops = {CGX_STRINGIFY(CGX_ISA), quantize, dequantize,
                                  reduce_requantize};

}  // namespace CGX_ISA
}  // namespace cgx
