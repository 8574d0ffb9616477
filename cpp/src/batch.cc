// Continuous batching of autoregressive requests: a finished request leaves and a waiting one
// joins between steps, its prompt prefilled in the same step function call as the others' next
// tokens (specpilot/runtime/batching.py's autoregressive runs, which prefill a join in a pass of its own).
#include <chrono>
#include <deque>
#include <map>

#include "engine_impl.h"

namespace specpilot {

struct Batch::Impl {
  using Clock = std::chrono::steady_clock;
  struct Request {
    uint64_t id;
    std::vector<int32_t> feed;   // the prompt, then each step's new token
    std::unique_ptr<Scorer> scorer;
    std::unique_ptr<Emitter> out;
    std::unique_ptr<State> state;
    Clock::time_point start;
  };

  explicit Impl(Engine::Impl& e) : engine(e) {}
  void Admit();
  std::vector<uint64_t> Step();

  Engine::Impl& engine;
  std::deque<Request> waiting;
  std::vector<Request> running;   // in admission order
  std::map<uint64_t, Generation> finished;
  uint64_t next_id = 1;
};

void Batch::Impl::Admit() {
  while (!waiting.empty() && static_cast<int>(running.size()) < engine.build.max_batch() && engine.target.free_rows() > 0) {
    Request r = std::move(waiting.front());
    waiting.pop_front();
    r.state = engine.target.NewState();
    r.start = Clock::now();
    running.push_back(std::move(r));
  }
}

std::vector<uint64_t> Batch::Impl::Step() {
  Admit();
  if (running.empty()) return {};
  std::vector<StepItem> items;
  std::vector<int> predicted;
  for (auto& r : running) {
    items.push_back(StepItem{r.feed, r.state.get()});
    predicted.push_back(r.state->length + static_cast<int>(r.feed.size()));
  }
  std::vector<Rows> rows = engine.target.ForwardBatch(items, false, true);
  std::vector<uint64_t> done;
  std::vector<Request> still;
  for (size_t i = 0; i < running.size(); ++i) {
    Request& r = running[i];
    r.scorer->Score(rows[i], {predicted[i]});
    int32_t token = r.out->Emit(Choose(engine.build, rows[i])[0]);
    r.out->gen.accepted.push_back(1);
    if (r.out->stopped()) {
      r.out->gen.seconds = std::chrono::duration<double>(Clock::now() - r.start).count();
      finished[r.id] = std::move(r.out->gen);
      done.push_back(r.id);
    } else {
      r.feed = {token};
      still.push_back(std::move(r));
    }
  }
  running = std::move(still);   // finished requests' states go, and their cache rows with them
  return done;
}

Batch::Batch(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Batch::~Batch() = default;

std::unique_ptr<Batch> Engine::NewBatch() { return std::make_unique<Batch>(std::make_unique<Batch::Impl>(*impl_)); }

uint64_t Batch::Add(const std::vector<int32_t>& prompt, const GenerateOptions& options) {
  if (!options.engine.empty() && options.engine != "compiled") {
    throw Error(Status::kInvalidArgument, "batched requests decode autoregressively (engine 'compiled'), not '" + options.engine + "'");
  }
  impl_->engine.CheckRequest(prompt, options);
  Impl::Request r;
  r.id = impl_->next_id++;
  r.feed = prompt;
  r.scorer = std::make_unique<Scorer>(impl_->engine.build, options.sampling);
  r.out = std::make_unique<Emitter>(options.max_new_tokens, impl_->engine.StopIds(options), options.on_token);
  impl_->waiting.push_back(std::move(r));
  return impl_->waiting.back().id;
}

std::vector<uint64_t> Batch::Step() {
  try {
    return impl_->Step();
  } catch (const ffi::Error& e) {
    throw Error(Status::kRuntime, e.message());
  }
}

size_t Batch::Pending() const { return impl_->waiting.size() + impl_->running.size(); }

Generation Batch::Take(uint64_t request_id) {
  auto it = impl_->finished.find(request_id);
  if (it == impl_->finished.end()) {
    throw Error(Status::kInvalidArgument, "request " + std::to_string(request_id) + " has not finished (or was taken)");
  }
  Generation g = std::move(it->second);
  impl_->finished.erase(it);
  return g;
}

}  // namespace specpilot
