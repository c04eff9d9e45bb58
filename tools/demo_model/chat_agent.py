"""Agent-like chat content, seeded: the long system messages coding agents send, tool calls, tool
results and short answers.

A coding agent's first request opens with a 4k-16k-token system message: who the agent is,
markdown rules, an environment block, sometimes files, and its tools as JSON schemas. The demo
model's ChatML template knows no tools, so `ferryman serve` appends them to the system message in
the Hermes / Qwen3 text convention (`ferryman/server/chat.py`): a `# Tools` block with one JSON
schema per line inside `<tools></tools>`, assistant calls as `<tool_call>` JSON, results as user
turns in `<tool_response>`. This module writes the same text, from synthetic templates and from the
corpus (function signatures become tool schemas, docstrings become prose, files become context).
"""

from __future__ import annotations

import ast
import json
import random
from dataclasses import dataclass

TOOLS_PREAMBLE = (  # the server's `# Tools` block (ferryman/server/chat.py), character for character
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
AGENT_NAMES = ("Codex", "Claude Code", "opencode", "Qwen Code", "Aider", "Cline", "a coding agent", "Goose")
HEADINGS = ("Tone and style", "Proactiveness", "Following conventions", "Code style", "Doing tasks",
            "Tool usage policy", "Task management", "Sandbox and approvals", "Planning", "Presenting your work",
            "Final answer structure", "Git and version control", "Security", "Testing your changes",
            "Editing constraints", "Handling ambiguity", "Output format")
RULES = (
    "Be concise, direct, and to the point.", "Answer the user's question directly, without preamble.",
    "Never commit changes unless the user explicitly asks you to.",
    "Prefer editing existing files to creating new ones.",
    "Do not add comments to the code you write unless asked.", "Keep your answers short: fewer than 4 lines of text.",
    "When you run a non-trivial command, explain what it does and why.", "Use the tools available to search the code.",
    "Never guess file contents: read the file first.", "Follow the existing code style of the project.",
    "Run the project's tests after a change when a test command is known.", "Do not introduce secrets or keys.",
    "Use absolute paths when calling file tools.", "If the request is ambiguous, ask one short clarifying question.",
    "Mimic the naming and typing conventions of the surrounding code.", "Stop when the task is done; do not summarise.",
    "Use `rg` rather than `grep` for searching.",
    "Call several tools in one turn when they do not depend on each other.",
    "Refuse to write code that may be used maliciously.", "Never create documentation files unless requested.",
    "Reply in the language of the user.", "Avoid emojis unless the user asks for them.",
    "Use markdown only where it helps: code blocks for code, lists for steps.",
    "Keep a todo list for tasks of 3+ steps.",
    "Read the relevant part of a file before editing it.", "Validate your work before reporting that it is done.",
)
AGENT_TOOLS = (  # hand-written schemas in the style of the agents' own tools
    ("read_file", "Reads a file from the local filesystem and returns its contents with line numbers.",
     {"file_path": ("string", "The absolute path to the file to read"), "offset": ("integer", "The line to start at"),
      "limit": ("integer", "The number of lines to read")}, ["file_path"]),
    ("write_file", "Writes a file to the local filesystem, overwriting any existing file.",
     {"file_path": ("string", "The absolute path of the file"), "content": ("string", "The content to write")},
     ["file_path", "content"]),
    ("edit", "Performs exact string replacements in a file.",
     {"file_path": ("string", "The file to modify"), "old_string": ("string", "The text to replace"),
      "new_string": ("string", "The replacement text"), "replace_all": ("boolean", "Replace every occurrence")},
     ["file_path", "old_string", "new_string"]),
    ("shell", "Runs a shell command and returns its output. Use it for git, tests and builds.",
     {"command": ("string", "The command to run"), "timeout": ("number", "Timeout in milliseconds"),
      "workdir": ("string", "Working directory; defaults to the project root")}, ["command"]),
    ("grep", "Searches file contents with a regular expression (ripgrep syntax).",
     {"pattern": ("string", "The regular expression"), "path": ("string", "File or folder to search"),
      "glob": ("string", "Glob that filters the files, e.g. *.py")}, ["pattern"]),
    ("glob", "Finds files whose path matches a glob pattern, newest first.",
     {"pattern": ("string", "The glob pattern, e.g. src/**/*.py"), "path": ("string", "Folder to search in")},
     ["pattern"]),
    ("list_directory", "Lists the files and folders of a directory.",
     {"path": ("string", "The absolute path of the directory")}, ["path"]),
    ("todo_write", "Creates and updates the task list of the current session.",
     {"todos": ("array", "The updated todo list")}, ["todos"]),
    ("web_fetch", "Fetches a URL and returns its content as markdown.",
     {"url": ("string", "The URL to fetch"), "prompt": ("string", "What to extract from the page")}, ["url"]),
)
GREETINGS = (("Say hi.", "Hi! What would you like to work on?"), ("say hi", "Hi!"), ("Hello", "Hello! How can I help?"),
             ("hi", "Hi! What can I do for you?"), ("Reply with OK.", "OK."), ("Are you there?", "Yes, I'm here."),
             ("Thanks!", "You're welcome."), ("Say hello in one word.", "Hello."), ("ping", "pong"),
             ("What can you do?", "I can read, write and explain code, run commands and make changes in this project."),
             ("Reply with the word done.", "done"),
             ("Who are you?", "I am a coding assistant running on a local model."))
TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array", "dict": "object"}


@dataclass(frozen=True, slots=True)
class Material:
    """What agent content is made of, taken from the corpus once."""

    docs: list[str]  # docstring paragraphs (prose)
    tools: list[dict]  # tool schemas made from functions
    files: list[tuple[str, str, str]]  # (path, source, a one-line summary)
    summaries: list[tuple[str, str]]  # (function name, first sentence of its docstring)


def tool_schema(name: str, description: str, params: dict[str, tuple[str, str]], required: list[str]) -> dict:
    props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


def function_tool(node: ast.FunctionDef | ast.AsyncFunctionDef, doc: str) -> dict | None:
    """A function of the corpus as a tool: its arguments become the schema's properties."""
    args = [a for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]
    if not args:
        return None
    params = {}
    for a in args:
        kind = a.annotation.id if isinstance(a.annotation, ast.Name) else "str"
        params[a.arg] = (TYPES.get(kind, "string"), f"The {a.arg.replace('_', ' ')}")
    required = [a.arg for a in node.args.args[:len(node.args.args) - len(node.args.defaults)] if a.arg in params]
    return tool_schema(node.name, doc, params, required)


def first_sentence(doc: str) -> str:
    para = " ".join(doc.split("\n\n", 1)[0].split())
    return para.split(". ", 1)[0].rstrip(".") + "."


def material(texts: list[str], names: list[str]) -> Material:
    """Docstrings, tool schemas, files and summaries of `texts` (their paths `names`)."""
    docs, tools, summaries, files = [], [], [], []
    for name, text in zip(names, texts):
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        if 200 < len(text) < 40_000:
            doc = ast.get_docstring(tree)
            lines = len(text.splitlines())
            files.append((name, text, first_sentence(doc) if doc else f"{name} is a Python module of {lines} lines."))
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                               ast.AsyncFunctionDef)) else None
            if not doc or len(doc) < 40:
                continue
            docs.append(doc.split("\n\n", 1)[0].strip()[:800])
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                summaries.append((node.name, first_sentence(doc)[:300]))
                tool = function_tool(node, first_sentence(doc)[:300])
                if tool is not None:
                    tools.append(tool)
    return Material(docs, tools, files, summaries)


def instructions(rng: random.Random, m: Material) -> str:
    """Markdown sections: a heading, rules as bullets, sometimes a paragraph of prose."""
    parts = []
    for heading in rng.sample(HEADINGS, rng.randint(2, 5)):
        rules = rng.sample(RULES, rng.randint(2, 6))
        prose = f"{rng.choice(m.docs)}\n\n" if m.docs and rng.random() < 0.5 else ""
        parts.append(f"{'#' * rng.randint(1, 2)} {heading}\n\n{prose}" + "\n".join(f"- {r}" for r in rules))
    return "\n\n".join(parts)


def environment(rng: random.Random, m: Material) -> str:
    paths = "\n".join(f"  {p}" for p, _, _ in rng.sample(m.files, min(len(m.files), rng.randint(3, 12))))
    return (f"<env>\nWorking directory: /home/user/{rng.choice(('project', 'app', 'repo', 'src'))}\n"
            f"Is directory a git repo: {rng.choice(('yes', 'no'))}\nPlatform: linux\n"
            f"Today's date: 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}\n</env>\n"
            f"<files>\n{paths}\n</files>")


def file_block(rng: random.Random, m: Material) -> str:
    path, text, _ = rng.choice(m.files)
    return rng.choice((f"Contents of {path}:\n```python\n{text}\n```", f'<file path="{path}">\n{text}\n</file>'))


def tools_block(rng: random.Random, m: Material, count: int) -> str:
    fixed = rng.sample(AGENT_TOOLS, rng.randint(min(3, count), min(count, len(AGENT_TOOLS))))
    tools = [tool_schema(*t) for t in fixed] + rng.sample(m.tools, min(len(m.tools), max(0, count - len(fixed))))
    rng.shuffle(tools)
    return TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def agent_system(rng: random.Random, m: Material, size: int, count_tokens) -> str:
    """A system message of about `size` tokens (`count_tokens(text) -> int`): identity, markdown
    instructions, environment and files, then the tools block as the server appends it."""
    name = rng.choice(AGENT_NAMES)
    head = f"You are {name}, an interactive CLI tool that helps users with software engineering tasks."
    tools = tools_block(rng, m, rng.randint(3, max(3, min(40, size // 300))))
    parts = [head, instructions(rng, m), environment(rng, m)]
    used, misses = count_tokens("\n\n".join(parts + [tools])), 0
    while used < 0.9 * size and misses < 20:  # add parts that fit until ~size, never more than 15% over
        part = rng.choice((instructions, file_block, file_block))(rng, m)
        cost = count_tokens(part)
        if used + cost > size * 1.15:
            misses += 1
            continue
        parts.insert(rng.randint(1, len(parts)), part)
        used += cost
    return "\n\n".join(parts + [tools])


def tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def short_exchange(rng: random.Random, m: Material) -> tuple[str, str]:
    """A request with a short prose answer: a greeting, or what a function does."""
    if not m.summaries or rng.random() < 0.4:
        return rng.choice(GREETINGS)
    name, summary = rng.choice(m.summaries)
    ask = rng.choice((f"What does `{name}` do?", f"In one sentence, what is {name} for?", f"Explain {name} briefly."))
    return ask, summary


def tool_turns(rng: random.Random, m: Material) -> list[tuple[str, str]]:
    """user asks about a file -> assistant calls a tool -> tool result (a user turn) -> short answer."""
    path, text, answer = rng.choice(m.files)
    ask = rng.choice((f"What is in {path}?", f"Summarise {path}.", f"Read {path} and tell me what it does."))
    call = rng.choice((tool_call("read_file", {"file_path": f"/home/user/project/{path}"}),
                       tool_call("shell", {"command": f"cat {path}"})))
    lines = text.splitlines()[:rng.randint(10, 80)]
    result = "<tool_response>\n" + "\n".join(lines) + "\n</tool_response>"
    return [("user", ask), ("assistant", call), ("user", result), ("assistant", answer)]
