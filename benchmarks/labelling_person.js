// The scripted person of benchmarks/labelling_day.py, run inside the labelling page: it knows each query's true class,
// sees only what the page shows (the query or grid on screen, the model's guess, its own history) and acts through the
// page's keys and clicks. Each action that asks the server for the next view is one timed click: from the key to the
// next view on screen.
"use strict";

window.labellingPerson = (() => {
  const KEYS = "1234567890qwertyuiopadfghjklzxcvbm";
  const state = {
    truth: {}, slipped: "", answered: new Set(), pending: [], latencies: [], kinds: {}, clicks: 0, marks: 0, undos: 0, corrections: 0,
    pages: 0, exceptions: 0, busy: 0,
  };

  const shown = () => Number(document.body.dataset.shown || 0);
  const onScreen = () => document.body.dataset.query || "";
  const classes = () => Array.from(document.querySelectorAll("#classes button.class-button"), b => b.firstChild.textContent);
  const press = key => document.dispatchEvent(new KeyboardEvent("keydown", {key}));

  // Resolves once the page has shown its next view; fails after 20 s naming what was on screen.
  function nextView(before) {
    return new Promise((resolve, reject) => {
      if (shown() !== before) return resolve();
      const late = setTimeout(() => {
        watch.disconnect();
        const status = document.getElementById("status").textContent;
        reject(new Error(`no next view after 20 s: on screen ${onScreen()}, status ${status}`));
      }, 20000);
      const watch = new MutationObserver(() => {
        if (shown() !== before) {
          clearTimeout(late);
          watch.disconnect();
          resolve();
        }
      });
      watch.observe(document.body, {attributes: true, attributeFilter: ["data-shown"]});
    });
  }

  // One timed click of a kind: an action, then the wait for what the page shows next.
  async function click(kind, action) {
    const before = shown();
    const started = performance.now();
    action();
    await nextView(before);
    const took = performance.now() - started;
    state.latencies.push(took);
    (state.kinds[kind] = state.kinds[kind] || []).push(took);
    state.clicks += 1;
  }

  function wrongFor(right) {
    return (right + 1 + (right % 3)) % classes().length;
  }

  // Corrects each answer it got wrong on purpose once the page's history says its device has it.
  async function correctDelivered() {
    for (const mistake of [...state.pending]) {
      if (state.answered.size < mistake.after) continue;
      const given = document.querySelector(`#history button.given.delivered[data-query="${mistake.key}"]`);
      if (given === null) continue;
      await click("history item", () => given.click());
      await click("correction", () => press(KEYS[mistake.right]));
      state.pending.splice(state.pending.indexOf(mistake), 1);
      state.corrections += 1;
    }
  }

  // A slip on the query on screen (a wrong class's key) undone at once with Backspace: the same query is back.
  async function slipAndUndo() {
    const key = onScreen();
    await click("slip", () => press(KEYS[wrongFor(state.truth[key])]));
    await click("undo", () => press("Backspace"));
    state.undos += 1;
    state.slipped = key;
    if (onScreen() !== key) throw new Error(`the undo showed ${onScreen()}, not ${key}`);
  }

  // Answers the query on screen: Enter when the guess is right, its class's key otherwise; a `mistake` is a wrong
  // class, corrected later (once its device stored it).
  async function answerShown(mistake) {
    const key = onScreen();
    const right = state.truth[key];
    const guess = classes().indexOf(document.getElementById("query-guess").textContent);
    const label = mistake ? wrongFor(right) : right;
    await click(label === guess ? "Enter: the guess" : "class key", () => press(label === guess ? "Enter" : KEYS[label]));
    if (mistake) state.pending.push({key, right, after: state.answered.size + 12});
    state.answered.add(key);
  }

  return {
    start(truth) {
      state.truth = truth;
      return true;
    },

    // Up to `steps` answers one image at a time (every 40th after a slip undone at once, every 50th a mistake
    // corrected later); stops right after an undo when `pauseAfterUndo` (a screenshot).
    async single(steps, pauseAfterUndo) {
      const started = performance.now();
      let paused = false;
      for (let step = 0; step < steps && onScreen(); step++) {
        const number = state.answered.size;
        if (number % 40 === 39 && state.slipped !== onScreen()) {
          await slipAndUndo();
          paused = pauseAfterUndo;
          if (paused) break;
        }
        await answerShown(number % 50 === 24);
        await correctDelivered();
      }
      state.busy += performance.now() - started;
      return {more: onScreen() !== "", paused};
    },

    // Marks a grid's exceptions (every 4th page leaves one unmarked: a mistake corrected once delivered); true when a
    // grid is on screen.
    markGrid() {
      const started = performance.now();
      const view = onScreen();
      if (!view.startsWith("grid:")) return false;
      const keys = view.slice(5).split(",");
      const label = classes().indexOf(document.getElementById("grid-class").textContent);
      const wrong = keys.map((key, position) => [key, position]).filter(([key]) => state.truth[key] !== label);
      // the mistake: an exception left unmarked, one the page sends at once (older than the 10 answers it holds for
      // an undo) on a page with another exception after it (whose answer brings the history with its delivery)
      const early = wrong.filter(([, position]) => position < keys.length - 10);
      const missed = state.pages % 4 === 1 && early.length && wrong.length >= 2 ? early[0] : null;
      for (const [key, position] of wrong) {
        if (missed !== null && key === missed[0]) continue;
        press(KEYS[position]);
        state.marks += 1;
        state.clicks += 1;
      }
      for (const key of keys) state.answered.add(key);
      if (missed !== null) state.pending.push({key: missed[0], right: state.truth[missed[0]], after: state.answered.size + 20});
      state.busy += performance.now() - started;
      return true;
    },

    // Accepts the marked grid, then answers its exceptions one by one (every 7th with a slip undone at once).
    async acceptGrid() {
      const started = performance.now();
      await click("grid accepted", () => press("Enter"));
      if (document.getElementById("status").className === "error") {
        throw new Error("the grid was refused: " + document.getElementById("status").textContent);
      }
      state.pages += 1;
      while (onScreen() && !onScreen().startsWith("grid:")) {
        if (state.exceptions % 7 === 3) await slipAndUndo();
        state.exceptions += 1;
        await answerShown(false);
        if (onScreen() && !onScreen().startsWith("grid:")) await correctDelivered();
      }
      await correctDelivered();
      state.busy += performance.now() - started;
      return onScreen() !== "";
    },

    // Switches the page to its grid mode.
    async toGrid() {
      const started = performance.now();
      await click("grid mode", () => press("G"));
      state.busy += performance.now() - started;
      return onScreen();
    },

    // Corrects what is left once the answers are delivered: the page's views are refreshed (one image at a time and
    // back) until the history shows them; these waits count as no one's work.
    async finish(timeoutMs) {
      const deadline = performance.now() + timeoutMs;
      while (state.pending.length && performance.now() < deadline) {
        for (const mistake of state.pending) mistake.after = 0;
        const started = performance.now();
        await correctDelivered();
        state.busy += performance.now() - started;
        if (!state.pending.length) break;
        await new Promise(resolve => setTimeout(resolve, 500));
        const before = shown();
        press("G");
        await nextView(before);
        if (document.getElementById("grid-view").hidden === false) {
          const again = shown();
          press("G");
          await nextView(again);
        }
      }
      return state.pending.length;
    },

    report() {
      return {
        answered: state.answered.size, latencies: state.latencies, kinds: state.kinds, clicks: state.clicks, marks: state.marks,
        undos: state.undos, corrections: state.corrections, pages: state.pages, exceptions: state.exceptions,
        busy_ms: state.busy, pending: state.pending.map(m => m.key),
      };
    },
  };
})();
