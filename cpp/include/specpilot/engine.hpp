// SpecPilot's C++ API (the C API in specpilot.h wraps it): a build directory's compiled engines
// driven with the TVM runtime alone, token-identical to the Python engine.
#ifndef SPECPILOT_ENGINE_HPP_
#define SPECPILOT_ENGINE_HPP_

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace specpilot {

enum class Status { kOk = 0, kInvalidArgument = 1, kBuild = 2, kDevice = 3, kCapacity = 4, kRuntime = 5 };

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  Status status() const { return status_; }

 private:
  Status status_;
};

struct Sampling {
  double temperature = 0.0;  // 0: greedy
  double top_p = 1.0;
  int64_t top_k = 0;         // 0: no cut
  uint64_t seed = 0;
  bool greedy() const { return temperature == 0.0; }
};

struct GenerateOptions {
  std::string engine;        // "": the build's best engine
  int max_new_tokens = 64;
  bool stop_at_eos = false;
  Sampling sampling;
  std::function<bool(int32_t)> on_token;   // false: end the generation at this token
};

struct Generation {
  std::vector<int32_t> tokens;
  std::vector<int32_t> accepted;   // tokens committed per target pass
  double seconds = 0.0;
};

struct OpenOptions {
  std::string device;              // "cpu", "cuda", "cuda:N"; "": the build's kind, device 0
  bool verify_hashes = true;
};

class Batch;

class Engine {
 public:
  static std::unique_ptr<Engine> Open(const std::string& build_dir, const OpenOptions& options = {});
  ~Engine();
  Generation Generate(const std::vector<int32_t>& prompt, const GenerateOptions& options);
  std::vector<std::string> Engines() const;
  std::string InfoJson() const;
  std::unique_ptr<Batch> NewBatch();

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Continuous batching of autoregressive requests (see sp_batch_* in specpilot.h).
class Batch {
 public:
  ~Batch();
  uint64_t Add(const std::vector<int32_t>& prompt, const GenerateOptions& options);
  std::vector<uint64_t> Step();          // the requests that finished in this step
  size_t Pending() const;                // running + waiting
  Generation Take(uint64_t request_id);  // a finished request's result, once

  struct Impl;
  explicit Batch(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace specpilot
#endif  // SPECPILOT_ENGINE_HPP_
