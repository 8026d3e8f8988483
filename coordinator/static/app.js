// The coordinator dashboard: reads the REST API, refreshes on Server-Sent Events, and polls only
// while no event stream is open (e.g. when reads need a token, which EventSource cannot send).
// One refresh at a time; none while the token form waits for a token (each would be a refused
// request, counted and logged as a guess).
"use strict";

const state = { runId: new URLSearchParams(location.search).get("run"), token: sessionStorage.getItem("fedal-token"),
                charts: {}, pending: null, running: false, again: false, live: false, needToken: false };

function askForToken(message) {
  state.needToken = true;
  document.getElementById("token-form").hidden = false;
  document.getElementById("token-error").textContent = message;
}

function timeoutSignal(ms) {  // AbortSignal.timeout where the browser has it (Chromium 103+, Safari 16+)
  if (typeof AbortSignal.timeout === "function") return AbortSignal.timeout(ms);
  const controller = new AbortController();
  setTimeout(() => controller.abort(), ms);
  return controller.signal;
}

async function api(path) {
  const headers = state.token ? { Authorization: `Bearer ${state.token}` } : {};
  let resp;
  try {
    // never waits for ever: one refresh runs at a time, and one that hung would hold every later one
    resp = await fetch(path, { headers, cache: "no-store", signal: timeoutSignal(20000) });
  } catch (err) {
    if (state.token && err instanceof TypeError && /[^\x20-\x7e]/.test(state.token)) {
      // a header can carry no such character: fetch refuses it before sending anything
      sessionStorage.removeItem("fedal-token");
      state.token = null;
      askForToken("that token holds characters a browser cannot send (paste it again without them)");
    }
    throw err;
  }
  if (resp.status === 401 || resp.status === 403) {
    askForToken(state.token ? "wrong token" : "this coordinator needs a token");
    throw new Error(`HTTP ${resp.status}`);
  }
  if (!resp.ok) throw new Error(`HTTP ${resp.status} for ${path}`);
  return resp.json();
}

const fmt = {
  // differential privacy: the epsilon a client last reported; "(stopped)" once it reached its budget
  epsilon: (c) => (c.epsilon === null || c.epsilon === undefined ? "–"
                   : c.epsilon.toFixed(2) + (c.dp_exhausted ? " (stopped)" : "")),
  acc: (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %"),
  time: (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "–"),
  bytes: (b) => (b === null || b === undefined ? "–" : b >= 2 ** 30 ? (b / 2 ** 30).toFixed(1) + " GiB"
                                                                     : (b / 2 ** 20).toFixed(0) + " MiB"),
  temp: (c) => (c === null || c === undefined ? "–" : c.toFixed(1) + " °C"),
};

// A client's last health report: its flags (or ok), with the details as the cell's tooltip.
function healthCell(c) {
  const h = c.health;
  if (!h) return { text: "–", cls: "", title: "no health report (agent health_every_s = 0, or an older agent)" };
  const details = [`reported ${fmt.time(h.ts)}`];
  if (h.throttled !== undefined) details.push(`get_throttled 0x${h.throttled.toString(16)}`);
  if (h.load1 !== undefined) details.push(`load ${h.load1} ${h.load5} ${h.load15}`);
  if (h.rss_bytes !== undefined) details.push(`agent RSS ${fmt.bytes(h.rss_bytes)}`);
  for (const [k, v] of Object.entries(h.versions || {})) details.push(`${k} ${v}`);
  const flags = c.health_flags || [];
  return { text: flags.length ? flags.join(", ") : "ok", cls: flags.length ? "flagged" : "healthy",
           title: details.join("\n") };
}

function setText(id, value) { document.getElementById(id).textContent = value; }

function fillTable(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows.map(({ cells, dataset }) => {
    const tr = document.createElement("tr");
    Object.assign(tr.dataset, dataset || {});
    for (const cell of cells) {
      const td = document.createElement("td");
      if (typeof cell === "object" && cell !== null) {
        td.textContent = cell.text; td.className = cell.cls;
        if (cell.title) td.title = cell.title;
      }
      else td.textContent = cell;
      tr.appendChild(td);
    }
    return tr;
  }));
}

// rounds are whole: the x axis steps by these (uPlot's own steps give 1, 1.2, 1.4 ... for a few rounds)
const ROUND_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];

function chart(id, series) {
  if (state.charts[id]) return state.charts[id];
  const el = document.getElementById(id);
  const opts = { width: Math.max(360, el.clientWidth || 480), height: 220,
                 scales: { x: { time: false } }, axes: [{ label: "round", incrs: ROUND_STEPS }, {}],
                 series: [{ label: "round" }, ...series] };
  state.charts[id] = new uPlot(opts, [[], ...series.map(() => [])], el);
  return state.charts[id];
}

function drawCurves(rounds) {
  const evald = rounds.filter((r) => r.mean_acc !== undefined);
  const x = evald.map((r) => r.round);
  chart("acc-chart", [
    { label: "mean", stroke: "#1f5fbf", width: 2 }, { label: "min", stroke: "#9a3b3b" },
    { label: "max", stroke: "#2a7d4f" }, { label: "local mean", stroke: "#b07d12", dash: [6, 4] },
  ]).setData([x, evald.map((r) => r.mean_acc), evald.map((r) => r.min_acc), evald.map((r) => r.max_acc),
              evald.map((r) => r.local_mean_acc ?? null)]);
  const withDisc = rounds.filter((r) => r.server && r.server.disc_loss !== undefined);
  chart("disc-chart", [
    { label: "loss", stroke: "#6b3fa0", width: 2 }, { label: "accuracy", stroke: "#1f8a8a" },
  ]).setData([withDisc.map((r) => r.round), withDisc.map((r) => r.server.disc_loss),
              withDisc.map((r) => r.server.disc_acc)]);
}

async function refresh() {
  const runs = await api("/api/v1/runs");
  fillTable("runs", runs.map((r) => ({ cells: [r.run_id, r.strategy, r.state, `${r.round} / ${r.rounds}`],
                                         dataset: { run: r.run_id } })));
  if (!runs.length) { setText("run-id", "none yet (POST /api/v1/runs)"); return; }
  if (!state.runId || !runs.some((r) => r.run_id === state.runId)) {
    // a running run, else the newest that did not fail, else the newest
    state.runId = (runs.find((r) => r.state === "running") || [...runs].reverse().find((r) => r.state !== "failed")
                   || runs[runs.length - 1]).run_id;
  }
  const select = document.getElementById("run-select");
  select.replaceChildren(...runs.map((r) => new Option(`${r.run_id} (${r.state})`, r.run_id, false, r.run_id === state.runId)));

  const id = encodeURIComponent(state.runId);
  const [run, rounds] = await Promise.all([api(`/api/v1/runs/${id}`), api(`/api/v1/runs/${id}/rounds`)]);
  setText("run-id", run.run_id);
  setText("run-state", run.state + (run.error ? ` (${run.error})` : ""));
  setText("run-strategy", run.strategy);
  setText("round-counter", run.round);
  setText("rounds-total", run.rounds);
  setText("completed-rounds", run.completed_rounds);
  setText("run-phase", run.phase ? `${run.phase} (iteration ${run.iteration})` : "–");
  const last = [...rounds].reverse().find((r) => r.mean_acc !== undefined) || {};
  setText("mean-acc", fmt.acc(last.mean_acc));
  setText("local-acc", fmt.acc(last.local_mean_acc));

  const clients = Object.entries(run.clients || {});
  const flagged = clients.filter(([, c]) => (c.health_flags || []).length).length;
  setText("client-count", `(${clients.filter(([, c]) => c.online).length} of ${clients.length} online`
                          + (flagged ? `, ${flagged} flagged)` : ")"));
  fillTable("clients", clients.map(([cid, c]) => ({
    dataset: { client: cid },
    cells: [cid, { text: c.online ? "online" : "offline", cls: c.online ? "online" : "offline" }, fmt.time(c.last_seen),
            c.answered, c.late, c.rejected, fmt.acc(c.last_acc), fmt.acc(c.last_local_acc), fmt.epsilon(c),
            fmt.temp(c.health?.cpu_temp_c), fmt.bytes(c.health?.mem_available_bytes), fmt.bytes(c.health?.disk_free_bytes),
            healthCell(c)],
  })));
  drawCurves(rounds);
}

function scheduleRefresh(delayMs = 250) {
  if (state.needToken) return;
  if (state.running) { state.again = true; return; }  // one at a time: a late answer never overwrites a newer one
  if (state.pending) return;
  state.pending = setTimeout(async () => {
    state.pending = null;
    state.running = true;
    try {
      await refresh();
    } catch (err) {
      console.warn("refresh failed:", err.message);
    } finally {
      state.running = false;
      if (state.again) { state.again = false; scheduleRefresh(0); }
    }
  }, delayMs);
}

function listen() {
  const badge = document.getElementById("live");
  const source = new EventSource("/api/v1/events");
  source.onopen = () => { state.live = true; badge.textContent = "live"; badge.className = "badge on"; scheduleRefresh(0); };
  // every event is sent with its type (`event: round`, ...), which onmessage never sees
  for (const type of ["run", "phase", "round", "client"]) source.addEventListener(type, () => scheduleRefresh());
  source.onerror = () => { state.live = false; badge.textContent = "polling"; badge.className = "badge off"; };
}

document.getElementById("run-select").addEventListener("change", (e) => { state.runId = e.target.value; scheduleRefresh(0); });
document.getElementById("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.token = document.getElementById("token").value.trim();
  sessionStorage.setItem("fedal-token", state.token);
  document.getElementById("token-form").hidden = true;
  state.needToken = false;
  scheduleRefresh(0);
});

listen();
scheduleRefresh(0);
// while live the events say when to refresh, and a slow poll brings what sends none (health
// reports, last seen, answers counted within a phase); without a stream, every two seconds
let ticks = 0;
setInterval(() => { ticks += 1; if (!state.live || ticks % 15 === 0) scheduleRefresh(0); }, 2000);
