// Metrics registry: counters, gauges and histograms, exposed in the Prometheus text format 0.0.4
// (what `/metrics` of every rubato process serves). A checked front of prometheus-cpp: its
// Registry, Family and Counter/Gauge/Histogram hold the values and its TextSerializer writes the
// text; this layer adds errors as Status values (names, labels, buckets, conflicting
// definitions), refuses bad updates with one warning, and writes families and children in a
// deterministic order. Counter and gauge updates are lock-free; a histogram observation takes
// that histogram's own mutex; the registry's mutex guards only registration, child creation and
// exposition, so look children up once (WithLabels locks) and keep the pointer: pointers live as
// long as the registry. Callers own the registry; there is no process-wide default. Usage:
// docs/common.md "Metrics".
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace rubato {

// The Content-Type of ExpositionText (Prometheus text format 0.0.4).
inline constexpr const char* kExpositionContentType = "text/plain; version=0.0.4; charset=utf-8";

enum class MetricType { kCounter, kGauge, kHistogram };

class MetricFamilyBase;

// "counter", "gauge" or "histogram": the word used in `# TYPE` lines.
std::string_view MetricTypeName(MetricType type);

// A monotonic value. Increments that are negative or NaN are ignored (a counter that went
// backwards would read as a process restart to Prometheus' rate()); the first one per family
// logs a warning on the "metrics" logger. Metrics are observability: a caller's bad value must
// never take a server down, so there is no assert.
class Counter {
 public:
  void Increment(double amount = 1.0);
  double Value() const;

 private:
  template <typename>
  friend class MetricFamily;
  using Impl = prometheus::Counter;
  Counter(prometheus::Counter* value, MetricFamilyBase* family) : value_(value), family_(family) {}

  prometheus::Counter* value_;  // owned by the prometheus-cpp family
  MetricFamilyBase* family_;    // the owner, which logs rejected increments
};

// A value that goes up and down. Any double is accepted, NaN and infinities included.
class Gauge {
 public:
  void Set(double value);
  void Add(double delta);
  double Value() const;

 private:
  template <typename>
  friend class MetricFamily;
  using Impl = prometheus::Gauge;
  explicit Gauge(prometheus::Gauge* value) : value_(value) {}

  prometheus::Gauge* value_;  // owned by the prometheus-cpp family
};

// Observations counted into fixed buckets. A value v falls into the first bucket whose upper
// bound is >= v (bounds are inclusive, as Prometheus' `le` says), or into the implicit +Inf
// bucket. NaN observations are ignored with a warning, like negative counter increments (one
// NaN would turn `_sum` into NaN for the life of the process).
//
// Consistency under concurrency: an observation and a read take the histogram's mutex, so a
// scrape shows `_count`, `_sum` and the buckets of the same observations.
class Histogram {
 public:
  void Observe(double value);

  struct Snapshot {
    std::vector<double> upper_bounds;     // finite bounds, strictly increasing
    std::vector<uint64_t> bucket_counts;  // non-cumulative; size upper_bounds.size() + 1,
                                          // the last one is the +Inf bucket
    double sum = 0.0;
    uint64_t count = 0;  // sum of bucket_counts
  };
  Snapshot Read() const;

 private:
  template <typename>
  friend class MetricFamily;
  using Impl = prometheus::Histogram;
  Histogram(prometheus::Histogram* value, MetricFamilyBase* family)
      : value_(value), family_(family) {}

  prometheus::Histogram* value_;  // owned by the prometheus-cpp family
  MetricFamilyBase* family_;      // the owner, which logs rejected observations
};

// What every family has, whatever its child type; used by the registry for exposition.
class MetricFamilyBase {
 public:
  virtual ~MetricFamilyBase() = default;
  MetricFamilyBase(const MetricFamilyBase&) = delete;
  MetricFamilyBase& operator=(const MetricFamilyBase&) = delete;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  const std::vector<double>& bucket_upper_bounds() const { return upper_bounds_; }

 protected:
  friend class MetricsRegistry;
  MetricFamilyBase(MetricType type, std::string name, std::string help,
                   std::vector<std::string> label_names, std::vector<double> upper_bounds,
                   std::mutex* registry_mutex);

  // Logs the family's first rejected update; later ones are dropped silently so that a caller
  // bug on a hot path cannot flood the log.
  friend class Counter;
  friend class Histogram;
  void WarnRejectedUpdate(const char* what, double value);

  const MetricType type_;
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
  const std::vector<double> upper_bounds_;  // histograms only; empty otherwise
  std::mutex* const registry_mutex_;        // guards the children maps of every family
  std::atomic<bool> warned_{false};         // a rejected update was logged
};

// A family of children that share a name and label names and differ by label values.
// Child is Counter, Gauge or Histogram (the instantiations in metrics.cc).
template <typename Child>
class MetricFamily final : public MetricFamilyBase {
 public:
  // The child for these label values (one per label name, in declaration order), created on
  // first use. InvalidArgument when the number of values differs from the number of names.
  // Label values may be any string (Prometheus expects UTF-8; that is not checked); they are
  // escaped on output. The pointer is stable.
  Result<Child*> WithLabels(const std::vector<std::string>& label_values);

 private:
  friend class MetricsRegistry;
  // The prometheus-cpp family behind this one (prometheus::Family<prometheus::Counter>, ...),
  // created in `registry` with the escaped help.
  MetricFamily(MetricType type, std::string name, std::string help,
               std::vector<std::string> label_names, std::vector<double> upper_bounds,
               std::mutex* registry_mutex, prometheus::Registry& registry);
  // WithLabels after the count check, with *registry_mutex_ held.
  Result<Child*> FindOrCreateLocked(const std::vector<std::string>& label_values);

  prometheus::Family<typename Child::Impl>* impl_;  // owned by the registry's prometheus::Registry
  // Guarded by *registry_mutex_; the children are updated without it.
  std::map<std::vector<std::string>, std::unique_ptr<Child>> children_;
};

using CounterFamily = MetricFamily<Counter>;
using GaugeFamily = MetricFamily<Gauge>;
using HistogramFamily = MetricFamily<Histogram>;

// Owns metric families, checks their definitions and writes the exposition text.
// Thread-safe: registration, WithLabels, updates and ExpositionText may run concurrently.
class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
  // Families point at the registry's mutex: the registry stays where it was created.
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Registration. InvalidArgument when:
  //  * the name does not match [a-zA-Z_:][a-zA-Z0-9_:]*, or a counter's name does not end in
  //    `_total` (docs/design.md §3);
  //  * a label name does not match [a-zA-Z_][a-zA-Z0-9_]*, starts with `__` (reserved by
  //    Prometheus), repeats, or is `le` on a histogram;
  //  * histogram bounds are not strictly increasing, or contain NaN or -Inf, or +Inf anywhere
  //    but last (a trailing +Inf is dropped: that bucket is always there);
  //  * the name is taken by a family with a different definition (type, help, label names or
  //    bounds), or one of the sample names it writes (`name`, or `name_bucket`, `name_sum`,
  //    `name_count` for histograms) collides with another family's.
  // Registering the same definition again returns the existing family.
  Result<CounterFamily*> AddCounterFamily(std::string_view name, std::string_view help,
                                          std::vector<std::string> label_names);
  Result<GaugeFamily*> AddGaugeFamily(std::string_view name, std::string_view help,
                                      std::vector<std::string> label_names);
  Result<HistogramFamily*> AddHistogramFamily(std::string_view name, std::string_view help,
                                              std::vector<double> bucket_upper_bounds,
                                              std::vector<std::string> label_names);

  // A family without labels and its only child, in one call.
  Result<Counter*> AddCounter(std::string_view name, std::string_view help);
  Result<Gauge*> AddGauge(std::string_view name, std::string_view help);
  Result<Histogram*> AddHistogram(std::string_view name, std::string_view help,
                                  std::vector<double> bucket_upper_bounds);

  // A function run at the start of every ExpositionText, one at a time, to refresh values that
  // are read rather than updated (process CPU and memory, a link's state). It runs without the
  // registry's lock (it may update children); what it reads must outlive the registry's last
  // ExpositionText.
  void AddCollector(std::function<void()> collect);

  // The Prometheus text format 0.0.4 of every family (prometheus-cpp's TextSerializer), after
  // running the collectors: families sorted by name, children by label values (byte-wise, so
  // "10" < "9"), labels in declaration order, a histogram's `_count` and `_sum` before its
  // buckets. A labelled family without children yet writes only HELP and TYPE; an empty help
  // writes no HELP line.
  std::string ExpositionText() const;

 private:
  template <typename Family>
  Result<Family*> AddFamily(MetricType type, std::string_view name, std::string_view help,
                            std::vector<std::string> label_names, std::vector<double> upper_bounds);

  mutable std::mutex mutex_;
  std::unique_ptr<prometheus::Registry> registry_;  // holds the values; its own lock inside
  std::map<std::string, std::unique_ptr<MetricFamilyBase>, std::less<>> families_;
  // Every sample name written (`x_total`, `h_bucket`, `h_sum`, ...) -> its family's name.
  std::map<std::string, std::string, std::less<>> sample_names_;
  mutable std::mutex collect_mutex_;  // guards collectors_ and serializes their runs
  std::vector<std::function<void()>> collectors_;
};

// Shortest text that reads back as the same double; integral values up to 2^53 print as
// integers ("3", not "3e+00"), special values as "+Inf", "-Inf" and "NaN". For messages.
std::string FormatMetricValue(double value);
// `\` -> `\\`, newline -> `\n` (HELP text, which prometheus-cpp writes as given).
std::string EscapeMetricHelp(std::string_view help);

}  // namespace rubato
