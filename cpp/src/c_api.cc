// The C API (include/specpilot/specpilot.h) over the C++ one: exceptions become status codes and
// a thread-local message; nothing escapes the boundary.
#include <cstdlib>
#include <cstring>
#include <new>

#include "specpilot/engine.hpp"
#include "specpilot/specpilot.h"

struct sp_engine {
  std::unique_ptr<specpilot::Engine> engine;
  std::string info;
};

struct sp_batch {
  std::unique_ptr<specpilot::Batch> batch;
  std::vector<uint64_t> unreported;   // finished ids not yet handed to the caller
};

namespace {

thread_local std::string last_error;

sp_status Fail(sp_status status, const std::string& message) {
  last_error = message;
  return status;
}

template <typename F>
sp_status Guard(F&& body) {
  try {
    body();
    return SP_OK;
  } catch (const specpilot::Error& e) {
    return Fail(static_cast<sp_status>(e.status()), e.what());
  } catch (const std::bad_alloc&) {
    return Fail(SP_ERR_RUNTIME, "out of memory");
  } catch (const std::exception& e) {
    return Fail(SP_ERR_RUNTIME, e.what());
  } catch (...) {
    return Fail(SP_ERR_RUNTIME, "unknown error");
  }
}

specpilot::GenerateOptions Convert(const sp_generate_options* o) {
  specpilot::GenerateOptions out;
  if (o == nullptr) return out;
  out.engine = o->engine ? o->engine : "";
  out.max_new_tokens = o->max_new_tokens;
  out.stop_at_eos = o->stop_at_eos != 0;
  out.sampling.temperature = o->temperature;
  out.sampling.top_p = o->top_p;
  out.sampling.top_k = o->top_k;
  out.sampling.seed = o->seed;
  if (o->on_token != nullptr) {
    sp_token_callback cb = o->on_token;
    void* user = o->user;
    out.on_token = [cb, user](int32_t token) { return cb(token, user) != 0; };
  }
  return out;
}

template <typename T>
T* Copy(const std::vector<T>& v) {
  T* p = static_cast<T*>(std::malloc(std::max<size_t>(v.size(), 1) * sizeof(T)));
  if (p == nullptr) throw std::bad_alloc();
  if (!v.empty()) std::memcpy(p, v.data(), v.size() * sizeof(T));
  return p;
}

void Fill(const specpilot::Generation& g, sp_generation* out) {
  out->tokens = Copy(g.tokens);
  out->n_tokens = g.tokens.size();
  try {
    out->accepted = Copy(g.accepted);
  } catch (...) {
    std::free(out->tokens);
    out->tokens = nullptr;
    throw;
  }
  out->n_passes = g.accepted.size();
  out->seconds = g.seconds;
}

std::vector<int32_t> Prompt(const int32_t* prompt, size_t n) {
  if (prompt == nullptr && n > 0) throw specpilot::Error(specpilot::Status::kInvalidArgument, "prompt is NULL");
  return std::vector<int32_t>(prompt, prompt + n);
}

}  // namespace

extern "C" {

void sp_open_options_init(sp_open_options* o) {
  if (o == nullptr) return;
  o->device = nullptr;
  o->verify_hashes = 1;
}

void sp_generate_options_init(sp_generate_options* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof(*o));
  o->max_new_tokens = 64;
  o->top_p = 1.0;
}

sp_status sp_engine_open(const char* build_dir, const sp_open_options* options, sp_engine** out) {
  if (out == nullptr || build_dir == nullptr) return Fail(SP_ERR_INVALID_ARGUMENT, "build_dir and out must not be NULL");
  *out = nullptr;
  return Guard([&] {
    specpilot::OpenOptions o;
    if (options != nullptr) {
      o.device = options->device ? options->device : "";
      o.verify_hashes = options->verify_hashes != 0;
    }
    auto handle = std::make_unique<sp_engine>();
    handle->engine = specpilot::Engine::Open(build_dir, o);
    handle->info = handle->engine->InfoJson();
    *out = handle.release();
  });
}

void sp_engine_close(sp_engine* engine) { delete engine; }

const char* sp_engine_info(const sp_engine* engine) { return engine ? engine->info.c_str() : "{}"; }

sp_status sp_generate(sp_engine* engine, const int32_t* prompt, size_t prompt_len, const sp_generate_options* options,
                      sp_generation* out) {
  if (engine == nullptr || out == nullptr) return Fail(SP_ERR_INVALID_ARGUMENT, "engine and out must not be NULL");
  std::memset(out, 0, sizeof(*out));
  return Guard([&] { Fill(engine->engine->Generate(Prompt(prompt, prompt_len), Convert(options)), out); });
}

void sp_generation_free(sp_generation* g) {
  if (g == nullptr) return;
  std::free(g->tokens);
  std::free(g->accepted);
  std::memset(g, 0, sizeof(*g));
}

sp_status sp_batch_create(sp_engine* engine, sp_batch** out) {
  if (engine == nullptr || out == nullptr) return Fail(SP_ERR_INVALID_ARGUMENT, "engine and out must not be NULL");
  *out = nullptr;
  return Guard([&] {
    auto handle = std::make_unique<sp_batch>();
    handle->batch = engine->engine->NewBatch();
    *out = handle.release();
  });
}

void sp_batch_free(sp_batch* batch) { delete batch; }

sp_status sp_batch_add(sp_batch* batch, const int32_t* prompt, size_t prompt_len, const sp_generate_options* options,
                       uint64_t* request_id) {
  if (batch == nullptr || request_id == nullptr) return Fail(SP_ERR_INVALID_ARGUMENT, "batch and request_id must not be NULL");
  return Guard([&] { *request_id = batch->batch->Add(Prompt(prompt, prompt_len), Convert(options)); });
}

sp_status sp_batch_step(sp_batch* batch, uint64_t* finished, size_t capacity, size_t* n_finished, size_t* n_pending) {
  if (batch == nullptr || n_finished == nullptr || (finished == nullptr && capacity > 0)) {
    return Fail(SP_ERR_INVALID_ARGUMENT, "batch and n_finished must not be NULL");
  }
  *n_finished = 0;
  return Guard([&] {
    for (uint64_t id : batch->batch->Step()) batch->unreported.push_back(id);
    size_t n = std::min(capacity, batch->unreported.size());
    std::copy(batch->unreported.begin(), batch->unreported.begin() + n, finished);
    batch->unreported.erase(batch->unreported.begin(), batch->unreported.begin() + n);
    *n_finished = n;
    if (n_pending) *n_pending = batch->batch->Pending() + batch->unreported.size();
  });
}

sp_status sp_batch_take(sp_batch* batch, uint64_t request_id, sp_generation* out) {
  if (batch == nullptr || out == nullptr) return Fail(SP_ERR_INVALID_ARGUMENT, "batch and out must not be NULL");
  std::memset(out, 0, sizeof(*out));
  return Guard([&] { Fill(batch->batch->Take(request_id), out); });
}

const char* sp_last_error(void) { return last_error.c_str(); }

const char* sp_status_name(sp_status status) {
  switch (status) {
    case SP_OK: return "ok";
    case SP_ERR_INVALID_ARGUMENT: return "invalid argument";
    case SP_ERR_BUILD: return "build";
    case SP_ERR_DEVICE: return "device";
    case SP_ERR_CAPACITY: return "capacity";
    case SP_ERR_RUNTIME: return "runtime";
  }
  return "unknown";
}

}  // extern "C"
