"""The documentation is checked against the code, so that it cannot drift.

- every relative link and ``#anchor`` in README.md and docs/*.md resolves
  (the file exists; the anchor is one of GitHub's heading slugs there);
- every ``shardps...`` name the README uses in code imports, every Python
  block in the README and docs parses, and its calls of public classes use
  keywords those classes take;
- docs/configuration.md lists every argument of ``DistributedOptimizer``,
  every field of its option groups, every ``shardps-server`` flag and every
  flag of the ``shardps`` commands, each with the code's default, and
  nothing that no longer exists;
- docs/architecture.md's room table names every module of the tree;
- README.md stays a front door (at most 300 lines) and holds the exact test
  command that ``.ci/run`` runs.

Fast: no servers, no network; only imports and parsing.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
CONFIGURATION = DOCS / "configuration.md"
ARCHITECTURE = DOCS / "architecture.md"
MAX_README_LINES = 300

FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
#: ``shardps`` followed by dotted names; not part of a path (``proto/shardps.proto``) or a longer word
DOTTED = re.compile(r"(?<![\w/.\-])shardps(?:\.[A-Za-z_]\w*)+")
#: the protobuf package of the wire contract, not a Python module
NOT_PYTHON = ("shardps.v1",)


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


# ---------------------------------------------------------------- markdown parsing


def split_code(text: str) -> tuple[list[tuple[int, str]], list[tuple[str, str]]]:
    """``(prose lines as (line number, text), fenced blocks as (language, code))``."""
    prose: list[tuple[int, str]] = []
    blocks: list[tuple[str, str]] = []
    fence, lang, body = None, "", []
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence, lang, body = m.group(1), m.group(2).lower(), []
            else:
                prose.append((number, line))
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2):
            blocks.append((lang, "\n".join(body)))
            fence = None
        else:
            body.append(line)
    assert fence is None, "a code fence is never closed"
    return prose, blocks


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and underscores
    return text.replace(" ", "-")


def headings(text: str) -> list[tuple[int, str, int]]:
    """``(level, slug, line number)`` of every heading outside code blocks, GitHub's ``-1``, ``-2`` for repeats."""
    seen: dict[str, int] = {}
    found = []
    prose, _ = split_code(text)
    for number, line in prose:
        m = HEADING.match(line)
        if not m:
            continue
        base = github_slug(m.group(2))
        slug = base if base not in seen else f"{base}-{seen[base]}"
        seen[base] = seen.get(base, 0) + 1
        found.append((len(m.group(1)), slug, number))
    return found


def anchors(path: Path) -> set[str]:
    return {slug for _, slug, _ in headings(path.read_text())}


def links(text: str) -> list[tuple[int, str]]:
    """``(line number, target)`` of every inline link and image outside code."""
    found = []
    prose, _ = split_code(text)
    for number, line in prose:
        line = CODE_SPAN.sub(lambda m: "CODE" if "](" not in m.group(0) else m.group(0), line)
        found += [(number, m.group(1)) for m in LINK.finditer(line)]
    return found


def section(path: Path, slug: str) -> list[str]:
    """The lines under the heading ``slug``, up to the next heading of any level."""
    text = path.read_text()
    lines = text.splitlines()
    marks = headings(text)
    for i, (_, found, number) in enumerate(marks):
        if found == slug:
            end = marks[i + 1][2] - 1 if i + 1 < len(marks) else len(lines)
            return lines[number:end]
    raise AssertionError(f"{path.relative_to(REPO)} has no heading #{slug}")


def split_row(line: str) -> list[str]:
    """The cells of a markdown table row; ``|`` inside a code span or escaped as ``\\|`` stays in its cell."""
    cells, cell, ticks, i = [], "", 0, 0
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    while i < len(body):
        ch = body[i]
        if ch == "`":
            run = len(body[i:]) - len(body[i:].lstrip("`"))
            ticks = 0 if ticks == run else (run if ticks == 0 else ticks)
            cell += "`" * run
            i += run
            continue
        if ch == "\\" and body[i + 1:i + 2] == "|":
            cell += "|"
            i += 2
            continue
        if ch == "|" and ticks == 0:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
        i += 1
    cells.append(cell.strip())
    return cells


def table_rows(lines: list[str]) -> list[list[str]]:
    """Data rows of every table in ``lines`` (header and separator rows dropped)."""
    rows, table = [], []
    for line in [*lines, ""]:
        if line.lstrip().startswith("|"):
            table.append(split_row(line))
            continue
        if len(table) >= 2 and all(re.fullmatch(r":?-+:?", c) for c in table[1]):
            rows += table[2:]
        table = []
    return rows


def code_value(cell: str) -> str | None:
    """The text of a cell that is one code span (`` `x` ``), else None."""
    m = re.fullmatch(r"(`+)\s?(.+?)\s?\1", cell.strip())
    return m.group(2) if m else None


def documented(path: Path, slug: str) -> dict[str, str]:
    """``name -> default cell`` of the table rows under heading ``slug`` (first column a code span)."""
    found: dict[str, str] = {}
    for row in table_rows(section(path, slug)):
        name = code_value(row[0])
        assert name is not None and len(row) >= 3, f"{path.name}#{slug}: a row without a `name` and a default: {row}"
        assert name not in found, f"{path.name}#{slug}: {name} is listed twice"
        found[name] = row[1]
    assert found, f"{path.name}#{slug}: no table rows"
    return found


REQUIRED = object()
NO_DEFAULT = object()


def default_problem(cell: str, value: object) -> str | None:
    """None if ``cell`` renders ``value``; else what is wrong.

    ``required`` for a value that must be given, ``—`` for an action without a
    default (``--version``); else one code span holding a Python literal equal to
    the value and of its type (``'fp32'`` and ``"fp32"`` alike), or ``Name()`` for
    a dataclass instance equal to its class's defaults.
    """
    cell = cell.strip()
    if value is REQUIRED:
        return None if cell == "required" else f"is required: write `required`, not {cell!r}"
    if value is NO_DEFAULT:
        return None if cell in ("—", "-") else f"has no default: write `—`, not {cell!r}"
    text = code_value(cell)
    if text is None:
        return f"default cell {cell!r} is not one code span (expected `{value!r}`)"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        expected = f"{type(value).__name__}()"
        if text.replace(" ", "") != expected:
            return f"`{text}` should be `{expected}`"
        return None if value == type(value)() else f"{value!r} is not {expected}"
    try:
        literal = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return f"`{text}` is not a Python literal (expected `{value!r}`)"
    if type(literal) is not type(value) or literal != value:
        return f"`{text}` should be `{value!r}`"
    return None


def check_table(path: Path, slug: str, expected: dict[str, object]) -> None:
    doc = documented(path, slug)
    problems = [f"missing: {name} (default {value if value in (REQUIRED, NO_DEFAULT) else repr(value)})"
                for name, value in expected.items() if name not in doc]
    problems += [f"no longer exists: {name}" for name in doc if name not in expected]
    problems += [f"{name}: {p}" for name, value in expected.items()
                 if name in doc and (p := default_problem(doc[name], value)) is not None]
    assert not problems, f"{path.relative_to(REPO)}#{slug}:\n" + "\n".join(problems)


# ---------------------------------------------------------------- links


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(path: Path) -> None:
    broken = []
    for number, target in links(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}:{number}: {target}"
        if not dest.is_relative_to(REPO):
            broken.append(f"{where}: points outside the repository")
        elif not dest.exists():
            broken.append(f"{where}: no such file")
        elif anchor:
            if dest.suffix != ".md":
                broken.append(f"{where}: an anchor into a file that is not markdown")
            elif anchor not in anchors(dest):
                broken.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


#: Material outside the repository the docs must not point at (the team's notes beside the clone).
OUTSIDE = ("../" + "shared", "DESIGN" + ".md")


def test_docs_stand_on_their_own() -> None:
    """The documentation is in the project's own words: it never points at material outside the repository."""
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}"
             for p in markdown_files() for n, line in enumerate(p.read_text().splitlines(), 1)
             if any(word in line for word in OUTSIDE)]
    assert not found, "\n".join(found)


TOP_FOLDERS = ("api", "proto", "common", "server", "worker", "cli", "apps", "tests", "benchmarks", "deploy",
               "examples", "docs", ".ci")
#: a repository path in a code span: a top-level folder, then path characters (``DIR/shard-<index>`` is not one)
REPO_PATH = re.compile(r"^(?:%s)/[\w./-]*$" % "|".join(re.escape(f) for f in TOP_FOLDERS))


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_paths_named_in_code_exist(path: Path) -> None:
    """A file or folder named in code (`` `server/store.py` ``, repository-relative) exists."""
    text = path.read_text()
    prose, blocks = split_code(text)
    spans = [m.group(2).strip() for _, line in prose for m in CODE_SPAN.finditer(line)]
    words = [w.strip(",;:()'\"") for span in spans for w in span.replace(",", " ").split()]
    missing = sorted({w for w in words if REPO_PATH.match(w) and not (REPO / w.rstrip("/")).exists()})
    assert not missing, f"{path.relative_to(REPO)} names paths that do not exist: {missing}"


# ---------------------------------------------------------------- names and code


def resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted``, then get the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not ".".join(parts[:cut]).startswith(exc.name):
                raise  # a module that exists but imports something missing
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def readme_code() -> tuple[list[str], list[tuple[str, str]]]:
    """The README's inline code spans (outside fences) and its fenced blocks."""
    prose, blocks = split_code(README.read_text())
    spans = [m.group(2) for _, line in prose for m in CODE_SPAN.finditer(line)]
    return spans, blocks


def readme_names() -> set[str]:
    spans, blocks = readme_code()
    names = {m.group(0) for text in [*spans, *(code for _, code in blocks)] for m in DOTTED.finditer(text)}
    for lang, code in blocks:
        if lang == "python":
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "shardps":
                    names |= {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Import):
                    names |= {a.name for a in node.names if a.name.split(".")[0] == "shardps"}
    return {n for n in names if not n.startswith(NOT_PYTHON)}


def test_readme_names_import() -> None:
    names = readme_names()
    assert "shardps.DistributedOptimizer" in names, "the README's example imports DistributedOptimizer from shardps"
    failed = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not failed, "README.md names what does not import:\n" + "\n".join(failed)


def python_blocks() -> list[tuple[Path, str]]:
    return [(p, code) for p in markdown_files() for lang, code in split_code(p.read_text())[1] if lang == "python"]


def allowed_keywords(name: str, obj: object) -> set[str] | None:
    """The keywords a public callable takes by name; None when it takes any."""
    params = inspect.signature(obj).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if name == "NodeOptimizer":  # its **kwargs go to DistributedOptimizer: those it forwards
        return named | set(resolve("shardps.worker.node.optimizer.FORWARDED_KEYWORDS"))
    if any(p.kind == p.VAR_KEYWORD for p in params) and name != "DistributedOptimizer":
        return None  # DistributedOptimizer's **legacy only names the option group a moved keyword belongs to
    return named


def test_python_examples_parse_and_call_real_keywords() -> None:
    import shardps

    public = set(shardps.__all__)
    problems = []
    for path, code in python_blocks():
        try:
            tree = ast.parse(code)
        except SyntaxError as exc:
            problems.append(f"{path.relative_to(REPO)}: a python block does not parse: {exc}")
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id in public:
                name, obj = func.id, getattr(shardps, func.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in public:
                name, obj = f"{func.value.id}.{func.attr}", getattr(getattr(shardps, func.value.id), func.attr)
            else:
                continue
            allowed = allowed_keywords(name, obj)
            if allowed is None:
                continue
            problems += [f"{path.relative_to(REPO)}: {name}({k.arg}=...) is not an argument of {name}"
                         for k in node.keywords if k.arg is not None and k.arg not in allowed]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- configuration reference


OPTION_GROUPS = ("ConsistencyOptions", "WireOptions", "ObservabilityOptions")


def test_configuration_lists_every_distributed_optimizer_argument() -> None:
    from shardps.worker import DistributedOptimizer

    expected = {}
    for p in inspect.signature(DistributedOptimizer).parameters.values():
        if p.name in ("self", "optimizer", "named_parameters") or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        expected[p.name] = REQUIRED if p.default is p.empty else p.default
    check_table(CONFIGURATION, "distributedoptimizer", expected)


@pytest.mark.parametrize("group", OPTION_GROUPS)
def test_configuration_lists_every_option_field(group: str) -> None:
    cls = resolve(f"shardps.worker.config.{group}")
    assert cls is resolve(f"shardps.{group}"), f"shardps.{group} is not shardps.worker.config.{group}"
    expected = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            expected[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            expected[f.name] = f.default_factory()
        else:
            expected[f.name] = REQUIRED
    check_table(CONFIGURATION, group.lower(), expected)


def capture_parser(run, argv: list[str]) -> argparse.ArgumentParser:
    """The parser a command line entry point builds: stop it at its first ``parse_args`` and keep the parser."""

    class Captured(Exception):
        pass

    def capture(self, *args, **kwargs):
        raise Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            run(argv)
        except Captured as captured:
            return captured.args[0]
    raise AssertionError(f"{run.__module__}.{run.__name__} never called parse_args")


def server_parser() -> argparse.ArgumentParser:
    from shardps.cli import server

    for name in ("build_parser", "make_parser", "parser"):  # a public builder, when the module offers one
        if callable(getattr(server, name, None)):
            return getattr(server, name)()
    return capture_parser(server.parse_args, ["--shard-index", "0", "--num-shards", "1"])


def parser_options(parser: argparse.ArgumentParser) -> dict[str, object]:
    """``--flag -> default`` of every option but ``--help``: REQUIRED, NO_DEFAULT, or the default."""
    options = {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or not action.option_strings:
            continue
        flag = max(action.option_strings, key=len)
        if action.required:
            options[flag] = REQUIRED
        elif action.default is argparse.SUPPRESS:
            options[flag] = NO_DEFAULT
        else:
            options[flag] = action.default
    return options


def test_configuration_lists_every_server_flag() -> None:
    options = parser_options(server_parser())
    assert {"--shard-index", "--num-shards", "--lease-seconds", "--auth-token-file"} <= set(options)
    check_table(CONFIGURATION, "shardps-server", options)


def test_configuration_lists_shard_config_fields_without_a_flag() -> None:
    from shardps import ShardConfig

    fields = {f.name: f for f in dataclasses.fields(ShardConfig)}
    doc = documented(CONFIGURATION, "shardconfig-fields-without-a-flag")
    unknown = sorted(set(doc) - set(fields))
    assert not unknown, f"configuration.md lists ShardConfig fields that no longer exist: {unknown}"
    flags = {flag.removeprefix("--").replace("-", "_") for flag in parser_options(server_parser())}
    flagless = {name for name in fields if name not in flags} - {
        "init_timeout_seconds", "reject_nonfinite"}  # --init-timeout, --allow-nonfinite
    assert flagless == set(doc), f"ShardConfig fields without a flag: {sorted(flagless)}; listed: {sorted(doc)}"
    wrong = [f"{n}: {p}" for n in doc if (p := default_problem(doc[n], fields[n].default)) is not None]
    assert not wrong, "\n".join(wrong)


SECURITY_FLAGS = ("--tls-ca", "--tls-cert", "--tls-key", "--auth-token-file")


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """``"shardps train digits" -> its parser`` for every leaf command of ``shardps``."""
    from shardps.cli import main

    found = {}

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            found[" ".join(words)] = parser
        for sub in subs:
            for name, child in sub.choices.items():
                walk(child, (*words, name))

    walk(capture_parser(main.main, ["--help"]), ("shardps",))
    return found


def test_configuration_lists_every_shardps_command_flag() -> None:
    commands = command_parsers()
    assert {"shardps train digits", "shardps stats", "shardps health", "shardps reset", "shardps checkpoint",
            "shardps export"} <= set(commands)
    security: dict[str, object] = {}
    for command, parser in commands.items():
        options = parser_options(parser)
        for flag in SECURITY_FLAGS:
            if flag in options:
                default = options.pop(flag)
                assert security.setdefault(flag, default) == default, f"{command} {flag}: another default"
        check_table(CONFIGURATION, command.replace(" ", "-"), options)
    check_table(CONFIGURATION, "security-flags", security)


# ---------------------------------------------------------------- architecture


def test_architecture_room_table_matches_the_tree() -> None:
    rooms = ("api", "proto", "common", "server", "worker", "cli", "apps")
    tree = {p.relative_to(REPO).as_posix() for room in rooms for p in (REPO / room).rglob("*.py")
            if "__pycache__" not in p.parts and (p.name != "__init__.py" or p.parent.name == "api")}
    listed = set()
    for row in table_rows(section(ARCHITECTURE, "room-by-room")):
        listed |= {m.group(2) for m in CODE_SPAN.finditer(row[1])}
    listed_py = {p for p in listed if p.endswith(".py")}
    missing = sorted(tree - listed_py)
    gone = sorted(p for p in listed if not (REPO / p).exists())
    assert not missing and not gone, (f"docs/architecture.md#room-by-room: add {missing}; "
                                      f"these no longer exist: {gone}")


# ---------------------------------------------------------------- the README as a front door


def test_readme_is_short_and_holds_the_ci_test_command() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in ci if line.strip() and not line.lstrip().startswith("#")]
    test_line = next((c for c in commands if "pytest" in c), None)
    assert test_line is not None, ".ci/run runs no pytest command"
    _, blocks = split_code(README.read_text())
    block_lines = {line.strip() for _, code in blocks for line in code.splitlines()}
    assert test_line in block_lines, f"README.md must show CI's test command in a code block: {test_line}"
    setup = 'pip install torch==2.13.0 && pip install -e ".[apps]" && shardps train digits --report report.json'
    assert setup in block_lines, f"README.md must show the set-up command in a code block: {setup}"
