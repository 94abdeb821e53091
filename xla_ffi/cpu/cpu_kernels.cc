// CPU XLA FFI handlers for the cgx_jax codec: quantize, dequantize, reduce_requantize.
//
// The format and all rounding arithmetic come from codec.h and the loops over buckets from
// bucket_loops.cc (one build per instruction set, chosen here at run time); this file
// validates buffers against attributes and splits large buffers over XLA's intra-op
// thread pool. Built with -ffp-contract=off so results match the CUDA kernels to the bit.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "bucket_loops.h"
#include "codec.h"
#include "module.h"
#include "validate.h"
#include "xla/ffi/api/ffi.h"

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
// threads that are busy (several simulated devices can share a two-thread pool). The pool
// has a thread per core, so the caller and pool threads - 1 helpers fill the cores; and
// there are a few ranges per participant, so the work stays balanced when a core is busy
// with something else (with one range each for the caller and a helper per pool thread,
// 3 participants on 2 cores took 2/3 of the one-thread time instead of 1/2).
template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t items, int64_t elements_per_item, Body body) {
  constexpr int64_t kRangesPerParticipant = 4;
  const int64_t total = items * elements_per_item;
  const int64_t by_size = std::max<int64_t>(1, total / kMinElementsPerTask);
  const int64_t participants =
      std::min<int64_t>({by_size, std::max<int64_t>(pool.num_threads(), 1), items, thread_cap()});
  if (participants <= 1) {
    IeeeDenormals ieee;
    body(int64_t{0}, items);
    return;
  }
  const int64_t ranges = std::min<int64_t>({by_size, items, participants * kRangesPerParticipant});
  // Shared with the helpers, which may outlive this call (they then touch only `next`).
  struct State {
    std::atomic<int64_t> next{0};
    std::mutex mutex;
    std::condition_variable done;
    int64_t finished = 0;
  };
  auto state = std::make_shared<State>();
  auto run_ranges = [state, ranges, items, &body] {
    IeeeDenormals ieee;
    for (int64_t r; (r = state->next.fetch_add(1)) < ranges;) {
      body(items * r / ranges, items * (r + 1) / ranges);
      std::lock_guard<std::mutex> lock(state->mutex);
      if (++state->finished == ranges) state->done.notify_one();
    }
  };
  for (int64_t t = 1; t < participants; ++t) {
    pool.Schedule([state, ranges, run_ranges] {
      if (state->next.load() < ranges) run_ranges();
    });
  }
  run_ranges();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->done.wait(lock, [&] { return state->finished == ranges; });
}

// ---------------------------------------------------------------------------
// Instruction-set dispatch
// ---------------------------------------------------------------------------

// The widest variant this CPU runs: no variant uses an instruction that is slow on some
// CPU that has it (no pext/pdep, no gathers), and the wider one was as fast or faster on
// every kernel where measured (AMD Zen 4, AVX-512 Intel-class; docs/performance.md).
// CGX_JAX_CPU_ISA=generic|avx2|avx512 forces one, or the widest the CPU runs below it.
const BucketLoops& select_loops() {
  const char* forced = std::getenv("CGX_JAX_CPU_ISA");
  const std::string want = forced && *forced ? std::string("isa_") + forced : "";
  const std::vector<const BucketLoops*> variants = runnable_loops();
  const BucketLoops* chosen = variants.front();
  for (const BucketLoops* variant : variants) {
    chosen = variant;
    if (variant->isa == want) break;
  }
  return *chosen;
}

const BucketLoops& loops() {
  static const BucketLoops& selected = select_loops();
  return selected;
}

bool element_type_of(ffi::DataType dtype, ElementType* type) {
  switch (dtype) {
    case ffi::F32:
      *type = ElementType::kF32;
      return true;
    case ffi::BF16:
      *type = ElementType::kBF16;
      return true;
    case ffi::F16:
      *type = ElementType::kF16;
      return true;
    default:
      return false;
  }
}

// ---------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------

// quantize: x [rows, n] (the last row may be short) -> packets [rows, P]; row skip_row (if
// in [0, rows)) -> zero bytes; with a residual (as many values as x) -> x - decode(packets).
ffi::Error QuantizeInto(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                        ffi::Buffer<ffi::S32> skip_row, ffi::ResultBuffer<ffi::U8> packets,
                        float* residual, std::optional<int64_t> residual_count, int64_t bits,
                        int64_t bucket_size, bool stochastic, int64_t n) {
  int64_t rows = 0;
  if (auto e = check_quantize_args(bits, bucket_size, n, x.element_count(),
                                   seed.element_count(), skip_row.element_count(),
                                   packets->dimensions(), residual_count, &rows);
      e.failure())
    return e;
  QuantizeJob job{ElementType::kF32, x.untyped_data(), x.element_count(), n,
                  CodecParams{static_cast<int>(bits), bucket_size, stochastic,
                              seed.typed_data()[0], seed.typed_data()[1]},
                  skip_row.typed_data()[0], packets->typed_data(), residual};
  if (!element_type_of(x.element_type(), &job.type)) return unsupported_dtype("x");
  if (rows * n == 0) return ffi::Error::Success();
  parallel_for(pool, rows * (n / bucket_size), bucket_size,
               [&](int64_t begin, int64_t end) { loops().quantize(job, begin, end); });
  return ffi::Error::Success();
}

// dequantize: the packets [rows, P] at byte `offset` of each row of packets -> x' [rows, n]
// (the last row may be short)
ffi::Error Dequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> packets,
                      ffi::Result<ffi::AnyBuffer> x, int64_t bits, int64_t bucket_size,
                      int64_t offset, int64_t n, int64_t divisor) {
  int64_t rows = 0, row_bytes = 0;
  if (auto e = check_dequantize_args(bits, bucket_size, n, offset, divisor, x->element_count(),
                                     packets.dimensions(), &rows, &row_bytes);
      e.failure())
    return e;
  DequantizeJob job{ElementType::kF32, packets.typed_data() + offset, row_bytes, n,
                    static_cast<int>(bits), bucket_size, x->untyped_data(), x->element_count(),
                    reciprocal_of(divisor)};
  if (!element_type_of(x->element_type(), &job.type)) return unsupported_dtype("output");
  if (rows * n == 0) return ffi::Error::Success();
  parallel_for(pool, rows * (n / bucket_size), bucket_size,
               [&](int64_t begin, int64_t end) { loops().dequantize(job, begin, end); });
  return ffi::Error::Success();
}

// The three reduce targets: N peers' packets of one chunk (at byte `offset` of each row of
// peers, + this participant's raw chunk) -> f32 sum in peer order 0..N-1, written as `out`
// says (re-encoded once, and/or the sum itself). `seed` is null for the sum alone.
ffi::Error ReduceInto(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> peers, ffi::AnyBuffer own,
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
  ReduceJob job{ElementType::kF32, peers.typed_data() + offset, row_bytes, num_peers, n,
                own.element_count() ? own.untyped_data() : nullptr, own.element_count(),
                own_index.typed_data()[0],
                CodecParams{static_cast<int>(bits), bucket_size, stochastic,
                            seed ? seed->typed_data()[0] : 0u, seed ? seed->typed_data()[1] : 0u},
                out.packet, out.sum, out.sum_count, reciprocal_of(divisor)};
  if (!element_type_of(own.element_type(), &job.own_type)) return unsupported_dtype("own");
  // The raw chunk replaces the own_index-th peer, which must then name a real peer.
  if (job.own != nullptr && (job.own_index < 0 || job.own_index >= num_peers)) {
    return ffi::Error::InvalidArgument("own_index must be in [0, " + std::to_string(num_peers) +
                                       ") when own is given, got " +
                                       std::to_string(job.own_index));
  }
  // own given as all N rows (SRA's input buffer, so no copy of the own chunk; the last row
  // may be short): read row own_index.
  if (job.own != nullptr && own.element_count() > n) {
    const int64_t element_bytes = job.own_type == ElementType::kF32 ? 4 : 2;
    job.own = static_cast<const char*>(job.own) + job.own_index * n * element_bytes;
    job.own_count -= job.own_index * n;
  }
  if (n == 0) return ffi::Error::Success();
  parallel_for(pool, n / bucket_size, bucket_size * num_peers,
               [&](int64_t begin, int64_t end) { loops().reduce_requantize(job, begin, end); });
  return ffi::Error::Success();
}

}  // namespace

using Cpu = TargetHandlers<ffi::ThreadPool, &QuantizeInto, &ReduceInto>;
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_quantize_cpu, Cpu::Quantize,
                              quantize_binding<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_quantize_with_residual_cpu, Cpu::QuantizeWithResidual,
                              quantize_with_residual_binding<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_dequantize_cpu, Dequantize,
                              dequantize_binding<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_reduce_requantize_cpu, Cpu::ReduceRequantize,
                              reduce_requantize_binding<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_reduce_requantize_with_sum_cpu, Cpu::ReduceRequantizeWithSum,
                              reduce_requantize_with_sum_binding<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(cgx_reduce_sum_cpu, Cpu::ReduceSum,
                              reduce_sum_binding<ffi::ThreadPool>());

}  // namespace cgx

NB_MODULE(_cgx_cpu, m) {
  cgx::define_common(m);
  m.def("registrations", []() {
    return cgx::registrations({cgx::cgx_quantize_cpu, cgx::cgx_quantize_with_residual_cpu,
                               cgx::cgx_dequantize_cpu, cgx::cgx_reduce_requantize_cpu,
                               cgx::cgx_reduce_requantize_with_sum_cpu, cgx::cgx_reduce_sum_cpu});
  });
  m.def("cpu_isa", []() { return std::string(cgx::loops().isa); },
        "The instruction-set variant of the bucket loops this process uses.");
  m.def("cpu_variants", []() {
    std::vector<std::string> names;
    for (const cgx::BucketLoops* variant : cgx::runnable_loops()) names.push_back(variant->isa);
    return names;
  }, "The instruction-set variants of the bucket loops this CPU runs, narrowest first.");
}
