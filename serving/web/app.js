// The chat page: talks to this server's /v1 API with streamed requests (fetch and a stream reader).
// Text from the model or the user is only ever put into the page with textContent, never parsed
// as HTML: an answer containing <script> shows those characters.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top_k", "top_p", "max_tokens", "api_key"];
const saved = JSON.parse(localStorage.getItem("nanomax") || "{}");
const state = {messages: saved.messages || [], mode: saved.mode || "", prompt: saved.prompt || "",
               settings: saved.settings || {}};
let running = null;  // the AbortController of the request in flight

function save() {
  localStorage.setItem("nanomax", JSON.stringify(state));
}

function element(tag, className, text = "") {
  const node = document.createElement(tag);
  node.className = className;
  node.textContent = text;
  return node;
}

function button(label, onClick) {
  const node = element("button", "small", label);
  node.type = "button";
  node.addEventListener("click", onClick);
  return node;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
  if (message) $("error").scrollIntoView({block: "nearest"});
}

// ---------------------------------------------------------------- talking to the server

function headers() {
  const key = $("api_key").value.trim();
  return {"Content-Type": "application/json", ...(key ? {"Authorization": "Bearer " + key} : {})};
}

// An error response's message, from OpenAI's shape {"error": {"message": ...}} when it has it.
async function errorMessage(response) {
  let message = response.statusText;
  try {
    message = (await response.json()).error.message;
  } catch (_) { /* not JSON: keep the status text */ }
  if (response.status === 401) {
    $("api_key").focus();
    message += " (enter it in the API key field)";
  }
  return `error ${response.status}: ${message}`;
}

function sampling() {
  const number = (id) => $(id).valueAsNumber;  // empty: NaN, sent as null, the server's default
  return {temperature: number("temperature"), top_k: number("top_k"), top_p: number("top_p"),
          max_tokens: number("max_tokens")};
}

// POSTs a streamed request and calls onText with each piece of text as it arrives. Resolves to a
// line for under the answer: tokens, tokens/s and finish reason ("stopped" if Stop was pressed).
async function stream(path, body, onText) {
  running = new AbortController();
  setRunning(true);
  const started = performance.now();
  let finish = null, usage = null;
  try {
    const response = await fetch(path, {method: "POST", headers: headers(), signal: running.signal,
      body: JSON.stringify({...body, ...sampling(), stream: true, stream_options: {include_usage: true}})});
    if (!response.ok) throw new Error(await errorMessage(response));
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) throw new Error("the connection closed before the answer ended");
      buffer += value;
      const events = buffer.split("\n\n");  // Server-Sent Events: "data: {json}" and a blank line
      buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") {
          const seconds = (performance.now() - started) / 1000;
          const tokens = usage ? usage.completion_tokens : 0;
          return `${tokens} tokens, ${(tokens / seconds).toFixed(1)} tokens/s, finish: ${finish}`;
        }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error("error: " + chunk.error.message);
        usage = chunk.usage || usage;
        for (const choice of chunk.choices) {
          const text = choice.text ?? choice.delta?.content ?? "";
          if (text) onText(text);
          finish = choice.finish_reason || finish;
        }
      }
    }
  } catch (error) {
    if (error.name === "AbortError") return "stopped";
    const message = error instanceof TypeError ? `the connection failed (${error.message})` : error.message;
    showError(message);
    return message;
  } finally {
    running = null;
    setRunning(false);
  }
}

function setRunning(busy) {
  $("stop").hidden = !busy;
  for (const id of ["send", "continue", "keep", "new"]) $(id).disabled = busy;
  document.querySelectorAll("#messages button").forEach((node) => { node.disabled = busy; });
  if (busy) showError("");
}

// ---------------------------------------------------------------- chat

function renderChat() {
  const last = state.messages.length - 1;
  $("messages").replaceChildren(...state.messages.map((message, i) => {
    const item = element("li", "message " + message.role);
    item.append(element("div", "role", message.role), element("div", "content", message.content));
    if (message.meta) item.append(element("div", "meta", message.meta));
    const actions = element("div", "actions");
    if (message.role === "user") actions.append(button("Edit", () => edit(item, i)));
    if (i === last) actions.append(button(message.role === "user" ? "Answer" : "Regenerate", regenerate));
    item.append(actions);
    return item;
  }));
  const bottom = $("error").hidden ? $("messages").lastElementChild : $("error");
  bottom?.scrollIntoView({block: "nearest"});
}

// Streams the assistant's answer to the conversation so far into a new message.
async function answer() {
  const system = $("system").value.trim();
  const messages = [...(system ? [{role: "system", content: system}] : []),
                    ...state.messages.map(({role, content}) => ({role, content}))];
  const reply = {role: "assistant", content: "", meta: ""};
  state.messages.push(reply);
  renderChat();
  const content = $("messages").lastElementChild.querySelector(".content");
  reply.meta = await stream("/v1/chat/completions", {messages}, (text) => {
    reply.content += text;
    content.textContent = reply.content;
  });
  if (!reply.content) state.messages.pop();  // nothing came: the user's message is last again
  save();
  renderChat();
}

function send(event) {
  event.preventDefault();
  const text = $("input").value;
  if (!text.trim() || running) return;
  $("input").value = "";
  state.messages.push({role: "user", content: text});
  answer();
}

function regenerate() {
  if (state.messages.at(-1)?.role === "assistant") state.messages.pop();
  answer();
}

// Turns a user message into a text box; saving it drops everything after it and answers again.
function edit(item, i) {
  const box = element("textarea", "edit");
  box.value = state.messages[i].content;
  const done = button("Save and answer", () => {
    state.messages = [...state.messages.slice(0, i), {role: "user", content: box.value}];
    answer();
  });
  item.querySelector(".content").replaceWith(box);
  item.querySelector(".actions").replaceChildren(done, button("Cancel", renderChat));
  box.focus();
}

// ---------------------------------------------------------------- completion

async function complete() {
  const prompt = $("prompt").value;
  state.prompt = prompt;
  save();
  $("output-prompt").textContent = prompt;
  $("output-text").textContent = "";
  $("output-meta").textContent = "";
  $("output-meta").textContent = await stream("/v1/completions", {prompt}, (text) => {
    $("output-text").textContent += text;
  });
}

function keepOutput() {
  $("prompt").value = $("output-prompt").textContent + $("output-text").textContent;
  $("output-prompt").textContent = $("output-text").textContent = "";
}

// ---------------------------------------------------------------- start

function setMode(mode) {
  $("mode").value = mode;
  $("chat").hidden = mode !== "chat";
  $("complete").hidden = mode !== "complete";
  $("new").hidden = mode !== "chat";
}

// The model's name, and the mode it suggests: chat if it has a chat template, else continue text.
async function loadModel() {
  try {
    const response = await fetch("/v1/models", {headers: headers()});
    if (!response.ok) throw new Error(await errorMessage(response));
    const model = (await response.json()).data[0];
    $("model").textContent = `${model.id} (context ${model.max_model_len} tokens)`;
    showError("");
    if (!state.mode) setMode(model.has_chat_template ? "chat" : "complete");
  } catch (error) {
    $("model").textContent = "not connected";
    showError(error instanceof TypeError ? `the server did not answer (${error.message})` : error.message);
  }
}

for (const id of SETTINGS) {
  if (state.settings[id] !== undefined) $(id).value = state.settings[id];
  $(id).addEventListener("change", () => {
    state.settings[id] = $(id).value;
    save();
    if (id === "api_key") loadModel();
  });
}
$("mode").addEventListener("change", () => {
  state.mode = $("mode").value;
  save();
  setMode(state.mode);
});
$("composer").addEventListener("submit", send);
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) send(event);
});
$("new").addEventListener("click", () => {
  state.messages = [];
  save();
  renderChat();
});
$("continue").addEventListener("click", complete);
$("keep").addEventListener("click", keepOutput);
$("stop").addEventListener("click", () => running?.abort());
$("prompt").value = state.prompt;
setMode(state.mode || "chat");
renderChat();
loadModel();
