// Bucket loops of the CPU kernels (see bucket_loops.h). This file is compiled several
// times with CGX_ISA set to the namespace of one instruction set and the matching -m flags;
// the loops are written in groups of eight values so the compiler vectorizes them.
#include "bucket_loops.h"

#include <algorithm>
#include <cstring>
#include <memory>

#if defined(__BMI2__)
#include <immintrin.h>
#endif

#include "codec.h"

#ifndef CGX_ISA
#error "compile with -DCGX_ISA=isa_generic|isa_avx2|isa_avx512"
#endif

namespace cgx {
namespace CGX_ISA {
namespace {

// Eight floats as one vector (GCC/Clang vector extensions: one AVX register, two SSE ones).
// Written out because compilers do not vectorize a float min/max reduction on their own.
typedef float Floats8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t Ints8 __attribute__((vector_size(32), aligned(4)));

template <typename Tag>
Floats8 load8(const typename Tag::storage* x, int64_t j) {
  Floats8 v;
  for (int k = 0; k < 8; ++k) v[k] = load_as_float(x, j + k, Tag{});
  return v;
}

// An unaligned vector load (the type is only 4-byte aligned and may alias floats).
template <>
Floats8 load8<F32>(const float* x, int64_t j) {
  return *reinterpret_cast<const Floats8*>(x + j);
}

// Asks for the cache line holding x[j + size], the same place in the next bucket, once per
// 64-byte line of x[j]. The first pass over a bucket streams it from memory and the
// arithmetic between passes leaves the memory bus idle; fetching one bucket ahead overlaps
// the two (measured: quantize 20% faster, the own chunk's sum in reduce_requantize too). A
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
  Floats8 lo = load8<Tag>(x, 0), hi = lo;
  Ints8 nonfinite = {0, 0, 0, 0, 0, 0, 0, 0};
  const Ints8 exponent = {0x7F800000, 0x7F800000, 0x7F800000, 0x7F800000,
                          0x7F800000, 0x7F800000, 0x7F800000, 0x7F800000};
  for (int64_t j = 0; j < size; j += 8) {
    if (kPrefetchNext) prefetch_next_bucket(x, j, size);
    const Floats8 v = load8<Tag>(x, j);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    nonfinite |= (reinterpret_cast<const Ints8&>(v) & exponent) == exponent;
  }
  float mn = lo[0], mx = hi[0];
  int32_t bad = nonfinite[0];
  for (int k = 1; k < 8; ++k) {
    mn = lo[k] < mn ? lo[k] : mn;
    mx = hi[k] > mx ? hi[k] : mx;
    bad |= nonfinite[k];
  }
  *mn_out = mn;
  *mx_out = mx;
  *finite_out = bad == 0;
}

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "packets are packed little-endian");

// ---------------------------------------------------------------------------
// Bit packing of a whole bucket, one level per byte <-> LSB-first bit stream. With BMI2
// one pext/pdep moves eight levels: each byte's low `kBits` bits are exactly the stream.
// ---------------------------------------------------------------------------

template <int kBits>
constexpr uint64_t low_bits_of_each_byte() {
  return 0x0101010101010101ull * ((1ull << kBits) - 1);
}

template <int kBits>
void pack_bucket(const uint8_t* levels, int64_t size, uint8_t* codes) {
  for (int64_t g = 0; g < size / 8; ++g) {
    uint64_t word;
    memcpy(&word, levels + 8 * g, 8);
#if defined(__BMI2__)
    const uint64_t packed = _pext_u64(word, low_bits_of_each_byte<kBits>());
#else
    uint64_t packed = 0;
    for (int k = 0; k < 8; ++k) packed |= ((word >> (8 * k)) & 0xFFu) << (k * kBits);
#endif
    memcpy(codes + g * kBits, &packed, kBits);
  }
}

template <int kBits>
void unpack_bucket(const uint8_t* codes, int64_t size, uint8_t* levels) {
  for (int64_t g = 0; g < size / 8; ++g) {
    uint64_t packed = 0;
    memcpy(&packed, codes + g * kBits, kBits);
#if defined(__BMI2__)
    const uint64_t word = _pdep_u64(packed, low_bits_of_each_byte<kBits>());
#else
    uint64_t word = 0;
    for (int k = 0; k < 8; ++k) word |= ((packed >> (k * kBits)) & ((1u << kBits) - 1)) << (8 * k);
#endif
    memcpy(levels + 8 * g, &word, 8);
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

// Levels of `size` values with a known scale; `counter` is the element index of x[0],
// which keys the stochastic noise. kInRange: the bucket's max - min is finite, so
// x - min cannot overflow and encode_level's first branch is the whole story; that keeps
// the loop free of branches and vectorized, with the same result.
template <bool kStochastic, bool kInRange, typename Tag>
void compute_levels(const typename Tag::storage* __restrict x, int64_t size,
                    const BucketScale scale, const CodecParams& p, uint32_t counter,
                    uint8_t* __restrict levels) {
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

uint8_t* codes_of(uint8_t* packet, int64_t nb, int64_t bucket, int64_t cbytes) {
  return packet + nb * kMetaBytesPerBucket + bucket * cbytes;
}
const uint8_t* codes_of(const uint8_t* packet, int64_t nb, int64_t bucket, int64_t cbytes) {
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
    if (row == job.skip_row) {
      store_meta(packet, bucket, 0.0f, 0.0f);
      uint8_t* codes = codes_of(packet, nb, bucket, cbytes);
      std::fill(codes, codes + cbytes, uint8_t{0});
      continue;
    }
    const int64_t first = row * job.n + bucket * p.bucket_size;
    const typename Tag::storage* values = x + first;
    if (first + p.bucket_size > job.x_count) {
      if (!padded) padded.reset(new typename Tag::storage[p.bucket_size]);
      values = padded_bucket(x, first, job.x_count, p.bucket_size, padded.get());
    }
    quantize_bucket<Tag, true>(values, p, static_cast<uint32_t>(first), bucket, packet,
                               codes_of(packet, nb, bucket, cbytes), levels.get());
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
        for (int64_t j = 0; j < p.bucket_size; j += 8) {
          prefetch_next_bucket(values, j, p.bucket_size);
          Floats8& sum = *reinterpret_cast<Floats8*>(acc + j);
          sum = sum + load8<Tag>(values, j);  // eight separately rounded f32 additions
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

// One entry point per operation, dispatching on the element type once per range.
template <template <typename> class Range, typename Job>
void by_type(ElementType type, const Job& job, int64_t begin, int64_t end) {
  switch (type) {
    case ElementType::kF32:
      return Range<F32>::run(job, begin, end);
    case ElementType::kBF16:
      return Range<BF16>::run(job, begin, end);
    case ElementType::kF16:
      return Range<F16>::run(job, begin, end);
  }
}

template <typename Tag>
struct Quantize {
  static void run(const QuantizeJob& j, int64_t b, int64_t e) { quantize_range<Tag>(j, b, e); }
};
template <typename Tag>
struct Dequantize {
  static void run(const DequantizeJob& j, int64_t b, int64_t e) { dequantize_range<Tag>(j, b, e); }
};
template <typename Tag>
struct Reduce {
  static void run(const ReduceJob& j, int64_t b, int64_t e) { reduce_range<Tag>(j, b, e); }
};

void quantize(const QuantizeJob& job, int64_t begin, int64_t end) {
  by_type<Quantize>(job.type, job, begin, end);
}
void dequantize(const DequantizeJob& job, int64_t begin, int64_t end) {
  by_type<Dequantize>(job.type, job, begin, end);
}
void reduce_requantize(const ReduceJob& job, int64_t begin, int64_t end) {
  by_type<Reduce>(job.own_type, job, begin, end);
}

}  // namespace

#define CGX_STRINGIFY2(x) #x
#define CGX_STRINGIFY(x) CGX_STRINGIFY2(x)
extern const BucketLoops loops = {CGX_STRINGIFY(CGX_ISA), quantize, dequantize,
                                  reduce_requantize};

}  // namespace CGX_ISA
}  // namespace cgx
