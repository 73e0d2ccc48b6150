"""Renders a Jinja chat template as Hugging Face's tokenizers do (jinja2 with trim_blocks,
lstrip_blocks and loop controls), the reference for templates llama.cpp's
llama_chat_apply_template does not render (Gemma 4's), with no BOS text.

python3 render_chat_template.py TEMPLATE MESSAGES_JSON [prompt] > rendered text
"""
import json
import sys

import jinja2


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                                 extensions=["jinja2.ext.loopcontrols"])
environment.globals["raise_exception"] = raise_exception
with open(sys.argv[1], encoding="utf-8") as f:
    template = environment.from_string(f.read())
with open(sys.argv[2], encoding="utf-8") as f:
    messages = json.load(f)
sys.stdout.write(template.render(messages=messages, bos_token="", eos_token="",
                                 add_generation_prompt=len(sys.argv) > 3))
