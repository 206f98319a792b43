// FerryLM dashboard: polls /dashboard/data every second and draws each series as an inline SVG
// line chart. No framework, no build step. Each chart writes what it drew into its element's
// data attributes (data-points, data-latest), so a headless browser test can read the DOM.
"use strict";
(() => {
  const POLL_MS = 1000;
  const KEY = "ferrylm-dashboard-key";
  const COLORS = ["#1f6feb", "#d1242f", "#1a7f37", "#8250df"];
  const W = 600, H = 190, L = 62, R = 8, T = 8, B = 20;  // viewBox and plot margins
  let updates = 0;

  const $ = (sel) => document.querySelector(sel);

  function fmt(v, unit) {
    if (v === null || v === undefined) return "–";
    if (unit === "s") return v < 1 ? (v * 1000).toFixed(v < 0.01 ? 2 : 1) + " ms" : v.toFixed(2) + " s";
    if (unit === "%") return (v * 100).toFixed(1) + " %";
    const digits = Number.isInteger(v) || Math.abs(v) >= 100 ? 0 : 1;
    return v.toFixed(digits) + (unit ? " " + unit : "");
  }

  function count(v) {
    return v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US");
  }

  function bytes(v) {
    if (v === null || v === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return v.toFixed(i === 0 ? 0 : 1) + " " + units[i];
  }

  // A cumulative figure and its rate over the panel's window: "1,234 (5.0/s)".
  function withRate(total, rate, show) {
    if (total === null || total === undefined) return "–";
    return show(total) + (rate === null || rate === undefined ? "" : ` (${show(rate)}/s)`);
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  // One polyline per run of non-null values (a gap in the data is a gap in the line).
  function segments(ts, values, x, y) {
    const out = [];
    let cur = [];
    values.forEach((v, i) => {
      if (v === null || v === undefined) { if (cur.length) out.push(cur); cur = []; return; }
      cur.push(x(ts[i]).toFixed(1) + "," + y(v).toFixed(1));
    });
    if (cur.length) out.push(cur);
    return out.map((pts) => pts.length === 1 ? [pts[0], pts[0]] : pts);
  }

  function ensureFigure(fig) {
    if (fig.querySelector("svg")) return;
    const caption = document.createElement("figcaption");
    caption.textContent = fig.dataset.title;
    const legend = document.createElement("div");
    legend.className = "legend";
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const note = document.createElement("div");
    note.className = "note";
    fig.append(caption, legend, svg, note);
  }

  function drawChart(fig, data) {
    ensureFigure(fig);
    const unit = fig.dataset.unit;
    const specs = fig.dataset.series.split(",").map((s) => s.split(":"));
    const ts = data.series.t;
    const now = data.now;
    const span = Math.min(data.window_s, Math.max(60, ts.length ? now - ts[0] : 60));
    const x = (t) => L + (W - L - R) * (1 - (now - t) / span);
    let top = 0, points = 0;
    const latest = {};
    for (const [key] of specs) {
      const values = data.series[key] || [];
      const seen = values.filter((v) => v !== null && v !== undefined);
      points = Math.max(points, seen.length);
      top = Math.max(top, ...seen, 0);
      latest[key] = seen.length ? seen[seen.length - 1] : null;
    }
    const ymax = unit === "%" ? 1 : niceMax(top * 1.05);
    const y = (v) => T + (H - T - B) * (1 - v / ymax);
    let svg = "";
    for (const f of [0, 0.5, 1]) {
      const gy = y(f * ymax).toFixed(1);
      svg += `<line class="grid" x1="${L}" x2="${W - R}" y1="${gy}" y2="${gy}"/>`;
      svg += `<text class="axis" x="${L - 4}" y="${gy}" text-anchor="end" dominant-baseline="middle">` +
             `${fmt(f * ymax, unit === "%" ? "%" : unit === "s" ? "s" : "")}</text>`;
    }
    svg += `<text class="axis" x="${L}" y="${H - 4}">-${Math.round(span)} s</text>`;
    svg += `<text class="axis" x="${W - R}" y="${H - 4}" text-anchor="end">now</text>`;
    specs.forEach(([key], i) => {
      for (const seg of segments(ts, data.series[key] || [], x, y)) {
        svg += `<polyline data-series="${key}" stroke="${COLORS[i % COLORS.length]}" points="${seg.join(" ")}"/>`;
      }
    });
    fig.querySelector("svg").innerHTML = svg;
    const legend = fig.querySelector(".legend");
    legend.replaceChildren(...specs.map(([key, label], i) => {
      const span = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = COLORS[i % COLORS.length];
      span.append(swatch, `${label}: ${fmt(latest[key], unit)}`);
      span.dataset.series = key;
      return span;
    }));
    const note = fig.dataset.note && data.notes[fig.dataset.note];
    fig.querySelector(".note").textContent = note || "";
    fig.dataset.points = String(points);
    fig.dataset.latest = JSON.stringify(latest);
  }

  function drawSummary(data) {
    const s = data.summary || {};
    const items = [["TTFT p50", s.ttft_p50, "s"], ["TTFT p99", s.ttft_p99, "s"], ["ITL p50", s.itl_p50, "s"],
                   ["ITL p99", s.itl_p99, "s"], ["generated", s.generation_tokens_per_s, "tok/s"],
                   ["prefix hits", s.prefix_cache_hit_rate, "%"]];
    const head = document.createElement("div");
    head.textContent = `over the last ${Math.round(s.seconds || 0)} s:`;
    $("#summary").replaceChildren(head, ...items.map(([label, v, unit]) => {
      const div = document.createElement("div");
      const b = document.createElement("b");
      b.textContent = fmt(v, unit);
      div.append(label + " ", b);
      return div;
    }));
  }

  function drawHealth(rows) {
    const body = $("#health tbody");
    body.replaceChildren(...rows.map((h) => {
      const tr = document.createElement("tr");
      tr.dataset.ok = String(h.ok);
      tr.dataset.name = h.name;
      for (const [text, cls] of [[h.name, ""], [h.state, h.ok ? "ok" : "bad"],
                                 [Object.entries(h.detail).map(([k, v]) => `${k}=${v}`).join("  "), "detail"]]) {
        const td = document.createElement("td");
        td.textContent = text;
        if (cls) td.className = cls;
        tr.append(td);
      }
      return tr;
    }));
  }

  const TIER_NAMES = { device: "device pool", host: "host (CPU)", disk: "disk" };

  // The cells of one tier's row, in the table's column order; a tier that is off is one "off" cell.
  function tierCells(t) {
    if (!t.on) return [["off", "off", 9]];
    const latency = t.load_latency_s === null && t.load_latency_total_s === null ? "–" :
      `${fmt(t.load_latency_s, "s")} (all: ${fmt(t.load_latency_total_s, "s")})`;
    return [[`${count(t.blocks_used)} / ${count(t.blocks_total)} (${fmt(t.occupancy, "%")})`],
            [count(t.hit_tokens)], [fmt(t.hit_tokens_per_s, "tok/s")],
            [withRate(t.blocks_out, t.blocks_out_per_s, count)], [withRate(t.blocks_in, t.blocks_in_per_s, count)],
            [withRate(t.bytes_out, t.bytes_out_per_s, bytes)], [withRate(t.bytes_in, t.bytes_in_per_s, bytes)],
            [latency], [count(t.blocks_lost)]];
  }

  function drawTiers(panel) {
    $("#tiers-window").textContent = panel ? `(rates over the last ${Math.round(panel.seconds)} s)` : "";
    const rows = panel ? panel.tiers : [];
    $("#tiers tbody").replaceChildren(...rows.map((t) => {
      const tr = document.createElement("tr");
      tr.dataset.tier = t.tier;
      tr.dataset.on = String(t.on);
      for (const [text, cls, span] of [[TIER_NAMES[t.tier] || t.tier], ...tierCells(t)]) {
        const td = document.createElement("td");
        td.textContent = text;
        if (cls) td.className = cls;
        if (span) td.colSpan = span;
        tr.append(td);
      }
      return tr;
    }));
  }

  function render(data) {
    updates += 1;
    $("#source").textContent = data.source === "gateway" ? "gateway" : "server";
    document.querySelectorAll("figure.chart").forEach((fig) => drawChart(fig, data));
    drawSummary(data);
    drawHealth(data.health);
    drawTiers(data.kv_tiers);
    const status = $("#status");
    status.className = "";
    status.dataset.updates = String(updates);
    status.dataset.numPoints = String(data.num_points);
    status.dataset.source = data.source;
    status.textContent = `${data.num_points} points, every ${data.interval_s} s; updated ` +
                         new Date(data.now * 1000).toLocaleTimeString();
  }

  async function poll() {
    const status = $("#status");
    try {
      const key = sessionStorage.getItem(KEY);
      const headers = key ? { Authorization: "Bearer " + key } : {};
      const r = await fetch("/dashboard/data", { headers, cache: "no-store" });
      if (r.status === 401) {
        $("#auth").hidden = false;
        status.className = "error";
        status.textContent = "a credential is needed to read /dashboard/data";
      } else if (!r.ok) {
        throw new Error(`/dashboard/data answered ${r.status}`);
      } else {
        $("#auth").hidden = true;
        render(await r.json());
      }
    } catch (e) {
      status.className = "error";
      status.textContent = String(e);
    }
    setTimeout(poll, POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("#auth").addEventListener("submit", (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY, $("#auth-key").value);  // the next poll sends it
    });
    poll();
  });
})();
