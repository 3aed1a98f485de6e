"""Convert Hugging Face GPT-2, Llama and Qwen3 checkpoints to minigpt run directories and back, never unpickling."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from minigpt.chat.template import END, has_chat_tokens
from minigpt.common.files import (
    atomic_write_bytes,
    atomic_write_json,
    load_tensors,
    make_dir,
    read_bounded,
    read_json,
    safetensors_shapes,
    save_tensors,
)
from minigpt.common.strict_json import preview
from minigpt.convert.config import ConvertResult, ImportConfig, record_export
from minigpt.convert.hf_map import (
    ARCHITECTURES,
    LABELS,
    canonical_name,
    config_from_hf,
    expected_hf_shapes,
    family_for,
    from_hf_tensors,
    hf_config,
    short_list,
    to_hf_tensors,
)
from minigpt.corpus.progress import QUIET, Progress
from minigpt.errors import MinigptError, UsageError
from minigpt.model.build import build_model, model_tensors
from minigpt.model.config import GPTConfig
from minigpt.runs.folder import FORMAT as RUN_FORMAT
from minigpt.runs.folder import RunDir
from minigpt.runs.model_card import model_card, write_card
from minigpt.tokenizer.base import shorten
from minigpt.tokenizer.bpe import NAMED_ENCODINGS
from minigpt.tokenizer.hf import (
    HF_MERGES,
    HF_SPECIAL_TOKENS,
    HF_TOKENIZER_CONFIG,
    HF_TOKENIZER_JSON,
    HF_VOCAB,
    hf_tokenizer_files,
    tokenizer_from_hf_json,
    tokenizer_from_vocab_merges,
)

if TYPE_CHECKING:
    import torch

    from minigpt.tokenizer.base import Tokenizer

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
# what `convert to-hf` wrote for char and bpe tokenizers before tokenizer.json could hold them: still read
MINIGPT_TOKENIZER = "minigpt_tokenizer.json"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
OTHER_WEIGHTS = ("tf_model.h5", "flax_model.msgpack")
# files a previous export into OUT may have left that transformers would read before (or beside) ours
_STALE_HF_FILES = (
    HF_INDEX,
    *PICKLE_WEIGHTS,
    HF_TOKENIZER_JSON,
    HF_VOCAB,
    HF_MERGES,
    HF_TOKENIZER_CONFIG,
    HF_SPECIAL_TOKENS,
    MINIGPT_TOKENIZER,
    "generation_config.json",
)


# ---------------------------------------------------------------- configs


def read_hf_config(src: Path) -> dict[str, Any]:
    """config.json of a Hugging Face model directory, checked to describe a GPT-2, Llama or Qwen3."""
    src = Path(src)
    if not src.exists():
        raise MinigptError(f"{src} does not exist: pass a local Hugging Face model directory")
    if not src.is_dir():
        raise MinigptError(f"{src} is a file: pass the directory that save_pretrained wrote")
    path = src / HF_CONFIG
    if not path.is_file():
        raise MinigptError(f"{src} has no {HF_CONFIG}: not a Hugging Face model directory")
    hf = read_json(path)
    if not isinstance(hf, dict):
        raise MinigptError(f"{path} is not a model config (expected a JSON object)")
    if hf.get("format") == RUN_FORMAT:
        raise MinigptError(f"{src} is a minigpt run already; `minigpt convert to-hf` goes the other way")
    if not isinstance(hf.get("model_type"), str) or hf["model_type"] not in ARCHITECTURES:
        raise MinigptError(
            f"{src} holds a {preview(hf.get('model_type'))} model, not GPT-2, Llama or Qwen3 (model_type "
            f"{', '.join(map(repr, ARCHITECTURES))}): only those checkpoints convert"
        )
    return hf


# ---------------------------------------------------------------- tensor names and layouts


def plan_import(shapes: dict[str, list[int]], config: GPTConfig, source: Path) -> dict[str, str]:
    """File tensor name -> the name `expected_hf_shapes` gives it, for every tensor to import, after
    checking names and shapes."""
    expected = expected_hf_shapes(config)
    family = family_for(config)
    label, architecture = LABELS[family], ARCHITECTURES[family]
    plan: dict[str, str] = {}
    unexpected = []
    for file_name in shapes:
        name = canonical_name(config, file_name)
        if name is None or (name == "lm_head.weight" and config.tie_embeddings):
            continue  # buffers, and a tied head: transformers ties it to the embedding whatever the file holds
        if name not in expected:
            unexpected.append(file_name)
        elif name in plan.values():
            raise MinigptError(f"{source} holds {name} twice (with and without the 'transformer.' prefix)")
        else:
            plan[file_name] = name
    missing = set(expected) - set(plan.values())
    if missing:
        raise MinigptError(
            f"{source} lacks tensors a {label} of this config needs: {short_list(missing)}; "
            f"is it a complete {architecture} checkpoint?"
        )
    if unexpected:
        raise MinigptError(f"{source} holds tensors that are not {label}'s: {short_list(unexpected)}")
    for file_name, name in plan.items():
        if tuple(shapes[file_name]) != expected[name]:
            raise MinigptError(
                f"{source}: {file_name} has shape {list(shapes[file_name])} but config.json implies "
                f"{list(expected[name])}"
            )
    return plan


def weight_files(src: Path) -> list[Path]:
    """The safetensors files of a HF model directory (one file or a sharded index); refuse pickles."""
    single, index = src / HF_WEIGHTS, src / HF_INDEX
    if single.is_file():
        return [_contained(src, single)]
    if index.is_file():
        return _shards(src, index)
    if any((src / n).is_file() for n in PICKLE_WEIGHTS):
        raise MinigptError(
            f"{src} has only pickled weights ({PICKLE_WEIGHTS[0]}), which minigpt never loads (unpickling "
            f"can run code): re-save as safetensors with transformers, "
            f"GPT2LMHeadModel.from_pretrained(DIR).save_pretrained(NEW_DIR)"
        )
    if any((src / n).is_file() for n in OTHER_WEIGHTS):
        raise MinigptError(
            f"{src} has TensorFlow/Flax weights only: re-save them as {HF_WEIGHTS} with transformers"
        )
    raise MinigptError(f"{src} has no {HF_WEIGHTS}: save the model with save_pretrained")


def _shards(src: Path, index: Path) -> list[Path]:
    """The shard files model.safetensors.index.json lists, each a file inside src."""
    data = read_json(_contained(src, index))
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise MinigptError(f"{index} is corrupt (no weight_map from tensor names to shard files)")
    names = list(weight_map.values())
    outside = [n for n in names if not _plain_relative(n)]
    if outside:
        raise MinigptError(
            f"{index} lists the shard {shorten(outside[0])}, which is not a path inside {src}: "
            f"a shard index may only name files in its own directory"
        )
    files = [src / n for n in sorted(set(names))]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise MinigptError(f"{src} lacks the shard(s) {short_list(absent)} that {HF_INDEX} lists")
    return [_contained(src, f) for f in files]


def _plain_relative(name: Any) -> bool:
    """A relative path with no '..' (nor NUL, which no path can hold)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


def _contained(src: Path, path: Path) -> Path:
    """path, if it resolves (through symlinks) inside src, else a MinigptError. Inside a Hugging Face
    hub cache snapshot (models--X/snapshots/REV) the files link to ../../blobs/, which counts as inside.
    """
    try:
        real, root = path.resolve(), src.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise MinigptError(f"cannot resolve {path}: {e}") from None
    roots = [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]
    if not any(real.is_relative_to(r) for r in roots):
        raise MinigptError(
            f"{path} links to {real}, outside {src}: a model directory may only use its own files"
        )
    return path


def _hf_shapes(files: list[Path]) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for f in files:
        shapes.update(safetensors_shapes(f))
    return shapes


def _load_planned(files: list[Path], plan: dict[str, str], config: GPTConfig) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in files:
        tensors.update({plan[n]: t for n, t in load_tensors(f)[0].items() if n in plan})
    return from_hf_tensors(config, tensors)


# ---------------------------------------------------------------- tokenizers


def _read_dir_tokenizer(src: Path) -> Tokenizer | None:
    """The tokenizer a HF directory ships (tokenizer.json, else GPT-2's vocab.json + merges.txt), if any."""
    fast, vocab, merges = src / HF_TOKENIZER_JSON, src / HF_VOCAB, src / HF_MERGES
    name = src.name or "hf-bpe"
    if fast.is_file():
        return tokenizer_from_hf_json(read_json(_contained(src, fast)), fast, name)
    if vocab.is_file() and merges.is_file():
        try:
            text = read_bounded(_contained(src, merges)).decode("utf-8")
        except UnicodeDecodeError:
            raise MinigptError(f"{merges} is not UTF-8 text; pass --tokenizer NAME|FILE") from None
        return tokenizer_from_vocab_merges(read_json(_contained(src, vocab)), text, vocab, name)
    return None


def resolve_import_tokenizer(src: Path, cfg: ImportConfig, gpt2: bool = True) -> Tokenizer:
    """The tokenizer a converted run gets: --tokenizer-file, --tokenizer, the minigpt tokenizer an older
    `to-hf` saved, the directory's own tokenizer files, else, for a GPT-2, r50k_base (GPT-2's) from
    TIKTOKEN_CACHE_DIR.
    """
    from minigpt.tokenizer.bpe import TiktokenTokenizer
    from minigpt.tokenizer.load import tokenizer_kind

    tokenizer = cfg.tokenizer
    if cfg.tokenizer_file is not None:
        return TiktokenTokenizer.from_file(cfg.tokenizer_file)
    if tokenizer is not None:
        if tokenizer_kind(tokenizer) != "tiktoken":
            raise UsageError(
                f"--tokenizer {tokenizer} is learned from training text; a converted model needs the "
                f"tokenizer it was trained with: a tiktoken name (r50k_base for GPT-2) or a .tiktoken file"
            )
        if tokenizer in NAMED_ENCODINGS:
            return _named(tokenizer)
        return TiktokenTokenizer.from_file(tokenizer)
    if (src / MINIGPT_TOKENIZER).is_file():  # what minigpt 0.1's `to-hf` wrote for char and bpe tokenizers
        from minigpt.tokenizer.load import load_tokenizer_file

        return load_tokenizer_file(_contained(src, src / MINIGPT_TOKENIZER))
    own = _read_dir_tokenizer(src)
    if own is not None:
        return own
    if not gpt2:  # other models ship their own tokenizer; guessing GPT-2's would give wrong text
        raise MinigptError(
            f"{src} has no tokenizer files minigpt reads (a byte-level or character tokenizer.json, or "
            f"vocab.json + merges.txt): pass --tokenizer NAME|FILE for the model's tokenizer"
        )
    return _named("r50k_base")


def _named(name: str) -> Tokenizer:
    import os

    from minigpt.tokenizer.bpe import TiktokenTokenizer

    try:
        return TiktokenTokenizer.from_name(name)
    except MinigptError:
        spec = NAMED_ENCODINGS[name]
        where = os.environ.get("TIKTOKEN_CACHE_DIR")
        looked = f"TIKTOKEN_CACHE_DIR={where}" if where else "TIKTOKEN_CACHE_DIR is not set"
        raise MinigptError(
            f"the {name} tokenizer's ranks file is not available offline ({looked}): download {spec.url} "
            f"and pass --tokenizer-file path/to/{spec.file}, or put it in TIKTOKEN_CACHE_DIR"
        ) from None


# ---------------------------------------------------------------- the two conversions


def _hf_usage(name: str, chat: bool) -> str:
    """The model card's example: a text continued, or for a chat run a conversation answered (its
    tokenizer_config.json holds the chat template the pipeline applies)."""
    prompt = '[{"role": "user", "content": "Who are you?"}]' if chat else '"Once upon a time"'
    result = '[0]["generated_text"][-1]["content"]' if chat else '[0]["generated_text"]'
    return (
        "```python\nfrom transformers import pipeline\n\n"
        f'generate = pipeline("text-generation", model="{name}")\n'
        f"print(generate({prompt}, max_new_tokens=50, do_sample=False){result})\n```"
    )


def _check_out(out: Path, src: Path, overwrite: bool) -> None:
    """Refuse to write over the source, into a file, or into a non-empty directory without --overwrite."""
    if out.exists() and not out.is_dir():
        raise MinigptError(f"{out} exists and is not a directory: choose another OUT")
    if out.resolve() == src.resolve():
        raise MinigptError(f"OUT is the source directory {src}: choose another OUT")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise MinigptError(f"{out} is not empty: choose another OUT or pass --overwrite to replace its model")


def _clear(out: Path, names: Iterable[str]) -> None:
    for name in names:
        (out / name).unlink(missing_ok=True)


def from_hf(
    src: Path,
    out: Path,
    cfg: ImportConfig = ImportConfig(),
    *,
    overwrite: bool = False,
    progress: Progress = QUIET,
) -> ConvertResult:
    """Write a minigpt run directory from a local Hugging Face GPT-2, Llama or Qwen3 directory
    (safetensors only), `progress` showing the reading and the writing.

    Everything is checked (config, tensor names and shapes from the file headers, tokenizer) before
    anything is written; an existing run at `out` is only replaced with `overwrite`.
    """
    src, out = Path(src), Path(out)
    hf = read_hf_config(src)
    config = config_from_hf(hf, src / HF_CONFIG)
    files = weight_files(src)
    plan = plan_import(_hf_shapes(files), config, src)
    tok = resolve_import_tokenizer(src, cfg, hf["model_type"] == "gpt2")
    if tok.vocab_size > config.vocab_size:
        raise MinigptError(
            f"the tokenizer ({tok.describe()}) is larger than the model's vocabulary ({config.vocab_size:,}): "
            f"pass the tokenizer the model was trained with"
        )
    _check_out(out, src, overwrite)
    with progress.phase(f"reading the weights of {src}"):
        model = build_model(config, _load_planned(files, plan, config), src)
    run = RunDir(out)
    # a replaced run's optimizer state and history belong to other weights
    run.clear((RunDir.STATE, RunDir.METRICS))
    extra = {"source": {"kind": "huggingface", "path": str(src.resolve()), "model_type": hf["model_type"]}}
    with progress.phase(f"writing {out}"):
        run.save(model, tok, extra)
    return ConvertResult(out, config, model.num_params(), tok.describe())


def to_hf(
    run: Path, out: Path, *, overwrite: bool = False, device: str = "cpu", progress: Progress = QUIET
) -> ConvertResult:
    """Write a directory transformers' AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained
    load (GPT2LMHeadModel, LlamaForCausalLM or Qwen3ForCausalLM, as `hfmap.family_for` picks):
    config.json, model.safetensors, the tokenizer files (minigpt.tokenizer.hf) and a model card (RunDir.CARD:
    the hub and a run folder name it alike); `progress` shows each long phase.
    """
    run, out = Path(run), Path(out)
    rundir = RunDir(run)
    with progress.phase(f"loading {run}"):
        model, tok, data = rundir.load_model(device)
    config = model.config
    hf = hf_config(config, tok.eot_id, tok.specials.get(END))  # a chat run's answer ends at <|end|>
    _check_out(out, run, overwrite)
    with progress.phase(f"building the tokenizer files of {tok.describe()}"):
        tok_files = hf_tokenizer_files(tok, config.block_size)
    make_dir(out)
    _clear(out, _STALE_HF_FILES)
    with progress.phase(f"writing {out / HF_WEIGHTS}"):
        # metadata format "pt" is what transformers checks before loading a safetensors file
        save_tensors(out / HF_WEIGHTS, to_hf_tensors(config, model_tensors(model)), metadata={"format": "pt"})
    for name, content in tok_files.items():
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False, indent=2)
        atomic_write_bytes(out / name, text.encode("utf-8"))
    usage = _hf_usage(out.name, has_chat_tokens(tok))
    write_card(
        out / RunDir.CARD,
        lambda license: model_card(
            out.name, data, config, tok.describe(), model.num_params(), library="transformers",
            made_by=f"`minigpt convert to-hf` of the run {run.resolve()}", usage=usage, license=license,
        ),
    )  # fmt: skip
    atomic_write_json(out / HF_CONFIG, hf)  # last: without it the directory is not a model yet
    note = record_export(rundir, "hf", out, architecture=hf["architectures"][0])
    return ConvertResult(out, config, model.num_params(), tok.describe(), note)
