// Motley's dashboard: nodes, jobs, a job's page and the link matrix, read from the REST API
// every POLL_MS.
// Plain JavaScript modules, no build step: what this file says is what the browser runs.
// Every text from the API goes into the page as text (textContent), never as markup; the
// plan and training-curve pictures come from the coordinator's own renderers (their text
// escaped there) and are parsed as SVG, where no script runs (and the page's
// Content-Security-Policy allows none).

import { api, AuthError, setToken, token } from './api.js';

const POLL_MS = 1500;
const LOG_KEEP = 64 * 1024;
// The training curves are redrawn this often while the job runs (the coordinator keeps what it
// parsed of rank 0's logs and fetches only what was written since), and once more when it ends.
const CURVES_MS = 5000;
const OVER = ['succeeded', 'failed', 'cancelled'];

const $ = (id) => document.getElementById(id);

/** An element: `h('td', {class: 'num'}, 'text', child, ...)`; strings become text nodes. */
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// A degraded job's state with the share of the plan's throughput its members keep.
function stateLabel(job) {
  return job.membership ? `${job.state} ${Math.round(job.membership.throughput_share * 100)}%` : job.state;
}

// The membership a degraded job trains under (docs/keep-going.md), as `motley job show` says it.
function membershipLine(m) {
  return `Keeping going: epoch ${m.epoch}: replicas ${m.replicas.join(', ')} train (${m.lost.join(', ')} lost); ` +
    `${Math.round(m.throughput_share * 100)}% of the plan's throughput: ${m.reason}`;
}

function badge(state, label = state) {
  return h('span', { class: `badge s-${state}` }, label);
}

function bytes(b) {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = b, u = 0;
  while (v >= 1024 && u < units.length - 1) { v /= 1024; u++; }
  return u === 0 ? `${b} B` : `${v.toFixed(1)} ${units[u]}`;
}

function when(ms) {
  return new Date(ms).toLocaleString();
}

/** Replace `parent`'s content, keeping keyboard focus on the element with the same id. */
function replace(parent, ...children) {
  const focused = document.activeElement && parent.contains(document.activeElement) ? document.activeElement.id : null;
  parent.replaceChildren(...children.filter((c) => c !== null && c !== undefined));
  if (focused && $(focused)) $(focused).focus();
}

/** The confirmation dialog: resolves true when the operator confirms. */
function confirmAction(text, yes) {
  const d = $('confirm');
  $('confirm-text').textContent = text;
  $('confirm-yes').textContent = yes;
  d.returnValue = '';
  d.showModal();
  return new Promise((resolve) => d.addEventListener('close', () => resolve(d.returnValue === 'ok'), { once: true }));
}

function status(text) {
  $('status').textContent = text;
}

// ---- pages ----

let page = null; // { key, refresh, timer }

function route() {
  const hash = location.hash || '#/nodes';
  const job = hash.match(/^#\/jobs\/(\d+)$/);
  if (job) return { key: `job-${job[1]}`, make: (view) => jobPage(view, Number(job[1])), nav: 'nav-jobs' };
  if (hash === '#/jobs') return { key: 'jobs', make: jobsPage, nav: 'nav-jobs' };
  if (hash === '#/net') return { key: 'net', make: netPage, nav: 'nav-net' };
  return { key: 'nodes', make: nodesPage, nav: 'nav-nodes' };
}

function show() {
  if (page) clearTimeout(page.timer);
  const r = route();
  for (const id of ['nav-nodes', 'nav-jobs', 'nav-net']) {
    if (id === r.nav) $(id).setAttribute('aria-current', 'page');
    else $(id).removeAttribute('aria-current');
  }
  const view = $('view');
  view.replaceChildren();
  const p = { key: r.key, timer: null, ...r.make(view) };
  page = p;
  const tick = async () => {
    if (page !== p) return;
    // A tab in the background asks nothing; it catches up when shown again.
    if (document.hidden) {
      p.timer = setTimeout(tick, POLL_MS);
      return;
    }
    try {
      await p.refresh();
      status(`updated ${new Date().toLocaleTimeString()}`);
    } catch (e) {
      if (e instanceof AuthError) return signIn(e.message);
      status(`error: ${e.message}`);
    }
    if (page === p) p.timer = setTimeout(tick, POLL_MS);
  };
  tick();
}

function nodesPage(view) {
  const table = h('div', { id: 'nodes' });
  view.append(h('h2', {}, 'Nodes'), table);
  const act = async (name, drain) => {
    const text = drain
      ? `Drain node ${name}? It gets no new ranks; what runs there keeps running.`
      : `Undrain node ${name}? It takes new ranks again.`;
    if (!(await confirmAction(text, drain ? 'Drain' : 'Undrain'))) return;
    try {
      await api(`/nodes/${encodeURIComponent(name)}/${drain ? 'drain' : 'undrain'}`, { method: 'POST' });
      status(`node ${name} ${drain ? 'drained' : 'undrained'}`);
      await refresh();
    } catch (e) {
      status(`error: ${e.message}`);
    }
  };
  const refresh = async () => {
    const nodes = await api('/nodes');
    const rows = nodes.map((n, i) => {
      const inv = n.inventory || {};
      const gpus = n.load?.gpus || [];
      const util = gpus.length ? `${Math.round(gpus.reduce((a, g) => a + g.utilization_percent, 0) / gpus.length)}%` : '-';
      const used = gpus.reduce((a, g) => a + g.memory_used_bytes, 0);
      const total = gpus.reduce((a, g) => a + g.memory_total_bytes, 0);
      const draining = n.state === 'draining';
      return h('tr', { 'data-node': n.name },
        h('th', { scope: 'row' }, n.name),
        h('td', {}, n.live ? badge('live', '● live') : badge('lost', '○ lost')),
        h('td', {}, badge(n.state)),
        h('td', {}, `${inv.gpus ?? '?'} × ${inv.gpu ?? '?'}`),
        h('td', { class: 'num' }, util),
        h('td', { class: 'num' }, gpus.length ? `${bytes(used)} / ${bytes(total)}` : '-'),
        h('td', { class: 'num' }, n.load ? bytes(n.load.work_dir_free_bytes) : '-'),
        h('td', { class: 'num' }, n.load ? n.load.load_1m.toFixed(2) : '-'),
        h('td', { class: 'num' }, n.load ? n.load.ranks_running : '-'),
        h('td', {}, h('button', {
          type: 'button', id: `node-action-${i}`, class: draining ? null : 'danger',
          'aria-label': `${draining ? 'Undrain' : 'Drain'} node ${n.name}`,
          onclick: () => act(n.name, !draining),
        }, draining ? 'Undrain' : 'Drain')));
    });
    replace(table, nodes.length === 0 ? h('p', {}, 'No nodes yet: start an agent (motley-agent --coordinator ...).') :
      h('table', { 'aria-label': 'Nodes' },
        h('thead', {}, h('tr', {}, ['Node', 'Agent', 'State', 'GPUs', 'GPU util', 'GPU memory', 'Work dir free', 'Load (1 min)', 'Ranks', 'Action'].map((c) => h('th', { scope: 'col' }, c)))),
        h('tbody', {}, rows)));
  };
  return { refresh };
}

// The measured over the declared rate: at least GOOD is healthy, below FAIR is degraded.
const GOOD = 0.8;
const FAIR = 0.5;

function ratioClass(ratio) {
  if (ratio === null) return 'r-none';
  return ratio >= GOOD ? 'r-good' : ratio >= FAIR ? 'r-fair' : 'r-poor';
}

/** The live link matrix (GET /net): a row and a column per node; a cell per measured pair
 * (its slowest NIC kind, as the planner prices it), coloured by its ratio to the declared
 * rate, the ratio also written out; the tooltip has every kind's latency and samples. */
function netPage(view) {
  const matrix = h('div', { id: 'net-matrix' });
  const nics = h('div', { id: 'net-nics' });
  view.append(h('h2', {}, 'Network'),
    h('p', { class: 'legend' }, 'Measured GB/s between nodes; the colour and the × figure are its ratio to the declared rate: ',
      h('span', { class: 'r-good' }, `≥ ${GOOD}`), h('span', { class: 'r-fair' }, `≥ ${FAIR}`),
      h('span', { class: 'r-poor' }, `< ${FAIR}`), h('span', { class: 'r-none' }, 'nothing declared')),
    matrix, h('h3', {}, 'NICs'), nics);
  const refresh = async () => {
    const [net, nodeList] = await Promise.all([api('/net'), api('/nodes')]);
    const names = [...new Set([...nodeList.map((n) => n.name), ...net.links.flatMap((l) => [l.a, l.b])])].sort();
    const pair = new Map(); // "a\u0000b" (a < b) -> links of every kind
    for (const l of net.links) {
      const k = `${l.a}\u0000${l.b}`;
      if (!pair.has(k)) pair.set(k, []);
      pair.get(k).push(l);
    }
    const cell = (x, y) => {
      if (x === y) return h('td', { class: 'self', 'aria-label': `${x} itself` }, '');
      const links = pair.get(x < y ? `${x}\u0000${y}` : `${y}\u0000${x}`);
      if (!links) return h('td', { class: 'cell r-none', 'aria-label': `${x} to ${y}: not measured` }, '—');
      const slow = links.reduce((m, l) => (l.gb_per_s < m.gb_per_s ? l : m));
      const ratio = slow.declared_gb_per_s ? slow.gb_per_s / slow.declared_gb_per_s : null;
      const tip = links.map((l) => `${l.nic_kind}: ${l.gb_per_s.toFixed(2)} GB/s` +
        (l.declared_gb_per_s ? ` (declared ${l.declared_gb_per_s.toFixed(2)})` : ' (nothing declared)') +
        `, latency ${l.latency_ms.toFixed(3)} ms, ${l.samples} samples, ${Math.max(0, Math.round((Date.now() - l.updated_unix_ms) / 1000))} s ago`);
      return h('td', {
        class: `cell ${ratioClass(ratio)}`, 'data-a': x, 'data-b': y, 'data-gbps': slow.gb_per_s,
        title: `${x} ↔ ${y}\n${tip.join('\n')}`, tabindex: 0,
      }, `${slow.gb_per_s.toFixed(2)} GB/s`, h('small', {}, ratio === null ? 'declared: —' : `×${ratio.toFixed(2)} of declared`));
    };
    replace(matrix, names.length === 0 ? h('p', {}, 'No nodes yet.') :
      h('table', { class: 'matrix', 'aria-label': 'Link matrix' },
        h('thead', {}, h('tr', {}, h('td', {}, ''), names.map((n) => h('th', { scope: 'col' }, n)))),
        h('tbody', {}, names.map((x) => h('tr', { 'data-node': x }, h('th', { scope: 'row' }, x), names.map((y) => cell(x, y)))))),
      net.links.length === 0 ? h('p', {}, 'No link measured yet: agents probe the links between the nodes of a running launch.') : null);
    replace(nics, net.nics.length === 0 ? h('p', {}, 'No NIC rates reported yet.') :
      h('table', { 'aria-label': 'NICs' },
        h('thead', {}, h('tr', {}, ['Node', 'NIC', 'Kind', 'Sent GB/s', 'Received GB/s', 'Reported'].map((c) => h('th', { scope: 'col' }, c)))),
        h('tbody', {}, net.nics.map((n) => h('tr', {},
          h('td', {}, n.node), h('td', {}, n.name), h('td', {}, n.kind),
          h('td', { class: 'num' }, n.tx_gb_per_s.toFixed(3)), h('td', { class: 'num' }, n.rx_gb_per_s.toFixed(3)),
          h('td', {}, when(n.at_unix_ms)))))));
  };
  return { refresh };
}

function jobsPage(view) {
  const table = h('div', { id: 'jobs' });
  view.append(h('h2', {}, 'Jobs'), table);
  const refresh = async () => {
    const jobs = (await api('/jobs')).sort((a, b) => b.id - a.id);
    replace(table, jobs.length === 0 ? h('p', {}, 'No jobs yet: motley job submit FILE.') :
      h('table', { 'aria-label': 'Jobs' },
        h('thead', {}, h('tr', {}, ['Job', 'Name', 'State', 'Generation', 'Why (reason)', 'Updated'].map((c) => h('th', { scope: 'col' }, c)))),
        h('tbody', {}, jobs.map((j) => h('tr', { 'data-job': j.id },
          h('td', {}, h('a', { href: `#/jobs/${j.id}`, id: `job-link-${j.id}` }, `#${j.id}`)),
          h('td', {}, j.name),
          h('td', {}, badge(j.state, stateLabel(j))),
          h('td', { class: 'num' }, j.generation),
          h('td', { class: 'reason' }, j.reason ?? ''),
          h('td', {}, when(j.updated_at_ms)))))));
  };
  return { refresh };
}

function jobPage(view, id) {
  const head = h('div', { id: 'job-head' });
  const plan = h('div', { id: 'plan', class: 'plan', role: 'group', 'aria-label': 'Plan picture' }, h('p', {}, 'Not planned yet.'));
  // Rank 0's training lines (loss, eval loss, tokens/s) of every generation, drawn by the
  // coordinator (GET /jobs/{id}/curves.svg).
  const curves = h('div', { id: 'curves', class: 'plan curves', role: 'group', 'aria-label': 'Training curves' }, h('p', {}, 'No steps yet.'));
  const ranks = h('div', { id: 'ranks' });
  const events = h('ol', { id: 'events', class: 'events', 'aria-live': 'polite', 'aria-label': 'Events', tabindex: 0 });
  // The checkpoint-location bitmap: the steps some node holds and where each file of the newest
  // complete one is; and the job's recoveries (from its events), each with the planner's lower
  // bound next to the time the restore took.
  const checkpoints = h('section', { id: 'checkpoints', hidden: true, 'aria-labelledby': 'checkpoints-heading' },
    h('h3', { id: 'checkpoints-heading' }, 'Checkpoints'));
  const recoveries = h('section', { id: 'recoveries', hidden: true, 'aria-labelledby': 'recoveries-heading' });
  const recovered = []; // { why, planned, done, retries }
  view.append(h('p', {}, h('a', { href: '#/jobs' }, '← all jobs')), head,
    h('h3', {}, 'Plan'), plan, h('h3', {}, 'Training curves'), curves, h('h3', {}, 'Ranks'), ranks, checkpoints, recoveries, h('h3', {}, 'Events'), events);
  let lastSeq = 0;
  let planGeneration = 0;
  let curvesAt = 0; // when the curves were last fetched (ms)
  let curvesFinal = false; // drawn after the job ended: not fetched again
  const logs = new Map(); // rank -> { open, text, offset, generation }

  const cancel = async () => {
    if (!(await confirmAction(`Cancel job ${id}? Its ranks are stopped.`, 'Cancel job'))) return;
    try {
      await api(`/jobs/${id}/cancel`, { method: 'POST' });
      await refresh();
    } catch (e) {
      status(`error: ${e.message}`);
    }
  };

  const drawPlan = async (generation) => {
    const text = await api(`/jobs/${id}/plan.svg`, { text: true });
    const doc = new DOMParser().parseFromString(text, 'image/svg+xml');
    const svg = doc.documentElement;
    if (svg.nodeName !== 'svg') throw new Error('the plan picture does not parse');
    replace(plan, document.importNode(svg, true));
    planGeneration = generation;
  };

  // Every CURVES_MS while the job runs; once more when it is over, then never again.
  const drawCurves = async (over) => {
    if (curvesFinal || (!over && Date.now() - curvesAt < CURVES_MS)) return;
    curvesAt = Date.now();
    try {
      const text = await api(`/jobs/${id}/curves.svg`, { text: true });
      const svg = new DOMParser().parseFromString(text, 'image/svg+xml').documentElement;
      if (svg.nodeName !== 'svg') throw new Error('the curves picture does not parse');
      replace(curves, document.importNode(svg, true));
      curvesFinal = over;
    } catch (e) {
      if (e instanceof AuthError) throw e;
      replace(curves, h('p', { class: 'error' }, `Training curves: ${e.message}`));
    }
  };

  const pollLog = async (rank, generation) => {
    const l = logs.get(rank);
    if (!l || !l.open) return;
    if (l.generation !== generation) Object.assign(l, { text: '', offset: null, generation });
    try {
      // The first read takes the log's tail (a long log is never read from its start); the
      // next ones read on from where it ended.
      const from = l.offset === null || l.offset === undefined ? `tail=${LOG_KEEP}` : `offset=${l.offset}`;
      const { text: chunk, headers } = await api(`/jobs/${id}/ranks/${rank}/logs?${from}&generation=${generation}`, { text: true, headers: true });
      const next = Number(headers.get('x-motley-log-next'));
      l.offset = Number.isFinite(next) && headers.has('x-motley-log-next') ? next : (l.offset || 0) + new TextEncoder().encode(chunk).length;
      l.text = (l.text + chunk).slice(-LOG_KEEP);
      l.error = null;
    } catch (e) {
      if (e instanceof AuthError) throw e;
      l.error = e.message;
    }
  };

  const drawRanks = (list, generation) => {
    const rows = [];
    for (const r of list) {
      const a = r.assignment;
      const l = logs.get(a.rank) || { open: false };
      rows.push(h('tr', { 'data-rank': a.rank },
        h('td', { class: 'num' }, a.rank), h('td', {}, a.node), h('td', { class: 'num' }, a.gpu),
        h('td', { class: 'num' }, a.replica), h('td', { class: 'num' }, a.stage),
        h('td', {}, `${a.layer_start}-${a.layer_end}`), h('td', {}, badge(r.state)),
        h('td', { class: 'num' }, r.exit_code ?? ''),
        h('td', {}, h('button', {
          type: 'button', id: `log-toggle-${a.rank}`, 'aria-expanded': l.open ? 'true' : 'false',
          'aria-controls': `log-${a.rank}`,
          onclick: async () => {
            logs.set(a.rank, { ...(logs.get(a.rank) || { text: '', offset: null, generation }), open: !l.open });
            await pollLog(a.rank, generation);
            drawRanks(list, generation);
          },
        }, l.open ? 'Hide log' : 'Show log'))));
      if (l.open) {
        rows.push(h('tr', {}, h('td', { colspan: 9 },
          l.error ? h('p', { class: 'error' }, l.error) : null,
          h('pre', { class: 'log', id: `log-${a.rank}`, tabindex: 0, 'aria-label': `Log of rank ${a.rank}` }, l.text || '(no output yet)'))));
      }
    }
    replace(ranks, list.length === 0 ? h('p', {}, 'No ranks yet.') :
      h('table', { 'aria-label': 'Ranks' },
        h('thead', {}, h('tr', {}, ['Rank', 'Node', 'GPU', 'Replica', 'Stage', 'Layers', 'State', 'Exit code', 'Log'].map((c) => h('th', { scope: 'col' }, c)))),
        h('tbody', {}, rows)));
    for (const pre of ranks.querySelectorAll('pre.log')) pre.scrollTop = pre.scrollHeight;
  };

  const drawCheckpoints = async () => {
    const steps = await api(`/jobs/${id}/checkpoints`);
    if (steps.length === 0) {
      checkpoints.hidden = true;
      return;
    }
    const grid = await api(`/jobs/${id}/checkpoints/grid`);
    const th = (cols) => h('thead', {}, h('tr', {}, cols.map((c) => h('th', { scope: 'col' }, c))));
    checkpoints.hidden = false;
    replace(checkpoints, h('h3', { id: 'checkpoints-heading' }, 'Checkpoints'),
      h('table', { id: 'ckpt-steps', 'aria-label': 'Checkpoint steps' },
        th(['Step', 'Files', 'Bytes', 'Nodes', 'Restorable']),
        h('tbody', {}, steps.map((st) => h('tr', { 'data-step': st.step },
          h('td', { class: 'num' }, st.step), h('td', { class: 'num' }, st.files), h('td', { class: 'num' }, bytes(st.bytes)),
          h('td', {}, st.nodes.join(', ')), h('td', {}, st.complete ? 'yes' : `no: ${st.missing}`))))),
      h('p', {}, `Step ${grid.step}: the tier each node holds each file in`),
      h('table', { id: 'ckpt-grid', 'aria-label': `Checkpoint step ${grid.step}, files by node` },
        th(['Unit', 'Bytes', ...grid.nodes]),
        h('tbody', {}, grid.rows.map((r) => h('tr', {},
          h('th', { scope: 'row' }, r.unit), h('td', { class: 'num' }, bytes(r.bytes)),
          grid.nodes.map((n) => h('td', {}, r.held[n] ? r.held[n].join('+') : '—')))))));
  };

  // A recovery's events: `recovering` (why), `recovery_planned` and `recovery_done` (JSON),
  // `recovery_waiting` (a pinned plan's nodes waited for).
  const noteRecovery = (e) => {
    const json = () => { try { return JSON.parse(e.message); } catch { return null; } };
    if (e.kind === 'recovering') recovered.push({ why: e.message, planned: null, done: null, retries: 0 });
    const last = recovered[recovered.length - 1];
    if (!last) return false;
    if (e.kind === 'recovery_planned') last.planned = json();
    else if (e.kind === 'recovery_done') last.done = json();
    else if (e.kind === 'recovery_retry') last.retries += 1;
    else if (e.kind === 'recovery_waiting') last.waiting = e.message;
    else if (e.kind === 'failed' && !last.done) last.failed = e.message;
    return e.kind.startsWith('recover') || e.kind === 'failed';
  };

  const drawRecoveries = () => {
    if (recovered.length === 0) return;
    const secs = (x) => (typeof x === 'number' ? `${x.toFixed(2)} s` : '—');
    const mb = (b) => (b ? bytes(b.local) + ' / ' + bytes(b.peer) + ' / ' + bytes(b.cloud) : '—');
    recoveries.hidden = false;
    replace(recoveries, h('h3', { id: 'recoveries-heading' }, 'Recoveries'),
      h('table', { id: 'recoveries-table', 'aria-label': 'Recoveries' },
        h('thead', {}, h('tr', {}, ['#', 'Why', 'Step', 'Lower bound', 'Restore took', 'Total', 'Bytes local / peer / cloud', 'Outcome']
          .map((c) => h('th', { scope: 'col' }, c)))),
        h('tbody', {}, recovered.map((r, i) => h('tr', { 'data-recovery': i + 1 },
          h('td', { class: 'num' }, i + 1), h('td', {}, r.why),
          h('td', { class: 'num' }, r.planned ? r.planned.step : (r.done ? r.done.step ?? 'none' : '…')),
          h('td', { class: 'num' }, secs(r.planned && r.planned.lower_bound_s)),
          h('td', { class: 'num' }, secs(r.done && r.done.transfer_s)),
          h('td', { class: 'num' }, secs(r.done && r.done.total_s)),
          h('td', { class: 'num' }, mb((r.done && r.done.bytes) || (r.planned && r.planned.bytes))),
          h('td', {}, r.done ? `relaunched${r.retries ? ` after ${r.retries} retries` : ''}` : (r.failed ? `failed: ${r.failed}` : (r.waiting ? `in progress: ${r.waiting}` : 'in progress'))))))));
  };

  const refresh = async () => {
    const job = await api(`/jobs/${id}`);
    const over = OVER.includes(job.state);
    replace(head,
      h('h2', {}, `Job ${job.id}: ${job.name}`),
      h('div', { class: 'meta' },
        h('p', {}, 'State ', badge(job.state), h('span', { id: 'job-state', hidden: true }, job.state)),
        h('p', {}, `Generation ${job.generation}`),
        h('p', {}, `Submitted ${when(job.created_at_ms)}`),
        over ? null : h('button', { type: 'button', id: 'cancel', class: 'danger', onclick: cancel }, 'Cancel job')),
      job.membership ? h('p', { id: 'job-membership' }, membershipLine(job.membership)) : null,
      job.reason ? h('p', { class: 'reason', id: 'job-reason' }, ['submitted', 'planning'].includes(job.state) ? `Waiting: ${job.reason}` : job.reason) : null);
    for (;;) {
      const batch = await api(`/jobs/${id}/events?after=${lastSeq}`);
      for (const e of batch) {
        events.append(h('li', { 'data-seq': e.seq },
          h('time', { datetime: new Date(e.at_ms).toISOString() }, new Date(e.at_ms).toLocaleTimeString()), ' ',
          h('span', { class: 'kind' }, e.kind), e.message));
        lastSeq = e.seq;
        noteRecovery(e);
      }
      if (batch.length < 1000) break;
    }
    drawRecoveries();
    if (job.generation > 0) {
      if (planGeneration !== job.generation) await drawPlan(job.generation);
      await drawCurves(over);
      const p = await api(`/jobs/${id}/plan`);
      for (const [rank, l] of logs) if (l.open) await pollLog(rank, p.generation);
      drawRanks(p.ranks, p.generation);
      await drawCheckpoints();
    }
  };
  return { refresh };
}

// ---- sign-in ----

function signIn(message) {
  if (page) clearTimeout(page.timer);
  page = null;
  $('view').replaceChildren();
  $('login').hidden = false;
  $('signout').hidden = true;
  $('login-error').textContent = message && token() ? `The coordinator refused the token: ${message}` : (message || '');
  setToken(null);
  $('token').focus();
}

async function start() {
  try {
    await api('/leader');
  } catch (e) {
    if (e instanceof AuthError) return signIn(token() ? e.message : '');
    status(`error: ${e.message}`);
  }
  $('login').hidden = true;
  $('signout').hidden = !token();
  show();
}

$('login-form').addEventListener('submit', async (ev) => {
  ev.preventDefault();
  const t = $('token').value.trim();
  setToken(t);
  try {
    await api('/nodes');
  } catch (e) {
    if (e instanceof AuthError) {
      setToken(null);
      $('login-error').textContent = `The coordinator refused the token: ${e.message}`;
      $('token').select();
      return;
    }
  }
  $('token').value = '';
  $('login-error').textContent = '';
  start();
  $('main').focus();
});

$('signout').addEventListener('click', () => {
  setToken(null);
  signIn('');
});

window.addEventListener('hashchange', () => {
  if (!$('login').hidden) return;
  show();
  $('main').focus();
});

start();
