// The rubato YAML of `helm template` outputs, made checkable on this machine (tests/deploy/check):
//   node rubato_config.mjs OUT_DIR NAME=RENDERED.yaml[,POLICY.yaml[,KV_RESIDENCY]]...
// For each job: takes rubato.yaml from the rendered ConfigMap, points model.path (the path in the
// image or volume, absent here) at the same model's shapes in the repository
// (configs/models/<name>, lower case, or the bundled models/<name>), optionally replaces the
// policy section with the one of a configs/policies/ file and sets engine.kv_residency, and
// writes OUT_DIR/NAME.rubato.yaml. One process for all jobs: node takes most of a second to start.
import fs from 'node:fs';
import path from 'node:path';
import YAML from 'yaml';

const [outDir, ...jobs] = process.argv.slice(2);
const repo = path.resolve(path.dirname(new URL(import.meta.url).pathname), '../..');
const renders = new Map();  // RENDERED -> its rubato YAML text
let failed = false;

function rubatoYaml(rendered) {
  if (!renders.has(rendered)) {
    const objects = YAML.parseAllDocuments(fs.readFileSync(rendered, 'utf8')).map((d) => d.toJS());
    const configMap = objects.find((o) => o?.kind === 'ConfigMap' && o.data?.['rubato.yaml']);
    renders.set(rendered, configMap?.data['rubato.yaml']);
  }
  return renders.get(rendered);
}

for (const job of jobs) {
  const [name, spec] = job.split(/=(.*)/s);
  const [rendered, policyFile, residency] = spec.split(',');
  const text = rubatoYaml(rendered);
  if (!text) {
    console.error(`${rendered}: no ConfigMap with rubato.yaml`);
    failed = true;
    continue;
  }
  const config = YAML.parse(text);
  const model = path.basename(config.model?.path ?? '');
  const candidates = [path.join(repo, 'configs/models', model.toLowerCase()), path.join(repo, 'models', model)];
  const shapes = candidates.find((dir) => model && fs.existsSync(path.join(dir, 'config.json')));
  if (!shapes) {
    console.error(`${name}: model.path ${config.model?.path}: no config.json in ` +
                  `${candidates.join(' or ')}; add the model's shapes to configs/models/`);
    failed = true;
    continue;
  }
  config.model.path = path.relative(process.cwd(), shapes);
  if (policyFile) config.policy = YAML.parse(fs.readFileSync(policyFile, 'utf8')).policy;
  if (residency) config.engine = { ...config.engine, kv_residency: residency };
  fs.writeFileSync(path.join(outDir, `${name}.rubato.yaml`), YAML.stringify(config));
}
process.exit(failed ? 1 : 0);
