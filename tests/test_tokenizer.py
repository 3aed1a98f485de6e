"""Tokenizers: exact round trips, offline tiktoken loading, JSON save/load, and one-line errors."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import socket
from pathlib import Path

import pytest
import regex
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minigpt.errors import MinigptError, UsageError
from minigpt.tokenizer.base import ENDOFTEXT
from minigpt.tokenizer.bpe import (
    CL100K_SPLIT_PATTERN,
    GPT2_SPLIT_PATTERN,
    GPT4_SPLIT_PATTERN,
    NAMED_ENCODINGS,
    BPETokenizer,
    TiktokenTokenizer,
)
from minigpt.tokenizer.char import CharTokenizer
from minigpt.tokenizer.load import build_tokenizer, tokenizer_from_json

FIXTURE_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# small but varied: words, digits, punctuation, newlines, non-Latin scripts and emoji
SAMPLE = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
    "It's 2024; they'll pay 3.14159 or 1,000,000 dollars!\n\tIndented\ttabs  and   spaces \n"
    "Ünïcödé façade — naïve café. Ελληνικά κείμενα. Русский текст. 日本語のテキスト。 中文文本。 "
    "emoji 🙂🚀 and <|endoftext|> as plain text.\r\n"
) * 20


@functools.cache
def small_bpe() -> BPETokenizer:
    return BPETokenizer.train([SAMPLE[i : i + 500] for i in range(0, len(SAMPLE), 500)], vocab_size=400)


@functools.cache
def r50k_from(path: str) -> TiktokenTokenizer:
    return TiktokenTokenizer.from_file(path)


def r50k_url() -> str:
    return NAMED_ENCODINGS["r50k_base"].url


def roundtrip_json(tok):
    return tokenizer_from_json(json.loads(json.dumps(tok.to_json())))


# ---------------------------------------------------------------------------------------------- patterns


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab1 2\n\r\t'sSlLvVeE.,!?-é日🙂\u00a0\u2028")), max_size=40))
def test_gpt4_pattern_splits_like_cl100k(text: str) -> None:
    assert regex.findall(GPT4_SPLIT_PATTERN, text) == regex.findall(CL100K_SPLIT_PATTERN, text)


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(st.text(max_size=60))
def test_gpt4_pattern_splits_like_cl100k_on_any_text(text: str) -> None:
    assert regex.findall(GPT4_SPLIT_PATTERN, text) == regex.findall(CL100K_SPLIT_PATTERN, text)


def test_named_encodings_match_tiktoken_ext(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiktoken_ext.openai_public as public

    seen: dict[str, tuple[str, str | None]] = {}

    def fake_load(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        seen["last"] = (url, expected_hash)
        return {bytes([b]): b for b in range(256)}

    monkeypatch.setattr(public, "load_tiktoken_bpe", fake_load)
    monkeypatch.setattr(public, "data_gym_to_mergeable_bpe_ranks", lambda **kw: fake_load("", None))
    for name, ours in NAMED_ENCODINGS.items():
        theirs = public.ENCODING_CONSTRUCTORS[name]()
        assert ours.pattern == theirs["pat_str"], name
        assert ours.specials == theirs["special_tokens"], name
        if name != "gpt2":  # gpt2 is built from other files; offline we read r50k_base's ranks
            assert (ours.url, ours.sha256) == seen["last"], name


# ---------------------------------------------------------------------------------------------- bpe


def test_bpe_vocabulary_and_special_token() -> None:
    tok = small_bpe()
    assert tok.kind == "bpe"
    assert tok.vocab_size == 400
    assert tok.eot_id == 399
    assert tok.pattern == GPT4_SPLIT_PATTERN
    assert len(tok.encode(SAMPLE)) < len(SAMPLE.encode()) / 2  # the merges do compress
    assert tok.encode(ENDOFTEXT) != [tok.eot_id]  # special-token text in input is plain text
    assert tok.decode_bytes([tok.eot_id]) == ENDOFTEXT.encode()


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.text())
def test_bpe_roundtrips_any_unicode(text: str) -> None:
    tok = small_bpe()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size - 1 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")


def test_bpe_training_is_deterministic_and_batch_encoding_agrees() -> None:
    again = BPETokenizer.train([SAMPLE], vocab_size=400)
    assert again.ranks == BPETokenizer.train([SAMPLE], vocab_size=400).ranks
    tok = small_bpe()
    texts = [SAMPLE[:100], SAMPLE[100:5000], "", "🙂"]
    assert tok.encode_batch(texts, num_threads=2) == [tok.encode(t) for t in texts]
    assert [a.tolist() for a in tok.encode_arrays(texts, num_threads=2)] == [tok.encode(t) for t in texts]


def test_bpe_smaller_vocab_when_text_runs_out_of_pairs() -> None:
    tok = BPETokenizer.train(["abab"], vocab_size=1000)
    assert tok.vocab_size < 1000 and tok.eot_id == tok.vocab_size - 1
    assert tok.decode(tok.encode("abba cd")) == "abba cd"


@pytest.mark.parametrize("vocab_size", [0, 100, 256, 257 - 1, 2.5, True])
def test_bpe_vocab_size_below_bytes_plus_specials(vocab_size) -> None:
    with pytest.raises(UsageError, match="at least 257") as e:
        build_tokenizer("bpe", lambda: [SAMPLE], vocab_size)
    assert "\n" not in str(e.value)


def test_bpe_smallest_vocab_is_bytes_plus_eot() -> None:
    tok = build_tokenizer("bpe", lambda: [SAMPLE], 257)
    assert tok.vocab_size == 257 and tok.eot_id == 256
    assert tok.encode("hé") == list("hé".encode())


def test_bpe_needs_text() -> None:
    with pytest.raises(MinigptError, match="empty"):
        BPETokenizer.train(["", ""], vocab_size=300)
    with pytest.raises(UsageError, match="learned from the training text"):
        build_tokenizer("bpe", None, 300)


def test_decode_bytes_may_end_inside_a_character() -> None:
    tok = build_tokenizer("bpe", lambda: ["plain ascii"], 257)
    ids = tok.encode("é🙂")
    assert tok.decode_bytes(ids[:1]) == "é".encode()[:1]
    assert tok.decode_bytes(ids[:3]) + tok.decode_bytes(ids[3:]) == "é🙂".encode()


def test_decode_of_an_unknown_id_is_a_one_line_error() -> None:
    tok = small_bpe()
    for bad in (tok.vocab_size, 10**12, -1):
        with pytest.raises(MinigptError, match="not in the"):
            tok.decode([1, bad])


# ---------------------------------------------------------------------------------------------- char


def test_char_roundtrip_and_unknown_characters() -> None:
    tok = CharTokenizer.from_texts(["hello", " world\n"])
    assert tok.vocab_size == len(set("hello world\n"))
    assert tok.eot_id is None
    with pytest.raises(MinigptError, match=r"2 character\(s\).*'Z'.*'é'.*--tokenizer bpe") as e:
        tok.encode("hello Zé")
    assert "\n" not in str(e.value)
    assert tok.unknown_chars("hZlé") == {"Z", "é"}
    with pytest.raises(MinigptError, match="empty"):
        CharTokenizer.from_texts(["", ""])


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(st.characters(), min_size=1, max_size=30, unique=True), st.lists(st.integers(0, 29)))
@example(["a", "\ud800", "\udfff"], [0, 1, 2, 0])  # lone surrogates: drawn rarely, so always tried
def test_char_roundtrips_over_its_alphabet(alphabet: list[str], picks: list[int]) -> None:
    """Any alphabet of code points either round-trips every text over it, or, holding a lone surrogate
    (which no UTF-8 text can), is refused in one line both when built and when loaded."""
    if any(0xD800 <= ord(c) <= 0xDFFF for c in alphabet):
        for build in (
            lambda: CharTokenizer(alphabet),
            lambda: tokenizer_from_json({"kind": "char", "chars": alphabet}),
        ):
            with pytest.raises(MinigptError, match="lone surrogate") as e:
                build()
            assert "\n" not in str(e.value)
        return
    tok = CharTokenizer.from_texts(["".join(alphabet)])
    text = "".join(alphabet[i % len(alphabet)] for i in picks)
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.decode_bytes(ids) == text.encode("utf-8")
    assert tok.encode_arrays([text])[0].tolist() == ids
    assert roundtrip_json(tok).chars == tok.chars


def test_vocab_size_only_for_bpe() -> None:
    with pytest.raises(UsageError, match="only applies to --tokenizer bpe"):
        build_tokenizer("char", lambda: ["abc"], 300)


# ---------------------------------------------------------------------------------------------- tiktoken


@pytest.mark.slow
@FIXTURE_SETTINGS
@given(st.text())
def test_r50k_file_roundtrips_any_unicode(r50k_file: Path, text: str) -> None:
    tok = r50k_from(str(r50k_file))
    assert tok.decode(tok.encode(text)) == text


def test_r50k_file_is_recognised_and_matches_tiktoken(
    r50k_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiktoken

    tok = r50k_from(str(r50k_file))
    assert (tok.kind, tok.name, tok.vocab_size, tok.eot_id) == ("tiktoken", "r50k_base", 50257, 50256)
    assert tok.pattern == GPT2_SPLIT_PATTERN
    # tiktoken itself, offline through its cache (sha1 of the url), is the reference
    (tmp_path / hashlib.sha1(r50k_url().encode()).hexdigest()).symlink_to(r50k_file)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    reference = tiktoken.get_encoding("r50k_base")
    assert tok.encode(SAMPLE) == reference.encode_ordinary(SAMPLE)
    assert tok.encode("hello world") == [31373, 995]


@pytest.mark.slow
@pytest.mark.parametrize("file_name", ["sha1", "r50k_base.tiktoken"])
@pytest.mark.parametrize("name", ["r50k_base", "gpt2"])
def test_named_encoding_from_tiktoken_cache_dir(
    r50k_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, file_name: str
) -> None:
    target = hashlib.sha1(r50k_url().encode()).hexdigest() if file_name == "sha1" else file_name
    (tmp_path / target).symlink_to(r50k_file)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    tok = build_tokenizer(name, None, None)
    assert (tok.name, tok.vocab_size, tok.eot_id) == (name, 50257, 50256)
    assert tok.encode(SAMPLE) == r50k_from(str(r50k_file)).encode(SAMPLE)


@pytest.mark.parametrize("name", ["gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base"])
def test_missing_named_encoding_is_one_line_without_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    def no_network(*args, **kwargs):
        raise AssertionError("tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    (tmp_path / NAMED_ENCODINGS[name].file).write_bytes(b"IQ== 0\n")  # wrong content: ignored
    with pytest.raises(MinigptError) as e:
        build_tokenizer(name, None, None)
    message = str(e.value)
    assert "\n" not in message
    for hint in ("TIKTOKEN_CACHE_DIR", "--tokenizer path/to/", "bpe or char", NAMED_ENCODINGS[name].url):
        assert hint in message


def test_unknown_spec_lists_the_choices() -> None:
    with pytest.raises(UsageError) as e:
        build_tokenizer("r50k", None, None)
    assert "char, bpe, gpt2, r50k_base" in str(e.value) and ".tiktoken" in str(e.value)


def test_local_tiktoken_file(tmp_path: Path) -> None:
    bpe = small_bpe()
    path = tmp_path / "mine.tiktoken"
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(bpe.ranks.items(), key=lambda x: x[1])]
    path.write_text("\n".join(lines) + "\n")
    tok = build_tokenizer(str(path), None, None)
    assert (tok.kind, tok.name, tok.pattern) == ("tiktoken", "mine", GPT2_SPLIT_PATTERN)
    assert tok.eot_id == len(bpe.ranks) and tok.vocab_size == len(bpe.ranks) + 1
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert TiktokenTokenizer.from_file(path, pattern=GPT4_SPLIT_PATTERN).encode(SAMPLE) == bpe.encode(SAMPLE)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "empty"),
        (b"IQ== 0\nnot base64!! x\n", r"mine.tiktoken: line 2 is not 'base64-token rank'"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "line 1 is not"),
        (b"IQ== 0\nIg== 1\n", "lacks single-byte token"),
    ],
)
def test_bad_tiktoken_file(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "mine.tiktoken"
    path.write_bytes(content)
    with pytest.raises(MinigptError, match=match) as e:
        build_tokenizer(str(path), None, None)
    assert "\n" not in str(e.value)


def test_missing_tiktoken_file(tmp_path: Path) -> None:
    with pytest.raises(MinigptError, match="no such .tiktoken file"):
        build_tokenizer(str(tmp_path / "nope.tiktoken"), None, None)


# ---------------------------------------------------------------------------------------------- json


@pytest.mark.slow
def test_save_load_gives_identical_ids(r50k_file: Path) -> None:
    kinds = [CharTokenizer.from_texts([SAMPLE]), small_bpe(), r50k_from(str(r50k_file))]
    for tok in kinds:
        data = json.loads(json.dumps(tok.to_json()))
        back = tokenizer_from_json(data)
        assert type(back) is type(tok)
        assert (back.vocab_size, back.eot_id, back.describe()) == (tok.vocab_size, tok.eot_id, tok.describe())
        assert back.encode(SAMPLE) == tok.encode(SAMPLE)
        assert back.decode(tok.encode(SAMPLE)) == SAMPLE
        assert back.to_json() == tok.to_json()
    assert len(json.dumps(kinds[2].to_json())) < 1_000_000  # compact: ~12 bytes per rank


def test_bad_tokenizer_json_is_a_one_line_error() -> None:
    good = small_bpe().to_json()
    for bad in (
        {"kind": "wat"},
        {**good, "ranks": "x"},
        {**good, "ranks": ["!!"]},
        {**good, "pattern": "(unclosed"},
    ):
        with pytest.raises(MinigptError) as e:
            tokenizer_from_json(bad)
        assert "\n" not in str(e.value)


def test_text_byte_lengths_count_utf8_bytes(r50k_file: Path) -> None:
    for tok in (CharTokenizer.from_texts([SAMPLE]), small_bpe(), r50k_from(str(r50k_file))):
        lengths = tok.text_byte_lengths()
        assert len(lengths) == tok.vocab_size
        assert int(lengths[tok.encode(SAMPLE)].sum()) == len(SAMPLE.encode())
        if tok.eot_id is not None:
            assert lengths[tok.eot_id] == 0
