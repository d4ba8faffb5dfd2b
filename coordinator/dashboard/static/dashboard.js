// The dashboard's behaviour: polls the JSON API and redraws tables and inline SVG charts (no libraries).
"use strict";

const POLL_MILLISECONDS = 1500;
const SVG_NS = "http://www.w3.org/2000/svg";
const COLOURS = ["#d1495b", "#edae49", "#00798c", "#30638e", "#8d6a9f", "#66a182", "#b56576", "#6c757d"];
const TOKEN = new URLSearchParams(location.hash.slice(1)).get("token");
let chosenRound = null;  // the divergence round the user picked; null follows the latest

async function getJson(path) {
  const headers = TOKEN ? {Authorization: "Bearer " + TOKEN} : {};
  const response = await fetch(path, {headers, cache: "no-store"});
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

function element(tag, attributes = {}, text = null, namespace = null) {
  const node = namespace ? document.createElementNS(namespace, tag) : document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text !== null) node.textContent = text;
  return node;
}

function svg(tag, attributes = {}, text = null) {
  return element(tag, attributes, text, SVG_NS);
}

function cell(row, text, className = null) {
  const td = element("td", className ? {class: className} : {}, text);
  row.appendChild(td);
  return td;
}

function fixed(value, digits = 3) {
  return value === null || value === undefined ? "-" : Number(value).toFixed(digits);
}

function ago(timestamp) {
  if (!timestamp) return "-";
  const seconds = Math.max(0, Date.now() / 1000 - timestamp);
  return seconds < 60 ? seconds.toFixed(0) + " s ago" : (seconds / 60).toFixed(1) + " min ago";
}

function histogram(counts) {
  const width = 100, height = 22, most = Math.max(1, ...counts);
  const chart = svg("svg", {width, height, viewBox: `0 0 ${width} ${height}`, class: "histogram"});
  const step = width / Math.max(1, counts.length);
  counts.forEach((count, index) => {
    const barHeight = (count / most) * (height - 2);
    const bar = svg("rect", {x: index * step + 1, y: height - barHeight, width: step - 2, height: barHeight,
                             class: "bar"});
    bar.appendChild(svg("title", {}, `class ${index}: ${count}`));
    chart.appendChild(bar);
  });
  return chart;
}

function drawPredictions(row, predictions) {
  if (!predictions) {
    for (let column = 0; column < 3; column++) cell(row, "-");
    return;
  }
  cell(row, String(predictions.per_hour));
  const mix = Object.entries(predictions.class_mix).slice(0, 3);
  cell(row, mix.length ? mix.map(([name, share]) => `${name} ${(100 * share).toFixed(0)}%`).join(", ") : "-");
  const uncertain = predictions.uncertain_share === null ? "-" : `${(100 * predictions.uncertain_share).toFixed(0)}%`;
  if (predictions.drift) cell(row, `${uncertain}, drift: uncertain share jumped`, "rejected");
  else cell(row, uncertain);
}

function drawDevices(devices) {
  const body = document.querySelector("#devices tbody");
  body.replaceChildren();
  for (const device of devices) {
    const row = element("tr", {"data-device": device.device_id});
    cell(row, device.device_id);
    const troubled = device.part_restarts || device.set_aside;
    const health = troubled ? ` (${device.part_restarts} restarts, ${device.set_aside} set aside)` : "";
    cell(row, device.state + health, device.online ? "online" : "offline");
    cell(row, ago(device.last_seen));
    cell(row, device.profile || "-");
    cell(row, device.peak_rss_mb ? `${device.peak_rss_mb.toFixed(0)} MB` : "-");
    cell(row, String(device.rounds_joined));
    cell(row, String(device.labelled));
    cell(row, "").appendChild(histogram(device.class_counts.length ? device.class_counts : [0]));
    cell(row, fixed(device.local_accuracy));
    const update = device.last_update;
    cell(row, update ? `round ${update.round_id}, ${(update.size / 1024).toFixed(1)} KiB` : "-");
    if (!update) cell(row, "-");
    else if (update.accepted) cell(row, "accepted", "accepted");
    else cell(row, "rejected: " + update.reason, "rejected");
    drawPredictions(row, device.predictions);
    drawQueue(row, device.label_queue);
    body.appendChild(row);
  }
}

// A device's open queries in the fleet's labelling queue and how long the oldest has waited, linked to the labelling
// page ("-" without a queue).
function drawQueue(row, queue) {
  if (!queue) {
    cell(row, "-");
    return;
  }
  const text = queue.open ? `${queue.open} open, oldest ${ago(Date.now() / 1000 - queue.oldest_age_seconds)}` : "0 open";
  cell(row, "").appendChild(element("a", {href: "/label" + location.hash, class: "label-queue"}, text));
}

// Who labels the fleet: each person's answers today and in the last hour, the corrections made, and the link to the
// labelling page (all hidden when the coordinator keeps no queue).
function drawLabellers(labelling) {
  const note = document.getElementById("labellers");
  note.hidden = !labelling;
  document.getElementById("label-link").hidden = !labelling;
  if (!labelling) return;
  document.getElementById("label-link").href = "/label" + location.hash;
  const people = labelling.people
    .map(person => `${person.person} ${person.answers_today} (${person.answers_last_hour} in the last hour)`)
    .join(", ");
  note.textContent = `labelling queue: ${labelling.open} open; answers today: ${people || "none"}; ` +
    `corrections: ${labelling.corrections}`;
}

// The supervised parts: hidden while every part is up and none restarted or set a message aside; else each part's
// state and restarts with its last failure, and who sent the messages the parts set aside.
function drawHealth(health) {
  const note = document.getElementById("health");
  const troubled = health.parts.filter(part => !part.up || part.restarts);
  note.hidden = !troubled.length && !health.set_aside.length;
  if (note.hidden) return;
  const parts = troubled.map(part =>
    `${part.part} ${part.up ? "up" : "restarting"}, ${part.restarts} restarts (last: ${part.last_error})`);
  const aside = health.set_aside.map(item => `${item.messages} from ${item.sender} (${item.part})`);
  note.textContent = `parts: ${parts.join("; ") || "all up"}; set aside: ${aside.join(", ") || "none"}`;
  note.className = troubled.some(part => !part.up) ? "note down" : "note";
}

// A line chart of series [{name, colour, points: [[x, y], ...]}] into an <svg> with a 480x260 viewBox.
function lineChart(target, series, xLabel, yLabel) {
  target.replaceChildren();
  const left = 44, right = 470, top = 10, bottom = 225;
  const xs = series.flatMap(s => s.points.map(p => p[0]));
  const ys = series.flatMap(s => s.points.map(p => p[1]));
  if (!xs.length) {
    target.appendChild(svg("text", {x: 180, y: 130, class: "label"}, "no rounds yet"));
    return;
  }
  const xMin = Math.min(...xs), xMax = Math.max(...xs) === xMin ? xMin + 1 : Math.max(...xs);
  const yMin = Math.min(0, ...ys), yMax = Math.max(1, ...ys);
  const px = x => left + ((x - xMin) / (xMax - xMin)) * (right - left);
  const py = y => bottom - ((y - yMin) / (yMax - yMin)) * (bottom - top);
  target.appendChild(svg("line", {x1: left, y1: bottom, x2: right, y2: bottom, class: "axis"}));
  target.appendChild(svg("line", {x1: left, y1: top, x2: left, y2: bottom, class: "axis"}));
  for (const tick of [0, 0.25, 0.5, 0.75, 1]) {
    target.appendChild(svg("text", {x: 4, y: py(tick) + 4, class: "label"}, tick.toFixed(2)));
  }
  target.appendChild(svg("text", {x: left, y: 250, class: "label"}, `${xLabel} ${xMin} .. ${xMax}`));
  target.appendChild(svg("text", {x: right - 90, y: 250, class: "label"}, yLabel));
  series.forEach((s, index) => {
    const points = s.points.map(p => `${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(" ");
    target.appendChild(svg("polyline", {points, fill: "none", stroke: s.colour, "stroke-width": s.width || 1.5,
                                        "stroke-dasharray": s.dashed ? "4 3" : "none"}));
    for (const p of s.points) target.appendChild(svg("circle", {cx: px(p[0]), cy: py(p[1]), r: 2.5, fill: s.colour}));
    target.appendChild(svg("text", {x: left + 8 + 90 * (index % 5), y: top + 12 + 13 * Math.floor(index / 5),
                                    fill: s.colour, class: "label"}, s.name));
  });
}

function drawAccuracy(rounds) {
  const devices = [...new Set(rounds.flatMap(r => Object.keys(r.device_accuracy)))].sort();
  const global = {name: "global", colour: "#111", width: 2.5,
                  points: rounds.filter(r => r.accuracy !== null).map(r => [r.round, r.accuracy])};
  const local = devices.map((device, index) => ({
    name: device, colour: COLOURS[index % COLOURS.length], dashed: true,
    points: rounds.filter(r => device in r.device_accuracy).map(r => [r.round, r.device_accuracy[device]]),
  }));
  const field = {name: "field set", colour: "#b5179e", width: 2,
                 points: rounds.filter(r => r.field_images > 0).map(r => [r.round, r.field_accuracy])};
  const series = field.points.length ? [global, field, ...local] : [global, ...local];
  lineChart(document.getElementById("accuracy-chart"), series, "round", "test accuracy");
  lineChart(document.getElementById("labels-chart"),
            [{name: "global", colour: "#111", width: 2.5,
              points: rounds.filter(r => r.accuracy !== null).map(r => [r.labels, r.accuracy])}],
            "labels", "test accuracy");
}

function roundName(r) {
  return r.pool_weight === null || r.pool_weight === undefined ? String(r.round)
    : `${r.round} (refined by the pools, weight ${fixed(r.pool_weight, 3)})`;
}

function drawTimeline(rounds) {
  const body = document.querySelector("#timeline tbody");
  body.replaceChildren();
  const longest = Math.max(1, ...rounds.map(r => r.seconds));
  for (const r of rounds) {
    const row = element("tr", {"data-round": r.round});
    cell(row, roundName(r));
    const bar = svg("svg", {width: 160, height: 12});
    bar.appendChild(svg("rect", {x: 0, y: 1, width: (160 * r.seconds) / longest, height: 10, class: "bar"}));
    cell(row, "").appendChild(bar);
    cell(row, r.seconds.toFixed(1));
    cell(row, r.quorum === null ? "-" : String(r.quorum));
    cell(row, String(r.accepted));
    cell(row, r.stragglers.length ? r.stragglers.join(", ") : "-");
    cell(row, r.rejections.length ? r.rejections.map(x => `${x.device_id}: ${x.reason}`).join("; ") : "-",
         r.rejections.length ? "rejected" : null);
    cell(row, Object.keys(r.suspects).length ? Object.keys(r.suspects).join(", ") : "-");
    cell(row, r.test_images ? `${fixed(r.accuracy, 4)} (${r.test_images})` : fixed(r.accuracy, 4));
    cell(row, r.field_images > 0 ? `${fixed(r.field_accuracy, 4)} (${r.field_images})` : "-");
    const gate = r.serving;
    cell(row, gate === null ? "-" : gate.decision === "held" ? `not promoted: ${gate.reason}` : gate.decision,
         gate !== null && gate.decision === "held" ? "held" : null);
    body.appendChild(row);
  }
}

function heatColour(value, most) {
  if (value === null) return "#cccccc";
  const t = Math.min(1, value / most);
  const channel = start => Math.round(start + (30 - start) * t);
  return `rgb(${channel(247)},${channel(251)},${Math.round(255 + (110 - 255) * t)})`;
}

function drawDivergence(view) {
  const target = document.getElementById("divergence-heatmap");
  target.replaceChildren();
  const labelWidth = 110, cellHeight = 26, top = 8;
  const cellWidth = Math.max(8, (950 - labelWidth) / Math.max(1, view.layers.length));
  const height = top + cellHeight * view.devices.length + 90;
  target.setAttribute("viewBox", `0 0 960 ${height}`);
  const most = Math.max(1e-12, ...view.values.flat().filter(v => v !== null));
  view.devices.forEach((device, row) => {
    const suspect = device in view.suspects;
    const group = svg("g", {class: "heat-row", "data-device": device});
    group.appendChild(svg("text", {x: 2, y: top + row * cellHeight + 17, class: suspect ? "suspect-label" : "label"},
                          (suspect ? "⚠ " : "") + device));
    view.values[row].forEach((value, column) => {
      const layer = view.layers[column];
      const outlier = suspect && view.suspects[device].includes(layer);
      const rect = svg("rect", {x: labelWidth + column * cellWidth, y: top + row * cellHeight, width: cellWidth - 1,
                                height: cellHeight - 1, fill: heatColour(value, most),
                                stroke: outlier ? "#b42318" : "none", "stroke-width": outlier ? 2 : 0});
      rect.appendChild(svg("title", {}, `${device} ${layer}: ${fixed(value, 4)}`));
      group.appendChild(rect);
    });
    target.appendChild(group);
  });
  view.layers.forEach((layer, column) => {
    const x = labelWidth + column * cellWidth + cellWidth / 2;
    const y = top + cellHeight * view.devices.length + 6;
    target.appendChild(svg("text", {x, y, class: "label", transform: `rotate(60 ${x} ${y})`}, layer));
  });
}

function drawMethods(methods) {
  const rows = (methods || []).map(method => {
    const row = element("tr");
    cell(row, method.kind);
    cell(row, method.method);
    cell(row, method.summary);
    const options = method.options.map(o => `${o.flag} ${o.value} (default ${o.default}): ${o.help}`);
    cell(row, options.length ? options.join("; ") : "none");
    return row;
  });
  document.querySelector("#methods tbody").replaceChildren(...rows);
}

function fillRoundChoice(rounds) {
  const select = document.getElementById("divergence-round");
  const ids = rounds.map(r => String(r.round));
  const current = [...select.options].map(o => o.value);
  if (ids.join() !== current.join()) {
    select.replaceChildren(...ids.map(id => element("option", {value: id}, id)));
  }
  const wanted = chosenRound !== null && ids.includes(chosenRound) ? chosenRound : ids[ids.length - 1];
  if (wanted !== undefined) select.value = wanted;
  return wanted;
}

async function refresh() {
  try {
    const [run, devices, rounds] = await Promise.all(
      [getJson("/api/run"), getJson("/api/devices"), getJson("/api/rounds")]);
    document.getElementById("run-id").textContent = run.run_id || "-";
    document.getElementById("run-fleet").textContent = run.fleet || "-";
    document.getElementById("run-strategy").textContent = run.strategy || "-";
    document.getElementById("run-model").textContent =
      `${run.model.architecture} ${run.model.input_shape.join("x")}: ${run.model.class_names.join(", ")}`;
    document.getElementById("round-counter").textContent = String(run.round);
    document.getElementById("round-total").textContent = run.total_rounds === null ? "-" : String(run.total_rounds);
    document.getElementById("run-phase").textContent = run.phase;
    document.getElementById("devices-online").textContent = run.devices_online === null ? "-" : run.devices_online;
    document.getElementById("run-privacy").textContent = run.privacy.summary;
    document.getElementById("run-secure").textContent = run.secure.summary;
    document.getElementById("run-serving").textContent = run.serving.summary;
    document.getElementById("divergence-source").hidden = run.secure.divergence_source !== "aggregate";
    drawMethods(run.methods);
    drawDevices(devices.devices);
    drawLabellers(devices.labelling);
    drawHealth(run.health);
    drawAccuracy(rounds.rounds);
    drawTimeline(rounds.rounds);
    const round = fillRoundChoice(rounds.rounds);
    if (round !== undefined) drawDivergence(await getJson(`/api/rounds/${round}/divergence`));
    document.getElementById("connection").className = "ok";
    document.getElementById("connection").textContent = "live";
  } catch (error) {
    document.getElementById("connection").className = "down";
    document.getElementById("connection").textContent = "disconnected (" + error.message + ")";
  }
}

document.getElementById("divergence-round").addEventListener("change", event => {
  chosenRound = event.target.value;
  refresh();
});
refresh();
setInterval(refresh, POLL_MILLISECONDS);
