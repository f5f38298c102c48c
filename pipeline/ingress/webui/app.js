// The page's entry: tabs (arrow keys move between them), the API key, and the two views.

import { apiKey, setApiKey } from "./api.js";
import { ChatView } from "./chat.js";
import { EngineView } from "./engine.js";

const $ = (id) => document.getElementById(id);

function say(text) {
  $("status").textContent = text;
}

function selectTab(tab, views) {
  for (const other of document.querySelectorAll('[role="tab"]')) {
    const selected = other === tab;
    other.setAttribute("aria-selected", String(selected));
    other.tabIndex = selected ? 0 : -1;
    $(other.getAttribute("aria-controls")).hidden = !selected;
  }
  if (tab.id === "tab-engine") views.engine.start();
  else views.engine.stop();
  localStorage.setItem("pagedserve.tab", tab.id);
}

function bindTabs(views) {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => selectTab(tab, views));
    tab.addEventListener("keydown", (e) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
      if (!step) return;
      const next = tabs[(i + step + tabs.length) % tabs.length];
      next.focus();
      selectTab(next, views);
    });
  });
  const saved = $(localStorage.getItem("pagedserve.tab") || "tab-chat");
  selectTab(saved || tabs[0], views);
}

async function refreshModels(chat) {
  try {
    await chat.loadModels();
    say("");
  } catch (err) {
    say(`Models: ${err.message}`);
  }
}

function main() {
  const views = { chat: new ChatView(say), engine: new EngineView(say) };
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    setApiKey($("api-key").value.trim());
    refreshModels(views.chat);
  });
  bindTabs(views);
  refreshModels(views.chat);
}

main();
