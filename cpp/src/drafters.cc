#include "drafters.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace specpilot {
namespace {

std::vector<int> PredictedPositions(const StepItem& item, int length, bool last_only) {
  std::vector<int> out;
  size_t n = item.tokens.size();
  for (size_t i = last_only ? n - 1 : 0; i < n; ++i) {
    out.push_back((item.positions.empty() ? length + static_cast<int>(i) : item.positions[i]) + 1);
  }
  return out;
}

size_t CommonPrefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return i;
  }
  return n;
}

}  // namespace

Rows ScoredForward(Model& model, const Scorer& scorer, StepItem item, bool record, bool last_only) {
  std::vector<int> positions = PredictedPositions(item, item.state->length, last_only);
  Rows rows = model.Forward(std::move(item), record, last_only);
  scorer.Score(rows, positions);
  return rows;
}

Rows ScoredForwardView(Model& model, const Scorer& scorer, const StepItem& item) {
  std::vector<int> positions = PredictedPositions(item, item.state->length, false);
  Rows rows = model.ForwardView(item);
  scorer.Score(rows, positions);
  return rows;
}

void NGramDrafter::Index(const std::vector<int32_t>& context) {
  if (CommonPrefix(context, indexed_) != indexed_.size()) {
    indexed_.clear();
    follow_.clear();
  }
  for (size_t end = std::max<size_t>(indexed_.size(), 1); end < context.size(); ++end) {
    int32_t next = context[end];
    for (int n = min_n_; n <= max_n_; ++n) {
      if (static_cast<int>(end) - n < 0) break;
      Follow& f = follow_[std::vector<int32_t>(context.begin() + (end - n), context.begin() + end)];
      f.counts[next] += 1;
      f.last_seen[next] = static_cast<int>(end);
    }
  }
  indexed_ = context;
}

std::vector<std::pair<int32_t, double>> NGramDrafter::Ranked(const std::vector<int32_t>& seq) const {
  for (int n = std::min<int>(max_n_, static_cast<int>(seq.size())); n >= min_n_; --n) {
    auto it = follow_.find(std::vector<int32_t>(seq.end() - n, seq.end()));
    if (it == follow_.end() || it->second.counts.empty()) continue;
    const Follow& f = it->second;
    int total = 0;
    std::vector<int32_t> ranked;
    for (auto& [token, count] : f.counts) {
      total += count;
      ranked.push_back(token);
    }
    std::sort(ranked.begin(), ranked.end(), [&](int32_t a, int32_t b) {   // most often, then most recent, then lowest id
      int ca = f.counts.at(a), cb = f.counts.at(b), sa = f.last_seen.at(a), sb = f.last_seen.at(b);
      return ca != cb ? ca > cb : sa != sb ? sa > sb : a < b;
    });
    std::vector<std::pair<int32_t, double>> out;
    for (size_t i = 0; i < ranked.size() && static_cast<int>(i) < top_k_; ++i) {
      out.emplace_back(ranked[i], static_cast<double>(f.counts.at(ranked[i])) / total);
    }
    return out;
  }
  return {};
}

std::vector<int32_t> NGramDrafter::ProposeChain(const std::vector<int32_t>& context, int n) {
  Index(context);
  std::vector<int32_t> seq = context, chain;
  for (int i = 0; i < n; ++i) {
    auto cands = Ranked(seq);
    if (cands.empty()) break;
    chain.push_back(cands[0].first);
    seq.push_back(cands[0].first);
  }
  return chain;
}

Expander NGramDrafter::Expand(const std::vector<int32_t>& context) {
  Index(context);
  return Expander{[this, context](const std::vector<int32_t>& path) {
    std::vector<int32_t> seq = context;
    seq.insert(seq.end(), path.begin(), path.end());
    Candidates out;
    for (auto& [token, p] : Ranked(seq)) out.emplace_back(token, std::log(p));
    return out;
  }, nullptr};
}

ModelDrafter::ModelDrafter(Model& model, const Scorer& scorer, int top_k, double temperature)
    : model_(model), scorer_(scorer), top_k_(top_k), temperature_(temperature), state_(model.NewState()) {
  if (!(temperature > 0)) throw Error(Status::kBuild, "drafter temperature must be positive");
}

Rows ModelDrafter::Sync(const std::vector<int32_t>& context, bool keep_history) {
  size_t keep = CommonPrefix(consumed_, context);
  if (keep == context.size()) keep -= 1;   // nothing new: recompute the last position
  if (static_cast<int>(keep) < state_->length) model_.Truncate(*state_, static_cast<int>(keep));
  if (!keep_history) state_->history.clear();
  consumed_.assign(context.begin(), context.begin() + keep);
  std::vector<int32_t> fresh(context.begin() + keep, context.end());
  if (keep == 0 && fresh.size() > 1) {   // first call: prefill without per-token states
    ScoredForward(model_, scorer_, StepItem{std::vector<int32_t>(fresh.begin(), fresh.end() - 1), state_.get()}, false, true);
    fresh.erase(fresh.begin(), fresh.end() - 1);
  }
  Rows logits = ScoredForward(model_, scorer_, StepItem{fresh, state_.get()}, true, true);
  consumed_ = context;
  return logits;
}

Candidates ModelDrafter::Top(const Rows& logits, int64_t r) const {
  const float* row = logits.row(r);
  int64_t V = logits.vocab;
  double scale = temperature_ != 1.0 ? 1.0 / temperature_ : 1.0;
  double top = -INFINITY;
  for (int64_t i = 0; i < V; ++i) top = std::max(top, row[i] * scale);
  double sum = 0.0;
  for (int64_t i = 0; i < V; ++i) sum += std::exp(row[i] * scale - top);
  double log_z = top + std::log(sum);
  std::vector<int32_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  int64_t k = std::min<int64_t>(top_k_, V);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int32_t a, int32_t b) { return row[a] != row[b] ? row[a] > row[b] : a < b; });
  Candidates out;
  for (int64_t i = 0; i < k; ++i) out.emplace_back(order[i], static_cast<float>(row[order[i]] * scale - log_z));
  return out;
}

Expander ModelDrafter::Expand(const std::vector<int32_t>& context) {
  Rows last = Sync(context);
  Candidates root = Top(last, last.n - 1);
  auto one = [this, context, root](const std::vector<int32_t>& path) -> Candidates {
    if (static_cast<int>(context.size() + path.size()) >= model_.capacity()) return {};
    if (path.empty()) return root;
    std::vector<int32_t> seq = context;
    seq.insert(seq.end(), path.begin(), path.end());
    Rows rows = Sync(seq, true);
    return Top(rows, rows.n - 1);
  };
  bool tree_capable = !model_.has_gdn() || model_.path_recompute();   // one pass can score a whole tree
  if (!tree_capable) return Expander{one, nullptr};
  auto batch = [this, context, one](const std::vector<std::vector<int32_t>>& paths) {
    auto fetched = ExpandTree(context, paths);
    if (fetched) return *fetched;
    std::vector<Candidates> out;
    for (const auto& path : paths) out.push_back(one(path));
    return out;
  };
  return Expander{one, batch};
}

std::optional<std::vector<Candidates>> ModelDrafter::ExpandTree(const std::vector<int32_t>& context,
                                                                const std::vector<std::vector<int32_t>>& paths) {
  std::map<std::vector<int32_t>, int> nodes;   // path prefix -> index in the pass
  StepItem item{{}, state_.get()};
  std::vector<int32_t> depths;
  for (const auto& path : paths) {
    for (size_t d = 1; d <= path.size(); ++d) {
      std::vector<int32_t> key(path.begin(), path.begin() + d);
      if (nodes.count(key)) continue;
      nodes[key] = static_cast<int>(item.tokens.size());
      item.tokens.push_back(path[d - 1]);
      item.parents.push_back(d > 1 ? nodes[std::vector<int32_t>(path.begin(), path.begin() + d - 1)] : -1);
      depths.push_back(static_cast<int32_t>(d));
    }
  }
  int base = static_cast<int>(context.size()), n = static_cast<int>(item.tokens.size());
  int limit = model_.max_verify_tokens();
  if (n == 0 || consumed_ != context || state_->length != base || base + n > model_.capacity() || (limit && n > limit)) {
    return std::nullopt;
  }
  int width = base + n;
  item.mask.assign(static_cast<size_t>(n) * width, 0);
  for (int i = 0; i < n; ++i) {
    uint8_t* m = &item.mask[static_cast<size_t>(i) * width];
    if (item.parents[i] >= 0) std::copy_n(&item.mask[static_cast<size_t>(item.parents[i]) * width], width, m);
    std::fill(m, m + base, 1);
    m[base + i] = 1;
    item.positions.push_back(base + depths[i] - 1);
  }
  State::Snapshot snap = state_->Snap();
  Rows logits;
  try {
    logits = ScoredForward(model_, scorer_, item, true);
  } catch (...) {
    state_->Restore(snap, true);
    throw;
  }
  state_->Restore(snap, true);
  std::vector<Candidates> out;
  for (const auto& path : paths) {
    out.push_back(base + static_cast<int>(path.size()) >= model_.capacity() || path.empty() ? Candidates{}
                                                                                            : Top(logits, nodes[path]));
  }
  return out;
}

std::vector<int32_t> ModelDrafter::ProposeChain(const std::vector<int32_t>& context, int n) {
  n = std::min(n, model_.capacity() - static_cast<int>(context.size()));
  if (n <= 0) return {};
  Rows logits = Sync(context);
  std::vector<int32_t> chain;
  for (int i = 0; i < n; ++i) {
    int32_t best = Choose(model_.build(), logits)[0];   // the top-1 of log_softmax
    chain.push_back(best);
    if (i + 1 < n) {
      logits = ScoredForward(model_, scorer_, StepItem{{best}, state_.get()}, true, true);
      consumed_.push_back(best);
    }
  }
  return chain;
}

}  // namespace specpilot
