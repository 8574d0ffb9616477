/* SpecPilot's C API: open a build directory made by `specpilot compile` and generate tokens with
 * its compiled engines (autoregressive, chain, tree and two-level speculative decoding; greedy or
 * seeded sampling), with the TVM runtime alone.  Tokens in, tokens out.
 *
 * Contract:
 *  - Every function that can fail returns an sp_status; on failure sp_last_error() gives the
 *    message (thread-local, valid until the next failing call on the same thread).  Nothing here
 *    aborts the process on bad input: a corrupt or mismatched build is an error code.
 *  - Handles are opaque.  One engine runs one call at a time (callers serialise their calls on it);
 *    separate engines are independent.
 *  - Outputs the library allocates (sp_generation) are released with sp_generation_free.
 *  - Every speculative engine emits exactly the tokens of autoregressive decoding of the same
 *    build (greedy, or sampled with the same seed): speculation changes speed, not tokens.
 */
#ifndef SPECPILOT_SPECPILOT_H_
#define SPECPILOT_SPECPILOT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SP_API_VERSION 1

typedef enum {
  SP_OK = 0,
  SP_ERR_INVALID_ARGUMENT = 1, /* a bad option, prompt or token id */
  SP_ERR_BUILD = 2,            /* the build directory: missing, corrupt, another format or version */
  SP_ERR_DEVICE = 3,           /* the build is for another device or architecture than the one given */
  SP_ERR_CAPACITY = 4,         /* the prompt and new tokens exceed max_seq_len, or no KV-cache row is free */
  SP_ERR_RUNTIME = 5           /* TVM or the device failed while running */
} sp_status;

typedef struct sp_engine sp_engine;
typedef struct sp_batch sp_batch;

typedef struct {
  const char* device;  /* "cpu", "cuda" or "cuda:N"; NULL: the build's kind, device 0 */
  int verify_hashes;   /* nonzero: check model.so and the parameters against manifest.json's SHA-256 */
} sp_open_options;

/* Called with each token as it is decided; return nonzero to go on, 0 to end the generation there. */
typedef int (*sp_token_callback)(int32_t token, void* user);

typedef struct {
  const char* engine;      /* "compiled", "compiled-spec", "compiled-tree", "compiled-two-level";
                              NULL: the build's best (two-level, tree, chain, in that order) */
  int32_t max_new_tokens;  /* > 0 */
  int stop_at_eos;         /* nonzero: stop after the target's end-of-sequence token */
  double temperature;      /* 0: greedy; > 0: seeded sampling (same tokens on every engine) */
  double top_p;            /* (0, 1] */
  int32_t top_k;           /* 0: no top-k cut */
  uint64_t seed;
  sp_token_callback on_token; /* optional: streaming */
  void* user;
} sp_generate_options;

typedef struct {
  int32_t* tokens;        /* the new tokens (the prompt excluded) */
  size_t n_tokens;
  int32_t* accepted;      /* tokens committed by each target pass (1 each for autoregressive decoding) */
  size_t n_passes;
  double seconds;         /* wall clock of the generation, prefill included */
} sp_generation;

void sp_open_options_init(sp_open_options* options);
void sp_generate_options_init(sp_generate_options* options);

sp_status sp_engine_open(const char* build_dir, const sp_open_options* options, sp_engine** out);
void sp_engine_close(sp_engine* engine);
/* A JSON object: engines, vocab_size, capacity, max_batch, eos_token_ids, dtype, target, device.
 * Owned by the engine. */
const char* sp_engine_info(const sp_engine* engine);

sp_status sp_generate(sp_engine* engine, const int32_t* prompt, size_t prompt_len,
                      const sp_generate_options* options, sp_generation* out);
void sp_generation_free(sp_generation* generation);

/* Continuous batching (autoregressive engine): requests join and leave between steps; each step
 * is one call of the build's step function over every running request (at most the build's
 * deployment.max_batch; the rest wait in arrival order).  Every request's tokens equal its own
 * sp_generate with engine "compiled".  A batch holds its engine: no other call on that engine
 * while the batch has requests. */
sp_status sp_batch_create(sp_engine* engine, sp_batch** out);
void sp_batch_free(sp_batch* batch);
sp_status sp_batch_add(sp_batch* batch, const int32_t* prompt, size_t prompt_len,
                       const sp_generate_options* options, uint64_t* request_id);
/* One step.  Writes the ids of requests that finished in it (at most `capacity`; the rest are
 * reported by later calls) and how many requests are still running or waiting. */
sp_status sp_batch_step(sp_batch* batch, uint64_t* finished, size_t capacity, size_t* n_finished,
                        size_t* n_pending);
/* A finished request's result (once; the id is then forgotten). */
sp_status sp_batch_take(sp_batch* batch, uint64_t request_id, sp_generation* out);

const char* sp_last_error(void);
const char* sp_status_name(sp_status status);

#ifdef __cplusplus
}
#endif
#endif /* SPECPILOT_SPECPILOT_H_ */
