// Metrics registry: definition checks in front of prometheus-cpp's registry, families and text
// serializer (see metrics.h).
#include "common/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <exception>
#include <limits>
#include <set>
#include <sstream>
#include <type_traits>
#include <utility>

#include "common/logging.h"

namespace rubato {
namespace {

bool IsAsciiLetter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsAsciiDigit(char c) { return c >= '0' && c <= '9'; }

// [a-zA-Z_:][a-zA-Z0-9_:]*
bool IsValidMetricName(std::string_view name) {
  if (name.empty() || IsAsciiDigit(name[0])) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return IsAsciiLetter(c) || IsAsciiDigit(c) || c == '_' || c == ':';
  });
}

// [a-zA-Z_][a-zA-Z0-9_]*
bool IsValidLabelName(std::string_view name) {
  if (name.empty() || IsAsciiDigit(name[0])) return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return IsAsciiLetter(c) || IsAsciiDigit(c) || c == '_'; });
}

Status CheckLabelNames(MetricType type, std::string_view name,
                       const std::vector<std::string>& label_names) {
  std::set<std::string_view> seen;
  for (const std::string& label : label_names) {
    if (!IsValidLabelName(label)) {
      return InvalidArgumentError("metrics: label name '" + label + "' of '" + std::string(name) +
                                  "' does not match [a-zA-Z_][a-zA-Z0-9_]*");
    }
    if (label.starts_with("__")) {
      return InvalidArgumentError("metrics: label name '" + label + "' of '" + std::string(name) +
                                  "' starts with '__', which Prometheus reserves");
    }
    if (type == MetricType::kHistogram && label == "le") {
      return InvalidArgumentError("metrics: histogram '" + std::string(name) +
                                  "' cannot have a label named 'le' (it names the buckets)");
    }
    if (!seen.insert(label).second) {
      return InvalidArgumentError("metrics: label name '" + label + "' appears twice in '" +
                                  std::string(name) + "'");
    }
  }
  return Status::Ok();
}

// Checks histogram bounds and drops a trailing +Inf (the +Inf bucket is always written).
Status NormalizeBucketBounds(std::string_view name, std::vector<double>* bounds) {
  if (!bounds->empty() && bounds->back() == std::numeric_limits<double>::infinity()) {
    bounds->pop_back();
  }
  for (size_t i = 0; i < bounds->size(); ++i) {
    const double b = (*bounds)[i];
    if (!std::isfinite(b)) {
      return InvalidArgumentError("metrics: histogram '" + std::string(name) + "' bucket bound " +
                                  std::to_string(i) + " is " + FormatMetricValue(b) +
                                  "; bounds must be finite (+Inf is allowed only last)");
    }
    if (i > 0 && !((*bounds)[i - 1] < b)) {
      return InvalidArgumentError("metrics: histogram '" + std::string(name) +
                                  "' bucket bounds must be strictly increasing, but bound " +
                                  std::to_string(i) + " (" + FormatMetricValue(b) + ") follows " +
                                  FormatMetricValue((*bounds)[i - 1]));
    }
  }
  return Status::Ok();
}

// The names of the sample lines a family writes.
std::vector<std::string> SampleNames(MetricType type, const std::string& name) {
  if (type != MetricType::kHistogram) return {name};
  return {name + "_bucket", name + "_sum", name + "_count"};
}

prometheus::MetricType PrometheusType(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return prometheus::MetricType::Counter;
    case MetricType::kGauge:
      return prometheus::MetricType::Gauge;
    case MetricType::kHistogram:
      return prometheus::MetricType::Histogram;
  }
  return prometheus::MetricType::Untyped;
}

// prometheus-cpp keeps labels in a std::map (sorted by name) and children in a hash map: puts
// each child's labels back in declaration order and sorts the children by their label values.
void OrderLikeDeclared(const std::vector<std::string>& label_names,
                       prometheus::MetricFamily* family) {
  std::vector<std::pair<std::vector<std::string>, prometheus::ClientMetric>> keyed;
  keyed.reserve(family->metric.size());
  for (prometheus::ClientMetric& metric : family->metric) {
    std::vector<prometheus::ClientMetric::Label> ordered;
    std::vector<std::string> values;
    for (const std::string& name : label_names) {
      for (const prometheus::ClientMetric::Label& label : metric.label) {
        if (label.name == name) {
          ordered.push_back(label);
          values.push_back(label.value);
        }
      }
    }
    metric.label = std::move(ordered);
    keyed.emplace_back(std::move(values), std::move(metric));
  }
  std::sort(keyed.begin(), keyed.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  family->metric.clear();
  for (auto& [values, metric] : keyed) family->metric.push_back(std::move(metric));
}

}  // namespace

std::string_view MetricTypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

std::string FormatMetricValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // Integral values print as integers: to_chars' shortest form would write 1e+06.
  constexpr double kExactIntegerLimit = 9007199254740992.0;  // 2^53
  if (std::trunc(value) == value && std::fabs(value) <= kExactIntegerLimit) {
    return std::to_string(static_cast<int64_t>(value));  // -0 prints as 0
  }
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  if (ec != std::errc()) return "NaN";  // cannot happen: 32 bytes hold any shortest double
  return std::string(buf, end);
}

std::string EscapeMetricHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// ---- children ------------------------------------------------------------------------------

void Counter::Increment(double amount) {
  if (!(amount >= 0.0)) {  // negative or NaN
    family_->WarnRejectedUpdate("increment", amount);
    return;
  }
  value_->Increment(amount);
}

double Counter::Value() const { return value_->Value(); }

void Gauge::Set(double value) { value_->Set(value); }
void Gauge::Add(double delta) { value_->Increment(delta); }
double Gauge::Value() const { return value_->Value(); }

void Histogram::Observe(double value) {
  if (std::isnan(value)) {  // prometheus-cpp would count it in +Inf and make _sum NaN
    family_->WarnRejectedUpdate("observation", value);
    return;
  }
  value_->Observe(value);
}

Histogram::Snapshot Histogram::Read() const {
  const prometheus::ClientMetric::Histogram collected = value_->Collect().histogram;
  Snapshot snapshot;
  uint64_t below = 0;  // cumulative count of the buckets before
  for (const prometheus::ClientMetric::Bucket& bucket : collected.bucket) {
    if (!std::isinf(bucket.upper_bound)) snapshot.upper_bounds.push_back(bucket.upper_bound);
    snapshot.bucket_counts.push_back(bucket.cumulative_count - below);
    below = bucket.cumulative_count;
  }
  snapshot.sum = collected.sample_sum;
  snapshot.count = collected.sample_count;
  return snapshot;
}

// ---- families ------------------------------------------------------------------------------

MetricFamilyBase::MetricFamilyBase(MetricType type, std::string name, std::string help,
                                   std::vector<std::string> label_names,
                                   std::vector<double> upper_bounds, std::mutex* registry_mutex)
    : type_(type),
      name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      upper_bounds_(std::move(upper_bounds)),
      registry_mutex_(registry_mutex) {}

void MetricFamilyBase::WarnRejectedUpdate(const char* what, double value) {
  if (warned_.exchange(true, std::memory_order_relaxed)) return;
  RUBATO_LOG_WARN("metrics", "metrics: {} '{}' ignored the {} {} (logged once per metric)",
                  MetricTypeName(type_), name_, what, FormatMetricValue(value));
}

template <typename Child>
MetricFamily<Child>::MetricFamily(MetricType type, std::string name, std::string help,
                                  std::vector<std::string> label_names,
                                  std::vector<double> upper_bounds, std::mutex* registry_mutex,
                                  prometheus::Registry& registry)
    : MetricFamilyBase(type, std::move(name), std::move(help), std::move(label_names),
                       std::move(upper_bounds), registry_mutex) {
  // Names were checked by the caller, so prometheus-cpp has nothing to throw about.
  auto builder = [] {
    if constexpr (std::is_same_v<Child, Counter>) {
      return prometheus::BuildCounter();
    } else if constexpr (std::is_same_v<Child, Gauge>) {
      return prometheus::BuildGauge();
    } else {
      return prometheus::BuildHistogram();
    }
  }();
  impl_ = &builder.Name(name_).Help(EscapeMetricHelp(help_)).Register(registry);
}

template <typename Child>
Result<Child*> MetricFamily<Child>::WithLabels(const std::vector<std::string>& label_values) {
  if (label_values.size() != label_names_.size()) {
    return InvalidArgumentError("metrics: '" + name_ + "' has " +
                                std::to_string(label_names_.size()) + " label name(s) but " +
                                std::to_string(label_values.size()) + " label value(s) were given");
  }
  std::lock_guard<std::mutex> lock(*registry_mutex_);
  return FindOrCreateLocked(label_values);
}

template <typename Child>
Result<Child*> MetricFamily<Child>::FindOrCreateLocked(
    const std::vector<std::string>& label_values) {
  auto it = children_.find(label_values);
  if (it != children_.end()) return it->second.get();
  prometheus::Labels labels;
  for (size_t i = 0; i < label_names_.size(); ++i) labels[label_names_[i]] = label_values[i];
  std::unique_ptr<Child> child;
  try {
    if constexpr (std::is_same_v<Child, Histogram>) {
      child.reset(new Histogram(&impl_->Add(labels, upper_bounds_), this));
    } else if constexpr (std::is_same_v<Child, Counter>) {
      child.reset(new Counter(&impl_->Add(labels), this));
    } else {
      child.reset(new Gauge(&impl_->Add(labels)));
    }
  } catch (const std::exception& e) {  // prometheus-cpp's checks; ours ran first
    return InternalError("metrics: prometheus-cpp refused a child of '" + name_ + "': " + e.what());
  }
  Child* raw = child.get();
  children_.emplace(label_values, std::move(child));
  return raw;
}

template class MetricFamily<Counter>;
template class MetricFamily<Gauge>;
template class MetricFamily<Histogram>;

// ---- registry ------------------------------------------------------------------------------

MetricsRegistry::MetricsRegistry() : registry_(std::make_unique<prometheus::Registry>()) {}

// Families hold references into registry_, which members destroy after families_.
MetricsRegistry::~MetricsRegistry() = default;

template <typename Family>
Result<Family*> MetricsRegistry::AddFamily(MetricType type, std::string_view name,
                                           std::string_view help,
                                           std::vector<std::string> label_names,
                                           std::vector<double> upper_bounds) {
  if (!IsValidMetricName(name)) {
    return InvalidArgumentError("metrics: metric name '" + std::string(name) +
                                "' does not match [a-zA-Z_:][a-zA-Z0-9_:]*");
  }
  if (type == MetricType::kCounter && !name.ends_with("_total")) {
    return InvalidArgumentError("metrics: counter name '" + std::string(name) +
                                "' must end in '_total'");
  }
  RUBATO_RETURN_IF_ERROR(CheckLabelNames(type, name, label_names));
  if (type == MetricType::kHistogram) {
    RUBATO_RETURN_IF_ERROR(NormalizeBucketBounds(name, &upper_bounds));
  }

  std::lock_guard<std::mutex> lock(mutex_);
  if (auto it = families_.find(name); it != families_.end()) {
    MetricFamilyBase* existing = it->second.get();
    if (existing->type() != type || existing->help() != help ||
        existing->label_names() != label_names || existing->bucket_upper_bounds() != upper_bounds) {
      return InvalidArgumentError(
          "metrics: '" + std::string(name) + "' is already registered as a " +
          std::string(MetricTypeName(existing->type())) +
          " with a different definition (type, help, label names or buckets)");
    }
    return static_cast<Family*>(existing);  // same type, so the same Family
  }
  const std::string name_str(name);
  const std::vector<std::string> samples = SampleNames(type, name_str);
  for (const std::string& sample : samples) {
    if (auto it = sample_names_.find(sample); it != sample_names_.end()) {
      return InvalidArgumentError("metrics: '" + name_str + "' would write samples named '" +
                                  sample + "', which '" + it->second + "' already writes");
    }
  }
  const bool unlabelled = label_names.empty();
  std::unique_ptr<Family> family;
  try {
    family.reset(new Family(type, name_str, std::string(help), std::move(label_names),
                            std::move(upper_bounds), &mutex_, *registry_));
  } catch (const std::exception& e) {  // a name prometheus-cpp reserves, e.g. `__x`
    return InvalidArgumentError("metrics: prometheus-cpp refused '" + name_str + "': " + e.what());
  }
  if (unlabelled) {
    // The only child exists from the start, so the metric is scraped (as 0) before its first
    // update; WithLabels({}) then finds it. mutex_ is held, as FindOrCreateLocked needs.
    RUBATO_RETURN_IF_ERROR(family->FindOrCreateLocked({}).status());
  }
  Family* raw = family.get();
  families_.emplace(name_str, std::move(family));
  for (const std::string& sample : samples) sample_names_.emplace(sample, name_str);
  return raw;
}

Result<CounterFamily*> MetricsRegistry::AddCounterFamily(std::string_view name,
                                                         std::string_view help,
                                                         std::vector<std::string> label_names) {
  return AddFamily<CounterFamily>(MetricType::kCounter, name, help, std::move(label_names), {});
}

Result<GaugeFamily*> MetricsRegistry::AddGaugeFamily(std::string_view name, std::string_view help,
                                                     std::vector<std::string> label_names) {
  return AddFamily<GaugeFamily>(MetricType::kGauge, name, help, std::move(label_names), {});
}

Result<HistogramFamily*> MetricsRegistry::AddHistogramFamily(
    std::string_view name, std::string_view help, std::vector<double> bucket_upper_bounds,
    std::vector<std::string> label_names) {
  return AddFamily<HistogramFamily>(MetricType::kHistogram, name, help, std::move(label_names),
                                    std::move(bucket_upper_bounds));
}

Result<Counter*> MetricsRegistry::AddCounter(std::string_view name, std::string_view help) {
  RUBATO_ASSIGN_OR_RETURN(CounterFamily * family, AddCounterFamily(name, help, {}));
  return family->WithLabels({});
}

Result<Gauge*> MetricsRegistry::AddGauge(std::string_view name, std::string_view help) {
  RUBATO_ASSIGN_OR_RETURN(GaugeFamily * family, AddGaugeFamily(name, help, {}));
  return family->WithLabels({});
}

Result<Histogram*> MetricsRegistry::AddHistogram(std::string_view name, std::string_view help,
                                                 std::vector<double> bucket_upper_bounds) {
  RUBATO_ASSIGN_OR_RETURN(HistogramFamily * family,
                          AddHistogramFamily(name, help, std::move(bucket_upper_bounds), {}));
  return family->WithLabels({});
}

void MetricsRegistry::AddCollector(std::function<void()> collect) {
  std::lock_guard<std::mutex> lock(collect_mutex_);
  collectors_.push_back(std::move(collect));
}

std::string MetricsRegistry::ExpositionText() const {
  {
    std::lock_guard<std::mutex> collect_lock(collect_mutex_);
    for (const std::function<void()>& collect : collectors_) collect();
  }
  std::vector<prometheus::MetricFamily> collected;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<std::string, prometheus::MetricFamily> by_name;
    for (prometheus::MetricFamily& family : registry_->Collect()) {
      by_name.emplace(family.name, std::move(family));
    }
    collected.reserve(families_.size());
    for (const auto& [name, family] : families_) {
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        // prometheus-cpp leaves out a family without children; rubato declares it.
        prometheus::MetricFamily empty;
        empty.name = name;
        empty.help = EscapeMetricHelp(family->help());
        empty.type = PrometheusType(family->type());
        collected.push_back(std::move(empty));
      } else {
        OrderLikeDeclared(family->label_names(), &it->second);
        collected.push_back(std::move(it->second));
      }
    }
  }
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, collected);
  return std::move(out).str();
}

}  // namespace rubato
