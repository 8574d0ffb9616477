// Best-first draft trees under a node budget and their acceptance walk (specpilot/runtime/tree.py).
#ifndef SPECPILOT_TREE_H_
#define SPECPILOT_TREE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

namespace specpilot {

using Candidates = std::vector<std::pair<int32_t, double>>;   // (token, log-probability), best first
using Expand = std::function<Candidates(const std::vector<int32_t>& path)>;
// Many paths' expansions from one drafter call (a tree-shaped drafter pass); may be empty.
using ExpandBatch = std::function<std::vector<Candidates>(const std::vector<std::vector<int32_t>>& paths)>;

struct Expander {
  Expand one;
  ExpandBatch batch;
};

// Index i's path from the top of a parent forest (-1: no parent) down to i, top first.
std::vector<int32_t> RootPath(const std::vector<int32_t>& parents, int i);

struct Tree {
  std::vector<int32_t> tokens, parents, depths;   // parent -1: the root (the last emitted token)
  std::vector<double> scores;
  size_t size() const { return tokens.size(); }
  std::vector<int32_t> Path(int i) const;         // node indices from the root's child down to i
  std::vector<int32_t> PathTokens(int i) const;
  std::vector<int32_t> Children(int i) const;     // in index order (-1: the root's)
  std::vector<uint8_t> AncestorMask() const;      // (N+1) x (N+1) over [root] + nodes
  static Tree Chain(const std::vector<int32_t>& tokens);
};

// The `budget` highest-scoring nodes at most `max_depth` deep; ties break on (depth, parent, rank).
// With a batch expansion the expansions it needs are fetched first, one call per tree level
// (PrefetchLevels); the tree is the same node for node.
Tree BestFirst(const Expander& expander, int budget, int max_depth);

// Expansions fetched one level per batch call: scores only fall along a path, so a node of the
// best `budget` scores at least the budget-th best known score; each level expands exactly the
// known nodes at or above that bound.  Returns a lookup (a node not fetched is expanded alone).
Expand PrefetchLevels(const Expander& expander, int budget, int max_depth);

// Walk down from the root: choose(row) gives the token emitted after verification row `row`
// (0: the root, i + 1: node i), or nothing to stop.  Returns (accepted nodes, emitted tokens).
std::pair<std::vector<int>, std::vector<int32_t>> Accept(const Tree& tree,
                                                        const std::function<std::optional<int32_t>(int)>& choose);

}  // namespace specpilot
#endif  // SPECPILOT_TREE_H_
