#include "tree.h"

#include <algorithm>
#include <map>
#include <memory>
#include <cmath>
#include <queue>
#include <tuple>

namespace specpilot {

std::vector<int32_t> RootPath(const std::vector<int32_t>& parents, int i) {
  std::vector<int32_t> out;
  while (i >= 0) {
    out.push_back(i);
    i = parents[i];
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<int32_t> Tree::Path(int i) const { return RootPath(parents, i); }

std::vector<int32_t> Tree::PathTokens(int i) const {
  std::vector<int32_t> out;
  for (int j : Path(i)) out.push_back(tokens[j]);
  return out;
}

std::vector<int32_t> Tree::Children(int i) const {
  std::vector<int32_t> out;
  for (size_t j = 0; j < parents.size(); ++j) {
    if (parents[j] == i) out.push_back(static_cast<int32_t>(j));
  }
  return out;
}

std::vector<uint8_t> Tree::AncestorMask() const {
  size_t n = size() + 1;
  std::vector<uint8_t> mask(n * n, 0);
  for (size_t a = 0; a < n; ++a) mask[a * n] = 1;
  for (size_t i = 0; i < size(); ++i) {
    size_t row = i + 1, parent = static_cast<size_t>(parents[i] + 1);
    for (size_t b = 1; b < n; ++b) mask[row * n + b] = mask[parent * n + b];
    mask[row * n + row] = 1;
  }
  return mask;
}

Tree Tree::Chain(const std::vector<int32_t>& tokens) {
  Tree t;
  for (size_t i = 0; i < tokens.size(); ++i) {
    t.tokens.push_back(tokens[i]);
    t.parents.push_back(static_cast<int32_t>(i) - 1);
    t.depths.push_back(static_cast<int32_t>(i) + 1);
    t.scores.push_back(0.0);
  }
  return t;
}

Expand PrefetchLevels(const Expander& expander, int budget, int max_depth) {
  auto cache = std::make_shared<std::map<std::vector<int32_t>, Candidates>>();
  (*cache)[{}] = expander.one({});
  std::vector<double> known;
  std::vector<std::pair<std::vector<int32_t>, double>> frontier{{{}, 0.0}};
  for (int depth = 1; depth < max_depth; ++depth) {   // nodes at max_depth are never expanded
    std::vector<std::pair<std::vector<int32_t>, double>> level;
    for (auto& [path, score] : frontier) {
      for (auto& [token, logprob] : cache->at(path)) {
        if (logprob == -INFINITY) continue;
        std::vector<int32_t> child = path;
        child.push_back(token);
        level.emplace_back(child, score + logprob);
        known.push_back(score + logprob);
      }
    }
    double bound = -INFINITY;
    if (static_cast<int>(known.size()) >= budget) {
      std::vector<double> top = known;
      std::nth_element(top.begin(), top.begin() + (budget - 1), top.end(), std::greater<double>());
      bound = top[budget - 1];
    }
    frontier.clear();
    std::vector<std::vector<int32_t>> paths;
    for (auto& [path, score] : level) {
      if (score >= bound) {
        frontier.emplace_back(path, score);
        paths.push_back(path);
      }
    }
    if (frontier.empty()) break;
    std::vector<Candidates> children = expander.batch(paths);
    for (size_t i = 0; i < paths.size(); ++i) (*cache)[paths[i]] = children[i];
  }
  Expand one = expander.one;
  return [cache, one](const std::vector<int32_t>& path) {
    auto it = cache->find(path);
    if (it == cache->end()) it = cache->emplace(path, one(path)).first;
    return it->second;
  };
}

Tree BestFirst(const Expander& expander, int budget, int max_depth) {
  Expand expand = expander.batch && budget > 1 ? PrefetchLevels(expander, budget, max_depth) : expander.one;
  using Entry = std::tuple<double, int, int, int, int32_t>;   // -score, depth, parent, rank, token
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  Tree tree;
  auto push_children = [&](int parent, int depth, double score, const std::vector<int32_t>& path) {
    if (depth > max_depth) return;
    Candidates children = expand(path);
    for (size_t rank = 0; rank < children.size(); ++rank) {
      if (children[rank].second == -INFINITY) continue;
      heap.emplace(-(score + children[rank].second), depth, parent, static_cast<int>(rank), children[rank].first);
    }
  };
  push_children(-1, 1, 0.0, {});
  while (!heap.empty() && static_cast<int>(tree.size()) < budget) {
    auto [neg, depth, parent, rank, token] = heap.top();
    heap.pop();
    tree.tokens.push_back(token);
    tree.parents.push_back(parent);
    tree.depths.push_back(depth);
    tree.scores.push_back(-neg);
    if (static_cast<int>(tree.size()) < budget) {
      int i = static_cast<int>(tree.size()) - 1;
      push_children(i, depth + 1, -neg, tree.PathTokens(i));
    }
  }
  return tree;
}

std::pair<std::vector<int>, std::vector<int32_t>> Accept(const Tree& tree,
                                                        const std::function<std::optional<int32_t>(int)>& choose) {
  std::vector<int> nodes;
  std::vector<int32_t> emitted;
  int row = 0;
  while (true) {
    std::optional<int32_t> token = choose(row);
    if (!token) return {nodes, emitted};
    emitted.push_back(*token);
    int match = -1;
    for (int c : tree.Children(row - 1)) {
      if (tree.tokens[c] == *token) {
        match = c;
        break;
      }
    }
    if (match < 0) return {nodes, emitted};
    nodes.push_back(match);
    row = match + 1;
  }
}

}  // namespace specpilot
