// Runs the CPU bucket loops (xla_ffi/cpu/bucket_loops.cc) without Python or XLA, for two
// purposes (tests/test_cpu_loops.py, docs/design.md section 3):
//   loops_check digest       one line per variant this CPU runs: "isa_name <hash>", a hash of
//                            every byte the loops write over inputs that take every code path
//                            (all bits, both roundings, f32/bf16/f16, buckets wider than the
//                            largest float, subnormals, NaN, a short last row, scaled means).
//                            Built for aarch64 and run under qemu-user, its generic line must
//                            equal the x86-64 build's: the same bytes on both architectures.
//   loops_check time [N]     single-thread milliseconds per call of each variant on N f32
//                            values (default 16M), 4-bit stochastic, next to a memcpy.
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bucket_loops.h"
#include "codec.h"

namespace {

using cgx::BucketLoops;

// FNV-1a over bytes: the same on every architecture.
struct Hash {
  uint64_t h = 1469598103934665603ull;
  void add(const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < size; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
};

// A deterministic input: integer noise turned into floats by exact operations only, spread
// over magnitudes; with edge_cases (rows >= 3), those of the Python variant test.
std::vector<float> make_input(int64_t rows, int64_t n, bool edge_cases) {
  std::vector<float> x(rows * n);
  uint64_t state = 0x9E3779B97F4A7C15ull;
  for (int64_t i = 0; i < rows * n; ++i) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    const float unit = static_cast<float>(static_cast<int32_t>(state >> 40) - (1 << 23)) *
                       1.1920928955078125e-07f;  // [-1, 1) in steps of 2^-23
    static const float scales[6] = {1e-3f, 1e-2f, 1e-1f, 1.0f, 10.0f, 100.0f};
    x[i] = unit * scales[(i / n) % 6];
  }
  if (!edge_cases) return x;
  for (int64_t k = 0; k < 64; ++k) {
    x[k] = (static_cast<float>(k) - 31.5f) * (3e38f / 31.5f);  // wider than the largest float
    x[n + 64 + k] = static_cast<float>(k) * 1e-41f;           // subnormals
  }
  x[2 * n + 5] = std::numeric_limits<float>::quiet_NaN();
  return x;
}

std::vector<uint16_t> narrow(const std::vector<float>& x, cgx::ElementType type) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    out[i] = type == cgx::ElementType::kBF16 ? cgx::float_to_bf16(x[i]) : cgx::float_to_f16(x[i]);
  return out;
}

uint64_t digest(const BucketLoops& loops) {
  const int64_t rows = 3, n = 4032, count = rows * n - 40;  // a short last row
  const std::vector<float> x32 = make_input(rows, n, true);
  Hash hash;
  // Buckets of one, three and eight 8-value groups (odd and even vector counts).
  for (int64_t bucket : {8, 24, 64}) {
  for (int bits = 1; bits <= 8; ++bits) {
    for (bool stochastic : {true, false}) {
      for (auto type : {cgx::ElementType::kF32, cgx::ElementType::kBF16, cgx::ElementType::kF16}) {
        std::vector<uint16_t> x16;
        const void* x = x32.data();
        if (type != cgx::ElementType::kF32) x = (x16 = narrow(x32, type)).data();
        const int64_t element_bytes = type == cgx::ElementType::kF32 ? 4 : 2;
        const cgx::CodecParams codec{bits, bucket, stochastic, 0x1234u, 0xABCDu};
        const int64_t pbytes = cgx::packet_bytes(n, bits, bucket), nb = n / bucket;
        std::vector<uint8_t> packets(rows * pbytes);
        cgx::QuantizeJob quantize{type, x, count, n, codec, /*skip_row=*/-1, packets.data()};
        loops.quantize(quantize, 0, rows * nb);
        hash.add(packets.data(), packets.size());

        for (float scale : {1.0f, 0.25f}) {
          std::vector<uint8_t> decoded(count * element_bytes);
          cgx::DequantizeJob dequantize{type, packets.data(), pbytes, n, bits, bucket,
                                        decoded.data(), count, scale};
          loops.dequantize(dequantize, 0, rows * nb);
          hash.add(decoded.data(), decoded.size());
        }

        std::vector<uint8_t> packet_out(pbytes);
        std::vector<float> sum(n - 8);  // a short sum: the last bucket is cut
        cgx::ReduceJob reduce{type, packets.data(), pbytes, rows, n,
                              static_cast<const char*>(x) + n * element_bytes, n, 1, codec,
                              packet_out.data(), sum.data(), n - 8, 1.0f / 3.0f};
        loops.reduce_requantize(reduce, 0, nb);
        hash.add(packet_out.data(), packet_out.size());
        hash.add(sum.data(), sum.size() * sizeof(float));
      }
    }
  }
  }
  return hash.h;
}

template <typename Fn>
double best_ms(Fn fn, int repeats) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    const std::chrono::duration<double, std::milli> took = std::chrono::steady_clock::now() - start;
    best = took.count() < best ? took.count() : best;
  }
  return best;
}

void time_variants(int64_t n) {
  const int bits = 4, peers = 8;
  const int64_t bucket = 1024, nb = n / bucket, pbytes = cgx::packet_bytes(n, bits, bucket);
  const cgx::CodecParams codec{bits, bucket, true, 1234u, 5678u};
  std::vector<float> x = make_input(1, n, false), out(n);
  std::vector<uint8_t> packets(pbytes);
  std::printf("%-12s %10s %10s %10s %10s  (ms, one thread, %" PRId64 " f32, 4-bit)\n", "variant",
              "memcpy", "quantize", "dequantize", "reduce N=8", n);
  for (const BucketLoops* loops : cgx::runnable_loops()) {
    const double copy = best_ms([&] { std::memcpy(out.data(), x.data(), n * 4); }, 10);
    const cgx::QuantizeJob q{cgx::ElementType::kF32, x.data(), n, n, codec, -1, packets.data()};
    const double quantize = best_ms([&] { loops->quantize(q, 0, nb); }, 10);
    const cgx::DequantizeJob d{cgx::ElementType::kF32, packets.data(), pbytes, n, bits, bucket,
                               out.data(), n, 1.0f};
    const double dequantize = best_ms([&] { loops->dequantize(d, 0, nb); }, 10);
    const int64_t chunk = n / peers, cbytes = cgx::packet_bytes(chunk, bits, bucket);
    std::vector<uint8_t> packet_out(cbytes);
    const cgx::ReduceJob r{cgx::ElementType::kF32, packets.data(), cbytes, peers, chunk, x.data(),
                           chunk, 0, codec, packet_out.data(), nullptr, 0, 1.0f};
    const double reduce = best_ms([&] { loops->reduce_requantize(r, 0, chunk / bucket); }, 10);
    std::printf("%-12s %10.2f %10.2f %10.2f %10.2f\n", loops->isa, copy, quantize, dequantize,
                reduce);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "digest";
  if (mode == "digest") {
    for (const BucketLoops* loops : cgx::runnable_loops())
      std::printf("%s %016" PRIx64 "\n", loops->isa, digest(*loops));
    return 0;
  }
  if (mode == "time") {
    time_variants(argc > 2 ? std::atoll(argv[2]) : int64_t{1} << 24);
    return 0;
  }
  std::fprintf(stderr, "usage: loops_check digest | time [N]\n");
  return 2;
}
