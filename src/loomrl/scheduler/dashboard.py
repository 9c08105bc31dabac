"""The dashboard page the daemon serves at ``/``: devices, a live lease timeline, the queue
with each job's wait and why, utilisation per device and per-job slowdown. One static
page that polls ``/api/status`` every second; no external assets."""

DASHBOARD_HTML = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>loomrl scheduler</title>
<style>
 body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
 h1{font-size:18px;margin:0 0 4px} h2{font-size:15px;margin:18px 0 6px}
 .muted{color:#777} table{border-collapse:collapse;background:#fff;min-width:50%}
 td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top} th{background:#f0f0f0}
 .devices{display:flex;gap:12px;flex-wrap:wrap}
 .device{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:220px}
 .bar{height:8px;background:#eee;border-radius:4px;overflow:hidden;margin-top:4px}
 .bar>div{height:100%;background:#3a7}
 .swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px}
 svg text{font-size:11px;fill:#333}
</style></head><body>
<h1>loomrl scheduler</h1>
<div class="muted" id="summary">connecting...</div>
<h2>Devices</h2><div class="devices" id="devices"></div>
<h2>Lease timeline <span class="muted" id="window"></span></h2>
<svg id="timeline" width="1000" height="40"></svg>
<h2>Queue</h2>
<table id="queue"><thead><tr><th>job</th><th>phase</th><th>devices</th><th>waited s</th><th>deadline in s</th><th>why it waits</th></tr></thead><tbody></tbody></table>
<h2>Jobs</h2>
<table id="jobs"><thead><tr><th>job</th><th>state</th><th>priority</th><th>weight</th><th>device s</th><th>swap s</th><th>wait s</th><th>grants</th><th>slowdown</th></tr></thead><tbody></tbody></table>
<h2>Leases</h2>
<table id="leases"><thead><tr><th>lease</th><th>job</th><th>devices</th><th>phase</th><th>state</th><th>held s</th></tr></thead><tbody></tbody></table>
<h2>Events</h2>
<table id="events"><thead><tr><th>time</th><th>event</th><th>job</th><th>device</th></tr></thead><tbody></tbody></table>
<script>
const palette = ["#4e79a7","#f28e2b","#e15759","#76b7b2","#59a14f","#edc948","#b07aa1","#ff9da7","#9c755f","#bab0ac"];
const colors = {};
function color(job){ if(!(job in colors)) colors[job] = palette[Object.keys(colors).length % palette.length]; return colors[job]; }
function esc(s){ return String(s ?? "").replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c])); }
function f(x, d=1){ return x == null ? "-" : Number(x).toFixed(d); }
function rows(id, items, cells, key){
  document.querySelector("#" + id + " tbody").innerHTML = items.map(it =>
    "<tr " + key(it) + ">" + cells(it).map(c => "<td>" + c + "</td>").join("") + "</tr>").join("") ||
    "<tr><td colspan=9 class=muted>none</td></tr>";
}
function timeline(s){
  const svg = document.getElementById("timeline"), w = 1000, left = 70, rowH = 26;
  const t1 = s.now, t0 = t1 - s.window_s, x = t => left + (w - left - 10) * (t - t0) / s.window_s;
  let out = "";
  s.devices.forEach((d, i) => {
    const y = 8 + i * rowH;
    out += `<text x="0" y="${y + 14}">${esc(d.name)}</text><rect x="${left}" y="${y}" width="${w-left-10}" height="20" fill="#eee"/>`;
    s.timeline.filter(sp => sp.device === d.name && sp.end >= t0).forEach(sp => {
      const a = x(Math.max(sp.start, t0)), b = x(sp.end);
      out += `<rect class="span" data-job="${esc(sp.job)}" x="${a}" y="${y}" width="${Math.max(b - a, 1)}" height="20" ` +
             `fill="${sp.kind === "swap" ? "#999" : color(sp.job)}"><title>${esc(sp.job)} ${esc(sp.phase)} ${f(sp.end - sp.start, 2)} s</title></rect>`;
    });
  });
  svg.setAttribute("height", 16 + s.devices.length * rowH);
  svg.innerHTML = out;
}
function render(s){
  document.getElementById("summary").textContent =
    `policy ${s.policy} · ${s.devices.length} device(s) · ${s.jobs.filter(j => j.state === "alive").length} live job(s) · ${s.queue.length} waiting · ${new Date(s.now * 1000).toLocaleTimeString()}`;
  document.getElementById("window").textContent = `(last ${s.window_s} s; grey = offload/restore)`;
  document.getElementById("devices").innerHTML = s.devices.map(d => {
    const h = d.holder;
    return `<div class="device" data-device="${esc(d.name)}"><b>${esc(d.name)}</b> <span class="muted">${d.cores ? "cores " + d.cores.join(",") : ""}</span><br>` +
      (h ? `<span class="swatch" style="background:${color(h.job)}"></span>held by <b>${esc(h.job)}</b> (${esc(h.phase)}${h.state === "evicting" ? ", offloading" : ""}) for ${f(h.held_s)} s`
         : `free${d.resident ? " · state of <b>" + esc(d.resident) + "</b> resident" : ""}`) +
      `<div class="bar"><div style="width:${(100 * d.utilisation).toFixed(1)}%"></div></div>` +
      `<span class="muted">utilisation ${(100 * d.utilisation).toFixed(1)}%</span></div>`;
  }).join("");
  timeline(s);
  rows("queue", s.queue, q => [`<span class="swatch" style="background:${color(q.job)}"></span>${esc(q.job)}`, esc(q.phase),
       esc(q.devices.join(",")), f(q.waited_s), f(q.deadline_in_s), esc(q.why)], q => `data-request="${esc(q.request)}" data-job="${esc(q.job)}"`);
  rows("jobs", s.jobs, j => [`<span class="swatch" style="background:${color(j.name)}"></span>${esc(j.name)}`, esc(j.state), j.priority, j.weight,
       f(j.device_s), f(j.swap_s, 2), f(j.wait_s), j.grants, f(j.slowdown, 2) + "x"], j => `data-job="${esc(j.name)}"`);
  rows("leases", s.leases, l => [esc(l.lease), esc(l.job), esc(l.devices.join(",")), esc(l.phase), esc(l.state), f(l.held_s)],
       l => `data-lease="${esc(l.lease)}"`);
  rows("events", s.events.slice().reverse(), e => [new Date(e.t * 1000).toLocaleTimeString(), esc(e.kind), esc(e.job), esc(e.device)], e => "");
}
async function poll(){
  try { const r = await fetch("/api/status", {cache: "no-store"}); render(await r.json()); }
  catch (err) { document.getElementById("summary").textContent = "scheduler unreachable: " + err; }
  setTimeout(poll, 1000);
}
poll();
</script></body></html>
"""
