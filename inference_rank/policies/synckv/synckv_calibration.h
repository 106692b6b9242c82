// SyncKV's offline head clustering (the SyncKV paper §4.1 Eq. 2 and App. B.1): per layer the
// head-to-head similarity S (the mean overlap coefficient, Eq. 1, of the heads' top-k position
// sets over a development set's decode steps, GQA query heads max-pooled into their KV head),
// the distance D = max(S) - S, K-means of D's rows into N_r clusters and each cluster's
// representative head (R-head: the member nearest its centroid); and the calibration file that
// records them. No model here: the calibrator (synckv_calibrator.h) feeds what it observes.
// Narrative and the choices the paper leaves open: docs/synckv.md "Calibration".
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace rubato {

// Accumulates Eq. 2 over observed steps. A step is one query position of one layer: per KV head
// the GQA group's post-softmax rows over the step's causal prefix, max-pooled over the group.
class SyncKvHeadOverlap {
 public:
  SyncKvHeadOverlap(int num_layers, int num_kv_heads, int top_k);

  // pooled: [kv_heads][length] for one query at position length - 1 of `layer`.
  Status AddStep(int layer, const float* pooled, int length);

  int num_layers() const { return layers_; }
  int num_kv_heads() const { return heads_; }
  int top_k() const { return top_k_; }
  // Steps observed per layer (the same for every layer when the calibrator feeds them all).
  long steps(int layer) const { return steps_[static_cast<size_t>(layer)]; }
  // S: [layer][i][j], the mean over steps of |T_k(i) ∩ T_k(j)| / min(|T_k(i)|, |T_k(j)|); 1 on
  // the diagonal; a layer without steps is all ones.
  std::vector<double> Similarity() const;

 private:
  int layers_, heads_, top_k_;
  std::vector<long> steps_;        // [layer]
  std::vector<double> sum_;        // [layer][i][j]
  std::vector<int> sets_;          // scratch: [kv_head][k], the step's top-k positions, sorted
  std::vector<int> order_;         // scratch
  std::vector<unsigned char> in_;  // scratch: [length] membership of one head's set
};

// One layer's clustering: cluster of each head and each cluster's R-head.
struct HeadClusters {
  std::vector<int> cluster;         // [heads] in [0, clusters); clusters numbered by lowest member
  std::vector<int> representative;  // [clusters]: a member of the cluster
};

struct KMeansOptions {
  // Exact search over every partition into `clusters` non-empty parts while their number
  // (a Stirling number of the second kind) is at most this; Lloyd's iterations otherwise.
  double exact_limit = 1e5;
  int max_iterations = 100;
};

// D = max(S) - S for one layer's [heads][heads] S.
std::vector<double> OverlapDistance(const std::vector<double>& similarity, int heads);
// K-means of the rows of `distance` ([heads][heads], each head a point in R^heads) into
// `clusters` parts, minimizing the sum of squared distances to the parts' means: exactly (ties:
// the lexicographically first assignment) or, past options.exact_limit, by Lloyd's iterations
// from every head as the first seed with farthest-point seeding for the rest (ties: the lower
// head), keeping the best. Then each cluster's R-head: its member nearest its mean (ties: the
// lower head). InvalidArgument unless 1 <= clusters <= heads.
Result<HeadClusters> ClusterHeads(const std::vector<double>& distance, int heads, int clusters,
                                  const KMeansOptions& options = {});
// The K-means objective of an assignment (numbered 0..clusters-1, every cluster non-empty).
double KMeansObjective(const std::vector<double>& distance, int heads,
                       const std::vector<int>& cluster, int clusters);

// What a calibration file records.
struct SyncKvCalibration {
  std::string model;  // the model directory it was made for
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  std::string dev_set;        // path as given
  std::string dev_set_fnv1a;  // 64-bit FNV-1a of the dev set file's bytes, 16 hex digits
  int prompts = 0;
  int top_k = 64;                  // k of Eq. 2
  int decode_steps = 64;           // observed query positions per prompt (its last ones)
  long steps = 0;                  // observed steps per layer
  std::vector<double> similarity;  // S, [layer][kv_head][kv_head]
  // The clustering for `clusters` (N_r) parts, for inspection: the policy clusters S again with
  // its own policy.representatives (the same deterministic function).
  int clusters = 1;
  std::vector<HeadClusters> layers;  // [layer]

  double S(int layer, int i, int j) const {
    return similarity[(static_cast<size_t>(layer) * num_kv_heads + i) * num_kv_heads + j];
  }
  std::vector<double> LayerSimilarity(int layer) const;
};

// Clusters every layer of `c.similarity` into `clusters` parts (fills c.clusters, c.layers).
Status ClusterCalibration(SyncKvCalibration& c, int clusters);
// Shape and invariants (S of layers x H x H, finite, in [0, 1], symmetric, 1 on the diagonal;
// clusters in range, non-empty, R-heads members); every error names the field.
Status ValidateSyncKvCalibration(const SyncKvCalibration& calibration);
Status SaveSyncKvCalibration(const SyncKvCalibration& calibration, const std::string& path);
// Parses and validates a calibration file's text; `what` names it in errors. Strict: every
// field by type and range, a truncated file or a null / non-finite number refused by name.
Result<SyncKvCalibration> ParseSyncKvCalibration(std::string_view text, const std::string& what);
// Reads (at most kMaxCalibrationFileBytes) and parses the file at `path`.
Result<SyncKvCalibration> LoadSyncKvCalibration(const std::string& path);
// The file's model shape against the model's, naming both.
Status CheckSyncKvCalibrationFits(const SyncKvCalibration& calibration, int num_layers,
                                  int num_heads, int num_kv_heads, int head_dim);

}  // namespace rubato
