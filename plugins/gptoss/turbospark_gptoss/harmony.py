"""The harmony chat format gpt-oss was trained on, as a Jinja template for installs that carry none.

Every message is ``<|start|>{role}<|message|>{content}<|end|>``; an assistant
message names its channel (``final`` by default, its ``thinking`` goes first
on ``analysis``), a tool result speaks as ``functions.{name}`` to the
assistant on ``commentary``, and the generation prompt opens an assistant
message (``<|start|>assistant``), leaving the channel to the model. Like the
checkpoints' own templates the text starts with ``bos_token`` (empty when the
tokenizer has none).
"""

from __future__ import annotations

ROLES = ("system", "developer", "user", "assistant", "tool")

TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- if role not in " + repr(list(ROLES)) + " -%}"
    "{{- raise_exception('harmony has no role ' ~ role ~ '; use " + ", ".join(ROLES) + "') -}}"
    "{%- elif role == 'assistant' -%}"
    "{%- if message.get('thinking') -%}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message['thinking'] }}<|end|>"
    "{%- endif -%}"
    "<|start|>assistant<|channel|>{{ message.get('channel') or 'final' }}<|message|>{{ message['content'] }}<|end|>"
    "{%- elif role == 'tool' -%}"
    "<|start|>functions.{{ message.get('name') or 'tool' }} to=assistant<|channel|>commentary<|message|>"
    "{{ message['content'] }}<|end|>"
    "{%- else -%}"
    "<|start|>{{ role }}<|message|>{{ message['content'] }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
