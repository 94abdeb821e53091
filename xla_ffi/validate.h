// Argument checks shared by the CPU and CUDA handlers. Each returns an
// ffi::Error::InvalidArgument naming the buffer or attribute, what was expected and what
// was received, so a bad call fails in Python with a readable message, never by writing
// outside a buffer.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "codec.h"
#include "xla/ffi/api/ffi.h"

namespace cgx {

// Larger buckets buy nothing (one scale per 16M values) and would let size arithmetic
// approach int64 limits.
constexpr int64_t kMaxBucketSize = int64_t{1} << 24;

inline xla::ffi::Error check_codec(int64_t bits, int64_t bucket_size) {
  if (bits < kMinBits || bits > kMaxBits)
    return xla::ffi::Error::InvalidArgument("bits must be in [1, 8], got " +
                                            std::to_string(bits));
  if (bucket_size <= 0 || bucket_size % 8 != 0 || bucket_size > kMaxBucketSize)
    return xla::ffi::Error::InvalidArgument(
        "bucket_size must be a positive multiple of 8 no larger than " +
        std::to_string(kMaxBucketSize) + ", got " + std::to_string(bucket_size));
  return xla::ffi::Error::Success();
}

// Reads a rank-1 ([n], one row) or rank-2 ([rows, n]) shape.
inline xla::ffi::Error rows_and_length(xla::ffi::Span<const int64_t> dims, const char* name,
                                       int64_t* rows, int64_t* n) {
  if (dims.size() == 1) {
    *rows = 1;
    *n = dims[0];
  } else if (dims.size() == 2) {
    *rows = dims[0];
    *n = dims[1];
  } else {
    return xla::ffi::Error::InvalidArgument(std::string(name) + " must have rank 1 or 2, got rank " +
                                            std::to_string(dims.size()));
  }
  return xla::ffi::Error::Success();
}

inline xla::ffi::Error check_multiple(int64_t n, int64_t bucket_size, const char* name) {
  if (n < 0 || n % bucket_size != 0)
    return xla::ffi::Error::InvalidArgument(std::string(name) + " length " + std::to_string(n) +
                                            " is not a multiple of bucket_size " +
                                            std::to_string(bucket_size));
  return xla::ffi::Error::Success();
}

inline xla::ffi::Error check_count(int64_t actual, int64_t expected, const char* name) {
  if (actual != expected)
    return xla::ffi::Error::InvalidArgument(std::string(name) + " must hold " +
                                            std::to_string(expected) + " elements, got " +
                                            std::to_string(actual));
  return xla::ffi::Error::Success();
}

inline xla::ffi::Error unsupported_dtype(const char* name) {
  return xla::ffi::Error::InvalidArgument(std::string(name) +
                                          " must be float32, bfloat16 or float16");
}

// ---------------------------------------------------------------------------
// The full argument check of each handler, shared by the CPU and CUDA builds
// ---------------------------------------------------------------------------

// A buffer standing for `rows` rows of n values whose last row may be short: it holds
// between (rows - 1) * n + 1 and rows * n values (none when rows * n is 0). The kernels read
// a missing value as the buffer's last one (the padding of docs/design.md section 2) and
// write only the values the buffer holds.
inline xla::ffi::Error check_rows_of(int64_t count, int64_t rows, int64_t n, const char* name) {
  const int64_t full = rows * n, least = rows * n == 0 ? 0 : (rows - 1) * n + 1;
  if (count < least || count > full)
    return xla::ffi::Error::InvalidArgument(
        std::string(name) + " must hold " + std::to_string(rows) + " rows of " +
        std::to_string(n) + " values, the last possibly short (" + std::to_string(least) +
        " to " + std::to_string(full) + " values), got " + std::to_string(count));
  return xla::ffi::Error::Success();
}

// quantize: x [rows, n] (n a multiple of bucket_size; x's shape does not matter, its last
// row may be short), seed [2], skip_row [1], packets [rows, P], and for
// cgx_quantize_with_residual the residual, as many values as x (none for cgx_quantize).
inline xla::ffi::Error check_quantize_args(int64_t bits, int64_t bucket_size, int64_t n,
                                           int64_t x_count, int64_t seed_count,
                                           int64_t skip_row_count,
                                           xla::ffi::Span<const int64_t> packets_dims,
                                           std::optional<int64_t> residual_count,
                                           int64_t* rows) {
  if (auto e = check_codec(bits, bucket_size); e.failure()) return e;
  if (auto e = check_multiple(n, bucket_size, "n"); e.failure()) return e;
  int64_t pbytes = 0;
  if (auto e = rows_and_length(packets_dims, "packets", rows, &pbytes); e.failure()) return e;
  const int64_t want = packet_bytes(n, static_cast<int>(bits), bucket_size);
  if (pbytes != want)
    return xla::ffi::Error::InvalidArgument("packets rows must hold " + std::to_string(want) +
                                            " bytes (one packet of n = " + std::to_string(n) +
                                            " values), got " + std::to_string(pbytes));
  if (auto e = check_rows_of(x_count, *rows, n, "x"); e.failure()) return e;
  if (auto e = check_count(seed_count, 2, "seed"); e.failure()) return e;
  if (residual_count && *residual_count != x_count)
    return xla::ffi::Error::InvalidArgument("residual must hold as many values as x (" +
                                            std::to_string(x_count) + "), got " +
                                            std::to_string(*residual_count));
  return check_count(skip_row_count, 1, "skip_row");
}

// A window of `pbytes` bytes at byte `offset` of each row of `dims` ([rows, W], or [W] for
// one row): the packets of one segment inside rows that carry several (collectives/sra.py).
// Sets *rows and *row_bytes (W).
inline xla::ffi::Error check_packet_window(xla::ffi::Span<const int64_t> dims, const char* name,
                                           int64_t pbytes, int64_t offset, int64_t* rows,
                                           int64_t* row_bytes) {
  if (auto e = rows_and_length(dims, name, rows, row_bytes); e.failure()) return e;
  if (offset < 0 || offset > *row_bytes - pbytes)
    return xla::ffi::Error::InvalidArgument(
        std::string(name) + " rows of " + std::to_string(*row_bytes) +
        " bytes cannot hold a packet of " + std::to_string(pbytes) + " bytes at offset " +
        std::to_string(offset));
  return xla::ffi::Error::Success();
}

// The divisor of decoded values (compressed_pmean divides by the participants in the kernel
// that writes the result), exact in f32. The kernels multiply by its f32 reciprocal, as
// XLA:CPU computes x / n, so a mean has the bits of `sum / n` there and on every platform.
constexpr int64_t kMaxDivisor = int64_t{1} << 24;

inline float reciprocal_of(int64_t divisor) { return 1.0f / static_cast<float>(divisor); }

inline xla::ffi::Error check_divisor(int64_t divisor) {
  if (divisor < 1 || divisor > kMaxDivisor)
    return xla::ffi::Error::InvalidArgument("divisor must be in [1, " +
                                            std::to_string(kMaxDivisor) + "], got " +
                                            std::to_string(divisor));
  return xla::ffi::Error::Success();
}

// dequantize: the packets [rows, P] at byte `offset` of packets [rows, W], output [rows, n]
// (n a multiple of bucket_size; the output's shape does not matter, its last row may be
// short).
inline xla::ffi::Error check_dequantize_args(int64_t bits, int64_t bucket_size, int64_t n,
                                             int64_t offset, int64_t divisor, int64_t out_count,
                                             xla::ffi::Span<const int64_t> packets_dims,
                                             int64_t* rows, int64_t* row_bytes) {
  if (auto e = check_codec(bits, bucket_size); e.failure()) return e;
  if (auto e = check_divisor(divisor); e.failure()) return e;
  if (auto e = check_multiple(n, bucket_size, "n"); e.failure()) return e;
  const int64_t pbytes = packet_bytes(n, static_cast<int>(bits), bucket_size);
  if (auto e = check_packet_window(packets_dims, "packets", pbytes, offset, rows, row_bytes);
      e.failure())
    return e;
  return check_rows_of(out_count, *rows, n, "output");
}

// What one of the three reduce targets writes: cgx_reduce_requantize the packet,
// cgx_reduce_sum the sum, cgx_reduce_requantize_with_sum both. A null pointer: the target
// has no such output (nothing else switches an output off).
struct ReduceOutputs {
  uint8_t* packet = nullptr;  // [P(n)]: the sum re-encoded
  int64_t packet_count = 0;
  float* sum = nullptr;       // [n] or its first values: the sum, times f32(1 / divisor)
  int64_t sum_count = 0;
};

// The reduce targets: the peers' packets [N, P(n)] at byte `offset` of peers [N, W],
// own_index [1], the optional own ([n], or all N rows [N, n], the last possibly short, of
// which row own_index is read, or empty), seed [2] where the target encodes a packet, and
// the outputs.
inline xla::ffi::Error check_reduce_args(int64_t bits, int64_t bucket_size, int64_t n,
                                         int64_t offset, int64_t divisor,
                                         xla::ffi::Span<const int64_t> peers_dims,
                                         std::optional<int64_t> seed_count,
                                         int64_t own_index_count, int64_t own_count,
                                         const ReduceOutputs& out, int64_t* num_peers,
                                         int64_t* row_bytes) {
  if (auto e = check_codec(bits, bucket_size); e.failure()) return e;
  if (auto e = check_divisor(divisor); e.failure()) return e;
  if (auto e = check_multiple(n, bucket_size, "n"); e.failure()) return e;
  const int64_t pbytes = packet_bytes(n, static_cast<int>(bits), bucket_size);
  if (auto e = check_packet_window(peers_dims, "peers", pbytes, offset, num_peers, row_bytes);
      e.failure())
    return e;
  if (seed_count)
    if (auto e = check_count(*seed_count, 2, "seed"); e.failure()) return e;
  if (auto e = check_count(own_index_count, 1, "own_index"); e.failure()) return e;
  const int64_t all_least = (*num_peers - 1) * n + 1, all_full = *num_peers * n;
  if (own_count != 0 && own_count != n && (own_count < all_least || own_count > all_full))
    return xla::ffi::Error::InvalidArgument(
        "own must hold n = " + std::to_string(n) + " elements, all " +
        std::to_string(*num_peers) + " rows (" + std::to_string(all_least) + " to " +
        std::to_string(all_full) + ", the last row possibly short), or 0 to skip it, got " +
        std::to_string(own_count));
  if (out.packet != nullptr)
    if (auto e = check_count(out.packet_count, pbytes, "packet"); e.failure()) return e;
  if (out.sum == nullptr) return xla::ffi::Error::Success();
  return check_rows_of(out.sum_count, 1, n, "sum");
}

// ---------------------------------------------------------------------------
// The binding of each FFI target: operands and attribute names, defined once so the CPU
// and CUDA handlers cannot disagree. `Context` is the platform's context (ThreadPool on
// CPU, PlatformStream<cudaStream_t> on CUDA). Every output of a target is written: a
// variant that writes more is another target, not a zero-length output.
// ---------------------------------------------------------------------------

template <typename Context>
auto quantize_operands() {
  return xla::ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<xla::ffi::AnyBuffer>()                    // x [rows, n], last row may be short
      .template Arg<xla::ffi::Buffer<xla::ffi::U32>>()        // seed [2]
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()        // skip_row []
      .template Ret<xla::ffi::Buffer<xla::ffi::U8>>();        // packets [rows, P]
}

template <typename Binding>
auto with_quantize_attrs(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("bits")
      .template Attr<int64_t>("bucket_size")
      .template Attr<bool>("stochastic")
      .template Attr<int64_t>("n");
}

// cgx_quantize: x -> packets.
template <typename Context>
auto quantize_binding() {
  return with_quantize_attrs(quantize_operands<Context>());
}

// cgx_quantize_with_residual: x -> packets, and the residual x - decode(packets) (f32, like x).
template <typename Context>
auto quantize_with_residual_binding() {
  return with_quantize_attrs(
      quantize_operands<Context>().template Ret<xla::ffi::Buffer<xla::ffi::F32>>());
}

template <typename Context>
auto dequantize_binding() {
  return xla::ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<xla::ffi::Buffer<xla::ffi::U8>>()         // packets [rows, W >= offset + P]
      .template Ret<xla::ffi::AnyBuffer>()                    // x' [rows, n], last row may be short
      .template Attr<int64_t>("bits")
      .template Attr<int64_t>("bucket_size")
      .template Attr<int64_t>("offset")
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("divisor");  // x' = decoded * f32(1 / divisor) (1: as decoded)
}

template <typename Context>
auto reduce_operands() {
  return xla::ffi::Ffi::Bind()
      .Ctx<Context>()
      .template Arg<xla::ffi::Buffer<xla::ffi::U8>>()         // peers [N, W >= offset + P]
      .template Arg<xla::ffi::AnyBuffer>()                    // own [n], [N, n] (short) or [0]
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>();       // own_index []
}

template <typename Binding>
auto with_requantize_attrs(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("bits")
      .template Attr<int64_t>("bucket_size")
      .template Attr<bool>("stochastic")
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("offset");
}

// cgx_reduce_requantize: the peers' chunks (+ own) -> their f32 sum, re-encoded as one packet.
template <typename Context>
auto reduce_requantize_binding() {
  return with_requantize_attrs(reduce_operands<Context>()
                                   .template Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // seed [2]
                                   .template Ret<xla::ffi::Buffer<xla::ffi::U8>>());  // packet [P]
}

// cgx_reduce_requantize_with_sum: the packet and the f32 sum it encodes (error feedback's
// residual in the ring is sum - decode(packet)).
template <typename Context>
auto reduce_requantize_with_sum_binding() {
  return with_requantize_attrs(reduce_operands<Context>()
                                   .template Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // seed [2]
                                   .template Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // packet [P]
                                   .template Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // sum [n]
}

// cgx_reduce_sum: the peers' chunks (+ own) -> their f32 sum (its first values), no packet.
template <typename Context>
auto reduce_sum_binding() {
  return reduce_operands<Context>()
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>()        // sum [n], or its first values
      .template Attr<int64_t>("bits")
      .template Attr<int64_t>("bucket_size")
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("offset")
      .template Attr<int64_t>("divisor");  // sum *= f32(1 / divisor)
}

// ---------------------------------------------------------------------------
// The handler of each target, for a platform whose `Context` (ThreadPool, cudaStream_t) and
// two implementations are given: quantize_into(ctx, x, seed, skip_row, packets, residual or
// null, residual count or nullopt, attributes...) and reduce_into(ctx, peers, own,
// own_index, seed or null, ReduceOutputs, attributes...). Each handler only says which
// outputs its target has.
// ---------------------------------------------------------------------------

template <typename Context, auto quantize_into, auto reduce_into>
struct TargetHandlers {
  using Error = xla::ffi::Error;
  using Bytes = xla::ffi::Buffer<xla::ffi::U8>;
  using Seed = xla::ffi::Buffer<xla::ffi::U32>;
  using Index = xla::ffi::Buffer<xla::ffi::S32>;
  using BytesOut = xla::ffi::ResultBuffer<xla::ffi::U8>;
  using FloatsOut = xla::ffi::ResultBuffer<xla::ffi::F32>;

  static Error Quantize(Context ctx, xla::ffi::AnyBuffer x, Seed seed, Index skip_row,
                        BytesOut packets, int64_t bits, int64_t bucket_size, bool stochastic,
                        int64_t n) {
    return quantize_into(ctx, x, seed, skip_row, packets, nullptr, std::nullopt, bits,
                         bucket_size, stochastic, n);
  }

  static Error QuantizeWithResidual(Context ctx, xla::ffi::AnyBuffer x, Seed seed,
                                    Index skip_row, BytesOut packets, FloatsOut residual,
                                    int64_t bits, int64_t bucket_size, bool stochastic,
                                    int64_t n) {
    return quantize_into(ctx, x, seed, skip_row, packets, residual->typed_data(),
                         residual->element_count(), bits, bucket_size, stochastic, n);
  }

  static Error ReduceRequantize(Context ctx, Bytes peers, xla::ffi::AnyBuffer own,
                                Index own_index, Seed seed, BytesOut packet, int64_t bits,
                                int64_t bucket_size, bool stochastic, int64_t n,
                                int64_t offset) {
    const ReduceOutputs out{packet->typed_data(), packet->element_count()};
    return reduce_into(ctx, peers, own, own_index, &seed, out, bits, bucket_size, stochastic,
                       n, offset, 1);
  }

  static Error ReduceRequantizeWithSum(Context ctx, Bytes peers, xla::ffi::AnyBuffer own,
                                       Index own_index, Seed seed, BytesOut packet,
                                       FloatsOut sum, int64_t bits, int64_t bucket_size,
                                       bool stochastic, int64_t n, int64_t offset) {
    const ReduceOutputs out{packet->typed_data(), packet->element_count(), sum->typed_data(),
                            sum->element_count()};
    return reduce_into(ctx, peers, own, own_index, &seed, out, bits, bucket_size, stochastic,
                       n, offset, 1);
  }

  static Error ReduceSum(Context ctx, Bytes peers, xla::ffi::AnyBuffer own, Index own_index,
                         FloatsOut sum, int64_t bits, int64_t bucket_size, int64_t n,
                         int64_t offset, int64_t divisor) {
    const ReduceOutputs out{nullptr, 0, sum->typed_data(), sum->element_count()};
    return reduce_into(ctx, peers, own, own_index, nullptr, out, bits, bucket_size, false, n,
                       offset, divisor);
  }
};

}  // namespace cgx
