"""Tests for bertjax.data.tokenization: exact Google BERT WordPiece behaviour, SentencePiece, CLI."""

import importlib.util
import os
import pathlib
import pickle
import random
import subprocess
import sys

import numpy as np
import pytest

from bertjax.data import tokenization as tok, wordpiece

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PARITY_VOCAB = REPO_ROOT.parent / "shared" / "data" / "bert-base-uncased" / "vocab.txt"

VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    "the",
    "hello",
    "héllo",
    "Hello",
    "un",
    "##aff",
    "##able",
    "a",
    "##a",
    "b",
    ",",
    "!",
    "?",
    "[",
    "]",
    "mask",
    "中",
    "文",
    "¿",
    "—",
    "que",
    "no",
]


def write_vocab(path: pathlib.Path, tokens, newline: str = "\n") -> str:
    path.write_bytes(newline.join(tokens).encode("utf-8") + newline.encode())
    return str(path)


@pytest.fixture
def vocab_file(tmp_path):
    return write_vocab(tmp_path / "vocab.txt", VOCAB)


@pytest.fixture
def wp(vocab_file):
    return tok.WordPieceTokenizer(vocab_file)


# ---------------------------------------------------------------------------
# BasicTokenizer behaviour.


@pytest.mark.parametrize(
    "lower, strip, expected",
    [
        (True, None, ["hello"]),  # uncased BERT: lower + strip accents
        (False, None, ["Héllo"]),  # cased BERT keeps accents
        (False, True, ["Hello"]),  # strip accents, keep case
        (True, False, ["héllo"]),  # lower, keep accents
    ],
)
def test_accent_and_case_options(lower, strip, expected):
    assert tok.basic_tokenize("Héllo", do_lower_case=lower, strip_accents=strip) == expected


def test_decomposed_accents_are_stripped():
    assert tok.basic_tokenize("He\u0301llo NAI\u0308VE") == ["hello", "naive"]


def test_cjk_ideographs_split_per_char():
    assert tok.basic_tokenize("中文abc日本") == ["中", "文", "abc", "日", "本"]
    assert tok.basic_tokenize("x\U00020000y") == ["x", "\U00020000", "y"]
    # Kana and Hangul are not in the original's ranges: they stay one word.
    assert tok.basic_tokenize("ひらがな", do_lower_case=False) == ["ひらがな"]
    assert tok.basic_tokenize("한국어", do_lower_case=False) == ["한국어"]


def test_punctuation_ascii_and_unicode():
    assert tok.basic_tokenize("¿Qué—no?") == ["¿", "que", "—", "no", "?"]
    assert tok.basic_tokenize("$5^3`x`+y") == ["$", "5", "^", "3", "`", "x", "`", "+", "y"]
    assert tok.basic_tokenize("a.b,c...") == ["a", ".", "b", ",", "c", ".", ".", "."]
    # Unicode symbols outside "P*" and ASCII ranges are not punctuation.
    assert tok.basic_tokenize("5€ x©") == ["5€", "x©"]


def test_control_chars_removed_and_whitespace_normalized():
    assert tok.basic_tokenize("a\x00b\ufffdc\u200bd\x07e") == ["abcde"]
    assert tok.basic_tokenize("a\tb\nc\rd") == ["a", "b", "c", "d"]
    assert tok.basic_tokenize("a\u00a0b\u3000c") == ["a", "b", "c"]
    assert tok.basic_tokenize("a\u2028b") == ["a", "b"]
    assert tok.basic_tokenize(" \t\n ") == []


def test_bytes_input_decoded_with_replacement():
    assert tok.basic_tokenize(b"caf\xc3\xa9 \xffx") == ["cafe", "x"]


def test_mask_in_raw_text_is_split_like_punctuation(wp):
    assert tok.basic_tokenize("[MASK]", do_lower_case=False) == ["[", "MASK", "]"]
    assert wp.tokenize("the [MASK]!") == ["the", "[", "mask", "]", "!"]


# ---------------------------------------------------------------------------
# WordPiece.


def test_greedy_longest_match(wp):
    assert wp.tokenize("unaffable") == ["un", "##aff", "##able"]
    assert wp.tokenize("Hello, unaffable!") == ["hello", ",", "un", "##aff", "##able", "!"]


def test_greedy_does_not_backtrack(tmp_path):
    # "unaf" wins as the longest prefix; "##fable" is absent so the whole word
    # is [UNK] even though un ##aff ##able would have worked.
    path = write_vocab(tmp_path / "v.txt", [*VOCAB, "unaf"])
    assert tok.WordPieceTokenizer(path).tokenize("unaffable") == ["[UNK]"]


def test_unsegmentable_word_is_single_unk(wp):
    assert wp.tokenize("hello unaffablez the") == ["hello", "[UNK]", "the"]


def test_cased_tokenization(vocab_file):
    cased = tok.WordPieceTokenizer(vocab_file, do_lower_case=False)
    assert cased.tokenize("Hello héllo Héllo") == ["Hello", "héllo", "[UNK]"]
    assert tok.WordPieceTokenizer(vocab_file, do_lower_case=True, strip_accents=False).tokenize(
        "Héllo"
    ) == ["héllo"]


def test_long_words(wp, vocab_file):
    assert wp.tokenize("a" * 200) == ["a"] + ["##a"] * 199
    assert wp.tokenize("a" * 201 + " b") == ["[UNK]", "b"]
    short = tok.WordPieceTokenizer(vocab_file, max_input_chars_per_word=100)
    assert short.tokenize("a" * 101) == ["[UNK]"]


def test_cjk_through_wordpiece(wp):
    assert wp.tokenize("中文") == ["中", "文"]


def test_special_ids_and_vocab_size(wp):
    assert (wp.pad_id, wp.unk_id, wp.cls_id, wp.sep_id, wp.mask_id) == (0, 1, 2, 3, 4)
    assert wp.vocab_size == len(VOCAB)
    assert wp.special_ids() == frozenset({0, 2, 3, 4})
    assert isinstance(wp, tok.Tokenizer)


def test_ids_round_trip(wp):
    text = "Hello, the unaffable 中文 [MASK]!"
    tokens = wp.tokenize(text)
    ids = wp.encode(text)
    assert ids == [VOCAB.index(t) for t in tokens]
    assert wp.convert_ids_to_tokens(ids) == tokens
    assert wp.convert_tokens_to_ids(["hello", "not-a-token"]) == [VOCAB.index("hello"), wp.unk_id]
    with pytest.raises(IndexError):
        wp.convert_ids_to_tokens([len(VOCAB)])
    with pytest.raises(IndexError):
        wp.convert_ids_to_tokens([-1])


@pytest.mark.parametrize("lower", [True, False])
def test_encode_remembers_words_without_changing_ids(vocab_file, monkeypatch, lower):
    """encode looks remembered words up (the same ids as splitting them again), stops
    remembering at WORDS_REMEMBERED, and a pickled tokenizer (sent to a worker) forgets them."""
    wp = tok.WordPieceTokenizer(vocab_file, do_lower_case=lower)
    lines = [
        "Hello, the unaffable 中文 [MASK]!",
        "héllo\x00 HÉLLO\u3000a\tb\x0b¿que?",
        "the the THE unaffable, — no!",
        "aaa ##a b,b,b 文中 \ufffd",
    ] * 3
    expected = [wp.convert_tokens_to_ids(wp.tokenize(line)) for line in lines]
    assert [wp.encode(line) for line in lines] == expected
    assert [wp.encode(line) for line in lines] == expected  # now from the remembered words
    assert 0 < len(wp._word_ids) < 30
    monkeypatch.setattr(wordpiece, "WORDS_REMEMBERED", 3)
    small = tok.WordPieceTokenizer(vocab_file, do_lower_case=lower)
    assert [small.encode(line) for line in lines] == expected and len(small._word_ids) == 3
    assert pickle.loads(pickle.dumps(wp))._word_ids == {}


def test_continuation_mask(wp):
    mask = wp.continuation_mask()
    assert mask.dtype == np.bool_ and mask.shape == (len(VOCAB),)
    assert list(np.flatnonzero(mask)) == [i for i, t in enumerate(VOCAB) if t.startswith("##")]


def test_fingerprint_tracks_vocab_and_options(tmp_path, vocab_file):
    def fp(path=vocab_file, **kw):
        return tok.WordPieceTokenizer(path, **kw).fingerprint()

    base = fp()
    assert base == fp() and len(base) == 64
    # None means "follow do_lower_case": same behaviour, same fingerprint.
    assert base == fp(strip_accents=True)
    others = {
        fp(do_lower_case=False),
        fp(strip_accents=False),
        fp(max_input_chars_per_word=100),
        fp(write_vocab(tmp_path / "other.txt", [*VOCAB, "extra"])),
    }
    assert base not in others and len(others) == 4


def test_vocab_lines_stripped_crlf_and_duplicates(tmp_path):
    path = write_vocab(tmp_path / "crlf.txt", [*VOCAB, "the "], newline="\r\n")
    t = tok.WordPieceTokenizer(path)
    assert t.vocab_size == len(VOCAB) + 1
    # A duplicate maps to its last line, as Google's dict-based load_vocab does.
    assert t.encode("the") == [len(VOCAB)]
    assert t.convert_ids_to_tokens([VOCAB.index("the")]) == ["the"]


def test_vocab_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        tok.WordPieceTokenizer(str(missing))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt"):
        tok.WordPieceTokenizer(str(empty))
    no_specials = write_vocab(tmp_path / "plain.txt", ["the", "a"])
    with pytest.raises(ValueError, match=r"plain.txt.*\[PAD\]"):
        tok.WordPieceTokenizer(no_specials)


def test_load_tokenizer(vocab_file):
    t = tok.load_tokenizer("wordpiece", vocab_file, do_lower_case=False)
    assert isinstance(t, tok.WordPieceTokenizer) and t.tokenize("Hello") == ["Hello"]
    with pytest.raises(ValueError, match="'bpe'"):
        tok.load_tokenizer("unigram", vocab_file)


# ---------------------------------------------------------------------------
# SentencePiece.

SYLLABLES = [
    "ka",
    "to",
    "ri",
    "mo",
    "ne",
    "su",
    "la",
    "pi",
    "do",
    "ge",
    "ba",
    "zu",
    "vi",
    "sho",
    "ter",
    "ing",
    "ed",
]


def make_sentences(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)

    def word():
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))

    return [
        " ".join(word() for _ in range(rng.randint(3, 12))).capitalize() + "." for _ in range(n)
    ]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("sp") / "m"
    return tok.train_sentencepiece(make_sentences(), str(prefix), vocab_size=200)


def test_sentencepiece_special_ids(sp_model):
    sp = tok.SentencePieceTokenizer(sp_model)
    assert os.path.exists(sp_model) and sp_model.endswith(".model")
    assert (sp.pad_id, sp.unk_id, sp.cls_id, sp.sep_id, sp.mask_id) == (0, 1, 2, 3, 4)
    assert sp.convert_ids_to_tokens(range(5)) == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert sp.special_ids() == frozenset({0, 2, 3, 4})
    assert 5 < sp.vocab_size <= 200
    assert isinstance(sp, tok.Tokenizer)


def test_sentencepiece_encode_decode_round_trip(sp_model):
    sp = tok.SentencePieceTokenizer(sp_model)
    text = "Kato rimo sune lapi."
    tokens = sp.tokenize(text)
    ids = sp.encode(text)
    assert len(tokens) > 1 and sp.unk_id not in ids
    assert sp.convert_tokens_to_ids(tokens) == ids
    assert sp.convert_ids_to_tokens(ids) == tokens
    assert sp.decode(ids) == text
    assert sp.convert_tokens_to_ids(["no-such-piece"]) == [sp.unk_id]


def test_sentencepiece_continuation_mask(sp_model):
    sp = tok.SentencePieceTokenizer(sp_model)
    mask = sp.continuation_mask()
    pieces = sp.convert_ids_to_tokens(range(sp.vocab_size))
    assert mask.dtype == np.bool_ and mask.shape == (sp.vocab_size,)
    assert not mask[:5].any()
    assert not any(mask[i] for i, p in enumerate(pieces) if p.startswith("▁"))
    assert all(mask[i] for i, p in enumerate(pieces) if i >= 5 and not p.startswith("▁"))
    assert mask.any()


def test_sentencepiece_training_is_deterministic(tmp_path, sp_model):
    again = tok.train_sentencepiece(make_sentences(), str(tmp_path / "m"), vocab_size=200)
    first, second = tok.SentencePieceTokenizer(sp_model), tok.SentencePieceTokenizer(again)
    assert first.convert_ids_to_tokens(range(first.vocab_size)) == second.convert_ids_to_tokens(
        range(second.vocab_size)
    )


def test_sentencepiece_counts_the_lines_it_leaves_out(tmp_path, caplog, capfd):
    """A line over max_sentence_length bytes is left out of learning the vocabulary: one
    bertjax warning counts them, and SentencePiece's own log lines stay off the console."""
    long_line = " ".join(make_sentences(40, seed=1))
    sentences = [*make_sentences(), long_line, "", long_line]
    with caplog.at_level("WARNING"):
        tok.train_sentencepiece(
            sentences,
            str(tmp_path / "m"),
            vocab_size=200,
            max_sentence_length=len(long_line.encode()) - 1,
        )
    assert (
        f"SentencePiece left 2 of 402 lines longer than {len(long_line.encode()) - 1} bytes"
        in caplog.text
    )
    assert "too long line" not in capfd.readouterr().err.lower()


def test_sentencepiece_says_when_it_makes_fewer_pieces_than_asked(tmp_path, caplog):
    with caplog.at_level("INFO"):
        model = tok.train_sentencepiece(make_sentences(), str(tmp_path / "m"), vocab_size=5000)
    made = tok.SentencePieceTokenizer(model).vocab_size
    assert made < 5000
    assert f"SentencePiece: asked for 5000 pieces, made {made}: the corpus holds too few" in (
        caplog.text
    )


def test_sentencepiece_lowercase_and_fingerprint(tmp_path, sp_model):
    lower = tok.SentencePieceTokenizer(
        tok.train_sentencepiece(
            make_sentences(), str(tmp_path / "low"), vocab_size=200, do_lower_case=True
        )
    )
    assert all(p == p.lower() for p in lower.tokenize("KATO Rimo"))
    assert lower.fingerprint() != tok.SentencePieceTokenizer(sp_model).fingerprint()
    assert (
        tok.load_tokenizer("sentencepiece", sp_model).fingerprint()
        == tok.SentencePieceTokenizer(sp_model).fingerprint()
    )


def test_sentencepiece_errors(tmp_path):
    with pytest.raises(ValueError, match="no non-blank"):
        tok.train_sentencepiece(["", "  "], str(tmp_path / "e"), vocab_size=50)
    with pytest.raises(ValueError, match="model_type"):
        tok.train_sentencepiece(["a b"], str(tmp_path / "e"), vocab_size=50, model_type="wordpiece")
    with pytest.raises(ValueError, match="vocab_size"):
        tok.train_sentencepiece(make_sentences(20), str(tmp_path / "e"), vocab_size=8)
    with pytest.raises(FileNotFoundError, match=r"gone\.model"):
        tok.SentencePieceTokenizer(str(tmp_path / "gone.model"))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"garbage\.model"):
        tok.SentencePieceTokenizer(str(garbage))


# ---------------------------------------------------------------------------
# CLI.


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(
        [sys.executable, "-m", "bertjax.data.tokenization", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_train(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(make_sentences()) + "\n", encoding="utf-8")
    prefix = tmp_path / "out" / "sp"
    result = run_cli(
        "train", f"--input={corpus}", f"--model_prefix={prefix}", "--vocab_size=150", "--lowercase"
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "sp.model").exists()
    assert str(prefix) + ".model" in result.stdout


def test_cli_missing_input_file(tmp_path):
    missing = tmp_path / "missing_corpus.txt"
    result = run_cli(
        "train", f"--input={missing}", f"--model_prefix={tmp_path / 'sp'}", "--vocab_size=100"
    )
    assert result.returncode == 2
    assert "missing_corpus.txt" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_empty_input_and_tokenize(tmp_path, vocab_file, capsys):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n", encoding="utf-8")
    assert (
        tok.main(
            ["train", f"--input={blank}", f"--model_prefix={tmp_path / 'sp'}", "--vocab_size=100"]
        )
        == 2
    )
    assert "no non-blank" in capsys.readouterr().err
    assert (
        tok.main(
            ["tokenize", "--kind=wordpiece", f"--vocab={vocab_file}", "--text=Hello unaffable!"]
        )
        == 0
    )
    tokens, ids = capsys.readouterr().out.splitlines()
    assert tokens == "hello un ##aff ##able !"
    assert ids == " ".join(str(VOCAB.index(t)) for t in tokens.split())


# ---------------------------------------------------------------------------
# Opt-in parity with transformers' slow BERT tokenizer on the real vocab.


def _random_text(rng: random.Random) -> str:
    # NFC-stable characters only: transformers NFC-normalizes input, Google does not.
    pool = (
        list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
        + list("     \t\n\r.,;:!?'\"()[]{}<>$^`~@#%&*-_+=/\\|")
        + list("éàüñçøÉÅßæœłđ¿¡—–…«»€£©®°±×÷中文日本語한국어ひらがなカタカナ")
        + ["\x00", "\x07", "\ufffd", "\u200b", "\u00a0", "\u3000", "\u2028", "\U00020001"]
    )
    return "".join(rng.choice(pool) for _ in range(rng.randint(1, 80)))


@pytest.mark.skipif(
    not PARITY_VOCAB.exists() or importlib.util.find_spec("transformers") is None,
    reason="needs ../shared/data/bert-base-uncased/vocab.txt and transformers",
)
def test_parity_with_transformers():
    bert = pytest.importorskip("transformers.models.bert.tokenization_bert")
    if not hasattr(bert, "BasicTokenizer") or not hasattr(bert, "WordpieceTokenizer"):
        pytest.skip("this transformers version has no slow BERT tokenizer")
    hf_vocab = bert.load_vocab(str(PARITY_VOCAB))
    basic = bert.BasicTokenizer(do_lower_case=True)
    wordpiece = bert.WordpieceTokenizer(
        vocab=hf_vocab, unk_token="[UNK]", max_input_chars_per_word=200
    )
    ours = tok.WordPieceTokenizer(str(PARITY_VOCAB))
    rng = random.Random(0)
    texts = [
        "Hello, World! The quick brown fox jumped over the lazy dog in 1999.",
        "unaffable [MASK] Héllo naïve café ¿Qué? a—b $5^3`x`",
        "中文字符 and 日本語のテキスト, 한국어 텍스트.",
        "x" * 150 + " " + "y" * 250,
    ] + [_random_text(rng) for _ in range(300)]
    for text in texts:
        expected = [p for w in basic.tokenize(text) for p in wordpiece.tokenize(w)]
        assert ours.tokenize(text) == expected, repr(text)
