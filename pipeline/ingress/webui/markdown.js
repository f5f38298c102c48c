// A small Markdown renderer for model answers: fenced code (highlighted), headings, lists,
// quotes, paragraphs; inline code, bold, italics and http(s) links. Everything is escaped
// first, so a model's HTML is shown as text, never run. One pass over the lines; an
// unterminated fence (an answer still streaming) renders as code so far.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const KEYWORDS = new Set((
  "and as async await break case catch class const continue def default del do elif else " +
  "enum except export extends false finally fn for from func function go if impl import in " +
  "interface is let match mod mut new nil none not null or package pass pub raise return " +
  "self static struct super switch this throw true try type typeof use var void while with " +
  "yield True False None int float str bool char long double unsigned").split(" "));

// One token a match: comment, string, number, word, or any other character.
const TOKEN = /(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/)|("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)|(\b\d[\d_]*(?:\.\d+)?(?:e[+-]?\d+)?\b)|([A-Za-z_$][\w$]*)|([\s\S])/g;

// Code as HTML with spans for comments, strings, numbers and keywords (classes hl-*).
export function highlight(code) {
  let out = "";
  for (const m of code.matchAll(TOKEN)) {
    const [text, comment, string, number, word] = m;
    const cls = comment ? "hl-comment" : string ? "hl-string" : number ? "hl-number"
      : word && KEYWORDS.has(word) ? "hl-keyword" : "";
    out += cls ? `<span class="${cls}">${escapeHtml(text)}</span>` : escapeHtml(text);
  }
  return out;
}

function inline(text) {
  // code spans first, kept out of the other rules by splitting on them
  return text.split(/(`[^`\n]+`)/).map((part, i) => {
    if (i % 2 === 1) return `<code>${escapeHtml(part.slice(1, -1))}</code>`;
    return escapeHtml(part)
      .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*([^*\n]+)\*/g, "$1<em>$2</em>")
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g,
        '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
  }).join("");
}

function codeBlock(lang, lines) {
  const label = lang ? ` data-lang="${escapeHtml(lang)}"` : "";
  return `<pre${label}><code>${highlight(lines.join("\n"))}</code></pre>`;
}

const LIST_ITEM = /^\s{0,3}(?:([-*+])|(\d{1,9})[.)])\s+(.*)$/;

function listHtml(list) {
  const start = list.start && list.start !== 1 ? ` start="${list.start}"` : "";
  const items = list.items.map((i) => `<li>${i.map(inline).join("<br>")}</li>`).join("");
  return `<${list.tag}${start}>${items}</${list.tag}>`;
}

// Markdown text as HTML. A list stays open across blank lines (a "loose" list) and takes
// indented lines as its last item's continuation.
export function renderMarkdown(text) {
  const out = [];
  let para = [], list = null, code = null, blank = false;
  const flushPara = () => { if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`); para = []; };
  const flushList = () => { if (list) out.push(listHtml(list)); list = null; };
  for (const line of text.split("\n")) {
    if (code) {
      if (/^\s*```/.test(line)) { out.push(codeBlock(code.lang, code.lines)); code = null; }
      else code.lines.push(line);
      continue;
    }
    const fence = line.match(/^\s*```\s*([\w+#.-]*)/);
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(LIST_ITEM);
    if (!line.trim()) { flushPara(); blank = true; continue; }
    const continues = list && !item && !fence && /^\s{2,}/.test(line);
    if (continues) { list.items[list.items.length - 1].push(line.trim()); blank = false; continue; }
    if (fence || heading || item || blank || line.startsWith(">")) flushPara();
    if (!item) flushList();
    blank = false;
    if (fence) code = { lang: fence[1], lines: [] };
    else if (heading) out.push(`<h${heading[1].length + 2}>${inline(heading[2])}</h${heading[1].length + 2}>`);
    else if (item) {
      const tag = item[1] ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      list = list || { tag, start: Number(item[2] || 1), items: [] };
      list.items.push([item[3]]);
    } else if (line.startsWith(">")) out.push(`<blockquote>${inline(line.replace(/^>\s?/, ""))}</blockquote>`);
    else para.push(line);
  }
  if (code) out.push(codeBlock(code.lang, code.lines));
  flushPara();
  flushList();
  return out.join("");
}
