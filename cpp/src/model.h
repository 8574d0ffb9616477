// One model of a build (target or drafter) behind its step functions: the KV-cache pool with one
// row per live sequence, and each sequence's Gated DeltaNet states.  The C++ twin of
// specpilot/runtime/engine.py's CompiledModel / CompiledState (same calls, same arguments).
#ifndef SPECPILOT_MODEL_H_
#define SPECPILOT_MODEL_H_

#include <memory>
#include <optional>
#include <vector>

#include "build.h"

namespace specpilot {

// Float32 rows of a step's logits (or sampling scores) where the build runs; read back to the host
// only when a host needs values (a drafter's top-k, top-k / top-p cuts), not for the greedy choice.
struct Rows {
  int64_t n = 0, vocab = 0;
  std::optional<Tensor> device;     // (n, vocab) float32
  const float* row(int64_t i) const;
  void Replace(Tensor values) {     // new values for the same rows (sampling scores)
    device = std::move(values);
    host_.clear();
  }

 private:
  mutable std::vector<float> host_;
};

// A recording verification pass of one sequence: what commit needs to rebuild the recurrent
// state after any of its tokens.
struct Pass {
  int start = 0, length = 0;
  Tensor conv_states, rec_records, conv_before, rec_before;
  std::vector<int32_t> parents;       // each token's parent in the pass (-1: before it)
  std::vector<int32_t> Path(int index) const;   // token index's root path, root first
};

class Model;

class State {
 public:
  State(Model* model, int row);
  ~State();
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  int row() const { return row_; }
  Tensor conv();
  Tensor rec();
  void SetStates(Tensor conv, Tensor rec);
  void SetAfter(std::shared_ptr<Pass> pass);   // states after the pass's last token, committed when read
  void CheckRoom(int n_new) const;

  struct Snapshot {
    int length;
    Tensor conv, rec;
  };
  Snapshot Snap();
  void Restore(const Snapshot& snap, bool keep_history);

  int length = 0;
  std::vector<std::shared_ptr<Pass>> history;

 private:
  void Settle();
  Model* model_;
  int row_;
  Tensor conv_, rec_;
  std::shared_ptr<Pass> pending_;
};

// One sequence's part of a step: its new tokens and, for trees, rotary positions, the attention
// mask over its cache and new tokens (T x (length + T), row-major) and parents.  Empty: a chain.
struct StepItem {
  std::vector<int32_t> tokens;
  State* state = nullptr;
  std::vector<int32_t> positions;
  std::vector<uint8_t> mask;
  std::vector<int32_t> parents;
};

class Model {
 public:
  Model(const Build& build, const std::string& which);

  const ModelSpec& spec() const { return spec_; }
  int64_t vocab() const { return spec_.vocab_size; }
  bool has_gdn() const { return spec_.has_gdn; }
  bool tuple_out() const { return spec_.tuple_out; }
  bool path_recompute() const { return build_.path_recompute(); }
  int max_verify_tokens() const { return spec_.has_gdn ? build_.max_verify_tokens() : 0; }
  int capacity() const { return build_.capacity(); }
  int free_rows() const { return static_cast<int>(free_rows_.size()); }

  std::unique_ptr<State> NewState();
  // One call of the step function for every item (each sequence at its own length); each item's
  // float32 rows (all its tokens', or only its last with last_only); advances each state.
  std::vector<Rows> ForwardBatch(std::vector<StepItem>& items, bool record, bool last_only = false);
  Rows Forward(StepItem item, bool record, bool last_only = false);
  Rows ForwardView(const StepItem& item);     // the nested 8-bit view's verification; state unmoved
  void AcceptPath(State& state, int base, const std::vector<int>& rows);
  void Truncate(State& state, int length);
  std::pair<Tensor, Tensor> CommitAt(const Pass& pass, int index);

  void Release(int row) { free_rows_.push_back(row); }
  Tensor Zeros(const std::string& cache) const;
  Tensor kv() const { return kv_; }
  const ffi::Function& decode() const { return decode_; }
  const Build& build() const { return build_; }

 private:
  struct Inputs;
  Inputs Prepare(std::vector<StepItem>& items, bool record);
  Tensor Stack(const std::vector<Tensor>& parts);
  Tensor Row(const Tensor& t, int b, int n);
  Tensor Placeholder() const;

  const Build& build_;
  ModelSpec spec_;
  ffi::Function prefill_, decode_, decode_batch_, verify_;
  std::optional<ffi::Function> commit_, compact_kv_, verify_view_;
  Tensor kv_;
  std::vector<int> free_rows_;
  Staging staging_;
};

}  // namespace specpilot
#endif  // SPECPILOT_MODEL_H_
