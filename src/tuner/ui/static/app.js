// tuner ui: live updates, caption edits and the charts. Our own code, no libraries.
"use strict";

async function postJSON(url, body) {
  const r = await fetch(url, {method: "POST", headers: {"Content-Type": "application/json"},
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
  const r = await fetch("/runs/check", {method: "POST", body: new FormData(form)});
  const result = await r.json();
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
      field.closest("details").open = true;
    }
  }
  return result;
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
      svg.append(svgEl("polyline", {points: d, fill: "none", stroke: s.color, "stroke-width": 1.5, class: "line"}));
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

function showMetrics(rows) {
  const train = rows.filter(r => r.loss !== null && r.loss !== undefined);
  const val = rows.filter(r => r.val_loss !== null && r.val_loss !== undefined);
  lineChart(document.getElementById("loss-chart"), [
    {points: train.map(r => [r.step, r.loss]), color: "#2b6cb0"},
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
    setText("stat-eta", duration(last.eta_seconds));
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
  const error = document.getElementById("job-error");
  error.hidden = !job.error;
  error.textContent = job.error || "";
  const log = document.getElementById("log");
  const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  log.textContent = job.log.join("\n");
  if (atEnd) log.scrollTop = log.scrollHeight;
  showMetrics(metrics);
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
