"""The prompt text of a chat request: the tokenizer's chat template, with vLLM's ``continue_final_message``.

A continued answer (the gateway's stall fallback sends one: the messages plus an assistant message holding the text
already streamed) must end inside that message, with no end-of-turn marker and no new assistant header, so that the
model carries on from its last character. Chat templates have no switch for that; as vLLM and Hugging Face do, the
conversation is rendered closed and cut right after the final message's content.
"""

from __future__ import annotations

from typing import Any


def render_chat_prompt(tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                       continue_final_message: bool = False) -> str:
    if not continue_final_message:
        return tok.render_chat(messages, add_generation_prompt=add_generation_prompt)
    content = messages[-1].get("content") or ""
    if not content:  # nothing to continue: an empty open assistant turn is a fresh one
        return tok.render_chat(messages[:-1], add_generation_prompt=True)
    rendered = tok.render_chat(messages, add_generation_prompt=False)
    at = rendered.rfind(content)
    if at >= 0:
        return rendered[:at + len(content)]
    core = content.strip()  # a template that trims the content: cut after what it kept, give back what it trimmed
    at = rendered.rfind(core) if core else -1
    if at < 0:
        raise ValueError("the chat template does not render the final message's content as it is, so it cannot be "
                         "continued (continue_final_message)")
    return rendered[:at + len(core)] + content[len(content.rstrip()):]
