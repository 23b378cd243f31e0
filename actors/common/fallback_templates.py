"""Chat templates a family falls back to when its checkpoint carries none (many GGUF files have no
`tokenizer.chat_template`, e.g. the Gemma 3 270M Q4_K_M file the tests serve). Each writes the family's own turn
format; no torch here (the launcher and the tokenizer actor read it, through model_source.py)."""

from __future__ import annotations

# Gemma 2/3: `<start_of_turn>user|model`, no system role (a system message opens the first user turn, as
# Gemma 3's own template does), roles alternating from the user, contents trimmed.
GEMMA = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    "{% set turns = messages[1:] if system is not none else messages %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{% if loop.first and system is not none %}{{ (system if system is string else system[0]['text']) + '\\n\\n' }}"
    "{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

FALLBACK_TEMPLATES = {"gemma2": GEMMA, "gemma3": GEMMA}


def fallback_template(family: str) -> str | None:
    """The chat template `family` uses when its checkpoint has none (None: the tokenizer's default applies)."""
    return FALLBACK_TEMPLATES.get(family)
