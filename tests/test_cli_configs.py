"""The configs the smaller commands build (eval, attention, convert, chat, demo, serve, generate's prompt and
output): the defaults their --help states are the configs' own, and a bad value is a one-line usage error
(exit 2) on the command line and from code alike."""

from __future__ import annotations

from dataclasses import MISSING
from pathlib import Path
from typing import Any

import pytest
from test_cli_options import option_table

from minigpt.analysis.attention_config import AttentionConfig
from minigpt.analysis.eval_config import EvalConfig
from minigpt.chat.config import ChatConfig
from minigpt.cli.demo import DemoConfig
from minigpt.cli.main import app
from minigpt.common.settings import options_of
from minigpt.convert.config import GGUFConfig, ImportConfig, MergeConfig, OverwriteConfig
from minigpt.errors import UsageError
from minigpt.generate.config import GenerateIOConfig
from minigpt.serve.config import Limits, ServeConfig

COMMANDS: list[tuple[str, type]] = [
    ("eval", EvalConfig), ("attention", AttentionConfig), ("convert from-hf", ImportConfig),
    ("convert from-hf", OverwriteConfig), ("convert to-hf", OverwriteConfig), ("convert to-gguf", GGUFConfig),
    ("convert merge", MergeConfig), ("chat", ChatConfig), ("demo", DemoConfig), ("serve", ServeConfig),
    ("generate", GenerateIOConfig),
]  # fmt: skip


@pytest.mark.parametrize(("command", "config"), COMMANDS)
def test_help_states_the_configs_own_defaults(command: str, config: type) -> None:
    table = option_table(command)
    required = {o.name: Path("x") for o in options_of(config) if o.default is MISSING}
    built = config(**required)
    for o in options_of(config):
        stated = table[o.flag]
        value = getattr(built, o.name)
        if o.name in required:
            assert stated["required"] and stated["default"] is None, o.flag
        elif value is None or value is False:  # no default to state: unset, or a flag that is off
            assert stated["default"] is None, o.flag
        else:
            assert stated["default"] == str(value), o.flag


def test_the_defaults_are_what_the_commands_always_used() -> None:
    assert EvalConfig() == EvalConfig(batch_size=16, max_windows=None, encoding="utf-8", dtype="float32")
    assert ServeConfig() == ServeConfig(host="127.0.0.1", port=8000, api_key=None, max_batch=32, queue=64,
                                        max_tokens=1024)  # fmt: skip
    assert ServeConfig(max_batch=4, max_tokens=99).limits == Limits(max_tokens=99, max_n=4)
    assert DemoConfig().seconds == 120 and DemoConfig().out == Path("checkpoints/demo")
    assert AttentionConfig().top == 3 and not OverwriteConfig().overwrite


def _one_line(result: Any, *needles: str) -> None:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and all(n in lines[0] for n in needles), lines[0]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["serve", "--port", "70000"], ("--port", "65535")),
        (["serve", "--queue", "-1"], ("--queue", "greater than or equal to 0")),
        (["serve", "--max-batch", "0"], ("--max-batch", "greater than or equal to 1")),
        (["eval", "run", "a.txt", "--batch-size", "0"], ("--batch-size", "greater than or equal to 1")),
        (["eval", "run", "a.txt", "--max-windows", "0"], ("--max-windows",)),
        (["attention", "Hi", "--top", "0"], ("--top",)),
        (["attention", "Hi", "--head", "1"], ("--head needs --layer",)),
        (["demo", "--tokens", "0"], ("--tokens",)),
        (["demo", "--max-time", "soon"], ("cannot read duration 'soon'",)),
        (
            ["convert", "from-hf", "a", "b", "--tokenizer", "r50k_base", "--tokenizer-file", "r.tiktoken"],
            ("--tokenizer or --tokenizer-file, not both",),
        ),
        (["convert", "merge", "run"], ("--out",)),
    ],
)
def test_bad_values_are_one_line_usage_errors(runner, args: list[str], needles: tuple[str, ...]) -> None:
    _one_line(runner.invoke(app, args), *needles)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ServeConfig(port=70000), "--port must be from 0 to 65535, got 70000"),
        (lambda: ServeConfig(queue=-1), "--queue must be at least 0, got -1"),
        (lambda: EvalConfig(batch_size=0), "--batch-size must be at least 1, got 0"),
        (lambda: AttentionConfig(top=0), "--top must be at least 1, got 0"),
        (lambda: DemoConfig(tokens=0), "--tokens must be at least 1, got 0"),
        (lambda: DemoConfig(max_time="soon"), "cannot read duration"),
        (lambda: ImportConfig(tokenizer="gpt2", tokenizer_file=Path("r")), "not both"),
    ],
)
def test_configs_built_in_code_are_checked_too(build: Any, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        build()


def test_the_api_key_comes_from_the_environment_and_an_option_overrides_it(runner, monkeypatch) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    seen: list[ServeConfig] = []
    monkeypatch.setattr("minigpt.serve.server.run_server", lambda models, cfg: seen.append(cfg))
    monkeypatch.setattr("minigpt.serve.models.load_models", lambda paths, run_on, cfg: [])
    for args, env in ((["serve", "x"], {"MINIGPT_API_KEY": "from-env"}),
                      (["serve", "x", "--api-key", "given"], {"MINIGPT_API_KEY": "from-env"}),
                      (["serve", "x", "-m", "y", "-m", "z"], {})):  # fmt: skip
        result = runner.invoke(app, args, env=env)
        assert result.exit_code == 0, result.output
    assert [c.api_key for c in seen] == ["from-env", "given", None]
    assert seen[2].models == [Path("y"), Path("z")]
