"""Every ``tailguard`` command explains itself: a description, a help line for each option and its default."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tailguard.cli import HelpFormatter, build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"


def _commands(parser: argparse.ArgumentParser, path: str = "tailguard",
              line: str | None = None) -> Iterator[tuple[str, argparse.ArgumentParser, str | None]]:
    """(command path, its parser, its help line in its parent's list) for the top level and every subcommand."""
    yield path, parser, line
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            lines = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{path} {name}", lines.get(name))


COMMANDS = list(_commands(build_parser()))


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._SubParsersAction, argparse._HelpAction, argparse._VersionAction))]


def _name(action: argparse.Action) -> str:
    return "/".join(action.option_strings) or action.dest


def test_the_walk_reaches_every_command():
    paths = {path for path, _, _ in COMMANDS}
    for path in ("tailguard demo", "tailguard serve", "tailguard replay", "tailguard bench", "tailguard bench sweep",
                 "tailguard bench fake-server", "tailguard slo hotspots", "tailguard keys add", "tailguard advise",
                 "tailguard model pull", "tailguard generate"):
        assert path in paths


def test_every_command_has_a_description_and_a_help_line():
    missing = [f"{path}: no help line in its parent's command list" for path, _, line in COMMANDS[1:] if not line]
    missing += [f"{path}: no description" for path, parser, _ in COMMANDS if not (parser.description or "").strip()]
    assert not missing, "\n".join(missing)


def test_every_option_has_help():
    missing = [f"{path} {_name(a)}" for path, parser, _ in COMMANDS for a in _options(parser)
               if not (a.help or "").strip() or a.help == argparse.SUPPRESS]
    assert not missing, "options without help text:\n" + "\n".join(missing)


def test_every_option_with_a_default_shows_it():
    """A value taken when the option is not given is in its help, as the formatter adds it or as the text says it."""
    hidden = []
    for path, parser, _ in COMMANDS:
        assert parser.formatter_class is HelpFormatter, path
        formatter = parser._get_formatter()
        for a in _options(parser):
            if a.nargs == 0 or a.default in (None, [], argparse.SUPPRESS) or not a.option_strings:
                continue  # flags, options unset unless given, positionals
            shown = formatter._expand_help(a)
            if "default" not in shown.lower():
                hidden.append(f"{path} {_name(a)}: {shown}")
    assert not hidden, "defaults not shown:\n" + "\n".join(hidden)


@pytest.mark.parametrize("path", [path for path, _, _ in COMMANDS])
def test_every_help_page_renders(path, capsys):
    argv = path.split()[1:] + ["--help"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tailguard")


def test_demo_help_says_what_the_demo_does_and_its_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "send a burst of concurrent" in out and "tailguard bench" in out
    options = out.split(" options: ", 1)[1]
    for option, default in (("--block-size", "16"), ("--max-num-seqs", "64"), ("--max-prefill-chunk", "512"),
                            ("--max-tokens", "48"), ("--output-dir", "runs/demo"), ("--model", "smollm2")):
        entry = re.search(re.escape(option) + r" [A-Z_]+ (.*?)(?= --[a-z]|$)", options)
        assert entry and re.search(r"default:? " + re.escape(default), entry.group(1)), option


def test_the_readme_lists_every_command():
    table = [line for line in README.read_text(encoding="utf-8").splitlines() if line.startswith("| `tailguard ")]
    listed = {line.split("`")[1].split()[1] for line in table}
    commands = {path.split()[1] for path, _, _ in COMMANDS if path.count(" ") == 1}
    assert commands <= listed, f"not in the README's command table: {sorted(commands - listed)}"


@pytest.mark.real_model
def test_the_kv_cache_figures_of_help_and_readme_are_what_the_engine_sizes(smollm2_path):
    """``--kv-cache-memory auto`` in the help and the README: the tokens and 2K conversations the engine allots."""
    from tailguard.engine.engine import EngineArgs, LLMEngine

    serve = next(parser for path, parser, _ in COMMANDS if path == "tailguard serve")
    help_text = " ".join(next(a.help for a in serve._actions if a.dest == "kv_cache_memory").split())
    readme = " ".join(README.read_text(encoding="utf-8").split())
    for dtype in ("auto", "float16"):  # auto: int8 with the CPU's native weights
        tokens = LLMEngine(EngineArgs(model=str(smollm2_path), kv_cache_dtype=dtype, num_threads=1)).kv_capacity_tokens
        figure = re.compile(rf"{tokens:,} tokens[^)]*?: {tokens // 2048} conversations")
        assert figure.search(help_text) and figure.search(readme), (dtype, tokens)
