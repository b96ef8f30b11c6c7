// Murmura dashboard: follows one run through server-sent events and draws it with SVG.
// Plain JavaScript, no library and no build step. Everything a client sends (its id, its
// device name) is shown through textContent, never parsed as HTML.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  // /runs/NAME shows another run of the same root; its API lives under the same prefix.
  const match = location.pathname.match(/^\/runs\/([^/]+)/);
  const base = match ? "/runs/" + match[1] : "";
  const MAX_CLIENT_ROWS = 500;

  const state = {
    rows: [], have: 0, generation: null, snapshot: null, xAxis: "version",
    snaps: [], sortKey: "refusals", sortDesc: true, peerSortKey: null, peerSortDesc: false,
    fetching: null, polling: null, connected: false,
  };

  if (new URLSearchParams(location.search).has("token")) {
    // the server answered with a cookie: keep the token out of the address bar and history
    history.replaceState(null, "", location.pathname);
  }

  // -- small helpers --------------------------------------------------------------------------

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function isNum(v) { return typeof v === "number" && isFinite(v); }

  function fmt(v, digits) {
    if (v === null || v === undefined) return "–";
    if (typeof v === "boolean") return v ? "yes" : "no";
    if (!isNum(v)) return String(v);
    if (digits !== undefined) return v.toFixed(digits);
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    return Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 1 ? v.toFixed(2) : v.toPrecision(3);
  }

  function bytes(n) {
    if (!isNum(n)) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return (i ? n.toFixed(n >= 100 ? 0 : 1) : n) + " " + units[i];
  }

  function ago(seconds) {
    if (!isNum(seconds)) return "–";
    if (seconds < 60) return seconds.toFixed(seconds < 10 ? 1 : 0) + " s";
    if (seconds < 3600) return (seconds / 60).toFixed(0) + " min";
    return (seconds / 3600).toFixed(1) + " h";
  }

  function sum(obj) {
    return Object.values(obj || {}).reduce((a, b) => a + (isNum(b) ? b : 0), 0);
  }

  // -- charts ---------------------------------------------------------------------------------

  // Round tick steps: 1, 2 or 5 times a power of ten, about `count` of them over [lo, hi].
  function ticks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
      out.push(Math.abs(t) < step * 1e-9 ? 0 : t);
    }
    return out;
  }

  function tickText(t) {
    const a = Math.abs(t);
    if (a >= 1e6) return (t / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return (t / 1e3).toFixed(0) + "k";
    if (a === 0 || a >= 1) return String(+t.toFixed(2));
    return String(+t.toPrecision(2));
  }

  // A line chart in `figure`: series = [{points: [[x, y], ...]}], drawn to fit its box.
  // The SVG carries data-points (the first series' point count): tests and scripts read it.
  function lineChart(figure, title, series, opts) {
    opts = opts || {};
    figure.replaceChildren(el("figcaption", {}, title));
    const W = 560, H = opts.small ? 140 : 220, L = 48, R = 12, T = 10, B = 34;
    const box = svg("svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none",
                            role: "img", "aria-label": title});
    const first = series[0] ? series[0].points : [];
    box.setAttribute("data-points", String(first.length));
    figure.appendChild(box);
    const all = series.flatMap((s) => s.points);
    if (!all.length) {
      box.appendChild(svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"},
                          opts.empty || "no data yet"));
      return;
    }
    let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
    let y0 = Math.min(...all.map((p) => p[1])), y1 = Math.max(...all.map((p) => p[1]));
    if (opts.yMin !== undefined) y0 = Math.min(y0, opts.yMin);
    if (opts.yMax !== undefined) y1 = Math.max(y1, opts.yMax);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0 && y0 === opts.yMin) y1 = y0 + 1;  // all at the floor: show it as the floor
    else if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
    const sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
    for (const t of ticks(y0, y1, opts.small ? 3 : 5)) {
      box.appendChild(svg("line", {x1: L, x2: W - R, y1: sy(t), y2: sy(t), class: "gridline"}));
      box.appendChild(svg("text", {x: L - 6, y: sy(t) + 3, "text-anchor": "end", class: "tick"},
                          tickText(t)));
    }
    for (const t of ticks(x0, x1, 6)) {
      box.appendChild(svg("text", {x: sx(t), y: H - B + 14, "text-anchor": "middle",
                                   class: "tick"}, tickText(t)));
    }
    box.appendChild(svg("line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"}));
    box.appendChild(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}));
    box.appendChild(svg("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle",
                                 class: "axis-label"}, opts.xLabel || ""));
    series.forEach((s, i) => {
      const pts = thin(s.points, 1200);
      if (!pts.length) return;
      const d = pts.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + " " +
                        sy(p[1]).toFixed(1)).join("");
      box.appendChild(svg("path", {d: d, class: "series s" + i}));
      if (i === 0 && pts.length <= 150) {
        for (const p of pts) {
          box.appendChild(svg("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.2, class: "point"}));
        }
      }
    });
  }

  // Every k-th point (and the last) when there are more than `max`: a screen has few pixels.
  function thin(points, max) {
    if (points.length <= max) return points;
    const k = Math.ceil(points.length / max);
    const out = points.filter((_, i) => i % k === 0);
    if (out[out.length - 1] !== points[points.length - 1]) out.push(points[points.length - 1]);
    return out;
  }

  function barChart(figure, title, bars, xLabel) {
    figure.replaceChildren(el("figcaption", {}, title));
    const W = 560, H = 140, L = 48, R = 12, T = 10, B = 34;
    const box = svg("svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none",
                            role: "img", "aria-label": title});
    box.setAttribute("data-points", String(bars.length));
    figure.appendChild(box);
    if (!bars.length) {
      box.appendChild(svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"},
                          "no updates yet"));
      return;
    }
    const top = Math.max(...bars.map((b) => b[1]), 1);
    const slot = (W - L - R) / bars.length;
    const sy = (y) => H - B - y / top * (H - T - B);
    for (const t of ticks(0, top, 3)) {
      box.appendChild(svg("line", {x1: L, x2: W - R, y1: sy(t), y2: sy(t), class: "gridline"}));
      box.appendChild(svg("text", {x: L - 6, y: sy(t) + 3, "text-anchor": "end", class: "tick"},
                          tickText(t)));
    }
    bars.forEach((b, i) => {
      const x = L + i * slot;
      box.appendChild(svg("rect", {x: x + slot * 0.15, width: slot * 0.7, y: sy(b[1]),
                                   height: H - B - sy(b[1]), class: "bar"}));
      if (bars.length <= 24 || i % Math.ceil(bars.length / 24) === 0) {
        box.appendChild(svg("text", {x: x + slot / 2, y: H - B + 14, "text-anchor": "middle",
                                     class: "tick"}, b[0]));
      }
    });
    box.appendChild(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}));
    box.appendChild(svg("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle",
                                 class: "axis-label"}, xLabel));
  }

  // -- the views ------------------------------------------------------------------------------

  function xOf(row) { return state.xAxis === "time" ? row.time_s : row.version; }

  function renderCharts() {
    const rows = state.rows;
    const xLabel = state.xAxis === "time" ? "seconds (the run's clock)" : "version";
    const series = (key) => rows.filter((r) => isNum(r[key]) && isNum(xOf(r)))
      .map((r) => [xOf(r), r[key]]);
    lineChart(document.getElementById("chart-accuracy"), "Test accuracy",
              [{points: series("accuracy")}], {xLabel: xLabel, yMin: 0, yMax: 1});
    lineChart(document.getElementById("chart-loss"), "Test loss",
              [{points: series("loss")}], {xLabel: xLabel, yMin: 0});
    const rate = [];
    for (let i = 1; i < rows.length; i++) {
      const a = rows[i - 1], b = rows[i];
      const dt = b.time_s - a.time_s, du = b.updates - a.updates;
      if (isNum(dt) && isNum(du) && dt > 0) rate.push([xOf(b), du / dt]);
    }
    lineChart(document.getElementById("chart-rate"), "Updates per second", [{points: rate}],
              {xLabel: xLabel, yMin: 0, empty: "needs two versions"});
    const consensus = series("consensus_distance");
    const fig = document.getElementById("chart-consensus");
    fig.hidden = !consensus.length;
    if (consensus.length) {
      lineChart(fig, "Peer disagreement (consensus distance)", [{points: consensus}],
                {xLabel: xLabel, yMin: 0});
    }
  }

  function tile(label, value, alert) {
    const t = el("div", {class: "tile" + (alert ? " alert" : "")});
    t.appendChild(el("div", {class: "label"}, label));
    t.appendChild(el("div", {class: "value"}, value));
    return t;
  }

  // updates per second over the last ~10 s of posted snapshots (live), else the last rows
  function currentRate() {
    const s = state.snapsRate || [];
    if (s.length >= 2) {
      const a = s[0], b = s[s.length - 1];
      if (b.t > a.t) return (b.updates - a.updates) / ((b.t - a.t) / 1000);
    }
    const r = state.rows;
    if (r.length >= 2) {
      const a = r[Math.max(0, r.length - 6)], b = r[r.length - 1];
      if (b.time_s > a.time_s) return (b.updates - a.updates) / (b.time_s - a.time_s);
    }
    return null;
  }

  function renderTiles(snap) {
    const m = snap.metrics || {};
    const refused = sum(snap.refused_total);
    const started = snap.run && snap.run.started_unix;
    const tiles = [
      tile("version", fmt(snap.version)),
      tile("accuracy", isNum(m.accuracy) ? (100 * m.accuracy).toFixed(1) + " %" : "–"),
      tile("loss", fmt(m.loss)),
      tile(snap.role === "peer" ? "peers" : "clients active", fmt(snap.clients_active)),
      tile("updates", fmt(snap.updates_total)),
      tile("updates/s", fmt(currentRate())),
      tile("refused", fmt(refused), refused > 0),
      tile("bytes in", bytes(sum(snap.bytes_in_total))),
      tile("bytes out", bytes(snap.bytes_out_total)),
      snap.done ? tile("ran for", ago(m.time_s))
        : tile("running for", started ? ago(Date.now() / 1000 - started) : "–"),
    ];
    document.getElementById("tiles").replaceChildren(...tiles);
  }

  function renderHeader(snap) {
    const run = snap.run || {};
    const title = document.getElementById("run-title");
    title.replaceChildren(el("b", {}, run.name || "(unnamed run)"));
    const parts = [snap.role, run.mode && "mode " + run.mode, run.rule && "rule " + run.rule]
      .filter(Boolean);
    title.appendChild(document.createTextNode(" · " + parts.join(" · ")));
    title.title = run.dir || "";
    const badge = document.getElementById("status");
    let text = "live", cls = "badge-live";
    if (snap.done) { text = "finished"; cls = "badge-finished"; }
    else if (snap.source === "waiting") { text = "waiting"; cls = "badge-waiting"; }
    else if (snap.source === "files") { text = "from files"; cls = "badge-live"; }
    if (!state.connected && !snap.done) { text = "reconnecting"; cls = "badge-lost"; }
    badge.textContent = text;
    badge.className = "badge " + cls;
    document.getElementById("footer-source").textContent =
      snap.source === "files" ? "read from the run's files (per-client details are live only)"
        : "live from the " + (snap.role === "peer" ? "peer" : "aggregator");
  }

  function renderTier(snap) {
    const tier = snap.tier || {};
    const dl = document.getElementById("tier");
    const facts = [["workers", tier.workers], ["queue depth", tier.queue_depth],
                   ["cold starts", tier.cold_starts]];
    for (const [k, v] of Object.entries(tier)) {
      if (!["workers", "queue_depth", "cold_starts"].includes(k)) facts.push([k, v]);
    }
    dl.replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, fmt(v))]));
    const t0 = state.snaps.length ? state.snaps[0].t : 0;
    const pts = state.snaps.filter((s) => isNum(s.queue)).map((s) => [(s.t - t0) / 1000, s.queue]);
    lineChart(document.getElementById("chart-queue"), "Queue depth (this page's last minutes)",
              [{points: pts}], {xLabel: "seconds", yMin: 0, small: true});
  }

  function renderStaleness(snap) {
    const hist = snap.staleness_hist || {};
    const bars = Object.entries(hist).filter(([, v]) => isNum(v))
      .sort((a, b) => Number(a[0]) - Number(b[0]) || a[0].localeCompare(b[0]));
    barChart(document.getElementById("chart-staleness"), "Updates by staleness (versions behind)",
             bars, "staleness");
  }

  function renderRefusals(snap) {
    const body = document.querySelector("#refusals tbody");
    const entries = Object.entries(snap.refused_total || {}).sort((a, b) => b[1] - a[1]);
    if (!entries.length) {
      body.replaceChildren(el("tr", {}, null));
      body.firstChild.appendChild(el("td", {colspan: "2", class: "note"}, "none"));
      return;
    }
    body.replaceChildren(...entries.map(([reason, n]) => {
      const tr = el("tr");
      tr.appendChild(el("td", {}, reason));
      tr.appendChild(el("td", {class: "num"}, fmt(n)));
      return tr;
    }));
  }

  function compare(key, desc) {
    return (a, b) => {
      const x = a[key], y = b[key];
      let c;
      if (x === y) c = 0;
      else if (x === null || x === undefined) c = 1;
      else if (y === null || y === undefined) c = -1;
      else if (typeof x === "number" && typeof y === "number") c = x - y;
      else c = String(x).localeCompare(String(y));
      if (x !== null && x !== undefined && y !== null && y !== undefined && desc) c = -c;
      return c || String(a.client_id || a.peer_id || "").localeCompare(
        String(b.client_id || b.peer_id || ""));
    };
  }

  function markSorted(table, key, desc) {
    for (const th of table.querySelectorAll("th")) {
      th.classList.toggle("sorted-asc", th.dataset.key === key && !desc);
      th.classList.toggle("sorted-desc", th.dataset.key === key && desc);
    }
  }

  function renderClients(snap) {
    const table = document.getElementById("clients");
    const clients = (snap.clients || []).slice().sort(compare(state.sortKey, state.sortDesc));
    const shown = clients.slice(0, MAX_CLIENT_ROWS);
    const refused = clients.filter((c) => (c.refusals || 0) > 0).length;
    const total = Math.max(snap.clients_total || 0, clients.length);
    document.getElementById("clients-note").textContent = clients.length
      ? `${total} clients${refused ? `, ${refused} with refused updates` : ""}` +
        (shown.length < total ? ` (${shown.length} shown)` : "")
      : (snap.source === "files" ? "per-client details are shown while the run is live" : "");
    markSorted(table, state.sortKey, state.sortDesc);
    const body = table.querySelector("tbody");
    body.replaceChildren(...shown.map((c) => {
      const cls = [(c.refusals || 0) > 0 ? "refused" : "", c.active === false ? "inactive" : ""];
      const tr = el("tr", {class: cls.join(" ").trim(), "data-client": String(c.client_id)});
      tr.appendChild(el("td", {class: "id", title: String(c.client_id)}, c.client_id));
      tr.appendChild(el("td", {}, c.device || "–"));
      tr.appendChild(el("td", {class: "num"}, fmt(c.steps_per_s)));
      tr.appendChild(el("td", {class: "num"}, ago(c.last_seen_s_ago)));
      tr.appendChild(el("td", {class: "num"}, fmt(c.updates)));
      tr.appendChild(el("td", {class: "num"}, fmt(c.last_staleness)));
      tr.appendChild(el("td", {class: "num"}, isNum(c.weight) ? c.weight.toFixed(3) : "–"));
      tr.appendChild(el("td", {class: "num refusals"}, fmt(c.refusals)));
      tr.appendChild(el("td", {}, c.active === undefined ? "–" : c.active ? "yes" : "no"));
      return tr;
    }));
  }

  function renderPeers(snap) {
    const peers = snap.peers || [];
    const panel = document.getElementById("peers-panel");
    panel.hidden = !peers.length;
    if (!peers.length) return;
    const table = document.getElementById("peers");
    const keys = [];
    for (const p of peers.slice(0, 50)) {
      for (const k of Object.keys(p)) if (!keys.includes(k) && keys.length < 12) keys.push(k);
    }
    const head = table.querySelector("thead tr");
    if (head.dataset.keys !== keys.join("\u0000")) {
      head.dataset.keys = keys.join("\u0000");
      head.replaceChildren(...keys.map((k) => el("th", {"data-key": k}, k.replace(/_/g, " "))));
    }
    const key = state.peerSortKey || keys[0];
    markSorted(table, key, state.peerSortDesc);
    const rows = peers.slice().sort(compare(key, state.peerSortDesc)).slice(0, MAX_CLIENT_ROWS);
    table.querySelector("tbody").replaceChildren(...rows.map((p) => {
      const tr = el("tr");
      for (const k of keys) {
        const v = p[k];
        tr.appendChild(el("td", {class: isNum(v) ? "num" : ""},
                          typeof v === "object" && v !== null ? JSON.stringify(v) : fmt(v)));
      }
      return tr;
    }));
  }

  function render() {
    const snap = state.snapshot;
    if (!snap) return;
    renderHeader(snap);
    renderTiles(snap);
    renderCharts();
    renderTier(snap);
    renderStaleness(snap);
    renderRefusals(snap);
    renderClients(snap);
    renderPeers(snap);
  }

  // -- data -----------------------------------------------------------------------------------

  function takeSnapshot(snap) {
    // most updates leave the tables out (they come every few seconds): keep the last ones
    const last = state.snapshot || {};
    for (const key of ["clients", "peers", "clients_total", "peers_total"]) {
      if (!(key in snap) && key in last) snap[key] = last[key];
    }
    state.snapshot = snap;
    const now = Date.now();
    state.snaps.push({t: now, updates: snap.updates_total || 0,
                      queue: snap.tier ? snap.tier.queue_depth : null});
    while (state.snaps.length > 2 && now - state.snaps[0].t > 10 * 60 * 1000) state.snaps.shift();
    // the tile's rate: the last ~10 s
    state.snapsRate = state.snaps.filter((s) => now - s.t <= 10000);
  }

  function resetRows(generation) {
    state.rows = [];
    state.have = 0;
    state.generation = generation;
  }

  // `path` is the run's (under /runs/NAME for another run); `prefix` "" asks the root
  async function getJSON(path, prefix) {
    const url = (prefix === undefined ? base : prefix) + path;
    const r = await fetch(url, {credentials: "same-origin", cache: "no-store"});
    if (!r.ok) throw new Error(path + ": HTTP " + r.status);
    return r.json();
  }

  // Fetch rows from state.have on, page by page, until the server has no more.
  function fetchRows() {
    if (state.fetching) return state.fetching;
    state.fetching = (async () => {
      try {
        for (let pages = 0; pages < 50; pages++) {
          const ans = await getJSON("/api/metrics?since=" + state.have);
          if (ans.generation !== state.generation) resetRows(ans.generation);
          if (ans.from > state.have) { state.have = ans.from; }
          appendRows(ans.from, ans.rows);
          if (!ans.rows.length || state.have >= ans.total) break;
        }
      } finally {
        state.fetching = null;
      }
      render();
    })();
    return state.fetching;
  }

  function appendRows(from, rows) {
    const skip = state.have - from;
    if (skip < 0) return false;  // a gap: fetchRows fills it
    for (const row of rows.slice(skip)) state.rows.push(row);
    state.have = Math.max(state.have, from + rows.length);
    return true;
  }

  function onUpdate(msg) {
    if (msg.generation !== state.generation) {
      resetRows(msg.generation);
      takeSnapshot(msg.snapshot);
      fetchRows();
      return;
    }
    takeSnapshot(msg.snapshot);
    if (msg.rows && !appendRows(msg.rows_from, msg.rows)) fetchRows();
    else if (msg.rows_total > state.have && !msg.rows) fetchRows();
    render();
  }

  function connect() {
    const source = new EventSource(base + "/events");
    source.addEventListener("hello", (e) => {
      state.connected = true;
      stopPolling();
      const msg = JSON.parse(e.data);
      if (msg.generation !== state.generation) resetRows(msg.generation);
      takeSnapshot(msg.snapshot);
      render();
      fetchRows();
    });
    source.addEventListener("update", (e) => {
      state.connected = true;
      onUpdate(JSON.parse(e.data));
    });
    source.onerror = () => {
      state.connected = false;
      if (state.snapshot) renderHeader(state.snapshot);
      // refused (too many streams, 401) or gone: EventSource gives up; poll instead
      if (source.readyState === EventSource.CLOSED) startPolling();
    };
  }

  function startPolling() {
    if (state.polling) return;
    state.polling = setInterval(async () => {
      try {
        const snap = await getJSON("/api/snapshot");
        if (snap.generation !== state.generation) resetRows(snap.generation);
        takeSnapshot(snap);
        state.connected = true;
        await fetchRows();
      } catch (err) {
        state.connected = false;
        if (state.snapshot) renderHeader(state.snapshot);
      }
    }, 5000);
  }

  function stopPolling() {
    if (state.polling) clearInterval(state.polling);
    state.polling = null;
  }

  async function loadRuns() {
    try {
      const ans = await getJSON("/api/runs", "");
      const select = document.getElementById("runs");
      if (!ans.can_open || !ans.runs.length) return;
      const current = match ? decodeURIComponent(match[1]) : ans.current;
      select.replaceChildren(...ans.runs.map((r) => {
        const o = el("option", {value: r.name}, r.name + (r.finished ? "" : " (running)"));
        if (r.name === current) o.selected = true;
        return o;
      }));
      select.disabled = false;
      select.addEventListener("change", () => {
        location.href = "/runs/" + encodeURIComponent(select.value);
      });
    } catch (err) { /* the list is a convenience */ }
  }

  // -- wiring ---------------------------------------------------------------------------------

  function setAxis(axis) {
    state.xAxis = axis;
    document.getElementById("x-version").classList.toggle("on", axis === "version");
    document.getElementById("x-time").classList.toggle("on", axis === "time");
    renderCharts();
  }

  function sortable(tableId, onSort) {
    document.querySelector(`#${tableId} thead`).addEventListener("click", (e) => {
      const th = e.target.closest("th");
      if (th && th.dataset.key) { onSort(th.dataset.key); render(); }
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.getElementById("x-version").addEventListener("click", () => setAxis("version"));
    document.getElementById("x-time").addEventListener("click", () => setAxis("time"));
    sortable("clients", (key) => {
      state.sortDesc = state.sortKey === key ? !state.sortDesc : key !== "client_id";
      state.sortKey = key;
    });
    sortable("peers", (key) => {
      state.peerSortDesc = state.peerSortKey === key ? !state.peerSortDesc : false;
      state.peerSortKey = key;
    });
    connect();
    loadRuns();
  });
})();
