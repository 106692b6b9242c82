// Checks helm/rubato/dashboards/rubato.json (tests/deploy/check):
//   node dashboard.mjs WORK_DIR
// 1. the layout: unique panel ids, panels within the 24-column grid and not overlapping, every
//    query on the ${datasource} variable, every $variable defined;
// 2. writes WORK_DIR/dashboard.ts, the JSON as a literal of dashboard_types.ts' RubatoDashboard
//    (@grafana/schema), for `tsc --noEmit`;
// 3. every metric name is exported by rubato's sources (a "rubato:..." string in common/,
//    inference_rank/, cache_rank/, transport/) or is one of PENDING, the names being added;
// 4. writes WORK_DIR/dashboard-rules.yml, every PromQL expression (panel targets and the
//    variables' label_values selectors) as a recording rule, for `promtool check rules`.
//    Grafana's variables are replaced first: $__rate_interval by 5m, the others by `.*`
//    (they only appear inside regex matchers). `:` in metric names is legal PromQL.
import fs from 'node:fs';
import path from 'node:path';

const workDir = process.argv[2];
const here = path.dirname(new URL(import.meta.url).pathname);
const file = path.resolve(here, '../../helm/rubato/dashboards/rubato.json');
const dashboard = JSON.parse(fs.readFileSync(file, 'utf8'));
const failures = [];
const fail = (where, message) => failures.push(`${where}: ${message}`);

const BUILTIN_DURATIONS = { __rate_interval: '5m', __interval: '1m', __range: '1h' };
const variables = new Set((dashboard.templating?.list ?? []).map((v) => v.name));
const VARIABLE = /\$\{?(\w+)\}?/g;

function checkVariables(where, text) {
  for (const [, name] of text.matchAll(VARIABLE)) {
    if (!variables.has(name) && !(name in BUILTIN_DURATIONS)) {
      fail(where, `uses $${name}, which is not a dashboard variable`);
    }
  }
}
const substitute = (expr) => expr.replace(VARIABLE, (_, name) => BUILTIN_DURATIONS[name] ?? '.*');

const exprs = [];  // [where, expr]
const ids = new Set();
const occupied = new Map();  // "x,y" grid cell -> panel title
const panels = (dashboard.panels ?? []).flatMap((p) => [p, ...(p.panels ?? [])]);
for (const p of panels) {
  const where = `panel ${p.id} "${p.title}"`;
  if (!Number.isInteger(p.id) || ids.has(p.id)) fail(where, 'ids must be unique integers');
  ids.add(p.id);
  const { x, y, w, h } = p.gridPos ?? {};
  if (![x, y, w, h].every(Number.isInteger) || x < 0 || y < 0 || w < 1 || h < 1 || x + w > 24) {
    fail(where, `gridPos ${JSON.stringify(p.gridPos)} is off the 24-column grid`);
  } else {
    for (let cx = x; cx < x + w; cx++) {
      for (let cy = y; cy < y + h; cy++) {
        const other = occupied.get(`${cx},${cy}`);
        if (other) fail(where, `overlaps "${other}"`);
        occupied.set(`${cx},${cy}`, p.title);
      }
    }
  }
  if (p.type === 'row') continue;
  if (p.datasource?.uid !== '${datasource}') fail(where, 'datasource must be ${datasource}');
  if (!p.description) fail(where, 'says nothing of what it shows (description)');
  const refIds = new Set();
  if (!(p.targets?.length > 0)) fail(where, 'has no queries');
  for (const t of p.targets ?? []) {
    if (refIds.has(t.refId)) fail(where, `refId ${t.refId} twice`);
    refIds.add(t.refId);
    if (t.datasource?.uid !== '${datasource}') fail(where, `target ${t.refId}: datasource must be \${datasource}`);
    checkVariables(`${where} target ${t.refId}`, t.expr ?? '');
    exprs.push([`${where} ${t.refId}`, t.expr]);
  }
}
for (const v of dashboard.templating?.list ?? []) {
  if (v.type !== 'query') continue;
  const query = typeof v.query === 'string' ? v.query : v.query?.query;
  checkVariables(`variable ${v.name}`, query ?? '');
  const labelValues = /^label_values\((.+),\s*\w+\)$/.exec(query ?? '');
  if (!labelValues) fail(`variable ${v.name}`, `query ${query} is not label_values(selector, label)`);
  else exprs.push([`variable ${v.name}`, labelValues[1]]);
}

// Names the dashboard uses before rubato exports them (docs/deploy.md, "Panels that wait for
// metrics not exported yet"); drop one from here once it is exported.
const PENDING = new Set([
]);
function exportedNames() {
  const names = new Set();
  const walk = (dir) => {
    for (const entry of fs.readdirSync(dir, { withFileTypes: true })) {
      const full = path.join(dir, entry.name);
      if (entry.isDirectory()) walk(full);
      else if (/\.(cc|h)$/.test(entry.name)) {
        const text = fs.readFileSync(full, 'utf8');
        for (const [, name] of text.matchAll(/"(rubato:[a-z0-9_:]+|process_[a-z_]+)"/g)) {
          names.add(name);
        }
      }
    }
  };
  for (const dir of ['common', 'inference_rank', 'cache_rank', 'transport']) {
    walk(path.resolve(here, '../..', dir));
  }
  return names;
}
// The metric names of an expression; {__name__=~"a(b|c)d"} counts as abd and acd.
function metricNames(expr) {
  const expanded = expr.replace(/__name__=~"([^"(]*)\(([^)]*)\)([^"]*)"/g,
    (_, pre, alternatives, post) => alternatives.split('|').map((a) => pre + a + post).join(' '));
  return [...expanded.matchAll(/(?<![\w:])(rubato:[a-z0-9_:]+|process_[a-z_]+)/g)].map((m) => m[1]);
}
const exported = exportedNames();
const pendingUsed = new Set();
for (const [where, expr] of exprs) {
  for (const name of metricNames(expr)) {
    const base = [name, name.replace(/_(bucket|sum|count)$/, '')];
    if (base.some((n) => exported.has(n))) continue;
    const pending = base.find((n) => PENDING.has(n));
    if (pending) pendingUsed.add(pending);
    else fail(where, `${name}: rubato exports no such metric, and it is not in PENDING`);
  }
}
const landed = [...PENDING].filter((n) => exported.has(n));
if (landed.length > 0) console.log(`dashboard: now exported, drop from PENDING: ${landed.join(' ')}`);

const rules = exprs.map(([where, expr], i) =>
  `      - record: dashboard:expr_${i}\n        # ${where.replace(/\n/g, ' ')}\n        expr: ${JSON.stringify(substitute(expr))}`);
fs.writeFileSync(path.join(workDir, 'dashboard-rules.yml'),
  `groups:\n  - name: rubato-dashboard\n    rules:\n${rules.join('\n')}\n`);
fs.writeFileSync(path.join(workDir, 'dashboard.ts'),
  `import type { RubatoDashboard } from '${path.join(here, 'dashboard_types')}';\n\n` +
  `export const dashboard: RubatoDashboard = ${JSON.stringify(dashboard, null, 2)};\n`);

if (failures.length > 0) {
  console.error(failures.map((f) => `FAIL ${f}`).join('\n'));
  process.exit(1);
}
console.log(`dashboard: ${panels.length} panels, ${exprs.length} PromQL expressions laid out and ` +
  `written; ${pendingUsed.size} metric names not exported yet (PENDING)`);
