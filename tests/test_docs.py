"""The docs must match the code: README.md and docs/*.md are read as a new user reads them.

1. Every `floodgate ...` command line (fenced and indented code blocks, inline code spans, and
   `command: [floodgate, ...]` lists in YAML examples; `make` targets, with `make up ARGS=...`
   read as `floodgate up ...`) parses with the real argparse parser that floodgate/cli.py builds
   (`build_parser`): the subcommands exist and every option is spelled exactly as the parser
   knows it (no abbreviations). `python -m floodgate.<tool>` lines parse with that tool's own
   parser (caught at its parse_args). So does every command line a `--help` shows (its
   examples and inline spans). Nothing is run. Options named alone in prose exist;
   flag/default tables and tables of an option's choices match the parsers.
2. Every `floodgate_*` metric name the docs mention is one the processor (extproc/metrics.py)
   or the controller (controller/metrics.py) registers, with the labels the docs give it, and
   docs/metrics.md lists every registered metric (its table is generated here:
   `.venv/bin/python tests/test_docs.py` rewrites it). FLOODGATE_* variables are read.
3. Every ```yaml example loads; those that are Floodgate processor or controller configs
   validate with the real models; dotted config keys in inline code (`pools[].limit.signal`,
   `policy.max_replicas`, `warm_pool.min_size`) exist in the models; actuator option tables
   match their models (names and defaults), and docs/controller.md's PolicyConfig defaults
   table gives each field's default; docs/compose.md's service table gives each compose.yaml
   service its image and tag.
4. Every relative link (and its #anchor), repository path (`deploy/kubernetes/...`), file
   named bare (`leases.lua`), test cited by name, module in docs/architecture.md's maps, Python
   import in a ```python example and dotted Python name (`extproc.state.read_demand`) exists.
5. docs/admission.md names the error code of every reply the shipped bootstrap's
   `local_reply_config` (envoy/local.yaml) rewrites into JSON.
6. Every Redis key the docs spell (`fg:{pool}:leases`, `fg:{<pool>}:gw:<gateway>`,
   `fg:controller:leader`) is one extproc/schema.py names, and docs/admission.md's table of a
   pool's keys lists every key schema.py names.

Fast (no network, no processes, no clock): a failure names the doc file and line. The only
skip lists are of words that are not Floodgate's (NOT_METRICS, EXTERNAL_OPTIONS,
EXTERNAL_PROGRAMS, NOT_CONFIG_KEYS, WRITTEN_BY_COMMANDS, NOT_KEYS), each entry commented.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import io
import re
import shlex
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from floodgate.controller import config as controller_config
from floodgate.controller.metrics import ControllerMetrics
from floodgate.extproc import config as extproc_config
from floodgate.extproc.metrics import Metrics
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from pydantic import BaseModel, ValidationError

from floodgate import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
METRICS_DOC = ROOT / "docs" / "metrics.md"

# Repository folders whose paths the docs cite, and how the installed package names them
# (pyproject's package-dir: floodgate/sim/data is sim/data in the repository).
REPO_DIRS = ("deploy", "bench", "docs", "tests", "extproc", "controller", "floodgate", "sim", "envoy")
INSTALLED_AS = {f"floodgate/{d}/": f"{d}/" for d in ("extproc", "controller", "sim", "bench", "envoy")}

# Words that match `floodgate_[a-z_]+` but are not metrics (and only these: a metric name that
# is wrong must fail).
NOT_METRICS = {
    "floodgate_extproc",  # the Envoy cluster of the processors (envoy/floodgate-cluster.yaml)
}


# --- reading the docs -----------------------------------------------------------------------


@dataclass(frozen=True)
class Doc:
    path: Path
    text: str

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))

    def line_of(self, offset: int) -> int:
        return line_at(self.text, offset)


def line_at(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language, its first content line and its text."""

    lang: str
    line: int
    text: str


FENCE = re.compile(r"^( *)(```+|~~~+)\s*([\w+-]*)[^\n]*$", re.M)


@functools.cache
def docs() -> tuple[Doc, ...]:
    return tuple(Doc(p, p.read_text()) for p in DOCS)


def fenced_blocks(doc: Doc) -> list[Block]:
    blocks, lines, i = [], doc.text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence[:3]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        blocks.append(Block(lang, i + 2, "\n".join(body)))
        i = j + 1
    return blocks


def prose(doc: Doc) -> str:
    """The text with fenced blocks blanked (line numbers kept)."""
    out, in_block, fence = [], False, ""
    for line in doc.text.split("\n"):
        m = FENCE.match(line)
        if m and (not in_block or line.strip().startswith(fence[:3])):
            in_block, fence = (not in_block), m.group(2)
            out.append("")
        else:
            out.append("" if in_block else line)
    return "\n".join(out)


INLINE = re.compile(r"(?<!`)`([^`]+?)`(?!`)", re.S)


def inline_spans(doc: Doc) -> Iterator[tuple[int, str]]:
    """(line, text) of every inline code span outside fenced blocks; a span may wrap lines."""
    text = prose(doc)
    for m in INLINE.finditer(text):
        yield line_at(text, m.start()), " ".join(m.group(1).split())


# --- 1. command lines -----------------------------------------------------------------------

# Programs that run the next words as a command: name -> how many of the following words are
# their own (flock's lock file, nice's -n N, ...).
WRAPPERS = {"flock": 1, "nice": 0, "time": 0, "exec": 0, "sudo": 0, "env": 0, "timeout": 1, "nohup": 0}
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
REDIRECT = re.compile(r"^\d*(>>?|<)(&\d+)?$")
REDIRECT_WITH_TARGET = re.compile(r"^\d*(>>?|<)(?![^>]*>$)\S+$")  # not a <placeholder>
ALTERNATION = "\x00"  # `extproc|controller` in prose: one word with choices, not a pipe
PLACEHOLDER = re.compile(r"^(<[^>]+>|\{[a-z_]+\}|[A-Z][A-Z0-9_]*|\.\.\.|…)$")
ELLIPSIS = ("...", "…")
SEPARATORS = {"|", "||", "&&", ";", "&"}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str
    argv: tuple[str, ...]
    mention: bool = False  # an inline code span: prose naming a command (see parse_problem)


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", (ROOT / "Makefile").read_text(), re.M))


def split_commands(words: list[str]) -> Iterator[list[str]]:
    cmd: list[str] = []
    for w in words:
        if w in SEPARATORS:
            yield cmd
            cmd = []
        else:
            cmd.append(w)
    yield cmd


def shell_words(text: str) -> list[str] | None:
    """The words of a shell line, with `|`, `&&`, `;` as words of their own, comments,
    redirections and `[optional]` brackets removed; None if it does not split."""
    text = re.sub(r"(^|\s)#.*$", "", text)  # a comment
    # A placeholder with spaces is one word: `<processor metrics port>`.
    text = re.sub(r"<([A-Za-z][^<>]*)>", lambda m: "<" + re.sub(r"\W+", "_", m.group(1)) + ">", text)
    # Redirections: 2>&1, > file, >> file, < file (not a <placeholder>).
    text = re.sub(r"(?<![\w<>-])\d*>>?&\d+", " ", text)
    text = re.sub(r"(?<![\w<>-])\d*(>>?|<)\s*(?![\w-]*>)[^\s|&;]+", " ", text)
    text = re.sub(r"(?<=[\w-])\|(?=[\w-])", ALTERNATION, text)
    text = re.sub(r"\s(\|\|?|&&|;)\s", r" \1 ", f" {text} ").strip()
    text = re.sub(r";\s*$", "", text)
    try:
        lex = shlex.shlex(text, posix=True, punctuation_chars="|&;")
        lex.whitespace_split = True
        raw = list(lex)
    except ValueError:
        return None
    words: list[str] = []
    skip = False
    for w in raw:
        if skip:
            skip = False
            continue
        if REDIRECT.match(w):
            skip = True
            continue
        if REDIRECT_WITH_TARGET.match(w):
            continue
        if w.startswith("[") or w.endswith("]"):  # [--out DIR]: an optional part
            w = w.strip("[]")
            if not w:
                continue
        words.append(w.replace(ALTERNATION, "|"))
    return words


def commands_in(words: list[str], makefile: set[str]) -> Iterator[tuple[str, ...] | str]:
    """floodgate argvs (tuples) found in shell words, or an error message (str)."""
    for cmd in split_commands(words):
        while cmd and ENV_ASSIGN.match(cmd[0]):
            cmd = cmd[1:]
        while cmd and cmd[0] in WRAPPERS:
            own = WRAPPERS[cmd[0]]
            cmd = cmd[1:]
            while cmd and cmd[0].startswith("-"):  # the wrapper's options: nice -n 5, flock -x
                cmd = cmd[2:] if cmd[0] in ("-n", "-w") else cmd[1:]
            cmd = cmd[own:]
            while cmd and ENV_ASSIGN.match(cmd[0]):
                cmd = cmd[1:]
        if not cmd:
            continue
        head = cmd[0]
        if head == "floodgate" or head.endswith("/floodgate"):
            yield tuple(cmd[1:])
        elif head in ("python", "python3") or head.endswith(("/python", "/python3")):
            if cmd[1:3] == ["-m", "floodgate"]:
                yield tuple(cmd[3:])
            elif cmd[1:2] == ["-m"] and len(cmd) > 2 and cmd[2].startswith(("floodgate.", "tests.")):
                yield tuple(cmd[1:])  # ("-m", module, args...): the module's own parser
        elif head == "make":
            args = [w for w in cmd[1:] if not w.startswith("-")]
            targets = [w for w in args if "=" not in w]
            for t in targets:
                if t not in makefile:
                    yield f"`make {t}`: no such Makefile target"
            if targets == ["up"]:
                extra = next((w.split("=", 1)[1] for w in args if w.startswith("ARGS=")), "")
                yield ("up", *shlex.split(extra))


def alternatives(argv: tuple[str, ...]) -> list[tuple[str, ...]]:
    """`floodgate extproc|controller --config FILE` is two commands (the span is prose)."""
    for i, w in enumerate(argv):
        if "|" in w and not w.startswith("-") and re.fullmatch(r"[\w-]+(\|[\w-]+)+", w):
            return [alt for choice in w.split("|")
                    for alt in alternatives((*argv[:i], choice, *argv[i + 1:]))]
    return [argv]


def doc_commands() -> list[Command | tuple[str, int, str]]:
    """Every command the docs show, or (doc, line, error) for a line that names a wrong target."""
    makefile = makefile_targets()
    found: list[Command | tuple[str, int, str]] = []

    def add(doc: Doc, line: int, text: str, mention: bool = False) -> None:
        words = shell_words(text)
        if words is None:
            return
        for got in commands_in(words, makefile):
            if isinstance(got, str):
                found.append((doc.name, line, got))
            else:
                for argv in alternatives(got):
                    found.append(Command(doc.name, line, text, argv, mention))

    for doc in docs():
        for block in fenced_blocks(doc):
            if block.lang in ("yaml", "yml"):
                for line, argv in yaml_argvs(block):
                    found.append(Command(doc.name, line, " ".join(argv), tuple(argv[1:])))
                continue
            if block.lang not in ("", "sh", "bash", "shell", "console", "text"):
                continue
            lines = block.text.split("\n")
            i = 0
            while i < len(lines):
                start, text = i, lines[i]
                while text.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text.rstrip()[:-1] + " " + lines[i]
                add(doc, block.line + start, re.sub(r"^\s*\$\s+", "", text))
                i += 1
        # Indented code blocks (four spaces, outside lists' continuation text).
        plain = prose(doc).split("\n")
        for n, text in enumerate(plain):
            if text.startswith("    ") and re.match(r"\s+(\S*floodgate|make|flock|\S*python3? -m)\s", text):
                add(doc, n + 1, text.strip())
        for line, span in inline_spans(doc):
            if re.match(r"(\S*/)?(floodgate|make|flock|nice)(\s|$)|(\S*/)?python3? -m (floodgate|tests)\b", span) \
                    or ENV_ASSIGN.match(span):
                add(doc, line, span, mention=True)
    return found


def yaml_argvs(block: Block) -> Iterator[tuple[int, list[str]]]:
    """`command: [floodgate, sim, ...]` lists in a YAML example."""
    try:
        loaded = list(yaml.safe_load_all(block.text))
    except yaml.YAMLError:
        return

    def walk(node: Any) -> Iterator[list[str]]:
        if isinstance(node, dict):
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            if node and all(isinstance(x, str) for x in node) and \
                    (node[0] == "floodgate" or node[0].endswith("/floodgate")):
                yield node
            for v in node:
                yield from walk(v)

    for doc in loaded:
        for argv in walk(doc):
            line = next((block.line + i for i, t in enumerate(block.text.split("\n")) if argv[1] in t),
                        block.line)
            yield line, argv


@functools.cache
def parser_for(command: str | None) -> argparse.ArgumentParser:
    return cli.build_parser(command)


class _Parser(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@functools.cache
def module_parser(module: str) -> argparse.ArgumentParser | None:
    """The parser `python -m module` builds, caught at its parse_args (nothing else runs); None
    for a module that takes no arguments."""
    mod = importlib.import_module(module)
    if "ArgumentParser" not in Path(mod.__file__ or "").read_text():
        return None

    def caught(self: argparse.ArgumentParser, *_: Any, **__: Any) -> Any:
        raise _Parser(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", caught):
        try:
            mod.main([])
        except _Parser as got:
            return got.parser
    raise AssertionError(f"{module}.main() built no parser")


def root_parser(argv: tuple[str, ...]) -> argparse.ArgumentParser | None:
    if argv[:1] == ("-m",):
        return module_parser(argv[1])
    return parser_for(cli._command(argv))


def subparser_chain(argv: tuple[str, ...]) -> list[argparse.ArgumentParser]:
    """The parsers a command line goes through: floodgate, its command, a nested command."""
    root = root_parser(argv)
    chain = [root] if root else []
    for w in argv[2:] if argv[:1] == ("-m",) else argv:
        if not chain:
            break
        if w.startswith("-"):
            continue
        subs = [a for a in chain[-1]._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and w in subs[0].choices:
            chain.append(subs[0].choices[w])
    return chain


def option_action(chain: list[argparse.ArgumentParser], flag: str) -> argparse.Action | None:
    for p in reversed(chain):
        if flag in p._option_string_actions:
            return p._option_string_actions[flag]
    return None


def is_placeholder(word: str) -> bool:
    """`<url>`, `{port}`, `FILE`, `N`, `...`, or a word with a `<placeholder>` in it."""
    return bool(PLACEHOLDER.match(word) or re.search(r"<[^>]+>", word) or word.endswith(ELLIPSIS))


def concrete(argv: tuple[str, ...]) -> tuple[list[str], set[argparse.Action], list[str]]:
    """argv with its placeholders as plain words, the actions whose values are placeholders
    (their type and choices are not checked), and the options the parsers do not know by that
    exact spelling (argparse would take an abbreviation, which breaks when a longer option is
    added)."""
    chain = subparser_chain(argv)
    if argv[:1] == ("-m",):
        argv = argv[2:]
    out: list[str] = []
    loose: set[argparse.Action] = set()
    problems: list[str] = []
    for i, w in enumerate(argv):
        prev = option_action(chain, argv[i - 1]) if i and argv[i - 1].startswith("-") else None
        if w in ELLIPSIS and (prev is None or prev.nargs == 0):
            continue  # `floodgate controller simulate …`: the rest of the line left out
        if w.startswith("-") and len(w) > 1 and not re.fullmatch(r"-\d.*", w):
            flag, eq, value = w.partition("=")
            action = option_action(chain, flag)
            if action is None:
                problems.append(f"unknown option {flag}")
            elif eq and is_placeholder(value):
                loose.add(action)
            out.append(w)
            continue
        if is_placeholder(w):
            subs = [a for a in chain[-1]._actions if isinstance(a, argparse._SubParsersAction)]
            if prev is not None:
                loose.add(prev)
                w = "x"
            elif subs and not any(x in subs[0].choices for x in argv[i + 1:]):
                w = next(iter(subs[0].choices))  # `floodgate bench <name>`: any of them
            else:
                w = "x"
        out.append(w)
    return out, loose, problems


def parse_problem(argv: tuple[str, ...], mention: bool = False) -> str | None:
    """Why `floodgate <argv>` would not start, or None. A `mention` (an inline code span names
    a command or an option in prose) may leave out required options and a last option's value."""
    if argv[:1] == ("-m",):
        if importlib.util.find_spec(argv[1]) is None:
            return f"no module {argv[1]}"
        if root_parser(argv) is None:
            return f"{argv[1]} takes no arguments" if argv[2:] else None
    args, loose, problems = concrete(argv)
    if problems:
        return "; ".join(problems)
    parser = root_parser(argv)
    assert parser is not None
    err = io.StringIO()
    saved = [(a, a.type, a.choices) for a in loose]
    try:
        for a in loose:
            a.type, a.choices = None, None
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _, extra = parser.parse_known_args(args)
    except SystemExit as exc:
        if exc.code in (0, None):  # --help, --version
            return None
        message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
        if mention and ("arguments are required" in message or
                        (message.endswith("expected one argument") and args and args[-1].startswith("-"))):
            return None
        return message
    finally:
        for a, type_, choices in saved:
            a.type, a.choices = type_, choices
    if extra:
        return f"unrecognized arguments: {' '.join(extra)}"
    return None


def test_the_docs_show_commands() -> None:
    commands = [c for c in doc_commands() if isinstance(c, Command)]
    assert len(commands) > 100, len(commands)
    shown = {c.argv[0] for c in commands if c.argv}
    assert {c.argv[1] for c in commands if c.argv[:1] == ("-m",)} >= {"floodgate.bench.p0_onset",
                                                                     "floodgate.envoy_config"}
    assert {"up", "extproc", "controller", "sim", "load", "status", "bench"} <= shown, shown


def test_every_command_in_the_docs_parses() -> None:
    failures = []
    for c in doc_commands():
        if isinstance(c, tuple):
            failures.append(f"{c[0]}:{c[1]}: {c[2]}")
            continue
        problem = parse_problem(c.argv, c.mention)
        if problem:
            failures.append(f"{c.doc}:{c.line}: `{c.text}`: {problem}")
    assert not failures, "commands in the docs that `floodgate` does not accept:\n" + "\n".join(failures)


@pytest.mark.parametrize(("argv", "ok"), [
    (("extproc", "--config", "<file>"), True),
    (("controller", "simulate", "--trace", "azure", "--out", "DIR"), True),
    (("load", "--shape", "burst", "--rate", "N"), True),
    (("bench", "overhead", "--help"), True),
    (("bench", "<name>"), True),
    (("<command>", "--help"), True),
    (("extproc", "--conf", "x"), False),  # an abbreviation argparse would accept
    (("bench", "nosuch"), False),
    (("nosuch",), False),
    (("load", "--shape", "nosuch"), False),
    (("sim", "--no-such-flag"), False),
    (("-m", "floodgate.envoy_config", "--compose"), True),
    (("-m", "floodgate.envoy_config", "--compost"), False),
    (("-m", "floodgate.config_reference"), True),
    (("-m", "floodgate.nosuch"), False),
])
def test_the_command_check_itself(argv: tuple[str, ...], ok: bool) -> None:
    assert (parse_problem(argv) is None) is ok


def test_shell_lines_are_read_as_a_shell_would() -> None:
    words = shell_words("FOO=1 flock /tmp/l nice -n 5 .venv/bin/floodgate status --json 2>&1 | head  # x")
    assert words is not None
    assert list(commands_in(words, {"up"})) == [("status", "--json")]
    assert list(commands_in(shell_words("make up ARGS='--no-demo'") or [], {"up"})) == [("up", "--no-demo")]
    assert list(commands_in(shell_words("make nosuch") or [], {"up"})) == ["`make nosuch`: no such Makefile target"]
    assert list(commands_in(shell_words(".venv/bin/python -m floodgate.envoy_config --compose > x.yaml") or [],
                            set())) == [("-m", "floodgate.envoy_config", "--compose")]
    assert alternatives(("extproc|controller", "--config", "FILE")) == [
        ("extproc", "--config", "FILE"), ("controller", "--config", "FILE")]


# Modules run as `python -m` whose --help shows command lines (besides the `floodgate` CLI's).
HELP_MODULES = ("floodgate.envoy_config", "floodgate.redis_acl", "floodgate.bench.sim_capacity",
                "floodgate.bench.p0_onset")


def help_commands() -> Iterator[tuple[str, str, tuple[str, ...], bool]]:
    """(parser, line, argv, mention) of every `floodgate ...` / `python -m floodgate...` command
    line a --help shows: example lines of a description or epilog, and inline `spans`."""
    parsers: list[argparse.ArgumentParser] = []
    for command in (None, *sorted(c for c in cli_commands())):
        parsers += [p for p in parser_tree(parser_for(command)) if p not in parsers]
    parsers += [p for p in map(module_parser, HELP_MODULES) if p is not None]
    makefile = makefile_targets()
    for p in parsers:
        texts = [p.description, p.epilog, *(a.help for a in p._actions if isinstance(a.help, str))]
        lines = "\n".join(t for t in texts if t).split("\n")
        i = 0
        while i < len(lines):
            line = lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
            found = [(re.sub(r"^Run:\s*", "", line.strip()), False)] \
                if re.match(r"(Run:\s*)?(\S*/)?(floodgate|python3? -m floodgate)\b", line.strip()) else []
            found += [(m.group(1), True) for m in re.finditer(r"`([^`]+)`", line)
                      if re.match(r"(\S*/)?(floodgate|python3? -m floodgate)\b", m.group(1))]
            for text, mention in found:
                for got in commands_in(shell_words(text) or [], makefile):
                    if isinstance(got, tuple):
                        for argv in alternatives(got):
                            yield p.prog, text, argv, mention


def cli_commands() -> set[str]:
    subs = [a for a in cli.build_parser(None)._actions if isinstance(a, argparse._SubParsersAction)]
    return set(subs[0].choices)


def test_every_command_a_help_shows_parses() -> None:
    """`floodgate bench overhead --help` shows how to run it: those lines parse as the docs' do."""
    failures, seen = [], 0
    for prog, text, argv, mention in help_commands():
        seen += 1
        problem = parse_problem(argv, mention)
        if problem:
            failures.append(f"{prog} --help: `{text}`: {problem}")
    assert not failures, "commands in --help texts that `floodgate` does not accept:\n" + "\n".join(failures)
    assert seen > 30, seen


# Options of other programs the docs name in prose (only these: a Floodgate option that is
# misspelled or was renamed must fail).
EXTERNAL_OPTIONS = {
    "--concurrency",  # Envoy's worker count (docs/benchmarks.md, the overhead bench's front Envoys)
    "--latency",  # wrk's latency histogram
    "--native",  # py-spy's native frames
}
# Spans that are another program's command line: their options are that program's.
EXTERNAL_PROGRAMS = {"docker", "kubectl", "envoy", "vllm", "curl", "wrk", "py-spy", "valgrind", "redis-cli",
                     "valkey-cli", "git", "pip", "sudo", "apt-get", "openssl", "helm", "istioctl", "perf"}


def parser_tree(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`p` and every subcommand parser below it."""
    found = [p]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                found += parser_tree(sub)
    return found


@functools.cache
def all_options() -> set[str]:
    """Every option of every `floodgate` command and of the `python -m` tools the docs name."""
    parsers = list(all_parsers())
    for c in doc_commands():
        if isinstance(c, Command) and c.argv[:1] == ("-m",) and importlib.util.find_spec(c.argv[1]):
            parser = module_parser(c.argv[1])
            if parser:
                parsers += parser_tree(parser)
    return {opt for p in parsers for opt in p._option_string_actions}


def test_the_readme_lists_every_command() -> None:
    """README: "`floodgate --help` lists every command (`extproc`, `controller`, ...)"."""
    readme = next(d for d in docs() if d.path.name == "README.md")
    m = re.search(r"lists every command \(([^)]*)\)", readme.text)
    assert m, "README.md no longer says which commands `floodgate --help` lists"
    assert set(re.findall(r"`([a-z-]+)`", m.group(1))) == set(cli.COMMANDS), (
        f"README.md:{readme.line_of(m.start())}: the commands are {', '.join(cli.COMMANDS)}")


def test_every_option_named_in_prose_exists() -> None:
    """`--replicas 2`, `--arrival poisson|uniform`, `--output-*`: an option named on its own."""
    known = all_options()
    failures, checked = [], 0
    for doc in docs():
        for line, span in inline_spans(doc):
            first = span.split()[0].split("/")[-1]
            if first in EXTERNAL_PROGRAMS or re.match(r"(\S*/)?(floodgate|make|flock|nice|python3?)$", first):
                continue  # a command line: checked whole above, or another program's
            for m in re.finditer(r"(?<![\w-])(--[a-z][a-z0-9-]*)(\*?)", span):
                flag, glob = m.groups()
                checked += 1
                if flag in EXTERNAL_OPTIONS or flag in known or (glob and any(k.startswith(flag) for k in known)):
                    continue
                failures.append(f"{doc.name}:{line}: `{span}`: no command has the option {flag}{glob}")
    assert not failures, "\n".join(failures)
    assert checked > 50, checked


@functools.cache
def all_parsers() -> tuple[argparse.ArgumentParser, ...]:
    """Every `floodgate` command's parser and its subcommands'."""
    return tuple(p for command in cli.COMMANDS for p in parser_tree(parser_for(command)))


def test_flag_default_tables_match_the_parsers() -> None:
    """docs/emulator.md's `| Knob | Flag | Default |`: each flag's default, in the order the
    flags are listed (`6250 × 16`, `0.5 s / 1 s / 8 s`, `fcfs`), on the one command that has
    every flag of the table."""
    failures, checked = [], 0

    def check(name: str, rows: list[tuple[int, list[str], str]]) -> None:
        nonlocal checked
        every = {f for _, flags, _ in rows for f in flags}
        parser = next((p for p in all_parsers() if every <= set(p._option_string_actions)), None)
        if parser is None:
            failures.append(f"{name}:{rows[0][0]}: no command has all of {sorted(every)}")
            return
        for n, flags, shown in rows:
            values = re.findall(r"`([^`]+)`", shown)[:1] or re.findall(r"\d+(?:\.\d+)?", shown)
            for flag, value in zip(flags, values, strict=False):
                checked += 1
                default = parser._option_string_actions[flag].default
                same = (str(default) == value if isinstance(default, str)
                        else isinstance(default, int | float) and float(default) == float(value))
                if not same:
                    failures.append(f"{name}:{n}: {flag} defaults to {default!r}, the table says {value}")

    for doc in docs():
        columns: tuple[int, int] | None = None
        rows: list[tuple[int, list[str], str]] = []
        for n, line in enumerate([*doc.text.split("\n"), ""], 1):
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
            lower = [c.lower() for c in cells]
            if "flag" in lower and "default" in lower:
                columns, rows = (lower.index("flag"), lower.index("default")), []
            elif cells and columns is not None:
                flags = re.findall(r"`(--[a-z0-9-]+)`", cells[columns[0]])
                if flags:
                    rows.append((n, flags, cells[columns[1]]))
            elif columns is not None:
                if rows:
                    check(doc.name, rows)
                columns = None
    assert not failures, "\n".join(failures)
    assert checked >= 10, checked


def test_tables_of_an_options_choices_list_them_all() -> None:
    """docs/load.md's shape table (a first column headed by an option, in backticks): one row per
    choice of the option, no other."""
    failures, checked = [], 0
    for doc in docs():
        flag: str | None = None
        shown: set[str] = set()
        start = 0
        for n, line in enumerate([*doc.text.split("\n"), ""], 1):
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
            if cells and re.fullmatch(r"`--[a-z0-9-]+`", cells[0]):
                flag, shown, start = cells[0].strip("`"), set(), n
            elif cells and flag:
                shown |= set(re.findall(r"`([^`]+)`", cells[0]))
            elif flag:
                choices = {str(c) for p in all_parsers() if flag in p._option_string_actions
                           for c in p._option_string_actions[flag].choices or ()}
                checked += 1
                if shown != choices:
                    failures.append(f"{doc.name}:{start}: {flag} choices are {sorted(choices)}, "
                                    f"the table lists {sorted(shown)}")
                flag = None
    assert not failures, "\n".join(failures)
    assert checked >= 1, checked


# --- 2. metrics -----------------------------------------------------------------------------


def registered() -> dict[str, tuple[str, Metric]]:
    """Every metric family the processor and the controller register: name -> (component, family)."""
    families: dict[str, tuple[str, Metric]] = {}
    for component, registry in (("processor", Metrics(CollectorRegistry()).registry),
                                ("controller", ControllerMetrics().registry)):
        for fam in registry.collect():
            families[fam.name] = (component, fam)
    return families


def exposed_names(fam: Metric) -> set[str]:
    """The names a user can query (and the family name, for a histogram's quantiles)."""
    if fam.type == "counter":
        return {f"{fam.name}_total"}
    if fam.type == "histogram":
        return {fam.name, f"{fam.name}_bucket", f"{fam.name}_sum", f"{fam.name}_count"}
    return {fam.name}


METRIC_WORD = re.compile(r"(?<![\w/.-])floodgate_[a-z_]*[a-z]")


def metric_mentions() -> Iterator[tuple[str, int, str]]:
    for doc in docs():
        if doc.path == METRICS_DOC:
            continue
        for m in METRIC_WORD.finditer(doc.text):
            yield doc.name, doc.line_of(m.start()), m.group(0)


def test_every_metric_the_docs_name_is_registered() -> None:
    known = set().union(*(exposed_names(f) for _, f in registered().values()))
    failures = []
    for name, line, word in metric_mentions():
        if word in NOT_METRICS or word in known:
            continue
        hint = ""
        if f"{word}_total" in known:
            hint = f" (a counter: `{word}_total`)"
        elif word.endswith("_total") and word[:-6] in known:
            hint = f" (not a counter: `{word[:-6]}`)"
        failures.append(f"{name}:{line}: `{word}` is not a metric of the processor or the controller{hint}")
    assert not failures, "\n".join(failures)


def test_the_labels_the_docs_give_a_metric_are_its_labels() -> None:
    """`floodgate_replicas{pool,state}`, `floodgate_releases_total{pool,reason="cancelled"}`."""
    families = registered()
    failures, checked = [], 0
    for doc in docs():
        for m in re.finditer(r"(?<![\w/.-])(floodgate_[a-z_]*[a-z])\{([^}]*)\}", doc.text):
            word = m.group(1)
            fam = next((n for n, (_, f) in families.items() if word in exposed_names(f)), None)
            if fam is None:
                continue  # reported by the test above
            checked += 1
            given = {re.split(r"[=!~]", part)[0].strip() for part in m.group(2).split(",") if part.strip()}
            given.discard("le")  # a histogram bucket's bound
            unknown = given - set(_label_names().get(fam, ()))
            if unknown:
                failures.append(f"{doc.name}:{doc.line_of(m.start())}: `{m.group(0)}`: {word} has no label "
                                f"{', '.join(sorted(unknown))} (its labels: {', '.join(_label_names()[fam]) or 'none'})")
    assert not failures, "\n".join(failures)
    assert checked >= 5, checked


def test_metric_tables_give_each_metric_its_labels() -> None:
    """A docs table with a `labels` column (docs/admission.md's) lists exactly the registered ones."""
    families = registered()
    failures, checked = [], 0
    for doc in docs():
        if doc.path == METRICS_DOC:
            continue
        column = None
        for n, line in enumerate(doc.text.split("\n"), 1):
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
            if not cells:
                column = None
                continue
            if "labels" in cells:
                column = cells.index("labels")
                continue
            if column is None or column >= len(cells):
                continue
            given = {x.strip() for x in cells[column].split(",") if x.strip()}
            for word in re.findall(r"`(floodgate_[a-z_]*[a-z])`", cells[0]):
                fam = next((f for f in families.values() if word in exposed_names(f[1])), None)
                if fam is None:
                    continue
                checked += 1
                labels = set(_label_names().get(fam[1].name, ()))
                if given != labels:
                    failures.append(f"{doc.name}:{n}: `{word}` labels given as {sorted(given)}, "
                                    f"registered with {sorted(labels)}")
    assert not failures, "\n".join(failures)
    assert checked >= 20, checked


ENV_VARS = re.compile(r"\bFLOODGATE_[A-Z_]*[A-Z]\b")


def test_environment_variables_in_the_docs_are_read() -> None:
    import inspect

    from floodgate import supervisor

    read = set(extproc_config.ENV_OVERRIDES) | set(controller_config.ENV_OVERRIDES)
    read |= set(ENV_VARS.findall(inspect.getsource(supervisor)))  # the local stack's (free ports)
    from floodgate.controller.actuators import process

    read.add(process.TOKEN_ENV)  # read from the replicas' environments (a start's token)
    failures = [f"{doc.name}:{doc.line_of(m.start())}: {m.group(0)} is read by neither the processor, the "
                f"controller nor the local stack" for doc in docs() for m in ENV_VARS.finditer(doc.text)
                if m.group(0) not in read]
    assert not failures, "\n".join(failures)


METRICS_BEGIN = "<!-- generated by tests/test_docs.py: begin -->"
METRICS_END = "<!-- generated by tests/test_docs.py: end -->"


def metrics_table() -> str:
    rows = ["| metric | type | labels | component | help |", "|---|---|---|---|---|"]
    families = registered()
    for name in sorted(families, key=lambda n: (families[n][0] != "processor", n)):
        component, fam = families[name]
        shown = f"{name}_total" if fam.type == "counter" else name
        labels = _labels(component, name)
        doc = fam.documentation.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{shown}` | {fam.type} | {', '.join(labels)} | {component} | {doc} |")
    return "\n".join(rows)


@functools.cache
def _label_names() -> dict[str, tuple[str, ...]]:
    """Label names by family (prometheus_client keeps them on the collector, not the family)."""
    out: dict[str, tuple[str, ...]] = {}
    for registry in (Metrics(CollectorRegistry()).registry, ControllerMetrics().registry):
        for collector in list(registry._collector_to_names):
            name = getattr(collector, "_name", None)
            if name:
                out[name] = tuple(getattr(collector, "_labelnames", ()))
    return out


def _labels(component: str, name: str) -> tuple[str, ...]:
    return _label_names().get(name, ())


def test_the_metrics_reference_names_every_registered_metric() -> None:
    text = METRICS_DOC.read_text()
    missing = [n for n, (_, f) in registered().items() if not any(f"`{x}`" in text for x in exposed_names(f))]
    assert not missing, f"docs/metrics.md does not list {missing}"


def rendered_metrics_doc(current: str) -> str:
    head, _, rest = current.partition(METRICS_BEGIN)
    _, _, tail = rest.partition(METRICS_END)
    return f"{head}{METRICS_BEGIN}\n{metrics_table()}\n{METRICS_END}{tail}"


def test_the_metrics_reference_lists_every_metric() -> None:
    current = METRICS_DOC.read_text()
    assert METRICS_BEGIN in current and METRICS_END in current
    assert current == rendered_metrics_doc(current), (
        "docs/metrics.md is out of date with extproc/metrics.py and controller/metrics.py: "
        "run `.venv/bin/python tests/test_docs.py` to regenerate its table")


def local_reply_codes() -> dict[str, str]:
    """The error `code` of every reply the shipped gateway bootstrap's `local_reply_config`
    rewrites (envoy/local.yaml), with the CEL filter that selects it."""
    from floodgate.envoy_config import load_yaml

    boot = load_yaml(ROOT / "envoy" / "local.yaml")
    codes: dict[str, str] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "local_reply_config" in node:
                for mapper in node["local_reply_config"].get("mappers", []):
                    expr = str(mapper.get("filter", {}).get("extension_filter", {})
                               .get("typed_config", {}).get("expression", ""))
                    body = mapper.get("body_format_override", {}).get("json_format", {}).get("error", {})
                    codes[str(body.get("code") or body.get("type"))] = expr
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(boot)
    return codes


def test_every_error_envoy_answers_itself_is_documented() -> None:
    """docs/admission.md, "Errors Envoy answers itself", names the code of every reply the shipped
    local_reply_config gives a JSON body (the codec's 426/431/400 were said to keep Envoy's plain
    bodies after they got one)."""
    doc = (ROOT / "docs" / "admission.md").read_text()
    start = doc.index("**Errors Envoy answers itself.**")
    section = doc[start:doc.index("\n\n", start)]
    codes = local_reply_codes()
    assert len(codes) >= 8, codes
    missing = {c: e for c, e in codes.items() if f"`{c}`" not in section}
    assert not missing, f"docs/admission.md, 'Errors Envoy answers itself', does not name: {missing}"
    assert "plain bodies" not in section, "the codec's refusals get a JSON body too (envoy/local.yaml)"


# --- 3. YAML examples and config keys -------------------------------------------------------

PROCESSOR_ONLY = {"server", "admission"}
CONTROLLER_ONLY = {"envoy", "leader", "tick_interval_s", "metrics_listen"}


def config_kind(doc: dict[str, Any]) -> str | None:
    """processor, controller, or None (Kubernetes, Envoy, compose, a fragment of something else)."""
    keys = set(doc)
    proc_keys = set(extproc_config.Config.model_fields)
    ctl_keys = set(controller_config.ControllerConfig.model_fields)
    if not keys or not keys <= proc_keys | ctl_keys:
        return None
    if keys & PROCESSOR_ONLY:
        return "processor"
    if keys & CONTROLLER_ONLY:
        return "controller"
    pool_keys = {k for p in doc.get("pools") or [] if isinstance(p, dict) for k in p}
    ctl_pool = set(controller_config.PoolConfig.model_fields) - set(extproc_config.PoolConfig.model_fields)
    return "controller" if pool_keys & ctl_pool else "processor"


def validate(kind: str, doc: dict[str, Any]) -> None:
    model: type[BaseModel] = extproc_config.Config if kind == "processor" else controller_config.ControllerConfig
    try:
        model.model_validate(doc)
    except ValidationError as exc:
        # An example's certificate paths are where a deployment mounts them, not files here.
        errors = [e for e in exc.errors() if "is not a readable file" not in str(e.get("msg", ""))]
        if errors:
            raise


def yaml_blocks() -> Iterator[tuple[Doc, Block]]:
    for doc in docs():
        for block in fenced_blocks(doc):
            if block.lang in ("yaml", "yml"):
                yield doc, block


def test_every_yaml_example_loads_and_every_floodgate_config_validates() -> None:
    failures, checked = [], {"processor": 0, "controller": 0}
    for doc, block in yaml_blocks():
        try:
            loaded = list(yaml.safe_load_all(block.text))
        except yaml.YAMLError as exc:
            failures.append(f"{doc.name}:{block.line}: not valid YAML: {exc}")
            continue
        for item in loaded:
            kind = config_kind(item) if isinstance(item, dict) else None
            if kind is None:
                continue
            checked[kind] += 1
            try:
                validate(kind, item)
            except (ValidationError, ValueError) as exc:
                failures.append(f"{doc.name}:{block.line}: {kind} config does not validate: {exc}")
    assert not failures, "\n".join(failures)
    assert checked["processor"] >= 3 and checked["controller"] >= 2, checked


def options_models() -> list[type[BaseModel]]:
    """The models of an actuator's free-form `options` (validated by the controller's config)."""
    from floodgate.controller.actuators.kubernetes import KubernetesActuatorConfig
    from floodgate.controller.discovery import EndpointSliceConfig
    return [KubernetesActuatorConfig, EndpointSliceConfig]


def shown_default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_option_tables_match_the_options_models() -> None:
    """docs/kubernetes.md's `| option | default | meaning |` tables: every option of the model
    it describes, each with its default."""
    failures, tables = [], 0
    for doc in docs():
        rows: dict[str, str] | None = None
        start = 0
        for n, line in enumerate([*doc.text.split("\n"), ""], 1):
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.strip().startswith("|") else []
            if cells == ["option", "default", "meaning"]:
                rows, start = {}, n
                continue
            if rows is not None and cells:
                if set("".join(cells)) <= set("- "):
                    continue
                for name in re.findall(r"`([a-z_]+)`", cells[0]):
                    rows[name] = cells[1].strip("`")
                continue
            if rows is not None:  # the table ended
                tables += 1
                shown = set(rows)
                model = max(options_models(), key=lambda m: len(set(m.model_fields) & shown))
                fields = model.model_fields
                where = f"{doc.name}:{start}: the options table of {model.__name__}"
                if set(rows) != set(fields):
                    failures.append(f"{where}: missing {sorted(set(fields) - set(rows))}, "
                                    f"not options {sorted(set(rows) - set(fields))}")
                failures += [f"{where}: `{k}` default is `{shown_default(fields[k].default)}`, the table says {v}"
                             for k, v in rows.items() if k in fields and shown_default(fields[k].default) != v]
                rows = None
    assert not failures, "\n".join(failures)
    assert tables >= 2, tables


def models_of(annotation: Any) -> tuple[list[type[BaseModel]], str]:
    """The models an annotation holds, and what comes between it and them: '' (the model
    itself), 'list', 'dict' (a key segment follows), 'open' (any keys: a free mapping)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], ""
    if origin is typing.Annotated:
        return models_of(args[0])
    if origin in (typing.Union, types.UnionType):
        models, how = [], "leaf"
        for a in args:
            m, h = models_of(a)
            if m or h in ("open", "dict", "list"):
                models += m
                how = h
        return models, how
    if origin in (list, tuple, set, frozenset) or str(origin) == "collections.abc.Sequence":
        models = [m for a in args if a is not Ellipsis for m in models_of(a)[0]]
        return models, "list" if models else "leaf"
    if origin is dict or (origin is not None and "Mapping" in str(origin)):
        value = args[1] if len(args) == 2 else Any
        models = models_of(value)[0]
        return models, "dict" if models else "open"
    return [], "leaf"


def resolve(model: type[BaseModel], path: list[str]) -> bool:
    if not path:
        return True
    name = path[0].removesuffix("[]")
    field = model.model_fields.get(name)
    if field is None:
        return False
    rest = path[1:]
    models, how = models_of(field.annotation)
    if how == "open":
        return True
    if how == "leaf" and not models:
        return not rest
    if how == "list" and rest and rest[0].isdigit():
        rest = rest[1:]
    if how == "dict":
        if not rest:
            return True
        rest = rest[1:]  # the key: `classes.<key>`, `classes.0`
    return not rest or any(resolve(m, rest) for m in models)


def all_models() -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    todo: list[type[BaseModel]] = [extproc_config.Config, controller_config.ControllerConfig]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.append(m)
        for f in m.model_fields.values():
            todo += models_of(f.annotation)[0]
    return seen


CONFIG_KEY = re.compile(r"[a-z_]+(\[\])?(\.([a-z_]+|\d+|<[a-z_]+>)(\[\])?)+")
FILE_SUFFIX = re.compile(r"\.(py|md|yaml|yml|lua|json|txt|sh|toml|crt|key|pem|conf|asyncio|local)$")


def config_key_mentions() -> Iterator[tuple[str, int, str]]:
    for doc in docs():
        for line, span in inline_spans(doc):
            for word in re.findall(r"[\w.\[\]<>]+", span):
                word = word.rstrip(".")
                if CONFIG_KEY.fullmatch(word) and not FILE_SUFFIX.search(word):
                    yield doc.name, line, word


# Dotted words that start like a config section but name code: a function or class of a module
# of that name (`policy.burst_reaction` is controller/policy.py's, `limit.cap_to_ceiling`
# extproc/limit.py's) is recognised by reading the module; these are the rest.
NOT_CONFIG_KEYS = {
    "redis.call",  # Lua's call into Redis (extproc/leases.lua)
}
CODE_ALIASES = {"actuator": ["controller/actuators/base.py"]}  # the Actuator protocol's methods


@functools.cache
def code_names(module: str) -> set[str]:
    """Functions, classes, methods and attributes defined in the components' modules `module`.py."""
    files = CODE_ALIASES.get(module) or [
        str(f.relative_to(ROOT)) for d in ("extproc", "controller", "sim", "bench", "floodgate")
        for f in (ROOT / d).rglob(f"{module}.py")]
    names: set[str] = set()
    for f in files:
        src = (ROOT / f).read_text()
        names |= set(re.findall(r"\b(?:def|class)\s+(\w+)", src))
        names |= set(re.findall(r"^(\w+)\s*(?::[^=\n]*)?=", src, re.M))  # module level
        names |= set(re.findall(r"^    (\w+)\s*:", src, re.M))  # a class's fields
    return names


def names_code(key: str) -> bool:
    path = key.split(".")
    return key in NOT_CONFIG_KEYS or (len(path) == 2 and path[1] in code_names(path[0].removesuffix("[]")))


# Sections of the two configs a dotted key in prose may start with.
@functools.cache
def section_names() -> set[str]:
    return {name for m in all_models() for name, f in m.model_fields.items() if models_of(f.annotation)[0]}


def test_the_policy_defaults_table_matches_policyconfig() -> None:
    """docs/controller.md, "`PolicyConfig` defaults": `| `min_replicas` / `max_replicas` | 1 / 64 |`
    rows give each field's default as the model has it."""
    from floodgate.controller.policy import PolicyConfig

    doc = next(d for d in docs() if d.name == "docs/controller.md")
    lines = doc.text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("### `PolicyConfig` defaults"))
    defaults = {f.name: f.default for f in dataclasses.fields(PolicyConfig)} \
        if dataclasses.is_dataclass(PolicyConfig) else {k: v.default for k, v in PolicyConfig.model_fields.items()}
    failures, rows = [], 0
    for n, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        names = re.findall(r"`([a-z_]+)`", cells[0]) if cells else []
        if not names:
            continue
        rows += 1
        values = [v.strip() for v in cells[1].split("/")]
        if len(values) != len(names):
            failures.append(f"docs/controller.md:{n}: {len(names)} fields, {len(values)} defaults")
            continue
        for name, shown in zip(names, values, strict=True):
            if name not in defaults:
                failures.append(f"docs/controller.md:{n}: PolicyConfig has no field {name}")
            elif not _same_default(defaults[name], shown):
                failures.append(f"docs/controller.md:{n}: {name} defaults to {defaults[name]!r}, the table says {shown}")
    assert rows >= 8, rows
    assert not failures, "\n".join(failures)


def _same_default(value: object, shown: str) -> bool:
    if isinstance(value, bool):
        return shown == str(value).lower()
    try:
        return float(shown) == float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return shown.strip("`") == str(value)


def test_config_keys_in_the_docs_exist() -> None:
    models = all_models()
    sections = section_names()
    failures, checked = [], 0
    for name, line, key in config_key_mentions():
        path = key.split(".")
        if path[0].removesuffix("[]") not in sections:
            continue
        checked += 1
        if not any(resolve(m, path) for m in models) and not names_code(key):
            failures.append(f"{name}:{line}: `{key}` is not a key of the processor or controller config")
    assert not failures, "\n".join(failures)
    assert checked > 50, checked


def test_the_key_check_itself() -> None:
    models = all_models()
    for good in ("pools[].limit.signal", "pools.0.policy.min_replicas", "pools[].classes.<key>.queue_timeout_s",
                 "policy.max_replicas", "warm_pool.min_size", "admission.trust.spiffe_ids", "redis.lease_ttl_s"):
        assert any(resolve(m, good.split(".")) for m in models), good
    for bad in ("pools[].limit.nosuch", "policy.nosuch", "redis.lease_ttl_s.x"):
        assert not any(resolve(m, bad.split(".")) for m in models), bad
    assert names_code("policy.burst_reaction") and names_code("limit.cap_to_ceiling")
    assert not names_code("policy.nosuch") and not names_code("warm_pool.nosuch")


# --- 4. links and paths ---------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./~-])((?:" + "|".join(REPO_DIRS) + r")/[\w.<>*{},/-]*[\w*>}/])")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(Doc(path, path.read_text())).split("\n"):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_every_relative_link_resolves() -> None:
    failures, checked = [], 0
    for doc in docs():
        text = prose(doc)
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            checked += 1
            file, _, anchor = target.partition("#")
            path = (doc.path.parent / file).resolve() if file else doc.path
            where = f"{doc.name}:{line_at(text, m.start())}: link `{target}`"
            if not path.exists():
                failures.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                failures.append(f"{where}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not failures, "\n".join(failures)
    assert checked >= 10, checked


def repo_path_exists(mention: str) -> bool:
    for installed, repo in INSTALLED_AS.items():
        if mention.startswith(installed):
            mention = repo + mention[len(installed):]
    mention = mention.rstrip("/")
    if re.search(r"[<*{]", mention):
        pattern = re.sub(r"<[^>]+>", "*", mention)
        expanded = [pattern]
        if "{" in pattern:  # {a,b} as a shell expands it
            m = re.search(r"\{([^}]*)\}", pattern)
            assert m
            expanded = [pattern[:m.start()] + alt + pattern[m.end():] for alt in m.group(1).split(",")]
        return all(any(ROOT.glob(p)) for p in expanded)
    return (ROOT / mention).exists()


def test_every_repository_path_the_docs_name_exists() -> None:
    failures, checked = [], 0
    for doc in docs():
        for m in REPO_PATH.finditer(doc.text):
            if re.search(r"(--out|--json|>)(\s+|=)$", doc.text[max(0, m.start() - 8):m.start()]):
                continue  # where a command writes: made by running it
            mention = m.group(1).rstrip(".,")
            if mention.endswith(("...", "…")):
                mention = mention.rstrip(".…").rstrip("/")
            checked += 1
            if not repo_path_exists(mention):
                failures.append(f"{doc.name}:{doc.line_of(m.start())}: `{mention}` does not exist")
    assert not failures, "\n".join(failures)
    assert checked > 50, checked


# Files the docs name by their bare name that are not in the repository because a command
# writes them (only these: a named script or config that does not exist must fail).
WRITTEN_BY_COMMANDS = {
    "requests.json",  # floodgate load / up: every request of a run (docs/load.md)
    "summary.md",  # floodgate load / up: the run's report
    "results.json",  # a bench's --json output
}
BARE_FILE = re.compile(r"^[A-Za-z0-9_.-]+\.(py|lua|yaml|yml|toml|sh|json|csv|gz|md)$")


@functools.cache
def repo_basenames() -> set[str]:
    names = {p.name for p in ROOT.iterdir() if p.is_file()}
    for d in REPO_DIRS:
        names |= {p.name for p in (ROOT / d).rglob("*") if "__pycache__" not in p.parts}
    return names


def test_every_file_the_docs_name_exists() -> None:
    """`steady_vs_static.py`, `leases.lua`, `kustomization.yaml`: a file named without its folder
    is somewhere in the repository."""
    names = repo_basenames()
    failures, checked = [], 0
    for doc in docs():
        for line, span in inline_spans(doc):
            word = span.split()[0]
            if not BARE_FILE.match(word) or word in WRITTEN_BY_COMMANDS:
                continue
            checked += 1
            if word not in names:
                failures.append(f"{doc.name}:{line}: `{span}`: no file {word} in the repository")
    assert not failures, "\n".join(failures)
    assert checked > 20, checked


def test_every_test_the_docs_cite_exists() -> None:
    """"Tested by `test_kv_bound_burst_is_caught_below_the_concurrency_target`": a test function
    or test module of that name (a name cut at a `_` is a prefix)."""
    names: set[str] = set()
    for f in (ROOT / "tests").rglob("*.py"):
        names.add(f.stem)
        names |= set(re.findall(r"def (test_\w+)", f.read_text()))
    failures, checked = [], 0
    for doc in docs():
        for m in re.finditer(r"(?<![\w/.-])(test_[a-z0-9_]*[a-z0-9_])", doc.text):
            word = m.group(1)
            checked += 1
            if word in names or (word.endswith("_") and any(n.startswith(word) for n in names)):
                continue
            failures.append(f"{doc.name}:{doc.line_of(m.start())}: no test named {word}")
    assert not failures, "\n".join(failures)
    assert checked > 10, checked


def test_module_maps_name_existing_files() -> None:
    """docs/architecture.md's maps (a block opening with `extproc/` and one file per line) name
    files that exist, and every module of the folder."""
    failures, checked = [], 0
    for doc in docs():
        for block in fenced_blocks(doc):
            lines = block.text.split("\n")
            if not re.fullmatch(r"[a-z_]+/", lines[0].strip()) or not (ROOT / lines[0].strip()).is_dir():
                continue
            folder = ROOT / lines[0].strip()
            listed = set()
            for n, line in enumerate(lines[1:], 1):
                m = re.match(r"  ([\w.]+/?(?:, [\w.]+/?)*)\s", line)
                for name in (m.group(1).split(", ") if m else []):
                    checked += 1
                    listed.add(name)
                    if not (folder / name).exists():
                        failures.append(f"{doc.name}:{block.line + n}: {folder.name}/{name} does not exist")
            present = {p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                       if (p.suffix in (".py", ".lua") and p.name != "__init__.py")
                       or (p.is_dir() and (p / "__init__.py").exists())}
            if present - listed:
                failures.append(f"{doc.name}:{block.line - 1}: the map of {folder.name}/ leaves out "
                                f"{', '.join(sorted(present - listed))}")
    assert not failures, "\n".join(failures)
    assert checked > 20, checked


def test_python_examples_import_what_the_package_has() -> None:
    """```python blocks parse, and what they import exists under the installed names: the
    components install as floodgate.sim, floodgate.extproc, ... (pyproject's package-dir), so
    `from sim.arrivals import ...` only works from the repository's root."""
    failures, checked = [], 0
    for doc in docs():
        for block in fenced_blocks(doc):
            if block.lang != "python":
                continue
            try:
                tree = ast.parse(block.text)
            except SyntaxError as exc:
                failures.append(f"{doc.name}:{block.line}: not Python: {exc}")
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module:
                    module, names = node.module, [a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    module, names = node.names[0].name, []
                else:
                    continue
                checked += 1
                where = f"{doc.name}:{block.line + node.lineno - 1}: `{module}`"
                top = module.split(".")[0]
                if top in REPO_DIRS and top != "floodgate":
                    failures.append(f"{where}: not an installed module (floodgate.{module})")
                    continue
                try:
                    mod = importlib.import_module(module)
                except ImportError as exc:
                    failures.append(f"{where}: {exc}")
                    continue
                failures += [f"{where} has no {n}" for n in names if not hasattr(mod, n)]
    assert not failures, "\n".join(failures)
    assert checked >= 3, checked


PY_NAME = re.compile(r"(?:floodgate\.)?(?:extproc|controller|sim|bench|floodgate)(?:\.\w+)+")


def resolves(dotted: str) -> bool:
    """`extproc.state.read_demand`, `floodgate.envoy_config.render_compose`: the longest
    importable module (the components as installed: floodgate.extproc, ...), then attributes."""
    parts = dotted.split(".")
    if parts[0] != "floodgate":
        parts = ["floodgate", *parts]
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:
            continue
        obj: Any = importlib.import_module(name)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_python_names_in_prose_exist() -> None:
    """`extproc.config.load_config`, `controller.actuators.kubernetes.KubernetesActuatorConfig`:
    a module, function or class the docs name by its dotted path exists."""
    failures, checked = [], 0
    for doc in docs():
        for line, span in inline_spans(doc):
            word = re.sub(r"\(.*\)$", "", span.split()[0]) if span.split() else ""
            if not PY_NAME.fullmatch(word) or FILE_SUFFIX.search(word):
                continue
            checked += 1
            if not resolves(word):
                failures.append(f"{doc.name}:{line}: `{span}`: no Python name {word}")
    assert not failures, "\n".join(failures)
    assert checked >= 5, checked


def test_the_compose_service_table_names_each_services_image() -> None:
    """docs/compose.md's `| service | image | ...` table: every service compose.yaml runs, with
    the image (and tag) compose.yaml gives it (`${VAR:-default}` read as its default)."""
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    images = {name: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(s.get("image"))) for name, s in services.items()}
    text = (ROOT / "docs" / "compose.md").read_text()
    shown: dict[str, str] = {}
    for line in text.split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) < 2:
            continue
        image = cells[1].strip("`")
        for name in re.findall(r"`([a-z0-9.-]+)`", cells[0].split("(")[0]):  # not "(profile `sim`)"
            m = re.fullmatch(r"(.+)-(\d+)\.\.(\d+)", name)  # `vllm-1..3`
            for n in ([f"{m.group(1)}-{i}" for i in range(int(m.group(2)), int(m.group(3)) + 1)] if m else [name]):
                shown[n] = image
    assert set(shown) == set(images), (sorted(set(images) - set(shown)), sorted(set(shown) - set(images)))
    wrong = {n: (shown[n], images[n]) for n in images if shown[n] != images[n]}
    assert not wrong, f"docs/compose.md shows these images (doc, compose.yaml): {wrong}"


# --- 6. Redis keys ---------------------------------------------------------------------------

# Module-level strings of extproc/schema.py that are not key names (a field, a message).
SCHEMA_NOT_KEYS = {"PAD_FIELD", "REGISTRY_CHANGED", "RESYNC", "EJECTED_FIELD", "RETRIED_ADMITTED"}
# Keys the docs spell that are not Floodgate's (and only these: a key that was renamed must fail).
NOT_KEYS = {
    "zz",  # docs/operations.md, threat model: a junk key an attacker writes (SETRANGE)
    "ctl:leader",  # docs/operations.md: an example `leader.key` an operator sets (`fg:{chat}:ctl:leader`)
}
REDIS_KEY = re.compile(r"fg:\{[^{}\s`]*\}:([a-z_]+(?::[a-z_]+)?)")


@functools.cache
def schema_keys() -> set[str]:
    """The name (after `fg:{pool}:`) of every key of a pool extproc/schema.py spells."""
    from floodgate.extproc import schema
    names = set(schema.SCRIPT_KEYS)
    names |= {v for k, v in vars(schema).items()
              if k.isupper() and isinstance(v, str) and k not in SCHEMA_NOT_KEYS}
    for spelled in (schema.gateway_channel("G", "P"), schema.gateway_claim_key("P", "G")):
        assert spelled.startswith("fg:{P}:") and spelled.endswith(":G"), spelled
        names.add(spelled[len("fg:{P}:"):-len(":G")])
    return names


def test_every_redis_key_the_docs_spell_is_one_floodgate_uses() -> None:
    from floodgate.extproc import schema
    keys, failures, checked = schema_keys(), [], 0
    for doc in docs():
        for m in REDIS_KEY.finditer(doc.text):
            name = m.group(1)
            checked += 1
            if name in keys or name in NOT_KEYS or name.split(":")[0] in keys \
                    or any(k.startswith(name + ":") for k in keys):  # `ctl:*`, `gw:<gateway>`
                continue
            failures.append(f"{doc.name}:{doc.line_of(m.start())}: `{m.group(0)}`: no such key in extproc/schema.py")
        for m in re.finditer(r"fg:controller:[a-z_:]+", doc.text):
            if m.group(0) != schema.controller_leader_key():
                failures.append(f"{doc.name}:{doc.line_of(m.start())}: `{m.group(0)}`: the leader key is "
                                f"{schema.controller_leader_key()}")
    assert not failures, "\n".join(failures)
    assert checked >= 20, checked


def test_the_key_table_lists_every_key_of_a_pool() -> None:
    """docs/admission.md, "Shared state": what an operator finds under `fg:{pool}:` in Redis."""
    text = (ROOT / "docs" / "admission.md").read_text()
    rows = [line for line in text.split("\n") if re.match(r"\| (channel )?`fg:\{pool\}:", line)]
    assert len(rows) > 10, rows
    listed = set()
    for row in rows:
        cell = row.split("|")[1]
        for m in re.finditer(r"`(?:fg:\{pool\})?:([a-z_]+(?::[a-z_]+)?)", cell):
            listed.add(m.group(1))
    missing = sorted(k for k in schema_keys() if k not in listed and k.split(":")[0] + ":*" not in cell_text(rows))
    assert not missing, f"docs/admission.md's key table does not list {missing} (extproc/schema.py)"


def cell_text(rows: list[str]) -> str:
    return " ".join(r.split("|")[1] for r in rows)


if __name__ == "__main__":  # regenerate docs/metrics.md's table
    METRICS_DOC.write_text(rendered_metrics_doc(METRICS_DOC.read_text()))
    sys.exit(0)
