"""Convert Hugging Face GPT-2, Llama and Qwen3 checkpoints to minigpt run directories and back, never unpickling."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from minigpt.config import GPTConfig
from minigpt.errors import MinigptError, UsageError
from minigpt.files import (
    atomic_write_bytes,
    atomic_write_json,
    load_tensors,
    make_dir,
    read_bounded,
    read_json,
    safetensors_shapes,
    save_tensors,
)
from minigpt.hfmap import (
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
from minigpt.model import build_model, model_tensors
from minigpt.rundir import FORMAT as RUN_FORMAT
from minigpt.rundir import RunDir
from minigpt.tokenizer import (
    ENDOFTEXT,
    GPT2_SPLIT_PATTERN,
    NAMED_ENCODINGS,
    naming,
    shorten,
)

if TYPE_CHECKING:
    import torch

    from minigpt.tokenizer import TiktokenTokenizer, Tokenizer

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_VOCAB = "vocab.json"
HF_MERGES = "merges.txt"
HF_TOKENIZER_JSON = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_SPECIAL_TOKENS = "special_tokens_map.json"
# minigpt's own tokenizer.json would be mistaken by transformers for a `tokenizers` file: renamed
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


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion wrote: the directory, the model shape and a one-line tokenizer note."""

    out: Path
    config: GPTConfig
    params: int
    tokenizer: str
    tokenizer_note: str | None = None  # set when the tokenizer could not be written in the target format


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
    if hf.get("model_type") not in ARCHITECTURES:
        raise MinigptError(
            f"{src} holds a {hf.get('model_type')!r} model, not GPT-2, Llama or Qwen3 (model_type "
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


# ---------------------------------------------------------------- byte-level BPE files


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character (vocab.json and merges.txt use it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def _token_str(token: bytes) -> str:
    # latin-1 turns each byte into the code point of the same number, which translate then maps
    return token.decode("latin-1").translate(bytes_to_unicode())


def _split_below(token: bytes, ranks: dict[bytes, int], limit: int) -> list[bytes]:
    """Byte-level BPE of token using only the ranks below limit (how tiktoken would build it)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], limit)
            if r < best_rank:
                best_rank, best_i = r, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def bpe_vocab_merges(ranks: dict[bytes, int], specials: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """vocab.json and merges.txt entries equivalent to tiktoken ranks.

    Each multi-byte token's merge is recovered by running BPE on its bytes with the ranks below its own:
    that yields the two parts tiktoken joins to make it. A token that does not come out as exactly two
    parts can never be produced by BPE, so the ranks have no merges-file equivalent (a MinigptError).
    """
    vocab: dict[str, int] = {}
    merges: list[str] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        vocab[_token_str(token)] = rank
        if len(token) > 1:
            parts = _split_below(token, ranks, rank)
            if len(parts) != 2:
                raise MinigptError(f"token {token!r} (rank {rank}) is not the merge of two earlier tokens")
            merges.append(f"{_token_str(parts[0])} {_token_str(parts[1])}")
    for text, i in specials.items():
        vocab[text] = i
    return vocab, merges


def ranks_from_vocab_merges(
    vocab: dict[str, int], merges: list[tuple[str, str]], source: Path
) -> tuple[dict[bytes, int], dict[str, int]]:
    """tiktoken ranks and special tokens from GPT-2 style vocab.json + merges.txt.

    tiktoken merges by the rank of the joined token, transformers by the order of merges.txt; the two
    agree when each merge's result has a higher id than its parts and ids grow along merges.txt, which
    is checked (GPT-2's own files satisfy it: tiktoken's r50k_base was made from them).
    """
    dec = {c: b for b, c in bytes_to_unicode().items()}
    results = {a + b for a, b in merges}
    ranks: dict[bytes, int] = {}
    specials: dict[str, int] = {}
    for text, i in vocab.items():
        if not isinstance(i, int) or isinstance(i, bool):
            raise MinigptError(f"{source}: id of {text!r} is not an integer")
        if (len(text) == 1 and text in dec) or text in results:
            try:
                ranks[bytes(dec[c] for c in text)] = i
            except KeyError:
                raise MinigptError(f"{source}: {text!r} is not a byte-level BPE token") from None
        else:
            specials[text] = i
    last = -1
    for a, b in merges:
        ids = [vocab.get(a), vocab.get(b), vocab.get(a + b)]
        if None in ids:
            raise MinigptError(f"{source}: merge '{a} {b}' uses tokens that are not in the vocabulary")
        ia, ib, ic = ids
        if not (ia < ic and ib < ic and ic > last):
            raise MinigptError(
                f"{source}: merge '{a} {b}' is out of id order, so tiktoken ranks cannot reproduce it"
            )
        last = ic
    return ranks, specials


def _read_dir_tokenizer(src: Path) -> TiktokenTokenizer | None:
    """The byte-level BPE a HF directory ships (vocab.json + merges.txt, or tokenizer.json), if any."""
    from minigpt.tokenizer import TiktokenTokenizer

    vocab_path, merges_path, fast_path = src / HF_VOCAB, src / HF_MERGES, src / HF_TOKENIZER_JSON
    try:
        if vocab_path.is_file() and merges_path.is_file():
            source = vocab_path
            vocab = read_json(_contained(src, vocab_path))
            text = read_bounded(_contained(src, merges_path)).decode("utf-8")
            merges = [
                tuple(line.split(" "))
                for line in text.splitlines()
                if line and not line.startswith("#version")
            ]
            added: dict[str, int] = {}
        elif fast_path.is_file():
            source = fast_path
            data = read_json(_contained(src, fast_path))
            model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
            byte_level = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            if model.get("type") != "BPE" or not byte_level or pre.get("add_prefix_space"):
                raise MinigptError(
                    f"{fast_path} is not GPT-2's byte-level BPE: pass --tokenizer NAME|FILE for the "
                    f"model's tokenizer"
                )
            vocab = model.get("vocab")
            merges = [
                tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])
            ]
            added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        else:
            return None
    except (UnicodeDecodeError, AttributeError, TypeError, KeyError) as e:
        raise MinigptError(f"{src}: unreadable tokenizer files ({e}); pass --tokenizer NAME|FILE") from None
    if not isinstance(vocab, dict) or not all(
        len(m) == 2 and all(isinstance(p, str) for p in m) for m in merges
    ):
        raise MinigptError(f"{source} is not a GPT-2 style BPE vocabulary; pass --tokenizer NAME|FILE")
    ranks, specials = ranks_from_vocab_merges(vocab, merges, source)  # type: ignore[arg-type]
    specials.update(added)
    r50k = NAMED_ENCODINGS["r50k_base"]
    with naming(source, "pass --tokenizer NAME|FILE"):
        if _ranks_sha256(ranks) == r50k.sha256 and specials == r50k.specials:
            return TiktokenTokenizer(r50k.name, r50k.pattern, ranks, r50k.specials)
        return TiktokenTokenizer(src.name or "hf-bpe", GPT2_SPLIT_PATTERN, ranks, specials)


def _ranks_sha256(ranks: dict[bytes, int]) -> str:
    """sha256 of the ranks written as a .tiktoken file (so it matches the published files' hashes)."""
    import base64
    import hashlib

    h = hashlib.sha256()
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        h.update(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    return h.hexdigest()


def resolve_import_tokenizer(
    src: Path, tokenizer: str | None, tokenizer_file: Path | None, gpt2: bool = True
) -> Tokenizer:
    """The tokenizer a converted run gets: --tokenizer-file, --tokenizer, the minigpt tokenizer `to-hf` saved,
    the directory's own BPE files, else, for a GPT-2, r50k_base (GPT-2's) from TIKTOKEN_CACHE_DIR.
    """
    from minigpt.tokenizer import TiktokenTokenizer, tokenizer_kind

    if tokenizer_file is not None:
        if tokenizer is not None:
            raise UsageError("give --tokenizer or --tokenizer-file, not both")
        return TiktokenTokenizer.from_file(tokenizer_file)
    if tokenizer is not None:
        if tokenizer_kind(tokenizer) != "tiktoken":
            raise UsageError(
                f"--tokenizer {tokenizer} is learned from training text; a converted model needs the "
                f"tokenizer it was trained with: a tiktoken name (r50k_base for GPT-2) or a .tiktoken file"
            )
        if tokenizer in NAMED_ENCODINGS:
            return _named(tokenizer)
        return TiktokenTokenizer.from_file(tokenizer)
    if (src / MINIGPT_TOKENIZER).is_file():  # written by `convert to-hf` for tokenizers transformers lacks
        from minigpt.tokenizer import load_tokenizer_file

        return load_tokenizer_file(_contained(src, src / MINIGPT_TOKENIZER))
    own = _read_dir_tokenizer(src)
    if own is not None:
        return own
    if not gpt2:  # other models ship their own tokenizer; guessing GPT-2's would give wrong text
        raise MinigptError(
            f"{src} has no tokenizer files minigpt reads (vocab.json + merges.txt, or a byte-level "
            f"tokenizer.json): pass --tokenizer NAME|FILE for the model's tokenizer"
        )
    return _named("r50k_base")


def _named(name: str) -> Tokenizer:
    import os

    from minigpt.tokenizer import TiktokenTokenizer

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
    *,
    tokenizer: str | None = None,
    tokenizer_file: Path | None = None,
    overwrite: bool = False,
) -> ConvertResult:
    """Write a minigpt run directory from a local Hugging Face GPT-2, Llama or Qwen3 directory
    (safetensors only).

    Everything is checked (config, tensor names and shapes from the file headers, tokenizer) before
    anything is written; an existing run at `out` is only replaced with `overwrite`.
    """
    src, out = Path(src), Path(out)
    hf = read_hf_config(src)
    config = config_from_hf(hf, src / HF_CONFIG)
    files = weight_files(src)
    plan = plan_import(_hf_shapes(files), config, src)
    tok = resolve_import_tokenizer(src, tokenizer, tokenizer_file, hf["model_type"] == "gpt2")
    if tok.vocab_size > config.vocab_size:
        raise MinigptError(
            f"the tokenizer ({tok.describe()}) is larger than the model's vocabulary ({config.vocab_size:,}): "
            f"pass the tokenizer the model was trained with"
        )
    _check_out(out, src, overwrite)
    model = build_model(config, _load_planned(files, plan, config), src)
    run = RunDir(out)
    # a replaced run's optimizer state and history belong to other weights
    run.clear((RunDir.STATE, RunDir.METRICS))
    extra = {"source": {"kind": "huggingface", "path": str(src.resolve()), "model_type": hf["model_type"]}}
    run.save(model, tok, extra)
    return ConvertResult(out, config, model.num_params(), tok.describe())


def hf_tokenizer_files(tokenizer: Tokenizer, block_size: int) -> dict[str, str] | None:
    """transformers' GPT-2 tokenizer files for a byte-level BPE with GPT-2's split pattern, else None."""
    from minigpt.tokenizer import _RankedBPE

    if not isinstance(tokenizer, _RankedBPE) or tokenizer.pattern != GPT2_SPLIT_PATTERN:
        return None
    if set(tokenizer.specials) - {ENDOFTEXT}:
        return None
    try:
        vocab, merges = bpe_vocab_merges(tokenizer.ranks, tokenizer.specials)
    except MinigptError:
        return None
    eot = ENDOFTEXT if ENDOFTEXT in tokenizer.specials else None
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": block_size,
        "add_prefix_space": False,
        "errors": "replace",
        "bos_token": eot,
        "eos_token": eot,
        "unk_token": eot,
    }
    specials = {"bos_token": eot, "eos_token": eot, "unk_token": eot} if eot else {}
    return {
        HF_VOCAB: json.dumps(vocab, ensure_ascii=False) + "\n",
        HF_MERGES: "#version: 0.2\n" + "".join(m + "\n" for m in merges),
        HF_TOKENIZER_CONFIG: json.dumps(config, indent=2) + "\n",
        HF_SPECIAL_TOKENS: json.dumps(specials, indent=2) + "\n",
    }


def to_hf(run: Path, out: Path, *, overwrite: bool = False, device: str = "cpu") -> ConvertResult:
    """Write a directory transformers' AutoModelForCausalLM.from_pretrained loads (GPT2LMHeadModel,
    LlamaForCausalLM or Qwen3ForCausalLM, as `hfmap.family_for` picks): config.json, model.safetensors
    and, for a GPT-2 style byte-level BPE, the tokenizer files.
    """
    run, out = Path(run), Path(out)
    model, tok, _ = RunDir(run).load_model(device)
    config = model.config
    hf = hf_config(config, tok.eot_id)
    _check_out(out, run, overwrite)
    tok_files = hf_tokenizer_files(tok, config.block_size)
    make_dir(out)
    _clear(out, _STALE_HF_FILES)
    # metadata format "pt" is what transformers checks before loading a safetensors file
    save_tensors(out / HF_WEIGHTS, to_hf_tensors(config, model_tensors(model)), metadata={"format": "pt"})
    note = None
    if tok_files is not None:
        for name, text in tok_files.items():
            atomic_write_bytes(out / name, text.encode("utf-8"))
    else:
        atomic_write_json(out / MINIGPT_TOKENIZER, tok.to_json())
        note = (
            f"the tokenizer is minigpt's own ({tok.describe()}), which transformers cannot load: "
            f"it is saved as {out / MINIGPT_TOKENIZER}; encode text with minigpt"
        )
    atomic_write_json(out / HF_CONFIG, hf)  # last: without it the directory is not a model yet
    return ConvertResult(out, config, model.num_params(), tok.describe(), note)
