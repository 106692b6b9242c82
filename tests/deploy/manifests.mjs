// Checks the manifests `helm template` rendered for each value set (tests/deploy/check):
//   node manifests.mjs WORK_DIR SET=FILE...
// 1. every object against the Kubernetes / prometheus-operator schemas (kubernetes-models,
//    @kubernetes-models/prometheus-operator: types, formats, required fields);
// 2. WORK_DIR/manifests.ts types each object as its interface (IDeployment, ...), so that
//    `tsc --noEmit` also rejects unknown fields, which the schemas let through;
// 3. the wiring: selectors, port names, the config volume, /health probes, the rubato YAML's
//    server and cache endpoints, and what each value set must render.
import fs from 'node:fs';
import path from 'node:path';
import { isDeepStrictEqual } from 'node:util';
import YAML from 'yaml';

const [workDir, ...sets] = process.argv.slice(2);
const chartDir = path.resolve(path.dirname(new URL(import.meta.url).pathname), '../../helm/rubato');
const failures = [];
const fail = (where, message) => failures.push(`${where}: ${message}`);

// apiVersion -> the package module holding its kinds.
const MODULES = {
  v1: 'kubernetes-models/v1',
  'apps/v1': 'kubernetes-models/apps/v1',
  'policy/v1': 'kubernetes-models/policy/v1',
  'monitoring.coreos.com/v1': '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1',
};

// What each value set renders (kinds, with counts), beyond the generic checks.
const DISAGGREGATED = {
  ConfigMap: 1, Service: 2, Deployment: 1, StatefulSet: 1, PodDisruptionBudget: 2, Secret: 1,
};
const EXPECTED = {
  default: { ConfigMap: 1, Service: 1, Deployment: 1, PodDisruptionBudget: 1 },
  colocated: { ConfigMap: 1, Service: 1, Deployment: 1, PodDisruptionBudget: 1 },
  disaggregated: DISAGGREGATED,
  'long-release': DISAGGREGATED,
  monitoring: { ConfigMap: 2, Service: 1, Deployment: 1, ServiceMonitor: 1, PodDisruptionBudget: 1 },
  'disaggregated+monitoring': { ...DISAGGREGATED, ConfigMap: 2, ServiceMonitor: 2 },
  // tests/deploy/pod-keys.yaml: the cache ranks' PDB off, the token from the user's Secret.
  'pod-keys': (({ Secret, ...rest }) => ({ ...rest, PodDisruptionBudget: 1 }))(DISAGGREGATED),
};

// Object names: DNS labels of at most 63 characters; a StatefulSet's at most 52, since its pods'
// controller-revision-hash label is the name, '-' and 10 characters.
const DNS_LABEL = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;

const matches = (selector, labels) =>
  Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v);

function checkSet(set, objects) {
  const byKind = (kind) => objects.filter((o) => o.kind === kind);
  const counts = {};
  for (const o of objects) counts[o.kind] = (counts[o.kind] ?? 0) + 1;
  if (!EXPECTED[set]) fail(set, 'no expectations for this value set in manifests.mjs');
  else if (!isDeepStrictEqual(counts, EXPECTED[set])) {
    fail(set, `rendered ${JSON.stringify(counts)}, expected ${JSON.stringify(EXPECTED[set])}`);
  }
  const configMaps = new Map(byKind('ConfigMap').map((c) => [c.metadata.name, c]));
  const workloads = [...byKind('Deployment'), ...byKind('StatefulSet')];
  for (const o of objects) {
    const name = o.metadata?.name ?? '';
    const limit = o.kind === 'StatefulSet' ? 52 : 63;
    if (!DNS_LABEL.test(name) || name.length > limit) {
      fail(`${set} ${o.kind}/${name}`, `name must be a DNS label of at most ${limit} characters (${name.length})`);
    }
  }
  // Each PodDisruptionBudget covers exactly one workload's pods.
  for (const b of byKind('PodDisruptionBudget')) {
    const covered = workloads.filter((w) => matches(b.spec.selector.matchLabels, w.spec.template.metadata.labels));
    if (covered.length !== 1) fail(`${set} PodDisruptionBudget/${b.metadata.name}`, `covers ${covered.length} workloads, expected 1`);
  }
  // Disaggregated: every rank reads the cache RPC token from the Secret (RUBATO_CACHE_TOKEN_FILE).
  const secrets = new Map(byKind('Secret').map((x) => [x.metadata.name, x]));
  if (byKind('StatefulSet').length > 0) {
    for (const w of workloads) {
      const pod = w.spec.template.spec;
      const c = pod.containers[0];
      const file = (c.env ?? []).find((e) => e.name === 'RUBATO_CACHE_TOKEN_FILE')?.value ?? '';
      const mount = (c.volumeMounts ?? []).find((m) => file.startsWith(`${m.mountPath}/`));
      const secret = (pod.volumes ?? []).find((v) => v.name === mount?.name)?.secret;
      const key = file.slice((mount?.mountPath.length ?? 0) + 1);
      // The chart's Secret holds the key; a user's (cache.token.existingSecret) is not rendered.
      const holds = secrets.has(secret?.secretName)
        ? Boolean(secrets.get(secret.secretName).data?.[key])
        : (secret?.items ?? []).some((i) => i.key === key && i.path === key);
      if (!secret || !holds) {
        fail(`${set} ${w.kind}/${w.metadata.name}`, `RUBATO_CACHE_TOKEN_FILE ${file} is not a key of the Secret mounted there`);
      }
    }
  }

  for (const w of workloads) {
    const where = `${set} ${w.kind}/${w.metadata.name}`;
    const pod = w.spec.template;
    if (!matches(w.spec.selector.matchLabels, pod.metadata.labels)) {
      fail(where, 'spec.selector does not match the pod template labels');
    }
    const volumes = new Map((pod.spec.volumes ?? []).map((v) => [v.name, v]));
    // rubato's container (the others: the user's sidecars, extraContainers).
    for (const c of pod.spec.containers.filter((x) => ['inference', 'cache'].includes(x.name))) {
      const ports = new Set((c.ports ?? []).map((p) => p.name));
      for (const probe of ['readinessProbe', 'livenessProbe']) {
        const get = c[probe]?.httpGet;
        if (get?.path !== '/health' || !ports.has(get.port)) {
          fail(where, `${c.name}.${probe} must GET /health on a named container port`);
        }
      }
      for (const m of c.volumeMounts ?? []) {
        if (!volumes.has(m.name)) fail(where, `mount ${m.name} has no volume`);
      }
      const shm = (c.volumeMounts ?? []).find((m) => m.mountPath === '/dev/shm');
      if (volumes.get(shm?.name)?.emptyDir?.medium !== 'Memory') {
        fail(where, `${c.name}: /dev/shm must be a memory-backed emptyDir`);
      }
      if (!(c.args ?? []).includes('/etc/rubato/rubato.yaml')) {
        fail(where, `${c.name}: not started with --config /etc/rubato/rubato.yaml`);
      }
    }
    for (const v of volumes.values()) {
      if (v.configMap && !configMaps.has(v.configMap.name)) {
        fail(where, `volume ${v.name} names ConfigMap ${v.configMap.name}, not rendered`);
      }
    }
    if (w.kind === 'StatefulSet') {
      const svc = byKind('Service').find((s) => s.metadata.name === w.spec.serviceName);
      if (svc?.spec.clusterIP !== 'None') {
        fail(where, `serviceName ${w.spec.serviceName} is not a rendered headless Service`);
      }
    }
  }

  // Every Service selects pods of this release and targets their named ports.
  for (const s of byKind('Service')) {
    const where = `${set} Service/${s.metadata.name}`;
    const pods = workloads.map((w) => w.spec.template).filter((t) => matches(s.spec.selector, t.metadata.labels));
    if (pods.length === 0) fail(where, 'selects no rendered pods');
    for (const p of s.spec.ports) {
      const named = pods.every((t) => t.spec.containers.some((c) => (c.ports ?? []).some((cp) => cp.name === p.targetPort)));
      if (!named) fail(where, `targetPort ${p.targetPort} is not a port of the selected pods`);
    }
  }
  for (const m of byKind('ServiceMonitor')) {
    const where = `${set} ServiceMonitor/${m.metadata.name}`;
    const services = byKind('Service').filter((s) => matches(m.spec.selector.matchLabels, s.metadata.labels));
    if (services.length !== 1) fail(where, `selects ${services.length} Services, expected 1`);
    for (const e of m.spec.endpoints) {
      if (!services.every((s) => s.spec.ports.some((p) => p.name === e.port))) {
        fail(where, `endpoint port ${e.port} is not a port of the selected Service`);
      }
      if (e.path !== '/metrics') fail(where, 'endpoints scrape /metrics');
    }
  }

  // The rubato YAML: what the chart owns in it.
  const config = [...configMaps.values()].find((c) => c.data?.['rubato.yaml']);
  const rubato = config ? YAML.parse(config.data['rubato.yaml']) : null;
  const inference = byKind('Deployment')[0];
  if (!rubato || !inference) {
    fail(set, 'no ConfigMap with rubato.yaml, or no inference Deployment');
  } else {
    const http = inference.spec.template.spec.containers[0].ports.find((p) => p.name === 'http');
    if (rubato.server?.host !== '0.0.0.0' || rubato.server?.port !== http?.containerPort) {
      fail(set, `rubato.yaml server ${JSON.stringify(rubato.server)} must listen on 0.0.0.0:${http?.containerPort}`);
    }
    // The pod outlives its preStop sleep and rubato's drain: SIGKILL must not cut the errors
    // rubato writes at its end.
    const grace = inference.spec.template.spec.terminationGracePeriodSeconds;
    const preStop = inference.spec.template.spec.containers[0].lifecycle?.preStop?.exec?.command;
    const sleep = preStop?.[0] === 'sleep' ? Number(preStop[1]) : 0;
    if (!(sleep > 0)) fail(set, `the inference container has no preStop sleep: ${JSON.stringify(preStop)}`);
    if (!(rubato.server?.shutdown_grace_s >= 0) || !(grace >= sleep + rubato.server.shutdown_grace_s + 5)) {
      fail(set, `terminationGracePeriodSeconds ${grace} must exceed the preStop sleep ${sleep} + server.shutdown_grace_s ${rubato.server?.shutdown_grace_s} by 5 s`);
    }
    const cache = byKind('StatefulSet')[0];
    if (cache) {
      const rpc = cache.spec.template.spec.containers[0].ports.find((p) => p.name === 'rpc');
      // UCX: every replica by its stable pod name; NCCL (one device peer): the headless Service.
      const ns = process.env.RELEASE_NAMESPACE;
      const service = cache.spec.serviceName;
      const expected = rubato.topology?.transport === 'ucx'
        ? Array.from({ length: cache.spec.replicas }, (_, i) =>
          `${cache.metadata.name}-${i}.${service}.${ns}.svc:${rpc?.containerPort}`)
        : [`${service}.${ns}.svc:${rpc?.containerPort}`];
      if (rubato.topology?.mode !== 'disaggregated' || rubato.engine?.kv_residency !== 'offloaded'
          || !isDeepStrictEqual(rubato.topology?.cache_endpoints, expected)) {
        fail(set, `rubato.yaml must offload to ${expected.join(', ')}: ${JSON.stringify(rubato.topology)}`);
      }
    } else if ((rubato.topology?.mode ?? 'colocated') !== 'colocated') {
      fail(set, 'no cache ranks rendered, yet rubato.yaml is not colocated');
    }
  }
  const dashboard = byKind('ConfigMap').find((c) => c.data?.['rubato.json']);
  if (dashboard) {
    const file = JSON.parse(fs.readFileSync(path.join(chartDir, 'dashboards/rubato.json'), 'utf8'));
    // The file folds the "Cache ranks" row; with cache ranks rendered the chart opens it.
    const expected = byKind('StatefulSet').length > 0 ? openRow(file, 'Cache ranks') : file;
    if (!isDeepStrictEqual(JSON.parse(dashboard.data['rubato.json']), expected)) {
      fail(set, 'the dashboard ConfigMap differs from dashboards/rubato.json'
        + (expected === file ? '' : ' with its "Cache ranks" row open'));
    }
  }
}

// `dashboard` with the collapsed row `title` open: its panels back after it, in order.
function openRow(dashboard, title) {
  const row = dashboard.panels.find((p) => p.type === 'row' && p.title === title && p.collapsed);
  if (!row) {
    fail('dashboards/rubato.json', `no collapsed row "${title}"`);
    return dashboard;
  }
  const panels = dashboard.panels.flatMap((p) => (p === row
    ? [{ ...p, collapsed: false, panels: [] }, ...p.panels] : [p]));
  return { ...dashboard, panels };
}

const tsImports = new Map();
const tsConsts = [];
let objectCount = 0;
for (const arg of sets) {
  const [set, file] = arg.split('=');
  const objects = YAML.parseAllDocuments(fs.readFileSync(file, 'utf8'))
    .map((d) => d.toJS())
    .filter((o) => o !== null);
  for (const [i, o] of objects.entries()) {
    const where = `${set} #${i} ${o.kind}/${o.metadata?.name}`;
    const module = MODULES[o.apiVersion];
    const model = module ? (await import(module))[o.kind] : undefined;
    if (!model) {
      fail(where, `no schema for ${o.apiVersion} ${o.kind} (add it to MODULES)`);
      continue;
    }
    try {
      new model(o).validate();
    } catch (e) {
      fail(where, e.message);
    }
    const type = `I${o.kind}`;
    tsImports.set(type, `import type { ${type} } from '${module}/${o.kind}';`);
    tsConsts.push(`// ${where}\nexport const m${objectCount++}: ${type} = ${JSON.stringify(o, null, 2)};`);
  }
  checkSet(set, objects);
}
fs.writeFileSync(path.join(workDir, 'manifests.ts'), [...tsImports.values(), ...tsConsts, ''].join('\n'));

if (failures.length > 0) {
  console.error(failures.map((f) => `FAIL ${f}`).join('\n'));
  process.exit(1);
}
console.log(`manifests: ${objectCount} objects of ${sets.length} value sets valid and wired`);
