// Seeded sampling as scores (specpilot/core/sampling.py): the token at position p is the argmax of
// logits / T plus Gumbel noise keyed by (seed, p) over the tokens top-k / top-p keep.  The scores
// come from the build's sample_scores function; greedy decoding leaves the logits as they are.
#ifndef SPECPILOT_SAMPLING_H_
#define SPECPILOT_SAMPLING_H_

#include <vector>

#include "model.h"

namespace specpilot {

void CheckSampling(const Sampling& s);

class Scorer {
 public:
  Scorer(const Build& build, const Sampling& sampling);
  bool greedy() const { return sampling_.greedy(); }
  // rows predicting the tokens at `positions` (one each) become their sampling scores
  void Score(Rows& rows, const std::vector<int>& positions) const;

 private:
  std::vector<float> Controls(const Rows& rows) const;   // (R, 2): 1 / T, lowest kept logit
  bool Cuts(int64_t vocab) const;                         // top-k or top-p leave tokens out
  const Build& build_;
  Sampling sampling_;
};

// Index of the largest value, ties to the lowest index (argmax's rule on every device).
int32_t Argmax(const float* row, int64_t n);

// Every row's choice (Argmax's rule) by the build's choose function where the rows are (one int32
// a row read back); builds without it: read back and chosen here.
std::vector<int32_t> Choose(const Build& build, const Rows& rows);

}  // namespace specpilot
#endif  // SPECPILOT_SAMPLING_H_
