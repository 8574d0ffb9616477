#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <functional>

namespace specpilot {

void CheckSampling(const Sampling& s) {
  if (!(s.temperature >= 0.0 && s.temperature <= 100.0)) throw Error(Status::kInvalidArgument, "temperature must be in [0, 100]");
  if (!(s.top_p > 0.0 && s.top_p <= 1.0)) throw Error(Status::kInvalidArgument, "top_p must be in (0, 1]");
  if (s.top_k < 0 || s.top_k > 2147483647LL) throw Error(Status::kInvalidArgument, "top_k must be in [0, 2^31 - 1]");
}

Scorer::Scorer(const Build& build, const Sampling& sampling) : build_(build), sampling_(sampling) {
  CheckSampling(sampling);
  if (!greedy() && !build.function("sample_scores")) {
    throw Error(Status::kBuild, build.dir() + ": this build has no sample_scores function; compile it again to sample");
  }
}

bool Scorer::Cuts(int64_t vocab) const {
  return (sampling_.top_k > 0 && sampling_.top_k < vocab) || sampling_.top_p < 1.0;
}

std::vector<float> Scorer::Controls(const Rows& rows) const {
  float inv_t = static_cast<float>(1.0 / sampling_.temperature);
  int64_t vocab = rows.vocab;
  int64_t k = (sampling_.top_k > 0 && sampling_.top_k < vocab) ? sampling_.top_k : vocab;
  std::vector<float> out;
  std::vector<float> values(vocab);
  for (int64_t r = 0; r < rows.n; ++r) {
    float low = -INFINITY;
    if (Cuts(vocab)) {   // the rows' values are needed here only for a cut
      values.assign(rows.row(r), rows.row(r) + vocab);
      std::partial_sort(values.begin(), values.begin() + k, values.end(), std::greater<float>());
      if (k < vocab) low = values[k - 1];
      if (sampling_.top_p < 1.0) {   // the smallest set of the top-k whose mass reaches top_p
        std::vector<float> probs(k);
        float sum = 0.f;
        for (int64_t i = 0; i < k; ++i) sum += probs[i] = std::exp((values[i] - values[0]) * inv_t);
        double before = 0.0;
        int64_t keep = 0;
        for (int64_t i = 0; i < k; ++i) {
          if (before < sampling_.top_p) ++keep;
          before += probs[i] / sum;
        }
        low = values[std::max<int64_t>(keep, 1) - 1];
      }
    }
    out.push_back(inv_t);
    out.push_back(low);
  }
  return out;
}

void Scorer::Score(Rows& rows, const std::vector<int>& positions) const {
  if (greedy()) return;
  int64_t R = rows.n;
  std::vector<int32_t> keys;
  for (int64_t r = 0; r < R; ++r) {   // seed low word, seed high word, position (two's-complement int32)
    keys.push_back(static_cast<int32_t>(static_cast<uint32_t>(sampling_.seed & 0xFFFFFFFFu)));
    keys.push_back(static_cast<int32_t>(static_cast<uint32_t>(sampling_.seed >> 32)));
    keys.push_back(static_cast<int32_t>(static_cast<uint32_t>(positions[r])));
  }
  DLDevice dev = build_.device();
  DLDataType f32{kDLFloat, 32, 1};
  std::vector<float> controls = Controls(rows);
  rows.Replace(build_.required("sample_scores")(*rows.device, Int32(keys, {R, 3}, dev), Upload(controls.data(), {R, 2}, f32, dev))
                   .cast<Tensor>());
}

std::vector<int32_t> Choose(const Build& build, const Rows& rows) {
  std::vector<int32_t> out(rows.n);
  if (auto choose = build.function("choose")) {
    Download((*choose)(*rows.device).cast<Tensor>(), out.data(), out.size() * 4);
    return out;
  }
  for (int64_t r = 0; r < rows.n; ++r) out[r] = Argmax(rows.row(r), rows.vocab);
  return out;
}

int32_t Argmax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (row[i] > row[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

}  // namespace specpilot
