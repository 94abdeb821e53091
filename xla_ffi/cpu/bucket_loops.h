// The CPU codec loops over ranges of buckets, compiled once per instruction set
// (bucket_loops.cc built with generic, AVX2 and AVX-512 flags) and picked at run time.
// All variants compute the same IEEE f32 operations, so they write the same bytes.
#pragma once

#include <cstdint>
#include <vector>

namespace cgx {

enum class ElementType { kF32, kBF16, kF16 };

struct CodecParams {
  int bits;
  int64_t bucket_size;
  bool stochastic;
  uint32_t seed0;
  uint32_t seed1;
};

// x [rows, n] -> packets [rows, P]; work item i is bucket i % nb of row i / nb. Row
// skip_row (when in range) is not encoded: its packet is all zero bytes. x holds x_count
// values: the last row may be short, and a missing value reads as x[x_count - 1]. residual (when
// not null; x_count values, like x) receives what the encoding lost, x - decode(packet) in
// f32, exactly what dequantizing the packets and subtracting gives; 0 in row skip_row.
struct QuantizeJob {
  ElementType type;
  const void* x;
  int64_t x_count;
  int64_t n;
  CodecParams codec;
  int64_t skip_row;
  uint8_t* packets;
  float* residual;
};

// packets [rows, P] (row r's packet at packets + r * row_bytes) -> out [rows, n], each value
// multiplied by `scale` (1: as decoded); work items as for QuantizeJob. out holds out_count
// values (the last row may be short): values past it are not written.
struct DequantizeJob {
  ElementType type;
  const uint8_t* packets;
  int64_t row_bytes;
  int64_t n;
  int bits;
  int64_t bucket_size;
  void* out;
  int64_t out_count;
  float scale;
};

// N peers' packets [N, P] (peer p's at peers + p * row_bytes) of one chunk of n values (+ the
// raw own chunk, replacing peer own_index when own is not null) -> f32 sum in peer order,
// re-encoded into packet_out and/or written to sum_out multiplied by `scale` (either may be
// null; the packet encodes the sum itself); work item i is
// bucket i of the chunk. own holds own_count values of the chunk (a short last row: a
// missing value reads as own[own_count - 1]); sum_out holds sum_count (values past it are
// not written).
struct ReduceJob {
  ElementType own_type;
  const uint8_t* peers;
  int64_t row_bytes;
  int64_t num_peers;
  int64_t n;
  const void* own;
  int64_t own_count;
  int32_t own_index;
  CodecParams codec;
  uint8_t* packet_out;
  float* sum_out;
  int64_t sum_count;
  float scale;
};

struct BucketLoops {
  const char* isa;
  void (*quantize)(const QuantizeJob& job, int64_t begin, int64_t end);
  void (*dequantize)(const DequantizeJob& job, int64_t begin, int64_t end);
  void (*reduce_requantize)(const ReduceJob& job, int64_t begin, int64_t end);
};

namespace isa_generic {
extern const BucketLoops loops;
}
#if defined(__x86_64__) || defined(_M_X64)
namespace isa_avx2 {
extern const BucketLoops loops;
}
namespace isa_avx512 {
extern const BucketLoops loops;
}
#endif

// The variants this CPU runs, narrowest first (x86-64 builds have all three, others the
// generic one: CMakeLists.txt).
inline std::vector<const BucketLoops*> runnable_loops() {
  std::vector<const BucketLoops*> variants = {&isa_generic::loops};
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    variants.push_back(&isa_avx2::loops);
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    variants.push_back(&isa_avx512::loops);
#endif
  return variants;
}

}  // namespace cgx
