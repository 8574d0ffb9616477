// specpilot-server: an HTTP server answering /v1/completions with token-id prompts (the shape of
// TensorRT-LLM's and Triton's token-level APIs), embedding libspecpilot through its C API.
//
//   specpilot-server BUILD_DIR [--port 8000] [--host 127.0.0.1] [--engine NAME] [--max-queue 64]
//                    [--device D] [--no-verify]
//
// One worker thread owns the engine.  With the autoregressive engine ("compiled") requests are
// decoded as one continuous batch (they join and leave between steps, up to the build's
// max_batch); with a speculative engine they run one at a time.  Either way every request's
// tokens are the ones sp_generate gives it alone.
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <algorithm>
#include <ctime>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "specpilot/specpilot.h"

using nlohmann::json;

namespace {

struct Job {
  std::vector<int32_t> prompt;
  sp_generate_options options;
  std::string engine;   // options.engine points here
  std::promise<json> done;
};

struct Settings {
  std::string build, host = "127.0.0.1", engine, device;
  int port = 8000;
  size_t max_queue = 64;
  bool verify = true;
};

json ErrorBody(const std::string& message, const std::string& type = "invalid_request_error") {
  return {{"error", {{"message", message}, {"type", type}}}};
}

class Worker {
 public:
  Worker(sp_engine* engine, std::string engine_name, size_t max_queue)
      : engine_(engine), name_(std::move(engine_name)), max_queue_(max_queue), thread_([this] { Run(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // nullopt when the queue is full
  std::optional<std::future<json>> Submit(std::unique_ptr<Job> job) {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.size() >= max_queue_) return std::nullopt;
    auto future = job->done.get_future();
    queue_.push_back(std::move(job));
    cv_.notify_one();
    return future;
  }

 private:
  static json Result(const sp_generation& g, size_t prompt_len, int32_t max_new) {
    std::vector<int32_t> tokens(g.tokens, g.tokens + g.n_tokens), accepted(g.accepted, g.accepted + g.n_passes);
    return {{"token_ids", tokens},
            {"finish_reason", static_cast<int32_t>(g.n_tokens) < max_new ? "stop" : "length"},
            {"usage", {{"prompt_tokens", prompt_len}, {"completion_tokens", g.n_tokens}, {"total_tokens", prompt_len + g.n_tokens}}},
            {"specpilot", {{"accepted", accepted}, {"seconds", g.seconds}}}};
  }

  std::unique_ptr<Job> Next(bool wait) {
    std::unique_lock<std::mutex> lock(mu_);
    if (wait) cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return nullptr;
    auto job = std::move(queue_.front());
    queue_.pop_front();
    return job;
  }

  void Run() {
    sp_batch* batch = nullptr;
    if (name_ == "compiled" && sp_batch_create(engine_, &batch) != SP_OK) batch = nullptr;
    std::map<uint64_t, std::unique_ptr<Job>> running;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_ && queue_.empty() && running.empty()) break;
      }
      if (batch == nullptr) {   // one speculative generation at a time
        auto job = Next(true);
        if (job == nullptr) continue;
        sp_generation g;
        if (sp_generate(engine_, job->prompt.data(), job->prompt.size(), &job->options, &g) == SP_OK) {
          job->done.set_value(Result(g, job->prompt.size(), job->options.max_new_tokens));
          sp_generation_free(&g);
        } else {
          job->done.set_value(ErrorBody(sp_last_error(), "generation_error"));
        }
        continue;
      }
      for (auto job = Next(running.empty()); job != nullptr; job = Next(false)) {   // new requests join
        uint64_t id = 0;
        if (sp_batch_add(batch, job->prompt.data(), job->prompt.size(), &job->options, &id) == SP_OK) {
          running[id] = std::move(job);
        } else {
          job->done.set_value(ErrorBody(sp_last_error(), "generation_error"));
        }
      }
      if (running.empty()) continue;
      uint64_t finished[64];
      size_t n_finished = 0, pending = 0;
      if (sp_batch_step(batch, finished, 64, &n_finished, &pending) != SP_OK) {
        std::string why = sp_last_error();   // a failed step fails every request in it
        for (auto& [id, job] : running) job->done.set_value(ErrorBody(why, "generation_error"));
        running.clear();
        sp_batch_free(batch);
        sp_batch_create(engine_, &batch);
        continue;
      }
      for (size_t i = 0; i < n_finished; ++i) {
        auto& job = running[finished[i]];
        sp_generation g;
        if (sp_batch_take(batch, finished[i], &g) == SP_OK) {
          job->done.set_value(Result(g, job->prompt.size(), job->options.max_new_tokens));
          sp_generation_free(&g);
        } else {
          job->done.set_value(ErrorBody(sp_last_error(), "generation_error"));
        }
        running.erase(finished[i]);
      }
    }
    sp_batch_free(batch);
  }

  sp_engine* engine_;
  std::string name_;
  size_t max_queue_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Job>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

// A request body -> a job, or the reason it is refused.
std::unique_ptr<Job> ParseRequest(const std::string& body, const std::string& engine, std::string* why) {
  json req = json::parse(body, nullptr, false);
  if (req.is_discarded() || !req.is_object()) {
    *why = "the body is not a JSON object";
    return nullptr;
  }
  auto job = std::make_unique<Job>();
  sp_generate_options_init(&job->options);
  try {
    const json& prompt = req.at("prompt");
    if (!prompt.is_array() || prompt.empty()) throw std::invalid_argument("'prompt' must be a non-empty array of token ids");
    for (const json& t : prompt) {
      if (!t.is_number_integer()) throw std::invalid_argument("'prompt' must hold integer token ids");
      job->prompt.push_back(t.get<int32_t>());
    }
    if (req.value("stream", false)) throw std::invalid_argument("'stream' is not supported by this server");
    if (req.contains("n") && req["n"] != 1) throw std::invalid_argument("'n' must be 1");
    job->options.max_new_tokens = req.value("max_tokens", 16);
    job->options.temperature = req.value("temperature", 0.0);
    job->options.top_p = req.value("top_p", 1.0);
    job->options.top_k = req.value("top_k", 0);
    job->options.seed = req.value("seed", static_cast<uint64_t>(0));
    job->options.stop_at_eos = req.value("ignore_eos", false) ? 0 : 1;
  } catch (const json::exception& e) {
    *why = std::string("bad request field: ") + e.what();
    return nullptr;
  } catch (const std::invalid_argument& e) {
    *why = e.what();
    return nullptr;
  }
  job->engine = engine;
  job->options.engine = job->engine.empty() ? nullptr : job->engine.c_str();
  return job;
}

bool ParseArgs(int argc, char** argv, Settings* s) {
  if (argc < 2 || argv[1][0] == '-') return false;
  s->build = argv[1];
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--no-verify") {
      s->verify = false;
      continue;
    }
    if (i + 1 >= argc) return false;
    std::string v = argv[++i];
    if (a == "--port") {
      s->port = std::atoi(v.c_str());
    } else if (a == "--host") {
      s->host = v;
    } else if (a == "--engine") {
      s->engine = v;
    } else if (a == "--device") {
      s->device = v;
    } else if (a == "--max-queue") {
      s->max_queue = static_cast<size_t>(std::atol(v.c_str()));
    } else {
      return false;
    }
  }
  return s->port >= 0 && s->port < 65536 && s->max_queue > 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  if (!ParseArgs(argc, argv, &settings)) {
    std::fprintf(stderr, "usage: specpilot-server BUILD_DIR [--port N] [--host H] [--engine NAME] [--max-queue N] "
                         "[--device D] [--no-verify]\n");
    return 2;
  }
  sp_open_options open_options;
  sp_open_options_init(&open_options);
  open_options.device = settings.device.empty() ? nullptr : settings.device.c_str();
  open_options.verify_hashes = settings.verify;
  sp_engine* engine = nullptr;
  if (sp_engine_open(settings.build.c_str(), &open_options, &engine) != SP_OK) {
    std::fprintf(stderr, "specpilot-server: %s\n", sp_last_error());
    return 1;
  }
  json info = json::parse(sp_engine_info(engine));
  std::string engine_name = settings.engine.empty() ? info["engines"].back().get<std::string>() : settings.engine;
  auto engines = info["engines"].get<std::vector<std::string>>();
  if (std::find(engines.begin(), engines.end(), engine_name) == engines.end()) {
    std::fprintf(stderr, "specpilot-server: unknown engine '%s' for this build; available: %s\n", engine_name.c_str(),
                 info["engines"].dump().c_str());
    sp_engine_close(engine);
    return 2;
  }
  std::string model = settings.build;
  std::atomic<uint64_t> next_id{1};
  {
    Worker worker(engine, engine_name, settings.max_queue);
    httplib::Server server;
    server.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"status":"ok"})", "application/json");
    });
    server.Get("/v1/models", [&](const httplib::Request&, httplib::Response& res) {
      json body = {{"object", "list"}, {"data", {{{"id", model}, {"object", "model"}, {"owned_by", "specpilot"}, {"specpilot", info}}}}};
      res.set_content(body.dump(), "application/json");
    });
    server.Post("/v1/completions", [&](const httplib::Request& req, httplib::Response& res) {
      std::string why;
      auto job = ParseRequest(req.body, engine_name, &why);
      if (job == nullptr) {
        res.status = 400;
        res.set_content(ErrorBody(why).dump(), "application/json");
        return;
      }
      auto future = worker.Submit(std::move(job));
      if (!future) {
        res.status = 503;
        res.set_content(ErrorBody("the server's queue is full; retry later", "overloaded").dump(), "application/json");
        return;
      }
      json result = future->get();
      if (result.contains("error")) {
        res.status = 400;
        res.set_content(result.dump(), "application/json");
        return;
      }
      json choice = {{"index", 0}, {"text", ""}, {"token_ids", result["token_ids"]}, {"finish_reason", result["finish_reason"]}};
      json body = {{"id", "cmpl-" + std::to_string(next_id++)},
                   {"object", "text_completion"},
                   {"created", static_cast<int64_t>(std::time(nullptr))},
                   {"model", model},
                   {"choices", json::array({choice})},
                   {"usage", result["usage"]},
                   {"specpilot", result["specpilot"]}};
      res.set_content(body.dump(), "application/json");
    });
    int port = settings.port;
    if (port == 0) port = server.bind_to_any_port(settings.host);
    else if (!server.bind_to_port(settings.host, port)) port = -1;
    if (port < 0) {
      std::fprintf(stderr, "specpilot-server: cannot listen on %s:%d\n", settings.host.c_str(), settings.port);
      sp_engine_close(engine);
      return 1;
    }
    std::printf("specpilot-server: %s (engine %s) on http://%s:%d\n", settings.build.c_str(), engine_name.c_str(),
                settings.host.c_str(), port);
    std::fflush(stdout);
    server.listen_after_bind();
  }
  sp_engine_close(engine);
  return 0;
}
