// tuner ui: live updates, caption edits, the form's helpers and the charts. Our own code, no libraries.
// No page holds inline script (the Content-Security-Policy allows only this file): every handler is
// attached here, from the elements' classes and data attributes.
"use strict";

// every request that changes something carries the session's CSRF token (see tuner/ui/auth.py)
const CSRF = document.querySelector('meta[name="csrf-token"]').content;

async function postJSON(url, body) {
  const r = await fetch(url, {method: "POST", headers: {"Content-Type": "application/json", "X-CSRF-Token": CSRF},
                              body: JSON.stringify(body)});
  const data = await r.json().catch(() => ({error: r.statusText}));
  if (!r.ok) throw new Error(data.error || data.detail || r.statusText);
  return data;
}

// ---------------------------------------------------------------- datasets

function thumbFailed(img) {
  const fig = img.closest(".item");
  fig.classList.add("bad");
  const note = document.createElement("span");
  note.className = "problem";
  note.textContent = "cannot be decoded";
  fig.querySelector("figcaption").prepend(note);
  img.remove();
}

async function saveCaption(button) {
  const fig = button.closest(".item");
  const status = fig.querySelector(".saved");
  status.textContent = "saving…";
  try {
    await postJSON("/api/caption", {path: fig.dataset.path, text: fig.querySelector(".caption").value});
    status.textContent = "saved";
  } catch (e) {
    status.textContent = e.message;
  }
}

// ---------------------------------------------------------------- new-run form

let checkTimer = null;

function watchForm() {
  const form = document.getElementById("run-form");
  form.addEventListener("input", () => {
    clearTimeout(checkTimer);
    checkTimer = setTimeout(checkForm, 700);
  });
}

async function checkForm() {
  const form = document.getElementById("run-form");
  const r = await fetch("/runs/check", {method: "POST", body: new FormData(form), headers: {"X-CSRF-Token": CSRF}});
  const result = await r.json();
  if (!r.ok) result.message = result.error;
  const box = document.getElementById("check");
  box.textContent = result.message;
  box.className = result.ok ? "ok" : "error";
  document.getElementById("toml-preview").textContent = result.toml;
  for (const el of form.querySelectorAll(".field-error")) el.textContent = "";
  for (const el of form.querySelectorAll(".field.invalid")) el.classList.remove("invalid");
  if (!result.ok && result.key) {
    const field = form.querySelector(`.field[data-key="${result.key}"]`);
    if (field) {
      field.classList.add("invalid");
      field.querySelector(".field-error").textContent = result.message;
      for (let d = field.closest("details"); d; d = d.parentElement.closest("details")) d.open = true;
    }
  }
  return result;
}

// Only the model keys the chosen architecture uses are shown (and sent); a key it does not use that holds a
// value stays, so the loader names it.
function showArchitecture() {
  const arch = document.getElementById("model.architecture").value;
  const used = JSON.parse(document.getElementById("model-keys").textContent)[arch] || [];
  for (const field of document.querySelectorAll('.field[data-key^="model."]')) {
    const input = field.querySelector("input:not([type=hidden]), select");
    const keep = used.includes(field.dataset.key) || (input && input.value !== "" && input.type !== "checkbox");
    field.hidden = !keep;
    for (const el of field.querySelectorAll("input, select")) el.disabled = !keep;
  }
  const box = document.getElementById("downloads");
  const downloads = JSON.parse(document.getElementById("downloads-data").textContent)[arch] || [];
  box.hidden = !downloads.length;
  box.replaceChildren(Object.assign(document.createElement("b"), {textContent: "Download the weights: "}));
  for (const d of downloads) {
    const line = document.createElement("div");
    line.append(Object.assign(document.createElement("code"), {textContent: d.command}), ` (${d.source})`);
    box.append(line);
  }
}

// ---------------------------------------------------------------- file picker (the roots only)

let pickerTarget = null;

async function pickerOpen(path) {
  const r = await fetch("/api/browse?path=" + encodeURIComponent(path));
  const data = await r.json();
  const list = document.getElementById("picker-list");
  list.replaceChildren();
  if (!r.ok) { list.append(Object.assign(document.createElement("li"), {textContent: data.error})); return; }
  document.getElementById("picker-path").textContent = data.path || "the folders this UI may use";
  document.getElementById("picker-here").dataset.path = data.path;
  const entries = data.path ? [{name: "..", path: data.parent, dir: true}, ...data.entries] : data.entries;
  for (const e of entries) {
    const a = Object.assign(document.createElement("a"), {href: "#", textContent: e.name + (e.dir ? "/" : "")});
    a.className = "picker-entry";
    a.dataset.path = e.path;
    a.dataset.dir = e.dir ? "1" : "";
    const li = document.createElement("li");
    li.append(a);
    list.append(li);
  }
}

function pickerChoose(path) {
  const input = document.getElementById(pickerTarget);
  input.value = path;
  input.dispatchEvent(new Event("input", {bubbles: true}));
  document.getElementById("picker").close();
}

// ---------------------------------------------------------------- charts (SVG)

const SVG = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function fmt(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  return a >= 1e4 || a < 1e-2 ? v.toExponential(1) : v.toPrecision(3);
}

// series: [{points: [[x, y], ...], color, dots}]; draws axes with min / max ticks and each series.
function lineChart(svg, series) {
  svg.replaceChildren();
  const W = 520, H = 240, L = 60, R = 10, T = 10, B = 30;
  const all = series.flatMap(s => s.points).filter(p => Number.isFinite(p[1]));
  if (!all.length) {
    svg.append(svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, "no data yet"));
    return;
  }
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  svg.append(svgEl("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}));
  svg.append(svgEl("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}));
  svg.append(svgEl("text", {x: L - 4, y: T + 8, "text-anchor": "end", class: "tick"}, fmt(y1)));
  svg.append(svgEl("text", {x: L - 4, y: H - B, "text-anchor": "end", class: "tick"}, fmt(y0)));
  svg.append(svgEl("text", {x: L, y: H - 10, class: "tick"}, "step " + x0));
  svg.append(svgEl("text", {x: W - R, y: H - 10, "text-anchor": "end", class: "tick"}, "step " + x1));
  for (const s of series) {
    const pts = s.points.filter(p => Number.isFinite(p[1]));
    if (!pts.length) continue;
    if (s.dots || pts.length === 1) {
      for (const p of pts) svg.append(svgEl("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 3, fill: s.color}));
    }
    if (pts.length > 1 && !s.dots) {
      const d = pts.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
      svg.append(svgEl("polyline", {points: d, fill: "none", stroke: s.color, "stroke-width": 1.5,
                                    class: "line " + (s.cls || "")}));
    }
  }
}

// ---------------------------------------------------------------- job page

function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.round(seconds);
  return s >= 3600 ? `${Math.floor(s / 3600)}h ${Math.floor(s % 3600 / 60)}m`
       : s >= 60 ? `${Math.floor(s / 60)}m ${s % 60}s` : `${s}s`;
}

function setText(id, text) { document.getElementById(id).textContent = text; }

// An exponential moving average of the loss (TensorBoard's smoothing, debiased so the start is not pulled
// toward 0): the trend a per-step loss, noisy by the timestep drawn, hides.
function smoothed(points, weight = 0.9) {
  let avg = 0, n = 0;
  return points.map(([x, y]) => {
    avg = weight * avg + (1 - weight) * y;
    n += 1;
    return [x, avg / (1 - Math.pow(weight, n))];
  });
}

function showMetrics(rows, running) {
  const train = rows.filter(r => r.loss !== null && r.loss !== undefined);
  const val = rows.filter(r => r.val_loss !== null && r.val_loss !== undefined);
  const loss = train.map(r => [r.step, r.loss]);
  lineChart(document.getElementById("loss-chart"), [
    {points: loss, color: "#90cdf4", cls: "raw"},
    {points: smoothed(loss), color: "#2b6cb0", cls: "smoothed"},
    {points: val.map(r => [r.step, r.val_loss]), color: "#dd6b20", dots: val.length < 50},
  ]);
  lineChart(document.getElementById("lr-chart"),
            [{points: train.filter(r => r.lr !== undefined).map(r => [r.step, r.lr]), color: "#2f855a"}]);
  const last = train[train.length - 1];
  if (last) {
    setText("stat-step", last.step);
    setText("stat-loss", fmt(last.loss));
    setText("stat-lr", last.lr === undefined ? "–" : fmt(last.lr));
    setText("stat-time", last.step_seconds ? last.step_seconds.toFixed(2) + " s" : "–");
    setText("stat-eta", running ? duration(last.eta_seconds) : "–");  // a stopped job has no ETA
  }
  if (val.length) setText("stat-val", fmt(val[val.length - 1].val_loss));
}

function mediaFor(sample) {
  const url = "/file?path=" + encodeURIComponent(sample.path);
  if (sample.path.endsWith(".mp4") || sample.path.endsWith(".webm")) {
    return Object.assign(document.createElement("video"), {src: url, controls: true, loop: true, muted: true});
  }
  return Object.assign(document.createElement("img"), {src: url, alt: sample.prompt, loading: "lazy"});
}

function showSamples(samples) {
  const box = document.getElementById("samples");
  if (box.dataset.count === String(samples.length)) return;  // nothing new: keep videos playing
  box.dataset.count = samples.length;
  box.replaceChildren();
  const steps = [...new Set(samples.map(s => s.step))].sort((a, b) => b - a);
  for (const step of steps) {
    const row = document.createElement("div");
    row.className = "sample-step";
    row.append(Object.assign(document.createElement("h3"), {textContent: `step ${step}`}));
    for (const s of samples.filter(x => x.step === step)) {
      const fig = document.createElement("figure");
      fig.className = "sample";
      fig.append(mediaFor(s), Object.assign(document.createElement("figcaption"), {textContent: s.prompt}));
      row.append(fig);
    }
    box.append(row);
  }
}

async function refreshJob(id) {
  const [job, metrics, samples] = await Promise.all([
    fetch(`/api/jobs/${id}?lines=200`).then(r => r.json()),
    fetch(`/api/jobs/${id}/metrics`).then(r => r.json()),
    fetch(`/api/jobs/${id}/samples`).then(r => r.json()),
  ]);
  setText("job-state", job.state);
  for (const form of document.querySelectorAll(".job-actions form")) {
    form.hidden = !form.dataset.states.split(" ").includes(job.state);
  }
  setText("job-stage", job.stage || "");
  setText("job-ranks", job.ranks_text);
  const error = document.getElementById("job-error");
  error.hidden = !job.error;
  error.textContent = job.error || "";
  const log = document.getElementById("log");
  const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  log.textContent = job.log.join("\n");
  if (atEnd) log.scrollTop = log.scrollHeight;
  showMetrics(metrics, job.state === "running");
  showSamples(samples);
  return job;
}

function watchJob(id) {
  const tick = async () => {
    try { await refreshJob(id); } catch (e) { /* the server restarts: try again */ }
    setTimeout(tick, 2000);
  };
  tick();
}

// ---------------------------------------------------------------- adapters

async function convertAdapter(button) {
  const out = button.parentElement.querySelector(".result");
  const to = button.parentElement.querySelector(".convert-to").value;
  out.textContent = "converting…";
  try {
    const r = await postJSON("/api/adapters/convert", {path: button.dataset.path, to});
    out.textContent = `wrote ${r.path}: ${r.modules} modules in the ${r.layout} layout`;
  } catch (e) { out.textContent = e.message; }
}

async function mergeAdapter(button) {
  const form = button.closest("#merge-form");
  const out = form.querySelector(".result");
  const value = cls => form.querySelector(cls).value;
  out.textContent = "merging…";
  try {
    const r = await postJSON("/api/adapters/merge", {
      model: value(".merge-model"), out: value(".merge-out"),
      loras: [[value(".merge-lora"), parseFloat(value(".merge-strength"))]],
    });
    out.textContent = `wrote ${r.path}`;
  } catch (e) { out.textContent = e.message; }
}

// ---------------------------------------------------------------- wiring (no inline handlers)

document.addEventListener("click", event => {
  const el = event.target.closest("button, a");
  if (!el) return;
  if (el.matches(".save-caption")) saveCaption(el);
  else if (el.matches(".convert")) convertAdapter(el);
  else if (el.matches(".merge")) mergeAdapter(el);
  else if (el.matches("#check-button")) checkForm();
  else if (el.matches(".pick")) {
    pickerTarget = el.dataset.for;
    const current = document.getElementById(pickerTarget).value;
    document.getElementById("picker").showModal();
    pickerOpen(current.includes("/") ? current.replace(/\/[^/]*$/, "") : "").catch(() => pickerOpen(""));
  } else if (el.matches(".picker-entry")) {
    event.preventDefault();
    if (el.dataset.dir) pickerOpen(el.dataset.path); else pickerChoose(el.dataset.path);
  } else if (el.matches("#picker-here") && el.dataset.path) pickerChoose(el.dataset.path);
  else if (el.matches("#picker-close")) document.getElementById("picker").close();
});

document.addEventListener("submit", event => {
  const message = event.target.dataset.confirm;
  if (message && !confirm(message)) event.preventDefault();
});

document.addEventListener("change", event => {
  if (event.target.matches("select[data-autosubmit]")) event.target.form.submit();
  if (event.target.id === "model.architecture") showArchitecture();
});

// a thumbnail that fails to load says so (error events do not bubble: caught on the way down)
document.addEventListener("error", event => {
  if (event.target.matches && event.target.matches("img.thumb")) thumbFailed(event.target);
}, true);

if (document.body.dataset.job) watchJob(document.body.dataset.job);
if (document.body.dataset.page === "new-run") {
  watchForm();
  showArchitecture();
}
