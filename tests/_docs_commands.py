"""Helpers of tests/test_docs_commands.py (loaded by file path: tests/ is not a package): extracting the shell
commands of Markdown pages, matching shown output, and the static checks of a command (`lint_command`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.S | re.M)
CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


@dataclasses.dataclass(frozen=True)
class DocCommand:
    file: str            # relative to the repo root
    line: int            # 1-based line of the command's first line
    command: str
    expected: tuple[str, ...] = ()   # output lines shown after a `$ ` line


def strip_comment(line: str) -> str:
    """`cmd args   # comment` -> `cmd args` (a `#` inside quotes stays)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def shell_commands(text: str, file: str = "") -> list[DocCommand]:
    """The shell commands of a Markdown text: every line of bash/sh/shell/console blocks, `$ ` lines anywhere."""
    out = []
    for m in FENCE.finditer(text):
        lang, body = m.group(1).lower(), m.group(2)
        first_line = text[:m.start()].count("\n") + 2
        lines = body.splitlines()
        dollar = any(ln.startswith("$ ") for ln in lines)
        if lang not in SHELL_LANGS and not dollar:
            continue
        i = 0
        while i < len(lines):
            start, raw = i, lines[i]
            i += 1
            if dollar and not raw.startswith("$ "):
                continue  # output of the previous `$ ` line (read below) or prose in a console block
            raw = raw[2:] if raw.startswith("$ ") else raw
            parts = [strip_comment(raw)]
            while parts[-1].endswith("\\") and i < len(lines):
                parts[-1] = parts[-1][:-1].rstrip()
                parts.append(strip_comment(lines[i]).strip())
                i += 1
            command = " ".join(p for p in parts if p).strip()
            expected = []
            if dollar:
                while i < len(lines) and not lines[i].startswith("$ ") and lines[i].strip():
                    expected.append(lines[i])
                    i += 1
            if command:
                out.append(DocCommand(file, first_line + start, command, tuple(expected)))
    return out


def documented_commands() -> list[DocCommand]:
    return [c for f in DOC_FILES for c in shell_commands(f.read_text(), str(f.relative_to(ROOT)))]


def output_matches(expected: tuple[str, ...], output: str) -> list[str]:
    """Expected output lines (`...` = anything) that appear in no line of `output`."""
    lines = output.splitlines()
    missing = []
    for exp in expected:
        pattern = ".*".join(re.escape(part.strip()) for part in re.split(r"\[?\.\.\.\]?", exp))
        if not any(re.search(pattern, ln) for ln in lines):
            missing.append(exp)
    return missing


# ---------------------------------------------------------------------------------------------------- static check
PLACEHOLDER = re.compile(r"^(\.\.\.|\[.*|.*\]|[A-Z][A-Z0-9_:.|/-]*|.*<.*>.*|.*\|.*|(dotted\.)?(key|k)=(value|v))$")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def lint_mmrl(args: list[str]) -> list[str]:
    """Problems of an `mmrl ...` argument list: unknown subcommands, options, choices and config keys."""
    from mmrl.cli import DEMO_CONFIGS, build_parser
    from mmrl.config import RECIPES, ConfigError, apply_overrides, default_config, load_config

    problems, parser, path, config, overrides = [], build_parser(), ["mmrl"], None, []
    i = 0
    while i < len(args):
        tok = args[i].strip("[]")
        i += 1
        if not tok or PLACEHOLDER.match(args[i - 1]) and not tok.startswith("-"):
            continue
        if tok.startswith("-"):
            name = tok.split("=", 1)[0]
            action = parser._option_string_actions.get(name)
            if action is None:
                problems.append(f"`{' '.join(path)}` has no option {name}")
            elif action.nargs != 0 and "=" not in tok and i < len(args):
                value = args[i].strip("[]")
                i += 1
                if action.choices and not PLACEHOLDER.match(value) and value not in action.choices:
                    problems.append(f"`{' '.join(path)} {name}`: {value!r} is not one of {sorted(action.choices)}")
            continue
        subs = _subparsers(parser)
        if subs:
            if tok not in subs:
                problems.append(f"`{' '.join(path)}` has no subcommand {tok!r} (valid: {sorted(subs)})")
                return problems
            parser = subs[tok]
            path.append(tok)
        elif "=" in tok and re.match(r"^[a-z_]+(\.[a-z_0-9]+)*=", tok):
            overrides.append(tok)
        elif tok.endswith((".yaml", ".yml")):
            config = tok
        elif path[-1] == "demo" and tok in DEMO_CONFIGS:
            config = str(ROOT / DEMO_CONFIGS[tok])
    if overrides:
        if config and (ROOT / config).is_file():
            try:
                load_config(ROOT / config, overrides)
            except (ConfigError, ValueError) as exc:
                problems.append(f"{config} {' '.join(overrides)}: {exc}")
        else:  # no real config named: each key must exist in some recipe
            for ov in overrides:
                errors = []
                for algo in sorted(RECIPES):
                    try:
                        apply_overrides(default_config(algo), [ov])
                        break
                    except (ConfigError, ValueError) as exc:
                        errors.append(str(exc))
                else:
                    problems.append(f"{ov}: no recipe has this key ({errors[0]})")
    return problems


def lint_command(command: str) -> list[str]:
    """Static problems of one documented command (see the module docstring)."""
    command = re.split(r"\s(?:>|\||&&|;)\s", command)[0]
    try:
        tokens = shlex.split(command)
    except ValueError:
        return []
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):  # VAR=value prefixes
        tokens.pop(0)
    if not tokens:
        return []
    tool = tokens[0].removeprefix(".venv/bin/")
    rest = tokens[1:]
    if tool in ("torchrun", "accelerate", "python", "python3"):
        if tool == "accelerate":
            rest = rest[1:] if rest[:1] == ["launch"] else rest
        if "-m" in rest:
            module, rest = rest[rest.index("-m") + 1], rest[rest.index("-m") + 2:]
            if module == "mmrl.cli":
                return lint_mmrl(rest)
            return [] if importlib.util.find_spec(module) else [f"no module {module}"]
        if tool.startswith("python") and rest and rest[0].endswith(".py"):
            script = ROOT / rest[0]
            if not script.is_file():
                return [f"no script {rest[0]}"]
            source = script.read_text()
            return [f"{rest[0]} has no option {f}" for f in rest[1:]
                    if f.startswith("--") and f"\"{f.split('=')[0]}\"" not in source]
        return []
    if tool == "mmrl":
        return lint_mmrl(rest)
    if tool == "make":
        makefile = (ROOT / "Makefile").read_text()
        return [f"Makefile has no target {t}" for t in rest if not t.startswith("-") and "=" not in t
                and not re.search(rf"^{re.escape(t)}:", makefile, re.M)]
    if tool == "pip":
        extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        named = {e.strip() for t in rest for group in re.findall(r"(?:^\.|^mmrl)\[([^\]]+)\]", t)
                 for e in group.split(",")}
        return [f"pyproject.toml has no extra [{e}]" for e in sorted(named - extras)]
    return []


def inline_commands(text: str) -> list[str]:
    """Commands in `code spans` and synopsis lines of unlabelled blocks that start with a tool mmrl documents."""
    starts = r"^(\.venv/bin/)?(mmrl|python|torchrun|accelerate launch|make|pip install)\b"
    out = []
    for m in FENCE.finditer(text):
        if not m.group(1):
            out += [ln.strip() for ln in m.group(2).splitlines() if re.match(starts, ln.strip())]
    prose = FENCE.sub("", text)
    out += [s for s in CODE_SPAN.findall(prose) if re.match(starts, s)]
    return out


HELP_OVERRIDE = re.compile(r"(?<![\w./-])([a-z_]+(?:\.[a-z_0-9]+)+=[^\s,;)]+)")  # e.g. train.max_steps=10
HELP_COMMAND = re.compile(r"(`?)\b(mmrl ([a-z][\w-]*)(?: [^\s;:,()`]+)*)")  # an `mmrl ...` command in a help


def help_texts(parser: argparse.ArgumentParser | None = None, path: tuple[str, ...] = ("mmrl",)
               ) -> list[tuple[tuple[str, ...], str]]:
    """(subcommand path, text) of every description, epilog and help string in `mmrl`'s parser tree (what
    `mmrl ... --help` prints)."""
    from mmrl.cli import build_parser

    parser = parser or build_parser()
    out = [(path, t) for t in (parser.description, parser.epilog) if t]
    for action in parser._actions:
        if action.help and action.help != argparse.SUPPRESS:
            out.append((path, action.help))
        if isinstance(action, argparse._SubParsersAction):
            out += [(path + (c.dest,), c.help) for c in action._choices_actions if c.help]
            for name, sub in action.choices.items():
                out += help_texts(sub, path + (name,))
    return out


def help_examples() -> list[tuple[str, str]]:
    """(where, command) of every example in `mmrl --help` texts: a quoted `mmrl ...` command as written, and each
    `key=value` override as `mmrl <subcommand> <override>` (the subcommand whose help shows it)."""
    from mmrl.cli import build_parser

    subcommands, out = _subparsers(build_parser()), []
    for path, text in help_texts():
        where = " ".join(path) + " --help"
        # prose such as "the mmrl client" is no command: a command names a subcommand, or is in `backticks`
        out += [(where, c) for tick, c, sub in HELP_COMMAND.findall(text) if tick or sub in subcommands]
        out += [(where, " ".join(path + (o,))) for o in HELP_OVERRIDE.findall(text)]
    return sorted(set(out))
