// The decoding loops (specpilot/runtime/decoding.py): autoregressive, chain, tree and two-level
// speculative decoding over a build's target model.  Every loop emits the target's own choices
// (argmax of logits, or of sampling scores), so all of them emit the same tokens.
#ifndef SPECPILOT_DECODING_H_
#define SPECPILOT_DECODING_H_

#include <set>

#include "drafters.h"

namespace specpilot {

// Emits the target's choices (Choose: the argmax, ties to the lowest index); stops at max_new, a
// stop token, or when the caller's callback says so.
class Emitter {
 public:
  Emitter(int max_new, std::set<int32_t> stop_ids, std::function<bool(int32_t)> on_token)
      : max_new_(max_new), stop_ids_(std::move(stop_ids)), on_token_(std::move(on_token)) {}
  int32_t Emit(int32_t token);
  bool stopped() const { return stopped_; }
  int remaining() const { return max_new_ - static_cast<int>(gen.tokens.size()); }
  int max_new() const { return max_new_; }
  Generation gen;

 private:
  int max_new_;
  std::set<int32_t> stop_ids_;
  std::function<bool(int32_t)> on_token_;
  bool stopped_ = false;
};

// The draft length before each verification: fixed, or from recent acceptance (runtime/draft_schedule.py).
class DraftSchedule {
 public:
  DraftSchedule(int length, int minimum, bool dynamic);
  int Next() const;
  void Update(int accepted_drafts) { recent_ = 0.5 * recent_ + 0.5 * accepted_drafts; }

 private:
  int max_, min_;
  bool dynamic_;
  double recent_;
};

struct Loop {
  Model& target;
  const Scorer& scorer;
  Emitter& out;
  const std::vector<int32_t>& prompt;
  int capacity;
};

void Autoregressive(Loop& loop);
// Greedy autoregressive decoding with the build's choose function: each step takes the previous
// step's choice where it is and its other inputs as views of tables made once, so on a GPU the
// host never waits on a step; every `window` steps the choices come back (stop tokens, streaming).
bool CanDecodeOnDevice(const Loop& loop);
void AutoregressiveOnDevice(Loop& loop, int window);
void Speculative(Loop& loop, Drafter& drafter, DraftSchedule schedule);
void SpeculativeTree(Loop& loop, Drafter& drafter, int budget);
void SpeculativeTwoLevel(Loop& loop, Drafter& drafter, int budget);

}  // namespace specpilot
#endif  // SPECPILOT_DECODING_H_
