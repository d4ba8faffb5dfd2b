// The labelling page's behaviour: shows the next query (or a grid of one guessed class), posts each answer with the
// token, undoes and corrects the person's latest answers, and shows what comes next at once.
"use strict";

const TOKEN = new URLSearchParams(location.hash.slice(1)).get("token");
const KEYS = "1234567890qwertyuiopadfghjklzxcvbm";
const ZOOMS = [1, 2, 4];
const CACHED_IMAGES = 200;
const page = {
  mode: "single",     // "single": one image; "grid": thumbnails of one guessed class
  current: null,      // the query shown in single mode
  correcting: null,   // the answer being changed (from an undo of a sent answer, or the history), else null
  exceptions: [],     // a grid's marked queries, answered one by one before the next grid
  grid: null,         // the grid shown: {class, class_name, queries, marked: Set}
  classes: [],
  zoom: 0,
  busy: false,
  shown: 0,           // counts what the page finished showing (a scripted person waits on it)
};
const images = new Map();  // image address -> object URL, the newest CACHED_IMAGES
const historyItems = new Map();  // "device/query" -> its item in the history

function headers(extra = {}) {
  // the token when there is one; on an open loopback dashboard the same-origin header the server asks for
  return Object.assign(TOKEN ? {Authorization: "Bearer " + TOKEN} : {"X-Requested-With": "edge-fal"}, extra);
}

function person() {
  const field = document.getElementById("person");
  return field.value.trim() || "anonymous";
}

function status(text, isError = false) {
  const node = document.getElementById("status");
  node.textContent = text;
  node.className = isError ? "error" : "";
}

function byId(id) {
  return document.getElementById(id);
}

// A query's image as an object URL, fetched once with the token and kept among the newest CACHED_IMAGES.
async function imageUrl(address) {
  if (images.has(address)) return images.get(address);
  const response = await fetch(address, {headers: headers(), cache: "no-store"});
  if (!response.ok) throw new Error("image: HTTP " + response.status);
  const url = URL.createObjectURL(await response.blob());
  return keepImage(address, url);
}

// Keeps an image's URL (an object URL, or a grid's data: URL) among the newest CACHED_IMAGES.
function keepImage(address, url) {
  images.set(address, url);
  if (images.size > CACHED_IMAGES) {
    const [oldest, stale] = images.entries().next().value;
    images.delete(oldest);
    if (stale.startsWith("blob:")) URL.revokeObjectURL(stale);
  }
  return url;
}

async function showImage(node, address) {
  node.src = await imageUrl(address);
  await node.decode();
}

// Tells a waiting script (and a person's eye) that what was asked for is on screen and the page takes the next key.
function shownNow() {
  page.shown += 1;
  document.body.dataset.shown = String(page.shown);
}

// Shows the key that presses a button (the n-th of KEYS), when there is one.
function showKey(button, position) {
  if (position >= KEYS.length) return;
  const key = document.createElement("kbd");
  key.textContent = KEYS[position];
  button.appendChild(key);
}

function drawButtons() {
  const box = byId("classes");
  if (box.childElementCount === page.classes.length) return;
  box.replaceChildren();
  page.classes.forEach((name, number) => {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "class-button";
    button.dataset.label = String(number);
    button.dataset.name = name.toLowerCase();
    button.textContent = name;
    showKey(button, number);
    button.addEventListener("click", () => answer(number));
    box.appendChild(button);
  });
  byId("search-box").hidden = page.classes.length <= KEYS.length;
}

// The class buttons whose name holds the search text; Enter in the search answers the first of them.
function searchClasses() {
  const text = byId("class-search").value.trim().toLowerCase();
  const matching = [];
  for (const button of byId("classes").children) {
    button.hidden = text !== "" && !button.dataset.name.includes(text);
    if (!button.hidden) matching.push(Number(button.dataset.label));
  }
  return matching;
}

function drawCounts(reply) {
  page.classes = reply.classes;
  drawButtons();
  byId("open-count").textContent = reply.open;
  byId("device-count").textContent = reply.devices;
  byId("today-count").textContent = reply.today;
  byId("correction-count").textContent = reply.corrections;
  drawHistory(reply.history);
}

// The person's latest answers, each item made once and then only updated (its picture is not decoded again).
function drawHistory(history) {
  const nodes = history.map(given => {
    const key = given.device + "/" + given.query_id;
    let item = historyItems.get(key);
    if (item === undefined) {
      item = document.createElement("button");
      item.type = "button";
      item.dataset.query = key;
      const picture = document.createElement("img");
      picture.alt = given.query_id;
      imageUrl(given.image).then(url => { picture.src = url; }).catch(() => {});
      item.append(picture, document.createElement("span"));
      historyItems.set(key, item);
    }
    const label = given.label === null ? "-" : given.label === -1 ? "none" : given.label_name;
    item.className = "given " + given.state.replace(" ", "-");
    item.lastChild.textContent = `${label} · ${given.state}`;
    item.onclick = () => correct(given);
    return item;
  });
  const kept = new Set(nodes);
  for (const [key, item] of historyItems) if (!kept.has(item)) historyItems.delete(key);
  byId("history").replaceChildren(...nodes);
}

function drawCorrecting() {
  const note = byId("correcting");
  note.hidden = page.correcting === null;
  if (page.correcting === null) return;
  const held = page.correcting.label === null ? "not decided yet" : page.correcting.label === -1
    ? "none of these" : page.classes[page.correcting.label];
  note.textContent = `changing ${page.correcting.device}/${page.correcting.query_id}, now ${held} ` +
    `(${page.correcting.state}): your answer replaces it (Esc: leave it as it is)`;
}

async function showQuery(query) {
  page.current = query;
  page.zoom = 0;
  applyZoom();
  byId("empty").hidden = query !== null;
  document.body.dataset.query = query ? query.device + "/" + query.query_id : "";
  drawCorrecting();
  byId("image-frame").hidden = query === null;
  byId("query-device").textContent = query ? query.device : "-";
  byId("query-id").textContent = query ? query.query_id : "-";
  const guessed = query !== null && query.guess_name !== null;
  byId("query-guess").textContent = guessed ? query.guess_name : "no guess yet";
  byId("query-probability").textContent = guessed ? query.probability.toFixed(2) : "-";
  byId("query-uncertainty").textContent = guessed ? query.uncertainty.toFixed(2) : "-";
  byId("accept").disabled = !guessed;
  if (query === null) {
    byId("query-image").removeAttribute("src");
    return;
  }
  await showImage(byId("query-image"), query.image);
}

function applyZoom() {
  const side = 320 * ZOOMS[page.zoom] + "px";
  const image = byId("query-image");
  image.style.width = side;
  image.style.height = side;
}

function zoom(step) {
  page.zoom = Math.max(0, Math.min(ZOOMS.length - 1, page.zoom + step));
  applyZoom();
}

async function getJson(path) {
  const response = await fetch(path, {headers: headers(), cache: "no-store"});
  const reply = await response.json();
  if (!response.ok) throw new Error(reply.error || "HTTP " + response.status);
  return reply;
}

async function postJson(path, body) {
  const response = await fetch(path, {
    method: "POST",
    headers: headers({"Content-Type": "application/json"}),
    body: JSON.stringify(Object.assign({person: person()}, body)),
  });
  return {ok: response.ok, reply: await response.json()};
}

// What comes after an answer: the next exception of a grid, a new grid, or the server's next query.
async function showNext(reply) {
  drawCounts(reply);
  if (page.exceptions.length) return showQuery(page.exceptions.shift());
  if (page.mode === "grid") return loadGrid();
  return showQuery(reply.query);
}

// Runs one step at a time (a second key while a post is on its way is dropped), showing any failure; then says the
// page is ready for the next key.
async function exclusive(step) {
  if (page.busy) return;
  page.busy = true;
  try {
    await step();
  } catch (error) {
    status(String(error), true);
  } finally {
    page.busy = false;
    shownNow();
  }
}

function answer(label) {
  return exclusive(async () => {
    const query = page.correcting || page.current;
    if (query === null) return;
    const path = page.correcting ? "/api/label/correct" : "/api/label/answer";
    const body = {device: query.device, query_id: query.query_id, label};
    const {ok, reply} = await postJson(path, page.correcting ? body : Object.assign(body, {hold: true}));
    if (!ok) {
      status(reply.error, true);
      page.correcting = null;
      return showNext(await nextQuery());
    }
    const outcome = reply.outcomes[0];
    status(outcome === "corrected" ? `correction sent to ${query.device}` : outcome === "decided"
      ? `answer stored; it goes to ${query.device} once it can no longer be undone` : `answer ${outcome}`);
    page.correcting = null;
    await showNext(reply);
  });
}

function skip() {
  return exclusive(async () => {
    if (page.current === null || page.correcting) return;
    const {ok, reply} = await postJson("/api/label/skip", {device: page.current.device, query_id: page.current.query_id});
    if (!ok) status(reply.error, true);
    await showNext(ok ? reply : await nextQuery());
  });
}

function undo() {
  return exclusive(async () => {
    const {ok, reply} = await postJson("/api/label/undo", {});
    if (!ok) return status(reply.error, true);
    drawCounts(reply);
    showView("single");  // a grid's flow goes on after the query taken back is answered
    if (reply.undone === "sent") {
      page.correcting = Object.assign({}, reply.query, {state: "sent"});
      status("that answer was sent already: answer again to correct it");
    } else {
      page.correcting = null;
      status("answer taken back: answer it again");
    }
    await showQuery(reply.query);
  });
}

// Shows one of the person's answers (from the history) to change it.
function correct(given) {
  return exclusive(async () => {
    showView("single");
    page.correcting = given;
    await showQuery({
      device: given.device, query_id: given.query_id, image: given.image, guess: -1, guess_name: null,
      probability: 0, uncertainty: 0,
    });
  });
}

function nextQuery() {
  return getJson("/api/label/next?person=" + encodeURIComponent(person()));
}

function leaveCorrection() {
  return exclusive(async () => {
    if (page.correcting === null) return;
    page.correcting = null;
    await showNext(await nextQuery());
  });
}

// Shows the grid ("grid") or one image ("single"), whichever mode the page is in.
function showView(view) {
  byId("grid-view").hidden = view !== "grid";
  byId("label-view").hidden = view === "grid";
}

function setMode(mode) {
  page.mode = mode;
  showView(mode);
  byId("mode").firstChild.textContent = mode === "grid" ? "one image at a time" : "grid of one class";
}

async function loadGrid() {
  const reply = await getJson("/api/label/grid?person=" + encodeURIComponent(person()));
  drawCounts(reply);
  if (!reply.queries.length) {
    byId("grid-empty").hidden = false;
    setMode("single");
    return showQuery((await nextQuery()).query);
  }
  byId("grid-empty").hidden = true;
  showView("grid");
  page.grid = {label: reply.class, queries: reply.queries, marked: new Set()};
  byId("grid-class").textContent = reply.class_name;
  byId("grid-accept-class").textContent = reply.class_name;
  const box = byId("grid");
  box.replaceChildren();
  const loads = reply.queries.map((query, position) => {
    if (query.data) keepImage(query.image, query.data);
    const thumb = document.createElement("button");
    thumb.type = "button";
    thumb.className = "thumb";
    thumb.dataset.query = query.device + "/" + query.query_id;
    const picture = document.createElement("img");
    picture.alt = query.query_id;
    thumb.appendChild(picture);
    showKey(thumb, position);
    thumb.addEventListener("click", () => mark(position));
    box.appendChild(thumb);
    return showImage(picture, query.image);
  });
  await Promise.all(loads);
  document.body.dataset.query = "grid:" + reply.queries.map(q => q.device + "/" + q.query_id).join(",");
}

function mark(position) {
  const grid = page.grid;
  if (grid === null || position >= grid.queries.length) return;
  if (grid.marked.has(position)) grid.marked.delete(position);
  else grid.marked.add(position);
  byId("grid").children[position].classList.toggle("exception", grid.marked.has(position));
}

// Accepts the grid's unmarked queries as its class in one post; the marked ones are shown one by one after it.
function acceptGrid() {
  return exclusive(async () => {
    const grid = page.grid;
    if (grid === null) return;
    const accepted = grid.queries.filter((_, position) => !grid.marked.has(position));
    page.exceptions = grid.queries.filter((_, position) => grid.marked.has(position));
    page.grid = null;
    let reply = null;
    if (accepted.length) {
      const queries = accepted.map(q => [q.device, q.query_id]);
      const posted = await postJson("/api/label/grid", {label: grid.label, queries, hold: true});
      if (!posted.ok) {
        page.exceptions = [];
        status(posted.reply.error, true);
        return loadGrid();
      }
      reply = posted.reply;
      status(`${accepted.length} answers stored` + (page.exceptions.length ? `; now the ${page.exceptions.length} exceptions` : ""));
    }
    if (page.exceptions.length) {
      showView("single");
      if (reply !== null) drawCounts(reply);
      return showQuery(page.exceptions.shift());
    }
    return loadGrid();
  });
}

function toggleMode() {
  return exclusive(async () => {
    if (page.correcting !== null) return;
    page.exceptions = [];
    setMode(page.mode === "grid" ? "single" : "grid");
    if (page.mode === "grid") return loadGrid();
    const reply = await nextQuery();
    drawCounts(reply);
    await showQuery(reply.query);
  });
}

function inGrid() {
  return page.mode === "grid" && byId("label-view").hidden;
}

function onKey(event) {
  if (event.target.tagName === "INPUT") return;
  if (event.key === "Backspace" || (event.key === "z" && (event.ctrlKey || event.metaKey))) {
    event.preventDefault();
    undo();
  } else if (event.key === "G") toggleMode();
  else if (event.key === "+" || event.key === "=") zoom(1);
  else if (event.key === "-") zoom(-1);
  else if (event.key === "Escape") leaveCorrection();
  else if (inGrid()) onGridKey(event);
  else onSingleKey(event);
}

function onGridKey(event) {
  if (event.key === "Enter") acceptGrid();
  else if (KEYS.includes(event.key)) mark(KEYS.indexOf(event.key));
}

function onSingleKey(event) {
  const number = KEYS.indexOf(event.key);
  if (event.key === "/") {
    event.preventDefault();
    byId("class-search").focus();
  } else if (event.key === "Enter" && page.current && page.current.guess >= 0 && !page.correcting) answer(page.current.guess);
  else if (number >= 0 && number < page.classes.length) answer(number);
  else if (event.key === "n") answer(-1);
  else if (event.key === "s") skip();
}

byId("none").addEventListener("click", () => answer(-1));
byId("skip").addEventListener("click", skip);
byId("accept").addEventListener("click", () => page.current && page.current.guess >= 0 && answer(page.current.guess));
byId("undo").addEventListener("click", undo);
byId("mode").addEventListener("click", toggleMode);
byId("zoom-in").addEventListener("click", () => zoom(1));
byId("zoom-out").addEventListener("click", () => zoom(-1));
byId("grid-accept").addEventListener("click", acceptGrid);
byId("query-image").addEventListener("click", () => zoom(page.zoom + 1 < ZOOMS.length ? 1 : -ZOOMS.length));
byId("dashboard-link").href = "/" + location.hash;
byId("class-search").addEventListener("input", searchClasses);
byId("class-search").addEventListener("keydown", (event) => {
  if (event.key === "Enter") {
    const matching = searchClasses();
    if (matching.length) answer(matching[0]);
    event.target.value = "";
    searchClasses();
    event.target.blur();
  } else if (event.key === "Escape") {
    event.target.value = "";
    searchClasses();
    event.target.blur();
  }
});
document.addEventListener("keydown", onKey);
const field = byId("person");
field.value = localStorage.getItem("edge-fal-person") || "";
field.addEventListener("change", () => {
  localStorage.setItem("edge-fal-person", field.value.trim());
  exclusive(async () => showNext(await nextQuery()));
});
exclusive(async () => showNext(await nextQuery()));
