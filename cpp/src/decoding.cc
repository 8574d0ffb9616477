#include "decoding.h"

#include <algorithm>
#include <cmath>

namespace specpilot {

int32_t Emitter::Emit(int32_t token) {
  gen.tokens.push_back(token);
  if (stop_ids_.count(token) || static_cast<int>(gen.tokens.size()) >= max_new_) stopped_ = true;
  if (on_token_ && !on_token_(token)) stopped_ = true;
  return token;
}

DraftSchedule::DraftSchedule(int length, int minimum, bool dynamic)
    : max_(length), min_(std::min(std::max(minimum, 1), length)), dynamic_(dynamic), recent_(length) {
  if (length < 1) throw Error(Status::kBuild, "draft length must be >= 1");
}

int DraftSchedule::Next() const {
  if (!dynamic_) return max_;
  return std::max(min_, std::min(max_, static_cast<int>(std::ceil(recent_ - 1e-9)) + 1));
}

namespace {

std::vector<int32_t> Context(const Loop& loop) {
  std::vector<int32_t> context = loop.prompt;
  context.insert(context.end(), loop.out.gen.tokens.begin(), loop.out.gen.tokens.end());
  return context;
}

// The prefill: emits the first token (not yet fed to the target); returns it.
int32_t Start(Loop& loop, State& state) {
  Rows rows = ScoredForward(loop.target, loop.scorer, StepItem{loop.prompt, &state}, false, true);
  int32_t last = loop.out.Emit(Choose(loop.target.build(), rows)[0]);
  loop.out.gen.accepted.push_back(1);
  return last;
}

// [root] + nodes as one verification pass: tokens, rotary positions, mask, parents.
StepItem TreeInputs(int32_t last, const Tree& tree, State& state) {
  int base = state.length, n = static_cast<int>(tree.size()), width = base + n + 1;
  StepItem item{{last}, &state, {base}, std::vector<uint8_t>(static_cast<size_t>(n + 1) * width, 0), {-1}};
  std::vector<uint8_t> ancestors = tree.AncestorMask();
  for (int a = 0; a <= n; ++a) {
    for (int j = 0; j < base; ++j) item.mask[static_cast<size_t>(a) * width + j] = 1;
    for (int j = 0; j <= n; ++j) item.mask[static_cast<size_t>(a) * width + base + j] = ancestors[a * (n + 1) + j];
  }
  for (int i = 0; i < n; ++i) {
    item.tokens.push_back(tree.tokens[i]);
    item.positions.push_back(base + tree.depths[i]);
    item.parents.push_back(tree.parents[i] + 1);
  }
  return item;
}

// One exact verification of `tree` below `last`: emit the accepted path and the bonus token, keep
// the path in the state; returns the new last token.
int32_t VerifyTree(Loop& loop, State& state, int32_t last, const Tree& tree) {
  int base = state.length;
  Rows rows = ScoredForward(loop.target, loop.scorer, TreeInputs(last, tree, state), true);
  std::vector<int32_t> choices = Choose(loop.target.build(), rows);
  auto [nodes, emitted] = Accept(tree, [&](int row) -> std::optional<int32_t> {
    if (loop.out.stopped()) return std::nullopt;
    return loop.out.Emit(choices[row]);
  });
  std::vector<int> kept{0};
  for (int i : nodes) kept.push_back(i + 1);
  loop.target.AcceptPath(state, base, kept);
  loop.out.gen.accepted.push_back(static_cast<int32_t>(emitted.size()));
  return emitted.back();
}

}  // namespace

void Autoregressive(Loop& loop) {
  auto state = loop.target.NewState();
  int32_t token = Start(loop, *state);
  while (!loop.out.stopped()) {
    Rows rows = ScoredForward(loop.target, loop.scorer, StepItem{{token}, state.get()}, false, true);
    token = loop.out.Emit(Choose(loop.target.build(), rows)[0]);
    loop.out.gen.accepted.push_back(1);
  }
}

bool CanDecodeOnDevice(const Loop& loop) {
  return loop.target.build().function("choose").has_value() && loop.scorer.greedy();
}

void AutoregressiveOnDevice(Loop& loop, int window) {
  const Build& build = loop.target.build();
  DLDevice dev = build.device();
  int capacity = loop.capacity;
  auto state = loop.target.NewState();
  constexpr int kStride = 16;   // int32s: position i at byte 64 i, so every view keeps kernels' alignment
  std::vector<int32_t> positions(static_cast<size_t>(capacity) * kStride, 0);
  for (int i = 0; i < capacity; ++i) positions[static_cast<size_t>(i) * kStride] = i;
  // tables for every step's views: positions / slots, an all-true mask row, the state's pool row
  Tensor arange = Int32(positions, {capacity * kStride}, dev);
  Tensor ones = Bool(std::vector<uint8_t>(capacity, 1), {capacity}, dev);
  Tensor row = Int32({state->row()}, {1}, dev);
  Tensor chosen = Empty({window}, DLDataType{kDLInt, 32, 1}, dev);   // a window's choices, read back at once
  ffi::Function choose = build.required("choose");
  const ffi::Function& decode = loop.target.decode();
  DLDataType i32{kDLInt, 32, 1}, boolean{kDLBool, 8, 1};
  bool gdn = loop.target.has_gdn();

  Rows first = ScoredForward(loop.target, loop.scorer, StepItem{loop.prompt, state.get()}, false, true);
  Tensor token = choose(*first.device).cast<Tensor>();
  std::vector<int32_t> heard(window);
  int pending = 0;
  auto hear = [&]() {   // the window's choices, in order; false once the emitter stops
    Download(View(chosen, {pending}, 0), heard.data(), pending * 4);
    for (int i = 0; i < pending; ++i) {
      loop.out.Emit(heard[i]);
      loop.out.gen.accepted.push_back(1);
      if (loop.out.stopped()) return false;
    }
    pending = 0;
    return true;
  };
  while (true) {
    CopyInto(token, View(chosen, {1}, pending * 4));
    if (++pending == window || static_cast<int>(loop.out.gen.tokens.size()) + pending >= loop.out.max_new()) {
      if (!hear()) break;
    }
    int start = state->length;
    state->CheckRoom(1);
    ffi::Any out = decode(
        View(token, {1, 1}, i32, 0), View(arange, {1, 1}, i32, start * 4 * kStride), View(arange, {1, 1}, i32, start * 4 * kStride),
        View(ones, {1, 1, start + 1}, boolean, 0), row, loop.target.kv(), state->conv(), state->rec(), build.params());
    Tensor logits = loop.target.tuple_out() ? out.cast<ffi::Array<ffi::Any>>()[0].cast<Tensor>() : out.cast<Tensor>();
    if (gdn) {
      auto parts = out.cast<ffi::Array<ffi::Any>>();
      state->SetStates(parts[1].cast<Tensor>(), parts[2].cast<Tensor>());
    }
    state->length = start + 1;
    token = choose(View(logits, {1, ShapeOf(logits).back()}, 0)).cast<Tensor>();
  }
}

void Speculative(Loop& loop, Drafter& drafter, DraftSchedule schedule) {
  auto state = loop.target.NewState();
  int32_t last = Start(loop, *state);
  Generation& gen = loop.out.gen;
  while (!loop.out.stopped()) {
    int room = std::min({schedule.Next(), loop.out.remaining(), loop.capacity - state->length - 1});
    std::vector<int32_t> draft = drafter.ProposeChain(Context(loop), room);
    if (static_cast<int>(draft.size()) > std::max(room, 0)) draft.resize(std::max(room, 0));
    int base = state->length;
    StepItem item{{last}, state.get()};
    item.tokens.insert(item.tokens.end(), draft.begin(), draft.end());
    Rows rows = ScoredForward(loop.target, loop.scorer, item, true);   // row i: target after draft[:i]
    std::vector<int32_t> choices = Choose(loop.target.build(), rows);
    int committed = 0;
    for (size_t i = 0; i <= draft.size(); ++i) {
      last = loop.out.Emit(choices[i]);
      ++committed;
      if (loop.out.stopped() || i == draft.size() || draft[i] != last) break;
    }
    loop.target.Truncate(*state, base + committed);   // keep [last fed] + accepted drafts
    state->history.clear();
    gen.accepted.push_back(committed);
    schedule.Update(committed - 1);
  }
}

void SpeculativeTree(Loop& loop, Drafter& drafter, int budget) {
  auto state = loop.target.NewState();
  int32_t last = Start(loop, *state);
  while (!loop.out.stopped()) {
    int room = std::min(budget, loop.capacity - state->length - 1);
    Tree tree = room > 0 ? BestFirst(drafter.Expand(Context(loop)), room, loop.out.remaining()) : Tree();
    last = VerifyTree(loop, *state, last, tree);
  }
}

void SpeculativeTwoLevel(Loop& loop, Drafter& drafter, int budget) {
  auto state = loop.target.NewState();
  int32_t last = Start(loop, *state);
  while (!loop.out.stopped()) {
    int room = std::min(budget, loop.capacity - state->length - 1);
    int depth = loop.out.remaining();
    std::vector<int32_t> context = Context(loop);
    Tree first = room > 0 ? BestFirst(drafter.Expand(context), room, depth) : Tree();
    std::vector<int32_t> chain;
    if (first.size()) {   // the nested 8-bit view's verification: a proposed chain, no state moved
      Rows view = ScoredForwardView(loop.target, loop.scorer, TreeInputs(last, first, *state));
      std::vector<int32_t> view_choices = Choose(loop.target.build(), view);
      auto [nodes, emitted] = Accept(first, [&](int row) -> std::optional<int32_t> { return view_choices[row]; });
      for (int i : nodes) chain.push_back(first.tokens[i]);
      chain.push_back(emitted.back());
      if (static_cast<int>(chain.size()) > std::min(room, depth)) chain.resize(std::min(room, depth));
    }
    int k = static_cast<int>(chain.size());
    Tree second;
    if (room > k && depth > k) {
      std::vector<int32_t> extended = context;
      extended.insert(extended.end(), chain.begin(), chain.end());
      second = BestFirst(drafter.Expand(extended), room - k, depth - k);
    }
    Tree combined = Tree::Chain(chain);
    for (size_t i = 0; i < second.size(); ++i) {
      combined.tokens.push_back(second.tokens[i]);
      combined.parents.push_back(second.parents[i] < 0 ? k - 1 : k + second.parents[i]);
      combined.depths.push_back(k + second.depths[i]);
      combined.scores.push_back(second.scores[i]);
    }
    last = VerifyTree(loop, *state, last, combined);
  }
}

}  // namespace specpilot
