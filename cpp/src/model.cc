#include "model.h"

#include "tree.h"

#include <algorithm>
#include <set>

namespace specpilot {

const float* Rows::row(int64_t i) const {
  if (host_.empty()) host_ = FloatRows(*device, 0, n);
  return host_.data() + i * vocab;
}

std::vector<int32_t> Pass::Path(int index) const { return RootPath(parents, index); }

State::State(Model* model, int row) : model_(model), row_(row) {
  const auto& caches = model->spec().caches;
  SetStates(caches.count("conv") ? model->Zeros("conv") : model->Zeros(""),
            caches.count("rec") ? model->Zeros("rec") : model->Zeros(""));
}

State::~State() { model_->Release(row_); }

Tensor State::conv() {
  Settle();
  return conv_;
}

Tensor State::rec() {
  Settle();
  return rec_;
}

void State::SetStates(Tensor conv, Tensor rec) {
  conv_ = std::move(conv);
  rec_ = std::move(rec);
  pending_.reset();
}

void State::SetAfter(std::shared_ptr<Pass> pass) { pending_ = std::move(pass); }

void State::Settle() {
  if (!pending_) return;
  auto p = std::move(pending_);
  pending_.reset();
  std::tie(conv_, rec_) = model_->CommitAt(*p, p->length - 1);
}

void State::CheckRoom(int n_new) const {
  if (length + n_new > model_->capacity()) {
    throw Error(Status::kCapacity, "sequence of " + std::to_string(length + n_new) + " tokens exceeds deployment.max_seq_len=" +
                                       std::to_string(model_->capacity()) + "; raise it in the spec or ask for fewer tokens");
  }
}

State::Snapshot State::Snap() { return Snapshot{length, conv(), rec()}; }

void State::Restore(const Snapshot& snap, bool keep_history) {
  length = snap.length;
  SetStates(snap.conv, snap.rec);
  std::vector<std::shared_ptr<Pass>> kept;
  for (auto& p : history) {
    if (keep_history && p->start + p->length <= length) kept.push_back(p);
  }
  history = std::move(kept);
}

Model::Model(const Build& build, const std::string& which)
    : build_(build),
      spec_(build.model(which)),
      prefill_(build.required(which + "_prefill")),
      decode_(build.required(which + "_decode")),
      decode_batch_(build.function(which + "_decode_batch").value_or(decode_)),
      verify_(build.required(which + "_verify")),
      commit_(build.function(which + "_commit")),
      compact_kv_(build.function(which + "_compact_kv")),
      verify_view_(build.function(which + "_verify_view")),
      kv_(spec_.caches.count("kv") ? Zeros("kv") : Placeholder()),
      staging_(build.device()) {
  for (int r = build.max_batch() - 1; r >= 0; --r) free_rows_.push_back(r);
}

Tensor Model::Placeholder() const { return specpilot::Zeros({1}, DLDataType{kDLFloat, 32, 1}, build_.device()); }

Tensor Model::Zeros(const std::string& cache) const {
  auto it = spec_.caches.find(cache);
  if (it == spec_.caches.end()) return Placeholder();
  Shape shape = it->second.shape;
  if (cache != "kv") shape.insert(shape.begin(), 1);   // one sequence's recurrent states: (1, ...)
  return specpilot::Zeros(shape, it->second.dtype, build_.device());
}

std::unique_ptr<State> Model::NewState() {
  if (free_rows_.empty()) {
    throw Error(Status::kCapacity, "all " + std::to_string(build_.max_batch()) + " KV-cache rows of the " + spec_.which +
                                       " are in use; raise deployment.max_batch in the spec or finish sequences first");
  }
  int row = free_rows_.back();
  free_rows_.pop_back();
  return std::make_unique<State>(this, row);
}

struct Model::Inputs {
  ffi::Function fn;
  std::vector<ffi::Any> args;
  int T = 0;
  std::vector<int32_t> parents;   // (B, T)
};

Model::Inputs Model::Prepare(std::vector<StepItem>& items, bool record) {
  std::set<State*> seen;
  int B = static_cast<int>(items.size()), T = 0, L = 0;
  for (auto& it : items) {
    if (!seen.insert(it.state).second) throw Error(Status::kInvalidArgument, "a sequence appears twice in one batch");
    int n = static_cast<int>(it.tokens.size());
    if (n == 0) throw Error(Status::kInvalidArgument, "a step item without tokens");
    it.state->CheckRoom(n);
    T = std::max(T, n);
    L = std::max(L, it.state->length + n);
  }
  std::vector<int32_t> tokens(B * T, 0), positions(B * T, 0), slots(B * T, -1), rows(B), parents(B * T);
  std::vector<uint8_t> mask(static_cast<size_t>(B) * T * L, 0);
  for (int b = 0; b < B; ++b) {
    const StepItem& it = items[b];
    int n = static_cast<int>(it.tokens.size()), start = it.state->length;
    rows[b] = it.state->row();
    for (int i = 0; i < T; ++i) {
      parents[b * T + i] = i - 1;                             // a chain unless a tree is given
      mask[(static_cast<size_t>(b) * T + i) * L] = 1;         // padding rows attend somewhere
    }
    for (int i = 0; i < n; ++i) {
      tokens[b * T + i] = it.tokens[i];
      slots[b * T + i] = start + i;
      positions[b * T + i] = it.positions.empty() ? start + i : it.positions[i];
      if (!it.parents.empty()) parents[b * T + i] = it.parents[i];
      uint8_t* m = &mask[(static_cast<size_t>(b) * T + i) * L];
      for (int j = 0; j < start + n; ++j) {
        m[j] = it.mask.empty() ? (j <= start + i) : it.mask[static_cast<size_t>(i) * (start + n) + j];
      }
    }
  }
  // the states first: settling one runs commit, whose inputs go through the same staging buffer
  Tensor conv, rec;
  if (spec_.has_gdn) {
    std::vector<Tensor> convs, recs;
    for (auto& it : items) {
      convs.push_back(it.state->conv());
      recs.push_back(it.state->rec());
    }
    conv = Stack(convs);
    rec = Stack(recs);
  } else {   // the placeholder arguments of a model without recurrent layers
    conv = items[0].state->conv();
    rec = items[0].state->rec();
  }
  Inputs in;
  in.T = T;
  staging_.AddInt32(tokens, {B, T});
  staging_.AddInt32(positions, {B, T});
  staging_.AddInt32(slots, {B, T});
  staging_.AddBool(mask, {B, T, L});
  staging_.AddInt32(rows, {B});
  if (record) staging_.AddInt32(parents, {B, T});
  for (Tensor& t : staging_.Send()) in.args.push_back(t);
  in.args.insert(in.args.end(), {kv_, conv, rec, build_.params()});
  in.fn = record ? verify_ : T > 1 ? prefill_ : B == 1 ? decode_ : decode_batch_;
  in.parents = std::move(parents);
  return in;
}

namespace {

ffi::Any Call(const ffi::Function& fn, const std::vector<ffi::Any>& args) {
  std::vector<ffi::AnyView> views(args.begin(), args.end());
  ffi::Any out;
  try {
    fn.CallPacked(views.data(), static_cast<int32_t>(views.size()), &out);
  } catch (const ffi::Error& e) {
    throw Error(Status::kRuntime, "step function failed: " + e.message());
  }
  return out;
}

}  // namespace

std::vector<Rows> Model::ForwardBatch(std::vector<StepItem>& items, bool record, bool last_only) {
  int longest = 0;
  for (auto& it : items) longest = std::max(longest, static_cast<int>(it.tokens.size()));
  if (record && max_verify_tokens() && longest > max_verify_tokens()) {
    throw Error(Status::kInvalidArgument, "a verification of " + std::to_string(longest) + " tokens; this build's Gated DeltaNet " +
                                              "tree kernel takes at most " + std::to_string(max_verify_tokens()));
  }
  Inputs in = Prepare(items, record);
  ffi::Any out = Call(in.fn, in.args);
  Tensor logits{ffi::UnsafeInit()};
  ffi::Array<ffi::Any> parts;
  if (spec_.tuple_out) {
    parts = out.cast<ffi::Array<ffi::Any>>();
    logits = parts[0].cast<Tensor>();
  } else {
    logits = out.cast<Tensor>();
  }
  std::vector<Rows> result;
  for (size_t b = 0; b < items.size(); ++b) {
    StepItem& it = items[b];
    int n = static_cast<int>(it.tokens.size()), start = it.state->length;
    Rows r;
    r.vocab = ShapeOf(logits).back();
    int first = last_only ? n - 1 : 0;
    r.n = n - first;
    r.device = AlignedView(logits, {r.n, r.vocab}, (static_cast<size_t>(b) * in.T + first) * r.vocab * 4);
    result.push_back(std::move(r));
    if (spec_.has_gdn) {
      Tensor conv = parts[1].cast<Tensor>(), rec = parts[2].cast<Tensor>();
      if (record) {
        auto p = std::make_shared<Pass>();
        p->start = start;
        p->length = n;
        p->conv_states = Row(conv, static_cast<int>(b), n);
        p->rec_records = Row(rec, static_cast<int>(b), n);
        p->conv_before = it.state->conv();
        p->rec_before = it.state->rec();
        p->parents.assign(in.parents.begin() + b * in.T, in.parents.begin() + b * in.T + n);
        it.state->history.push_back(p);
        it.state->SetAfter(p);
      } else {
        it.state->SetStates(Row(conv, static_cast<int>(b), -1), Row(rec, static_cast<int>(b), -1));
      }
    }
    it.state->length = start + n;
  }
  return result;
}

Rows Model::Forward(StepItem item, bool record, bool last_only) {
  if (!item.parents.empty() && spec_.has_gdn && !path_recompute()) {
    for (size_t i = 0; i < item.parents.size(); ++i) {
      if (item.parents[i] != static_cast<int32_t>(i) - 1) {
        throw Error(Status::kBuild, build_.dir() + ": tree verification of a hybrid (Gated DeltaNet) target needs a build with "
                                                   "the gdn-path-recompute pass");
      }
    }
  }
  std::vector<StepItem> items{std::move(item)};
  return std::move(ForwardBatch(items, record, last_only)[0]);
}

Rows Model::ForwardView(const StepItem& item) {
  if (!verify_view_) throw Error(Status::kBuild, build_.dir() + ": no " + spec_.which + "_verify_view; build with nested-int8-view");
  std::vector<StepItem> items{item};
  Inputs in = Prepare(items, true);
  ffi::Any out = Call(*verify_view_, in.args);
  Tensor logits = spec_.tuple_out ? out.cast<ffi::Array<ffi::Any>>()[0].cast<Tensor>() : out.cast<Tensor>();
  Rows r;
  r.vocab = ShapeOf(logits).back();
  r.n = static_cast<int64_t>(item.tokens.size());
  r.device = View(logits, {r.n, r.vocab}, 0);
  return r;
}

void Model::AcceptPath(State& state, int base, const std::vector<int>& rows) {
  for (size_t i = 1; i < rows.size(); ++i) {
    if (rows[i] <= rows[i - 1]) throw Error(Status::kRuntime, "accept_path: rows are not an ascending path");
  }
  if (!rows.empty() && (rows[0] < 0 || base + rows.back() >= state.length)) {
    throw Error(Status::kRuntime, "accept_path: rows outside the last pass");
  }
  std::vector<int32_t> src, dst;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] != static_cast<int>(i)) {
      src.push_back(base + rows[i]);
      dst.push_back(base + static_cast<int>(i));
    }
  }
  if (!src.empty() && spec_.has_attention) {
    if (!compact_kv_) {
      throw Error(Status::kBuild, build_.dir() + ": this build cannot keep a tree path (no " + spec_.which +
                                      "_compact_kv); build it with the tree-verify pass");
    }
    int m = static_cast<int>(src.size());
    staging_.AddInt32({state.row()}, {1});
    staging_.AddInt32(src, {1, m});
    staging_.AddInt32(dst, {1, m});
    auto in = staging_.Send();
    Call(*compact_kv_, {kv_, in[0], in[1], in[2]});
  }
  if (spec_.has_gdn && !rows.empty()) {   // the tree pass's records: the state after the path's last token
    if (state.history.empty() || state.history.back()->start != base) {
      throw Error(Status::kRuntime, "accept_path: the last pass was not a recorded verification starting at base");
    }
    auto [conv, rec] = CommitAt(*state.history.back(), rows.back());
    state.SetStates(conv, rec);
  }
  state.length = base + static_cast<int>(rows.size());
  state.history.clear();
}

void Model::Truncate(State& state, int length) {
  if (length == state.length) return;
  if (length < 0 || length > state.length) {
    throw Error(Status::kRuntime, "cannot truncate a state of length " + std::to_string(state.length) + " to " + std::to_string(length));
  }
  if (spec_.has_gdn) {
    bool found = false;
    for (auto& p : state.history) {
      if (length == p->start) {
        state.SetStates(p->conv_before, p->rec_before);
        found = true;
        break;
      }
      if (p->start < length && length <= p->start + p->length) {
        auto [conv, rec] = CommitAt(*p, length - p->start - 1);
        state.SetStates(conv, rec);
        found = true;
        break;
      }
    }
    if (!found) throw Error(Status::kRuntime, "recurrent state at length " + std::to_string(length) + " was not recorded");
    std::vector<std::shared_ptr<Pass>> kept;
    for (auto& p : state.history) {
      if (p->start < length) kept.push_back(p);
    }
    state.history = std::move(kept);
  }
  state.length = length;
}

std::pair<Tensor, Tensor> Model::CommitAt(const Pass& pass, int index) {
  if (!commit_) throw Error(Status::kBuild, build_.dir() + ": no " + spec_.which + "_commit function");
  std::vector<int32_t> path = pass.Path(index);
  staging_.AddInt32(path, {1, static_cast<int64_t>(path.size())});
  staging_.AddInt32({index}, {1});
  auto in = staging_.Send();
  ffi::Any out = Call(*commit_, {pass.conv_states, pass.rec_records, pass.rec_before, in[0], in[1]});
  auto parts = out.cast<ffi::Array<ffi::Any>>();
  return {parts[0].cast<Tensor>(), parts[1].cast<Tensor>()};
}

Tensor Model::Stack(const std::vector<Tensor>& parts) {
  if (parts.size() == 1) return parts[0];
  Shape shape = ShapeOf(parts[0]);
  size_t each = Bytes(parts[0]);
  shape[0] = static_cast<int64_t>(parts.size());
  Tensor out = Empty(shape, parts[0].dtype(), build_.device());
  Shape one = ShapeOf(parts[0]);
  for (size_t b = 0; b < parts.size(); ++b) CopyInto(parts[b], View(out, one, b * each));
  return out;
}

Tensor Model::Row(const Tensor& t, int b, int n) {
  Shape shape = ShapeOf(t);
  if (shape[0] == 1 && (n < 0 || shape[1] == n)) return t;
  Shape one = shape;
  one[0] = 1;
  size_t per_entry = Elements(one) * ElementBytes(t.dtype());
  if (n >= 0) one[1] = n;   // per-token results: the first n tokens (contiguous)
  return Clone(View(t, one, b * per_entry));
}

}  // namespace specpilot
