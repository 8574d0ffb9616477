// Engine::Impl: a build, its target (and drafter) models, and the engines they make.
#ifndef SPECPILOT_ENGINE_IMPL_H_
#define SPECPILOT_ENGINE_IMPL_H_

#include <memory>
#include <optional>

#include "decoding.h"

namespace specpilot {

struct Engine::Impl {
  Impl(const std::string& dir, const OpenOptions& options);
  Generation Generate(const std::vector<int32_t>& prompt, const GenerateOptions& options);
  void CheckRequest(const std::vector<int32_t>& prompt, const GenerateOptions& options) const;
  std::set<int32_t> StopIds(const GenerateOptions& options) const;
  std::unique_ptr<Drafter> NewDrafter(const Scorer& scorer);

  Build build;
  Model target;
  std::optional<Model> drafter;
  std::vector<std::string> engines;   // autoregressive first
  std::string info;                   // sp_engine_info's JSON
};

}  // namespace specpilot
#endif  // SPECPILOT_ENGINE_IMPL_H_
