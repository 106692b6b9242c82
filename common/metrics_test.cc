// Tests for the metrics registry: exact exposition text, escaping, sorting, every registration
// error, rejected updates, and exact sums under concurrent updates.
//
// GCC 12 at -O2 with -fsanitize=address warns maybe-uninitialized inside libstdc++'s own
// <regex> (GCC bug 105562, a false positive in std::function moves); with -Werror that breaks
// the sanitizer build. The pragma precedes every include because the warning is reported at
// header locations.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "common/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace rubato {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Checks `text` line by line against the text format 0.0.4 as rubato writes it (prometheus-cpp's
// TextSerializer): an optional HELP line (none for an empty help) and a TYPE line, then samples
// whose names belong to the family last typed, label values escaped, and values that strtod reads
// back. Returns "" when it parses, else the first problem.
std::string TextFormatProblem(const std::string& text) {
  static const std::regex kHelp(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) (?:[^\\]|\\[\\n])*)");
  static const std::regex kType(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram))");
  static const std::regex kSample(R"(([a-zA-Z_:][a-zA-Z0-9_:]*))"
                                  R"((?:\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\[\\"n])*")"
                                  R"((?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\[\\"n])*")*\})?)"
                                  R"( ([+-]Inf|Nan|-?[0-9]+(?:\.[0-9]+)?(?:e[+-][0-9]+)?))");
  if (!text.empty() && text.back() != '\n') return "text does not end with a newline";
  std::istringstream lines(text);
  std::string line;
  std::string family;
  std::string help_of;  // the name of the HELP line just read, if any
  std::string type;
  int number = 0;
  while (std::getline(lines, line)) {
    ++number;
    const std::string where = "line " + std::to_string(number) + " '" + line + "': ";
    std::smatch m;
    if (std::regex_match(line, m, kHelp)) {
      help_of = m[1];
      type.clear();
    } else if (std::regex_match(line, m, kType)) {
      if (!help_of.empty() && m[1] != help_of) return where + "TYPE after a HELP of another name";
      if (m[1] == family) return where + "a second TYPE for the same family";
      family = m[1];
      help_of.clear();
      type = m[2];
    } else if (std::regex_match(line, m, kSample)) {
      if (type.empty()) return where + "sample before any TYPE line";
      help_of.clear();
      const std::string name = m[1];
      const bool belongs =
          type == "histogram"
              ? (name == family + "_bucket" || name == family + "_sum" || name == family + "_count")
              : name == family;
      if (!belongs) return where + "sample name does not belong to " + type + " " + family;
      const std::string value = m[2];
      char* end = nullptr;
      std::strtod(value.c_str(), &end);
      if (end != value.c_str() + value.size()) return where + "value does not parse";
    } else {
      return where + "matches no line form";
    }
  }
  return "";
}

TEST(MetricsTextFormatChecker, RejectsMalformedLines) {
  // The checker itself must be able to fail, or the format tests below prove nothing.
  const std::string head = "# HELP x_total h\n# TYPE x_total counter\n";
  EXPECT_EQ(TextFormatProblem(head + "x_total 1\n"), "");
  EXPECT_NE(TextFormatProblem(head + "x_total{a=\"b} 1\n"), "");       // unterminated value
  EXPECT_NE(TextFormatProblem(head + "x_total{a=\"b\"c\"} 1\n"), "");  // unescaped quote
  EXPECT_NE(TextFormatProblem(head + "x_total 1e\n"), "");             // bad value
  EXPECT_NE(TextFormatProblem(head + "y_total 1\n"), "");              // wrong family
  EXPECT_NE(TextFormatProblem(head + "x_total 1"), "");                // no final newline
  EXPECT_NE(TextFormatProblem("x_total 1\n"), "");                     // no TYPE
  EXPECT_NE(TextFormatProblem("# HELP x bad \\escape\n"), "");
  EXPECT_NE(TextFormatProblem("# HELP y h\n# TYPE x_total counter\n"), "");        // other name
  EXPECT_NE(TextFormatProblem(head + "x_total 1\n# TYPE x_total counter\n"), "");  // twice
}

// The usage example of metrics.h, kept compiling here.
Status RunHeaderExample(std::string* body) {
  MetricsRegistry registry;
  RUBATO_ASSIGN_OR_RETURN(
      Counter * prompt_tokens,
      registry.AddCounter("rubato:prompt_tokens_total", "Prefill tokens processed."));
  RUBATO_ASSIGN_OR_RETURN(CounterFamily * bytes,
                          registry.AddCounterFamily("rubato:transport_bytes_total", "Bytes moved.",
                                                    {"direction", "backend"}));
  RUBATO_ASSIGN_OR_RETURN(Counter * tx_ucx, bytes->WithLabels({"tx", "ucx"}));
  RUBATO_ASSIGN_OR_RETURN(
      Histogram * ttft,
      registry.AddHistogram("rubato:time_to_first_token_seconds", "Time to first token.",
                            {0.01, 0.05, 0.1, 0.5, 1, 5}));
  prompt_tokens->Increment(512);
  tx_ucx->Increment(4096);
  ttft->Observe(0.042);
  *body = registry.ExpositionText();
  return Status::Ok();
}

TEST(Metrics, HeaderExampleWorks) {
  std::string body;
  ASSERT_TRUE(RunHeaderExample(&body).ok());
  EXPECT_NE(body.find("rubato:prompt_tokens_total 512\n"), std::string::npos) << body;
  EXPECT_NE(body.find("rubato:transport_bytes_total{direction=\"tx\",backend=\"ucx\"} 4096\n"),
            std::string::npos)
      << body;
  EXPECT_NE(body.find("rubato:time_to_first_token_seconds_bucket{le=\"0.05\"} 1\n"),
            std::string::npos)
      << body;
  EXPECT_EQ(TextFormatProblem(body), "");
}

TEST(Metrics, FormatsValues) {
  EXPECT_EQ(FormatMetricValue(0.0), "0");
  EXPECT_EQ(FormatMetricValue(-0.0), "0");
  EXPECT_EQ(FormatMetricValue(42.0), "42");
  EXPECT_EQ(FormatMetricValue(-7.0), "-7");
  EXPECT_EQ(FormatMetricValue(1e6), "1000000");  // not 1e+06
  EXPECT_EQ(FormatMetricValue(9007199254740992.0), "9007199254740992");
  EXPECT_EQ(FormatMetricValue(1e20), "1e+20");
  EXPECT_EQ(FormatMetricValue(0.1), "0.1");
  EXPECT_EQ(FormatMetricValue(-2.25), "-2.25");
  EXPECT_EQ(FormatMetricValue(1e-7), "1e-07");
  EXPECT_EQ(FormatMetricValue(kInf), "+Inf");
  EXPECT_EQ(FormatMetricValue(-kInf), "-Inf");
  EXPECT_EQ(FormatMetricValue(kNaN), "NaN");
  for (double v : {0.1, 1.0 / 3.0, 123456.789, 6.02214076e23, 5e-324, 1.7976931348623157e308}) {
    EXPECT_EQ(std::strtod(FormatMetricValue(v).c_str(), nullptr), v) << FormatMetricValue(v);
  }
}

TEST(Metrics, ExpositionTextIsExactAndSorted) {
  MetricsRegistry registry;
  // Registered out of name order: the output is sorted by name.
  auto wait = registry.AddHistogram("rubato:pack_wait_seconds", "Wait for a layer pack.",
                                    {0.25, 1, 2.5, 10});
  auto sessions = registry.AddGaugeFamily("rubato:cache_rank_sessions",
                                          "Open sessions per cache rank.", {"rank", "state"});
  auto tokens = registry.AddCounter("rubato:prompt_tokens_total", "Prefill tokens processed.");
  ASSERT_TRUE(wait.ok()) << wait.status().message();
  ASSERT_TRUE(sessions.ok()) << sessions.status().message();
  ASSERT_TRUE(tokens.ok()) << tokens.status().message();

  (*tokens)->Increment();
  (*tokens)->Increment(41);
  // Children created out of label order: the output is sorted by label values.
  (*(*sessions)->WithLabels({"1", "open"}))->Set(3);
  (*(*sessions)->WithLabels({"0", "open"}))->Set(5);
  Gauge* closing = *(*sessions)->WithLabels({"0", "closing"});
  closing->Add(2);
  closing->Add(-0.5);
  for (double v : {0.25, 0.5, 0.5, 2.0, 100.0}) (*wait)->Observe(v);  // 0.25 is in le="0.25"

  const std::string expected =
      "# HELP rubato:cache_rank_sessions Open sessions per cache rank.\n"
      "# TYPE rubato:cache_rank_sessions gauge\n"
      "rubato:cache_rank_sessions{rank=\"0\",state=\"closing\"} 1.5\n"
      "rubato:cache_rank_sessions{rank=\"0\",state=\"open\"} 5\n"
      "rubato:cache_rank_sessions{rank=\"1\",state=\"open\"} 3\n"
      "# HELP rubato:pack_wait_seconds Wait for a layer pack.\n"
      "# TYPE rubato:pack_wait_seconds histogram\n"
      "rubato:pack_wait_seconds_count 5\n"
      "rubato:pack_wait_seconds_sum 103.25\n"
      "rubato:pack_wait_seconds_bucket{le=\"0.25\"} 1\n"
      "rubato:pack_wait_seconds_bucket{le=\"1\"} 3\n"
      "rubato:pack_wait_seconds_bucket{le=\"2.5\"} 4\n"
      "rubato:pack_wait_seconds_bucket{le=\"10\"} 4\n"
      "rubato:pack_wait_seconds_bucket{le=\"+Inf\"} 5\n"
      "# HELP rubato:prompt_tokens_total Prefill tokens processed.\n"
      "# TYPE rubato:prompt_tokens_total counter\n"
      "rubato:prompt_tokens_total 42\n";
  const std::string text = registry.ExpositionText();
  EXPECT_EQ(text, expected);
  EXPECT_EQ(TextFormatProblem(text), "");
}

TEST(Metrics, UnlabelledMetricsAppearAtZeroAndEmptyFamiliesOnlyDeclare) {
  MetricsRegistry registry;
  ASSERT_TRUE(registry.AddGauge("g", "").ok());
  ASSERT_TRUE(registry.AddHistogram("h", "", {}).ok());  // only the +Inf bucket
  ASSERT_TRUE(registry.AddCounterFamily("c_total", "", {"kind"}).ok());
  const std::string text = registry.ExpositionText();
  EXPECT_EQ(text,
            "# TYPE c_total counter\n"
            "# TYPE g gauge\n"
            "g 0\n"
            "# TYPE h histogram\n"
            "h_count 0\n"
            "h_sum 0\n"
            "h_bucket{le=\"+Inf\"} 0\n");
  EXPECT_EQ(TextFormatProblem(text), "");
}

TEST(Metrics, LabelledHistogramPutsLeLast) {
  MetricsRegistry registry;
  auto family = registry.AddHistogramFamily("rubato:selection_latency_seconds", "Selector.",
                                            {0.001, 0.01, kInf}, {"policy"});
  ASSERT_TRUE(family.ok()) << family.status().message();
  EXPECT_EQ((*family)->bucket_upper_bounds(), (std::vector<double>{0.001, 0.01}));  // +Inf dropped
  Histogram* sfi = *(*family)->WithLabels({"sfi"});
  sfi->Observe(0.0005);
  sfi->Observe(0.02);
  sfi->Observe(-kInf);  // below every bound: first bucket, and _sum becomes -Inf
  const std::string text = registry.ExpositionText();
  EXPECT_EQ(text,
            "# HELP rubato:selection_latency_seconds Selector.\n"
            "# TYPE rubato:selection_latency_seconds histogram\n"
            "rubato:selection_latency_seconds_count{policy=\"sfi\"} 3\n"
            "rubato:selection_latency_seconds_sum{policy=\"sfi\"} -Inf\n"
            "rubato:selection_latency_seconds_bucket{policy=\"sfi\",le=\"0.001\"} 2\n"
            "rubato:selection_latency_seconds_bucket{policy=\"sfi\",le=\"0.01\"} 2\n"
            "rubato:selection_latency_seconds_bucket{policy=\"sfi\",le=\"+Inf\"} 3\n");
  EXPECT_EQ(TextFormatProblem(text), "");
  const Histogram::Snapshot snapshot = sfi->Read();
  EXPECT_EQ(snapshot.bucket_counts, (std::vector<uint64_t>{2, 0, 1}));
  EXPECT_EQ(snapshot.count, 3u);
}

TEST(Metrics, EscapesHelpAndLabelValues) {
  EXPECT_EQ(EscapeMetricHelp("a\\b\nc\"d"), "a\\\\b\\nc\"d");  // quotes stay in HELP

  MetricsRegistry registry;
  auto family = registry.AddGaugeFamily("escaped", "Line one\nback\\slash \"quoted\"", {"path"});
  ASSERT_TRUE(family.ok()) << family.status().message();
  (*(*family)->WithLabels({"C:\\dir\n\"x\""}))->Set(1);
  (*(*family)->WithLabels({""}))->Set(kNaN);  // empty label values and NaN gauges are valid
  const std::string text = registry.ExpositionText();
  EXPECT_EQ(text,
            "# HELP escaped Line one\\nback\\\\slash \"quoted\"\n"
            "# TYPE escaped gauge\n"
            "escaped{path=\"\"} Nan\n"
            "escaped{path=\"C:\\\\dir\\n\\\"x\\\"\"} 1\n");
  EXPECT_EQ(TextFormatProblem(text), "");
}

TEST(Metrics, WithLabelsReturnsStableChildren) {
  MetricsRegistry registry;
  auto family = registry.AddCounterFamily("rubato:transport_bytes_total", "Bytes moved.",
                                          {"direction", "backend"});
  ASSERT_TRUE(family.ok());
  Counter* tx = *(*family)->WithLabels({"tx", "ucx"});
  for (int i = 0; i < 1000; ++i) {  // many more children: tx must not move
    ASSERT_TRUE((*family)->WithLabels({"rx", "b" + std::to_string(i)}).ok());
  }
  EXPECT_EQ(*(*family)->WithLabels({"tx", "ucx"}), tx);
  tx->Increment(4096);
  EXPECT_EQ((*(*family)->WithLabels({"tx", "ucx"}))->Value(), 4096);
  // The one-call form returns the unlabelled family's only child, again on re-registration.
  auto steps = registry.AddCounter("rubato:slow_steps_total", "Slow steps.");
  ASSERT_TRUE(steps.ok());
  EXPECT_EQ(*registry.AddCounter("rubato:slow_steps_total", "Slow steps."), *steps);
}

TEST(Metrics, RejectedUpdatesAreIgnored) {
  MetricsRegistry registry;
  Counter* counter = *registry.AddCounter("c_total", "");
  counter->Increment(2);
  counter->Increment(-1);
  counter->Increment(kNaN);
  counter->Increment(0);
  EXPECT_EQ(counter->Value(), 2);
  counter->Increment(kInf);  // not negative: accepted
  EXPECT_EQ(counter->Value(), kInf);

  Gauge* gauge = *registry.AddGauge("g", "");
  gauge->Add(-3);  // gauges may go down and below zero
  EXPECT_EQ(gauge->Value(), -3);

  Histogram* histogram = *registry.AddHistogram("h", "", {1});
  histogram->Observe(kNaN);
  histogram->Observe(0.5);
  const Histogram::Snapshot snapshot = histogram->Read();
  EXPECT_EQ(snapshot.count, 1u);
  EXPECT_EQ(snapshot.sum, 0.5);
}

// Expects InvalidArgument whose message mentions `needle`.
template <typename T>
void ExpectInvalid(const Result<T>& result, const std::string& needle) {
  ASSERT_FALSE(result.ok()) << "expected an error mentioning '" << needle << "'";
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find(needle), std::string::npos) << result.status().message();
}

TEST(Metrics, RejectsInvalidNames) {
  MetricsRegistry registry;
  for (const char* bad : {"", "1abc", "a-b", "a b", "a.b", "caf\xc3\xa9"}) {
    ExpectInvalid(registry.AddGauge(bad, ""), "does not match [a-zA-Z_:]");
  }
  EXPECT_TRUE(registry.AddGauge("_a:b_9", "").ok());
  EXPECT_TRUE(registry.AddGauge(":colon_first", "").ok());

  ExpectInvalid(registry.AddCounter("rubato:slow_steps", ""), "must end in '_total'");
  ExpectInvalid(registry.AddCounterFamily("x_total_", "", {}), "must end in '_total'");

  for (const char* bad : {"", "1a", "a:b", "a-b"}) {
    ExpectInvalid(registry.AddGaugeFamily("labelled", "", {bad}), "does not match [a-zA-Z_]");
  }
  ExpectInvalid(registry.AddGaugeFamily("labelled", "", {"__name__"}), "reserves");
  ExpectInvalid(registry.AddGaugeFamily("labelled", "", {"a", "b", "a"}), "appears twice");
  ExpectInvalid(registry.AddHistogramFamily("hist", "", {1}, {"le"}), "'le'");
  EXPECT_TRUE(registry.AddGaugeFamily("gauge_with_le", "", {"le", "_x"}).ok());

  // Nothing failed above was registered: the names are still free.
  EXPECT_TRUE(registry.AddGaugeFamily("labelled", "", {"a"}).ok());
  EXPECT_TRUE(registry.AddHistogram("hist", "", {1}).ok());
}

TEST(Metrics, RejectsBadBucketBounds) {
  MetricsRegistry registry;
  ExpectInvalid(registry.AddHistogram("h", "", {1, 1}), "strictly increasing");
  ExpectInvalid(registry.AddHistogram("h", "", {2, 1}), "strictly increasing");
  ExpectInvalid(registry.AddHistogram("h", "", {1, kNaN}), "finite");
  ExpectInvalid(registry.AddHistogram("h", "", {-kInf, 1}), "finite");
  ExpectInvalid(registry.AddHistogram("h", "", {1, kInf, 2}), "finite");
  EXPECT_TRUE(registry.AddHistogram("h", "", {-1, 0, 1, kInf}).ok());
}

TEST(Metrics, SameDefinitionReturnsTheFamilyAndDifferentOnesAreRejected) {
  MetricsRegistry registry;
  auto first = registry.AddCounterFamily("req_total", "Requests.", {"code"});
  ASSERT_TRUE(first.ok());
  auto again = registry.AddCounterFamily("req_total", "Requests.", {"code"});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *first);

  ExpectInvalid(registry.AddGaugeFamily("req_total", "Requests.", {"code"}),
                "already registered as a counter");
  ExpectInvalid(registry.AddCounterFamily("req_total", "Requests.", {"method"}),
                "different definition");
  ExpectInvalid(registry.AddCounterFamily("req_total", "Requests.", {"code", "method"}),
                "different definition");
  ExpectInvalid(registry.AddCounterFamily("req_total", "Other help.", {"code"}),
                "different definition");
  ExpectInvalid(registry.AddHistogramFamily("req_total", "Requests.", {1}, {"code"}),
                "already registered as a counter");

  auto hist = registry.AddHistogram("lat", "", {1, 2});
  ASSERT_TRUE(hist.ok());
  EXPECT_EQ(*registry.AddHistogram("lat", "", {1, 2, kInf}), *hist);  // same after normalizing
  ExpectInvalid(registry.AddHistogram("lat", "", {1, 3}), "different definition");

  // Sample names may not collide across families, in either registration order.
  ExpectInvalid(registry.AddGauge("lat_count", ""), "which 'lat' already writes");
  ASSERT_TRUE(registry.AddGauge("q_bucket", "").ok());
  ExpectInvalid(registry.AddHistogram("q", "", {1}), "which 'q_bucket' already writes");
}

TEST(Metrics, RejectsWrongLabelValueCount) {
  MetricsRegistry registry;
  auto family = registry.AddGaugeFamily("g", "", {"a", "b"});
  ASSERT_TRUE(family.ok());
  ExpectInvalid((*family)->WithLabels({"x"}), "2 label name(s) but 1 label value(s)");
  ExpectInvalid((*family)->WithLabels({"x", "y", "z"}), "but 3 label value(s)");
  ExpectInvalid((*family)->WithLabels({}), "but 0 label value(s)");
  auto unlabelled = registry.AddGaugeFamily("u", "", {});
  ASSERT_TRUE(unlabelled.ok());
  ExpectInvalid((*unlabelled)->WithLabels({"x"}), "0 label name(s)");
  // No child was created by the failed calls.
  EXPECT_EQ(registry.ExpositionText(), "# TYPE g gauge\n# TYPE u gauge\nu 0\n");
}

TEST(Metrics, ConcurrentUpdatesSumExactly) {
  constexpr int kThreads = 8;
  constexpr int kIterations = 20000;
  MetricsRegistry registry;
  Counter* shared = *registry.AddCounter("shared_total", "");
  Gauge* gauge = *registry.AddGauge("level", "");
  Histogram* histogram = *registry.AddHistogram("obs", "", {0, 1});
  auto per_thread = registry.AddCounterFamily("per_thread_total", "", {"thread"});
  ASSERT_TRUE(per_thread.ok());

  std::atomic<bool> done{false};
  std::string scrape_problem;
  std::thread scraper([&] {  // exposition and registration race with the updates
    int round = 0;
    while (!done.load()) {
      const std::string text = registry.ExpositionText();
      if (round++ % 16 == 0 && scrape_problem.empty()) scrape_problem = TextFormatProblem(text);
      (void)registry.AddGauge("late_" + std::to_string(round % 4), "");
    }
  });
  std::vector<std::thread> workers;
  workers.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < kIterations; ++i) {
        shared->Increment();
        gauge->Add(i % 2 == 0 ? 3 : -1);
        histogram->Observe(i % 3);  // 0, 1, 2: one third per bucket
        // Looked up every time on purpose, to race child creation and lookups.
        (*(*per_thread)->WithLabels({std::to_string(i % kThreads)}))->Increment(2);
      }
    });
  }
  for (std::thread& worker : workers) worker.join();
  done = true;
  scraper.join();
  EXPECT_EQ(scrape_problem, "");

  constexpr double kTotal = double{kThreads} * kIterations;
  EXPECT_EQ(shared->Value(), kTotal);
  EXPECT_EQ(gauge->Value(), kTotal);  // (3 - 1) per two iterations
  const Histogram::Snapshot snapshot = histogram->Read();
  EXPECT_EQ(snapshot.count, static_cast<uint64_t>(kTotal));
  // kIterations is not a multiple of 3: i % 3 == 0 happens once more per thread.
  const uint64_t zeros = kThreads * static_cast<uint64_t>((kIterations + 2) / 3);
  const uint64_t ones = kThreads * static_cast<uint64_t>((kIterations + 1) / 3);
  const uint64_t twos = kThreads * static_cast<uint64_t>(kIterations / 3);
  EXPECT_EQ(snapshot.bucket_counts, (std::vector<uint64_t>{zeros, ones, twos}));
  EXPECT_EQ(snapshot.sum, static_cast<double>(ones + 2 * twos));
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ((*(*per_thread)->WithLabels({std::to_string(t)}))->Value(), 2.0 * kIterations)
        << "thread label " << t;
  }
  EXPECT_EQ(TextFormatProblem(registry.ExpositionText()), "");
}

}  // namespace
}  // namespace rubato
