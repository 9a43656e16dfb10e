// The relaybus operator page. Plain script, no build step: it reads the JSON routes beside it
// and builds the DOM with textContent only, so no stored text is ever parsed as HTML.
"use strict";

(() => {
  const BASE = document.body.dataset.base || "";
  const READ_ONLY = document.body.dataset.readOnly === "true";
  const REFRESH_MS = 5000;
  const main = document.getElementById("main");
  const notice = document.getElementById("notice");
  const live = document.getElementById("live");
  const refreshed = document.getElementById("refreshed");

  // ---- helpers ---------------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  async function api(path, options) {
    // From the page's origin, never from its URL: a page opened as http://user:pass@host/ops
    // has the credentials in its URL, and fetch refuses a URL that carries them.
    const response = await fetch(new URL(BASE + path, location.origin), options);
    let body = null;
    try { body = await response.json(); } catch (_) { /* not JSON */ }
    if (!response.ok) {
      throw new Error((body && body.error) || `${response.status} ${response.statusText}`);
    }
    return body;
  }

  function write(path, body) {
    return api(path, {
      method: "POST",
      headers: { "content-type": "application/json", "x-relaybus-ops": "1" },
      body: JSON.stringify(body),
    });
  }

  function say(text, isError) {
    notice.textContent = text;
    notice.className = isError ? "error" : "";
    notice.hidden = false;
  }

  function params() { return new URLSearchParams(location.search); }

  function href(values) {
    const query = new URLSearchParams();
    for (const [name, value] of Object.entries(values)) {
      if (value !== undefined && value !== null && value !== "") query.set(name, value);
    }
    return "?" + query.toString();
  }

  function link(values, text, attrs) {
    return el("a", Object.assign({ href: href(values), onclick: navigate }, attrs || {}), text);
  }

  function navigate(event) {
    if (event.metaKey || event.ctrlKey || event.shiftKey || event.button !== 0) return;
    event.preventDefault();
    history.pushState(null, "", event.currentTarget.getAttribute("href"));
    notice.hidden = true;
    render();
  }

  function time(value) {
    if (!value) return "";
    const date = new Date(value);
    return isNaN(date) ? value : date.toLocaleString();
  }

  function age(seconds) {
    if (seconds === null || seconds === undefined) return "";
    if (seconds < 0) return "in " + age(-seconds);
    if (seconds < 120) return `${Math.round(seconds)} s`;
    if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
    if (seconds < 172800) return `${Math.round(seconds / 3600)} h`;
    return `${Math.round(seconds / 86400)} d`;
  }

  function state(record) {
    if (record.status === "pending") {
      if (record.running) return "running";
      if (record.parked) return "parked";
      return "waiting";
    }
    return record.status;
  }

  function badge(name) { return el("span", { class: `status ${name}`, text: name }); }

  function table(headers, rows, attrs) {
    return el("table", attrs || {},
      el("thead", {}, el("tr", {}, headers.map((h) =>
        el("th", { class: h.num ? "num" : "", text: h.label || h })))),
      el("tbody", {}, rows));
  }

  function confirmThen(text, action) {
    const dialog = document.getElementById("confirm");
    document.getElementById("confirm-text").textContent = text;
    dialog.returnValue = "";
    dialog.addEventListener("close", async function once() {
      dialog.removeEventListener("close", once);
      if (dialog.returnValue !== "ok") return;
      try {
        say(await action());
      } catch (error) {
        say(error.message, true);
      }
      render();
    });
    dialog.showModal();
  }

  function outcome(verb, answer) {
    const parts = [`${verb} ${(answer.requeued || answer.discarded || answer.buried || []).length}`];
    if (answer.blocked && answer.blocked.length) {
      parts.push(`${answer.blocked.length} blocked by a running later delivery of their key`);
    }
    if (answer.not_found && answer.not_found.length) parts.push(`${answer.not_found.length} not found`);
    if (answer.more) parts.push("more are left: run it again");
    return parts.join("; ") + ".";
  }

  function requeueIds(ids) {
    return write("/deliveries/requeue", { ids }).then((a) => outcome("Requeued", a));
  }

  function discardIds(ids) {
    return write("/deliveries/discard", { ids }).then((a) => outcome("Discarded", a));
  }

  // ---- overview --------------------------------------------------------------------------

  function spark(minutes) {
    const now = Math.floor(Date.now() / 60000);
    const byMinute = new Map(minutes.map((m) => [Math.floor(new Date(m.start) / 60000), m]));
    let peak = 1;
    for (const m of minutes) peak = Math.max(peak, m.succeeded + m.failed);
    const bars = [];
    for (let i = 59; i >= 0; i--) {
      const m = byMinute.get(now - i);
      const total = m ? m.succeeded + m.failed : 0;
      const bar = el("span", { class: m && m.failed ? "failed" : "", title: m ?
        `${time(m.start)}: ${m.succeeded} succeeded, ${m.failed} failed` : "" });
      bar.style.height = `${Math.round((total / peak) * 100)}%`;
      bars.push(bar);
    }
    return el("div", { class: "spark" }, bars);
  }

  async function overview() {
    const [stats, handlers, activity] = await Promise.all([
      api("/statistics"), api("/handlers"), api("/activity"),
    ]);
    const recent = new Map(activity.handlers.map((h) => [h.handler, h]));
    const names = new Set([...handlers.handlers.map((h) => h.handler), ...recent.keys()]);
    const counts = new Map(handlers.handlers.map((h) => [h.handler, h]));
    const card = (id, label, value, cls, target) => el("div", { class: `card ${cls || ""}` },
      el("div", { class: "n", id }, target ? link(target, value) : value),
      el("div", { class: "label", text: label }));
    const rows = [...names].sort().map((name) => {
      const c = counts.get(name) || { waiting: 0, running: 0, parked: 0, dead: 0 };
      const l = c.limits || {};
      const limits = [
        l.global_concurrency
          ? `${l.global_concurrency} at once${l.concurrency_partitioned ? " per partition" : ""}`
          : null,
        l.rate_limit ? `${l.rate_limit.starts} per ${l.rate_limit.interval_ms} ms` : null,
        l.batch ? `batches of ${l.batch.max}` : null,
      ].filter(Boolean).join(", ");
      const a = recent.get(name) || { succeeded: 0, failed: 0, dead_lettered: 0, minutes: [] };
      const n = (value, status) => el("td", { class: "num" },
        value ? link({ view: "deliveries", handler: name, status }, value) : "0");
      return el("tr", { "data-handler": name },
        el("td", {}, link({ view: "deliveries", handler: name }, name)),
        el("td", { class: "limits", text: limits || "–" }),
        n(c.waiting, "waiting"), n(c.running, "running"), n(c.parked, "parked"),
        n(c.dead, "dead"),
        el("td", { class: "num", text: age(c.oldest_due_age_seconds) }),
        el("td", { class: "num", text: a.succeeded }),
        el("td", { class: "num", text: a.failed }),
        el("td", { class: "num", text: a.dead_lettered }),
        el("td", {}, spark(a.minutes)));
    });
    return [
      el("div", { class: "cards" },
        card("total-pending", "pending", stats.pending, "", { view: "deliveries", status: "pending" }),
        card("total-running", "running", stats.running, "", { view: "deliveries", status: "running" }),
        card("total-parked", "parked", stats.parked, "", { view: "deliveries", status: "parked" }),
        card("total-dead", "dead letters", stats.dead, "dead", { view: "dead" }),
        card("total-completed", "completed", stats.completion_history ? stats.completed : "–", "",
          stats.completion_history ? { view: "deliveries", status: "completed" } : null),
        card("oldest-due", "oldest due", stats.oldest_due_at ?
          age((Date.now() - new Date(stats.oldest_due_at)) / 1000) : "–")),
      stats.completion_history ? null : el("p", { class: "note", id: "completed-note",
        text: stats.completed_note.charAt(0).toUpperCase() + stats.completed_note.slice(1) + "." }),
      el("h2", { text: "Handlers" }),
      rows.length ? table(["Handler", "Limits", { label: "Waiting", num: 1 }, { label: "Running", num: 1 },
        { label: "Parked", num: 1 }, { label: "Dead", num: 1 }, { label: "Oldest due", num: 1 },
        { label: "Succeeded (1 h)", num: 1 }, { label: "Failed (1 h)", num: 1 },
        { label: "Dead-lettered (1 h)", num: 1 }, "Last hour"], rows, { id: "handlers" })
        : el("p", { class: "muted", text: "No handler has pending or dead deliveries." }),
      el("p", { class: "muted", text: "Counts come from the store. The last hour's runs are " +
        "counted by this process alone, in memory." }),
    ];
  }

  // ---- deliveries ------------------------------------------------------------------------

  const FILTERS = ["handler", "status", "event_type", "key", "event_id", "error", "last_error",
    "created_from", "created_before"];
  const STATES = ["", "pending", "waiting", "running", "parked", "dead", "completed"];

  function localInput(iso) {
    if (!iso) return "";
    const d = new Date(iso);
    if (isNaN(d)) return "";
    const pad = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}`;
  }

  function filterForm(current) {
    const field = (name, label, input) => el("label", {}, label, input);
    const text = (name, placeholder) => el("input", { name, value: current.get(name) || "",
      placeholder: placeholder || "", size: 16 });
    const when = (name) => el("input", { name, type: "datetime-local",
      value: localInput(current.get(name)) });
    const status = el("select", { name: "status" }, STATES.map((s) =>
      el("option", { value: s, selected: (current.get("status") || "") === s, text: s || "any" })));
    return el("form", { class: "filters", id: "filters", onsubmit: (event) => {
      event.preventDefault();
      const form = new FormData(event.target);
      const values = { view: "deliveries" };
      for (const name of FILTERS) {
        let value = form.get(name);
        if (value === null || value === "") continue;
        if (name.startsWith("created_")) value = new Date(value).toISOString();
        values[name] = value;
      }
      history.pushState(null, "", href(values));
      notice.hidden = true;
      render();
    } },
    field("handler", "Handler", text("handler")),
    field("status", "State", status),
    field("event_type", "Event type", text("event_type")),
    field("key", "Key", text("key")),
    field("event_id", "Event id", text("event_id")),
    field("error", "Error contains", text("error")),
    current.get("last_error") ? el("input", { type: "hidden", name: "last_error",
      value: current.get("last_error") }) : null,
    field("created_from", "Created from", when("created_from")),
    field("created_before", "Created before", when("created_before")),
    el("button", { class: "primary", type: "submit", text: "Filter" }),
    link({ view: "deliveries" }, "Clear"));
  }

  async function deliveries() {
    const current = params();
    const query = new URLSearchParams();
    for (const name of FILTERS.concat(["after"])) {
      if (current.get(name)) query.set(name, current.get(name));
    }
    query.set("limit", "50");
    const page = await api("/deliveries?" + query.toString());
    const dead = current.get("status") === "dead";
    const selected = new Set();
    const rows = page.deliveries.map((d) => {
      const box = dead && !READ_ONLY ? el("input", { type: "checkbox", class: "pick",
        "data-id": d.id, onchange: (e) => {
          if (e.target.checked) selected.add(d.id); else selected.delete(d.id);
          refreshButtons();
        } }) : null;
      return el("tr", { "data-id": d.id, "data-state": state(d) },
        dead && !READ_ONLY ? el("td", {}, box) : null,
        el("td", {}, link({ view: "event", id: d.event_id, delivery: d.id }, d.event_id,
          { class: "open" })),
        el("td", { text: d.handler }),
        el("td", { text: d.event_type }),
        el("td", { text: d.key ? `${d.key} #${d.sequence}` : "" }),
        el("td", {}, badge(state(d))),
        el("td", { class: "num", text: d.attempts }),
        el("td", { text: d.status === "pending" ? time(d.due_at) : time(d.updated_at || d.completed_at) }),
        el("td", { text: time(d.created_at) }),
        el("td", { class: "error", text: d.last_error || "" }));
    });
    const selectionButtons = [];
    const refreshButtons = () => selectionButtons.forEach((b) => { b.disabled = selected.size === 0; });
    const filterBody = () => {
      const filter = {};
      for (const name of FILTERS) {
        if (name !== "status" && current.get(name)) filter[name] = current.get(name);
      }
      return Object.keys(filter).length ? { filter } : { all: true };
    };
    let actions = null;
    if (dead && !READ_ONLY) {
      const requeueSel = el("button", { id: "requeue-selected", disabled: true, text: "Requeue selected",
        onclick: () => confirmThen(`Requeue ${selected.size} dead letter(s)?`, () => requeueIds([...selected])) });
      const discardSel = el("button", { id: "discard-selected", disabled: true, text: "Discard selected",
        onclick: () => confirmThen(`Discard ${selected.size} dead letter(s) for good?`, () => discardIds([...selected])) });
      selectionButtons.push(requeueSel, discardSel);
      const body = filterBody();
      const scope = body.all ? "every dead letter" : "every dead letter matching this filter";
      actions = el("div", { class: "actions" }, requeueSel, discardSel,
        el("button", { id: "requeue-matching", text: "Requeue all matching", onclick: () =>
          confirmThen(`Requeue ${scope}?`, () => write("/deliveries/requeue", body).then((a) => outcome("Requeued", a))) }),
        el("button", { id: "discard-matching", class: "danger", text: "Discard all matching", onclick: () =>
          confirmThen(`Discard ${scope} for good?`, () => write("/deliveries/discard", body).then((a) => outcome("Discarded", a))) }));
    }
    const headers = ["Event", "Handler", "Type", "Key", "State", { label: "Attempts", num: 1 },
      "Due / changed", "Created", "Last error"];
    if (dead && !READ_ONLY) headers.unshift("");
    const pageValues = { view: "deliveries" };
    for (const name of FILTERS) pageValues[name] = current.get(name);
    return [
      filterForm(current),
      actions,
      rows.length ? table(headers, rows, { id: "deliveries" })
        : el("p", { class: "muted", id: "no-deliveries", text: "No delivery matches." }),
      el("div", { class: "pager" },
        current.get("after") ? link(pageValues, "First page") : null,
        page.next_after ? link(Object.assign({}, pageValues, { after: page.next_after }), "Next page",
          { id: "next-page" }) : null,
        el("span", { class: "muted", text: `${rows.length} shown, oldest first` })),
    ];
  }

  // ---- event detail ----------------------------------------------------------------------

  async function eventView() {
    const id = params().get("id");
    if (!id) return el("p", { text: "No event id given." });
    const detail = await api("/events/" + encodeURIComponent(id));
    const e = detail.event;
    const fields = [["Event id", e.id], ["Type", e.type], ["Key", e.key ? `${e.key} (#${e.sequence})` : "none"],
      ["Created", time(e.created_at)], ["Completed", e.completed_at ? time(e.completed_at) : "not yet"],
      ["Correlation id", e.correlation_id || ""], ["Causation id", e.causation_id || ""],
      ["Handlers", [...(e.handlers || [])].sort().join(", ")]];
    const headerRows = Object.entries(e.headers || {}).map(([name, value]) =>
      el("tr", {}, el("td", { text: name }), el("td", { text: value })));
    const highlighted = params().get("delivery");
    const rows = detail.deliveries.map((d) => {
      const dead = d.status === "dead";
      return el("tr", { "data-id": d.id, "data-state": state(d), class: d.id === highlighted ? "selected" : "" },
        el("td", { text: d.handler }),
        el("td", {}, badge(state(d))),
        el("td", { class: "num", text: d.attempts + (d.requeues ? ` (requeued ${d.requeues}×)` : "") }),
        el("td", { text: d.status === "pending" ? time(d.due_at) : time(d.completed_at || d.updated_at) }),
        el("td", {}, d.errors.length ? el("ol", { class: "errors" }, d.errors.map((x) =>
          el("li", { text: `${time(x.at)}${x.attempt ? ` (attempt ${x.attempt})` : ""}: ${x.error}` })))
          : el("span", { class: "muted", text: "none" })),
        el("td", {}, dead && !READ_ONLY ? [
          el("button", { class: "requeue", "data-id": d.id, text: "Requeue", onclick: () =>
            confirmThen(`Requeue the dead delivery of ${e.id} to ${d.handler}?`, () => requeueIds([d.id])) }),
          " ",
          el("button", { class: "discard danger", "data-id": d.id, text: "Discard", onclick: () =>
            confirmThen(`Discard the dead delivery of ${e.id} to ${d.handler} for good?`, () => discardIds([d.id])) }),
        ] : null));
    });
    return [
      el("h2", { text: `Event ${e.id}` }),
      el("dl", { class: "fields", id: "event-fields" }, fields.map(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])),
      el("h2", { text: "Deliveries" }),
      table(["Handler", "State", { label: "Attempts", num: 1 }, "Due / settled", "Failed attempts", ""], rows,
        { id: "event-deliveries" }),
      el("h2", { text: "Headers" }),
      headerRows.length ? table(["Name", "Value"], headerRows) : el("p", { class: "muted", text: "none" }),
      el("h2", { text: "Payload" }),
      el("pre", { id: "payload", text: JSON.stringify(e.payload, null, 2) }),
    ];
  }

  // ---- dead letters ----------------------------------------------------------------------

  async function deadLetters() {
    const handler = params().get("handler");
    const answer = await api("/dead-letters" + (handler ? "?handler=" + encodeURIComponent(handler) : ""));
    const rows = answer.groups.map((g) => {
      const filter = { handler: g.handler };
      if (g.error !== null) filter.last_error = g.error;
      const what = `${g.count} dead letter(s) of ${g.handler}${g.error !== null ? ` failing with “${g.error}”` : ""}`;
      return el("tr", { "data-handler": g.handler },
        el("td", { text: g.handler }),
        el("td", { class: "error", text: g.error === null ? "(no error)" : g.error }),
        el("td", { class: "num" }, link({ view: "deliveries", status: "dead", handler: g.handler,
          last_error: g.error }, g.count, { class: "group-count" })),
        el("td", { text: time(g.first_created_at) }),
        el("td", { text: time(g.last_updated_at) }),
        el("td", {}, READ_ONLY ? null : [
          el("button", { class: "requeue-group", text: "Requeue all", onclick: () =>
            confirmThen(`Requeue ${what}?`, () => write("/deliveries/requeue", { filter }).then((a) => outcome("Requeued", a))) }),
          " ",
          el("button", { class: "discard-group danger", text: "Discard all", onclick: () =>
            confirmThen(`Discard ${what} for good?`, () => write("/deliveries/discard", { filter }).then((a) => outcome("Discarded", a))) }),
        ]));
    });
    return [
      el("h2", { text: "Dead letters by error" }),
      rows.length ? table(["Handler", "Last error", { label: "Count", num: 1 }, "Oldest created",
        "Last buried", ""], rows, { id: "groups" })
        : el("p", { class: "muted", id: "no-dead", text: "No dead letters." }),
    ];
  }

  // ---- lanes -----------------------------------------------------------------------------

  async function lanes() {
    const report = await api("/lanes");
    const held = report.lanes.filter((l) => l.held || l.in_flight || l.lost);
    const now = Date.now();
    const rows = held.map((l) => el("tr", { "data-lane": l.lane },
      el("td", { class: "num", text: l.lane }),
      el("td", { text: l.owner || "" }),
      el("td", { text: l.lease_expires_at ? `${time(l.lease_expires_at)} (${age((new Date(l.lease_expires_at) - now) / -1000)})` : "" }),
      el("td", { class: "num", text: l.in_flight }),
      el("td", { class: "num", text: l.lost }),
      el("td", { class: "num", text: l.epoch })));
    const blocked = report.blocked.map((b) => {
      const w = b.waiting_for;
      return el("tr", {},
        el("td", { text: b.handler }),
        el("td", { text: b.key }),
        el("td", { class: "num", text: b.parked }),
        el("td", { class: "num", text: b.first_parked_sequence ?? "" }),
        el("td", {}, w ? [link({ view: "event", id: w.event_id, delivery: w.id }, `#${w.sequence} ${w.event_id}`),
          " ", badge(state(w)), w.last_error ? el("div", { class: "error", text: w.last_error }) : null]
          : el("span", { class: "muted", text: "nothing: the next claim moves them on" })));
    });
    const owners = new Set(held.filter((l) => l.held).map((l) => l.owner));
    return [
      el("div", { class: "cards" },
        el("div", { class: "card" }, el("div", { class: "n", text: report.lanes.filter((l) => l.held).length }),
          el("div", { class: "label", text: `of ${report.lanes.length} lanes held` })),
        el("div", { class: "card" }, el("div", { class: "n", text: owners.size }),
          el("div", { class: "label", text: "owners" }))),
      el("h2", { text: "Held lanes" }),
      rows.length ? table([{ label: "Lane", num: 1 }, "Owner", "Lease ends", { label: "In flight", num: 1 },
        { label: "Lost claims", num: 1 }, { label: "Epoch", num: 1 }], rows, { id: "lanes" })
        : el("p", { class: "muted", text: "No lane is held." }),
      el("h2", { text: "Blocked keys" }),
      blocked.length ? table(["Handler", "Key", { label: "Parked", num: 1 }, { label: "First parked #", num: 1 },
        "Waiting for"], blocked, { id: "blocked" })
        : el("p", { class: "muted", text: "No key has parked deliveries." }),
    ];
  }

  // ---- schedules -------------------------------------------------------------------------

  async function schedules() {
    const report = await api("/schedules");
    const rows = report.schedules.map((s) => el("tr", { "data-schedule": s.id },
      el("td", { text: s.id }),
      el("td", { text: s.event_type }),
      el("td", { text: s.cadence }),
      el("td", { text: s.missed }),
      el("td", {}, s.last_tick ? link({ view: "event", id: `schedule:${s.id}:${s.last_tick}` }, time(s.last_tick))
        : el("span", { class: "muted", text: "none recent" })),
      el("td", { text: s.next_tick ? time(s.next_tick) : "never" })));
    return [
      el("h2", { text: "Schedules" }),
      rows.length ? table(["Schedule", "Event type", "Ticks", "Missed ticks", "Last tick", "Next tick"], rows,
        { id: "schedules" })
        : el("p", { class: "muted", text: "This bus runs no schedule." }),
    ];
  }

  // ---- shell -----------------------------------------------------------------------------

  const VIEWS = { overview, deliveries, event: eventView, dead: deadLetters, lanes, schedules };
  let rendering = false;

  async function render(background) {
    if (rendering) return;
    rendering = true;
    const view = VIEWS[params().get("view")] ? params().get("view") : "overview";
    for (const a of document.querySelectorAll("header nav a")) {
      a.classList.toggle("active", a.dataset.view === view || (view === "event" && a.dataset.view === "deliveries"));
    }
    try {
      const content = await VIEWS[view]();
      // A background refresh keeps the filter form as the user is typing in it.
      const form = background && document.getElementById("filters");
      const picked = new Set([...document.querySelectorAll("input.pick:checked")].map((b) => b.dataset.id));
      const fresh = el("div", { id: "view", "data-view": view }, content);
      if (form) {
        const newForm = fresh.querySelector("#filters");
        if (newForm) newForm.replaceWith(form);
      }
      if (background && picked.size) {
        for (const box of fresh.querySelectorAll("input.pick")) {
          if (picked.has(box.dataset.id)) { box.checked = true; box.dispatchEvent(new Event("change")); }
        }
      }
      main.replaceChildren(fresh);
      refreshed.textContent = "updated " + new Date().toLocaleTimeString();
    } catch (error) {
      if (!background) main.replaceChildren(el("p", { class: "error", text: error.message }));
      else say(error.message, true);
    } finally {
      rendering = false;
    }
  }

  for (const a of document.querySelectorAll("header nav a")) a.addEventListener("click", navigate);
  window.addEventListener("popstate", () => render());
  // Live refresh polls, and pauses while the tab is hidden or a confirmation is open. On a
  // store slow to answer (a large backlog to count) it polls less often: never more than a
  // tenth of the time goes to waiting for answers.
  let lastTook = 0;
  async function tick() {
    if (live.checked && !document.hidden && !document.getElementById("confirm").open) {
      const started = performance.now();
      await render(true);
      lastTook = performance.now() - started;
    }
    setTimeout(tick, Math.max(REFRESH_MS, 10 * lastTook));
  }
  setTimeout(tick, REFRESH_MS);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && live.checked) render(true);
  });
  render();
})();
