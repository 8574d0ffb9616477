/* specpilot-generate: a minimal C program over libspecpilot's C API.
 *
 *   specpilot-generate BUILD_DIR --prompt-ids 1,2,3 [--prompt-ids ...] [--engine NAME ...]
 *       [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
 *       [--stop-at-eos] [--device cpu|cuda:N] [--no-verify] [--stream]
 *
 * One JSON line per (engine, prompt): {"engine", "prompt", "tokens", "accepted", "seconds"}.
 * --stream prints each token to stderr as it is decided.  Exit status 2 on bad usage, 1 on an
 * error from the library (its message on stderr). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "specpilot/specpilot.h"

#define MAX_ITEMS 64
/* bad usage once prompts may be allocated: report, then free them on the way out */
#define USAGE(why) do { status = usage(why); goto done; } while (0)

static int usage(const char* why) {
  fprintf(stderr, "specpilot-generate: %s\nusage: specpilot-generate BUILD_DIR --prompt-ids 1,2,3 [--engine NAME] "
                  "[--max-new-tokens N] [--temperature T --top-p P --top-k K --seed S] [--stop-at-eos] "
                  "[--device D] [--no-verify] [--stream]\n", why);
  return 2;
}

static int parse_ids(const char* text, int32_t** out, size_t* n) {
  size_t cap = 16, count = 0;
  int32_t* ids = malloc(cap * sizeof(int32_t));
  const char* p = text;
  while (ids != NULL && *p) {
    char* end;
    errno = 0;
    long v = strtol(p, &end, 10);
    if (end == p || errno != 0 || v < -2147483647L || v > 2147483647L || (*end != ',' && *end != '\0')) {
      free(ids);
      return 0;
    }
    if (count == cap) {
      int32_t* grown = realloc(ids, (cap *= 2) * sizeof(int32_t));
      if (grown == NULL) break;
      ids = grown;
    }
    ids[count++] = (int32_t)v;
    p = *end == ',' ? end + 1 : end;
  }
  if (ids == NULL || count == 0) {
    free(ids);
    return 0;
  }
  *out = ids;
  *n = count;
  return 1;
}

static int stream_token(int32_t token, void* user) {
  (void)user;
  fprintf(stderr, "%d ", token);
  fflush(stderr);
  return 1;
}

static void print_array(const int32_t* values, size_t n) {
  putchar('[');
  for (size_t i = 0; i < n; ++i) printf(i ? ",%d" : "%d", values[i]);
  putchar(']');
}

int main(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return usage("BUILD_DIR first");
  const char* engines[MAX_ITEMS];
  int32_t* prompts[MAX_ITEMS];
  size_t lengths[MAX_ITEMS], n_engines = 0, n_prompts = 0;
  sp_open_options open_options;
  sp_generate_options options;
  sp_open_options_init(&open_options);
  sp_generate_options_init(&options);
  int status = 0;
  sp_engine* engine = NULL;
  for (int i = 2; i < argc; ++i) {
    const char* a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    int takes = strcmp(a, "--stop-at-eos") && strcmp(a, "--no-verify") && strcmp(a, "--stream");
    if (takes && strstr(" --prompt-ids --engine --max-new-tokens --temperature --top-p --top-k --seed --device ", a) == NULL)
      USAGE("unknown option");
    if (takes && v == NULL) USAGE("an option lacks its value");
    if (!strcmp(a, "--prompt-ids")) {
      if (n_prompts == MAX_ITEMS || !parse_ids(v, &prompts[n_prompts], &lengths[n_prompts])) USAGE("bad --prompt-ids");
      ++n_prompts;
    } else if (!strcmp(a, "--engine")) {
      if (n_engines == MAX_ITEMS) USAGE("too many engines");
      engines[n_engines++] = v;
    } else if (!strcmp(a, "--max-new-tokens")) {
      options.max_new_tokens = atoi(v);
    } else if (!strcmp(a, "--temperature")) {
      options.temperature = strtod(v, NULL);
    } else if (!strcmp(a, "--top-p")) {
      options.top_p = strtod(v, NULL);
    } else if (!strcmp(a, "--top-k")) {
      options.top_k = atoi(v);
    } else if (!strcmp(a, "--seed")) {
      options.seed = strtoull(v, NULL, 10);
    } else if (!strcmp(a, "--device")) {
      open_options.device = v;
    } else if (!strcmp(a, "--stop-at-eos")) {
      options.stop_at_eos = 1;
    } else if (!strcmp(a, "--no-verify")) {
      open_options.verify_hashes = 0;
    } else if (!strcmp(a, "--stream")) {
      options.on_token = stream_token;
    } else {
      USAGE("unknown option");
    }
    i += takes;
  }
  if (n_prompts == 0) USAGE("give at least one --prompt-ids");
  if (n_engines == 0) engines[n_engines++] = NULL;   /* the build's best */

  if (sp_engine_open(argv[1], &open_options, &engine) != SP_OK) {
    fprintf(stderr, "specpilot-generate: %s\n", sp_last_error());
    status = 1;
  }
  for (size_t e = 0; e < n_engines && status == 0; ++e) {
    options.engine = engines[e];
    for (size_t p = 0; p < n_prompts; ++p) {
      sp_generation g;
      if (sp_generate(engine, prompts[p], lengths[p], &options, &g) != SP_OK) {
        fprintf(stderr, "specpilot-generate: %s\n", sp_last_error());
        status = 1;
        break;
      }
      printf("{\"engine\":\"%s\",\"prompt\":%zu,\"tokens\":", engines[e] ? engines[e] : "default", p);
      print_array(g.tokens, g.n_tokens);
      printf(",\"accepted\":");
      print_array(g.accepted, g.n_passes);
      printf(",\"seconds\":%.6f}\n", g.seconds);
      sp_generation_free(&g);
    }
  }
  sp_engine_close(engine);
done:
  for (size_t p = 0; p < n_prompts; ++p) free(prompts[p]);
  return status;
}
