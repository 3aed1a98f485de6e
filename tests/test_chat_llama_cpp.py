"""A chat run's GGUF in llama.cpp's chat mode: the stored template uses only what llama.cpp's own Jinja engine
parses, and `llama-completion --jinja` (llama.cpp's binaries in ../shared, when present) answers a LoRA chat run
as `minigpt chat -t 0` does, for a bpe and an r50k_base tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from jinja2 import nodes

pytest.importorskip("gguf", reason="the gguf extra is not installed: pip install -e '.[gguf]'")

from conftest import R50K_FILE, ROOT  # noqa: E402
from test_finetune import BASE_TEXT, chat_data, conversations, ft, tiny, write_jsonl  # noqa: E402
from test_gguf import ROTARY, save_run  # noqa: E402

from minigpt.chat.template import ChatTemplate  # noqa: E402
from minigpt.cli.main import app  # noqa: E402
from minigpt.data.dataset import DataConfig  # noqa: E402
from minigpt.tokenizer.bpe import TiktokenTokenizer  # noqa: E402
from minigpt.train.loop import train  # noqa: E402

LLAMA_COMPLETION = ROOT.parent / "shared" / "tools" / "llama.cpp" / "bin" / "llama-completion"

# What llama.cpp's Jinja engine (common/jinja: parser.cpp, value.cpp) parses and defines, kept to what a chat
# template needs. Its parser reads a parenthesised tuple only without a trailing comma, so `in ('user',)` stops
# it ("Unexpected token: )"): tuples are left out altogether.
LLAMA_NODES = (
    nodes.Template, nodes.Output, nodes.TemplateData, nodes.For, nodes.If, nodes.Assign, nodes.Name,
    nodes.Const, nodes.List, nodes.Getitem, nodes.Getattr, nodes.Compare, nodes.Operand, nodes.And, nodes.Or,
    nodes.Not, nodes.CondExpr, nodes.Concat, nodes.Add, nodes.Call, nodes.Filter, nodes.Test,
)  # fmt: skip
LLAMA_FILTERS = {"default", "upper", "lower", "title", "capitalize", "length", "replace", "int", "float",
                 "string", "safe", "tojson", "indent", "abs"}  # fmt: skip
LLAMA_TESTS = {"defined", "undefined", "none", "string", "number", "mapping", "iterable", "sequence",
               "boolean", "true", "false", "eq", "equalto", "ne", "in"}  # fmt: skip
LLAMA_FUNCTIONS = {"raise_exception", "namespace", "range", "strftime_now"}


def beyond_llama_cpp(template: str) -> list[str]:
    """What in `template` (parsed by jinja2, as transformers does) llama.cpp's Jinja engine lacks."""
    found = []
    for node in jinja2.Environment().parse(template).find_all(nodes.Node):
        if not isinstance(node, LLAMA_NODES):
            found.append(f"{type(node).__name__} at line {node.lineno}")
        elif isinstance(node, nodes.Filter) and node.name not in LLAMA_FILTERS:
            found.append(f"filter {node.name}")
        elif isinstance(node, nodes.Test) and node.name not in LLAMA_TESTS:
            found.append(f"test {node.name}")
        elif isinstance(node, nodes.Call) and getattr(node.node, "name", None) not in LLAMA_FUNCTIONS:
            found.append(f"call of {getattr(node.node, 'name', None) or getattr(node.node, 'attr', '?')}")
    return found


def test_the_chat_template_uses_only_what_llama_cpps_jinja_parses() -> None:
    assert beyond_llama_cpp(ChatTemplate.jinja()) == []
    # the check itself: what stopped llama.cpp's chat mode, and what its engine does not define
    assert beyond_llama_cpp("{% if m['role'] in ('user',) %}x{% endif %}") == ["Tuple at line 1"]
    assert beyond_llama_cpp("{{ m | wordwrap }}{{ m is divisibleby(2) }}{{ m.pop() }}{{ cycler() }}") == [
        "filter wordwrap", "test divisibleby", "call of pop", "call of cycler"
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------- llama.cpp

needs_llama_cpp = pytest.mark.skipif(
    not LLAMA_COMPLETION.is_file(), reason="llama.cpp's binaries are absent from ../shared/tools"
)
ANSWER_TOKENS = 16
SYSTEM = "be brief."
QUESTION = "What is the capital of Italy?"


def base_run(kind: str, tmp_path: Path) -> Path:
    """The bpe base: a tokenizer and a tiny model trained a few steps on text. r50k_base's 50,257-row head is
    slow to train, so its base is random (random enough that every answer token is a clear choice)."""
    if kind == "bpe":
        (tmp_path / "base.txt").write_text(BASE_TEXT)
        data = DataConfig(paths=(tmp_path / "base.txt",), tokenizer="bpe", vocab_size=300, cache_dir=tmp_path)
        train(tiny(max_iters=8, arch="modern"), data, out=tmp_path / "base")
    elif R50K_FILE.is_file():
        save_run(tmp_path / "base", TiktokenTokenizer.from_file(R50K_FILE), **ROTARY, block_size=64)
    else:
        pytest.skip("../shared/data/r50k_base.tiktoken is absent")
    return tmp_path / "base"


def lora_chat_run(kind: str, tmp_path: Path) -> Path:
    """A LoRA chat run: a few steps on conversations, which add the chat tokens; the export merges it."""
    chat = write_jsonl(tmp_path / "chat.jsonl", conversations(8))
    settings = ft(max_iters=2, lora_rank=4, batch_size=2, eval_iters=1)
    train(settings, chat_data(chat, tmp_path), out=tmp_path / "lora", init_from=base_run(kind, tmp_path))
    return tmp_path / "lora"


def llama_cpp_chat(gguf: Path) -> str:
    """llama.cpp's greedy single-turn answer to SYSTEM and QUESTION through the file's template (--jinja)."""
    command = [str(LLAMA_COMPLETION), "-m", str(gguf), "--jinja", "-cnv", "-st", "-sys", SYSTEM, "-p", QUESTION,
               "--temp", "0", "-n", str(ANSWER_TOKENS), "--no-display-prompt", "--no-warmup", "-t", "1"]  # fmt: skip
    for _ in range(8):
        result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
        assert result.returncode == 0, result.stderr.decode(errors="replace")[-3000:]
        # llama.cpp prints from a logging thread that can lose the end of its output at exit (its issue 22142);
        # the timings are logged last, so when they are there, so is the answer
        if b"total time" in result.stderr:
            break
    else:
        pytest.fail("llama-completion lost the end of its output 8 times")
    out = result.stdout.decode("utf-8", errors="replace")
    assert out.endswith("\n\n"), out
    return out[:-2].removesuffix(" [end of text]\n")


@pytest.mark.slow
@needs_llama_cpp
@pytest.mark.parametrize("kind", ["bpe", "r50k"])
def test_llama_cpps_chat_mode_answers_as_minigpt_chat(kind: str, tmp_path: Path, runner) -> None:
    run = lora_chat_run(kind, tmp_path)
    gguf = tmp_path / "chat.gguf"
    result = runner.invoke(app, ["convert", "to-gguf", str(run), str(gguf)])
    assert result.exit_code == 0, result.output
    minigpt = subprocess.run(
        [sys.executable, "-m", "minigpt", "chat", str(run), "-t", "0", "-n", str(ANSWER_TOKENS), "--system", SYSTEM],
        input=f"{QUESTION}\n".encode(), capture_output=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert minigpt.returncode == 0, minigpt.stderr.decode(errors="replace")
    answer = minigpt.stdout.decode()
    assert answer.endswith("\n") and len(answer.strip()) > 8, answer
    assert llama_cpp_chat(gguf) == answer[:-1], f"minigpt chat answered {answer[:-1]!r}"
