// Kascade's offline calibration (the Kascade paper §3.2-3.5): the cross-layer similarity of
// top-k sets (Eq. 3) accumulated over a development set, the layer importance weights, the
// anchor layers of Algorithm 1 and the head map; and the calibration file that records them.
// No model here: the calibrator (kascade_calibrator.h) feeds the attention it observes.
// Narrative and every choice the paper leaves open: docs/kascade.md "Calibration".
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace rubato {

// Per-prompt accumulation of the head-level similarity of Eq. 3 and of the importance weights.
// Layers arrive in order 0, 1, ...; for each, every query token's post-softmax attention over
// its causal prefix, averaged over the GQA group of each KV head (the decode granularity).
class KascadeSimilarity {
 public:
  KascadeSimilarity(int num_layers, int num_kv_heads, int top_k);

  void BeginPrompt(int tokens);
  // probs: [tokens][kv_heads][tokens] (row q holds positions 0..q; the rest is ignored).
  Status AddLayer(int layer, const float* probs);
  // x: attention block input (residual stream), y: x + the block's output, [tokens][hidden].
  Status AddImportance(int layer, const float* x, const float* y, int tokens, int hidden);
  Status EndPrompt();

  int prompts() const { return prompts_; }
  int num_layers() const { return layers_; }
  int num_kv_heads() const { return heads_; }
  // Mean over prompts of the per-prompt minimum over tokens of sim((a, h') -> (b, h)), a <= b:
  // index ((a * H + h') * L + b) * H + h. Entries with a > b are 0.
  std::vector<double> HeadSimilarity() const;
  // Mean over prompts and tokens of 1 - cos(x, y), per layer.
  std::vector<double> Importance() const;

 private:
  size_t HeadIndex(int a, int ha, int b, int hb) const {
    return ((static_cast<size_t>(a) * heads_ + ha) * layers_ + b) * heads_ + hb;
  }

  int layers_, heads_, top_k_;
  int tokens_ = 0;
  int set_k_ = 0;  // this prompt's set size: min(top_k, tokens)
  int next_layer_ = 0;
  int prompts_ = 0;
  std::vector<int> top_sets_;       // [layer][token][kv_head][set_k_], -1 padded
  std::vector<double> prompt_min_;  // per head pair, this prompt's minimum over tokens
  std::vector<double> sum_over_prompts_;
  std::vector<double> importance_sum_;  // [layer], over prompts of the per-prompt mean
  std::vector<double> prompt_importance_;
};

// Layer-level similarity S[a][b] = w_b * (1/H) sum_h max_h' head_similarity((a, h') -> (b, h))
// for a < b, and w_b on the diagonal (a layer attends its own top-k); [L][L] row-major, 0 below.
std::vector<double> LayerSimilarity(const std::vector<double>& head_similarity,
                                    const std::vector<double>& importance, int num_layers,
                                    int num_kv_heads);

// Algorithm 1: the `anchors` layers (layer 0 always) maximizing sum_l S[anchor(l)][l], where
// anchor(l) is the last anchor <= l. Ascending. InvalidArgument unless 1 <= anchors <= L.
Result<std::vector<int>> SelectAnchorLayers(const std::vector<double>& similarity, int num_layers,
                                            int anchors);
// sum_l S[anchor(l)][l] of an anchor set (ascending, starting at 0).
double AnchorObjective(const std::vector<double>& similarity, int num_layers,
                       const std::vector<int>& anchors);

// Each layer's KV head -> the KV head of its anchor whose top-k it attends: the most similar
// (ties: the lower head); the identity on anchor layers. [layer][kv_head].
std::vector<std::vector<int>> HeadMap(const std::vector<double>& head_similarity,
                                      const std::vector<int>& anchors, int num_layers,
                                      int num_kv_heads);

// What a calibration file records.
struct KascadeCalibration {
  std::string model;  // the model directory it was made for
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  std::string dev_set;        // path as given
  std::string dev_set_fnv1a;  // 64-bit FNV-1a of the dev set file's bytes, 16 hex digits
  int prompts = 0;
  int top_k = 64;
  std::vector<int> anchors;                // ascending, anchors[0] == 0
  std::vector<std::vector<int>> head_map;  // [layer][kv_head]
  std::vector<double> importance;          // [layer]
  std::vector<double> similarity;          // S, [layer][layer]
  std::vector<double> head_similarity;     // see KascadeSimilarity::HeadSimilarity
  // Optional: what a measurement found this calibration loses on its model, logged as a warning
  // whenever a policy loads it ("" when none is known). The calibrator never writes it.
  std::string known_loss;

  // The anchor whose selection `layer` attends (the last anchor <= layer).
  int AnchorOf(int layer) const;
  bool IsAnchor(int layer) const;
};

// Checks the shape and the invariants (anchors ascending from 0, head map in range, identity on
// anchors, matrices of L x L and (L H)^2); every error names the field.
Status ValidateCalibration(const KascadeCalibration& calibration);
Status SaveCalibration(const KascadeCalibration& calibration, const std::string& path);
// Parses and validates the text of a calibration file; `what` names it in errors. Every field is
// read strictly by type and range (2.7 or 4294967298 for an integer is refused naming the field).
Result<KascadeCalibration> ParseCalibration(std::string_view text, const std::string& what);
// Reads (at most kMaxCalibrationFileBytes, text_file.h) and parses the file at `path`.
Result<KascadeCalibration> LoadCalibration(const std::string& path);
// The file's model shape against the model's: "made for 6 layers x 2 KV heads, the model has ...".
Status CheckCalibrationFits(const KascadeCalibration& calibration, int num_layers, int num_heads,
                            int num_kv_heads, int head_dim);

// 64-bit FNV-1a as 16 lowercase hex digits.
std::string Fnv1a64Hex(const std::string& bytes);

}  // namespace rubato
