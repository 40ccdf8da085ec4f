// agentrun console: countdowns and following a run live. Everything from
// the server is set with textContent: nothing here parses markup.
(function () {
  "use strict";

  function left(ms) {
    if (ms <= 0) return "expired";
    var s = Math.floor(ms / 1000);
    var h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    return (h > 0 ? h + "h" : "") + m + "m" + r + "s";
  }

  function tick() {
    var els = document.querySelectorAll("[data-expires]");
    for (var i = 0; i < els.length; i++) {
      var at = Date.parse(els[i].getAttribute("data-expires"));
      if (!isNaN(at)) els[i].textContent = left(at - Date.now());
    }
  }

  function cell(tr, text) {
    var td = document.createElement("td");
    td.textContent = text;
    tr.appendChild(td);
    return td;
  }

  function row(r) {
    var tr = document.createElement("tr");
    if (r.marked) tr.className = "marked";
    cell(tr, (r.marked ? "! " : "") + r.seq);
    cell(tr, r.kind);
    cell(tr, r.time);
    var td = cell(tr, "");
    var what = document.createElement("span");
    what.className = "what";
    what.textContent = r.what;
    td.appendChild(what);
    var d = document.createElement("details");
    var s = document.createElement("summary");
    s.textContent = "record";
    var pre = document.createElement("pre");
    pre.textContent = r.detail;
    d.appendChild(s);
    d.appendChild(pre);
    td.appendChild(d);
    return tr;
  }

  function follow(table) {
    var url = table.getAttribute("data-follow");
    var next = parseInt(table.getAttribute("data-next") || "0", 10);
    var body = table.tBodies[0];
    var verification = document.getElementById("verification");
    var phase = document.getElementById("phase");
    var live = document.getElementById("live");
    function poll() {
      fetch(url + "?fromSeq=" + next, { credentials: "same-origin", headers: { "Accept": "application/json" } })
        .then(function (res) { return res.json(); })
        .then(function (data) {
          if (data.error) {
            if (live) live.textContent = "Following stopped: " + data.error;
            return;
          }
          for (var i = 0; i < data.records.length; i++) body.appendChild(row(data.records[i]));
          next = data.next;
          if (verification) {
            verification.textContent = data.verdict;
            verification.className = data.verified ? "verified" : "not-verified";
          }
          if (phase && data.phase) {
            phase.textContent = data.phase;
            phase.className = "state state-" + data.phase.toLowerCase();
          }
          if (data.finished) {
            // The whole page as it now stands (status, approvals, verdict).
            if (live) live.textContent = "The run has finished.";
            setTimeout(function () { location.reload(); }, 1000);
            return;
          }
          setTimeout(poll, 1500);
        })
        .catch(function () { setTimeout(poll, 3000); });
    }
    setTimeout(poll, 1500);
  }

  document.addEventListener("DOMContentLoaded", function () {
    tick();
    setInterval(tick, 1000);
    var t = document.getElementById("timeline");
    if (t && t.getAttribute("data-follow")) follow(t);
  });
})();
