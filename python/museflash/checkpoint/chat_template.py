"""A checkpoint's chat template, rendered the way transformers' `apply_chat_template` renders it:
Jinja2 in a sandbox, with `raise_exception`, the `tojson` filter, `messages`,
`add_generation_prompt` and the tokenizer's special tokens by role (`bos_token`, ...).

The template itself travels with the checkpoint: `chat_template` in `tokenizer_config.json`
(as transformers writes it, and as museflash writes it for a GGUF file: checkpoint/gguf.py), or
a `chat_template.jinja` beside it.

`check_renderable` holds a template to the Jinja subset the Swift runtime renders
(swift/Sources/ChatTemplate): what it refuses, the Swift renderer refuses at parse time too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")

# The Jinja subset the Swift renderer implements. These lists mirror swift/Sources/ChatTemplate
# (Parser.swift's `Supported`); change both together.
SWIFT_NODES = frozenset({
    "Template", "Output", "TemplateData", "For", "If", "Assign", "NSRef", "Name", "Const", "List",
    "Tuple", "Dict", "Pair", "Getattr", "Getitem", "Slice", "Add", "Sub", "Mul", "Div", "FloorDiv",
    "Mod", "Pow", "Concat", "Compare", "Operand", "And", "Or", "Not", "Neg", "Pos", "CondExpr",
    "Test", "Filter", "Call", "Keyword"})
SWIFT_FILTERS = frozenset({
    "capitalize", "count", "d", "default", "first", "int", "items", "join", "last", "length",
    "list", "lower", "replace", "reverse", "safe", "string", "title", "tojson", "trim", "upper"})
SWIFT_TESTS = frozenset({
    "boolean", "defined", "even", "false", "float", "integer", "iterable", "mapping", "none",
    "number", "odd", "sequence", "string", "true", "undefined"})
SWIFT_FUNCTIONS = frozenset({"namespace", "raise_exception", "range"})
SWIFT_METHODS = frozenset({
    "endswith", "get", "items", "keys", "lower", "lstrip", "replace", "rstrip", "split",
    "startswith", "strip", "title", "upper", "values"})
# Jinja's node types outside the subset, by the tag a template writes.
_TAG_NAMES = {"Macro": "{% macro %}", "CallBlock": "{% call %}", "FilterBlock": "{% filter %}",
              "Include": "{% include %}", "Import": "{% import %}", "FromImport": "{% from %}",
              "Extends": "{% extends %}", "Block": "{% block %}", "With": "{% with %}",
              "ScopedEvalContextModifier": "{% autoescape %}",
              "EvalContextModifier": "{% autoescape %}", "AssignBlock": "{% set %} block",
              "ExprStmt": "{% do %}", "Break": "{% break %}", "Continue": "{% continue %}"}


class ChatTemplateError(ValueError):
    """A template that cannot be rendered; names it and why."""


def read_chat_template(checkpoint_dir: str | Path) -> tuple[str, dict[str, str]] | None:
    """(template, special tokens by role) of a checkpoint folder, or None without a template."""
    directory = Path(checkpoint_dir)
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    template = config.get("chat_template")
    if (directory / TEMPLATE_FILE).is_file():
        template = (directory / TEMPLATE_FILE).read_text()
    if not isinstance(template, str):
        return None
    special = {role: config[role] for role in SPECIAL_TOKEN_ROLES
               if isinstance(config.get(role), str)}
    return template, special


def render_chat(template: str, messages: Sequence[Mapping[str, str]], *,
                add_generation_prompt: bool = True,
                special_tokens: Mapping[str, str] | None = None) -> str:
    """The conversation `messages` ({"role", "content"} each) as the template writes it."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"the chat template refused the conversation: {message}")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent)
    environment.globals["raise_exception"] = raise_exception
    try:
        compiled = environment.from_string(template)
        return compiled.render(messages=[dict(m) for m in messages],
                               add_generation_prompt=add_generation_prompt,
                               **dict(special_tokens or {}))
    except TemplateError as error:
        raise ChatTemplateError(f"the chat template cannot be rendered ({error}); "
                                "fix: correct the template") from error


def user_turn_ids(checkpoint_dir: str | Path, texts: Sequence[str]) -> list[list[int]] | None:
    """Each text as one user turn rendered by the folder's chat template (generation prompt
    added), in its tokenizer.json's ids; None when the folder has no template."""
    from tokenizers import Tokenizer

    found = read_chat_template(checkpoint_dir)
    if found is None:
        return None
    template, special = found
    tokenizer = Tokenizer.from_file(str(Path(checkpoint_dir) / "tokenizer.json"))
    return [tokenizer.encode(render_chat(template, [{"role": "user", "content": text}],
                                         special_tokens=special),
                             add_special_tokens=False).ids for text in texts]


def _unsupported(template: str) -> list[tuple[str, int]]:
    """(construct, line) of each node outside the Swift renderer's subset, in template order."""
    from jinja2 import Environment, nodes

    found: list[tuple[str, int]] = []

    def visit(node: nodes.Node) -> None:
        kind = type(node).__name__
        line = getattr(node, "lineno", 1) or 1
        if kind not in SWIFT_NODES:
            found.append((_TAG_NAMES.get(kind, f"the Jinja node {kind}"), line))
        elif isinstance(node, nodes.For) and node.recursive:
            found.append(("{% for ... recursive %}", line))
        elif isinstance(node, nodes.Filter) and node.name not in SWIFT_FILTERS:
            found.append((f"filter {node.name}", line))
        elif isinstance(node, nodes.Test) and node.name not in SWIFT_TESTS:
            found.append((f"test {node.name}", line))
        elif isinstance(node, nodes.Call):
            if isinstance(node.node, nodes.Name):
                if node.node.name not in SWIFT_FUNCTIONS:
                    found.append((f"function {node.node.name}()", line))
            elif isinstance(node.node, nodes.Getattr):
                if node.node.attr not in SWIFT_METHODS:
                    found.append((f"method .{node.node.attr}()", line))
            else:
                found.append(("a call of a computed value", line))
        if isinstance(node, (nodes.Call, nodes.Filter, nodes.Test)) and (
                node.dyn_args is not None or node.dyn_kwargs is not None):
            found.append(("*args or **kwargs in a call", line))
        for child in node.iter_child_nodes():
            visit(child)

    visit(Environment(trim_blocks=True, lstrip_blocks=True).parse(template))
    return found


def unsupported_constructs(template: str) -> list[str]:
    """The constructs of `template` (each once, in order) the Swift renderer does not implement,
    e.g. "{% macro %}", "filter map", "function strftime_now()"; empty when it renders it all.
    Raises jinja2.TemplateSyntaxError for a template that is not valid Jinja."""
    return list(dict.fromkeys(name for name, _ in _unsupported(template)))


def check_renderable(template: str) -> None:
    """Raises ChatTemplateError, naming the first construct, unless the Swift renderer
    (swift/Sources/ChatTemplate) implements everything `template` uses."""
    from jinja2 import TemplateSyntaxError

    try:
        found = _unsupported(template)
    except TemplateSyntaxError as error:
        raise ChatTemplateError(
            f"chat template line {error.lineno}: not valid Jinja ({error.message}); "
            "fix: correct the template") from error
    if found:
        name, line = found[0]
        raise ChatTemplateError(
            f"chat template line {line}: {name} is not supported by museflash's Swift renderer; "
            "fix: remove it from the template or render prompts yourself")
