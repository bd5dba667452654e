// The explorer's page: sends the controls' commands and draws what the server sends.
// Nothing here computes the run's state: every cell, figure and pixel came from a rank.
"use strict";
const $ = (id) => document.getElementById(id);
const COLOURS = [[66, 133, 244], [234, 67, 53], [52, 168, 83], [251, 188, 5]];
let state = null;
let formSeed = null; // the run whose settings the form shows: a user's edits survive its updates
const ws = new WebSocket(`ws://${location.host}/ws`);

function send(cmd) { ws.send(JSON.stringify(cmd)); }
function settingsFromForm() {
  return {
    ranks: Number($("set-ranks").value),
    strategy: $("set-strategy").value,
    mixed_precision: $("set-mixed_precision").value,
    cpu_offload: $("set-cpu_offload").checked,
    activation_checkpointing: $("set-activation_checkpointing").checked,
    comm: $("set-comm").value,
  };
}
$("reset").onclick = () => { $("message").textContent = ""; send({ cmd: "reset", settings: settingsFromForm() }); };
$("train").onclick = () => send({ cmd: "train" });
$("pause").onclick = () => send({ cmd: "pause" });
$("step").onclick = () => send({ cmd: "step" });
$("speed").oninput = () => send({ cmd: "speed", delay_ms: Number($("speed").value) });

ws.onmessage = (e) => {
  const m = JSON.parse(e.data);
  if (m.type === "state") { state = m; draw(); }
  else if (m.type === "event" && state) { onEvent(m); }
  else if (m.type === "message") { $("message").textContent = m.text; }
};
ws.onclose = () => { $("status").textContent = "server gone"; };

function onEvent(m) {
  const r = state.ranks[m.rank];
  if (m.cell) r.cells[m.unit] = m.cell;
  if (m.cells) r.cells = m.cells;
  if ("optimizer" in m) r.optimizer = m.optimizer;
  r.event = m.event;
  drawRank(m.rank);
}

function fmt(n) { return n == null ? "-" : Number(n).toLocaleString("en-US"); }
function pct(measured, predicted) {
  if (!predicted) return "-";
  const e = (100 * (measured - predicted)) / predicted;
  return (e >= 0 ? "+" : "") + e.toFixed(1) + "%";
}

function draw() {
  const s = state;
  $("counter").textContent = `Step ${s.stage} / ${s.stages}`;
  $("seed").textContent = s.seed;
  $("status").textContent = s.status;
  $("nranks").textContent = s.ranks.length;
  $("machine").textContent = s.machine || "-";
  $("speed").value = s.delay_ms;
  $("delay").textContent = s.delay_ms ? `${s.delay_ms} ms after each event` : "no delay";
  if (s.seed !== formSeed) {
    formSeed = s.seed;
    for (const [k, v] of Object.entries(s.settings)) {
      const el = $("set-" + k);
      if (el.type === "checkbox") el.checked = v; else el.value = v;
    }
  }
  drawGrid();
  drawFigures();
  drawRegions();
  drawLoss();
}

function drawGrid() {
  const s = state, grid = $("grid");
  grid.innerHTML = "";
  const head = grid.insertRow();
  head.appendChild(document.createElement("th"));
  for (const u of s.units) { const th = document.createElement("th"); th.textContent = u; th.style.textAlign = "center"; head.appendChild(th); }
  const th = document.createElement("th"); th.textContent = "last event"; th.style.textAlign = "left"; head.appendChild(th);
  s.ranks.forEach((r, i) => {
    const row = grid.insertRow();
    row.id = "rank-" + i;
    const name = row.insertCell(); name.textContent = "rank " + i;
    s.units.forEach(() => { const td = row.insertCell(); td.className = "cell"; });
    row.insertCell().className = "event";
    drawRank(i);
  });
  $("ranks").innerHTML = s.ranks.filter((r) => !r.alive).map((r) =>
    `<div class="dead" id="dead-${r.rank}">rank ${r.rank} is dead: <pre style="white-space: pre-wrap">${escape(r.error)}</pre></div>`).join("");
}

function escape(t) { return String(t).replace(/[&<>]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;" })[c]); }

function drawRank(i) {
  const r = state.ranks[i], row = $("rank-" + i);
  if (!row) return;
  row.className = r.optimizer ? "optimizer" : "";
  r.cells.forEach((c, u) => {
    const td = row.cells[u + 1];
    if (!td) return;
    td.className = ["cell", c.params, c.compute, c.reducing ? "reducing" : ""].filter(Boolean).join(" ");
    td.textContent = c.compute ? c.compute : c.params;
  });
  const label = row.cells[row.cells.length - 1];
  label.textContent = r.alive ? (r.optimizer ? "optimizer step" : r.event || "") : "dead";
  label.className = "event" + (r.alive ? "" : " dead");
}

function drawFigures() {
  const s = state, measured = s.ranks.map((r) => r.measured);
  const mem = $("memory");
  mem.innerHTML = "<tr><th></th>" + s.ranks.map((r) => `<th>rank ${r.rank}</th>`).join("") + "<th>DDP rank</th></tr>";
  for (const [kind, ddp] of [["params", "ddp_params"], ["grads", "ddp_grads"], ["optimizer", "ddp_optimizer"]]) {
    mem.innerHTML += `<tr><th>${kind}</th>` + measured.map((m) => `<td>${fmt(m && m.held[kind])}</td>`).join("") +
      `<td>${fmt(measured[0] && measured[0].held[ddp])}</td></tr>`;
  }
  for (const kind of ["gathered", "activations"]) {
    mem.innerHTML += `<tr><th>${kind} at peak</th>` + measured.map((m) => `<td>${fmt(m && m.at_peak[kind])}</td>`).join("") + "<td></td></tr>";
  }
  const by = $("bytes");
  by.innerHTML = "<tr><th></th>" + s.ranks.map((r) => `<th>rank ${r.rank}</th>`).join("") + "</tr>" +
    "<tr><th>sent</th>" + measured.map((m) => `<td>${fmt(m && m.bytes_per_step)}</td>`).join("") + "</tr>" +
    "<tr><th>theory</th>" + measured.map((m) => `<td>${fmt(m && m.theory_per_step)}</td>`).join("") + "</tr>";
  const p = s.plan, plan = $("plan");
  if (!p) { plan.innerHTML = "<tr><td>waiting for the ranks</td></tr>"; return; }
  const peak = Math.max(...measured.map((m) => (m ? m.peak : 0)));
  const sent = Math.max(...measured.map((m) => (m ? m.bytes_per_step : 0)));
  const have = measured.every(Boolean);
  plan.innerHTML = "<tr><th></th><th>predicted</th><th>measured</th><th>error</th></tr>" +
    `<tr><th>peak memory (largest rank)</th><td>${fmt(p.peak)}</td><td>${have ? fmt(peak) : "after stage 1"}</td><td>${have ? pct(peak, p.peak) : ""}</td></tr>` +
    `<tr><th>bytes sent per step</th><td>${fmt(p.bytes_per_step)}</td><td>${have ? fmt(sent) : "after stage 1"}</td><td>${have ? pct(sent, p.bytes_per_step) : ""}</td></tr>`;
}

function drawRegions() {
  const c = $("regions"), g = c.getContext("2d"), s = state;
  g.clearRect(0, 0, c.width, c.height);
  if (!s.grid) return;
  const n = s.grid.size, cell = c.width / n, ext = s.grid.extent;
  for (let i = 0; i < n * n; i++) {
    const [r, gr, b] = COLOURS[s.grid.classes[i]], a = 0.15 + 0.45 * s.grid.confidence[i];
    g.fillStyle = `rgba(${r},${gr},${b},${a})`;
    g.fillRect((i % n) * cell, Math.floor(i / n) * cell, cell + 0.5, cell + 0.5);
  }
  for (const [x, y, k] of s.points) {
    const [r, gr, b] = COLOURS[k];
    g.beginPath();
    g.arc(((x + ext) / (2 * ext)) * c.width, ((ext - y) / (2 * ext)) * c.height, 3.2, 0, 2 * Math.PI);
    g.fillStyle = `rgb(${r},${gr},${b})`;
    g.fill();
    g.strokeStyle = "#fff";
    g.stroke();
  }
  $("accuracy").textContent = (100 * s.grid.accuracy).toFixed(1) + "%";
}

function drawLoss() {
  const c = $("loss"), g = c.getContext("2d"), s = state, total = s.stages * s.steps_per_stage;
  g.clearRect(0, 0, c.width, c.height);
  g.strokeStyle = "#c5ccd6";
  g.strokeRect(30, 5, c.width - 35, c.height - 25);
  g.fillStyle = "#4a5568";
  g.font = "11px sans-serif";
  g.fillText("0", 18, c.height - 20);
  g.fillText("step " + total, c.width - 50, c.height - 6);
  if (!s.loss.length) return;
  const top = Math.max(...s.loss);
  g.fillText(top.toFixed(2), 2, 14);
  g.beginPath();
  s.loss.forEach((v, i) => {
    const x = 30 + ((i + 1) / total) * (c.width - 35), y = 5 + (1 - v / top) * (c.height - 25);
    if (i) g.lineTo(x, y); else g.moveTo(x, y);
  });
  g.strokeStyle = "#1d4f91";
  g.lineWidth = 2;
  g.stroke();
  g.lineWidth = 1;
}
