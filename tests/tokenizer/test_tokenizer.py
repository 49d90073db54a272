"""Tests for pagoda.tokenizer: loading, chat templates, incremental detokenization and stop strings."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import (
    IncrementalDetokenizer,
    OutputTextState,
    StopStringChecker,
    apply_chat_template,
    eos_token_ids,
    load_tokenizer,
)

REPLACEMENT = "\ufffd"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = {
    "ascii": "Hello world, the tether! Hello there.",
    "cjk": "你好，世界。你好你好好",
    "emoji": "😀🎉😀 ok 👍🏽",
    "mixed": "Hello 你好 😀 world — café naïve 你好😀the",
}
# Every kind of character the tokenizers must handle: ASCII, Latin-1, CJK, emoji (4 bytes), combining marks.
TEXT_ALPHABET = st.sampled_from(
    list("Helo wrdth,.!\n") + list("éü—你好世界") + ["😀", "🎉", "👍", "🏽", "\u0301"]
)


def _byte_level_tokenizer() -> Tokenizer:
    b2u = bytes_to_unicode()

    def tok(bs: bytes) -> str:
        return "".join(b2u[b] for b in bs)

    vocab = {tok(bytes([b])): b for b in range(256)}
    merge_bytes = [
        (b" ", b"t"),
        (b"h", b"e"),
        (b" t", b"he"),
        (b"l", b"l"),
        (b"H", b"e"),
        (b"He", b"ll"),
        (b"Hell", b"o"),
        (b" ", b"w"),
        (b"o", b"r"),
        (b" w", b"or"),
        (b"\xe4", b"\xbd"),  # the first two bytes of 你: a token that ends mid-character
        (b"\xa0", b"\xe5"),  # the end of 你 and the start of 好: a token that spans a character boundary
        (b"\xf0", b"\x9f"),  # the first bytes of most emoji
        (b"\xf0\x9f", b"\x98"),
    ]
    merges = []
    for left, right in merge_bytes:
        merges.append((tok(left), tok(right)))
        vocab[tok(left + right)] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tokenizer


def _sentencepiece_tokenizer(decoder_style: str) -> Tokenizer:
    """A Llama-style BPE over characters with ``▁`` for spaces and <0xXX> byte fallback."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁" + "abcdefghijklmnopqrstuvwxyzHW,.!":
        vocab[ch] = len(vocab)
    merges = [
        ("▁", "w"),
        ("o", "r"),
        ("▁w", "or"),
        ("l", "d"),
        ("H", "e"),
        ("l", "l"),
        ("He", "ll"),
        ("Hell", "o"),
    ]
    merges += [("▁", "t"), ("h", "e"), ("▁t", "he")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    if decoder_style == "llama":
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tokenizer.decoder = decoders.Sequence(
            [
                decoders.ByteFallback(),
                decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False),
            ]
        )
    tokenizer.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in ("<unk>", "<s>", "</s>")]
    )
    return tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bytelevel")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_tokenizer(),
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [fast.convert_tokens_to_ids("<|im_end|>")]})
    )
    return path


@pytest.fixture(scope="module")
def tok(model_dir: Path):
    return load_tokenizer(str(model_dir))


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def sp_tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(f"sp-{request.param}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_sentencepiece_tokenizer(request.param),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(path))
    return load_tokenizer(str(path))


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    deltas, pos, k = [], 0, 0
    while pos < len(ids):
        n = sizes[k % len(sizes)]
        deltas.append(detok.add(ids[pos : pos + n]))
        pos, k = pos + n, k + 1
    deltas.append(detok.flush())
    return deltas


# --- loading --------------------------------------------------------------------------------------------


def test_load_tokenizer_round_trip(tok) -> None:
    assert tok.is_fast
    ids = _encode(tok, TEXTS["mixed"])
    assert tok.decode(ids) == TEXTS["mixed"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in tok.all_special_ids


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no tokenizer in"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not load a tokenizer"):
        load_tokenizer(str(tmp_path))


def test_eos_token_ids(tok, model_dir: Path, tmp_path: Path) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    assert eos_token_ids(tok, model_dir) == (im_end, eot)
    assert eos_token_ids(tok, tmp_path) == (eot,)  # no generation_config.json
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": eot}))
    assert eos_token_ids(tok, tmp_path) == (eot,)
    gen.write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert eos_token_ids(tok, tmp_path) == (7, 9, eot)
    gen.write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        eos_token_ids(tok, tmp_path)
    gen.write_text("{broken")
    with pytest.raises(ValueError, match=r"generation_config\.json"):
        eos_token_ids(tok, tmp_path)


# --- chat template --------------------------------------------------------------------------------------


def test_apply_chat_template(tok) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello 你好"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello 你好<|im_end|>\n"
    ids = apply_chat_template(tok, messages)
    assert ids == _encode(tok, expected + "<|im_start|>assistant\n")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert apply_chat_template(tok, messages, add_generation_prompt=False) == _encode(tok, expected)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object"),
        ([{"content": "a"}], r"messages\[0\]\.role"),
        ([{"role": "robot", "content": "a"}], r"messages\[0\]\.role must be one of system, user, assistant"),
        ([{"role": "tool", "content": "a"}], r"messages\[0\]\.role"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": 3}],
            r"messages\[1\]\.content must be a string",
        ),
        ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
    ],
)
def test_apply_chat_template_rejects_bad_messages(tok, messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_chat_template(tok, messages)


def test_chat_template_tool_role_and_errors(model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(model_dir))
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}<tool>{{ m['content'] }}</tool>"
        "{% elif m['role'] == 'system' %}{{ raise_exception('no system messages') }}"
        "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    assert tokenizer.decode(ids) == "a<tool>b</tool>"
    with pytest.raises(ValueError, match="no system messages"):
        apply_chat_template(tokenizer, [{"role": "system", "content": "a"}])
    with pytest.raises(ValueError, match="do not pass tokenize"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "a"}], tokenize=False)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "a"}])


# --- incremental detokenizer ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("sizes", [[1], [2], [3, 1, 4], [1000]])
def test_detokenizer_matches_decode(tok, name: str, sizes: list[int]) -> None:
    ids = _encode(tok, TEXTS[name])
    prompt = apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    deltas = _stream(IncrementalDetokenizer(tok, prompt, skip_special_tokens=True), ids, sizes)
    assert "".join(deltas) == tok.decode(ids) == TEXTS[name]
    assert not any(REPLACEMENT in d for d in deltas)


def test_detokenizer_holds_split_characters(tok) -> None:
    ids = _encode(tok, "a你好😀")
    assert len(ids) > 5  # the CJK and emoji characters are split over several tokens
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas = [detok.add([t]) for t in ids]
    # 你 and 好 come out together: one token holds the end of 你 and the start of 好.
    assert [d for d in deltas if d] == ["a", "你好", "😀"]
    assert detok.flush() == ""


def test_detokenizer_group_ending_mid_character(tok) -> None:
    ids = _encode(tok, "ab你 好")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    # All but the last token: 好 is incomplete, everything before it is emitted now.
    assert detok.add(ids[:-1]) == "ab你 "
    assert detok.add(ids[-1:]) == "好"


def test_detokenizer_flush_incomplete_character(tok) -> None:
    ids = _encode(tok, "ok😀")[:-1]  # cut the emoji short, as max_tokens might
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    streamed = "".join(detok.add([t]) for t in ids)
    assert streamed == "ok"
    rest = detok.flush()
    assert streamed + rest == tok.decode(ids) and rest.endswith(REPLACEMENT)
    with pytest.raises(ValueError, match="after flush"):
        detok.add(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_special_tokens(tok, skip: bool) -> None:
    ids = _encode(tok, "Hello<|im_end|>你好<|endoftext|>")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert text == ("Hello你好" if skip else "Hello<|im_end|>你好<|endoftext|>")


def test_detokenizer_prompt_ending_mid_character(tok) -> None:
    ids = _encode(tok, "x你好")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(REPLACEMENT))
    detok = IncrementalDetokenizer(tok, ids[:cut], skip_special_tokens=True)
    output = ids[cut:]
    assert "".join(detok.add([t]) for t in output) + detok.flush() == tok.decode(output)


def test_detokenizer_invalid_utf8_and_bounded_window(tok) -> None:
    """Invalid bytes come out as decode gives them, and no step decodes more than a small window."""
    b2u = bytes_to_unicode()
    cont = tok.convert_tokens_to_ids(b2u[0x80])  # a lone UTF-8 continuation byte
    ids = [cont] * 100 + _encode(tok, "Hello world 你好") * 40
    detok = IncrementalDetokenizer(tok, _encode(tok, "prompt " * 50), skip_special_tokens=True)
    decode, sizes = detok._backend.decode, []

    def counting_decode(window, **kwargs):
        sizes.append(len(window))
        return decode(window, **kwargs)

    detok._backend = type("Spy", (), {"decode": staticmethod(counting_decode)})()
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert max(sizes) <= 40


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=TEXT_ALPHABET, min_size=1, max_size=30),
    prompt=st.text(alphabet=TEXT_ALPHABET, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_detokenizer_random_splits(tok, text: str, prompt: str, seed: int) -> None:
    ids = _encode(tok, text)
    sizes = [random.Random(seed).randint(1, 5) for _ in range(8)]
    deltas = _stream(IncrementalDetokenizer(tok, _encode(tok, prompt), skip_special_tokens=True), ids, sizes)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any(REPLACEMENT in d for d in deltas)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_detokenizer_random_token_ids(tok, data: st.DataObject, skip: bool) -> None:
    """Any token sequence, valid UTF-8 or not, streams to exactly what decode gives."""
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=24), label="ids")
    prompt = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=8), label="prompt")
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=6), label="sizes")
    deltas = _stream(IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip), ids, sizes)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_sentencepiece_leading_space(sp_tok) -> None:
    prompt = _encode(sp_tok, "Hello")
    output = _encode(sp_tok, " world 你好")
    assert sp_tok.convert_ids_to_tokens(output[:1]) == ["▁wor"]
    in_context = sp_tok.decode(prompt + output)[len(sp_tok.decode(prompt)) :]
    assert in_context == " world 你好"
    detok = IncrementalDetokenizer(sp_tok, prompt, skip_special_tokens=True)
    assert "".join(detok.add([t]) for t in output) + detok.flush() == in_context
    # Without a prompt the first token starts the text, and decode drops its leading space.
    detok = IncrementalDetokenizer(sp_tok, [], skip_special_tokens=True)
    assert "".join(detok.add([t]) for t in output) + detok.flush() == sp_tok.decode(output) == "world 你好"
    # A skipped special token as the only prompt context behaves like no context, as in a full decode.
    bos = sp_tok.convert_tokens_to_ids("<s>")
    detok = IncrementalDetokenizer(sp_tok, [bos], skip_special_tokens=True)
    assert "".join(detok.add([t]) for t in output) + detok.flush() == sp_tok.decode(
        [bos, *output], skip_special_tokens=True
    )


@pytest.mark.parametrize("prompt_text", ["—🎉", "Hello 😀😀"])
def test_sentencepiece_prompt_context_starts_on_a_character(sp_tok, prompt_text: str) -> None:
    # The prompt ends in byte-fallback tokens, so its last few tokens start inside a character.
    prompt = _encode(sp_tok, prompt_text)
    output = _encode(sp_tok, prompt_text + " the")[len(prompt) :]
    assert sp_tok.convert_ids_to_tokens(output) == ["▁the"]
    detok = IncrementalDetokenizer(sp_tok, prompt, skip_special_tokens=True)
    assert detok.add(output) + detok.flush() == " the"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=TEXT_ALPHABET, min_size=1, max_size=20),
    prompt=st.text(alphabet=TEXT_ALPHABET, min_size=1, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_sentencepiece_random_splits(sp_tok, text: str, prompt: str, seed: int) -> None:
    prompt_ids = _encode(sp_tok, prompt)
    ids = _encode(sp_tok, prompt + text)[len(prompt_ids) :]
    if sp_tok.decode(prompt_ids + ids)[: len(sp_tok.decode(prompt_ids))] != sp_tok.decode(prompt_ids):
        return  # the prompt's last token merged with the text: no clean prompt/output split
    expected = sp_tok.decode(prompt_ids + ids)[len(sp_tok.decode(prompt_ids)) :]
    sizes = [random.Random(seed).randint(1, 5) for _ in range(8)]
    deltas = _stream(IncrementalDetokenizer(sp_tok, prompt_ids, skip_special_tokens=True), ids, sizes)
    assert "".join(deltas) == expected
    assert not any(REPLACEMENT in d for d in deltas)


# --- stop strings ---------------------------------------------------------------------------------------


def _feed_all(checker: StopStringChecker, deltas: list[str]) -> tuple[str, str | None]:
    out = []
    for d in deltas:
        released, hit = checker.feed(d)
        out.append(released)
        if hit is not None:
            return "".join(out), hit
    return "".join(out) + checker.flush(), None


def test_stop_single_delta() -> None:
    checker = StopStringChecker(["STOP"])
    assert checker.feed("Hello STOP world") == ("Hello ", "STOP")
    assert checker.stop_str == "STOP"
    with pytest.raises(ValueError, match="after stop string"):
        checker.feed("more")


def test_stop_spanning_deltas_holds_only_possible_prefix() -> None:
    checker = StopStringChecker(["</end>"])
    assert checker.feed("abc</") == ("abc", None)
    assert checker.feed("en") == ("", None)
    assert checker.feed("d>tail") == ("", "</end>")
    checker = StopStringChecker(["aaaa"])
    assert checker.feed("aa") == ("", None)
    assert checker.flush() == "aa"


def test_stop_diverging_prefix_is_released() -> None:
    checker = StopStringChecker(["STOP"])
    assert checker.feed("go ST") == ("go ", None)
    assert checker.feed("AR") == ("STAR", None)
    assert checker.feed("S") == ("", None)
    assert checker.flush() == "S"


def test_stop_at_start_and_include() -> None:
    assert StopStringChecker(["Hi"]).feed("Hi there") == ("", "Hi")
    checker = StopStringChecker(["STOP"], include_stop_str_in_output=True)
    assert checker.feed("a ST") == ("a ST", None)  # nothing is held back when the stop string is kept
    assert checker.feed("OP b") == ("OP", "STOP")


def test_several_stop_strings_first_completed_wins() -> None:
    assert _feed_all(StopStringChecker(["abc", "b"]), ["xa", "bc"]) == ("xa", "b")
    assert _feed_all(StopStringChecker(["bc", "abc"]), ["xab", "c"]) == ("x", "abc")
    assert _feed_all(StopStringChecker(["zz", "b"], True), ["a", "zzb"]) == ("azz", "zz")


def test_stop_validation() -> None:
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        StopStringChecker(["a", ""])
    assert StopStringChecker(None).feed("anything") == ("anything", None)


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, start, s = min(hits)
    return text[: end if include else start], s


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab你", max_size=16),
    stops=st.lists(st.text(alphabet="ab你", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    cuts=st.lists(st.integers(0, 25), max_size=8),
)
def test_stop_random_splits_match_unsplit(
    text: str, stops: list[str], include: bool, cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    checker = StopStringChecker(stops, include)
    released, fed = "", ""
    for d in deltas:
        fed += d
        out, hit = checker.feed(d)
        released += out
        if hit is not None:
            break
        # Only a possible start of a stop string is ever held back.
        assert fed.startswith(released) and len(fed) - len(released) <= max(map(len, stops)) - 1
    else:
        released += checker.flush()
        hit = None
    assert (released, hit) == _reference_stop(text, stops, include)


# --- per-completion output text -------------------------------------------------------------------------


def _run_state(state: OutputTextState, ids: list[int], sizes: list[int]) -> tuple[list[str], str | None]:
    deltas, pos, k, hit = [], 0, 0, None
    while pos < len(ids) and hit is None:
        n = sizes[k % len(sizes)]
        delta, hit = state.add(ids[pos : pos + n], finished=pos + n >= len(ids))
        deltas.append(delta)
        pos, k = pos + n, k + 1
    return deltas, hit


@pytest.mark.parametrize("sizes", [[1], [2, 3], [1000]])
def test_output_text_state_stop_inside_split_characters(tok, sizes: list[int]) -> None:
    prompt = apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    ids = _encode(tok, "Hello 你好😀 world")
    state = OutputTextState(tok, prompt, stop=["好😀", "xyz"])
    deltas, hit = _run_state(state, ids, sizes)
    assert hit == "好😀"
    assert "".join(deltas) == state.text == "Hello 你"
    assert state.finished and state.stop_str == "好😀"
    with pytest.raises(ValueError, match="finished"):
        state.add(ids)


def test_output_text_state_finish_releases_held_text(tok) -> None:
    ids = _encode(tok, "Hello wor")
    params = SamplingParams(stop=["world"], skip_special_tokens=False)
    state = OutputTextState.from_sampling_params(tok, [], params)
    streamed = "".join(state.add([t])[0] for t in ids)
    assert streamed == "Hello "
    assert state.finish() == "wor"
    assert state.text == "Hello wor" and state.stop_str is None


def test_output_text_state_include_and_specials(tok) -> None:
    ids = _encode(tok, "ab<|im_end|>cd")
    state = OutputTextState(
        tok, [], skip_special_tokens=False, stop=["<|im_end|>"], include_stop_str_in_output=True
    )
    assert _run_state(state, ids, [1]) == (["a", "b", "<|im_end|>"], "<|im_end|>")
    state = OutputTextState(tok, [], skip_special_tokens=True, stop=["bc"])
    assert _run_state(state, ids, [1]) == (["a", "", "", ""], "bc")


def test_output_text_state_min_tokens(tok) -> None:
    ids = _encode(tok, "a.b.c.")
    state = OutputTextState(tok, [], stop=["."], min_tokens=2)
    deltas, hit = _run_state(state, ids, [1])
    assert hit == "." and "".join(deltas) == "a.b"
    state = OutputTextState(tok, [], stop=["."], min_tokens=2)
    deltas, hit = _run_state(state, ids, [4])  # the group crosses the min_tokens boundary
    assert hit == "." and "".join(deltas) == "a.b"


def test_output_text_state_min_tokens_covers_flushed_text(tok) -> None:
    ids = _encode(tok, "a😀")[:-1]  # ends inside the emoji: the last character only appears at finish
    state = OutputTextState(tok, [], stop=[REPLACEMENT], min_tokens=len(ids) + 1)
    deltas, hit = _run_state(state, ids, [1])
    assert ("".join(deltas), hit) == ("a" + REPLACEMENT, None)
    state = OutputTextState(tok, [], stop=[REPLACEMENT])
    deltas, hit = _run_state(state, ids, [1])
    assert ("".join(deltas), hit) == ("a", REPLACEMENT)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=TEXT_ALPHABET, min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet=TEXT_ALPHABET, min_size=1, max_size=3), max_size=3),
    include=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_output_text_state_streamed_equals_unstreamed(
    tok, text: str, stops: list[str], include: bool, seed: int
) -> None:
    ids = _encode(tok, text)
    sizes = [random.Random(seed).randint(1, 4) for _ in range(8)]
    streamed = OutputTextState(tok, [], stop=stops, include_stop_str_in_output=include)
    deltas, hit = _run_state(streamed, ids, sizes)
    assert not any(REPLACEMENT in d for d in deltas)
    whole = OutputTextState(tok, [], stop=stops, include_stop_str_in_output=include)
    assert whole.add(ids, finished=True) == ("".join(deltas), hit)
    assert ("".join(deltas), hit) == _reference_stop(text, stops, include)


def test_detokenizer_sees_special_tokens_added_later(model_dir: Path) -> None:
    """The special ids are read once per tokenizer, and again once tokens were added to it."""
    tokenizer = load_tokenizer(str(model_dir))
    ids = _encode(tokenizer, "ab")
    before = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert before.add(ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]) + before.flush() == "ab"
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|late|>"]})
    late = tokenizer.convert_tokens_to_ids("<|late|>")
    after = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert after.add(ids + [late]) + after.flush() == "ab"
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert kept.add(ids + [late]) + kept.flush() == "ab<|late|>"
