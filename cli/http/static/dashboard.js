// ringq dashboard: polls /api/overview, /api/jobs and /api/batches every second on `/`; on
// `/jobs/<id>` follows one job through its SSE stream (/api/jobs/<id>/events).
"use strict";

const POLL_MS = 1000;
const PHASES = ["queued", "admitted", "loading", "prefill", "decode"];
const FINAL = new Set(["finished", "failed", "cancelled"]);
const samples = new Map(); // job id -> {phase, processed, at}: for decode tok/s and ETA
const seenPhases = new Map(); // phase -> unix s when this page first saw the job in it

const $ = (selector) => document.querySelector(selector);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child ?? "")));
  }
  return node;
}

async function getJSON(path, options = {}) {
  const response = await fetch(path, { credentials: "same-origin", ...options });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
  return body;
}

function showError(error) {
  const box = $("#error");
  box.hidden = !error;
  box.textContent = error ? String(error.message || error) : "";
}

const gib = (bytes) => `${(bytes / 1024 ** 3).toFixed(2)} GiB`;
const clock = (unix) => new Date(unix * 1000).toLocaleTimeString();

function duration(seconds) {
  if (seconds == null || !isFinite(seconds)) return "-";
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  const mm = h ? String(m).padStart(2, "0") : String(m);
  return (h ? `${h}:` : "") + `${mm}:${String(r).padStart(2, "0")}`;
}

function stateBadge(state) {
  return el("span", { class: `state ${state}` }, state);
}

// tok/s: the job's own prefill rate, else the rate between this page's last two samples.
function rateOf(job) {
  const p = job.progress;
  if (p.phase === "prefill" && p.prompt_tps > 0) return p.prompt_tps;
  if (p.phase === "decode" && p.generation_tps > 0) return p.generation_tps;
  const last = samples.get(job.id);
  let rate = last && last.rate;
  if (last && last.phase === p.phase && p.processed > last.processed && p.updated_at > last.at) {
    rate = (p.processed - last.processed) / (p.updated_at - last.at);
  } else if (!last || last.phase !== p.phase) {
    rate = null;
  }
  if (!last || p.updated_at !== last.at) {
    samples.set(job.id, { phase: p.phase, processed: p.processed, at: p.updated_at, rate });
  }
  return rate;
}

// A model path's last part, the whole path on hover: long paths kept the progress and Cancel
// columns off a 1280-px screen.
function modelCell(model) {
  if (!model) return el("td", {}, "-");
  const short = model.includes("/") ? model.split("/").filter(Boolean).pop() : model;
  return el("td", { class: "model", title: model }, short);
}

function progressBar(job) {
  const p = job.progress;
  const total = Math.max(p.total, 1);
  const done = job.state === "finished" ? total : Math.min(p.processed, total);
  const pct = (100 * done) / total;
  const rate = FINAL.has(job.state) ? null : rateOf(job);
  const eta = job.eta_s ?? (rate ? (p.total - p.processed) / rate : null);
  let label = `${p.phase} ${p.processed}/${p.total} tok`;
  if (rate) label += ` · ${rate.toFixed(0)} tok/s`;
  if (!FINAL.has(job.state) && eta != null) label += ` · ETA ${duration(eta)}`;
  return el(
    "div",
    { class: `progress ${job.state}`, "data-processed": p.processed, "data-total": p.total },
    el("div", { class: "fill", style: `width:${pct.toFixed(1)}%` }),
    el("span", { class: "label" }, label),
  );
}

function placementText(placement) {
  if (!placement) return "not placed";
  return `${placement.strategy}-${placement.ranks} on ${placement.nodes.join(", ")}`;
}

function cancelButton(jobId, state, after) {
  const button = el("button", { class: "cancel", "data-job-id": jobId }, "Cancel");
  button.hidden = FINAL.has(state);
  button.onclick = async () => {
    button.disabled = true;
    try {
      await getJSON(`/api/jobs/${encodeURIComponent(jobId)}/cancel`, { method: "POST" });
      showError(null);
    } catch (error) {
      showError(error);
    }
    if (after) after();
  };
  return button;
}

function fillTable(selector, rows, columns) {
  const body = $(`${selector} tbody`);
  if (!rows.length) {
    body.replaceChildren(el("tr", {}, el("td", { class: "empty", colSpan: columns }, "none")));
    return;
  }
  body.replaceChildren(...rows);
}

function renderNodes(overview) {
  const now = Date.now() / 1000;
  const rows = overview.nodes.map((n) =>
    el("tr", {},
      el("td", {}, n.name), el("td", {}, n.device || n.backend), el("td", {}, n.address),
      el("td", {}, gib(n.memory_bytes)), el("td", {}, gib(n.reserved_bytes)),
      el("td", {}, gib(n.free_bytes ?? n.available_bytes)), el("td", {}, `${(now - n.heartbeat_at).toFixed(1)} s ago`)),
  );
  fillTable("#nodes", rows, 7);
  const groups = [...overview.running_groups, ...overview.warm_groups].map((g) =>
    el("tr", {},
      el("td", { class: "mono" }, g.group_id), el("td", {}, stateBadge(g.state)),
      modelCell(g.model), el("td", {}, `${g.strategy} (${g.kv_layout} KV)`),
      el("td", {}, g.nodes.join(", ")), el("td", {}, (g.devices || []).join(", ") || "-"),
      el("td", {}, g.state === "running" ? jobLink(g.job_id) : "-")),
  );
  fillTable("#groups", groups, 7);
}

function jobLink(jobId) {
  return el("a", { href: `/jobs/${encodeURIComponent(jobId)}`, class: "mono" }, jobId);
}

function renderJobs(jobs) {
  const rows = jobs.map((job) =>
    el("tr", { "data-job-id": job.id },
      el("td", {}, jobLink(job.id)), el("td", {}, job.kind), modelCell(job.model),
      el("td", {}, stateBadge(job.state)), el("td", {}, progressBar(job), waitingNote(job)),
      el("td", {}, placementText(job.placement)), el("td", {}, clock(job.created_at)),
      el("td", {}, cancelButton(job.id, job.state, refreshLists))),
  );
  fillTable("#jobs", rows, 8);
}

function waitingNote(job) {
  const waiting = job.state === "queued" && job.waiting_reason;
  return waiting ? el("div", { class: "note" }, `waiting: ${job.waiting_reason}`) : "";
}

function renderBatches(batches) {
  const rows = batches.map((b) => {
    const c = b.counts;
    const status = b.openai_status || (c.done === c.total ? "completed" : "in_progress");
    return el("tr", { "data-batch-id": b.id },
      el("td", { class: "mono" }, b.id), el("td", {}, b.input_name), el("td", {}, stateBadge(status)),
      el("td", {}, `${c.done}/${c.total}`), el("td", {}, c.queued), el("td", {}, c.running),
      el("td", {}, c.completed), el("td", {}, c.failed), el("td", {}, c.cancelled),
      el("td", {}, clock(b.created_at)));
  });
  fillTable("#batches", rows, 10);
}

function jobQuery() {
  const form = new FormData($("#filters"));
  const query = new URLSearchParams();
  for (const [name, value] of form) if (value) query.set(name, value);
  return query.toString();
}

let refreshing = false;
async function refreshLists() {
  if (refreshing) return;
  refreshing = true;
  try {
    const [overview, jobs, batches] = await Promise.all([
      getJSON("/api/overview"), getJSON(`/api/jobs?${jobQuery()}`), getJSON("/api/batches"),
    ]);
    renderNodes(overview);
    renderJobs(jobs.data);
    renderBatches(batches.data);
    $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    showError(null);
  } catch (error) {
    showError(error);
  } finally {
    refreshing = false;
  }
}

// ---- one job's page ----

// When each phase began: from the result's timings once there is a result, else as seen here.
function phaseTimes(job) {
  const times = { queued: job.created_at, ...Object.fromEntries(seenPhases) };
  if (job.admitted_at) times.admitted = job.admitted_at;
  const r = job.result;
  if (r && r.prefill_started_at) {
    times.loading = r.prefill_started_at - r.load_s;
    times.prefill = r.prefill_started_at;
    if (job.kind === "generate") times.decode = r.prefill_started_at + r.prefill_s;
  }
  return times;
}

function renderTimeline(job) {
  if (!seenPhases.has(job.state)) seenPhases.set(job.state, job.updated_at);
  const times = phaseTimes(job);
  const reached = FINAL.has(job.state) ? PHASES.length : PHASES.indexOf(job.state);
  const items = PHASES.map((phase, i) => {
    let cls = i < reached ? "done" : i === reached ? "current" : "";
    if (phase === "decode" && job.kind === "prefill") cls = "skipped";
    if (FINAL.has(job.state) && times[phase] == null && phase !== "admitted") cls += " skipped";
    const when = times[phase] != null ? clock(times[phase]) : "";
    return el("li", { class: cls, "data-phase": phase }, phase, el("span", { class: "when" }, when));
  });
  const endCls = job.state === "finished" ? "done" : FINAL.has(job.state) ? "ended-bad" : "";
  const end = FINAL.has(job.state) ? job.state : "finished";
  items.push(el("li", { class: endCls, "data-phase": end }, end,
    el("span", { class: "when" }, FINAL.has(job.state) ? clock(job.updated_at) : "")));
  $("#timeline").replaceChildren(...items);
}

function renderDetails(job) {
  const pairs = [
    ["kind", job.kind], ["model", job.spec ? job.spec.model : ""],
    ["document", job.spec ? `${job.spec.document_name} (${job.spec.document_chars} chars)` : ""],
    ["prompt", job.spec ? job.spec.prompt ?? "(default: summarise the document)" : ""],
    ["max tokens", job.spec ? job.spec.max_tokens : ""],
    ["placement", placementText(job.placement) +
      (job.placement && job.placement.reason ? ` (${job.placement.reason})` : "")],
    ["waiting", job.waiting_reason || "-"], ["error", job.error || "-"],
  ];
  const r = job.result;
  if (r) {
    pairs.push(["prompt tokens", `${r.prompt_tokens} at ${r.prompt_tps.toFixed(1)} tok/s` +
      (r.cached_tokens ? ` (${r.cached_tokens} from a kept cache)` : "")]);
    pairs.push(["generated", `${r.generated_tokens} tok at ${r.generation_tps.toFixed(1)} tok/s`]);
    pairs.push(["times", `load ${r.load_s.toFixed(2)} s · prefill ${r.prefill_s.toFixed(2)} s · ` +
      `decode ${r.decode_s.toFixed(2)} s`]);
  }
  $("#job-details").replaceChildren(...pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  $("#job-result").textContent = resultText(job);
}

function resultText(job) {
  const r = job.result;
  if (!r) return job.error ? `(${job.state}: no result)` : "(no result yet)";
  if (r.text == null) return "(a prefill job generates no text)";
  return r.text || "(empty: the model generated no text)";
}

function renderJob(job) {
  $("#job-state").replaceChildren(stateBadge(job.state));
  $("#job-progress").replaceChildren(progressBar(job));
  $("#job-cancel").hidden = FINAL.has(job.state);
  renderTimeline(job);
}

async function showJob(jobId) {
  $("#job").hidden = false;
  $("#job-id").textContent = jobId;
  const button = cancelButton(jobId, "queued");
  button.id = "job-cancel";
  $("#job-cancel").replaceWith(button);
  let job = await getJSON(`/api/jobs/${encodeURIComponent(jobId)}`);
  renderJob(job);
  renderDetails(job);
  if (FINAL.has(job.state)) return;
  const events = new EventSource(`/api/jobs/${encodeURIComponent(jobId)}/events`);
  events.addEventListener("progress", (event) => {
    job = { ...job, ...JSON.parse(event.data) };
    renderJob(job);
  });
  let streamed = "";
  events.addEventListener("text", (event) => {
    streamed += JSON.parse(event.data).text;
    $("#job-result").textContent = streamed;
  });
  events.addEventListener("end", async () => {
    events.close();
    job = await getJSON(`/api/jobs/${encodeURIComponent(jobId)}`);
    renderJob(job);
    renderDetails(job);
  });
  events.onerror = () => showError("lost the job's event stream; reload to follow it again");
}

function start() {
  const match = location.pathname.match(/^\/jobs\/(.+)$/);
  if (match) {
    showJob(decodeURIComponent(match[1])).catch(showError);
    return;
  }
  $("#lists").hidden = false;
  $("#filters").addEventListener("input", refreshLists);
  $("#filters").addEventListener("submit", (event) => event.preventDefault());
  refreshLists();
  setInterval(refreshLists, POLL_MS);
}

document.addEventListener("DOMContentLoaded", start);
