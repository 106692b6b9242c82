// Tests for YamlMapReader: typed reads, ranges, defaults for absent keys, nested paths, unknown
// keys with suggestions, and maps built in code (no line numbers).
#include "common/yaml_map_reader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>

namespace rubato {
namespace {

using ::testing::HasSubstr;

YamlMapReader OpenText(const std::string& yaml, const std::string& path = "section") {
  Result<YamlMapReader> reader = YamlMapReader::Open(YAML::Load(yaml), path, "test.yaml");
  EXPECT_TRUE(reader.ok()) << reader.status().message();
  return std::move(reader).value();
}

TEST(YamlMapReader, AbsentKeysKeepTheCallersDefault) {
  YamlMapReader reader = OpenText("{}");
  int count = 7;
  double ratio = 0.25;
  bool flag = true;
  std::string name = "keep";
  std::vector<std::string> list = {"a"};
  EXPECT_TRUE(reader.ReadInt("count", 0, 10, &count).ok());
  EXPECT_TRUE(reader.ReadDouble("ratio", DoubleRange{0, 1}, &ratio).ok());
  EXPECT_TRUE(reader.ReadBool("flag", &flag).ok());
  EXPECT_TRUE(reader.ReadNonEmptyString("name", &name).ok());
  EXPECT_TRUE(reader.ReadStringList("list", &list).ok());
  EXPECT_EQ(count, 7);
  EXPECT_EQ(ratio, 0.25);
  EXPECT_TRUE(flag);
  EXPECT_EQ(name, "keep");
  EXPECT_EQ(list, std::vector<std::string>{"a"});
  EXPECT_TRUE(reader.Finish().ok());
  // A null document reads as an empty map too.
  EXPECT_TRUE(YamlMapReader::Open(YAML::Node(), "", "test.yaml").ok());
}

TEST(YamlMapReader, ReadsTypedValues) {
  YamlMapReader reader = OpenText(
      "count: +42\nbig: -9000000000\nratio: 1e-3\nflag: False\nname: 'x y'\n"
      "list: [a, 'b c']\ntagged: !!int 5\n");
  int count = 0;
  int64_t big = 0;
  double ratio = 0;
  bool flag = true;
  std::string name;
  std::vector<std::string> list;
  int tagged = 0;
  EXPECT_TRUE(reader.ReadInt("count", 0, 100, &count).ok());
  EXPECT_TRUE(reader.ReadInt64("big", INT64_MIN, INT64_MAX, &big).ok());
  EXPECT_TRUE(reader.ReadDouble("ratio", DoubleRange{}, &ratio).ok());
  EXPECT_TRUE(reader.ReadBool("flag", &flag).ok());
  EXPECT_TRUE(reader.ReadString("name", &name).ok());
  EXPECT_TRUE(reader.ReadStringList("list", &list).ok());
  EXPECT_TRUE(reader.ReadInt("tagged", 0, 10, &tagged).ok());
  EXPECT_EQ(count, 42);
  EXPECT_EQ(big, -9000000000);
  EXPECT_EQ(ratio, 1e-3);
  EXPECT_FALSE(flag);
  EXPECT_EQ(name, "x y");
  EXPECT_EQ(list, (std::vector<std::string>{"a", "b c"}));
  EXPECT_EQ(tagged, 5);
  EXPECT_TRUE(reader.Finish().ok());
}

TEST(YamlMapReader, NarrowIntegersAreRangeCheckedNotTruncated) {
  YamlMapReader reader = OpenText("small: 70000\nunsigned: -1\n");
  int16_t small = 0;
  uint32_t unsigned_value = 0;
  EXPECT_THAT(reader.ReadInt("small", INT64_MIN, INT64_MAX, &small).message(),
              HasSubstr("section.small: must be in [-32768, 32767], got 70000"));
  EXPECT_THAT(reader.ReadInt("unsigned", INT64_MIN, INT64_MAX, &unsigned_value).message(),
              HasSubstr("section.unsigned: must be in [0, 4294967295], got -1"));
  EXPECT_EQ(small, 0);
  EXPECT_EQ(unsigned_value, 0u);
}

TEST(YamlMapReader, DoubleRangesHonourOpenBoundsAndRejectNonFinite) {
  const DoubleRange unit_open{0, 1, /*min_inclusive=*/false, /*max_inclusive=*/false};
  EXPECT_EQ(unit_open.ToString(), "(0, 1)");
  EXPECT_FALSE(unit_open.Contains(0));
  EXPECT_TRUE(unit_open.Contains(0.5));
  EXPECT_FALSE(unit_open.Contains(1));
  EXPECT_FALSE(unit_open.Contains(std::nan("")));
  EXPECT_EQ((DoubleRange{-1, 2.5}).ToString(), "[-1, 2.5]");

  YamlMapReader reader = OpenText("edge: 1\nnan: .nan\ninf: inf\nword: nan\n");
  double value = 0.5;
  EXPECT_THAT(reader.ReadDouble("edge", unit_open, &value).message(),
              HasSubstr("test.yaml: section.edge: must be in (0, 1), got 1 (line 1)"));
  EXPECT_THAT(reader.ReadDouble("nan", DoubleRange{}, &value).message(),
              HasSubstr("section.nan: expected a number, got '.nan'"));
  EXPECT_THAT(reader.ReadDouble("inf", DoubleRange{}, &value).message(),
              HasSubstr("section.inf: expected a number, got 'inf'"));
  EXPECT_THAT(reader.ReadDouble("word", DoubleRange{}, &value).message(),
              HasSubstr("section.word: expected a number, got 'nan'"));
  EXPECT_EQ(value, 0.5);
}

TEST(YamlMapReader, EnumsMapNamesToValues) {
  enum class Color { kRed, kBlue };
  constexpr std::array<std::pair<std::string_view, Color>, 2> kColors = {
      {{"red", Color::kRed}, {"blue", Color::kBlue}}};
  YamlMapReader reader = OpenText("good: blue\nbad: green\nlist: [red]\n");
  Color color = Color::kRed;
  EXPECT_TRUE(reader.ReadEnum("good", kColors, &color).ok());
  EXPECT_EQ(color, Color::kBlue);
  EXPECT_THAT(reader.ReadEnum("bad", kColors, &color).message(),
              HasSubstr("section.bad: must be one of red, blue; got 'green' (line 2)"));
  EXPECT_THAT(reader.ReadEnum("list", kColors, &color).message(),
              HasSubstr("section.list: expected a name, got a list"));
  EXPECT_EQ(color, Color::kBlue);
}

TEST(YamlMapReader, NestedMapsAndListsExtendThePath) {
  YamlMapReader reader =
      OpenText("inner:\n  deep: {x: 1}\nitems:\n  - {a: 1}\n  - {a: two}\n", "outer");
  auto inner = reader.ReadMap("inner");
  ASSERT_TRUE(inner.ok());
  EXPECT_EQ(inner->key_path(), "outer.inner");
  auto deep = inner->ReadMap("deep");
  ASSERT_TRUE(deep.ok());
  int x = 0;
  EXPECT_TRUE(deep->ReadInt("x", 0, 5, &x).ok());
  EXPECT_EQ(x, 1);

  auto items = reader.ReadMapList("items");
  ASSERT_TRUE(items.ok());
  ASSERT_EQ(items->size(), 2u);
  int a = 0;
  EXPECT_TRUE((*items)[0].ReadInt("a", 0, 5, &a).ok());
  EXPECT_THAT((*items)[1].ReadInt("a", 0, 5, &a).message(),
              HasSubstr("test.yaml: outer.items[1].a: expected an integer, got 'two' (line 5)"));
  EXPECT_TRUE(reader.Finish().ok());
}

TEST(YamlMapReader, FinishSuggestsTheClosestKnownKey) {
  YamlMapReader reader = OpenText("recent_windw: 3\n");
  int recent_window = 0;
  int budget = 0;
  EXPECT_TRUE(reader.ReadInt("recent_window", 0, 10, &recent_window).ok());
  EXPECT_TRUE(reader.ReadInt("budget", 0, 10, &budget).ok());
  EXPECT_EQ(reader.Finish().message(),
            "test.yaml: section.recent_windw: unknown key; did you mean 'recent_window'? "
            "(line 1)");
  YamlMapReader unrelated = OpenText("zzz: 3\n");
  EXPECT_TRUE(unrelated.ReadInt("recent_window", 0, 10, &recent_window).ok());
  EXPECT_TRUE(unrelated.ReadInt("budget", 0, 10, &budget).ok());
  EXPECT_EQ(unrelated.Finish().message(),
            "test.yaml: section.zzz: unknown key; expected one of recent_window, budget (line 1)");
}

TEST(YamlMapReader, TakeRemainingHandsOverUnreadKeys) {
  YamlMapReader reader = OpenText("name: sfi\nalpha: 0.5\nwindow: {size: 4}\n", "policy");
  std::string name;
  EXPECT_TRUE(reader.ReadString("name", &name).ok());
  const YAML::Node remaining = reader.TakeRemaining();
  EXPECT_TRUE(reader.Finish().ok());
  ASSERT_TRUE(remaining.IsMap());
  EXPECT_EQ(remaining.size(), 2u);
  EXPECT_FALSE(remaining["name"].IsDefined());

  auto params = YamlMapReader::Open(remaining, "policy", "test.yaml");
  ASSERT_TRUE(params.ok());
  double alpha = 0;
  EXPECT_THAT(params->ReadDouble("alpha", DoubleRange{0, 0.25}, &alpha).message(),
              HasSubstr("test.yaml: policy.alpha: must be in [0, 0.25], got 0.5 (line 2)"));
  EXPECT_THAT(params->Finish().message(), HasSubstr("policy.window: unknown key"));
}

TEST(YamlMapReader, MapsBuiltInCodeHaveNoLineNumbers) {
  YAML::Node map(YAML::NodeType::Map);
  map["count"] = "abc";
  auto reader = YamlMapReader::Open(map, "built", "defaults");
  ASSERT_TRUE(reader.ok());
  int count = 0;
  EXPECT_EQ(reader->ReadInt("count", 0, 5, &count).message(),
            "defaults: built.count: expected an integer, got 'abc'");
}

TEST(YamlMapReader, RejectsNonMapsAndDuplicateKeys) {
  auto scalar = YamlMapReader::Open(YAML::Load("5"), "engine", "test.yaml");
  EXPECT_THAT(scalar.status().message(),
              HasSubstr("test.yaml: engine: expected a map of settings, got '5'"));
  auto duplicate = YamlMapReader::Open(YAML::Load("a: 1\nb: 2\na: 3\n"), "s", "test.yaml");
  EXPECT_EQ(duplicate.status().message(),
            "test.yaml: s.a: duplicate key (first given on line 1) (line 3)");
  auto complex_key = YamlMapReader::Open(YAML::Load("? [a, b]\n: 1\n"), "s", "test.yaml");
  EXPECT_THAT(complex_key.status().message(), HasSubstr("keys must be plain names"));
}

}  // namespace
}  // namespace rubato
