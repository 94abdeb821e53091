// CPU XLA FFI handlers for the cgx_jax codec: quantize, dequantize, reduce_requantize.
//
// The format and all rounding arithmetic come from codec.h; this file only walks buckets,
// validates buffers against attributes, and splits large buffers over XLA's intra-op
// thread pool. Built with -ffp-contract=off so results match the CUDA kernels to the bit.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "codec.h"
#include "validate.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace cgx {
namespace {

// ---------------------------------------------------------------------------
// Work splitting
// ---------------------------------------------------------------------------

// Below this many elements a single thread is faster than waking the pool.
constexpr int64_t kMinElementsPerTask = int64_t{1} << 18;

// CGX_JAX_CPU_THREADS=k caps the threads one kernel call uses (k=1: the calling thread
// only), for benchmarks and for hosts that already run one process per core.
int64_t thread_cap() {
  static const int64_t cap = [] {
    const char* value = std::getenv("CGX_JAX_CPU_THREADS");
    const long long parsed = value ? std::atoll(value) : 0;
    return parsed > 0 ? static_cast<int64_t>(parsed) : std::numeric_limits<int64_t>::max();
  }();
  return cap;
}

// XLA's CPU runtime runs with flush-to-zero and denormals-are-zero set; the format is
// defined in IEEE arithmetic (and CUDA computes it so), so each kernel body clears both
// modes for its duration and restores the caller's afterwards.
class IeeeDenormals {
 public:
#if defined(__x86_64__) || defined(_M_X64)
  IeeeDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~kFlushBits); }
  ~IeeeDenormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushBits = 0x8040;  // FTZ (bit 15) and DAZ (bit 6)
  unsigned saved_;
#elif defined(__aarch64__)
  IeeeDenormals() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t ieee = saved_ & ~(uint64_t{1} << 24);  // FZ
    asm volatile("msr fpcr, %0" : : "r"(ieee));
  }
  ~IeeeDenormals() { asm volatile("msr fpcr, %0" : : "r"(saved_)); }

 private:
  uint64_t saved_;
#endif
};

// Runs body(begin, end) over [0, items) split into contiguous ranges. The calling thread
// claims ranges itself until none are left, and helpers scheduled on the pool claim them
// too when they get a thread; the caller then waits only for ranges already being worked
// on. A helper that starts late finds nothing to claim, so a kernel never waits for pool
// threads that are busy (several simulated devices can share a two-thread pool).
template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t items, int64_t elements_per_item, Body body) {
  const int64_t total = items * elements_per_item;
  const int64_t by_size = std::max<int64_t>(1, total / kMinElementsPerTask);
  const int64_t tasks =
      std::min<int64_t>({by_size, pool.num_threads() + 1, items, thread_cap()});
  if (tasks <= 1) {
    IeeeDenormals ieee;
    body(int64_t{0}, items);
    return;
  }
  // Shared with the helpers, which may outlive this call (they then touch only `next`).
  struct State {
    std::atomic<int64_t> next{0};
    std::mutex mutex;
    std::condition_variable done;
    int64_t finished = 0;
  };
  auto state = std::make_shared<State>();
  auto run_ranges = [state, tasks, items, &body] {
    for (int64_t t; (t = state->next.fetch_add(1)) < tasks;) {
      {
        IeeeDenormals ieee;
        body(items * t / tasks, items * (t + 1) / tasks);
      }
      std::lock_guard<std::mutex> lock(state->mutex);
      if (++state->finished == tasks) state->done.notify_one();
    }
  };
  for (int64_t t = 1; t < tasks; ++t) {
    pool.Schedule([state, tasks, run_ranges] {
      if (state->next.load() < tasks) run_ranges();
    });
  }
  run_ranges();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->done.wait(lock, [&] { return state->finished == tasks; });
}

// ---------------------------------------------------------------------------
// One bucket
// ---------------------------------------------------------------------------

template <typename Tag>
void bucket_range(const typename Tag::storage* x, int64_t size, float* mn_out, float* mx_out,
                  bool* finite_out) {
  // Eight independent lanes so the compiler can keep them in one vector register.
  float lo[8], hi[8];
  uint32_t nonfinite[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < 8; ++k) lo[k] = hi[k] = load_as_float(x, k, Tag{});
  for (int64_t j = 0; j < size; j += 8) {
    for (int k = 0; k < 8; ++k) {
      const float v = load_as_float(x, j + k, Tag{});
      lo[k] = v < lo[k] ? v : lo[k];
      hi[k] = v > hi[k] ? v : hi[k];
      nonfinite[k] |= (float_bits(v) & 0x7F800000u) == 0x7F800000u;
    }
  }
  float mn = lo[0], mx = hi[0];
  uint32_t bad = nonfinite[0];
  for (int k = 1; k < 8; ++k) {
    mn = lo[k] < mn ? lo[k] : mn;
    mx = hi[k] > mx ? hi[k] : mx;
    bad |= nonfinite[k];
  }
  *mn_out = mn;
  *mx_out = mx;
  *finite_out = bad == 0;
}

// Encodes `size` (a multiple of 8) values with a known scale; `counter` is the element
// index of x[0], which keys the stochastic rounding noise.
template <bool kStochastic, typename Tag>
void encode_values(const typename Tag::storage* x, int64_t size, const BucketScale& s, int bits,
                   uint32_t seed0, uint32_t seed1, uint32_t counter, uint8_t* codes) {
  const uint32_t top = max_level(bits);
  for (int64_t j = 0; j < size; j += 8) {
    uint32_t levels[8];
    for (int k = 0; k < 8; ++k) {
      const float u = kStochastic
                          ? uniform01(seed0, seed1, counter + static_cast<uint32_t>(j + k))
                          : 0.5f;
      levels[k] = encode_level(load_as_float(x, j + k, Tag{}), s, u, top);
    }
    pack8(levels, bits, codes + (j / 8) * bits);
  }
}

struct CodecParams {
  int bits;
  int64_t bucket_size;
  bool stochastic;
  uint32_t seed0;
  uint32_t seed1;
};

// Quantizes one bucket of `p.bucket_size` values into meta slot `bucket` of `packet`.
template <typename Tag>
void quantize_bucket(const typename Tag::storage* x, const CodecParams& p, uint32_t counter,
                     int64_t bucket, uint8_t* packet, uint8_t* codes) {
  float mn, mx;
  bool finite;
  bucket_range<Tag>(x, p.bucket_size, &mn, &mx, &finite);
  const BucketScale s = make_scale(mn, mx, finite, p.bits);
  store_meta(packet, bucket, s.min, s.unit);
  if (!finite) {
    std::fill(codes, codes + code_bytes_per_bucket(p.bits, p.bucket_size), uint8_t{0});
  } else if (p.stochastic) {
    encode_values<true, Tag>(x, p.bucket_size, s, p.bits, p.seed0, p.seed1, counter, codes);
  } else {
    encode_values<false, Tag>(x, p.bucket_size, s, p.bits, p.seed0, p.seed1, counter, codes);
  }
}

// Decodes one bucket of `packet`, handing each value to emit(index_in_bucket, value).
template <typename Emit>
void dequantize_bucket(const uint8_t* packet, int64_t bucket, const uint8_t* codes, int bits,
                       int64_t bucket_size, Emit emit) {
  float mn, unit;
  load_meta(packet, bucket, &mn, &unit);
  for (int64_t j = 0; j < bucket_size; j += 8) {
    uint32_t levels[8];
    unpack8(codes + (j / 8) * bits, bits, levels);
    for (int k = 0; k < 8; ++k) emit(j + k, decode_level(levels[k], mn, unit));
  }
}

// ---------------------------------------------------------------------------
// quantize: x [rows, n] -> packets [rows, P]
// ---------------------------------------------------------------------------

template <typename Tag>
void quantize_rows(const typename Tag::storage* x, int64_t rows, int64_t n, const CodecParams& p,
                   uint8_t* out, ffi::ThreadPool& pool) {
  const int64_t nb = n / p.bucket_size;
  const int64_t pbytes = packet_bytes(n, p.bits, p.bucket_size);
  const int64_t cbytes = code_bytes_per_bucket(p.bits, p.bucket_size);
  parallel_for(pool, rows * nb, p.bucket_size, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / nb, bucket = i % nb;
      uint8_t* packet = out + row * pbytes;
      const int64_t first = row * n + bucket * p.bucket_size;
      quantize_bucket<Tag>(x + first, p, static_cast<uint32_t>(first), bucket, packet,
                           packet + nb * kMetaBytesPerBucket + bucket * cbytes);
    }
  });
}

ffi::Error Quantize(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                    ffi::ResultBuffer<ffi::U8> packets, int64_t bits, int64_t bucket_size,
                    bool stochastic) {
  int64_t rows = 0, n = 0;
  if (auto e = check_codec(bits, bucket_size); e.failure()) return e;
  if (auto e = rows_and_length(x.dimensions(), "x", &rows, &n); e.failure()) return e;
  if (auto e = check_multiple(n, bucket_size, "x"); e.failure()) return e;
  if (auto e = check_count(seed.element_count(), 2, "seed"); e.failure()) return e;
  const int64_t pbytes = packet_bytes(n, static_cast<int>(bits), bucket_size);
  if (auto e = check_count(packets->element_count(), rows * pbytes, "packets"); e.failure())
    return e;
  if (rows * n == 0) return ffi::Error::Success();
  const CodecParams p{static_cast<int>(bits), bucket_size, stochastic, seed.typed_data()[0],
                      seed.typed_data()[1]};
  uint8_t* out = packets->typed_data();
  switch (x.element_type()) {
    case ffi::F32:
      quantize_rows<F32>(x.typed_data<float>(), rows, n, p, out, pool);
      break;
    case ffi::BF16:
      quantize_rows<BF16>(x.reinterpret_data<uint16_t>(), rows, n, p, out, pool);
      break;
    case ffi::F16:
      quantize_rows<F16>(x.reinterpret_data<uint16_t>(), rows, n, p, out, pool);
      break;
    default:
      return unsupported_dtype("x");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// dequantize: packets [rows, P] -> x' [rows, n]
// ---------------------------------------------------------------------------

template <typename Tag>
void dequantize_rows(const uint8_t* in, int64_t rows, int64_t n, int bits, int64_t bucket_size,
                     typename Tag::storage* out, ffi::ThreadPool& pool) {
  const int64_t nb = n / bucket_size;
  const int64_t pbytes = packet_bytes(n, bits, bucket_size);
  const int64_t cbytes = code_bytes_per_bucket(bits, bucket_size);
  parallel_for(pool, rows * nb, bucket_size, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / nb, bucket = i % nb;
      const uint8_t* packet = in + row * pbytes;
      typename Tag::storage* dst = out + row * n + bucket * bucket_size;
      dequantize_bucket(packet, bucket, packet + nb * kMetaBytesPerBucket + bucket * cbytes,
                        bits, bucket_size,
                        [&](int64_t j, float v) { store_from_float(dst, j, canonical_nan(v), Tag{}); });
    }
  });
}

ffi::Error Dequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> packets, ffi::Result<ffi::AnyBuffer> x,
                      int64_t bits, int64_t bucket_size) {
  int64_t rows = 0, n = 0;
  if (auto e = check_codec(bits, bucket_size); e.failure()) return e;
  if (auto e = rows_and_length(x->dimensions(), "output", &rows, &n); e.failure()) return e;
  if (auto e = check_multiple(n, bucket_size, "output"); e.failure()) return e;
  const int64_t pbytes = packet_bytes(n, static_cast<int>(bits), bucket_size);
  if (auto e = check_count(packets.element_count(), rows * pbytes, "packets"); e.failure())
    return e;
  if (rows * n == 0) return ffi::Error::Success();
  const uint8_t* in = packets.typed_data();
  const int b = static_cast<int>(bits);
  switch (x->element_type()) {
    case ffi::F32:
      dequantize_rows<F32>(in, rows, n, b, bucket_size, x->typed_data<float>(), pool);
      break;
    case ffi::BF16:
      dequantize_rows<BF16>(in, rows, n, b, bucket_size, x->reinterpret_data<uint16_t>(), pool);
      break;
    case ffi::F16:
      dequantize_rows<F16>(in, rows, n, b, bucket_size, x->reinterpret_data<uint16_t>(), pool);
      break;
    default:
      return unsupported_dtype("output");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// reduce_requantize: N peers' packets of one chunk (+ this participant's raw chunk) ->
// f32 sum in peer order 0..N-1, re-encoded once.
// ---------------------------------------------------------------------------

template <typename Tag>
void reduce_chunk(const uint8_t* peers, int64_t num_peers, int64_t n,
                  const typename Tag::storage* own, int32_t own_index, const CodecParams& p,
                  uint8_t* packet_out, float* sum_out, ffi::ThreadPool& pool) {
  const int64_t nb = n / p.bucket_size;
  const int64_t pbytes = packet_bytes(n, p.bits, p.bucket_size);
  const int64_t cbytes = code_bytes_per_bucket(p.bits, p.bucket_size);
  parallel_for(pool, nb, p.bucket_size * num_peers, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> scratch(sum_out ? nullptr : new float[p.bucket_size]);
    for (int64_t bucket = begin; bucket < end; ++bucket) {
      const int64_t first = bucket * p.bucket_size;
      float* acc = sum_out ? sum_out + first : scratch.get();
      std::fill(acc, acc + p.bucket_size, 0.0f);
      for (int64_t peer = 0; peer < num_peers; ++peer) {
        if (peer == own_index) {
          for (int64_t j = 0; j < p.bucket_size; ++j)
            acc[j] = add_rn(acc[j], load_as_float(own, first + j, Tag{}));
        } else {
          const uint8_t* packet = peers + peer * pbytes;
          dequantize_bucket(packet, bucket, packet + nb * kMetaBytesPerBucket + bucket * cbytes,
                            p.bits, p.bucket_size,
                            [&](int64_t j, float v) { acc[j] = add_rn(acc[j], v); });
        }
      }
      if (sum_out) {
        for (int64_t j = 0; j < p.bucket_size; ++j) acc[j] = canonical_nan(acc[j]);
      }
      if (packet_out) {
        quantize_bucket<F32>(acc, p, static_cast<uint32_t>(first), bucket, packet_out,
                             packet_out + nb * kMetaBytesPerBucket + bucket * cbytes);
      }
    }
  });
}

ffi::Error ReduceRequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> peers, ffi::AnyBuffer own,
                            ffi::Buffer<ffi::S32> own_index, ffi::Buffer<ffi::U32> seed,
                            ffi::ResultBuffer<ffi::U8> packet, ffi::ResultBuffer<ffi::F32> sum,
                            int64_t bits, int64_t bucket_size, bool stochastic, int64_t n) {
  if (auto e = check_codec(bits, bucket_size); e.failure()) return e;
  if (auto e = check_multiple(n, bucket_size, "n"); e.failure()) return e;
  const int64_t pbytes = packet_bytes(n, static_cast<int>(bits), bucket_size);
  int64_t num_peers = 0, peer_bytes = 0;
  if (auto e = rows_and_length(peers.dimensions(), "peers", &num_peers, &peer_bytes); e.failure())
    return e;
  if (auto e = check_count(peer_bytes, pbytes, "peers row"); e.failure()) return e;
  if (auto e = check_count(seed.element_count(), 2, "seed"); e.failure()) return e;
  if (auto e = check_count(own_index.element_count(), 1, "own_index"); e.failure()) return e;
  if (auto e = check_count_or_empty(own.element_count(), n, "own"); e.failure()) return e;
  if (auto e = check_count_or_empty(packet->element_count(), pbytes, "packet"); e.failure())
    return e;
  if (auto e = check_count_or_empty(sum->element_count(), n, "sum"); e.failure()) return e;
  // With no raw chunk every peer is decoded; otherwise the raw chunk replaces the
  // own_index-th peer, which must then name a real peer.
  int32_t own_peer = own_index.typed_data()[0];
  if (own.element_count() == 0) {
    own_peer = -1;
  } else if (own_peer < 0 || own_peer >= num_peers) {
    return ffi::Error::InvalidArgument("own_index must be in [0, " + std::to_string(num_peers) +
                                       ") when own is given, got " + std::to_string(own_peer));
  }
  if (n == 0 || (packet->element_count() == 0 && sum->element_count() == 0))
    return ffi::Error::Success();
  const CodecParams p{static_cast<int>(bits), bucket_size, stochastic, seed.typed_data()[0],
                      seed.typed_data()[1]};
  uint8_t* packet_out = packet->element_count() ? packet->typed_data() : nullptr;
  float* sum_out = sum->element_count() ? sum->typed_data() : nullptr;
  const uint8_t* in = peers.typed_data();
  switch (own.element_type()) {
    case ffi::F32:
      reduce_chunk<F32>(in, num_peers, n, own.typed_data<float>(), own_peer, p, packet_out,
                        sum_out, pool);
      break;
    case ffi::BF16:
      reduce_chunk<BF16>(in, num_peers, n, own.reinterpret_data<uint16_t>(), own_peer, p,
                         packet_out, sum_out, pool);
      break;
    case ffi::F16:
      reduce_chunk<F16>(in, num_peers, n, own.reinterpret_data<uint16_t>(), own_peer, p,
                        packet_out, sum_out, pool);
      break;
    default:
      return unsupported_dtype("own");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_quantize_cpu, Quantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<bool>("stochastic"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_dequantize_cpu, Dequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_reduce_requantize_cpu, ReduceRequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<bool>("stochastic")
                                  .Attr<int64_t>("n"));

}  // namespace cgx

template <typename T>
static nb::capsule encapsulate(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_cgx_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["cgx_quantize"] = encapsulate(cgx::cgx_quantize_cpu);
    targets["cgx_dequantize"] = encapsulate(cgx::cgx_dequantize_cpu);
    targets["cgx_reduce_requantize"] = encapsulate(cgx::cgx_reduce_requantize_cpu);
    return targets;
  });
}
