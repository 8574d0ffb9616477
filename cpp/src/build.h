// A build directory (`specpilot compile`'s output): manifest.json checked, the VM loaded, the
// parameters on the device.  The manifest is the contract (specpilot/core/manifest.py).
#ifndef SPECPILOT_BUILD_H_
#define SPECPILOT_BUILD_H_

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/extra/module.h>

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "specpilot/engine.hpp"
#include "tensors.h"

namespace specpilot {

constexpr int kManifestVersion = 4;

struct CacheSpec {
  Shape shape;
  DLDataType dtype;
};

struct ModelSpec {
  std::string which;             // "target" or "drafter"
  int64_t vocab_size = 0;
  bool has_gdn = false;          // Gated DeltaNet layers: recurrent states per sequence
  bool tuple_out = false;        // a step returns a tuple: recurrent states, or the target's feature layers (last)
  bool has_attention = false;    // full-attention layers: the KV pool
  std::map<std::string, CacheSpec> caches;   // kv, conv, rec
  std::vector<int32_t> eos_token_ids;
};

struct DrafterSpec {
  std::string kind;              // ngram, model, early-exit (replay is a Python projection tool)
  int draft_len = 1, draft_min = 1, top_k = 1, max_ngram = 4, min_ngram = 1;
  bool draft_dynamic = false;
  double temperature = 1.0;
};

class Build {
 public:
  Build(const std::string& dir, const OpenOptions& options);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& manifest() const { return manifest_; }
  DLDevice device() const { return device_; }
  int capacity() const { return capacity_; }
  // the threads TVM's pool runs a CPU build's kernels on (threads.h); 0 on CUDA builds
  int cpu_threads() const { return cpu_threads_; }
  int max_batch() const { return max_batch_; }
  int tree_budget() const { return tree_budget_; }
  bool two_level() const { return two_level_; }
  bool path_recompute() const { return path_recompute_; }
  int max_verify_tokens() const { return max_verify_tokens_; }   // 0: no limit
  const DrafterSpec& drafter() const { return drafter_; }
  bool has_model(const std::string& which) const { return models_.count(which) > 0; }
  const ModelSpec& model(const std::string& which) const;
  std::optional<ffi::Function> function(const std::string& name) const;
  ffi::Function required(const std::string& name) const;
  const ffi::Array<Tensor>& params() const { return params_; }

 private:
  void ReadManifest();
  void CheckDevice(const std::string& requested);
  void CheckCpuLevel() const;
  void CheckHashes() const;
  void LoadModule();
  void LoadParams();

  std::string dir_;
  nlohmann::json manifest_;
  DLDevice device_{kDLCPU, 0};
  int capacity_ = 0, max_batch_ = 1, tree_budget_ = 0, max_verify_tokens_ = 0, cpu_threads_ = 0;
  bool two_level_ = false, path_recompute_ = false;
  DrafterSpec drafter_;
  std::map<std::string, ModelSpec> models_;
  std::map<std::string, ffi::Function> functions_;
  std::optional<ffi::Module> vm_;
  ffi::Array<Tensor> params_;
};

}  // namespace specpilot
#endif  // SPECPILOT_BUILD_H_
