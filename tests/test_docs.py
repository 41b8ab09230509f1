"""docs/*.md as a reader takes them: every flag of a `bridgelm`, benchmarks/ or tools/ command they show (in a bash
block or inline) is one the command takes, every `from bridgelm... import ...` resolves, and every repo path they name
in backticks exists, so the docs cannot drift from the code (tests/test_readme.py does the same for the README)."""

import argparse
import ast
import importlib
import importlib.util
import re
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
SCRIPT = re.compile(r"(?:^|/)((?:benchmarks|tools)/\w+\.py)$")
REPO_PATH = re.compile(r"(?<![\w/.$~-])(?:src|benchmarks|tests|tools|docs|examples)/[\w./-]*\w/?")
SEPARATORS = {";", "&&", "||", "|", "&"}
# demo-log.md quotes its older entries' commands as they were run, and its head names today's arm for each of these
RETIRED = {"docs/demo-log.md": {"--blocks-only", "--multi-group", "--set-reward"}}
FOREIGN = {"--no-deps", "--standalone", "--apply_chat_template"}  # pip's, torchrun's and lm_eval's


def where(doc: Path, text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    return f"{doc.relative_to(ROOT)}:{line}"


def fenced(language: str) -> list[tuple[str, str]]:
    """(file:line, body) of each ```language block of the docs."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M):
            out.append((where(doc, text, m.start(1)), m.group(1)))
    return out


def inline() -> list[tuple[str, str]]:
    """(file:line, text) of each `code span` of the docs outside fenced blocks; a span may wrap onto the next line."""
    out = []
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group().count("\n"), doc.read_text(), flags=re.S | re.M)
        for m in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", text):
            out.append((where(doc, text, m.start()), m.group(1).replace("\n", " ")))
    return out


def shell_lines(body: str) -> list[str]:
    """A bash block's command lines: continuations joined, here-documents dropped."""
    lines, heredoc = [], None
    for line in body.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        lines.append(line)
        m = re.search(r"<<-?\s*['\"]?(\w+)", line)
        heredoc = m.group(1) if m else None
    return lines


def split(line: str) -> list[list[str]]:
    """One shell line as the argv of each command in it (split at ; && | ...), comments dropped."""
    lexer = shlex.shlex(line.replace("\\|", " "), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    argvs = [[]]
    for token in lexer:
        argvs.append([]) if token in SEPARATORS else argvs[-1].append(token)
    return [a for a in argvs if a]


def program(argv: list[str]) -> tuple[str, list[str]] | None:
    """(`bridgelm` or the script's path, the arguments after it) of a command this project owns, else None."""
    for i, word in enumerate(argv):
        if word == "bridgelm":
            return "bridgelm", argv[i + 1 :]
        if m := SCRIPT.search(word):
            return m.group(1), argv[i + 1 :]
    return None  # another program: pip, lighteval, ...


def commands() -> list[tuple[str, str, list[str]]]:
    """(file:line, program, arguments) of each command of ours the docs show, in bash blocks and inline."""
    lines = [(at, line) for at, body in fenced("bash") for line in shell_lines(body)]
    lines += [(at, span) for at, span in inline() if re.match(r"(python3? |torchrun |bridgelm |benchmarks/|tools/)",
                                                                span)]
    found = []
    for at, line in lines:
        for argv in split(line):
            if (owned := program(argv)) is not None:
                found.append((at, *owned))
    return found


def flags(args: list[str]) -> list[str]:
    """The --flags among a command's arguments, as written (`[--quick]`, `--out=D` and `(--run` included)."""
    return [m.group(1) for a in args if (m := re.match(r"[\[(]*(--[\w-]+)", a))]


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return None if sub is None else sub.choices.get(name)


@cache
def bridgelm_parser() -> argparse.ArgumentParser:
    from bridgelm.cli import build_parser

    return build_parser()


def bridgelm_options(args: list[str]) -> tuple[str, set[str]]:
    """(`bridgelm <command> [<subcommand>]`, the flags it takes): its subcommands followed as far as args name them."""
    parser, name = bridgelm_parser(), "bridgelm"
    for word in args:
        if (child := subparser(parser, word)) is None:
            break
        parser, name = child, f"{name} {word}"
    return name, options(parser)


class _Parsed(Exception):
    pass


@cache
def script_options(path: str) -> frozenset[str]:
    """The flags a benchmarks/ or tools/ script takes: its main() run up to parse_args, where its parser is caught."""
    def catch(parser, *args, **kwargs):
        raise _Parsed(parser)

    saved_path, saved_parse = list(sys.path), argparse.ArgumentParser.parse_args
    spec = importlib.util.spec_from_file_location(f"docs_{Path(path).stem}", ROOT / path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # as a dataclass in it needs
    try:
        spec.loader.exec_module(module)
        argparse.ArgumentParser.parse_args = catch
        module.main()
    except _Parsed as parsed:
        return frozenset(options(parsed.args[0]))
    finally:
        argparse.ArgumentParser.parse_args, sys.path[:] = saved_parse, saved_path
        del sys.modules[spec.name]
    raise AssertionError(f"{path}: main() never parsed its arguments")


def test_the_docs_show_commands_of_every_kind():
    found = {prog for _, prog, _ in commands()}
    assert "bridgelm" in found and {"benchmarks/generate.py", "benchmarks/gpu_check.py"} <= found


def retired(at: str) -> set[str]:
    return RETIRED.get(at.split(":")[0], set())


def wrong_flags(at: str, prog: str, args: list[str]) -> list[str]:
    """What is wrong with one command of the docs: a bridgelm command that does not exist, flags it does not take."""
    if prog != "bridgelm":  # a script named without flags may be a module (benchmarks/bench_models.py)
        name, known = prog, script_options(prog) if flags(args) else set()
    else:
        name, known = bridgelm_options(args)
        if name == "bridgelm" and args and re.fullmatch(r"[a-z][a-z-]*", args[0]):
            return [f"{at}: bridgelm has no command {args[0]}"]
    return [f"{at}: {name} has no {flag}" for flag in flags(args) if flag not in known | retired(at)]


def test_every_flag_of_every_docs_command_exists():
    wrong = [w for command in commands() for w in wrong_flags(*command)]
    assert not wrong, "\n".join(wrong)


def test_the_retired_flags_the_demo_log_quotes_are_retired_and_named_as_todays_arms():
    head = (ROOT / "docs/demo-log.md").read_text()[:1000]
    for flag in RETIRED["docs/demo-log.md"]:
        assert flag not in bridgelm_options(["demo"])[1] and f"`{flag}` is `" in head, flag


def all_options() -> set[str]:
    """Every flag of every bridgelm command and of every benchmarks/ or tools/ script with a parser."""
    found, parsers = set(), [bridgelm_parser()]
    while parsers:
        parser = parsers.pop()
        found |= options(parser)
        parsers += [a for action in parser._actions if isinstance(action, argparse._SubParsersAction)
                    for a in action.choices.values()]
    scripts = [p for p in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("tools/*.py")]
               if "ArgumentParser(" in p.read_text()]
    return found.union(*(script_options(str(p.relative_to(ROOT))) for p in scripts))


def test_every_flag_the_docs_name_alone_is_one_of_ours():
    """A flag named in prose without its command (`--foreign-groups`) is at least some command's flag."""
    named = [(at, flag) for at, span in inline() if span.startswith("--") for flag in flags(span.split())]
    assert len(named) > 10
    known = all_options() | FOREIGN
    assert not [f"{at}: {flag}" for at, flag in named if flag not in known | retired(at)]


def binds(module: str, name: str) -> bool:
    """Whether a bridgelm module has name at its top level (a submodule, a def, a class, an import or an assignment),
    read from its source: an integration imports its tool (lighteval, ...), which need not be installed here."""
    spec = importlib.util.find_spec(module)
    if spec.submodule_search_locations is not None and importlib.util.find_spec(f"{module}.{name}") is not None:
        return True
    bound = set()
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            bound |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return name in bound


def test_every_name_the_docs_import_from_bridgelm_exists():
    code = fenced("python") + inline()
    imports = [(at, *m.groups()) for at, c in code for m in re.finditer(r"from (bridgelm[\w.]*) import ([\w, ]+)", c)]
    assert len(imports) >= 2
    missing = [f"{at}: {module}.{name.strip()}" for at, module, names in imports for name in names.split(",")
               if not binds(module, name.strip())]
    assert not missing, "\n".join(missing)


def test_every_repo_path_the_docs_name_in_backticks_exists():
    spans = inline() + fenced("bash")
    named = [(at, m.group()) for at, span in spans for m in REPO_PATH.finditer(span.split("::")[0])]
    assert len(named) > 10
    missing = [f"{at}: {path}" for at, path in named if not any(ROOT.glob(path.rstrip("/")))]
    assert not missing, "\n".join(missing)


def test_every_link_between_the_docs_resolves():
    """[text](target) relative to the doc that holds it, as GitHub resolves it (docs/x.md, not docs/docs/x.md)."""
    links = [(doc, m.group(1)) for doc in DOCS for m in re.finditer(r"\]\(([^)#\s:]+)(?:#[^)]*)?\)", doc.read_text())]
    assert links
    assert not [f"{doc.relative_to(ROOT)}: {target}" for doc, target in links if not (doc.parent / target).exists()]


@pytest.mark.parametrize("line, expected", [
    ("torchrun --nproc_per_node 8 -m bridgelm sft --model M  # --nope", ("bridgelm", ["sft", "--model", "M"])),
    ("PYTHONPATH=src python benchmarks/gpu_check.py --out $OUT/gc", ("benchmarks/gpu_check.py", ["--out", "$OUT/gc"])),
    ("pip install --no-deps wheels/*.whl", None),
])
def test_commands_are_read_as_a_shell_would(line, expected):
    (argv,) = split(line)
    assert program(argv) == expected
