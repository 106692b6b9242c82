// Kascade's calibration math and file (see kascade_calibration.h; docs/kascade.md).
#include "inference_rank/policies/kascade/kascade_calibration.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

namespace rubato {
namespace {

// The top min(k, n) positions of row[0, n), larger first, ties to the lower position.
void TopK(const float* row, int n, int k, std::vector<int>& order, int* out) {
  order.resize(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  const int keep = std::min(k, n);
  std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                    [row](int a, int b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  std::copy(order.begin(), order.begin() + keep, out);
  std::fill(out + keep, out + k, -1);
}

}  // namespace

KascadeSimilarity::KascadeSimilarity(int num_layers, int num_kv_heads, int top_k)
    : layers_(num_layers), heads_(num_kv_heads), top_k_(top_k) {
  const size_t pairs = static_cast<size_t>(layers_) * heads_ * layers_ * heads_;
  prompt_min_.assign(pairs, 1.0);
  sum_over_prompts_.assign(pairs, 0.0);
  importance_sum_.assign(static_cast<size_t>(layers_), 0.0);
  prompt_importance_.assign(static_cast<size_t>(layers_), 0.0);
}

void KascadeSimilarity::BeginPrompt(int tokens) {
  tokens_ = tokens;
  // A set never holds more positions than the prompt has: k beyond it is all -1 padding.
  set_k_ = std::min(top_k_, tokens);
  next_layer_ = 0;
  std::fill(prompt_min_.begin(), prompt_min_.end(), 1.0);
  std::fill(prompt_importance_.begin(), prompt_importance_.end(), 0.0);
  top_sets_.assign(static_cast<size_t>(layers_) * tokens_ * heads_ * set_k_, -1);
}

Status KascadeSimilarity::AddLayer(int layer, const float* probs) {
  if (layer != next_layer_) {
    return InvalidArgumentError("kascade similarity: layer " + std::to_string(layer) +
                                " arrived, expected " + std::to_string(next_layer_));
  }
  ++next_layer_;
  std::vector<int> order;
  const size_t set_stride = static_cast<size_t>(heads_) * set_k_;
  for (int q = 0; q < tokens_; ++q) {
    const int n = q + 1;
    for (int h = 0; h < heads_; ++h) {
      const float* row = probs + (static_cast<size_t>(q) * heads_ + h) * tokens_;
      int* own = top_sets_.data() + (static_cast<size_t>(layer) * tokens_ + q) * set_stride +
                 static_cast<size_t>(h) * set_k_;
      TopK(row, n, set_k_, order, own);
      double own_mass = 0.0;
      for (int i = 0; i < set_k_ && own[i] >= 0; ++i) own_mass += row[own[i]];
      for (int a = 0; a < layer; ++a) {
        const int* sets = top_sets_.data() + (static_cast<size_t>(a) * tokens_ + q) * set_stride;
        for (int ha = 0; ha < heads_; ++ha) {
          const int* set = sets + static_cast<size_t>(ha) * set_k_;
          double mass = 0.0;
          for (int i = 0; i < set_k_ && set[i] >= 0; ++i) mass += row[set[i]];
          const double ratio = own_mass > 0.0 ? mass / own_mass : 1.0;
          double& low = prompt_min_[HeadIndex(a, ha, layer, h)];
          low = std::min(low, ratio);
        }
      }
    }
  }
  return Status::Ok();
}

Status KascadeSimilarity::AddImportance(int layer, const float* x, const float* y, int tokens,
                                        int hidden) {
  if (layer < 0 || layer >= layers_ || tokens != tokens_) {
    return InvalidArgumentError("kascade importance: layer " + std::to_string(layer) + ", " +
                                std::to_string(tokens) + " tokens do not fit the prompt");
  }
  double sum = 0.0;
  for (int t = 0; t < tokens; ++t) {
    const float* a = x + static_cast<size_t>(t) * hidden;
    const float* b = y + static_cast<size_t>(t) * hidden;
    double dot = 0.0, na = 0.0, nb = 0.0;
    for (int i = 0; i < hidden; ++i) {
      dot += static_cast<double>(a[i]) * b[i];
      na += static_cast<double>(a[i]) * a[i];
      nb += static_cast<double>(b[i]) * b[i];
    }
    const double norm = std::sqrt(na) * std::sqrt(nb);
    sum += 1.0 - (norm > 0.0 ? dot / norm : 1.0);
  }
  prompt_importance_[static_cast<size_t>(layer)] = tokens > 0 ? sum / tokens : 0.0;
  return Status::Ok();
}

Status KascadeSimilarity::EndPrompt() {
  if (next_layer_ != layers_) {
    return FailedPreconditionError("kascade similarity: the prompt ended after " +
                                   std::to_string(next_layer_) + " of " + std::to_string(layers_) +
                                   " layers");
  }
  for (int a = 0; a < layers_; ++a) {
    for (int ha = 0; ha < heads_; ++ha) {
      for (int b = a + 1; b < layers_; ++b) {
        for (int hb = 0; hb < heads_; ++hb) {
          sum_over_prompts_[HeadIndex(a, ha, b, hb)] += prompt_min_[HeadIndex(a, ha, b, hb)];
        }
      }
    }
  }
  for (int l = 0; l < layers_; ++l) importance_sum_[l] += prompt_importance_[l];
  ++prompts_;
  return Status::Ok();
}

std::vector<double> KascadeSimilarity::HeadSimilarity() const {
  std::vector<double> mean(sum_over_prompts_.size(), 0.0);
  if (prompts_ == 0) return mean;
  for (size_t i = 0; i < mean.size(); ++i) mean[i] = sum_over_prompts_[i] / prompts_;
  return mean;
}

std::vector<double> KascadeSimilarity::Importance() const {
  std::vector<double> mean(importance_sum_.size(), 0.0);
  if (prompts_ == 0) return mean;
  for (size_t i = 0; i < mean.size(); ++i) mean[i] = importance_sum_[i] / prompts_;
  return mean;
}

std::vector<double> LayerSimilarity(const std::vector<double>& head_similarity,
                                    const std::vector<double>& importance, int num_layers,
                                    int num_kv_heads) {
  const int L = num_layers, H = num_kv_heads;
  std::vector<double> s(static_cast<size_t>(L) * L, 0.0);
  for (int b = 0; b < L; ++b) {
    const double w = importance[static_cast<size_t>(b)];
    s[static_cast<size_t>(b) * L + b] = w;
    for (int a = 0; a < b; ++a) {
      double total = 0.0;
      for (int hb = 0; hb < H; ++hb) {
        double best = 0.0;
        for (int ha = 0; ha < H; ++ha) {
          best =
              std::max(best, head_similarity[((static_cast<size_t>(a) * H + ha) * L + b) * H + hb]);
        }
        total += best;
      }
      s[static_cast<size_t>(a) * L + b] = w * total / H;
    }
  }
  return s;
}

Result<std::vector<int>> SelectAnchorLayers(const std::vector<double>& similarity, int num_layers,
                                            int anchors) {
  const int L = num_layers;
  if (anchors < 1 || anchors > L) {
    return InvalidArgumentError("kascade: --anchors " + std::to_string(anchors) +
                                " must lie in [1, " + std::to_string(L) + "] (layers)");
  }
  if (similarity.size() != static_cast<size_t>(L) * L) {
    return InvalidArgumentError("kascade: the similarity matrix is not " + std::to_string(L) +
                                " x " + std::to_string(L));
  }
  // segment(i, j): anchor i serves layers [i, j).
  auto segment = [&](int i, int j) {
    double sum = 0.0;
    for (int l = i; l < j; ++l) sum += similarity[static_cast<size_t>(i) * L + l];
    return sum;
  };
  const double kNone = -std::numeric_limits<double>::infinity();
  // best[m][j]: layers [0, j) covered by m anchors, the last segment ending at j.
  std::vector<std::vector<double>> best(anchors + 1, std::vector<double>(L + 1, kNone));
  std::vector<std::vector<int>> from(anchors + 1, std::vector<int>(L + 1, -1));
  for (int j = 1; j <= L; ++j) best[1][j] = segment(0, j);
  for (int m = 2; m <= anchors; ++m) {
    for (int j = m; j <= L; ++j) {
      for (int i = m - 1; i <= j - 1; ++i) {
        if (best[m - 1][i] == kNone) continue;
        const double value = best[m - 1][i] + segment(i, j);
        if (value > best[m][j]) {
          best[m][j] = value;
          from[m][j] = i;
        }
      }
    }
  }
  std::vector<int> chosen;
  for (int m = anchors, j = L; m >= 2; --m) {
    j = from[m][j];
    chosen.push_back(j);
  }
  chosen.push_back(0);
  std::reverse(chosen.begin(), chosen.end());
  return chosen;
}

double AnchorObjective(const std::vector<double>& similarity, int num_layers,
                       const std::vector<int>& anchors) {
  double sum = 0.0;
  size_t next = 0;
  int anchor = 0;
  for (int l = 0; l < num_layers; ++l) {
    if (next < anchors.size() && anchors[next] == l) anchor = anchors[next++];
    sum += similarity[static_cast<size_t>(anchor) * num_layers + l];
  }
  return sum;
}

std::vector<std::vector<int>> HeadMap(const std::vector<double>& head_similarity,
                                      const std::vector<int>& anchors, int num_layers,
                                      int num_kv_heads) {
  const int L = num_layers, H = num_kv_heads;
  std::vector<std::vector<int>> map(static_cast<size_t>(L), std::vector<int>(H));
  size_t next = 0;
  int anchor = 0;
  for (int b = 0; b < L; ++b) {
    if (next < anchors.size() && anchors[next] == b) anchor = anchors[next++];
    for (int hb = 0; hb < H; ++hb) {
      if (anchor == b) {
        map[b][hb] = hb;
        continue;
      }
      int best = 0;
      for (int ha = 1; ha < H; ++ha) {
        const auto at = [&](int h) {
          return head_similarity[((static_cast<size_t>(anchor) * H + h) * L + b) * H + hb];
        };
        if (at(ha) > at(best)) best = ha;
      }
      map[b][hb] = best;
    }
  }
  return map;
}

int KascadeCalibration::AnchorOf(int layer) const {
  int anchor = 0;
  for (int a : anchors) {
    if (a <= layer) anchor = a;
  }
  return anchor;
}

bool KascadeCalibration::IsAnchor(int layer) const {
  return std::find(anchors.begin(), anchors.end(), layer) != anchors.end();
}

std::string Fnv1a64Hex(const std::string& bytes) {
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

}  // namespace rubato
