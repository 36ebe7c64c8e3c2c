"""A deterministic English/German parallel corpus generated from a small bilingual grammar.

Nothing is shipped or downloaded: sentences are drawn from a grammar that realizes each abstract clause in
both languages, with the agreement German demands:

- articles and demonstratives by gender, number and case (nominative subject, accusative object, dative after
  prepositions), with the contractions ``in dem -> im``;
- adjective endings by declension class (weak after der/dieser, mixed after ein/mein, strong with no article);
- verbs conjugated for person and number, with irregular stems (``sehen -> siehst, sieht``);
- word order: verb second in main clauses (``Heute sieht der Mann ...``), verb last after ``weil``, ``dass``
  and ``während``.

Sentence length is controlled by the number of clauses, so the same generator gives short sentences for quick
runs and long ones for memory experiments.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------- lexicon


@dataclass(frozen=True)
class Noun:
    en: str
    en_pl: str
    gender: str  # m, f, n
    de: str
    de_pl: str
    de_dat_pl: str  # the dative plural adds -n where the plural does not already end in -n or -s
    kinds: frozenset[str]


def _nouns(kind: str, rows: str) -> list[Noun]:
    out = []
    for row in rows.strip().splitlines():
        en, en_pl, gender, de, de_pl, de_dat_pl = row.split()
        out.append(Noun(en, en_pl, gender, de, de_pl, de_dat_pl, frozenset(kind.split("+"))))
    return out


NOUNS: list[Noun] = [
    *_nouns(
        "animate",
        """
        man men m Mann Männer Männern
        woman women f Frau Frauen Frauen
        child children n Kind Kinder Kindern
        dog dogs m Hund Hunde Hunden
        cat cats f Katze Katzen Katzen
        girl girls n Mädchen Mädchen Mädchen
        teacher teachers m Lehrer Lehrer Lehrern
        friend friends m Freund Freunde Freunden
        bird birds m Vogel Vögel Vögeln
        horse horses n Pferd Pferde Pferden
        doctor doctors m Arzt Ärzte Ärzten
        """,
    ),
    *_nouns(
        "thing",
        """
        ball balls m Ball Bälle Bällen
        bag bags f Tasche Taschen Taschen
        chair chairs m Stuhl Stühle Stühlen
        key keys m Schlüssel Schlüssel Schlüsseln
        cup cups f Tasse Tassen Tassen
        picture pictures n Bild Bilder Bildern
        flower flowers f Blume Blumen Blumen
        bicycle bicycles n Fahrrad Fahrräder Fahrrädern
        hat hats m Hut Hüte Hüten
        """,
    ),
    *_nouns(
        "thing+readable",
        """
        book books n Buch Bücher Büchern
        letter letters m Brief Briefe Briefen
        newspaper newspapers f Zeitung Zeitungen Zeitungen
        map maps f Karte Karten Karten
        """,
    ),
    *_nouns(
        "thing+food",
        """
        apple apples m Apfel Äpfel Äpfeln
        cake cakes m Kuchen Kuchen Kuchen
        bread breads n Brot Brote Broten
        egg eggs n Ei Eier Eiern
        soup soups f Suppe Suppen Suppen
        banana bananas f Banane Bananen Bananen
        """,
    ),
    *_nouns(
        "place",
        """
        garden gardens m Garten Gärten Gärten
        city cities f Stadt Städte Städten
        park parks m Park Parks Parks
        kitchen kitchens f Küche Küchen Küchen
        school schools f Schule Schulen Schulen
        """,
    ),
    *_nouns(
        "place+landmark",
        """
        house houses n Haus Häuser Häusern
        street streets f Straße Straßen Straßen
        """,
    ),
    *_nouns(
        "landmark",
        """
        table tables m Tisch Tische Tischen
        tree trees m Baum Bäume Bäumen
        window windows n Fenster Fenster Fenstern
        door doors f Tür Türen Türen
        bridge bridges f Brücke Brücken Brücken
        wall walls f Wand Wände Wänden
        car cars n Auto Autos Autos
        """,
    ),
]


@dataclass(frozen=True)
class Adjective:
    en: str
    de: str  # predicative form: "der Hund ist müde"
    stem: str  # attributive stem: "der müde Hund", "ein müder Hund"


ADJECTIVES = [
    Adjective(en, de, stem)
    for en, de, stem in (
        ("big", "groß", "groß"),
        ("small", "klein", "klein"),
        ("old", "alt", "alt"),
        ("young", "jung", "jung"),
        ("red", "rot", "rot"),
        ("new", "neu", "neu"),
        ("beautiful", "schön", "schön"),
        ("tired", "müde", "müd"),
        ("happy", "glücklich", "glücklich"),
        ("black", "schwarz", "schwarz"),
        ("white", "weiß", "weiß"),
        ("green", "grün", "grün"),
        ("loud", "laut", "laut"),
        ("quiet", "leise", "leis"),
    )
]

# Persons: 1sg, 2sg, 3sg, 1pl, 3pl.
PERSONS = ("1sg", "2sg", "3sg", "1pl", "3pl")


@dataclass(frozen=True)
class Verb:
    en: str  # base form: "I see", "they see"
    en_3sg: str  # "he sees"
    de: tuple[str, ...]  # one form per person in PERSONS
    objects: frozenset[str] | None  # noun kinds it takes as direct object; None for intransitive verbs


def _verb(en: str, en_3sg: str, de: str, objects: str | None) -> Verb:
    forms = tuple(de.split())
    assert len(forms) == len(PERSONS), de
    return Verb(en, en_3sg, forms, frozenset(objects.split("+")) if objects else None)


TRANSITIVE = [
    _verb("see", "sees", "sehe siehst sieht sehen sehen", "animate+thing+place+landmark"),
    _verb("like", "likes", "mag magst mag mögen mögen", "animate+thing+place"),
    _verb("buy", "buys", "kaufe kaufst kauft kaufen kaufen", "thing"),
    _verb("read", "reads", "lese liest liest lesen lesen", "readable"),
    _verb("find", "finds", "finde findest findet finden finden", "animate+thing"),
    _verb("have", "has", "habe hast hat haben haben", "animate+thing"),
    _verb("eat", "eats", "esse isst isst essen essen", "food"),
    _verb("carry", "carries", "trage trägst trägt tragen tragen", "thing"),
    _verb("visit", "visits", "besuche besuchst besucht besuchen besuchen", "animate+place"),
    _verb("hold", "holds", "halte hältst hält halten halten", "thing"),
    _verb("write", "writes", "schreibe schreibst schreibt schreiben schreiben", "readable"),
    _verb("wash", "washes", "wasche wäschst wäscht waschen waschen", "animate+thing"),
    _verb("need", "needs", "brauche brauchst braucht brauchen brauchen", "animate+thing"),
    _verb("look for", "looks for", "suche suchst sucht suchen suchen", "animate+thing"),
    _verb("paint", "paints", "male malst malt malen malen", "animate+thing+place"),
]
INTRANSITIVE = [
    _verb("sleep", "sleeps", "schlafe schläfst schläft schlafen schlafen", None),
    _verb("play", "plays", "spiele spielst spielt spielen spielen", None),
    _verb("run", "runs", "laufe läufst läuft laufen laufen", None),
    _verb("wait", "waits", "warte wartest wartet warten warten", None),
    _verb("sing", "sings", "singe singst singt singen singen", None),
    _verb("work", "works", "arbeite arbeitest arbeitet arbeiten arbeiten", None),
]
BE = _verb("be", "is", "bin bist ist sind sind", None)
SAY = _verb("say", "says", "sage sagst sagt sagen sagen", None)
EN_BE = {"1sg": "am", "2sg": "are", "3sg": "is", "1pl": "are", "3pl": "are"}

PRONOUNS = {  # person -> (English, German)
    "1sg": [("I", "ich")],
    "2sg": [("you", "du")],
    "3sg": [("he", "er"), ("she", "sie")],
    "1pl": [("we", "wir")],
    "3pl": [("they", "sie")],
}

# Prepositions that take the dative for a location or company, with the noun kinds they go with.
PREPOSITIONS = [
    ("in", "in", frozenset({"place"})),
    ("with", "mit", frozenset({"animate", "thing"})),
    ("next to", "neben", frozenset({"landmark", "animate"})),
    ("behind", "hinter", frozenset({"landmark"})),
    ("under", "unter", frozenset({"landmark"})),
    ("on", "auf", frozenset({"landmark"})),
]
# "on" a vertical surface is "an" in German ("an der Wand"), "auf" only on top of something ("auf dem Tisch").
ON_THE_SIDE = frozenset({"Fenster", "Tür", "Wand"})
CONTRACTIONS = {("in", "dem"): "im", ("an", "dem"): "am", ("zu", "dem"): "zum", ("zu", "der"): "zur"}

ADVERBS = [("today", "heute"), ("often", "oft"), ("now", "jetzt"), ("sometimes", "manchmal"), ("usually", "meistens")]

# Clause connectives: (English, German, German comma before it, German verb-final subordinate clause).
CONNECTIVES = [
    ("and", "und", False, False),
    ("but", "aber", True, False),
    ("because", "weil", True, True),
    ("while", "während", True, True),
]

# ------------------------------------------------------------------------------------------ morphology

DETERMINERS = {  # German forms by case, then gender or plural
    "def": {
        "nom": {"m": "der", "f": "die", "n": "das", "pl": "die"},
        "acc": {"m": "den", "f": "die", "n": "das", "pl": "die"},
        "dat": {"m": "dem", "f": "der", "n": "dem", "pl": "den"},
    },
    "this": {
        "nom": {"m": "dieser", "f": "diese", "n": "dieses", "pl": "diese"},
        "acc": {"m": "diesen", "f": "diese", "n": "dieses", "pl": "diese"},
        "dat": {"m": "diesem", "f": "dieser", "n": "diesem", "pl": "diesen"},
    },
    "indef": {
        "nom": {"m": "ein", "f": "eine", "n": "ein"},
        "acc": {"m": "einen", "f": "eine", "n": "ein"},
        "dat": {"m": "einem", "f": "einer", "n": "einem"},
    },
    "my": {
        "nom": {"m": "mein", "f": "meine", "n": "mein", "pl": "meine"},
        "acc": {"m": "meinen", "f": "meine", "n": "mein", "pl": "meine"},
        "dat": {"m": "meinem", "f": "meiner", "n": "meinem", "pl": "meinen"},
    },
    "none": {},  # bare plural: "große Hunde"
}
EN_DETERMINERS = {"def": ("the", "the"), "this": ("this", "these"), "indef": ("a", None), "my": ("my", "my")}

ADJ_ENDINGS = {  # declension class -> case -> gender or plural
    "weak": {
        "nom": {"m": "e", "f": "e", "n": "e", "pl": "en"},
        "acc": {"m": "en", "f": "e", "n": "e", "pl": "en"},
        "dat": {"m": "en", "f": "en", "n": "en", "pl": "en"},
    },
    "mixed": {
        "nom": {"m": "er", "f": "e", "n": "es", "pl": "en"},
        "acc": {"m": "en", "f": "e", "n": "es", "pl": "en"},
        "dat": {"m": "en", "f": "en", "n": "en", "pl": "en"},
    },
    "strong": {
        "nom": {"m": "er", "f": "e", "n": "es", "pl": "e"},
        "acc": {"m": "en", "f": "e", "n": "es", "pl": "e"},
        "dat": {"m": "em", "f": "er", "n": "em", "pl": "en"},
    },
}


def declension(det: str, plural: bool) -> str:
    """Which adjective endings follow a determiner: der/dieser -> weak; ein/mein -> mixed (weak in the
    plural, where mein- behaves like der); no determiner -> strong."""
    if det in ("def", "this"):
        return "weak"
    if det in ("indef", "my"):
        return "weak" if plural else "mixed"
    return "strong"


@dataclass(frozen=True)
class NounPhrase:
    noun: Noun
    det: str  # a key of DETERMINERS
    plural: bool
    adjective: Adjective | None = None

    @property
    def person(self) -> str:
        return "3pl" if self.plural else "3sg"

    def en(self) -> str:
        noun = self.noun.en_pl if self.plural else self.noun.en
        words = [self.adjective.en, noun] if self.adjective else [noun]
        if self.det != "none":
            article = EN_DETERMINERS[self.det][1 if self.plural else 0]
            if article == "a" and words[0][0] in "aeiou":
                article = "an"
            words.insert(0, article)
        return " ".join(words)

    def de(self, case: str) -> list[str]:
        slot = "pl" if self.plural else self.noun.gender
        if self.plural:
            noun = self.noun.de_dat_pl if case == "dat" else self.noun.de_pl
        else:
            noun = self.noun.de
        words = [noun]
        if self.adjective:
            words.insert(0, self.adjective.stem + ADJ_ENDINGS[declension(self.det, self.plural)][case][slot])
        if self.det != "none":
            words.insert(0, DETERMINERS[self.det][case][slot])
        return words


@dataclass(frozen=True)
class Pronoun:
    en_form: str
    de_form: str
    person: str

    def en(self) -> str:
        return self.en_form

    def de(self, case: str) -> list[str]:
        assert case == "nom", "pronouns appear only as subjects"
        return [self.de_form]


@dataclass(frozen=True)
class Clause:
    """subject + verb (+ object | + predicate adjective) (+ prepositional phrase) (+ fronted adverb)."""

    subject: NounPhrase | Pronoun
    verb: Verb
    obj: NounPhrase | None = None
    predicate: Adjective | None = None  # with BE: "the dog is tired"
    pp: tuple[tuple[str, str], NounPhrase] | None = None  # ((English, German) preposition, dative NP)
    adverb: tuple[str, str] | None = None  # fronted in English and German: "Today ..." / "Heute sieht ..."

    def en(self) -> str:
        person = self.subject.person
        if self.verb is BE:
            verb = EN_BE[person]
        else:
            verb = self.verb.en_3sg if person == "3sg" else self.verb.en
        words = [self.subject.en(), verb]
        if self.obj is not None:
            words.append(self.obj.en())
        if self.predicate is not None:
            words.append(self.predicate.en)
        if self.pp is not None:
            words += [self.pp[0][0], self.pp[1].en()]
        if self.adverb is not None:
            words.insert(0, self.adverb[0])
        return " ".join(words)

    def de(self, verb_final: bool = False) -> str:
        verb = self.verb.de[PERSONS.index(self.subject.person)]
        subject = self.subject.de("nom")
        rest: list[str] = []
        if self.pp is not None:
            prep, np = self.pp[0][1], self.pp[1].de("dat")
            if (prep, np[0]) in CONTRACTIONS:
                rest += [CONTRACTIONS[prep, np[0]], *np[1:]]
            else:
                rest += [prep, *np]
        # German puts the accusative object before the place phrase less often than English; keep the
        # common "object, then place" order, and a predicate adjective at the end of the middle field.
        middle = (self.obj.de("acc") if self.obj is not None else []) + rest
        if self.predicate is not None:
            middle.append(self.predicate.de)
        if verb_final:  # subordinate clause: "weil der Mann den Hund sieht"
            words = subject + middle + [verb]
            if self.adverb is not None:
                words.insert(len(subject), self.adverb[1])
            return " ".join(words)
        if self.adverb is not None:  # verb second: "Heute sieht der Mann den Hund"
            return " ".join([self.adverb[1], verb, *subject, *middle])
        return " ".join([*subject, verb, *middle])


def capitalize(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


# --------------------------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class LengthDistribution:
    """How many clauses a sentence has: 1 + a geometric number (continue with ``continue_prob``) capped at
    ``max_clauses``; a ``long_fraction`` of sentences instead get between ``max_clauses + 1`` and
    ``long_clauses`` clauses, for memory experiments with long sentences."""

    continue_prob: float = 0.35
    max_clauses: int = 3
    long_fraction: float = 0.0
    long_clauses: int = 12
    adjective_prob: float = 0.35
    pp_prob: float = 0.4
    adverb_prob: float = 0.15

    def __post_init__(self):
        if not 0 <= self.continue_prob < 1:
            raise ValueError(f"data.continue_prob must be in [0, 1), got {self.continue_prob}")
        if self.max_clauses < 1:
            raise ValueError(f"data.max_clauses must be >= 1, got {self.max_clauses}")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"data.long_fraction must be in [0, 1], got {self.long_fraction}")
        if self.long_fraction > 0 and self.long_clauses <= self.max_clauses:
            raise ValueError(
                f"data.long_clauses ({self.long_clauses}) must exceed data.max_clauses ({self.max_clauses})"
            )


@functools.cache
def nouns_of(kinds: frozenset[str]) -> tuple[Noun, ...]:
    """The nouns of any of these kinds, in NOUNS' order: listed once per set of kinds, not at every noun phrase
    (a third of the corpus's generation time)."""
    return tuple(n for n in NOUNS if n.kinds & kinds)


class Grammar:
    def __init__(self, rng: random.Random, lengths: LengthDistribution):
        self.rng = rng
        self.lengths = lengths

    def noun_phrase(self, kinds: frozenset[str]) -> NounPhrase:
        r = self.rng
        noun = r.choice(nouns_of(kinds))
        plural = r.random() < 0.3
        det = r.choice(["def", "def", "this", "my", "none"] if plural else ["def", "def", "indef", "indef", "this", "my"])
        adjective = r.choice(ADJECTIVES) if r.random() < self.lengths.adjective_prob else None
        return NounPhrase(noun, det, plural, adjective)

    def subject(self) -> NounPhrase | Pronoun:
        if self.rng.random() < 0.3:
            person = self.rng.choice(PERSONS)
            en, de = self.rng.choice(PRONOUNS[person])
            return Pronoun(en, de, person)
        return self.noun_phrase(frozenset({"animate"}))

    def prepositional_phrase(self) -> tuple[tuple[str, str], NounPhrase]:
        en, de, kinds = self.rng.choice(PREPOSITIONS)
        np = self.noun_phrase(kinds)
        return (en, "an" if de == "auf" and np.noun.de in ON_THE_SIDE else de), np

    def clause(self, allow_adverb: bool) -> Clause:
        r, p = self.rng, self.lengths
        subject = self.subject()
        kind = r.random()
        obj = predicate = None
        if kind < 0.65:
            verb = r.choice(TRANSITIVE)
            obj = self.noun_phrase(verb.objects)
        elif kind < 0.85:
            verb = r.choice(INTRANSITIVE)
        else:
            verb, predicate = BE, r.choice(ADJECTIVES)
        pp = self.prepositional_phrase() if predicate is None and r.random() < p.pp_prob else None
        adverb = r.choice(ADVERBS) if allow_adverb and r.random() < p.adverb_prob else None
        return Clause(subject, verb, obj, predicate, pp, adverb)

    def num_clauses(self) -> int:
        r, p = self.rng, self.lengths
        if p.long_fraction and r.random() < p.long_fraction:
            return r.randint(p.max_clauses + 1, p.long_clauses)
        n = 1
        while n < p.max_clauses and r.random() < p.continue_prob:
            n += 1
        return n

    def sentence(self) -> tuple[str, str]:
        """One (English, German) pair."""
        r = self.rng
        en, de = [], []
        after_verb_final = False  # German closes a verb-final clause with a comma before a main clause goes on
        for i in range(self.num_clauses()):
            if i == 0:
                clause = self.clause(allow_adverb=True)
                en.append(clause.en())
                de.append(clause.de())
                continue
            c_en, c_de, comma, verb_final = r.choice(CONNECTIVES)
            if r.random() < 0.15:  # reported speech: "..., and he says that ...", with a verb-final clause
                c_en, c_de, comma, verb_final = "and", "und", False, False
                speaker = self.subject()
                said = Clause(speaker, SAY)
                inner = self.clause(allow_adverb=False)
                en.append(f"{c_en} {said.en()} that {inner.en()}")
                de.append(f"{', ' if after_verb_final else ''}{c_de} {said.de()}, dass {inner.de(verb_final=True)}")
                after_verb_final = True
                continue
            clause = self.clause(allow_adverb=not verb_final)
            en.append(f"{', ' if c_en == 'but' else ''}{c_en} {clause.en()}")
            de.append(f"{', ' if comma or after_verb_final else ''}{c_de} {clause.de(verb_final=verb_final)}")
            after_verb_final = verb_final
        return capitalize(join_clauses(en)) + ".", capitalize(join_clauses(de)) + "."


def join_clauses(parts: list[str]) -> str:
    out = parts[0]
    for part in parts[1:]:
        out += part if part.startswith(", ") else " " + part
    return out


# ------------------------------------------------------------------------------------------------ corpus


def generate_pairs(n: int, seed: int, lengths: LengthDistribution, exclude: set[str] | None = None) -> list[tuple[str, str]]:
    """``n`` distinct (English, German) pairs; English sentences in ``exclude`` are skipped, so held-out
    splits never repeat a training sentence."""
    grammar = Grammar(random.Random(seed), lengths)
    seen = set(exclude or ())
    pairs: list[tuple[str, str]] = []
    attempts = 0
    while len(pairs) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"could not generate {n} distinct sentences; lower the split size or allow longer ones")
        en, de = grammar.sentence()
        if en in seen:
            continue
        seen.add(en)
        pairs.append((en, de))
    return pairs


def generate_corpus(
    sizes: dict[str, int], seed: int, lengths: LengthDistribution
) -> dict[str, list[tuple[str, str]]]:
    """Splits (e.g. train/valid/test) of (English, German) pairs that share no sentence. The held-out splits are
    drawn first and train last, around them: valid and test stay the same whatever ``train_size`` (runs on more or
    less data are scored on the same sentences), and a larger train split begins with a smaller one's pairs. Each
    split draws from its own random stream, by its place in ``sizes``."""
    out: dict[str, list[tuple[str, str]]] = {}
    used: set[str] = set()
    offsets = {split: offset for offset, split in enumerate(sizes)}
    for split in sorted(sizes, key=lambda s: s == "train"):
        out[split] = generate_pairs(sizes[split], seed * 1000 + offsets[split], lengths, exclude=used)
        used.update(en for en, _ in out[split])
    return {split: out[split] for split in sizes}
