"""The generation engine against references: a full-recompute loop, known distributions, byte-exact text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from minigpt.config import GPTConfig
from minigpt.errors import MinigptError, UsageError
from minigpt.model import GPT
from minigpt.sampling import (
    DecodeStep,
    Generation,
    KVCache,
    TextStream,
    check_sampling,
    decode_tokens,
    default_slide,
    encode_prompt,
    generate,
    generate_uncached,
    make_generator,
    resolve_slide,
    sample_next,
    window_drop,
)
from minigpt.tokenizer import CharTokenizer, Tokenizer

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
    """Random weights, matrices scaled up so greedy text does not collapse into one repeated token."""
    torch.manual_seed(seed)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return model


def cached(model: GPT, idx: torch.Tensor, n: int, **kw: Any) -> torch.Tensor:
    return torch.stack(list(decode_tokens(model, idx, n, **kw)), dim=1)


def nanogpt_loop(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """nanoGPT's sample loop, greedy: crop to the last block_size tokens, full forward, append."""
    bs = model.config.block_size
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx[:, -bs:])
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx


# --- KV cache -------------------------------------------------------------------------------------------


def test_kv_cache_writes_in_place_and_returns_views() -> None:
    cache = KVCache(n_layer=2, batch=3, n_head=2, block_size=8, head_dim=4)
    k, v = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    k_all, v_all = cache.update(1, k, v)
    assert k_all.shape == (3, 2, 5, 4) and k_all.data_ptr() == cache.k[1].data_ptr()
    torch.testing.assert_close(k_all, k)
    torch.testing.assert_close(v_all, v)
    assert cache.pos == 0  # only GPT.forward advances, once for all layers
    cache.advance(5)
    k2 = torch.randn(3, 2, 1, 4)
    k_all, _ = cache.update(1, k2, k2)
    torch.testing.assert_close(k_all, torch.cat([k, k2], dim=2))
    with pytest.raises(UsageError, match="overflow"):
        cache.update(0, torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4))
    cache.reset()
    assert cache.pos == 0


def test_kv_cache_broadcasts_a_one_row_prefill() -> None:
    cache = KVCache(n_layer=1, batch=4, n_head=2, block_size=8, head_dim=4)
    k = torch.randn(1, 2, 3, 4)
    k_all, _ = cache.update(0, k, k)
    assert k_all.shape == (1, 2, 3, 4)
    torch.testing.assert_close(cache.k[0, :, :, :3], k.expand(4, -1, -1, -1))
    cache.advance(3)
    with pytest.raises(UsageError, match="rows"):
        cache.update(0, torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))


def test_kv_cache_follows_the_model_dtype() -> None:
    model = tiny_model().to(torch.bfloat16)
    cache = KVCache.for_model(model, 2)
    assert cache.k.dtype == torch.bfloat16 and cache.k.shape == (2, 2, 2, 16, 16)


def test_cached_forward_matches_full_forward() -> None:
    model = tiny_model(scale=1.0)
    idx = torch.randint(0, TINY.vocab_size, (2, 12))
    full, _ = model(idx, all_logits=True)
    cache = KVCache.for_model(model, 2)
    first, _ = model(idx[:, :7], kv_cache=cache, all_logits=True)
    second, _ = model(idx[:, 7:9], kv_cache=cache, all_logits=True)  # several new tokens at once
    steps = [model(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(9, 12)]
    torch.testing.assert_close(torch.cat([first, second, torch.stack(steps, 1)], 1), full)


@pytest.mark.parametrize(("bias", "tied"), [(True, True), (False, False)])
def test_decode_step_matches_gpt_forward(bias: bool, tied: bool) -> None:
    config = GPTConfig(
        vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=bias, tie_embeddings=tied
    )
    model = tiny_model(config=config, scale=10.0)  # activations of order 1: GELU's tanh form shows
    idx = torch.randint(0, config.vocab_size, (3, 10))
    want_cache, got_cache = KVCache.for_model(model, 3), KVCache.for_model(model, 3)
    model(idx[:, :6], kv_cache=want_cache)
    model(idx[:, :6], kv_cache=got_cache)
    step = DecodeStep(model)
    for t in range(6, 10):
        want, _ = model(idx[:, t : t + 1], kv_cache=want_cache)
        torch.testing.assert_close(step(idx[:, t], got_cache), want)
    assert got_cache.pos == want_cache.pos == 10
    torch.testing.assert_close(got_cache.k, want_cache.k)
    torch.testing.assert_close(got_cache.v, want_cache.v)
    assert DecodeStep.supports(model) and not DecodeStep.supports(model.train())


def test_any_model_with_the_cache_protocol_decodes_the_same() -> None:
    class Subclass(GPT):  # not exactly GPT: the engine steps through GPT.forward instead of DecodeStep
        pass

    model = tiny_model(9)
    other = Subclass(TINY).eval()
    other.load_state_dict(model.state_dict())
    assert not DecodeStep.supports(other)
    idx = torch.randint(0, TINY.vocab_size, (2, 5))
    n = 2 * TINY.block_size
    want = generate_uncached(model, idx, n)
    assert torch.equal(cached(other, idx, n), want) and torch.equal(cached(model, idx, n), want)


# --- windowing ------------------------------------------------------------------------------------------


def test_window_policy() -> None:
    assert default_slide(256) == 64 and default_slide(3) == 1
    assert resolve_slide(None, 16) == 4 and resolve_slide(16, 16) == 16
    for bad in (0, -1, 17):
        with pytest.raises(UsageError, match="slide"):
            resolve_slide(bad, 16)
    assert window_drop(16, 16, 4) == 0 and window_drop(17, 16, 4) == 4


@pytest.mark.parametrize("slide", [1, None, 5, 16])
@pytest.mark.parametrize("prompt_len", [3, 16, 21])
def test_cached_equals_uncached_greedy(slide: int | None, prompt_len: int) -> None:
    model = tiny_model(1)
    torch.manual_seed(2)
    idx = torch.randint(0, TINY.vocab_size, (3, prompt_len))  # batch > 1, different prompts
    n = 3 * TINY.block_size + 5  # inside one block, then several slides past it
    want = generate_uncached(model, idx, n, slide=slide)
    got = cached(model, idx, n, slide=slide)
    assert want.shape == (3, n)
    assert torch.equal(got, want)
    assert all(len(set(row[-TINY.block_size :])) > 3 for row in want.tolist())  # a non-trivial check


def test_slide_one_is_nanogpts_crop_loop() -> None:
    model = tiny_model(3)
    idx = torch.randint(0, TINY.vocab_size, (2, 5))
    n = 2 * TINY.block_size
    want = nanogpt_loop(model, idx, n)[:, 5:]
    assert torch.equal(cached(model, idx, n, slide=1), want)
    assert torch.equal(generate_uncached(model, idx, n, slide=1), want)


def test_slide_changes_what_the_model_sees_only_past_the_block() -> None:
    model = tiny_model(4)
    idx = torch.randint(0, TINY.vocab_size, (1, 4))
    n = 3 * TINY.block_size
    a, b = cached(model, idx, n, slide=1), cached(model, idx, n, slide=8)
    inside = TINY.block_size - 4 + 1  # tokens predicted before any slide
    assert torch.equal(a[:, :inside], b[:, :inside])
    assert not torch.equal(a, b)


def test_num_samples_share_one_prefill() -> None:
    model = tiny_model(5)
    idx = torch.randint(0, TINY.vocab_size, (1, 6))
    n = 2 * TINY.block_size
    kw = dict(temperature=1.0, top_k=20, top_p=0.9)
    want = generate_uncached(model, idx, n, num_samples=4, generator=make_generator(7), **kw)
    got = cached(model, idx, n, num_samples=4, generator=make_generator(7), **kw)
    assert got.shape == (4, n) and torch.equal(got, want)
    assert len({tuple(row) for row in got.tolist()}) > 1  # the rows really are different samples


# --- sampling -------------------------------------------------------------------------------------------


def draws(logits: list[float], n: int = 4000, seed: int = 0, **kw: Any) -> set[int]:
    """The support of sample_next: which ids n draws from `logits` ever produce."""
    batch = torch.tensor(logits).log().expand(n, -1)
    return set(sample_next(batch, generator=make_generator(seed), **kw).tolist())


def test_top_k_and_top_p_keep_the_right_tokens() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]  # ranked: 1, 3, 2, 0
    assert draws(probs) == {0, 1, 2, 3}
    assert draws(probs, top_k=2) == {1, 3}
    assert draws(probs, top_k=3) == {1, 2, 3}
    assert draws(probs, top_p=0.5) == {1}  # token 1 alone reaches 0.5
    assert draws(probs, top_p=0.7) == {1, 3}
    assert draws(probs, top_p=0.81) == {1, 2, 3}
    assert draws(probs, top_p=1.0) == {0, 1, 2, 3}
    assert draws(probs, top_k=2, top_p=0.99) == {1, 3}  # they compose: top-k first, then top-p
    assert draws(probs, top_k=3, top_p=0.6) == {1, 3}


def test_sample_frequencies_follow_the_renormalised_distribution() -> None:
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log().expand(20000, -1)
    got = sample_next(logits, top_k=2, generator=make_generator(1))
    share = (got == 1).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.02


def test_temperature_sharpens_and_zero_is_argmax() -> None:
    logits = torch.randn(50, 10)
    g = make_generator(0)
    state = g.get_state()
    assert torch.equal(sample_next(logits, 0.0, generator=g), logits.argmax(-1))
    assert torch.equal(g.get_state(), state)  # greedy never touches the generator
    cold = sample_next(logits.expand(50, 50, 10).reshape(-1, 10), 0.05, generator=g)
    assert (cold == logits.argmax(-1).repeat(50)).float().mean() > 0.9


def test_top_k_one_equals_greedy() -> None:
    model = tiny_model(6)
    idx = torch.randint(0, TINY.vocab_size, (2, 5))
    greedy = cached(model, idx, 40, temperature=0.0)
    for seed in (0, 1):
        assert torch.equal(
            cached(model, idx, 40, temperature=1.5, top_k=1, generator=make_generator(seed)), greedy
        )


def test_seeds_reproduce_and_temperature_zero_ignores_them() -> None:
    model = tiny_model(7)
    idx = torch.randint(0, TINY.vocab_size, (1, 5))

    def run(seed: int, temperature: float) -> torch.Tensor:
        return cached(model, idx, 40, num_samples=2, temperature=temperature, generator=make_generator(seed))

    assert torch.equal(run(1, 1.0), run(1, 1.0))
    assert not torch.equal(run(1, 1.0), run(2, 1.0))
    assert torch.equal(run(1, 0.0), run(2, 0.0))


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


@pytest.mark.parametrize("n", [33, 34, 35, 36, 37])  # ends on every byte of the 4-byte emoji
def test_streamed_text_equals_final_text_with_multibyte_tokens(n: int) -> None:
    tokenizer = ByteTokenizer()
    model = bigram_model()  # block_size 8: the window slides many times
    gen = Generation(model, tokenizer, tokenizer.encode("a"), max_new_tokens=n, temperature=1.0, seed=3)
    streamed = run_events(gen)
    [sample] = gen.samples
    assert streamed == [sample.text]
    assert sample.text.encode() == tokenizer.decode(sample.token_ids).encode()
    assert sample.text.startswith((SCRIPT[1:] + SCRIPT)[:6]) and sample.finish_reason == "length"
    assert len(sample.token_ids) == n


def test_end_of_text_stops_a_sample() -> None:
    tokenizer = ByteTokenizer()
    gen = Generation(
        bigram_model(then_eot=True), tokenizer, [tokenizer.eot_id], max_new_tokens=50, temperature=0.0
    )
    run_events(gen)
    [sample] = gen.samples
    assert sample.text == SCRIPT and sample.finish_reason == "end_of_text"
    assert sample.token_ids[-1] == tokenizer.eot_id and gen.steps == len(SCRIPT.encode()) + 1


def test_stop_string_ends_each_sample_at_its_first_match() -> None:
    model = tiny_model(8)
    tokenizer = CharTokenizer([chr(ord("a") + i) for i in range(TINY.vocab_size - 1)] + ["\n"])
    options = dict(max_new_tokens=60, num_samples=3, temperature=1.0, seed=5)
    free = generate(model, tokenizer, "abc", **options)
    stop = free[0].text[10:12]
    stopped = Generation(model, tokenizer, tokenizer.encode("abc"), stop=[stop], **options)
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
    model, tokenizer = tiny_model(), CharTokenizer([chr(65 + i) for i in range(TINY.vocab_size)])
    for kw, message in [
        (dict(max_new_tokens=0), "max-new-tokens"),
        (dict(max_new_tokens=5, num_samples=0), "num-samples"),
        (dict(max_new_tokens=5, top_p=2.0), "top-p"),
        (dict(max_new_tokens=5, slide=17), "slide"),
        (dict(max_new_tokens=5, stop=[""]), "stop"),
    ]:
        with pytest.raises(UsageError, match=message):
            Generation(model, tokenizer, [0], **kw)
