// The console's only script: the overview's live numbers. It polls
// /api/overview every few seconds and updates the table cells in place;
// without it the page works, it just does not move.
(function () {
  "use strict";
  var table = document.querySelector("table[data-live]");
  if (!table) { return; }
  var url = table.getAttribute("data-live");
  var fmt = function (n) { return Number(n).toLocaleString("en-US"); };
  var secs = function (s) {
    s = Math.floor(s);
    if (s < 60) { return s + "s"; }
    if (s < 3600) { return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s"; }
    return Math.floor(s / 3600) + "h" + String(Math.floor(s / 60) % 60).padStart(2, "0") + "m";
  };
  function update(d) {
    (d.targets || []).forEach(function (t) {
      var name = t.target_topic || "";
      var row = null;
      table.querySelectorAll("tr[data-target]").forEach(function (r) {
        if (r.getAttribute("data-target") === name) { row = r; }
      });
      if (!row) { return; }
      var set = function (field, text) {
        var c = row.querySelector('[data-field="' + field + '"]');
        if (!c) { return; }
        var a = c.querySelector("a");
        (a || c).textContent = text;
      };
      var approx = t.estimated ? "~" : "";
      set("pending", approx + fmt(t.pending));
      set("due", approx + fmt(t.due));
      set("late", t.oldest_due ? (t.paused ? "paused" : secs(t.lateness_seconds)) : "—");
      set("parked", fmt(t.parked));
      set("rejected", fmt(t.rejected));
      set("published", fmt(t.published));
      row.classList.toggle("late", !t.paused && t.lateness_seconds > 60);
    });
    var at = document.getElementById("overview-at");
    if (at && d.at) { at.textContent = new Date(d.at).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z"); }
  }
  function poll() {
    fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (d) { if (d) { update(d); } })
      .catch(function () {})
      .finally(function () { setTimeout(poll, 5000); });
  }
  setTimeout(poll, 5000);
})();
