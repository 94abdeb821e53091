// Argument checks shared by the CPU and CUDA handlers. Each returns an
// ffi::Error::InvalidArgument naming the buffer or attribute, what was expected and what
// was received, so a bad call fails in Python with a readable message, never by writing
// outside a buffer.
#pragma once

#include <cstdint>
#include <string>

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

// For optional buffers: either the full size or empty (not wanted / not given).
inline xla::ffi::Error check_count_or_empty(int64_t actual, int64_t expected, const char* name) {
  if (actual != expected && actual != 0)
    return xla::ffi::Error::InvalidArgument(std::string(name) + " must hold " +
                                            std::to_string(expected) +
                                            " elements (or 0 to skip it), got " +
                                            std::to_string(actual));
  return xla::ffi::Error::Success();
}

inline xla::ffi::Error unsupported_dtype(const char* name) {
  return xla::ffi::Error::InvalidArgument(std::string(name) +
                                          " must be float32, bfloat16 or float16");
}

}  // namespace cgx
