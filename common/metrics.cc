// Metrics registry: definition checks, lock-free updates and the Prometheus text format 0.0.4.
#include "common/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <set>
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

// `{a="x",b="y"}` (with `extra_name="extra_value"` last when extra_name is not empty), or
// nothing when there are no labels at all.
void AppendLabels(const std::vector<std::string>& names, const std::vector<std::string>& values,
                  std::string_view extra_name, std::string_view extra_value, std::string* out) {
  if (names.empty() && extra_name.empty()) return;
  out->push_back('{');
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out->push_back(',');
    *out += names[i];
    *out += "=\"";
    *out += EscapeLabelValue(values[i]);
    out->push_back('"');
  }
  if (!extra_name.empty()) {
    if (!names.empty()) out->push_back(',');
    *out += extra_name;
    *out += "=\"";
    *out += extra_value;  // bucket bounds: no characters that need escaping
    out->push_back('"');
  }
  out->push_back('}');
}

void AppendSample(std::string_view sample_name, const std::vector<std::string>& names,
                  const std::vector<std::string>& values, std::string_view extra_name,
                  std::string_view extra_value, double value, std::string* out) {
  *out += sample_name;
  AppendLabels(names, values, extra_name, extra_value, out);
  out->push_back(' ');
  *out += FormatMetricValue(value);
  out->push_back('\n');
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

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
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
  value_.fetch_add(amount, std::memory_order_relaxed);
}

Histogram::Histogram(const std::vector<double>* upper_bounds, MetricFamilyBase* family)
    : upper_bounds_(upper_bounds), buckets_(upper_bounds->size() + 1), family_(family) {}

void Histogram::Observe(double value) {
  if (std::isnan(value)) {
    family_->WarnRejectedUpdate("observation", value);
    return;
  }
  // First bound >= value; past the end means the +Inf bucket.
  const size_t bucket =
      static_cast<size_t>(std::lower_bound(upper_bounds_->begin(), upper_bounds_->end(), value) -
                          upper_bounds_->begin());
  buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot snapshot;
  snapshot.upper_bounds = *upper_bounds_;
  snapshot.bucket_counts.reserve(buckets_.size());
  for (const auto& bucket : buckets_) {
    snapshot.bucket_counts.push_back(bucket.load(std::memory_order_relaxed));
    snapshot.count += snapshot.bucket_counts.back();
  }
  snapshot.sum = sum_.load(std::memory_order_relaxed);
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
Child* MetricFamily<Child>::FindOrCreateLocked(const std::vector<std::string>& label_values) {
  auto it = children_.find(label_values);
  if (it != children_.end()) return it->second.get();
  std::unique_ptr<Child> child;
  if constexpr (std::is_same_v<Child, Counter>) {
    child.reset(new Counter(this));
  } else if constexpr (std::is_same_v<Child, Gauge>) {
    child.reset(new Gauge());
  } else {
    child.reset(new Histogram(&upper_bounds_, this));
  }
  Child* raw = child.get();
  children_.emplace(label_values, std::move(child));
  return raw;
}

template <typename Child>
void MetricFamily<Child>::AppendExposition(std::string* out) const {
  *out += "# HELP " + name_ + " " + EscapeMetricHelp(help_) + "\n";
  *out += "# TYPE " + name_ + " " + std::string(MetricTypeName(type_)) + "\n";
  for (const auto& [values, child] : children_) {
    if constexpr (std::is_same_v<Child, Histogram>) {
      const Histogram::Snapshot snapshot = child->Read();
      const std::string bucket_name = name_ + "_bucket";
      uint64_t cumulative = 0;
      for (size_t i = 0; i < snapshot.bucket_counts.size(); ++i) {
        cumulative += snapshot.bucket_counts[i];
        const std::string le = i < snapshot.upper_bounds.size()
                                   ? FormatMetricValue(snapshot.upper_bounds[i])
                                   : std::string("+Inf");
        AppendSample(bucket_name, label_names_, values, "le", le, static_cast<double>(cumulative),
                     out);
      }
      AppendSample(name_ + "_sum", label_names_, values, "", "", snapshot.sum, out);
      AppendSample(name_ + "_count", label_names_, values, "", "",
                   static_cast<double>(snapshot.count), out);
    } else {
      AppendSample(name_, label_names_, values, "", "", child->Value(), out);
    }
  }
}

template class MetricFamily<Counter>;
template class MetricFamily<Gauge>;
template class MetricFamily<Histogram>;

// ---- registry ------------------------------------------------------------------------------

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
  auto family = std::unique_ptr<Family>(new Family(
      type, name_str, std::string(help), std::move(label_names), std::move(upper_bounds), &mutex_));
  if (unlabelled) {
    // The only child exists from the start, so the metric is scraped (as 0) before its first
    // update; WithLabels({}) then finds it. mutex_ is held, as FindOrCreateLocked needs.
    family->FindOrCreateLocked({});
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
  std::string out;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [name, family] : families_) family->AppendExposition(&out);
  return out;
}

}  // namespace rubato
