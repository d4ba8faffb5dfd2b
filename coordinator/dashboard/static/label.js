// The labelling page's behaviour: shows the next query, posts each answer with the token, shows the next at once.
"use strict";

const TOKEN = new URLSearchParams(location.hash.slice(1)).get("token");
const KEYS = "1234567890qwertyuiopadfghjklzxcvbm";
let current = null;
let classes = [];
let busy = false;

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

async function showImage(query) {
  const response = await fetch(query.image, {headers: headers(), cache: "no-store"});
  if (!response.ok) throw new Error("image: HTTP " + response.status);
  const image = document.getElementById("query-image");
  if (image.src.startsWith("blob:")) URL.revokeObjectURL(image.src);
  image.src = URL.createObjectURL(await response.blob());
}

function drawButtons() {
  const box = document.getElementById("classes");
  if (box.childElementCount === classes.length) return;
  box.replaceChildren();
  classes.forEach((name, number) => {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "class-button";
    button.dataset.label = String(number);
    button.textContent = name;
    if (number < KEYS.length) {
      const key = document.createElement("kbd");
      key.textContent = KEYS[number];
      button.appendChild(key);
    }
    button.addEventListener("click", () => answer(number));
    box.appendChild(button);
  });
}

async function show(reply) {
  classes = reply.classes;
  drawButtons();
  document.getElementById("open-count").textContent = reply.open;
  document.getElementById("device-count").textContent = reply.devices;
  current = reply.query;
  document.getElementById("empty").hidden = current !== null;
  document.body.dataset.query = current ? current.device + "/" + current.query_id : "";
  if (current === null) {
    document.getElementById("query-image").removeAttribute("src");
    return;
  }
  document.getElementById("query-device").textContent = current.device;
  document.getElementById("query-id").textContent = current.query_id;
  const guessed = current.guess_name !== null;
  document.getElementById("query-guess").textContent = guessed ? current.guess_name : "no guess yet";
  document.getElementById("query-probability").textContent = guessed ? current.probability.toFixed(2) : "-";
  document.getElementById("query-uncertainty").textContent = guessed ? current.uncertainty.toFixed(2) : "-";
  await showImage(current);
}

async function next() {
  const response = await fetch("/api/label/next?person=" + encodeURIComponent(person()), {headers: headers(), cache: "no-store"});
  const reply = await response.json();
  if (!response.ok) throw new Error(reply.error || "HTTP " + response.status);
  await show(reply);
}

async function post(path, body) {
  if (current === null || busy) return;
  busy = true;
  try {
    const response = await fetch(path, {
      method: "POST",
      headers: headers({"Content-Type": "application/json"}),
      body: JSON.stringify(Object.assign({device: current.device, query_id: current.query_id, person: person()}, body)),
    });
    const reply = await response.json();
    if (!response.ok) {
      status(reply.error || "HTTP " + response.status, true);
      await next();
      return;
    }
    status(reply.decided ? "answer stored and sent to " + current.device : "answer stored");
    await show(reply);
  } catch (error) {
    status(String(error), true);
  } finally {
    busy = false;
  }
}

function answer(label) {
  return post("/api/label/answer", {label});
}

document.getElementById("none").addEventListener("click", () => answer(-1));
document.getElementById("skip").addEventListener("click", () => post("/api/label/skip", {}));
document.addEventListener("keydown", (event) => {
  if (event.target.tagName === "INPUT") return;
  const number = KEYS.indexOf(event.key);
  if (number >= 0 && number < classes.length) answer(number);
  else if (event.key === "n") answer(-1);
  else if (event.key === "s") post("/api/label/skip", {});
});
const field = document.getElementById("person");
field.value = localStorage.getItem("edge-fal-person") || "";
field.addEventListener("change", () => { localStorage.setItem("edge-fal-person", field.value.trim()); next(); });
next().catch((error) => status(String(error), true));
