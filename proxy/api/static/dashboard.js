// rlproxy dashboard: reads the JSON routes every few seconds and draws four views.
//
//   #/overview            calls per minute, reward per adapter version, trainer and judge
//   #/groups[/ID]         groups; one group's members side by side with scores and rewards
//   #/trajectories[/ID]   trajectories; one trajectory's turns, tool calls, tokens, versions
//   #/adapters            versions with their step metrics; activate or roll back
//
// No framework and no build step. Every stored text goes onto the page as text (textContent),
// never as markup. Once the server answers 401 the page asks for an API key, keeps it in
// localStorage and sends it as `Authorization: Bearer` on every request to this origin.
"use strict";

(() => {
  const POLL_MS = 5000;
  const KEY_STORAGE = "rlproxy.dashboard.apiKey";
  const SVG_NS = "http://www.w3.org/2000/svg";

  const state = {
    key: localStorage.getItem(KEY_STORAGE) || "",
    shown: "", // what the view shows now (route + data), so unchanged data is not redrawn
    timer: null,
    running: false,
    again: false,
  };

  // --------------------------------------------------------------------------- DOM helpers

  function h(tag, attrs, ...children) {
    return fill(document.createElement(tag), attrs, children);
  }

  function s(tag, attrs, ...children) {
    return fill(document.createElementNS(SVG_NS, tag), attrs, children);
  }

  function fill(el, attrs, children) {
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") el.setAttribute("class", value);
      else if (name === "text") el.textContent = String(value);
      else if (name === "data") Object.assign(el.dataset, value);
      else if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
      else el.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : String(child));
    }
    return el;
  }

  const $ = (id) => document.getElementById(id);

  // --------------------------------------------------------------------------- formatting

  function num(x, digits = 3) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    return Number(x).toFixed(digits).replace(/\.?0+$/, "") || "0";
  }

  function ago(epoch) {
    if (!epoch) return "–";
    const s = Math.max(0, Date.now() / 1000 - epoch);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${Math.round(s / 3600)} h ago`;
    return new Date(epoch * 1000).toISOString().slice(0, 16).replace("T", " ");
  }

  function clock(epoch) {
    return new Date(epoch * 1000).toTimeString().slice(0, 5);
  }

  const versionName = (v) => (v ? `v${v}` : "base");
  const short = (id) => (id && id.length > 12 ? id.slice(0, 12) + "…" : id || "–");

  function contentText(content) {
    if (content === null || content === undefined) return "";
    if (typeof content === "string") return content;
    if (Array.isArray(content)) {
      return content.map((p) => (p && typeof p.text === "string" ? p.text : JSON.stringify(p))).join("\n");
    }
    return JSON.stringify(content, null, 2);
  }

  function prettyArgs(args) {
    if (typeof args !== "string") return JSON.stringify(args, null, 2);
    try {
      return JSON.stringify(JSON.parse(args), null, 2);
    } catch {
      return args; // arguments cut off by max_tokens are not JSON
    }
  }

  // --------------------------------------------------------------------------- the API

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // Paths are relative ("rl/stats"), so the page also works behind a prefix.
  async function api(path, { method = "GET", accept = [] } = {}) {
    const headers = { Accept: "application/json" };
    if (state.key) headers.Authorization = `Bearer ${state.key}`;
    const resp = await fetch(path, { method, headers, cache: "no-store" });
    let body = null;
    try {
      body = await resp.json();
    } catch {
      body = null;
    }
    if (!resp.ok && !accept.includes(resp.status)) {
      const message = (body && body.error && body.error.message) || `${resp.status} ${resp.statusText}`;
      throw new HttpError(resp.status, message);
    }
    return body;
  }

  // --------------------------------------------------------------------------- routing

  function route() {
    const hash = location.hash.replace(/^#\/?/, "");
    const [path, query] = hash.split("?");
    const [name, ...rest] = path.split("/");
    const params = new URLSearchParams(query || "");
    const views = ["overview", "groups", "trajectories", "adapters"];
    return {
      name: views.includes(name) ? name : "overview",
      id: rest.length ? decodeURIComponent(rest.join("/")) : null,
      cursor: params.get("cursor"),
    };
  }

  // Each view loads its data and returns { data, draw }: draw() builds the view's nodes.
  const VIEWS = { overview, groups, trajectories, adapters };

  async function refresh() {
    if (state.running) {
      state.again = true;
      return;
    }
    state.running = true;
    clearTimeout(state.timer);
    const where = route();
    try {
      const [view, health] = await Promise.all([
        VIEWS[where.name](where),
        api("health", { accept: [503] }).catch(() => null),
      ]);
      showHealth(health);
      hideKeyForm();
      const shown = JSON.stringify([where, view.data]);
      if (shown !== state.shown) {
        $("view").replaceChildren(...[view.draw()].flat(Infinity).filter((n) => n !== null && n !== undefined));
        state.shown = shown;
      }
      $("updated").textContent = `Last update ${new Date().toLocaleTimeString()}.`;
    } catch (err) {
      failed(err);
    } finally {
      state.running = false;
      markNav(where.name);
      if (state.again) {
        state.again = false;
        refresh();
      } else {
        state.timer = setTimeout(poll, POLL_MS);
      }
    }
  }

  function poll() {
    if (document.hidden) {
      state.timer = setTimeout(poll, POLL_MS);
      return;
    }
    refresh();
  }

  function failed(err) {
    if (err instanceof HttpError && err.status === 401) {
      showKeyForm(state.key ? `That key was refused: ${err.message}` : "This server needs an API key.");
      state.shown = "";
      $("view").replaceChildren(h("p", { class: "muted", text: "Waiting for an API key." }));
      return;
    }
    const text = err instanceof HttpError ? err.message : `Could not reach rlproxy (${err.message}).`;
    notify(text, true);
  }

  function markNav(name) {
    for (const a of document.querySelectorAll("nav a")) {
      a.classList.toggle("current", a.dataset.view === name);
    }
  }

  function showHealth(health) {
    const pill = $("health");
    if (!health) {
      pill.className = "pill bad";
      pill.textContent = "unreachable";
      return;
    }
    pill.className = `pill ${health.status === "ok" ? "ok" : "bad"}`;
    pill.textContent = `${health.model} · ${health.status}`;
    pill.title = health.reason || "";
  }

  let noticeTimer = null;
  function notify(text, isError = false) {
    const box = $("notice");
    box.textContent = text;
    box.className = `notice${isError ? " error" : ""}`;
    box.hidden = false;
    clearTimeout(noticeTimer);
    noticeTimer = setTimeout(() => (box.hidden = true), isError ? 15000 : 6000);
  }

  // --------------------------------------------------------------------------- the API key

  function showKeyForm(message) {
    $("key-message").textContent = message;
    $("key-form").hidden = false;
    $("key-input").focus();
  }

  function hideKeyForm() {
    $("key-form").hidden = true;
    $("forget-key").hidden = !state.key;
  }

  function setupKeyForm() {
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      state.key = $("key-input").value.trim();
      $("key-input").value = "";
      localStorage.setItem(KEY_STORAGE, state.key);
      refresh();
    });
    $("forget-key").addEventListener("click", () => {
      localStorage.removeItem(KEY_STORAGE);
      state.key = "";
      refresh();
    });
  }

  // --------------------------------------------------------------------------- overview

  async function overview() {
    const [stats, models, judgeReport, health, evaluation] = await Promise.all([
      api("rl/stats"),
      api("v1/models"),
      api("rl/judge"),
      api("health", { accept: [503] }).catch(() => null),
      api("rl/eval"),
    ]);
    const cache = (health && health.engine && health.engine.prefix_cache) || null;
    return {
      data: { stats, models: models.data.map((m) => m.id), judge: judgeReport, cache, evaluation },
      draw: () => [drawOverview(stats, models, cache, evaluation), judgePanel(judgeReport)],
    };
  }

  // The judge checks (GET /rl/judge): canaries, self-agreement, agreement with the environment,
  // the gate on training and the drift alarm.
  // How the failed canary checks failed: scored above the member the canary was made from, or
  // one score for every member and the canary (a judge that ordered nothing).
  function canaryFailures(outcomes) {
    const parts = [];
    if (outcomes.above) parts.push(`${outcomes.above} above their source`);
    if (outcomes.flat) parts.push(`${outcomes.flat} one score for all`);
    return parts.length ? `; failed: ${parts.join(", ")}` : "";
  }

  function judgePanel(report) {
    const row = (j) => h("tr", { data: { judge: j.judge_model, rubric: j.rubric_hash } }, [
      j.judge_model,
      j.rubric_hash,
      `${j.canary.passed}/${j.canary.checks}` + (j.canary.checks ? ` (95% ${num(j.canary.low, 2)}–${num(j.canary.high, 2)})` : "") +
        canaryFailures(j.canary.outcomes || {}),
      j.self_agreement.mean_tau === null ? "–" : `τ ${num(j.self_agreement.mean_tau, 2)} over ${j.self_agreement.checks}`,
      j.environment.groups ? `ρ ${num(j.environment.spearman, 2)}, τ ${num(j.environment.kendall, 2)} (${j.environment.groups})` : "–",
      j.gate.decision === "held" ? `HELD: ${j.gate.reason}` : j.gate.reason || "trains",
      String(j.held_groups),
    ].map((c, i) => h("td", { class: i === 5 && j.gate.decision === "held" ? "bad" : null, text: c })));
    return h(
      "section",
      { class: "panel", id: "judge-checks" },
      h("h2", { text: "Judge checks" }),
      report.drift.alarm ? h("p", { class: "notice error", text: `Drift alarm: ${report.drift.reason}` }) : null,
      report.judges.length === 0
        ? h("p", { class: "small muted", text: report.checks ? "No group judged with checks yet." : "Judge checks are off." })
        : h("div", { class: "table-wrap" }, h("table", {},
          h("thead", {}, h("tr", {}, ["judge", "rubric", "canaries passed", "self-agreement", "environment", "gate", "held"].map((c) => h("th", { text: c })))),
          h("tbody", {}, report.judges.map(row)))),
    );
  }

  // The staleness bound over the trainer's run: groups dropped (or down-weighted) for being
  // more than max_staleness versions behind the weights a step started from.
  function staleLine(stale) {
    const share = `${num(100 * stale.dropped_share, 1)} %`;
    const weighted = stale.downweighted ? `, ${stale.downweighted} down-weighted` : "";
    return h("div", {
      class: stale.dropped ? "small" : "small muted",
      id: "stale-groups",
      text: `stale: ${stale.dropped} of ${stale.trained + stale.dropped} usable groups dropped (${share})${weighted}`,
    });
  }

  // The engine's prefix cache (GET /health's engine.prefix_cache, shown to an admin key or
  // when no keys exist): the share of prompt tokens not prefilled again.
  function cacheCard(cache) {
    const rate = cache.hit_rate === null || cache.hit_rate === undefined ? "–" : `${num(100 * cache.hit_rate, 1)} %`;
    const mb = (b) => `${Math.round(b / 2 ** 20)} MB`;
    return card("Prefix cache hits", cache.enabled === false ? "off" : rate, [
      h("div", { class: "small muted", text: `${cache.hit_tokens || 0} of ${cache.query_tokens || 0} prompt tokens came from the cache` }),
      cache.max_bytes !== undefined
        ? h("div", { class: "small muted", text: `${mb(cache.bytes)} of ${mb(cache.max_bytes)}, ${cache.entries} entries` })
        : null,
    ], { id: "prefix-cache" });
  }

  // What runs beside serving (GET /rl/stats `background`): the judge's state and cost, the
  // engine's background rows (paused while users' requests run), the trainer's priority and CPU.
  function backgroundCard(bg) {
    const judge = bg.judge;
    const engine = bg.engine;
    const cores = (x) => (x === null || x === undefined ? "–" : `${num(x, 2)} cores`);
    const state = judge ? judge.state : "no scorer";
    return card("Background work", state, [
      judge && judge.reason ? h("div", { class: "small", id: "background-reason", text: judge.reason }) : null,
      judge && judge.state === "backing off" && judge.retry_at
        ? h("div", { class: "small muted", text: `next try in ${Math.max(0, Math.round(judge.retry_at - Date.now() / 1000))} s` })
        : null,
      judge
        ? h("div", {
            class: "small muted",
            text: `judge: ${judge.judge_calls_per_minute} calls/min (last 10 min), ${judge.groups_last_hour} groups, ` +
              `${judge.judge_calls_last_hour} calls, ${num(judge.judge_seconds_last_hour, 0)} s in the last hour`,
          })
        : null,
      engine
        ? h("div", {
            class: "small muted",
            text: `engine: ${engine.running_rows} background rows running, ${engine.paused_rows} paused for users, ` +
              `${engine.pauses} pauses; ${bg.engine_background_share === null ? "–" : num(100 * bg.engine_background_share, 0) + " %"} of the engine`,
          })
        : null,
      h("div", {
        class: "small muted",
        text: `CPU, last minute: server ${cores(bg.server_cpu_cores)}, trainer ${cores(bg.trainer.cpu_cores)}` +
          (bg.trainer.nice === null || bg.trainer.nice === undefined ? "" : ` (nice ${bg.trainer.nice})`),
      }),
    ], { id: "background", small: true });
  }

  // "Is it getting better?" (GET /rl/eval): the newest version against the base on held-out
  // tasks, with its interval; what was evaluated and left out on hover and below.
  function betterCard(evaluation) {
    const head = evaluation.headline;
    const evaluated = Object.entries(evaluation.evaluated)
      .map(([label, n]) => `${label === "base" ? "base" : "v" + label} ${n}`)
      .join(", ");
    const left = Object.entries(evaluation.left_out).filter(([, n]) => n > 0);
    const leftText = left.map(([key, n]) => `${n} ${evaluation.left_out_reasons[key]}`).join("; ");
    const reruns = Object.entries(evaluation.reruns_evaluated || {})
      .map(([label, n]) => `${label === "base" ? "base" : "v" + label} ${n}`)
      .join(", ");
    return card("Is it getting better?", head.verdict, [
      h("div", { class: "small", text: head.line }),
      reruns
        ? h("div", { class: "small muted", text: `re-runs pinned to a version, paired by task: ${reruns}` })
        : null,
      h("div", {
        class: "small muted",
        text: `held-out tasks (${Math.round(evaluation.share * 100)}% kept out of training): ` +
          `evaluated ${evaluated || "none"}${left.length ? `; left out ${left.reduce((a, [, n]) => a + n, 0)}` : ""}`,
        title: leftText,
      }),
    ], { id: "better", small: true });
  }

  function drawOverview(stats, models, cache, evaluation) {
    const calls = stats.calls;
    const trainer = stats.trainer;
    const judge = stats.judge;
    const groups = stats.groups;
    const newest = trainer.newest_version;
    const nothing = calls.total === 0 && stats.rewards.by_version.length === 0 && !newest;
    return [
      h("h1", { text: "Overview" }),
      nothing ? emptyOverview() : null,
      h(
        "div",
        { class: "cards" },
        card("Active version", versionName(stats.active_version), [
          h("div", { class: "small muted", text: `Served names: ${models.data.map((m) => m.id).join(", ")}` }),
        ], { id: "active-version" }),
        card("Calls, last hour", String(calls.total), [
          h("div", { class: "small muted", text: `${calls.errors} failed` }),
        ], { id: "calls-total" }),
        card("Trainer", trainer.state, [
          h("div", {
            class: "small muted",
            text: newest
              ? `newest ${versionName(newest.version)} (${newest.status}), ${ago(newest.created_at)}`
              : "no version written yet",
          }),
          trainer.last_exit_code !== null && trainer.last_exit_code !== undefined
            ? h("div", { class: "small", text: `last exit code ${trainer.last_exit_code}, ${trainer.restarts} restarts` })
            : null,
          h("div", { class: "small muted", text: `${groups.untrained_scored} scored groups wait for a step` }),
          trainer.stale_groups ? staleLine(trainer.stale_groups) : null,
        ], { id: "trainer" }),
        card("Judge", judge.model, [
          h("div", {
            class: "small muted",
            text: `${judge.scoring === false ? "background scoring off" : judge.scoring === "auto" ? "scoring while a trainer uses the scores" : "scoring in the background"} · ` +
              `ready ${groups.counts.ready}, scoring ${groups.counts.scoring}, forming ${groups.counts.forming}`,
          }),
          h("div", {
            class: "small muted",
            text: groups.last_scored ? `last scored ${ago(groups.last_scored.at)}` : "no group scored yet",
          }),
          groups.last_failed
            ? h("div", { class: "small", text: `last failure ${ago(groups.last_failed.at)}: ${groups.last_failed.failure || "?"}` })
            : null,
        ], { id: "judge", small: true }),
        evaluation ? betterCard(evaluation) : null,
        cache ? cacheCard(cache) : null,
        stats.background ? backgroundCard(stats.background) : null,
      ),
      groups.why_not_training && groups.why_not_training.length
        ? h(
            "section",
            { class: "panel", id: "why-not-training" },
            h("h2", { text: "Why traffic is not training yet" }),
            h(
              "ul",
              {},
              ...groups.why_not_training.map((r) =>
                h("li", {}, h("div", { text: r.what }), h("div", { class: "small muted", text: r.fix })),
              ),
            ),
          )
        : null,
      h(
        "section",
        { class: "panel" },
        h("h2", { text: "Reward per adapter version" }),
        h("p", {
          class: "small muted",
          text: `Mean ± standard error of the newest ${stats.rewards.window} rewards of each kind, by the version ` +
            `that served the trajectory's first call (base: no adapter). Training uses the ` +
            `${stats.rewards.policy === "explicit" ? "environment's reward where there is one" : "RULER score where there is one"}.`,
        }),
        rewardChart(stats.rewards.by_version, stats.active_version),
      ),
      h(
        "section",
        { class: "panel" },
        h("h2", { text: "Calls per minute" }),
        callsChart(calls.per_minute),
      ),
    ];
  }

  function card(label, figure, extra, { id, small } = {}) {
    return h(
      "div",
      { class: "panel", id },
      h("div", { class: "label", text: label }),
      h("div", { class: `figure${small ? " small" : ""}`, text: figure }),
      extra,
    );
  }

  function emptyOverview() {
    const base = new URL("v1", location.href.replace(/#.*$/, "").replace(/dashboard\/?$/, "")).href;
    return h(
      "div",
      { class: "empty", id: "empty-overview" },
      h("strong", { text: "Nothing stored yet." }),
      h("p", {
        text: `Point any OpenAI client at ${base} (OPENAI_BASE_URL) and run your agent. Every call is ` +
          `stored, calls become trajectories, closed trajectories form groups, scored groups train ` +
          `a LoRA, and each new version appears here.`,
      }),
    );
  }

  // Charts are drawn at the width they are shown at, so their text stays at its size.
  function chartWidth() {
    return Math.max(280, Math.min(1200, $("view").clientWidth - 60));
  }

  function callsChart(perMinute) {
    const total = perMinute.reduce((n, m) => n + m.calls, 0);
    if (!total) {
      return h("p", { class: "empty", id: "calls-empty", text: "No calls in this window yet." });
    }
    const W = chartWidth(), H = 170, L = 34, R = 8, T = 10, B = 26;
    const peak = Math.max(...perMinute.map((m) => m.calls));
    const step = (W - L - R) / perMinute.length;
    const y = (v) => T + (H - T - B) * (1 - v / peak);
    const svg = s("svg", { class: "chart", id: "calls-chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `Calls per minute: ${total} in the last ${perMinute.length} minutes` });
    svg.append(
      s("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }),
      s("text", { x: L - 4, y: T + 8, "text-anchor": "end", text: String(peak) }),
      s("text", { x: L - 4, y: H - B, "text-anchor": "end", text: "0" }),
      s("text", { x: L, y: H - 8, text: clock(perMinute[0].start) }),
      s("text", { x: W - R, y: H - 8, "text-anchor": "end", text: "now" }),
    );
    perMinute.forEach((m, i) => {
      if (!m.calls) return;
      const x = L + i * step + step * 0.1;
      const title = `${clock(m.start)}: ${m.calls} calls${m.errors ? `, ${m.errors} failed` : ""}`;
      const bar = (cls, n) => s("rect", { class: cls, x, y: y(n), width: step * 0.8, height: y(0) - y(n), data: { calls: n } }, s("title", { text: title }));
      svg.append(bar("bar", m.calls));
      if (m.errors) svg.append(bar("bar failed", m.errors)); // the failed share, at the bottom
    });
    return svg;
  }

  function rewardChart(byVersion, active) {
    if (!byVersion.length) {
      return h("p", {
        class: "empty",
        id: "reward-empty",
        text: "No rewards yet. Post one with POST /rl/trajectories/{id}/reward, or let RULER score groups.",
      });
    }
    const versions = [...new Set(byVersion.map((v) => v.version))].sort((a, b) => a - b);
    const sources = [...new Set(byVersion.map((v) => v.source))].sort();
    const W = chartWidth(), H = 250, L = 44, R = 12, T = 12, B = 30;
    const lows = byVersion.map((v) => v.mean - (v.stderr || 0));
    const highs = byVersion.map((v) => v.mean + (v.stderr || 0));
    let lo = Math.min(...lows), hi = Math.max(...highs);
    if (lo >= 0 && hi <= 1) {
      lo = 0;
      hi = 1;
    } else if (hi - lo < 1e-9) {
      lo -= 0.5;
      hi += 0.5;
    } else {
      const pad = (hi - lo) * 0.08;
      lo -= pad;
      hi += pad;
    }
    const slot = (W - L - R) / versions.length;
    const x = (version, source) => L + slot * (versions.indexOf(version) + 0.5) + (sources.length > 1 ? (sources.indexOf(source) - 0.5) * 10 : 0);
    const y = (v) => T + (H - T - B) * (1 - (v - lo) / (hi - lo));
    const svg = s("svg", { class: "chart", id: "reward-chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "Reward per adapter version, mean and standard error" });
    for (let i = 0; i <= 4; i++) {
      const v = lo + ((hi - lo) * i) / 4;
      svg.append(
        s("line", { class: i ? "grid" : "axis", x1: L, x2: W - R, y1: y(v), y2: y(v) }),
        s("text", { x: L - 5, y: y(v) + 4, "text-anchor": "end", text: num(v, 2) }),
      );
    }
    const every = Math.ceil(versions.length / 12);
    versions.forEach((v, i) => {
      if (i % every && v !== active) return;
      svg.append(s("text", { class: v === active ? "active" : null, x: L + slot * (i + 0.5), y: H - 10, "text-anchor": "middle", text: versionName(v) + (v === active ? " ●" : "") }));
    });
    for (const source of sources) {
      const points = byVersion.filter((v) => v.source === source);
      if (points.length > 1) {
        svg.append(s("polyline", { class: `trend ${source}`, points: points.map((p) => `${x(p.version, source)},${y(p.mean)}`).join(" ") }));
      }
      for (const p of points) {
        const cx = x(p.version, source);
        const title = `${versionName(p.version)}, ${source === "ruler" ? "RULER score" : "environment reward"}: ` +
          `${num(p.mean)}${p.stderr === null ? "" : ` ± ${num(p.stderr)}`} (n = ${p.n})`;
        const group = s("g", { class: `point ${source}`, data: { version: p.version, source, mean: p.mean, stderr: p.stderr ?? "", n: p.n } }, s("title", { text: title }));
        if (p.stderr) {
          const top = y(p.mean + p.stderr), bottom = y(p.mean - p.stderr);
          group.append(
            s("line", { class: `err ${source}`, x1: cx, x2: cx, y1: top, y2: bottom }),
            s("line", { class: `err ${source}`, x1: cx - 4, x2: cx + 4, y1: top, y2: top }),
            s("line", { class: `err ${source}`, x1: cx - 4, x2: cx + 4, y1: bottom, y2: bottom }),
          );
        }
        group.append(
          source === "ruler"
            ? s("rect", { class: source, x: cx - 4, y: y(p.mean) - 4, width: 8, height: 8 })
            : s("circle", { class: source, cx, cy: y(p.mean), r: 4.5 }),
        );
        svg.append(group);
      }
    }
    const legend = h(
      "div",
      { class: "legend" },
      sources.map((source) => h("span", {}, h("span", { class: `swatch ${source}` }), source === "ruler" ? "RULER score" : "environment reward")),
      h("span", { text: "bars: ± 1 standard error" }),
    );
    const table = h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { id: "reward-table" },
        h("thead", {}, h("tr", {}, h("th", { text: "version" }), h("th", { text: "reward" }), h("th", { class: "num", text: "n" }), h("th", { class: "num", text: "mean ± s.e." }))),
        h(
          "tbody",
          {},
          byVersion.map((p) =>
            h(
              "tr",
              { class: p.version === active ? "active-row" : null },
              h("td", { text: versionName(p.version) + (p.version === active ? " (active)" : "") }),
              h("td", { text: p.source === "ruler" ? "RULER score" : "environment" }),
              h("td", { class: "num", text: String(p.n) }),
              h("td", { class: "num", text: `${num(p.mean)}${p.stderr === null ? "" : ` ± ${num(p.stderr)}`}` }),
            ),
          ),
        ),
      ),
    );
    return [svg, legend, table];
  }

  // --------------------------------------------------------------------------- groups

  async function groups(where) {
    if (where.id) {
      const group = await api(`rl/groups/${encodeURIComponent(where.id)}`);
      return { data: group, draw: () => drawGroup(group) };
    }
    const page = await api(`rl/groups?limit=50${where.cursor ? `&cursor=${encodeURIComponent(where.cursor)}` : ""}`);
    return { data: page, draw: () => drawGroups(page, where) };
  }

  function drawGroups(page, where) {
    const title = h("h1", { text: "Groups" });
    if (!page.data.length && !where.cursor) {
      return [
        title,
        h("div", { class: "empty", id: "groups-empty" },
          h("strong", { text: "No groups yet." }),
          h("p", { text: "Closed trajectories join groups: by an explicit key (X-RLProxy-Group), by the task (same system prompt, first user message and tools), by shadow samples, or by cohort. A group is scored once it is ready." })),
      ];
    }
    return [
      title,
      h("div", { class: "panel table-wrap" },
        h("table", { id: "groups-table" },
          h("thead", {}, h("tr", {}, ["group", "status", "source", "key", "members", "judge", "created"].map((c, i) => h("th", { class: i === 3 || i === 5 ? "wide" : null, text: c })))),
          h("tbody", {}, page.data.map((g) =>
            h("tr", { data: { id: g.id } },
              h("td", {}, h("a", { class: "mono", href: `#/groups/${encodeURIComponent(g.id)}`, text: short(g.id) })),
              h("td", {}, h("span", { class: `pill ${g.status === "scored" ? "ok" : g.status === "failed" ? "bad" : ""}`, text: g.status })),
              h("td", { text: g.source }),
              h("td", { class: "wide mono", text: short(g.key) }),
              h("td", { class: "num", text: String(g.member_count) }),
              h("td", { class: "wide", text: g.judge_model || "–" }),
              h("td", { text: ago(g.created_at) }),
            ))))),
      pager(page, where, "groups"),
    ];
  }

  function drawGroup(g) {
    const facts = [
      ["status", g.status],
      ["source", g.source],
      ["key", g.key],
      ["members", g.member_count],
      ["judge", g.judge_model || "–"],
      ["judge attempts", g.judge_attempts ?? "–"],
      ["judge latency", g.judge_latency_s ? `${num(g.judge_latency_s, 2)} s` : "–"],
      ["trained at step", g.trained_step === null ? "not yet" : g.trained_step === 0 ? "skipped" : g.trained_step],
      ["created", ago(g.created_at)],
    ];
    return [
      h("p", {}, h("a", { href: "#/groups", text: "← all groups" })),
      h("h1", {}, "Group ", h("span", { class: "mono", text: short(g.id) })),
      h("div", { class: "panel" }, factList(facts), g.failure ? h("p", { class: "notice error", text: `Judging failed: ${g.failure}` }) : null,
        g.hold_reason ? h("p", { class: "notice error", id: "hold-reason", text: `Scores held, not trained on: ${g.hold_reason}` }) : null),
      h("div", { class: "members", id: "members" }, g.members.map(drawMember)),
    ];
  }

  function drawMember(m) {
    const versions = [...new Set(m.turns.map((t) => versionName(t.adapter_version)))].join(", ");
    const tokens = m.turns.reduce((n, t) => n + (t.completion_tokens || 0), 0);
    const answer = [...m.messages].reverse().find((msg) => msg.role === "assistant");
    const earlier = m.messages.slice(0, answer ? m.messages.lastIndexOf(answer) : m.messages.length);
    return h(
      "article",
      { class: "panel member", data: { member: m.member_id } },
      h("div", { class: "label", text: `member ${m.position + 1}${m.returned ? "" : " · shadow sample"}` }),
      h("div", { class: "score", text: m.ruler ? num(m.ruler.score) : "–", title: "RULER score" }),
      h("p", { class: "explanation", text: m.ruler ? m.ruler.explanation || "(no explanation)" : "Not scored by the judge." }),
      factList([
        ["explicit reward", m.explicit_reward === null ? "–" : num(m.explicit_reward)],
        ["trains with", m.reward === null ? "–" : `${num(m.reward)} (${m.reward_source})`],
        ["served by", versions || "–"],
        ["completion tokens", tokens],
        ["trajectory", h("a", { class: "mono", href: `#/trajectories/${encodeURIComponent(m.trajectory_id)}`, text: short(m.trajectory_id) })],
      ]),
      answer ? messageView(answer) : h("p", { class: "muted", text: "No answer." }),
      earlier.length ? h("details", {}, h("summary", { text: `${earlier.length} earlier messages` }), earlier.map(messageView)) : null,
    );
  }

  function factList(pairs) {
    return h("dl", { class: "facts" }, pairs.map(([k, v]) => [h("dt", { text: k }), h("dd", {}, v instanceof Node ? v : String(v))]));
  }

  function pager(page, where, name) {
    if (!page.next_cursor && !where.cursor) return null;
    return h("div", { class: "pager" },
      where.cursor ? h("a", { href: `#/${name}`, text: "← newest" }) : null,
      page.next_cursor ? h("a", { href: `#/${name}?cursor=${encodeURIComponent(page.next_cursor)}`, text: "older →" }) : null);
  }

  // --------------------------------------------------------------------------- trajectories

  async function trajectories(where) {
    if (where.id) {
      const t = await api(`rl/trajectories/${encodeURIComponent(where.id)}`);
      return { data: t, draw: () => drawTrajectory(t) };
    }
    const page = await api(`rl/trajectories?limit=50${where.cursor ? `&cursor=${encodeURIComponent(where.cursor)}` : ""}`);
    return { data: page, draw: () => drawTrajectories(page, where) };
  }

  function drawTrajectories(page, where) {
    const title = h("h1", { text: "Trajectories" });
    if (!page.data.length && !where.cursor) {
      return [
        title,
        h("div", { class: "empty", id: "trajectories-empty" },
          h("strong", { text: "No trajectories yet." }),
          h("p", { text: "Every chat completion joins a trajectory: the one whose history it continues, or the one named by X-RLProxy-Trajectory. A trajectory closes on a reward, on POST /rl/trajectories/{id}/end, or when idle." })),
      ];
    }
    return [
      title,
      h("div", { class: "panel table-wrap" },
        h("table", { id: "trajectories-table" },
          h("thead", {}, h("tr", {}, ["trajectory", "status", "turns", "model", "group key", "created"].map((c, i) => h("th", { class: i === 3 || i === 4 ? "wide" : null, text: c })))),
          h("tbody", {}, page.data.map((t) =>
            h("tr", { data: { id: t.id } },
              h("td", {}, h("a", { class: "mono", href: `#/trajectories/${encodeURIComponent(t.id)}`, text: short(t.id) })),
              h("td", {}, h("span", { class: `pill ${t.status === "open" ? "accent" : ""}`, text: t.close_reason ? `${t.status} (${t.close_reason})` : t.status })),
              h("td", { class: "num", text: String(t.turn_count) }),
              h("td", { class: "wide", text: t.model || "–" }),
              h("td", { class: "wide mono", text: t.group_key || "–" }),
              h("td", { text: ago(t.created_at) }),
            ))))),
      pager(page, where, "trajectories"),
    ];
  }

  function drawTrajectory(t) {
    let seen = 0;
    const turns = t.turns.map((turn, i) => {
      const messages = turn.request_messages;
      const fresh = seen <= messages.length ? messages.slice(seen) : messages;
      seen = messages.length + (turn.response_messages.length ? 1 : 0);
      // The next turn resends this answer; a client may send reasoning back beside it.
      const resent = turn.response_messages.length && t.turns[i + 1] ? t.turns[i + 1].request_messages[seen - 1] : null;
      return drawTurn(turn, i, fresh, resent && resent.role === "assistant" ? resent.reasoning_content : null);
    });
    const tools = t.turns.length && t.turns[0].tools ? t.turns[0].tools : null;
    return [
      h("p", {}, h("a", { href: "#/trajectories", text: "← all trajectories" })),
      h("h1", {}, "Trajectory ", h("span", { class: "mono", text: short(t.id) })),
      h("div", { class: "panel" },
        factList([
          ["status", t.close_reason ? `${t.status} (${t.close_reason})` : t.status],
          ["model", t.model || "–"],
          ["turns", t.turn_count],
          ["group key", t.group_key || "–"],
          ["explicit id", t.explicit ? "yes" : "no"],
          ["created", ago(t.created_at)],
        ]),
        h("h2", { text: "Rewards" }),
        t.rewards.length
          ? h("ul", { id: "rewards" }, t.rewards.map((r) => h("li", {}, h("strong", { text: num(r.reward) }), ` from ${r.source}, ${ago(r.created_at)}`, r.explanation ? ` — ${r.explanation}` : "")))
          : h("p", { class: "muted", text: "No reward yet." }),
        tools ? h("details", {}, h("summary", { text: `${tools.length} tools offered` }), h("pre", { text: JSON.stringify(tools, null, 2) })) : null,
      ),
      h("section", { id: "turns" }, turns),
    ];
  }

  function drawTurn(turn, i, fresh, reasoningSentBack) {
    const tokens = `${turn.prompt_tokens ?? "–"} prompt + ${turn.completion_tokens ?? "–"} completion tokens`;
    const protocol = { chat: "chat completions", responses: "responses", messages: "anthropic messages" }[turn.protocol] ?? turn.protocol;
    const meta = [versionName(turn.adapter_version), protocol, tokens, `${num(turn.latency_s, 2)} s`, turn.status];
    if (turn.attempts > 1) meta.push(`${turn.attempts} attempts`);
    return h(
      "article",
      { class: "panel turn", data: { turn: i, version: turn.adapter_version ?? 0 } },
      h("h3", {}, `Turn ${i + 1} `, h("span", { class: "pill", text: versionName(turn.adapter_version) })),
      h("div", { class: "small muted", text: meta.join(" · ") }),
      fresh.map(messageView),
      turn.response_messages.map((m, j) => messageView({ role: "assistant", ...m, ...(j === 0 && reasoningSentBack ? { reasoning_content: reasoningSentBack } : {}) })),
    );
  }

  function messageView(msg) {
    const role = msg.role || "?";
    const parts = [h("span", { class: "role", text: role === "tool" ? "tool result" : role })];
    if (role === "tool" && msg.tool_call_id) parts.push(h("span", { class: "small muted mono", text: msg.tool_call_id }));
    // The reasoning a client sent back with an earlier answer (a thinking block, a reasoning item).
    if (msg.reasoning_content) parts.push(h("details", { class: "reasoning" }, h("summary", { class: "small muted", text: "reasoning sent back" }), h("pre", { text: msg.reasoning_content })));
    const text = contentText(msg.content);
    if (text) parts.push(h("pre", { text }));
    for (const call of msg.tool_calls || []) {
      const fn = call.function || {};
      parts.push(
        h("div", { class: "toolcall" },
          h("div", { class: "small" }, "calls ", h("strong", { class: "mono", text: fn.name || "?" }), call.id ? h("span", { class: "muted mono", text: ` ${call.id}` }) : null),
          h("pre", { text: prettyArgs(fn.arguments) })),
      );
    }
    if (!text && !(msg.tool_calls || []).length) parts.push(h("span", { class: "muted", text: " (empty)" }));
    return h("div", { class: `msg ${role}` }, parts);
  }

  // --------------------------------------------------------------------------- adapters

  async function adapters() {
    const [list, health] = await Promise.all([api("rl/adapters"), api("health", { accept: [503] })]);
    return { data: { list, active: health.active_version, model: health.model }, draw: () => drawAdapters(list.data, health) };
  }

  function drawAdapters(versions, health) {
    const title = h("h1", { text: "Adapters" });
    if (!versions.length) {
      return [
        title,
        h("div", { class: "empty", id: "adapters-empty" },
          h("strong", { text: "No adapter versions yet." }),
          h("p", { text: `The trainer writes one version per GRPO step into checkpoints/${health.model}/NNNN/ once enough scored groups wait; serving loads it and ${health.model} serves it at once.` })),
      ];
    }
    const active = health.active_version || 0;
    const metricCols = ["loss", "mean_reward", "groups", "stale_dropped", "staleness_max", "too_long", "tokens_per_s", "step_seconds"];
    const row = (v, label, a) => {
      const m = a ? a.metrics || {} : {};
      const isActive = v === active;
      return h("tr", { class: isActive ? "active-row" : null, data: { version: v } },
        h("td", {}, h("strong", { text: label }), " ", isActive ? h("span", { class: "pill ok", text: "serving" }) : null),
        a && a.status === "held"
          // held by the forgetting check: it never served; its reason is under the button
          ? h("td", {}, h("span", { class: "pill bad", title: heldTitle(a.forgetting), text: "held" }))
          : h("td", { text: a ? (a.status === "rejected" ? "rejected" : a.loaded ? "in memory" : "on disk") : "–" }),
        metricCols.map((k) => h("td", { class: "num wide", text: m[k] === undefined ? "–" : num(m[k]) })),
        h("td", { class: "wide", text: a && a.created_at ? ago(a.created_at) : "–" }),
        h("td", {},
          isActive
            ? h("span", { class: "muted small", text: "active" })
            : h("button", { type: "button", class: v < active ? "secondary" : null, data: { activate: v }, onclick: () => activate(v, health.model) },
                v < active ? (v ? `Roll back to v${v}` : "Serve the base") : `Activate v${v}`),
          a && a.error ? h("div", { class: "small", text: a.error }) : null),
      );
    };
    return [
      title,
      h("p", { class: "small muted", text: `${health.model} serves ${versionName(active)}. Rolling back or forward takes effect for the next request; requests in flight finish on their version.` }),
      h("div", { class: "panel table-wrap" },
        h("table", { id: "adapters-table" },
          h("thead", {}, h("tr", {}, h("th", { text: "version" }), h("th", { text: "status" }), metricCols.map((c) => h("th", { class: "num wide", text: c.replace(/_/g, " ") })), h("th", { class: "wide", text: "written" }), h("th", { text: "" }))),
          h("tbody", {}, [...versions].reverse().map((a) => row(a.version, `v${a.version}`, a)), row(0, "base", null)))),
    ];
  }

  function heldTitle(verdict) {
    const d = verdict && verdict.divergence;
    if (!d) return "held by the forgetting check";
    return `forgetting check: mean KL to the base ${num(d.mean_kl)} nats/token over ${d.prompts} general prompts (limit ${num(verdict.max_kl)}); greedy answer changed on ${Math.round(100 * d.answer_changed)}% of them`;
  }

  async function activate(version, model) {
    const name = versionName(version);
    if (!window.confirm(`Serve ${name} as ${model}?`)) return;
    for (const b of document.querySelectorAll("button[data-activate]")) b.disabled = true;
    try {
      await api(`rl/adapters/${version}/activate`, { method: "POST" });
      notify(`${model} now serves ${name}.`);
    } catch (err) {
      if (err instanceof HttpError && err.status === 401) failed(err);
      else notify(err instanceof HttpError ? `Not activated: ${err.message}` : String(err), true);
    }
    state.shown = "";
    refresh();
  }

  // --------------------------------------------------------------------------- start

  function start() {
    setupKeyForm();
    let resized = null;
    window.addEventListener("resize", () => {
      clearTimeout(resized);
      resized = setTimeout(() => {
        state.shown = ""; // redraw the charts at the new width
        refresh();
      }, 300);
    });
    window.addEventListener("hashchange", () => {
      state.shown = "";
      refresh();
    });
    refresh();
  }

  start();
})();
