"""Chat messages to a prompt: the model's jinja2 chat template, rendered the way transformers'
apply_chat_template renders it (a sandboxed environment, trim_blocks and lstrip_blocks, the loop
controls, raise_exception), or DEFAULT_TEMPLATE for a model that has none.

    text = render(tok, [{"role": "user", "content": "Hello"}])
    ids = tok.encode(text)   # no BOS added: a template that wants one writes it itself
"""

import bisect
import functools

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant")

# For a model without a template (a base model, the quickstart's characters): plain text that any
# vocabulary with letters can spell, ending where the assistant's turn begins.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: {{ message['content'] }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


class ChatError(ValueError):
    """Messages that can't be rendered; the message says which and why."""


def check_messages(messages) -> list[dict]:
    """[{role, content}] with a known role and string content, or ChatError naming the bad one."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ChatError(f"messages[{i}] must be an object with a role of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ChatError(f"messages[{i}].content must be a string")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def _raise(message):
    raise ChatError(message)


def render(tok, messages, add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` with tok's chat template (or DEFAULT_TEMPLATE)."""
    messages = check_messages(messages)
    special = lambda i: None if i is None else tok.decode([i])
    try:
        return _compiled(tok.chat_template or DEFAULT_TEMPLATE).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=special(tok.bos_token) or "",
            eos_token=special(tok.eot_token) or "",
        )
    except jinja2.TemplateError as e:
        raise ChatError(f"the model's chat template failed: {e}") from None


def tokenize_conversation(tok, messages) -> tuple[list[int], list[int]]:
    """(ids, mask) of a whole conversation for fine-tuning: the template's text for all of it,
    tokenized in one piece (as transformers' apply_chat_template does), and 1 on each token of an
    assistant turn up to and including its end-of-turn token (the first of tok's stop tokens), 0
    on the rest: the prompts, the template's headers, what follows an end of turn.

    An assistant turn is the text the template adds between the prompt serve.py would send for
    it (the messages before it, with the generation prompt) and the conversation up to it. A
    template that does not render a conversation as a sequence of such prefixes (one that drops
    earlier turns' reasoning, say) is a ChatError, and so is a conversation without an assistant turn.
    """
    messages = check_messages(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError("the conversation has no assistant turn: there is nothing to learn from it")
    if messages[0]["role"] == "assistant":
        raise ChatError("the conversation starts with the assistant: it needs a system or user message first")
    text = render(tok, messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tok, messages[:i], add_generation_prompt=True)
        upto = render(tok, messages[: i + 1], add_generation_prompt=False)
        if not (upto.startswith(prompt) and text.startswith(upto)):
            raise ChatError(
                f"the chat template does not render messages[{i}] (the assistant's) as an "
                f"addition to the conversation before it, so its tokens can't be told apart"
            )
        spans.append((len(prompt), len(upto)))
    ids, starts = tok.encode_with_offsets(text)
    mask, stop = [0] * len(ids), set(tok.stop_tokens)
    for begin, end in spans:  # token starts never decrease, so each span is a run of tokens
        for j in range(max(bisect.bisect_left(starts, begin), 1), bisect.bisect_left(starts, end)):
            mask[j] = 1  # (never the first token: nothing comes before it to predict it from)
            if ids[j] in stop:
                break  # the end of the turn; a newline after it is the template's, not the assistant's
    return ids, mask
