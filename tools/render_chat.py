#!/usr/bin/env python3
"""Renders chat templates as transformers' apply_chat_template does (jinja2, not the JavaScript
port): make_chat_fixtures.js sends a JSON list of {"template", "vars"} on stdin and reads the list
of renderings on stdout. Where the two differ (the port's trim and strip are JavaScript's, which
strip another set of whitespace than Python's str.strip), this rendering is the one kept."""
import json
import sys

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# the environment of transformers' _compile_jinja_template
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
jobs = json.load(sys.stdin)
json.dump([env.from_string(j["template"]).render(**j["vars"]) for j in jobs], sys.stdout)
