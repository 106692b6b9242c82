// The rubato YAML of a `helm template` output, made checkable on this machine (tests/deploy/check):
//   node rubato_config.mjs RENDERED.yaml OUT.yaml [POLICY.yaml [KV_RESIDENCY]]
// Takes rubato.yaml from the rendered ConfigMap, points model.path (the path in the image or
// volume, absent here) at the same model's shapes in the repository (configs/models/<name>,
// lower case, or the bundled models/<name>), optionally replaces the policy section with the
// one of a configs/policies/ file and sets engine.kv_residency, writes OUT and prints the
// model directory it chose.
import fs from 'node:fs';
import path from 'node:path';
import YAML from 'yaml';

const [rendered, out, policyFile, residency] = process.argv.slice(2);
const repo = path.resolve(path.dirname(new URL(import.meta.url).pathname), '../..');
const objects = YAML.parseAllDocuments(fs.readFileSync(rendered, 'utf8')).map((d) => d.toJS());
const configMap = objects.find((o) => o?.kind === 'ConfigMap' && o.data?.['rubato.yaml']);
if (!configMap) {
  console.error(`${rendered}: no ConfigMap with rubato.yaml`);
  process.exit(1);
}
const config = YAML.parse(configMap.data['rubato.yaml']);
const name = path.basename(config.model?.path ?? '');
const candidates = [path.join(repo, 'configs/models', name.toLowerCase()), path.join(repo, 'models', name)];
const shapes = candidates.find((dir) => name && fs.existsSync(path.join(dir, 'config.json')));
if (!shapes) {
  console.error(`model.path ${config.model?.path}: no config.json in ${candidates.join(' or ')};` +
                ' add the model\'s shapes to configs/models/');
  process.exit(1);
}
config.model.path = shapes;
if (policyFile) config.policy = YAML.parse(fs.readFileSync(policyFile, 'utf8')).policy;
if (residency) config.engine = { ...config.engine, kv_residency: residency };
fs.writeFileSync(out, YAML.stringify(config));
console.log(path.relative(repo, shapes));
