"""``--help`` explains every option: what it does, its valid values and its default."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from murmura.aggregation import available_aggregators
from murmura.cli import build_parser, main
from murmura.protocols.codecs import available_codecs
from murmura.server.config import MODES
from murmura.tasks.partition import PARTITIONERS
from murmura.tasks.registry import MODELS, TASKS


def parsers(parser: argparse.ArgumentParser, path: str = "murmura"
            ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser and sub-parser, by command path."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def options() -> Iterator[tuple[str, argparse.Action]]:
    for path, parser in parsers(build_parser()):
        for action in parser._actions:
            if action.option_strings and not isinstance(action, (argparse._HelpAction,
                                                                 argparse._VersionAction)):
                yield f"{path} {action.option_strings[-1]}", action


def own_words(text: str) -> str:
    """A help line without the ``(default: ...)`` the parser appends to every config flag."""
    return re.sub(r"\s*\(default: [^)]*\)\s*$", "", text).strip()


def test_every_option_of_every_subcommand_has_a_help_line() -> None:
    missing = [name for name, action in options()
               if action.help is not argparse.SUPPRESS
               and len(own_words(action.help or "")) < 8]  # a bare "(default: off)" is none
    assert not missing, f"options without help: {missing}"
    assert len(list(options())) > 150  # the walk found the config-field flags too


def test_config_flags_show_their_default() -> None:
    parser = build_parser()
    commands = {path: p for path, p in parsers(parser)}
    text = commands["murmura run"].format_help()
    assert "(default: 10)" in text  # --clients
    assert "(default: dense-f32)" in text  # --codec
    assert "(default: sync)" in text  # --mode
    server = commands["murmura server"].format_help()
    assert "(default: runs/server)" in server  # a hand-written flag, shown by the formatter
    assert "(default: 0)" in server  # -v / -q


def test_registry_options_list_their_valid_values() -> None:
    help_of = {name: action.help or "" for name, action in options()}
    for command in ("run", "server", "simulate"):
        prefix = f"murmura {command}"
        assert all(c in help_of[f"{prefix} --codec"] for c in available_codecs())
        assert all(r in help_of[f"{prefix} --defense"] for r in available_aggregators())
        assert all(m in help_of[f"{prefix} --mode"] for m in MODES)
        assert all(t in help_of[f"{prefix} --task"] for t in TASKS)
        assert all(m in help_of[f"{prefix} --model"] for m in MODELS)
        assert all(p in help_of[f"{prefix} --partition"] for p in PARTITIONERS)
    assert "auto" in help_of["murmura client --codec"]
    assert all(r in help_of["murmura peer --rule"] for r in available_aggregators())


@pytest.mark.parametrize("command", ["run", "server", "client", "peer", "simulate", "launch"])
def test_help_renders(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--config" in out and "(default:" in out


def test_a_new_option_hooks_into_validation_before_the_command_starts(capsys,
                                                                      monkeypatch) -> None:
    from murmura import validate as v

    seen: list[str] = []

    def app_file(args, toml) -> None:  # what a helper's --app check would look like
        seen.append(args.command)
        raise v.UsageError("--app my_app.py: no such file")

    monkeypatch.setitem(v._CHECKS, "run", list(v._CHECKS["run"]))
    v.check("run", first=True)(app_file)
    assert main(["run", "--codec", "foo"]) == 2  # the first check answers first
    assert seen == ["run"]
    assert capsys.readouterr().err.strip() == "murmura: error: --app my_app.py: no such file"
