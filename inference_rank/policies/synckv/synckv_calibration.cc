// SyncKV's head similarity and clustering (see synckv_calibration.h).
#include "inference_rank/policies/synckv/synckv_calibration.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace rubato {

SyncKvHeadOverlap::SyncKvHeadOverlap(int num_layers, int num_kv_heads, int top_k)
    : layers_(num_layers),
      heads_(num_kv_heads),
      top_k_(top_k),
      steps_(static_cast<size_t>(num_layers), 0),
      sum_(static_cast<size_t>(num_layers) * num_kv_heads * num_kv_heads, 0.0) {}

Status SyncKvHeadOverlap::AddStep(int layer, const float* pooled, int length) {
  if (layer < 0 || layer >= layers_) {
    return InvalidArgumentError("synckv calibration: layer " + std::to_string(layer) +
                                " outside [0, " + std::to_string(layers_) + ")");
  }
  if (length < 1) return InvalidArgumentError("synckv calibration: a step attends >= 1 position");
  const int k = std::min(top_k_, length);
  sets_.assign(static_cast<size_t>(heads_) * k, 0);
  order_.resize(static_cast<size_t>(length));
  for (int h = 0; h < heads_; ++h) {
    const float* row = pooled + static_cast<size_t>(h) * length;
    std::iota(order_.begin(), order_.end(), 0);
    // T_k: the k highest positions, ties to the lower position.
    std::partial_sort(order_.begin(), order_.begin() + k, order_.end(),
                      [row](int a, int b) { return row[a] != row[b] ? row[a] > row[b] : a < b; });
    std::copy(order_.begin(), order_.begin() + k, sets_.begin() + static_cast<long>(h) * k);
  }
  in_.assign(static_cast<size_t>(length), 0);
  double* sum = sum_.data() + static_cast<size_t>(layer) * heads_ * heads_;
  for (int i = 0; i < heads_; ++i) {
    const int* a = sets_.data() + static_cast<size_t>(i) * k;
    for (int n = 0; n < k; ++n) in_[static_cast<size_t>(a[n])] = 1;
    for (int j = 0; j < heads_; ++j) {
      const int* b = sets_.data() + static_cast<size_t>(j) * k;
      int common = 0;
      for (int n = 0; n < k; ++n) common += in_[static_cast<size_t>(b[n])];
      sum[i * heads_ + j] += static_cast<double>(common) / k;  // both sets hold k positions
    }
    for (int n = 0; n < k; ++n) in_[static_cast<size_t>(a[n])] = 0;
  }
  ++steps_[static_cast<size_t>(layer)];
  return Status::Ok();
}

std::vector<double> SyncKvHeadOverlap::Similarity() const {
  std::vector<double> s(sum_.size(), 1.0);
  const size_t per_layer = static_cast<size_t>(heads_) * heads_;
  for (int l = 0; l < layers_; ++l) {
    const long n = steps_[static_cast<size_t>(l)];
    if (n == 0) continue;
    for (size_t i = 0; i < per_layer; ++i) {
      s[l * per_layer + i] = sum_[l * per_layer + i] / static_cast<double>(n);
    }
  }
  return s;
}

std::vector<double> OverlapDistance(const std::vector<double>& similarity, int heads) {
  const size_t n = static_cast<size_t>(heads) * heads;
  const double max = *std::max_element(similarity.begin(), similarity.begin() + n);
  std::vector<double> d(n);
  for (size_t i = 0; i < n; ++i) d[i] = max - similarity[i];
  return d;
}

namespace {

double SquaredDistance(const double* a, const double* b, int n) {
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += (a[i] - b[i]) * (a[i] - b[i]);
  return sum;
}

// Means of the clusters' member rows: [clusters][heads].
std::vector<double> Means(const std::vector<double>& d, int heads, const std::vector<int>& cluster,
                          int clusters) {
  std::vector<double> means(static_cast<size_t>(clusters) * heads, 0.0);
  std::vector<int> members(static_cast<size_t>(clusters), 0);
  for (int h = 0; h < heads; ++h) {
    const int c = cluster[static_cast<size_t>(h)];
    ++members[static_cast<size_t>(c)];
    for (int x = 0; x < heads; ++x) means[c * heads + x] += d[h * heads + x];
  }
  for (int c = 0; c < clusters; ++c) {
    for (int x = 0; x < heads; ++x) means[c * heads + x] /= std::max(1, members[c]);
  }
  return means;
}

// Numbers clusters by their lowest member (the order of first appearance).
std::vector<int> Canonical(const std::vector<int>& cluster, int clusters) {
  std::vector<int> rename(static_cast<size_t>(clusters), -1);
  std::vector<int> out(cluster.size());
  int next = 0;
  for (size_t h = 0; h < cluster.size(); ++h) {
    int& to = rename[static_cast<size_t>(cluster[h])];
    if (to < 0) to = next++;
    out[h] = to;
  }
  return out;
}

// S(n, k), the partitions of n heads into k non-empty parts, as a double (it only bounds work).
double Stirling2(int n, int k) {
  std::vector<double> row(static_cast<size_t>(k) + 1, 0.0);
  row[0] = 1.0;
  for (int i = 1; i <= n; ++i) {
    for (int j = std::min(i, k); j >= 1; --j) row[j] = j * row[j] + row[j - 1];
    row[0] = 0.0;
  }
  return row[static_cast<size_t>(k)];
}

// Every restricted growth string of `heads` with exactly `clusters` labels, in lexicographic order.
void ExactSearch(const std::vector<double>& d, int heads, int clusters, std::vector<int>& current,
                 int used, std::vector<int>& best, double& best_objective) {
  const int h = static_cast<int>(current.size());
  if (h == heads) {
    if (used != clusters) return;
    const double objective = KMeansObjective(d, heads, current, clusters);
    if (objective < best_objective - 1e-12) {
      best_objective = objective;
      best = current;
    }
    return;
  }
  if (clusters - used > heads - h) return;  // too few heads left to open every cluster
  for (int c = 0; c <= std::min(used, clusters - 1); ++c) {
    current.push_back(c);
    ExactSearch(d, heads, clusters, current, std::max(used, c + 1), best, best_objective);
    current.pop_back();
  }
}

std::vector<int> Lloyd(const std::vector<double>& d, int heads, int clusters, int first_seed,
                       int max_iterations) {
  // Farthest-point seeding from `first_seed`.
  std::vector<double> centroids;
  std::vector<int> seeds{first_seed};
  while (static_cast<int>(seeds.size()) < clusters) {
    int far = -1;
    double far_distance = -1.0;
    for (int h = 0; h < heads; ++h) {
      double nearest = std::numeric_limits<double>::infinity();
      for (int s : seeds)
        nearest = std::min(nearest, SquaredDistance(&d[h * heads], &d[s * heads], heads));
      if (nearest > far_distance) far_distance = nearest, far = h;
    }
    seeds.push_back(far);
  }
  for (int s : seeds) centroids.insert(centroids.end(), &d[s * heads], &d[s * heads] + heads);
  std::vector<int> cluster(static_cast<size_t>(heads), -1);
  for (int iteration = 0; iteration < max_iterations; ++iteration) {
    bool changed = false;
    for (int h = 0; h < heads; ++h) {
      int nearest = 0;
      double nearest_distance = std::numeric_limits<double>::infinity();
      for (int c = 0; c < clusters; ++c) {
        const double distance = SquaredDistance(&d[h * heads], &centroids[c * heads], heads);
        if (distance < nearest_distance) nearest_distance = distance, nearest = c;
      }
      changed |= cluster[static_cast<size_t>(h)] != nearest;
      cluster[static_cast<size_t>(h)] = nearest;
    }
    // An emptied cluster takes the head farthest from its own centroid.
    for (int c = 0; c < clusters; ++c) {
      if (std::find(cluster.begin(), cluster.end(), c) != cluster.end()) continue;
      int far = -1;
      double far_distance = -1.0;
      for (int h = 0; h < heads; ++h) {
        const int own = cluster[static_cast<size_t>(h)];
        if (std::count(cluster.begin(), cluster.end(), own) < 2) continue;
        const double distance = SquaredDistance(&d[h * heads], &centroids[own * heads], heads);
        if (distance > far_distance) far_distance = distance, far = h;
      }
      cluster[static_cast<size_t>(far)] = c;
      changed = true;
    }
    centroids = Means(d, heads, cluster, clusters);
    if (!changed) break;
  }
  return Canonical(cluster, clusters);
}

}  // namespace

double KMeansObjective(const std::vector<double>& distance, int heads,
                       const std::vector<int>& cluster, int clusters) {
  const std::vector<double> means = Means(distance, heads, cluster, clusters);
  double sum = 0.0;
  for (int h = 0; h < heads; ++h) {
    sum += SquaredDistance(&distance[h * heads], &means[cluster[h] * heads], heads);
  }
  return sum;
}

Result<HeadClusters> ClusterHeads(const std::vector<double>& distance, int heads, int clusters,
                                  const KMeansOptions& options) {
  if (heads < 1 || distance.size() != static_cast<size_t>(heads) * heads) {
    return InvalidArgumentError("synckv clustering: the distance matrix is not heads x heads");
  }
  if (clusters < 1 || clusters > heads) {
    return InvalidArgumentError("policy.representatives: " + std::to_string(clusters) +
                                " clusters must lie in [1, " + std::to_string(heads) +
                                "] (the model's KV heads per layer)");
  }
  std::vector<int> best;
  double best_objective = std::numeric_limits<double>::infinity();
  if (Stirling2(heads, clusters) <= options.exact_limit) {
    std::vector<int> current;
    ExactSearch(distance, heads, clusters, current, 0, best, best_objective);
  } else {
    for (int seed = 0; seed < heads; ++seed) {
      std::vector<int> found = Lloyd(distance, heads, clusters, seed, options.max_iterations);
      const double objective = KMeansObjective(distance, heads, found, clusters);
      if (objective < best_objective - 1e-12) best_objective = objective, best = std::move(found);
    }
  }
  HeadClusters out;
  out.cluster = best;
  const std::vector<double> means = Means(distance, heads, best, clusters);
  out.representative.assign(static_cast<size_t>(clusters), -1);
  std::vector<double> nearest(static_cast<size_t>(clusters),
                              std::numeric_limits<double>::infinity());
  for (int h = 0; h < heads; ++h) {
    const int c = best[static_cast<size_t>(h)];
    const double d = SquaredDistance(&distance[h * heads], &means[c * heads], heads);
    if (d < nearest[static_cast<size_t>(c)] - 1e-12) {
      nearest[static_cast<size_t>(c)] = d;
      out.representative[static_cast<size_t>(c)] = h;
    }
  }
  return out;
}

std::vector<double> SyncKvCalibration::LayerSimilarity(int layer) const {
  const size_t n = static_cast<size_t>(num_kv_heads) * num_kv_heads;
  return std::vector<double>(similarity.begin() + static_cast<long>(layer * n),
                             similarity.begin() + static_cast<long>((layer + 1) * n));
}

Status ClusterCalibration(SyncKvCalibration& c, int clusters) {
  c.clusters = clusters;
  c.layers.clear();
  for (int l = 0; l < c.num_layers; ++l) {
    RUBATO_ASSIGN_OR_RETURN(HeadClusters layer,
                            ClusterHeads(OverlapDistance(c.LayerSimilarity(l), c.num_kv_heads),
                                         c.num_kv_heads, clusters));
    c.layers.push_back(std::move(layer));
  }
  return Status::Ok();
}

}  // namespace rubato
