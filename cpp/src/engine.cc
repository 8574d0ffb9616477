#include <chrono>

#include "engine_impl.h"

namespace specpilot {

Engine::Impl::Impl(const std::string& dir, const OpenOptions& options)
    : build(dir, options), target(build, "target") {
  if (build.has_model("drafter")) drafter.emplace(build, "drafter");
  const std::string& kind = build.drafter().kind;
  bool drafts = kind == "ngram" || ((kind == "model" || kind == "early-exit") && drafter.has_value());
  engines.push_back("compiled");
  if (drafts) {
    engines.push_back("compiled-spec");
    if (build.tree_budget()) engines.push_back("compiled-tree");
    if (build.tree_budget() && build.two_level()) engines.push_back("compiled-two-level");
  }
  const auto& m = build.manifest();
  nlohmann::json j = {{"engines", engines},
                      {"vocab_size", target.vocab()},
                      {"capacity", build.capacity()},
                      {"max_batch", build.max_batch()},
                      {"eos_token_ids", target.spec().eos_token_ids},
                      {"dtype", m.at("dtype")},
                      {"target", m.at("target")},
                      {"drafter", kind},
                      {"tree_budget", build.tree_budget()},
                      {"cpu_threads", build.cpu_threads()},
                      {"device", build.device().device_type == kDLCUDA ? "cuda:" + std::to_string(build.device().device_id) : "cpu"}};
  info = j.dump();
}

void Engine::Impl::CheckRequest(const std::vector<int32_t>& prompt, const GenerateOptions& options) const {
  if (prompt.empty()) throw Error(Status::kInvalidArgument, "the prompt is empty");
  for (int32_t t : prompt) {
    if (t < 0 || t >= target.vocab()) {
      throw Error(Status::kInvalidArgument, "prompt token " + std::to_string(t) + " is outside the vocabulary [0, " +
                                                std::to_string(target.vocab()) + ")");
    }
  }
  if (options.max_new_tokens < 1) throw Error(Status::kInvalidArgument, "max_new_tokens must be >= 1");
  if (static_cast<int64_t>(prompt.size()) + options.max_new_tokens > build.capacity()) {
    throw Error(Status::kCapacity, "prompt (" + std::to_string(prompt.size()) + ") + max new tokens (" +
                                       std::to_string(options.max_new_tokens) + ") exceeds deployment.max_seq_len=" +
                                       std::to_string(build.capacity()));
  }
  CheckSampling(options.sampling);
}

std::set<int32_t> Engine::Impl::StopIds(const GenerateOptions& options) const {
  if (!options.stop_at_eos) return {};
  return std::set<int32_t>(target.spec().eos_token_ids.begin(), target.spec().eos_token_ids.end());
}

std::unique_ptr<Drafter> Engine::Impl::NewDrafter(const Scorer& scorer) {
  const DrafterSpec& d = build.drafter();
  if (d.kind == "ngram") return std::make_unique<NGramDrafter>(d.max_ngram, d.min_ngram, d.top_k);
  return std::make_unique<ModelDrafter>(*drafter, scorer, d.top_k, d.temperature);
}

Generation Engine::Impl::Generate(const std::vector<int32_t>& prompt, const GenerateOptions& options) {
  std::string engine = options.engine.empty() ? engines.back() : options.engine;
  if (std::find(engines.begin(), engines.end(), engine) == engines.end()) {
    std::string have;
    for (auto& e : engines) have += (have.empty() ? "" : ", ") + e;
    throw Error(Status::kInvalidArgument, "unknown engine '" + engine + "' for this build; available: " + have);
  }
  CheckRequest(prompt, options);
  auto start = std::chrono::steady_clock::now();
  Scorer scorer(build, options.sampling);
  Emitter out(options.max_new_tokens, StopIds(options), options.on_token);
  Loop loop{target, scorer, out, prompt, build.capacity()};
  if (engine == "compiled") {
    if (CanDecodeOnDevice(loop)) AutoregressiveOnDevice(loop, options.on_token ? 4 : 16);
    else Autoregressive(loop);
  } else {
    std::unique_ptr<Drafter> d = NewDrafter(scorer);   // per generation: a drafter network holds a cache row
    const DrafterSpec& spec = build.drafter();
    if (engine == "compiled-spec") Speculative(loop, *d, DraftSchedule(spec.draft_len, spec.draft_min, spec.draft_dynamic));
    if (engine == "compiled-tree") SpeculativeTree(loop, *d, build.tree_budget());
    if (engine == "compiled-two-level") SpeculativeTwoLevel(loop, *d, build.tree_budget());
  }
  out.gen.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return std::move(out.gen);
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

std::unique_ptr<Engine> Engine::Open(const std::string& build_dir, const OpenOptions& options) {
  try {
    return std::unique_ptr<Engine>(new Engine(std::make_unique<Impl>(build_dir, options)));
  } catch (const ffi::Error& e) {
    throw Error(Status::kRuntime, build_dir + ": " + e.message());
  }
}

Generation Engine::Generate(const std::vector<int32_t>& prompt, const GenerateOptions& options) {
  try {
    return impl_->Generate(prompt, options);
  } catch (const ffi::Error& e) {
    throw Error(Status::kRuntime, e.message());
  }
}

std::vector<std::string> Engine::Engines() const { return impl_->engines; }
std::string Engine::InfoJson() const { return impl_->info; }

}  // namespace specpilot
