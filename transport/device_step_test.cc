// The device data plane's step descriptor (device_step.h): a step survives the wire, its size
// is fixed by the limits alone, and every broken field is refused by name.
#include "transport/device_step.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace rubato {
namespace {

const DevicePlaneLimits kLimits{.max_runs = 4, .max_rows = 64};

DeviceStep MixedStep() {
  DeviceStep step;
  step.step = 7;
  step.decode_rows = 2;
  step.max_seq_len = 4096;
  step.num_splits = 3;
  step.runs = {{11, 100, 1}, {12, 3000, 1}, {13, 0, 17}};
  return step;
}

std::vector<std::byte> Encoded(const DeviceStep& step) {
  std::vector<std::byte> wire(DeviceStepBytes(kLimits), std::byte{0xAB});
  EXPECT_TRUE(EncodeDeviceStep(step, kLimits, wire).ok());
  return wire;
}

TEST(DeviceStepTest, RoundTripsAStepAndAStop) {
  const DeviceStep step = MixedStep();
  EXPECT_EQ(step.rows(), 19);
  const std::vector<std::byte> wire = Encoded(step);
  Result<DeviceStep> back = DecodeDeviceStep(wire, kLimits);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->kind, DeviceStep::Kind::kStep);
  EXPECT_EQ(back->step, 7u);
  EXPECT_EQ(back->decode_rows, 2);
  EXPECT_EQ(back->max_seq_len, 4096);
  EXPECT_EQ(back->num_splits, 3);
  ASSERT_EQ(back->runs.size(), 3u);
  EXPECT_EQ(back->runs[1].session_id, 12u);
  EXPECT_EQ(back->runs[1].first_position, 3000u);
  EXPECT_EQ(back->runs[2].tokens, 17u);

  DeviceStep stop;
  stop.kind = DeviceStep::Kind::kStop;
  stop.step = 8;
  Result<DeviceStep> stopped = DecodeDeviceStep(Encoded(stop), kLimits);
  ASSERT_TRUE(stopped.ok()) << stopped.status().message();
  EXPECT_EQ(stopped->kind, DeviceStep::Kind::kStop);
  EXPECT_TRUE(stopped->runs.empty());
}

TEST(DeviceStepTest, SizesDependOnTheLimitsAndRowsOnly) {
  EXPECT_EQ(DeviceStepBytes(kLimits), 40u + 4u * 16u);
  DeviceStep step = MixedStep();
  EXPECT_EQ(DeviceStepUsedBytes(step), 40u + 3u * 16u);
  // A layer's bytes follow from the rows, whatever the sessions hold.
  EXPECT_EQ(DeviceRowsBytes(19, 4096, 1024), 19u * 6144u * 2u);
  EXPECT_EQ(DeviceOutputBytes(2, 4096), 2u * 4096u * 2u);
}

// Decodes `wire` after `edit` and expects a refusal whose message holds `expected`.
void ExpectRefused(std::vector<std::byte> wire, const char* expected) {
  Result<DeviceStep> step = DecodeDeviceStep(wire, kLimits);
  ASSERT_FALSE(step.ok()) << "expected a refusal naming '" << expected << "'";
  EXPECT_EQ(step.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(step.status().message().find(expected), std::string::npos) << step.status().message();
}

template <typename T>
void Poke(std::vector<std::byte>& wire, size_t offset, T value) {
  std::memcpy(wire.data() + offset, &value, sizeof(value));
}

TEST(DeviceStepTest, RefusesBrokenFieldsByName) {
  const std::vector<std::byte> good = Encoded(MixedStep());
  std::vector<std::byte> wire = good;
  wire[0] = std::byte{'X'};
  ExpectRefused(wire, "magic");
  wire = good;
  Poke<uint16_t>(wire, 4, 9);
  ExpectRefused(wire, "version 9");
  wire = good;
  Poke<uint16_t>(wire, 4, 1);  // a peer of the first version (no num_splits)
  ExpectRefused(wire, "version 1; this rank speaks 2");
  wire = good;
  Poke<uint16_t>(wire, 6, 5);
  ExpectRefused(wire, "kind 5");
  wire = good;
  Poke<uint32_t>(wire, 16, 5);  // runs > max_runs
  ExpectRefused(wire, "5 runs");
  wire = good;
  Poke<uint32_t>(wire, 20, 18);  // rows disagree with the runs
  ExpectRefused(wire, "header says 18 rows");
  wire = good;
  Poke<uint32_t>(wire, 24, 3);  // the third run is a prefill chunk, not a decode row
  ExpectRefused(wire, "decode row 2 but has 17 tokens");
  wire = good;
  Poke<uint32_t>(wire, 28, 3000);  // below a decode row's keys
  ExpectRefused(wire, "max_seq_len 3000");
  wire = good;
  Poke<uint32_t>(wire, 32, 5000);
  ExpectRefused(wire, "num_splits 5000");
  wire = good;
  Poke<uint32_t>(wire, 40 + 2 * 16 + 12, 0);  // a run of no tokens
  ExpectRefused(wire, "run 2: 0 tokens");
  ExpectRefused(std::vector<std::byte>(good.begin(), good.end() - 1), "bytes; the descriptor");
  wire = good;
  Poke<uint32_t>(wire, 40 + 2 * 16 + 12, 63);  // 2 decode rows + 63: one past max_rows
  Poke<uint32_t>(wire, 20, 65);
  ExpectRefused(wire, "65 rows; max_rows is 64");
}

TEST(DeviceStepTest, EncodeRefusesWhatDecodeWould) {
  std::vector<std::byte> wire(DeviceStepBytes(kLimits));
  DeviceStep step = MixedStep();
  step.decode_rows = 1;  // run 1 has one token but would be a prefill run after a decode run
  step.max_seq_len = 101;
  EXPECT_TRUE(EncodeDeviceStep(step, kLimits, wire).ok());
  step.decode_rows = 3;
  EXPECT_FALSE(EncodeDeviceStep(step, kLimits, wire).ok());
  step = MixedStep();
  step.runs.push_back({14, 0, 1});
  step.runs.push_back({15, 0, 1});
  EXPECT_FALSE(EncodeDeviceStep(step, kLimits, wire).ok());  // 5 runs
  EXPECT_FALSE(EncodeDeviceStep(MixedStep(), kLimits, {wire.data(), wire.size() - 1}).ok());
  EXPECT_FALSE((DevicePlaneLimits{.max_runs = 8, .max_rows = 4}.Check().ok()));
  step = MixedStep();
  step.num_splits = -1;
  EXPECT_FALSE(EncodeDeviceStep(step, kLimits, wire).ok());
  DeviceStep prefill;
  prefill.runs = {{13, 0, 17}};
  prefill.num_splits = 2;  // splits without decode rows
  EXPECT_FALSE(EncodeDeviceStep(prefill, kLimits, wire).ok());
  prefill.num_splits = 0;
  EXPECT_TRUE(EncodeDeviceStep(prefill, kLimits, wire).ok());
}

}  // namespace
}  // namespace rubato
