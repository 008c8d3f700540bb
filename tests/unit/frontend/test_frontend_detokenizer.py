"""Incremental detokenisation and stop strings on the tiny-llama byte-level tokenizer (no network)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from components.frontend.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer, load_tokenizer

pytestmark = pytest.mark.unit

MODEL_PATH = str(Path(__file__).resolve().parents[3] / "models" / "tiny-llama")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(MODEL_PATH)


def stream(tok: Tokenizer, ids: list[int], chunk_sizes: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt or [])
    out, i = [], 0
    for n in chunk_sizes:
        out.append(detok.feed(ids[i : i + n]))
        i += n
    out.append(detok.feed(ids[i:]) if i < len(ids) else "")
    out.append(detok.flush())
    return out


def test_multibyte_characters_split_across_chunks_are_never_emitted_half(tok: Tokenizer):
    text = "héllo 日本語 🙂!"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # byte-level: one token per UTF-8 byte, so characters span tokens
    pieces = stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # The 4-byte emoji arrives as three empty deltas and then the whole character.
    emoji = len("héllo 日本語 ".encode())
    assert pieces[emoji : emoji + 4] == ["", "", "", "🙂"]


def test_any_chunking_gives_the_same_text_as_one_transformers_decode(tok: Tokenizer):
    # Imported here, not at the top: AutoTokenizer imports torch (~2-3 s), which collecting the suite
    # paid in every pytest process (both xdist workers and the vLLM run) whether it ran this or not.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(MODEL_PATH)  # the reference: transformers' own decode, not our fast path
    rng = random.Random(7)
    for _ in range(200):
        # Random bytes and special tokens: invalid UTF-8 included, as the mock engine produces.
        ids = [rng.randrange(384) for _ in range(rng.randrange(1, 120))]
        sizes = [rng.randrange(1, 9) for _ in range(len(ids))]
        # ... except that the very end never sends replacement characters (an output cut inside a character).
        full = hf.decode(ids, skip_special_tokens=True)
        assert isinstance(full, str)
        assert "".join(stream(tok, ids, sizes)) == full.rstrip("\ufffd")


def test_special_tokens_are_skipped_and_long_outputs_keep_a_short_window(tok: Tokenizer):
    ids = [104, 257, 105, 260] * 500  # 'h' <|eos|> 'i' <|user|> ...
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.feed(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert text == "hi" * 500
    assert len(detok._ids) < 100  # the window was trimmed as the output grew (2000 tokens fed)


def test_a_prompt_ending_inside_a_character_does_not_swallow_output(tok: Tokenizer):
    snow = "日".encode()  # e6 97 a5
    prompt = [*tok.encode("ab", add_special_tokens=False), snow[0], snow[1]]
    # The prompt's last two bytes are half a character; the output starts with the rest of it and then 'z'.
    assert "".join(stream(tok, [snow[2], 122], [1], prompt)) == tok.decode([snow[2], 122])


def test_stop_string_split_across_chunks_is_cut_and_nothing_after_is_emitted():
    m = StopStringMatcher(["STOP", "halt"])
    out = [m.feed("abc ST"), m.feed("O"), m.feed("P and more"), m.feed("ignored")]
    assert "".join(out) == "abc "
    assert m.stopped and m.flush() == ""
    assert out[0] == "abc "  # 'ST' is held back: it may be the start of STOP


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop():
    m = StopStringMatcher(["STOP"])
    assert m.feed("xxST") == "xx"
    assert m.feed("Ay S") == "STAy "  # 'STA' cannot begin STOP; ' S' ends in 'S', which can
    assert m.feed("TO") == ""
    assert m.flush() == "STO"
    assert not m.stopped
    assert StopStringMatcher(["STOP"]).feed("no tail here") == "no tail here"  # nothing held without a reason


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(["bb", "a"])
    assert m.feed("xxbbya") == "xx"
    assert m.stopped


def test_single_token_stop_detection(tok: Tokenizer):
    assert tok.single_token_stop("x") == 120
    assert tok.single_token_stop("<|user|>") == 260
    assert tok.single_token_stop("xy") is None
    assert tok.single_token_stop("é") is None  # two bytes, two tokens


def test_an_output_that_ends_inside_a_character_sends_no_replacement_character_at_the_end(tok: Tokenizer):
    # vLLM's server sends "" for a final token that stops inside a UTF-8 character; so does the frontend.
    snow = "日".encode()  # e6 97 a5
    ids = [*tok.encode("ab", add_special_tokens=False), snow[0], snow[1]]
    pieces = stream(tok, ids, [1, 1, 1])
    assert pieces[-1] == "" and "".join(pieces) == "ab"
    assert all("\ufffd" not in p for p in pieces)
    # A whole character after an invalid byte is kept, the invalid byte too: only the cut-off end is dropped.
    assert "".join(stream(tok, [0xFF, *snow], [1, 1])) == tok.decode([0xFF, *snow])


def test_the_offset_free_encoder_gives_transformers_ids_on_prompts_and_chat_templates(tok: Tokenizer):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(MODEL_PATH, local_files_only=True)
    assert tok._backend_encode_fast is not None  # tokenizers >= 0.21: the fast path is the one under test
    rng = random.Random(3)
    alphabet = "abc xyz  \n\t.,!?'\"éü日本語🙂<s></s>[INST]0123456789"
    texts = ["", " ", "<s>", "".join(rng.choice(alphabet) for _ in range(2000))]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 200))) for _ in range(200)]
    for text in texts:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    messages = [{"role": "system", "content": texts[3][:300]}, {"role": "user", "content": texts[5]}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(messages) == hf.encode(text, add_special_tokens=False)


def test_the_byte_table_streams_what_the_rust_decode_stream_streams_chunk_for_chunk(tok: Tokenizer):
    # The byte-level fast path (Tokenizer.byte_table) against tokenizers' DecodeStream, which it replaces: random
    # bytes (invalid UTF-8 and characters split over chunks included), special tokens, ids the tokenizer does not
    # have, in random chunkings, must give the same text in every chunk, not only in all.
    assert tok.byte_table is not None and len(tok.byte_table) == 384
    rust = load_tokenizer(MODEL_PATH)
    rust.byte_table = None  # the DecodeStream path
    assert rust.streams_in_rust
    rng = random.Random(11)
    for _ in range(300):
        n = rng.randrange(1, 80)
        ids = [rng.randrange(-2, 400) if rng.random() < 0.02 else rng.randrange(384) for _ in range(n)]
        ids += list("日🙂".encode())[: rng.randrange(0, 7)]  # sometimes ends inside a character
        sizes = [rng.choice((1, 1, 1, 2, 3, 5)) for _ in range(len(ids))]
        prompt = [rng.randrange(384) for _ in range(rng.randrange(0, 8))]
        assert stream(tok, ids, sizes, prompt) == stream(rust, ids, sizes, prompt)


def test_a_tokenizer_that_does_not_decode_bytes_gets_no_byte_table(tok: Tokenizer):
    from tokenizers import decoders

    from components.frontend.tokenizer import byte_table

    backend = load_tokenizer(MODEL_PATH)._backend
    assert byte_table(backend) is not None
    backend.decoder = decoders.Metaspace()  # decodes "▁" as a space, and drops a leading one: not ByteLevel
    assert byte_table(backend) is None
