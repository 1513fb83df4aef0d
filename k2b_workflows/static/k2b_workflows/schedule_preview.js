// The schedule form's "next five fire times", recomputed by the server as the spec is typed.
// A static file (no inline script): the admin may run under a strict Content-Security-Policy.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  const list = document.getElementById("k2b-schedule-preview");
  const cron = document.getElementById("id_cron");
  const every = document.getElementById("id_every");
  const zone = document.getElementById("id_timezone");
  if (!list || !(cron || every)) {
    return;
  }
  let timer = null;
  let asked = 0;
  function show(lines, isError) {
    list.replaceChildren();
    list.classList.toggle("errornote", Boolean(isError));
    for (const line of lines) {
      const item = document.createElement("li");
      item.textContent = line;
      list.appendChild(item);
    }
  }
  function refresh() {
    const query = new URLSearchParams({
      cron: cron ? cron.value : "",
      every: every ? every.value : "",
      timezone: zone ? zone.value : "UTC",
    });
    const ticket = ++asked;
    fetch(list.dataset.url + "?" + query.toString(), { credentials: "same-origin" })
      .then(function (response) { return response.json(); })
      .then(function (body) {
        if (ticket !== asked) {
          return; // an answer to an older spec
        }
        if (body.error) {
          show([body.field + ": " + body.error], true);
        } else {
          show(body.ticks, false);
        }
      })
      .catch(function () { /* keep what is shown */ });
  }
  for (const input of [cron, every, zone]) {
    if (input) {
      input.addEventListener("input", function () {
        clearTimeout(timer);
        timer = setTimeout(refresh, 250);
      });
    }
  }
});
