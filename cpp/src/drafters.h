// Drafters (specpilot/runtime/drafters.py): given the accepted context, propose a chain (chain
// drafting) or expand tree paths (tree drafting).
//  - NGramDrafter: prompt lookup over an n-gram index of the context.
//  - ModelDrafter: the build's drafter network (a separate small model, or the target's first
//    layers), drafting greedily on its own state, rolled back when drafts are rejected.
#ifndef SPECPILOT_DRAFTERS_H_
#define SPECPILOT_DRAFTERS_H_

#include <map>
#include <memory>
#include <vector>

#include "model.h"
#include "sampling.h"
#include "tree.h"

namespace specpilot {

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::vector<int32_t> ProposeChain(const std::vector<int32_t>& context, int n) = 0;
  virtual Expander Expand(const std::vector<int32_t>& context) = 0;
};

class NGramDrafter : public Drafter {
 public:
  NGramDrafter(int max_n, int min_n, int top_k) : max_n_(max_n), min_n_(min_n), top_k_(top_k) {}
  std::vector<int32_t> ProposeChain(const std::vector<int32_t>& context, int n) override;
  Expander Expand(const std::vector<int32_t>& context) override;

 private:
  struct Follow {
    std::map<int32_t, int> counts;
    std::map<int32_t, int> last_seen;   // recency tie-break
  };
  void Index(const std::vector<int32_t>& context);
  std::vector<std::pair<int32_t, double>> Ranked(const std::vector<int32_t>& seq) const;   // (token, p)
  int max_n_, min_n_, top_k_;
  std::vector<int32_t> indexed_;
  std::map<std::vector<int32_t>, Follow> follow_;
};

class ModelDrafter : public Drafter {
 public:
  ModelDrafter(Model& model, const Scorer& scorer, int top_k, double temperature);
  std::vector<int32_t> ProposeChain(const std::vector<int32_t>& context, int n) override;
  Expander Expand(const std::vector<int32_t>& context) override;

 private:
  Rows Sync(const std::vector<int32_t>& context, bool keep_history = false);
  Candidates Top(const Rows& logits, int64_t row) const;   // top-k of log_softmax(logits / temperature)
  // the expansions of many paths below `context` from one tree-shaped pass over the union of their
  // nodes; the state is put back afterwards (empty: no room for the pass, expand one by one)
  std::optional<std::vector<Candidates>> ExpandTree(const std::vector<int32_t>& context,
                                                    const std::vector<std::vector<int32_t>>& paths);
  Model& model_;
  const Scorer& scorer_;
  int top_k_;
  double temperature_;
  std::unique_ptr<State> state_;
  std::vector<int32_t> consumed_;   // the tokens whose KV / recurrent state is in state_
};

// A model step whose rows become sampling scores (rows keyed by the position they predict).
Rows ScoredForward(Model& model, const Scorer& scorer, StepItem item, bool record, bool last_only = false);
Rows ScoredForwardView(Model& model, const Scorer& scorer, const StepItem& item);

}  // namespace specpilot
#endif  // SPECPILOT_DRAFTERS_H_
