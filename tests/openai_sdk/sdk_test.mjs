// The official OpenAI Node SDK (npm `openai`) against a running `rubato serve`: models.list and
// models.retrieve, completions and chat completions streamed and not, usage, stop sequences, a
// refused field as the SDK's BadRequestError, logit_bias steering greedy decoding and the
// penalties changing it (their arithmetic is checked against a CPU reference in the C++ tests). Run by
// tests/openai_sdk/run, which starts the server; prints one line per check and exits 1 when any
// failed.
//   node tests/openai_sdk/sdk_test.mjs http://127.0.0.1:PORT MODEL_ID
import assert from "node:assert/strict";
import OpenAI from "openai";

const [baseUrl, modelId] = process.argv.slice(2);
if (!baseUrl || !modelId) {
  console.error("usage: sdk_test.mjs BASE_URL MODEL_ID");
  process.exit(2);
}
// maxRetries 0: a failure shows once, not after the SDK's retries.
const client = new OpenAI({ baseURL: `${baseUrl}/v1`, apiKey: "unused", maxRetries: 0 });
const prompt = "The pass key is 4711. Remember it. The pass key is";
let passed = 0;
let failed = 0;

async function check(name, body) {
  try {
    await body();
    passed += 1;
    console.log(`ok   ${name}`);
  } catch (error) {
    failed += 1;
    console.log(`FAIL ${name}: ${String(error?.message ?? error).slice(0, 500)}`);
  }
}

async function collect(stream) {
  const parts = [];
  for await (const chunk of stream) parts.push(chunk);
  return parts;
}

await check("models.list names the served model", async () => {
  const ids = [];
  for await (const model of client.models.list()) ids.push(model.id);
  assert.ok(ids.includes(modelId), `ids ${JSON.stringify(ids)}`);
});

await check("models.retrieve gives the model, an unknown id NotFoundError", async () => {
  const model = await client.models.retrieve(modelId);
  assert.equal(model.id, modelId);
  await assert.rejects(client.models.retrieve("no-such-model"), OpenAI.NotFoundError);
});

let greedyText = "";
await check("completions.create: text, finish reason, usage", async () => {
  const result = await client.completions.create({
    model: modelId, prompt, max_tokens: 8, temperature: 0,
  });
  assert.equal(result.object, "text_completion");
  assert.equal(result.choices.length, 1);
  greedyText = result.choices[0].text;
  assert.ok(greedyText.length > 0, "empty completion");
  assert.ok(["length", "stop"].includes(result.choices[0].finish_reason));
  assert.ok(result.usage.prompt_tokens > 0);
  assert.ok(result.usage.completion_tokens > 0 && result.usage.completion_tokens <= 8);
  assert.equal(result.usage.total_tokens,
               result.usage.prompt_tokens + result.usage.completion_tokens);
});

await check("completions.create streamed gives the same text", async () => {
  const chunks = await collect(await client.completions.create({
    model: modelId, prompt, max_tokens: 8, temperature: 0, stream: true,
  }));
  const text = chunks.map((c) => c.choices[0]?.text ?? "").join("");
  assert.equal(text, greedyText);
});

await check("chat.completions.create: an assistant message and usage", async () => {
  const result = await client.chat.completions.create({
    model: modelId, messages: [{ role: "user", content: prompt }], max_tokens: 8,
    temperature: 0,
  });
  assert.equal(result.object, "chat.completion");
  assert.equal(result.choices[0].message.role, "assistant");
  assert.equal(typeof result.choices[0].message.content, "string");
  assert.ok(result.usage.total_tokens > result.usage.prompt_tokens);
});

await check("chat.completions.create streamed: deltas, then the finish reason", async () => {
  const chunks = await collect(await client.chat.completions.create({
    model: modelId, messages: [{ role: "user", content: prompt }], max_tokens: 8,
    temperature: 0, stream: true,
  }));
  assert.ok(chunks.length >= 2);
  assert.equal(chunks[0].object, "chat.completion.chunk");
  const last = chunks.filter((c) => c.choices.length > 0).at(-1);
  assert.ok(["length", "stop"].includes(last.choices[0].finish_reason));
});

await check("a stop sequence ends the text before it", async () => {
  assert.ok(greedyText.length >= 2, `greedy text ${JSON.stringify(greedyText)} too short`);
  const stop = greedyText.slice(1, 2);
  const result = await client.completions.create({
    model: modelId, prompt, max_tokens: 8, temperature: 0, stop: [stop],
  });
  assert.equal(result.choices[0].finish_reason, "stop");
  assert.ok(!result.choices[0].text.includes(stop), JSON.stringify(result.choices[0].text));
  assert.ok(greedyText.startsWith(result.choices[0].text));
});

await check("an unsupported field is a BadRequestError naming it", async () => {
  const error = await client.chat.completions
    .create({
      model: modelId, messages: [{ role: "user", content: prompt }], max_tokens: 4,
      response_format: { type: "json_object" },
    })
    .then(() => null, (e) => e);
  assert.ok(error instanceof OpenAI.BadRequestError, `got ${error}`);
  assert.match(String(error.message), /response_format/);
});

await check("logit_bias +100 makes greedy decoding emit that token every step", async () => {
  const bias = { "65": 100 };
  const one = await client.completions.create({
    model: modelId, prompt, max_tokens: 1, temperature: 0, logit_bias: bias,
  });
  const four = await client.completions.create({
    model: modelId, prompt, max_tokens: 4, temperature: 0, logit_bias: bias,
  });
  const token = one.choices[0].text;
  assert.ok(token.length > 0);
  assert.equal(four.choices[0].text, token.repeat(4));
  assert.notEqual(four.choices[0].text, greedyText.slice(0, four.choices[0].text.length));
});

await check("frequency and presence penalties change a repetitive greedy text", async () => {
  const ask = (extra) => client.completions.create({
    model: modelId, prompt, max_tokens: 16, temperature: 0, ...extra,
  });
  const plain = (await ask({})).choices[0].text;
  assert.equal((await ask({ frequency_penalty: 0, presence_penalty: 0 })).choices[0].text, plain);
  assert.notEqual((await ask({ frequency_penalty: 2 })).choices[0].text, plain);
  assert.notEqual((await ask({ presence_penalty: 2 })).choices[0].text, plain);
});

console.log(`openai sdk: ${passed} passed, ${failed} failed`);
process.exit(failed === 0 ? 0 : 1);
