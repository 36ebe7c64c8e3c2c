"""spaCy word vocabularies with learned detokenization; the XLM-R tokenizer loaded through the real code path."""

import json
import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from src import fileio
from src.data.corpus import read_lines
from src.errors import ConfigError
from src.tokenizers import (
    SPECIALS,
    UNK_TEXT,
    HFCodec,
    SpacyCodec,
    TrimmedCodec,
    build_codec,
    codec_from_state,
    load_codecs,
    save_codecs,
    saved_tokenizer_name,
)

from .conftest import make_xlmr_tokenizer, multi30k_root
from .helpers import run_cli

TEXT = [
    "Ein Mann (mit Hut) sagt: „Hallo!“",
    "Zwei Hunde spielen, und ein Kind lacht.",
    "Ein Mann spielt, und zwei Kinder lachen.",
    "Der Hund (schwarz) bellt: „Wuff!“",
    "Die Frau (alt) ruft: „Komm!“",
    "Ein Hund läuft, und ein Mann wartet.",
]


def test_vocabulary_specials_order_and_min_freq():
    codec = SpacyCodec.build(TEXT, "de", min_freq=2)
    assert tuple(codec.itos[:4]) == SPECIALS == ("<s>", "<pad>", "</s>", "<unk>")
    assert (codec.bos_id, codec.pad_id, codec.eos_id, codec.unk_id) == (0, 1, 2, 3)
    assert "Mann" in codec.stoi and "Hut" not in codec.stoi  # seen 3 times vs once
    assert codec.encode(["Hut"]) == [[codec.unk_id]]
    counts = [codec.itos.index(w) for w in ("Ein", "Mann")]
    assert counts == sorted(counts)  # most frequent first
    assert len(SpacyCodec.build(TEXT, "de", min_freq=1, max_size=10)) == 10


@pytest.mark.parametrize("options", [{}, {"min_freq": 2}, {"max_size": 10}, {"lowercase": True}])
def test_spacy_counts_its_vocabulary_in_the_pass_that_encodes_the_training_text(options):
    """``build_encoding`` tokenizes the training text once: its vocabulary is the tokens counted from that text
    (``min_freq`` times or more, most frequent first, ties alphabetical, at most ``max_size``), and its ids are
    its codec's ``encode`` of the same text (<unk> for the words left out), end to end with each line's length."""
    texts = [*TEXT, "", "Ein  Hund\u00a0läuft, und ein Kind lacht."]  # an empty line; spaces spaCy makes tokens of
    codec, ids, lengths = SpacyCodec.build_encoding(texts, "de", **options)
    counts = Counter(token for tokens in codec.tokenize(texts) for token in tokens)
    words = sorted((w for w, c in counts.items() if c >= options.get("min_freq", 1)), key=lambda w: (-counts[w], w))
    assert codec.itos == [*SPECIALS, *words[: options.get("max_size", len(words) + 4) - 4]]
    assert codec.state() == SpacyCodec.build(texts, "de", **options).state()
    expected = codec.encode(texts)
    assert (ids.dtype, lengths.dtype) == (torch.int32, torch.int64)
    assert lengths.tolist() == [len(e) for e in expected] and lengths[-2] == 0
    assert ids.tolist() == [i for e in expected for i in e]
    assert (codec.unk_id in ids.tolist()) == ("min_freq" in options or "max_size" in options)
    empty, no_ids, no_lengths = SpacyCodec.build_encoding([], "de")
    assert empty.itos == list(SPECIALS) and no_ids.numel() == no_lengths.numel() == 0


def test_a_detokenization_rule_needs_most_of_at_least_three_cases():
    """A token is glued (or spaced) by rule when it was so in more than half of 3 or more of its occurrences in the
    training text: 2 of 3, not 2 of 4 (half), nor 2 of 2 (too few to tell)."""
    from src.tokenizers import _mostly

    cases = [("a", True), ("a", False), ("a", True), ("b", True), ("b", False), ("b", True), ("b", False),
             ("c", True), ("c", True), ("d", False), ("d", False), ("d", True)]
    assert _mostly(cases) == {"a"}


def test_detokenization_is_learned_from_the_training_text():
    codec = SpacyCodec.build(TEXT, "de", min_freq=1)
    assert {",", ".", "!", ")", ":", "“"} <= codec.glue_left
    assert {"(", "„"} <= codec.glue_right
    for sentence in TEXT:
        assert codec.decode(codec.encode([sentence])[0]) == sentence
    ids = codec.encode(["Ein Mann wartet."])[0]
    assert codec.decode([codec.bos_id, *ids, codec.eos_id, codec.pad_id, 7]) == "Ein Mann wartet."


def test_text_without_spaces_between_words_is_joined_without_them():
    """Chinese, Japanese, Thai: most gaps between tokens hold no space, so tokens join unless they were seen set
    apart (a Latin word in Chinese text). Before, every token not learned to glue took a space: '我喜欢 猫。'."""
    lines = ["我喜欢猫。", "今天我去市场。", "猫在垫子上睡觉。", "我们喜欢 Python 和猫。", "他们用 Python 写代码。",
             "我在学 Python 编程。", "孩子们在公园里玩。"]
    codec = SpacyCodec.build(lines, "zh")
    assert not codec.spaced
    for line in lines:
        assert codec.decode(codec.encode([line])[0]) == line
    assert codec.decode(codec.encode(["我喜欢狗。"])[0]) == "我喜欢⁇。"  # an unknown word: no space either
    again = codec_from_state(json.loads(json.dumps(codec.state())))
    assert again.detokenize(codec.tokenize(["我们喜欢 Python 和猫。"])[0]) == "我们喜欢 Python 和猫。"
    assert SpacyCodec.build(TEXT, "de").spaced


def test_a_tokenizer_that_splits_nothing_is_said(caplog):
    """Thai given as xx (spaCy's multi-language code, which splits at spaces): a vocabulary of whole sentences,
    which trained without a word before."""
    SpacyCodec.build(["แมวนอนบนเสื่อ", "วันนี้ฉันไปตลาด", "ฉันชอบชาเขียว"], "xx")
    assert "spaCy's 'xx' tokenizer made 1.0 tokens per training sentence" in caplog.text
    caplog.clear()
    SpacyCodec.build(TEXT, "de")
    assert "tokens per training sentence" not in caplog.text


@pytest.mark.parametrize("lang", ["th", "lo", "km", "my"])
def test_bleu_of_a_language_without_spaces_counts_characters(lang):
    """13a saw each Thai sentence as one word: a perfect translation scored BLEU 0."""
    from src.evaluate import score

    refs = ["แมวนอนบนเสื่อ", "วันนี้ฉันไปตลาด"]
    got = score(refs, refs, tgt_lang=lang)
    assert got["bleu"] == 100 and "tok:char" in got["bleu_signature"]
    assert score(["แมวนอนบนเสื่อ", "วันนี้ฉันไปตลา"], refs, tgt_lang=lang)["bleu"] > 50  # one character wrong


def bleu_words(hypothesis: str) -> int:
    """The words sacreBLEU's BLEU counts in a hypothesis (its 13a tokenization)."""
    from src.evaluate import bleu_metric

    return bleu_metric().corpus_score([hypothesis], [["x"]]).sys_len


def test_an_unknown_word_is_one_word_of_the_scored_text_in_both_tokenizers(xlmr_dir):
    """An unknown token decodes as one word that matches nothing, whichever tokenizer: the text "<unk>" was three
    words to sacreBLEU (a longer hypothesis, n-grams that never match), and XLM-R's decoding dropped it."""
    codec = SpacyCodec.build(TEXT, "de", min_freq=2)
    ids = codec.encode(["Ein Mann mit Hut wartet."])[0]
    assert ids.count(codec.unk_id) == 3  # mit, Hut, wartet
    text = codec.decode(ids)
    assert text == f"Ein Mann {UNK_TEXT} {UNK_TEXT} {UNK_TEXT}." and bleu_words(text) == 6
    assert bleu_words(f"Ein Mann <unk> {UNK_TEXT} {UNK_TEXT}.") == 8  # what "<unk>" did
    hf = build_codec({"name": "xlmr", "name_or_path": str(xlmr_dir)}, "de", [])
    dog, garden = hf.encode(["ein Hund"])[0], hf.encode(["im Garten"])[0]
    assert hf.decode([*dog, hf.unk_id, hf.unk_id, *garden, hf.eos_id, *dog]) == f"ein Hund {UNK_TEXT} {UNK_TEXT} im Garten"
    assert hf.decode([hf.unk_id, *garden]) == f"{UNK_TEXT} im Garten" and hf.decode([hf.eos_id]) == ""
    trimmed = TrimmedCodec(codec, [i for i in range(len(codec)) if codec.itos[i] != "Mann"])  # "Mann" dropped
    assert trimmed.decode(trimmed.encode(["Ein Mann"])[0]) == f"Ein {UNK_TEXT}"


def test_xlmr_decodes_the_spaces_the_model_wrote_and_never_writes_mask(xlmr_dir, tmp_path):
    """sentencepiece's spaces are the model's: a tokenizer config asking for transformers' cleanup (4.x wrote it
    so) must not join "Hund ." into "Hund." when the model wrote the space. <mask> is never a translation's: the
    decoding drops it, so decoding may not choose it (``other_specials``)."""
    import json

    copy = tmp_path / "cleanup"
    shutil.copytree(xlmr_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    plain, cleaning = HFCodec(str(xlmr_dir)), HFCodec(str(copy))
    ids = plain.encode(["ein Hund ."])[0]
    assert plain.decode(ids) == cleaning.decode(ids) == "ein Hund ."
    assert plain.other_specials == (plain.tok.convert_tokens_to_ids("<mask>"),)
    trimmed = TrimmedCodec(plain, [*range(10), *plain.other_specials])
    assert trimmed.other_specials == (10,) and SpacyCodec.build(TEXT, "de", min_freq=2).other_specials == ()


def test_scores_are_sacrebleus_corpus_scores_with_the_hypotheses_first():
    """BLEU and chrF as sacreBLEU's own functions give them, hypotheses first (on sentences where the swapped
    order scores otherwise: shorter hypotheses pay the brevity penalty, longer ones lower precisions)."""
    import sacrebleu

    from src.evaluate import score

    hyps = ["the dog runs in the park", "a man sings"]
    refs = ["the black dog runs fast in the big park today", "a man sings a song"]
    got = score(hyps, refs)
    assert got["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert got["chrf"] == round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2)
    swapped = score(refs, hyps)
    assert got["bleu"] != swapped["bleu"] and got["chrf"] != swapped["chrf"]


def test_training_lines_hold_one_string_per_distinct_token():
    """The vocabulary is learned from lines held as shared token strings and space flags, not a (str, bool) pair
    per token: the same word in two lines is the same object, and the spaces are those of the text."""
    lines = list(SpacyCodec("de", list(SPECIALS)).token_lines(TEXT))
    tokens, spaces = lines[1]
    assert tokens == ("Zwei", "Hunde", "spielen", ",", "und", "ein", "Kind", "lacht", ".")
    assert list(spaces) == [1, 1, 0, 1, 1, 1, 1, 0, 0]
    mann = [t for toks, _ in lines for t in toks if t == "Mann"]
    assert len(mann) == 3 and all(t is mann[0] for t in mann)


def test_runs_of_spaces_make_no_tokens():
    """spaCy makes a token of the extra spaces in "Hund  und" (and of a no-break space); words are what spaces
    separate, so neither reaches the vocabulary, the encoded ids or the detokenization rules (Multi30k's issue
    table counts 8,012 German words with min_freq 2, not 8,014)."""
    text = ["Ein Hund  und ein Kind .", "\u00a0Ein Hund und  ein Kind .", "Ein Hund und ein Kind . "]
    codec = SpacyCodec.build(text, "de")
    assert list(codec.tokenize(text)) == [["Ein", "Hund", "und", "ein", "Kind", "."]] * 3
    assert not any(w.isspace() for w in codec.itos)
    ids = codec.encode(text)
    assert ids[0] == ids[1] == ids[2]
    assert [list(spaces) for _, spaces in codec.token_lines(text[:1])] == [[1, 1, 1, 1, 1, 0]]
    assert codec.decode(ids[1]) == "Ein Hund und ein Kind ."


def test_a_tab_or_no_break_space_separates_words_as_a_space_does():
    """The word after a tab or a no-break space (Multi30k's German has 48: "Nummer\u00a028") follows a space: it
    is not learned as attached to the word before it (which glued hypotheses into "thedogruns")."""
    text = ["a\tdog\truns ."] * 5 + ["the cat sleeps ."] * 5 + ["number\u00a028 wins ."] * 5
    codec = SpacyCodec.build(text, "en")
    assert codec.glue_left == set()  # (it held "dog", "runs" and "28")
    assert [list(spaces) for _, spaces in codec.token_lines(text[:1])] == [[1, 1, 1, 0]]
    assert codec.detokenize(["the", "dog", "runs", "."]) == "the dog runs ."


def test_words_typed_with_combining_accents_are_the_vocabularys_words():
    """Text in Unicode's decomposed form (NFD: "a" + a combining umlaut) is tokenized as the composed form (NFC) the
    vocabulary holds, in training and in what is translated: not as <unk>."""
    import unicodedata

    codec = SpacyCodec.build(["Zwei Männer laufen ."] * 3, "de")
    nfd = unicodedata.normalize("NFD", "Zwei Männer laufen .")
    assert nfd != "Zwei Männer laufen ." and codec.encode([nfd]) == codec.encode(["Zwei Männer laufen ."])
    assert codec.unk_id not in codec.encode([nfd])[0]
    assert SpacyCodec.build([nfd] * 3, "de").itos == codec.itos
    # an NFD corpus: its correct translations score 100 against its NFD references (the hypotheses are NFC)
    from src.evaluate import score

    refs = [unicodedata.normalize("NFD", t) for t in ("Zwei Männer laufen über die Straße .", "Ein Mädchen hört .")]
    nfd_codec = SpacyCodec.build(refs * 3, "de")
    assert score([nfd_codec.decode(ids) for ids in nfd_codec.encode(refs)], refs, False, "de")["bleu"] == 100
    # lowercasing can decompose (T with a combining diaeresis lowercases to t and the mark): NFC after it
    lower = SpacyCodec.build(["the \u1e97 sign ."] * 3, "en", lowercase=True)
    assert lower.encode(["THE T\u0308 SIGN ."]) == lower.encode(["the \u1e97 sign ."])
    assert lower.unk_id not in lower.encode(["THE T\u0308 SIGN ."])[0]


def test_detokenization_credits_each_space_to_the_token_that_explains_it():
    """French elision and straight quotes: "air" follows "l'" without a space more often than not here, yet it is
    "l'" that glues (so "plein air" keeps its space); a straight quote glues right when it opens and left when it
    closes."""
    text = [
        "Un homme respire l'air frais près de l'eau.",
        "Une femme regarde l'air du soir sur l'herbe.",
        "Un enfant joue dans l'air sous l'arbre.",
        "Deux chiens courent en plein air avec l'enfant.",
        'Un chien prend un "bain" en plein air.',
        'Une femme lit "Le Monde" dans un café.',
        'Un homme porte un "chapeau" rouge.',
    ]
    codec = SpacyCodec.build(text, "fr")
    assert "l'" in codec.glue_right and "air" not in codec.glue_left and codec.paired == {'"'}
    for sentence in text:
        assert codec.decode(codec.encode([sentence])[0]) == sentence
    unseen = 'Un chien en plein air regarde un "match" près de l\'eau.'
    assert codec.detokenize(codec.tokenize([unseen])[0]) == unseen  # "regarde", "match" are not in the vocabulary
    state = codec.state()
    assert codec_from_state(state).paired == {'"'}
    del state["paired"]  # a vocabulary saved before quotes were paired still loads
    assert codec_from_state(state).paired == set()


@pytest.mark.parametrize("lowercase", [False, True])
def test_codecs_save_and_load(tmp_path, lowercase):
    """Everything a codec is comes back (its state whole: a lowercasing one that came back not lowercasing
    encoded every capitalized word of translate.py's input as <unk>)."""
    spec = {"name": "spacy", "min_freq": 1, "lowercase": lowercase}
    src, tgt = build_codec(spec, "de", TEXT), build_codec(spec, "en", [t.upper() for t in TEXT])
    save_codecs(tmp_path, src, tgt)
    src2, tgt2 = load_codecs(tmp_path)
    assert (src2.state(), tgt2.state()) == (src.state(), tgt.state()) and src2.lowercase is lowercase
    assert src2.encode(TEXT) == src.encode(TEXT) and src2.encode([t.upper() for t in TEXT]) == src.encode(
        [t.upper() for t in TEXT])


def test_a_vocabulary_is_the_same_whatever_the_order_of_its_lines_and_a_trim_is_its_kept_ids():
    """Words of equal counts are ordered alphabetically, so the ids do not depend on the order of the training
    lines; a trimmed vocabulary's digest (what resuming and translate.py check) names which ids it kept, not
    only how many."""
    assert SpacyCodec.build(["b a", "a b"], "en").itos == SpacyCodec.build(["a b", "b a"], "en").itos
    base = SpacyCodec.build(TEXT, "de")
    assert TrimmedCodec(base, [0, 1, 2, 3, 7]).vocab_digest() != TrimmedCodec(base, [0, 1, 2, 3, 8]).vocab_digest()


def test_xlmr_tokenizer_loads_from_a_local_directory(xlmr_dir, tmp_path):
    src = build_codec({"name": "xlmr", "name_or_path": str(xlmr_dir)}, "de", [])
    assert isinstance(src, HFCodec)
    assert (src.bos_id, src.pad_id, src.eos_id, src.unk_id) == (0, 1, 2, 3)  # XLM-R's ids
    assert type(src.tok).__name__ == "XLMRobertaTokenizer"
    sentence = "Der große Hund sieht den alten Mann im Garten."
    ids = src.encode([sentence])[0]
    assert src.bos_id not in ids and src.eos_id not in ids
    assert src.decode([*ids, src.eos_id, src.pad_id]) == sentence
    save_codecs(tmp_path, src, src)  # XLM-R: one codec for both sides
    again, again_tgt = load_codecs(tmp_path)
    assert again is again_tgt and again.encode([sentence])[0] == ids
    # what a checkpoint's ids stand for: the same for the same tokenizer loaded again, another for another one
    assert again.vocab_digest() == src.vocab_digest()
    assert HFCodec(str(make_xlmr_tokenizer(tmp_path / "other", vocab_size=400))).vocab_digest() != src.vocab_digest()
    same_size = HFCodec(str(make_xlmr_tokenizer(tmp_path / "same_size", seed=8)))  # other text: other pieces
    assert len(same_size) == len(src) and same_size.tok.convert_ids_to_tokens(list(range(len(src)))) != \
        src.tok.convert_ids_to_tokens(list(range(len(src))))
    assert same_size.vocab_digest() != src.vocab_digest()


def test_a_hub_name_in_the_cache_loads_from_it_without_asking_the_hub(xlmr_dir, tmp_path):
    """A tokenizer downloaded once is loaded from Hugging Face's cache with the hub not asked, as on a compute node
    without network, where each request is retried for about 25 s before the cache is used (minutes a run)."""
    from transformers import XLMRobertaConfig

    snapshot = tmp_path / "hub" / "models--xlm-roberta-base" / "snapshots" / ("0" * 40)  # the cache's layout
    shutil.copytree(xlmr_dir, snapshot)
    XLMRobertaConfig(vocab_size=len(HFCodec(str(xlmr_dir)))).save_pretrained(snapshot)  # a download holds it too
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    load = run_cli("-c", "from src.tokenizers import HFCodec; print(HFCodec('xlm-roberta-base').vocab_digest())",
                   env_extra={"HF_HUB_OFFLINE": "", "HF_HOME": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert load.returncode == 0, load.stderr
    assert load.stdout.split() == [HFCodec(str(xlmr_dir)).vocab_digest()]
    assert "requesting" not in load.stderr  # the hub's warning for each failed request, and each retry


def test_xlmr_encodes_special_tokens_written_in_the_text_as_unk(xlmr_dir, caplog):
    """"</s>" written in a sentence would end it in training, "<pad>" would be masked out: both become <unk>."""
    codec = build_codec({"name": "xlmr", "name_or_path": str(xlmr_dir)}, "de", [])
    plain = codec.encode(["ein Hund im Garten"])[0]
    ids = codec.encode(["ein <s> Hund </s> im <pad> Garten"])[0]
    assert not {codec.bos_id, codec.eos_id, codec.pad_id} & set(ids) and ids.count(codec.unk_id) == 3
    assert [i for i in ids if i != codec.unk_id] == [i for i in plain if i != codec.unk_id]
    assert "3 special token(s)" in caplog.text
    assert codec.encode([]) == []  # translate.py's input of blank lines only: no sentence to encode


def test_unloadable_xlmr_name_is_one_clear_line(tmp_path):
    """A path that is not a directory is said to be one before the hub is asked (which reads "/x/tok" as a
    malformed repository id); a directory without a tokenizer, and a hub name offline, each in one line."""
    (tmp_path / "file").write_text("")
    for name, says in ((tmp_path / "no-such-tokenizer", "no such directory; give a directory written by save_pretrained"),
                       (tmp_path / "file", "not a directory"),
                       (tmp_path, "cannot load a tokenizer (")):
        with pytest.raises(ConfigError) as e:
            HFCodec(str(name))
        assert str(e.value).startswith(f"tokenizer.name_or_path={name}: {says}") and "\n" not in str(e.value)
    assert str(e.value).endswith("give a directory written by save_pretrained")  # not the hub's advice
    hint = ("; without network, point it at a local directory written by save_pretrained, or load it once where the "
            "hub answers (then it is read from Hugging Face's cache)")
    hub = run_cli("-c", "from src.tokenizers import HFCodec; HFCodec('nobody/no-such-tokenizer')",
                  env_extra={"HF_HUB_OFFLINE": "1"})
    assert hub.stderr.strip().splitlines()[-1].endswith(
        "cannot load a tokenizer (We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find "
        f"them in the cached files.){hint}")


@pytest.mark.slow
def test_an_unreachable_hub_is_said_at_once_not_after_a_minute_of_retries(tmp_path):
    """Online mode with no hub to answer (no network, a wrong HF_ENDPOINT): from_pretrained retried the connection
    for 49 s, printing 24 warnings, before it said so; one request without retries says it in a moment."""
    started = time.perf_counter()
    hub = run_cli("-c", "from src.tokenizers import HFCodec; HFCodec('xlm-roberta-base')",
                  env_extra={"HF_HUB_OFFLINE": "", "HF_HOME": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert time.perf_counter() - started < 20
    last = hub.stderr.strip().splitlines()[-1]
    assert last.startswith("src.errors.ConfigError: tokenizer.name_or_path=xlm-roberta-base: cannot load a tokenizer "
                           "(cannot reach the Hugging Face hub at http://127.0.0.1:9: [Errno 111] Connection refused); "
                           "without network") and last.endswith("written by save_pretrained, or "
                           "load it once where the hub answers (then it is read from Hugging Face's cache)")
    assert "requesting" not in hub.stderr  # the hub's warning for each failed request, and each retry


def test_unknown_spacy_pipeline_says_how_to_fix():
    codec = SpacyCodec("de", list(SPECIALS), model="de_no_such_pipeline")
    with pytest.raises(ConfigError, match="tokenizer.models.de=de_no_such_pipeline"):
        codec.encode(["Hallo"])


def test_a_spacy_pipeline_that_is_no_pipeline_is_named_in_one_line(tmp_path, caplog):
    """+tokenizer.models.de=...: empty, a package that is no pipeline, a folder without config.cfg (whose files
    were hashed for the cache key first) and a folder gone since training (translate.py) each get one line naming
    the key; a language the run does not translate is said to be unused."""
    import spacy

    from src.tokenizers import check_tokenizer

    spec = {"name": "spacy", "min_freq": 1, "max_vocab": None, "lowercase": False}
    cases = {"": "tokenizer.models.de: empty; give a pipeline's name or directory",
             str(tmp_path): f"tokenizer.models.de={tmp_path}: not a spaCy pipeline directory (no config.cfg)",
             str(tmp_path / "gone"): f"tokenizer.models.de={tmp_path / 'gone'}: no such directory"}
    for model, message in cases.items():
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
            check_tokenizer({**spec, "models": {"de": model}}, ("de", "en"))
    with pytest.raises(ConfigError, match=r"^tokenizer.models.de=pytest: not a spaCy pipeline \(\w+Error: "):
        SpacyCodec("de", list(SPECIALS), model="pytest").encode(["Hallo"])
    spacy.blank("de").to_disk(tmp_path / "de")
    check_tokenizer({**spec, "models": {"de": str(tmp_path / "de"), "ge": "de_core_news_sm"}}, ("de", "en"))
    assert "tokenizer.models.ge: not a language of this run (de->en), so not used" in caplog.text
    assert SpacyCodec("de", list(SPECIALS), model=str(tmp_path / "de")).encode(["Hallo"])
    (tmp_path / "de").rename(tmp_path / "moved")  # a run trained with it, translated after the folder moved
    with pytest.raises(ConfigError, match=f"^tokenizer.models.de={re.escape(str(tmp_path / 'de'))}: no such dir"):
        SpacyCodec("de", list(SPECIALS), model=str(tmp_path / "de")).encode(["Hallo"])


def test_a_pipeline_directorys_tokenizer_is_kept_with_the_run(tmp_path):
    """tokenizer.models.<lang> given as a directory: the run keeps that pipeline's tokenizer (its rules and special
    cases) beside codecs.json, so the run's checkpoints translate as it trained after the directory has moved or
    changed; a side without one (spacy.blank) keeps nothing."""
    import spacy
    from spacy.symbols import ORTH

    nlp = spacy.blank("de")
    nlp.tokenizer.add_special_case("Hallo", [{ORTH: "Hal"}, {ORTH: "lo"}])
    nlp.to_disk(tmp_path / "de")
    src = SpacyCodec.build(["Hallo Welt", "Welt"], "de", model=str(tmp_path / "de"))
    tgt = SpacyCodec.build(["Hello world"], "en")
    save_codecs(tmp_path / "run", src, tgt)
    assert src.tokenize(["Hallo Welt"]) == [["Hal", "lo", "Welt"]]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["codecs.json",
                                                                  saved_tokenizer_name("de", str(tmp_path / "de"))]
    (tmp_path / "de").rename(tmp_path / "moved")
    spacy.blank("de").to_disk(tmp_path / "de")  # another pipeline where the run's was
    loaded, _ = load_codecs(tmp_path / "run")
    assert loaded.tokenize(["Hallo Welt"]) == [["Hal", "lo", "Welt"]]
    assert loaded.encode(["Hallo Welt"]) == src.encode(["Hallo Welt"]) and loaded.vocab_digest() == src.vocab_digest()


@pytest.mark.slow
@pytest.mark.skipif(multi30k_root() is None, reason="set MULTI30K_ROOT to the folder of the real Multi30k raw files")
@pytest.mark.parametrize("lang", ["en", "fr"])
def test_multi30k_references_come_back_from_tokens_as_they_were(lang):
    """Rules learned from the real training split join the tokens of the real validation references back into
    the same text, but for typos in the references themselves (the code before these rules: en 3, fr 55 lines).
    A run of spaces reads as one (three French references have a double space)."""
    root = multi30k_root()
    codec = SpacyCodec.build(read_lines(root / f"train.{lang}.gz"), lang, min_freq=2)
    references = read_lines(root / f"val.{lang}.gz")
    joined = [codec.detokenize(tokens) for tokens in codec.tokenize(references)]
    assert sum(r.split() != j.split() for r, j in zip(references, joined)) <= 1


def test_a_failed_save_of_an_hf_tokenizer_leaves_the_earlier_one_whole(xlmr_dir, tmp_path, monkeypatch):
    """save_pretrained writes several files; one that fails halfway (a full disk, a kill) leaves the run's earlier
    tokenizer as it was, and nothing beside it."""
    codec = HFCodec(str(xlmr_dir))
    codec.save(tmp_path)
    saved = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o777 & ~fileio._umask()  # what mkdir gives

    def fails_halfway(directory):
        (Path(directory) / "tokenizer.json").write_text("{")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(codec.tok, "save_pretrained", fails_halfway)
    with pytest.raises(OSError, match="No space left"):
        codec.save(tmp_path)
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == saved
    assert os.listdir(tmp_path) == ["hf"]
    monkeypatch.undo()
    codec.save(tmp_path)  # and a save that succeeds replaces it, leaving nothing beside it either
    assert os.listdir(tmp_path) == ["hf"] and HFCodec(str(tmp_path / "hf")).encode(["ein Hund"]) == codec.encode(["ein Hund"])


def test_the_vocabulary_counts_every_training_line_and_the_rules_learn_from_a_sample(monkeypatch):
    """A WMT-sized training split: detokenization rules from RULES_SAMPLE of its lines drawn at random (learn_glue's
    passes over every gap, and every line's tokens held for them, grew with the corpus); the vocabulary still counts
    every line, and a split within the sample learns from all of it."""
    from src import tokenizers
    from src.tokenizers import SpacyCodec, learn_glue, learn_spacing, rules_sample

    texts = [f"(der Satz {i}), hier." if i % 5 else f"Wort{i} ist da" for i in range(60)]
    whole = SpacyCodec.build(texts, "de")
    monkeypatch.setattr(tokenizers, "RULES_SAMPLE", 12)
    chosen = [i for i, yes in enumerate(rules_sample(60)) if yes]
    assert len(chosen) == 12 and chosen == [i for i, yes in enumerate(rules_sample(60)) if yes]  # the same each time
    assert chosen != list(range(0, 60, 5)) and max(chosen) >= 30  # drawn, not every k-th line, from all of it
    given = []
    monkeypatch.setattr(tokenizers, "learn_glue", lambda docs: given.append(docs) or learn_glue(docs))
    sampled = SpacyCodec.build(texts, "de")
    assert sampled.itos == whole.itos and "Wort55" in sampled.itos
    docs = list(SpacyCodec("de", list(tokenizers.SPECIALS)).token_lines([texts[i] for i in chosen]))
    assert given == [docs]
    assert (sampled.glue_left, sampled.glue_right, sampled.paired) == tuple(learn_glue(docs))
    assert (sampled.spaced, sampled.space_left, sampled.space_right) == learn_spacing(docs)
    monkeypatch.setattr(tokenizers, "RULES_SAMPLE", 60)
    assert rules_sample(60) == bytearray([1] * 60)
