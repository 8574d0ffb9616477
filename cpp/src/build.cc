#include "build.h"

#include <dlfcn.h>
#include <openssl/evp.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>

#include "safetensors.h"
#include "threads.h"

namespace specpilot {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(Status::kBuild, path + ": cannot read");
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

bool IsFile(const std::string& path) {
  std::ifstream f(path);
  return static_cast<bool>(f);
}

std::string Sha256Hex(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) throw Error(Status::kBuild, path + ": missing from the build");
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  std::vector<char> block(1 << 22);
  size_t n;
  while ((n = std::fread(block.data(), 1, block.size(), f)) > 0) EVP_DigestUpdate(ctx.get(), block.data(), n);
  std::fclose(f);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &len);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out += hex[digest[i] >> 4];
    out += hex[digest[i] & 15];
  }
  return out;
}

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

DLDevice ParseDevice(const std::string& text) {
  if (text == "cpu") return {kDLCPU, 0};
  if (text == "cuda") return {kDLCUDA, 0};
  if (text.rfind("cuda:", 0) == 0) {
    char* end = nullptr;
    long id = std::strtol(text.c_str() + 5, &end, 10);
    if (end != text.c_str() + 5 && *end == '\0' && id >= 0 && id < 1024) return {kDLCUDA, static_cast<int>(id)};
  }
  throw Error(Status::kInvalidArgument, "device '" + text + "': expected cpu, cuda or cuda:N");
}

void LoadCudaRuntime() {
  const char* env = std::getenv("SPECPILOT_TVM_LIBDIR");
  std::string path = std::string(env ? env : SPECPILOT_TVM_LIBDIR) + "/libtvm_runtime_cuda.so";
  if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    const char* why = dlerror();
    throw Error(Status::kDevice, "cannot load TVM's CUDA runtime " + path + " (" + (why ? why : "?") + ")");
  }
}

// "sm_90" / "sm_90a" / "sm_120" -> (major, minor)
std::pair<int, int> ArchVersion(const std::string& arch) {
  std::string digits;
  for (char c : arch.substr(arch.rfind('_') + 1)) {
    if (c >= '0' && c <= '9') digits += c;
  }
  if (digits.size() < 2) throw Error(Status::kBuild, "manifest.json: unreadable arch " + arch);
  return {std::stoi(digits.substr(0, digits.size() - 1)), digits.back() - '0'};
}

}  // namespace

Build::Build(const std::string& dir, const OpenOptions& options) : dir_(dir) {
  ReadManifest();
  CheckDevice(options.device);
  if (options.verify_hashes) CheckHashes();
  if (device_.device_type == kDLCPU) ClaimCoresForTvm();   // before the pool starts
  LoadModule();
  if (device_.device_type == kDLCPU) {
    auto threads = ffi::Function::GetGlobal("runtime.NumThreads");   // what TVM's pool runs kernels on
    if (threads.has_value()) cpu_threads_ = (*threads)().cast<int>();
  }
  LoadParams();
}

void Build::ReadManifest() {
  std::string path = dir_ + "/manifest.json";
  if (!IsFile(path)) throw Error(Status::kBuild, dir_ + ": not a build directory (no manifest.json); run `specpilot compile` first");
  std::string text = ReadFile(path);
  manifest_ = nlohmann::json::parse(text, nullptr, false);
  if (manifest_.is_discarded() || !manifest_.is_object() || manifest_.value("format", "") != "specpilot-build") {
    throw Error(Status::kBuild, path + ": not a SpecPilot build manifest");
  }
  if (manifest_.value("version", -1) != kManifestVersion) {
    throw Error(Status::kBuild, path + ": build format version " + manifest_["version"].dump() + ", this runtime reads version " +
                                    std::to_string(kManifestVersion) + "; rebuild with `specpilot compile`");
  }
  std::string sidecar = dir_ + "/manifest.sha256";
  if (!IsFile(sidecar)) throw Error(Status::kBuild, path + ": no manifest.sha256 beside it; compile it again");
  if (Sha256Hex(path) != Trim(ReadFile(sidecar))) {
    throw Error(Status::kBuild, path + ": does not match manifest.sha256 (edited or corrupt); compile it again");
  }
  try {
    const auto& m = manifest_;
    if (m.at("params_source") != "file") {
      throw Error(Status::kBuild, dir_ + ": parameters are '" + m["params_source"].get<std::string>() +
                                      "' (made again by Python at load time); the C++ runtime reads params/params.safetensors: "
                                      "compile with --params file, or write them in with `specpilot materialize BUILD -o NEW`");
    }
    if (!m.contains("caches") || m["caches"].is_null()) {
      throw Error(Status::kBuild, path + ": no 'caches' field (made by an older SpecPilot); compile it again");
    }
    capacity_ = m.at("capacity").get<int>();
    max_batch_ = m.at("max_batch").get<int>();
    tree_budget_ = m.at("tree").is_null() ? 0 : m["tree"].at("budget").get<int>();
    two_level_ = m.value("two_level", false);
    if (!m.at("gdn_verify").is_null()) {
      path_recompute_ = true;
      const auto& limit = m["gdn_verify"]["max_tokens"];
      max_verify_tokens_ = limit.is_null() ? 0 : limit.get<int>();
    }
    const auto& d = m.at("drafter");
    const auto& s = m.at("serving");
    drafter_ = DrafterSpec{d.at("kind").get<std::string>(), s.at("draft_len").get<int>(), s.value("draft_min", 1),
                           d.at("top_k").get<int>(), d.at("max_ngram").get<int>(), d.at("min_ngram").get<int>(),
                           s.value("draft_dynamic", false), d.value("temperature", 1.0)};
    for (auto& [which, cfg] : m.at("models").items()) {
      ModelSpec spec;
      spec.which = which;
      spec.vocab_size = cfg.at("vocab_size").get<int64_t>();
      for (const auto& kind : cfg.at("layer_types")) {
        spec.has_gdn |= kind == "linear_attention";
        spec.has_attention |= kind == "full_attention";
      }
      if (cfg.contains("eos_token_ids")) spec.eos_token_ids = cfg["eos_token_ids"].get<std::vector<int32_t>>();
      for (auto& [name, cache] : m.at("caches").at(which).items()) {
        spec.caches[name] = CacheSpec{cache.at("shape").get<Shape>(), ParseDtype(cache.at("dtype").get<std::string>())};
      }
      // a target built for a block / feature drafter also returns hidden states (read by the Python drafter only)
      spec.tuple_out = spec.has_gdn || (which == "target" && m.contains("features") && !m["features"].is_null());
      models_[which] = spec;
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(Status::kBuild, path + ": malformed (" + e.what() + ")");
  }
  if (!models_.count("target")) throw Error(Status::kBuild, path + ": no target model");
}

void Build::CheckDevice(const std::string& requested) {
  std::string kind = manifest_.at("target_kind").get<std::string>();
  device_ = requested.empty() ? DLDevice{kind == "cuda" ? kDLCUDA : kDLCPU, 0} : ParseDevice(requested);
  if (kind == "llvm" && device_.device_type != kDLCPU) {
    throw Error(Status::kDevice, dir_ + ": a CPU (llvm) build cannot run on a CUDA device; compile with --target cuda");
  }
  if (kind == "cuda" && device_.device_type != kDLCUDA) {
    throw Error(Status::kDevice, dir_ + ": a CUDA build cannot run on the CPU; compile with --target llvm");
  }
  if (kind == "llvm") CheckCpuLevel();
  if (kind != "cuda") return;
  LoadCudaRuntime();
  auto attr = ffi::Function::GetGlobal("runtime.GetDeviceAttr");
  if (!attr.has_value()) throw Error(Status::kDevice, "TVM runtime lacks runtime.GetDeviceAttr");
  if (!(*attr)(static_cast<int>(kDLCUDA), device_.device_id, 0).cast<bool>()) {
    throw Error(Status::kDevice, "no CUDA device " + std::to_string(device_.device_id) + " is visible");
  }
  std::string version = (*attr)(static_cast<int>(kDLCUDA), device_.device_id, 4).cast<ffi::String>();
  int major = std::stoi(version.substr(0, version.find('.'))), minor = std::stoi(version.substr(version.find('.') + 1));
  auto [want_major, want_minor] = ArchVersion(manifest_.at("arch").get<std::string>());
  // Hopper / Blackwell datacenter code (sm_90a, sm_100a) runs on that exact version only; other
  // cubins run on the same major version at an equal or later minor
  bool exact = want_major == 9 || want_major == 10;
  if (major != want_major || (exact ? minor != want_minor : minor < want_minor)) {
    throw Error(Status::kDevice, dir_ + ": built for " + manifest_["arch"].get<std::string>() + ", but CUDA device " +
                                     std::to_string(device_.device_id) + " is compute capability " + version);
  }
}

// A CPU build's x86-64 level (manifest "cpu", specpilot/core/cpu_level.py): code built for a level runs only
// on a CPU with the level's features -- elsewhere its first AVX2 / FMA instruction would stop the process.
// Checked feature by feature (the vector and bit-manipulation ones code generation uses), as the Python
// loader does, so that compilers without the level names take it too.
static bool CpuRunsLevel(const std::string& level) {
  if (level == "generic") return true;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  bool v2 = __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("ssse3") &&
            __builtin_cpu_supports("sse4.1") && __builtin_cpu_supports("sse4.2");
  bool v3 = v2 && __builtin_cpu_supports("avx") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
            __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
  bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512vl");
  if (level == "x86-64-v2") return v2;
  if (level == "x86-64-v3") return v3;
  if (level == "x86-64-v4") return v4;
#endif
  return false;
}

void Build::CheckCpuLevel() const {
  if (!manifest_.contains("cpu") || manifest_["cpu"].is_null()) return;   // built before levels were recorded
  std::string level = manifest_["cpu"].get<std::string>();
  if (level != "generic" && level != "x86-64-v2" && level != "x86-64-v3" && level != "x86-64-v4") {
    throw Error(Status::kBuild, dir_ + ": unknown CPU level " + level + " in manifest.json");
  }
  if (!CpuRunsLevel(level)) {
    throw Error(Status::kDevice, dir_ + ": built for " + level + ", which this CPU does not run; rebuild it here with "
                                     "--target llvm");
  }
}

void Build::CheckHashes() const {
  for (auto& [rel, digest] : manifest_.at("hashes").items()) {
    std::string path = dir_ + "/" + rel;
    if (!IsFile(path)) throw Error(Status::kBuild, path + ": missing from the build");
    if (Sha256Hex(path) != digest.get<std::string>()) {
      throw Error(Status::kBuild, path + ": content hash differs from manifest.json (corrupt or modified build)");
    }
  }
}

void Build::LoadModule() {
  std::string so = dir_ + "/model.so";
  if (!IsFile(so)) throw Error(Status::kBuild, so + ": missing from the build");
  try {
    ffi::Module lib = ffi::Module::LoadFromFile(so);
    auto load = lib->GetFunction("vm_load_executable");
    if (!load.has_value()) throw Error(Status::kBuild, so + ": not a Relax VM executable");
    vm_ = (*load)().cast<ffi::Module>();
    auto init = (*vm_)->GetFunction("vm_initialization");
    // the device and the host, each with the pooled allocator (2), as the Python engine does
    (*init)(static_cast<int>(device_.device_type), device_.device_id, 2, static_cast<int>(kDLCPU), 0, 2);
    for (const auto& name : manifest_.at("functions")) {
      auto f = (*vm_)->GetFunction(name.get<std::string>());
      if (!f.has_value()) throw Error(Status::kBuild, so + ": has no function " + name.get<std::string>() + " (manifest.json lists it)");
      functions_.emplace(name.get<std::string>(), *f);
    }
  } catch (const ffi::Error& e) {
    throw Error(Status::kBuild, so + ": cannot load (" + e.message() + ")");
  }
}

void Build::LoadParams() {
  SafetensorsFile file(dir_ + "/params/params.safetensors");
  const auto& stored = file.tensors();
  std::map<std::string, Tensor> on_device;
  std::vector<Tensor> params;
  const auto& aliases = manifest_.value("aliases", nlohmann::json::object());
  for (const auto& entry : manifest_.at("params")) {
    std::string name = entry.get<std::string>();
    std::string key = aliases.contains(name) ? aliases[name].get<std::string>() : name;
    auto it = on_device.find(key);
    if (it == on_device.end()) {
      auto s = stored.find(key);
      if (s == stored.end()) throw Error(Status::kBuild, dir_ + ": parameter " + key + " listed in manifest.json is missing");
      it = on_device.emplace(key, Upload(s->second.data, s->second.shape, s->second.dtype, device_)).first;
    }
    params.push_back(it->second);
  }
  params_ = ffi::Array<Tensor>(params.begin(), params.end());
}

const ModelSpec& Build::model(const std::string& which) const {
  auto it = models_.find(which);
  if (it == models_.end()) throw Error(Status::kInvalidArgument, dir_ + ": the build has no " + which + " model");
  return it->second;
}

std::optional<ffi::Function> Build::function(const std::string& name) const {
  auto it = functions_.find(name);
  if (it == functions_.end()) return std::nullopt;
  return it->second;
}

ffi::Function Build::required(const std::string& name) const {
  auto f = function(name);
  if (!f.has_value()) throw Error(Status::kBuild, dir_ + ": the build has no " + name + " function");
  return *f;
}

}  // namespace specpilot
