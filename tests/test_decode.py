"""The decode loop and the text it streams, on both engines: window policy, KV cache, UTF-8, stop strings."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from conftest import slow_but

from minigpt.errors import MinigptError, UsageError
from minigpt.generate.decode import (
    SAMPLE_SEPARATOR,
    Engine,
    Generation,
    Sampling,
    TextStream,
    check_sampling,
    decode,
    default_slide,
    encode_prompt,
    generate,
    generate_uncached,
    resolve_slide,
    window_drop,
    write_text,
)
from minigpt.generate.engines.numpy_engine import NumpyEngine
from minigpt.generate.engines.torch_engine import TorchEngine
from minigpt.model.build import model_tensors
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.kvcache import KVCache, first_position, gather_rows
from minigpt.tokenizer.base import Tokenizer
from minigpt.tokenizer.char import CharTokenizer

TINY = GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32)

# every byte distinct, so a bigram model can spell it: 1-, 2-, 3- and 4-byte characters
SCRIPT = "aé日 🎉ж"


class ByteTokenizer(Tokenizer):
    """One id per byte plus <|endoftext|> (256): tokens routinely end inside a UTF-8 character."""

    kind = "bytes-test"

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eot_id(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(b"<|endoftext|>" if i == 256 else bytes([i]) for i in ids)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind}


def bigram_model(script: str = SCRIPT, then_eot: bool = False, block_size: int = 8) -> GPT:
    """A GPT whose next token depends only on the current one: it spells `script` over and over.

    Blocks are zeroed (identity), positions are zero, wte is the identity, and the untied head maps
    each byte to its successor in the script, so even sampling at temperature 1 follows the script.
    """
    data = list(script.encode("utf-8"))
    assert len(set(data)) == len(data)
    config = GPTConfig(
        vocab_size=257, block_size=block_size, n_layer=1, n_head=1, n_embd=257, tie_embeddings=False
    )
    model = GPT(config).eval()
    successor = {b: data[(i + 1) % len(data)] for i, b in enumerate(data)}
    successor[256] = data[0]  # <|endoftext|> starts the script again
    if then_eot:
        successor[data[-1]] = 256
    with torch.no_grad():
        for p in model.transformer.h.parameters():
            p.zero_()
        model.transformer.wpe.weight.zero_()
        model.transformer.wte.weight.copy_(torch.eye(257))
        head = torch.zeros(257, 257)  # one entry per column, so each margin is ~160 logits
        for i, j in successor.items():
            head[j, i] = 10.0
        model.lm_head.weight.copy_(head)
    return model


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


def tiny_model(seed: int = 0, config: GPTConfig = TINY, scale: float = 50.0) -> GPT:
    """Random weights, matrices scaled up so greedy text does not collapse into one repeated token (the
    attention score's per-head maps, 3-D, keep their initialisation: 50 x general's W would put its logits
    past what float32 rounds evenly in two engines)."""
    torch.manual_seed(seed)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model


def numpy_twin(model: GPT, kernels: bool | None = None, kv_cache: str = "float32") -> NumpyEngine:
    """The NumPy engine over the very weights of `model`, named as a run's weights file names them
    (`kernels`: its compiled one-token steps; None: where numba runs them)."""
    tensors = {k: v.detach().float().numpy() for k, v in model_tensors(model).items()}
    return NumpyEngine(model.config, tensors, kernels=kernels, kv_cache=kv_cache)


def numpy_arrays(model: GPT) -> NumpyEngine:
    """The NumPy engine on its array path only: every step through NumPy's operations and BLAS."""
    return numpy_twin(model, kernels=False)


# the engines, by backend name: every loop test runs on each (the NumPy engine with and without its
# compiled one-token steps)
ENGINES: dict[str, Callable[[GPT], Engine]] = {
    "torch": TorchEngine,
    "numpy": numpy_twin,
    "numpy-arrays": numpy_arrays,
}


def nanogpt_loop(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """nanoGPT's sample loop, greedy: crop to the last block_size tokens, full forward, append."""
    bs = model.config.block_size
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx[:, -bs:])
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx


def rows(steps: list[list[int]]) -> list[list[int]]:
    """Per-step tokens of every row (what the loops give) as one token list per row."""
    return [list(row) for row in zip(*steps, strict=True)]


GREEDY = Sampling(temperature=0.0)


# --- the windowing policy -------------------------------------------------------------------------------


def test_window_policy() -> None:
    assert default_slide(256) == 64 and default_slide(3) == 1
    assert resolve_slide(None, 16) == 4 and resolve_slide(16, 16) == 16
    for bad in (0, -1, 17):
        with pytest.raises(UsageError, match="slide"):
            resolve_slide(bad, 16)
    assert window_drop(16, 16, 4) == 0 and window_drop(17, 16, 4) == 4


@pytest.mark.parametrize("backend", ENGINES)
def test_slide_one_is_nanogpts_crop_loop(backend: str) -> None:
    model = tiny_model(3)
    prompts = torch.randint(0, TINY.vocab_size, (2, 5))
    n = 2 * TINY.block_size
    want = nanogpt_loop(model, prompts, n)[:, 5:].tolist()
    engine = ENGINES[backend](model)
    assert rows(list(decode(engine, prompts.tolist(), n, slide=1, sampling=GREEDY))) == want
    assert rows(generate_uncached(engine, prompts.tolist(), n, slide=1, sampling=GREEDY)) == want


@pytest.mark.parametrize("backend", ENGINES)
def test_slide_changes_what_the_model_sees_only_past_the_block(backend: str) -> None:
    engine = ENGINES[backend](tiny_model(4))
    prompt = [[3, 1, 4, 1]]
    n = 3 * TINY.block_size
    a = list(decode(engine, prompt, n, slide=1, sampling=GREEDY))
    b = list(decode(engine, prompt, n, slide=8, sampling=GREEDY))
    inside = TINY.block_size - 4 + 1  # tokens predicted before any slide
    assert a[:inside] == b[:inside] and a != b


@pytest.mark.parametrize("backend", ENGINES)
def test_num_samples_share_one_prefill(backend: str) -> None:
    engine = ENGINES[backend](tiny_model(5))
    prompt = [[2, 7, 1, 8, 2, 8]]
    n = 2 * TINY.block_size
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    want = generate_uncached(engine, prompt, n, num_samples=4, sampling=sampling)
    got = list(decode(engine, prompt, n, num_samples=4, sampling=sampling))
    assert got == want and len(got) == n and len(got[0]) == 4
    assert len({tuple(row) for row in rows(got)}) > 1  # the rows really are different samples


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_the_cache_holds_the_positions_a_generation_reaches_and_decodes_alike(backend: str, pos: str) -> None:
    """decode's cache holds prompt + new tokens' positions where they fit in the block (a batch's cache at
    a long block is no longer all allocated and zeroed before its first token), the block where they do
    not; the tokens are the uncached loop's either way."""
    config = dataclasses.replace(TINY, pos=pos)
    engine = ENGINES[backend](tiny_model(4, config))
    made: list[list[int]] = []
    new_cache = engine.new_cache

    def spy(batch: int, capacity: int | None = None) -> Any:
        cache = new_cache(batch, capacity)
        made.append(list(cache.capacity))
        return cache

    engine.new_cache = spy  # type: ignore[method-assign]
    prompt = [[2, 7, 1]]
    for n, capacity in (
        (5, 8),
        (TINY.block_size - 3, TINY.block_size),
        (2 * TINY.block_size, TINY.block_size),
    ):
        made.clear()
        options = dict(num_samples=3, sampling=Sampling(temperature=1.0, seed=n))
        assert list(decode(engine, prompt, n, **options)) == generate_uncached(engine, prompt, n, **options)
        assert made == [[capacity] * TINY.n_layer], (n, made)


def test_a_gpt_subclass_decodes_the_same() -> None:
    class Subclass(GPT):
        pass

    model = tiny_model(9)
    other = Subclass(TINY).eval()
    other.load_state_dict(model.state_dict())
    prompts = torch.randint(0, TINY.vocab_size, (2, 5)).tolist()
    n = 2 * TINY.block_size
    want = generate_uncached(TorchEngine(model), prompts, n, sampling=GREEDY)
    assert list(decode(TorchEngine(other), prompts, n, sampling=GREEDY)) == want
    assert list(decode(TorchEngine(model), prompts, n, sampling=GREEDY)) == want


def test_decode_checks_its_prompts() -> None:
    engine = TorchEngine(tiny_model())
    for prompts, num_samples, message in [
        ([[1, 2], [3, 4]], 2, "needs one prompt"),
        ([[1, 2], [3]], 1, "one length"),
        ([[]], 1, "at least one token"),
    ]:
        with pytest.raises(UsageError, match=message):
            next(decode(engine, prompts, 5, num_samples=num_samples))


# --- the KV cache ---------------------------------------------------------------------------------------

ARRAYS: dict[str, Callable[..., Any]] = {
    "torch": lambda *shape: torch.randn(*shape),
    "numpy": lambda *shape: np.random.default_rng(0).standard_normal(shape).astype(np.float32),
}


def _shares(a: Any, b: Any) -> bool:
    return np.shares_memory(a, b) if isinstance(a, np.ndarray) else a.data_ptr() == b.data_ptr()


def _cache(kind: str, rows: int, capacities: list[int], limit: int | None = None) -> KVCache[Any]:
    new = ARRAYS[kind]
    cat = torch.cat if kind == "torch" else np.concatenate
    return KVCache(
        [new(rows, 2, c, 4) * 0 for c in capacities], [new(rows, 2, c, 4) * 0 for c in capacities], limit, cat
    )


@pytest.mark.parametrize("kind", ARRAYS)
def test_kv_cache_writes_in_place_and_returns_views(kind: str) -> None:
    new = ARRAYS[kind]
    cache = _cache(kind, 3, [8, 8], limit=8)
    k, v = new(3, 2, 5, 4), new(3, 2, 5, 4)
    k_all, v_all = cache.update(1, k, v)
    assert tuple(k_all.shape) == (3, 2, 5, 4) and _shares(k_all, cache.k[1])
    np.testing.assert_array_equal(np.asarray(k_all), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(v_all), np.asarray(v))
    assert cache.pos == 0  # only the forward pass advances, once for all layers
    cache.advance(5)
    k2 = new(3, 2, 1, 4)
    k_all, _ = cache.update(1, k2, k2)
    np.testing.assert_array_equal(np.asarray(k_all), np.concatenate([np.asarray(k), np.asarray(k2)], axis=2))
    with pytest.raises(UsageError, match="overflow"):
        cache.update(0, new(3, 2, 4, 4), new(3, 2, 4, 4))
    cache.reset()
    assert cache.pos == 0


@pytest.mark.parametrize("kind", ARRAYS)
def test_kv_cache_broadcasts_a_one_row_prefill(kind: str) -> None:
    new = ARRAYS[kind]
    cache = _cache(kind, 4, [8])
    k = new(1, 2, 3, 4)
    k_all, _ = cache.update(0, k, k)
    assert tuple(k_all.shape) == (1, 2, 3, 4)
    np.testing.assert_array_equal(
        np.asarray(cache.k[0][:, :, :3]), np.broadcast_to(np.asarray(k), (4, 2, 3, 4))
    )
    cache.advance(3)
    with pytest.raises(UsageError, match="rows"):
        cache.update(0, new(1, 2, 1, 4), new(1, 2, 1, 4))


@pytest.mark.parametrize("kind", ARRAYS)
def test_a_full_kv_cache_layer_keeps_its_latest_positions(kind: str) -> None:
    """A ring of 4 slots: position p lives in slot p % 4; one new key sees the whole ring, several new keys
    see the kept ones oldest first, then themselves; a prefill longer than the ring keeps its last 4."""
    new = ARRAYS[kind]
    keys = new(1, 2, 11, 4)  # positions 0..10
    cache = _cache(kind, 1, [4, 11])
    cache.update(0, keys[:, :, :6], keys[:, :, :6])  # longer than the ring: keeps 2..5
    cache.update(1, keys[:, :, :6], keys[:, :, :6])
    cache.advance(6)
    got, _ = cache.update(0, keys[:, :, 6:7], keys[:, :, 6:7])  # replaces position 2 in slot 2
    np.testing.assert_array_equal(np.asarray(got), np.asarray(keys)[:, :, [4, 5, 6, 3]])
    cache.advance(1)
    got, _ = cache.update(0, keys[:, :, 7:10], keys[:, :, 7:10])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(keys)[:, :, 3:10])
    np.testing.assert_array_equal(np.asarray(cache.k[0]), np.asarray(keys)[:, :, [8, 9, 6, 7]])
    assert cache.capacity == [4, 11]


@pytest.mark.parametrize("kind", ARRAYS)
def test_kv_cache_rows_keep_their_own_positions(kind: str) -> None:
    """Rows joined from caches at positions 2, 5 and 0 (`gather_rows`): each new key goes into its row's
    slot, position % capacity; `key_mask` marks the slots each row has filled (all of a wrapped ring);
    rows at different positions take one token each, and say how far each stands."""
    new = ARRAYS[kind]
    parts = []
    for pos in (2, 5, 0):
        part = _cache(kind, 1, [4, 8], limit=8)
        part.update(0, new(1, 2, pos, 4), new(1, 2, pos, 4))
        part.update(1, new(1, 2, pos, 4), new(1, 2, pos, 4))
        part.advance(pos)
        parts.append((part, 0, 1))
    cache = gather_rows(lambda rows: _cache(kind, rows, [4, 8], limit=8), parts)
    assert cache.mixed and cache.positions.tolist() == [2, 5, 0]
    with pytest.raises(UsageError, match="different positions"):
        _ = cache.pos
    k = new(3, 2, 1, 4)
    ring, _ = cache.update(0, k, k)
    full, _ = cache.update(1, k, k)
    assert tuple(ring.shape) == (3, 2, 4, 4) and tuple(full.shape) == (3, 2, 6, 4)
    for row, slot in enumerate([2, 1, 0]):  # position 5 wraps to slot 1 of the 4-slot ring
        np.testing.assert_array_equal(np.asarray(cache.k[0][row, :, slot]), np.asarray(k[row, :, 0]))
    for row, slot in enumerate([2, 5, 0]):
        np.testing.assert_array_equal(np.asarray(cache.k[1][row, :, slot]), np.asarray(k[row, :, 0]))
    assert cache.key_mask(0).tolist() == [[True] * 3 + [False], [True] * 4, [True] + [False] * 3]
    assert cache.key_mask(1).tolist() == [[True] * 3 + [False] * 3, [True] * 6, [True] + [False] * 5]
    with pytest.raises(UsageError, match="one token each"):
        cache.update(0, new(3, 2, 2, 4), new(3, 2, 2, 4))
    cache.advance(1)
    assert cache.positions.tolist() == [3, 6, 1] and first_position(cache, 1, 8).tolist() == [3, 6, 1]
    with pytest.raises(UsageError, match="block_size"):
        first_position(cache, 3, 8)
    cache.reset()
    assert not cache.mixed and cache.pos == 0 and cache.key_mask(0) is None


# --- sampling settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(temperature=-0.1, top_k=None, top_p=None), "temperature"),
        (dict(temperature=float("nan"), top_k=None, top_p=None), "temperature"),
        (dict(temperature=1.0, top_k=0, top_p=None), "top-k"),
        (dict(temperature=1.0, top_k=None, top_p=0.0), "top-p"),
        (dict(temperature=1.0, top_k=None, top_p=1.01), "top-p"),
    ],
)
def test_bad_sampling_settings(kw: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        check_sampling(**kw)


# --- text: UTF-8 and stop strings ----------------------------------------------------------------------


def shown_pieces(stream: TextStream, chunks: Sequence[bytes], reason: str = "length") -> list[str]:
    pieces = []
    for chunk in chunks:
        stream.feed(chunk)
        pieces.append(stream.take())
        if stream.done:
            break
    stream.close(reason)
    pieces.append(stream.take())
    return pieces


def test_text_stream_shows_only_whole_characters() -> None:
    text = "héllo wörld — 日本語 🎉!"
    data = text.encode("utf-8")
    stream = TextStream()
    pieces = shown_pieces(stream, [data[i : i + 1] for i in range(len(data))])
    assert "".join(pieces) == stream.text == text and stream.finish_reason == "length"
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some bytes ended inside a character and showed nothing


@pytest.mark.parametrize(
    "data", [b"ab\xe6\x97", b"\xff\xfeok\xc3", b"\xf0\x9f\x8e\x89\x89x", b"a\xed\xa0\x80b"]
)
def test_text_stream_decodes_bad_bytes_like_decode_replace(data: bytes) -> None:
    stream = TextStream()
    pieces = shown_pieces(stream, [data[i : i + 1] for i in range(len(data))])
    assert "".join(pieces) == stream.text == data.decode("utf-8", errors="replace")


def test_stop_strings() -> None:
    stream = TextStream(["END", "日本"])
    pieces = shown_pieces(stream, [b"abc E", b"N", b"xE", b"ND tail"])
    assert stream.text == "abc ENx" and stream.finish_reason == "stop"
    assert pieces == ["abc ", "", "ENx", "", ""]  # "E", "EN" could still become "END": held back
    assert "".join(pieces) == stream.text

    # the earliest match wins, even when a later-listed string matches first, inside one token
    stream = TextStream(["zzz", "日本"])
    pieces = shown_pieces(stream, ["x日".encode()[:2], "x日".encode()[2:] + "本zzz".encode()])
    assert stream.text == "x" and "".join(pieces) == "x"

    # a multi-byte stop string split across tokens
    stream = TextStream(["本"])
    b = "a本b".encode()
    pieces = shown_pieces(stream, [b[:2], b[2:3], b[3:]])
    assert stream.text == "a" and "".join(pieces) == "a"

    # a held-back prefix that never completes is shown at the end
    stream = TextStream(["END"])
    pieces = shown_pieces(stream, [b"xx", b"EN"])
    assert pieces == ["xx", "", "EN"] and stream.finish_reason == "length"

    with pytest.raises(UsageError, match="empty"):
        TextStream([""])


def test_encode_prompt_defaults() -> None:
    chars = CharTokenizer(list("ab\n"))
    assert encode_prompt(chars, "") == [2]
    assert encode_prompt(chars, "ba") == [1, 0]
    assert encode_prompt(ByteTokenizer(), "") == [256]
    with pytest.raises(MinigptError, match="give a prompt"):
        encode_prompt(CharTokenizer(list("ab")), "")
    with pytest.raises(MinigptError, match="'z'"):
        encode_prompt(chars, "abz")


# --- the whole generation -------------------------------------------------------------------------------


def run_events(gen: Generation) -> list[str]:
    """Concatenate each sample's streamed events; check each sample reports done exactly once, last."""
    texts = [""] * gen.num_samples
    done = [False] * gen.num_samples
    for event in gen.events():
        assert not done[event.sample]
        texts[event.sample] += event.text
        done[event.sample] = event.done
    assert all(done)
    return texts


@pytest.mark.parametrize("backend", ENGINES)
# ends on every byte of the 4-byte emoji
@pytest.mark.parametrize("n", slow_but([33, 34, 35, 36, 37], "33", "37"))
def test_streamed_text_equals_final_text_with_multibyte_tokens(backend: str, n: int) -> None:
    tokenizer = ByteTokenizer()
    engine = ENGINES[backend](bigram_model())  # block_size 8: the window slides many times
    gen = Generation(engine, tokenizer, tokenizer.encode("a"), max_new_tokens=n, temperature=1.0, seed=3)
    streamed = run_events(gen)
    [sample] = gen.samples
    assert streamed == [sample.text]
    assert sample.text.encode() == tokenizer.decode(sample.token_ids).encode()
    assert sample.text.startswith((SCRIPT[1:] + SCRIPT)[:6]) and sample.finish_reason == "length"
    assert len(sample.token_ids) == n


def test_end_of_text_stops_a_sample() -> None:
    tokenizer = ByteTokenizer()
    engine = TorchEngine(bigram_model(then_eot=True))
    gen = Generation(engine, tokenizer, [tokenizer.eot_id], max_new_tokens=50, temperature=0.0)
    run_events(gen)
    [sample] = gen.samples
    assert sample.text == SCRIPT and sample.finish_reason == "end_of_text"
    assert sample.token_ids[-1] == tokenizer.eot_id and gen.steps == len(SCRIPT.encode()) + 1


def test_stop_string_ends_each_sample_at_its_first_match() -> None:
    engine = TorchEngine(tiny_model(8))
    tokenizer = CharTokenizer([chr(ord("a") + i) for i in range(TINY.vocab_size - 1)] + ["\n"])
    options = dict(max_new_tokens=60, num_samples=3, temperature=1.0, seed=5)
    free = generate(engine, tokenizer, "abc", **options)
    stop = free[0].text[10:12]
    stopped = Generation(engine, tokenizer, tokenizer.encode("abc"), stop=[stop], **options)
    streamed = run_events(stopped)
    for before, after, text in zip(free, stopped.samples, streamed, strict=True):
        if stop in before.text:
            assert after.text == before.text[: before.text.index(stop)] and after.finish_reason == "stop"
            assert len(after.token_ids) < 60
        else:
            assert after.text == before.text and after.finish_reason == "length"
        assert text == after.text
    assert stopped.samples[0].finish_reason == "stop"


def test_generation_checks_its_arguments() -> None:
    engine, tokenizer = (
        TorchEngine(tiny_model()),
        CharTokenizer([chr(65 + i) for i in range(TINY.vocab_size)]),
    )
    for kw, message in [
        (dict(max_new_tokens=0), "max-new-tokens"),
        (dict(max_new_tokens=5, num_samples=0), "num-samples"),
        (dict(max_new_tokens=5, top_p=2.0), "top-p"),
        (dict(max_new_tokens=5, slide=17), "slide"),
        (dict(max_new_tokens=5, stop=[""]), "stop"),
    ]:
        with pytest.raises(UsageError, match=message):
            Generation(engine, tokenizer, [0], **kw)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_written_text_is_the_same_streamed_or_not_and_json_describes_it() -> None:
    engine = TorchEngine(tiny_model(8))
    tokenizer = CharTokenizer([chr(ord("a") + i) for i in range(TINY.vocab_size - 1)] + ["\n"])
    options = dict(max_new_tokens=40, num_samples=3, temperature=1.0, seed=5)
    stop = generate(engine, tokenizer, "abc", **options)[1].text[5:7]  # sample 1 ends before sample 0
    outputs = []
    for out, stream in [(io.StringIO(), True), (io.StringIO(), False), (Terminal(), True)]:
        gen = Generation(engine, tokenizer, tokenizer.encode("abc"), stop=[stop], **options)
        write_text(gen, out, stream)
        outputs.append(out.getvalue())
    texts = [s.text for s in gen.samples]
    assert outputs[0] == outputs[1] == SAMPLE_SEPARATOR.join(texts) and outputs[2] == outputs[0] + "\n"
    data = gen.to_json()
    assert data["backend"] == "torch" and data["device"] == "cpu" and data["dtype"] == "float32"
    assert data["prompt_tokens"] == 3 and data["seed"] == 5 and data["samples"][1]["finish_reason"] == "stop"
    assert [s["text"] for s in data["samples"]] == texts
    assert "seed 5" in gen.summary() and "torch on cpu" in gen.summary()
