"""The built-in corpus: small synthetic data sets for each task, generated here from a seed.

    records = make_corpus(task="keyphrase", split="train", size=2000, seed=0)

It is the library's default data source: no network, no data files, and the same
(task, split, size, seed) always gives the same records. Text looks like KP20K's pre-tokenized
style: lowercase words separated by single spaces, punctuation as separate tokens (" .").

What is generated, and the rule that decides the targets:

- keyphrase: a paper about one of ten topics. Each topic owns a lexicon of ten technical terms
  (2-4 words that the generic research words of the templates never use). The title names the
  first term, the abstract introduces 1-4 more in template sentences. keyphrases = the terms in
  order of first appearance (present), then the topic's name (absent: never in the text) and,
  for some title terms, a fixed broader concept (absent too).
- qa: a context of 4-8 short sentences "<person> <relation> <value> ." (visited a city, bought
  an object, speaks a language, plays an instrument, met a person) and a question about one
  person and one relation. answers = the values of the matching sentences, in order; the other
  sentences are distractors about the same person or the same relation. Only answer sentences
  ever carry two values, a cue a model can use without binding values to the asked person
  (results/README.md#built-in-qa measures how much). `qa_question` and `qa_facts` read a
  record's question and sentences back.
- summarization: a local news story of 6-9 sentences about one city. 2-4 of them are key facts,
  recognisable by their opening ("officials in ... announced", "police in ... reported", ...);
  the rest is filler with no reporting verb. summary = one compressed sentence per key fact, in
  order, obtained from a fixed template per fact type (e.g. "officials in oslo announced on
  monday that the new bridge will open in may ." -> "new bridge in oslo will open in may .").

Why a tiny T5 trained from scratch for minutes can learn it: every target is decided by a
simple, local and consistent rule (copy the marked spans in order, fill a fixed template from
one sentence), the vocabulary is a few hundred words, and sources are 40-120 words.

Reproducibility: every record has its own `random.Random`, seeded from a SHA-256 of
(task, split, seed, index), so a larger size extends a smaller one (limits are prefixes). A
record belongs to the split picked by a CRC-32 of its source text (80/10/10); a draw landing in
another split's bucket is redrawn, so no source text is ever shared between splits.
"""
from __future__ import annotations

import hashlib
import random
import zlib
from dataclasses import dataclass
from itertools import count

from datamodules.schema import TASKS, schema_for

SPLITS = ("train", "validation", "test")
_SPLIT_BUCKETS = {"train": range(0, 8), "validation": range(8, 9), "test": range(9, 10)}


def make_corpus(task: str, split: str = "train", size: int = 2000, seed: int = 0) -> list[dict]:
    """`size` records of `task` for `split`, in the schema of datamodules.schema."""
    if task not in _GENERATORS:
        raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive integer (1, 2, ...), got {size!r}")
    return [_make_record(task, split, seed, index) for index in range(size)]


def _make_record(task: str, split: str, seed: int, index: int) -> dict:
    """Draw record `index` until its source text falls in `split`'s bucket."""
    source_text = schema_for(task).source_text
    for attempt in count():
        key = f"builtin/{task}/{split}/{seed}/{index}/{attempt}".encode()
        rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
        fields = _GENERATORS[task](rng)
        if zlib.crc32(source_text(fields).encode()) % 10 in _SPLIT_BUCKETS[split]:
            return {"id": f"builtin-{task}-{split}-{index:06d}", **fields}


def _fill(rng: random.Random, template: str, choices: dict[str, tuple[str, ...]],
          **fixed: str) -> str:
    """Format `template`, drawing each slot not given in `fixed` from `choices`."""
    slots = {name: rng.choice(options) for name, options in choices.items()}
    return template.format(**{**slots, **fixed})


# --------------------------------------------------------------------------------------------
# keyphrase: papers whose keyphrases are the topic terms they mention, plus absent topic labels
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Topic:
    name: str                # absent keyphrase; its words never occur in the text
    terms: tuple[str, ...]   # the topic's lexicon: no term is part of another


_TOPICS = (
    _Topic("computer vision", (
        "object detection", "image segmentation", "optical flow", "stereo matching",
        "depth estimation", "pose estimation", "image captioning", "visual tracking",
        "edge detection", "face recognition")),
    _Topic("wireless networks", (
        "channel allocation", "power control", "beam forming", "spectrum sensing",
        "mobile handover", "interference cancellation", "cellular coverage", "mesh routing",
        "antenna selection", "link scheduling")),
    _Topic("cryptography", (
        "asymmetric encryption", "digital signatures", "hash functions", "key exchange",
        "block ciphers", "lattice cryptanalysis", "zero knowledge proofs", "secret sharing",
        "homomorphic encryption", "password hashing")),
    _Topic("databases", (
        "query optimization", "index structures", "transaction processing", "join algorithms",
        "lock management", "column stores", "crash recovery", "schema evolution",
        "materialized views", "query rewriting")),
    _Topic("computational linguistics", (
        "dependency parsing", "pos tagging", "word embeddings", "machine translation",
        "named entity recognition", "sentiment classification", "coreference resolution",
        "word sense disambiguation", "text summarization", "semantic role labeling")),
    _Topic("robotics", (
        "motion planning", "inverse kinematics", "legged locomotion", "robot grasping",
        "visual servoing", "trajectory generation", "robot localization", "sensor fusion",
        "force control", "swarm coordination")),
    _Topic("software engineering", (
        "program repair", "static analysis", "test generation", "code review",
        "regression testing", "symbolic execution", "bug prediction", "code smells",
        "mutation testing", "program synthesis")),
    _Topic("bioinformatics", (
        "protein folding", "gene expression", "genome assembly", "sequence alignment",
        "phylogenetic inference", "variant calling", "rna structure", "cell clustering",
        "drug discovery", "metabolic pathways")),
    _Topic("operating systems", (
        "virtual memory", "page replacement", "kernel modules", "file caching",
        "device drivers", "cpu scheduling", "live migration", "spin locks",
        "garbage collection", "interrupt handling")),
    _Topic("information retrieval", (
        "pseudo relevance feedback", "document ranking", "inverted indexes", "click models",
        "web crawling", "passage reranking", "snippet extraction", "session modeling",
        "query suggestion", "duplicate detection")),
)

# A second absent keyphrase for some title terms: a broader concept the text never names.
_RELATED = {
    "object detection": "scene understanding", "face recognition": "biometrics",
    "mesh routing": "multihop networking", "interference cancellation": "signal processing",
    "asymmetric encryption": "confidentiality", "key exchange": "secure communication",
    "query optimization": "cost models", "crash recovery": "fault tolerance",
    "dependency parsing": "syntactic analysis", "word embeddings": "distributional semantics",
    "motion planning": "autonomous agents", "robot grasping": "dexterous manipulation",
    "program repair": "software maintenance", "program synthesis": "formal methods",
    "protein folding": "structural biology", "gene expression": "functional genomics",
    "live migration": "cloud computing", "spin locks": "concurrency",
    "document ranking": "search engines", "web crawling": "web mining",
}

# Research filler. No word here or in the templates below is a term word, so in a text every
# term is a maximal run of term words.
_PAPER_WORDS = {
    "adj": ("novel", "simple", "robust", "scalable", "practical", "lightweight", "unified",
            "principled", "fast", "general", "flexible", "modular", "reliable", "compact"),
    "data": ("several benchmarks", "real world data", "synthetic data", "public datasets",
             "three datasets", "large scale data", "standard benchmarks"),
    "metric": ("accuracy", "efficiency", "robustness", "runtime", "precision", "recall",
               "throughput", "latency", "quality"),
    "setting": ("the presence of noise", "low resource settings", "dynamic environments",
                "distributed settings", "the online setting", "adversarial conditions",
                "practical deployments"),
    "weakness": ("slow", "brittle", "expensive", "inaccurate", "hard to tune", "limited"),
    "property": ("stability", "complexity", "limitations", "behaviour", "convergence",
                 "sensitivity"),
}

_TITLES = (
    "a {adj} approach to {term}",
    "towards {adj} {term}",
    "{term} in {setting}",
    "on the {property} of {term}",
    "a {adj} framework for {term}",
    "revisiting {term} with {adj} methods",
)

# Sentences that introduce one term; the first abstract sentence restates the title's term.
_TERM_SENTENCES = (
    "in this paper we study {term} in {setting} .",
    "we propose a {adj} method for {term} .",
    "existing approaches to {term} are {weakness} .",
    "we also address {term} with a {adj} model .",
    "the main idea is to cast {term} as a {adj} problem .",
    "our method relies on {term} to improve {metric} .",
    "experiments on {data} show that {term} improves {metric} .",
    "we further analyze the {property} of {term} .",
)
_PAIR_SENTENCE = "our framework combines {term} with {term2} ."
_FILLER_SENTENCES = (
    "results confirm the {property} of the proposed method .",
    "the method outperforms strong baselines in {metric} .",
    "we discuss limitations and future work .",
    "our implementation is publicly available .",
)


def _keyphrase_record(rng: random.Random) -> dict:
    topic = rng.choice(_TOPICS)
    terms = rng.sample(topic.terms, rng.randint(2, 5))
    title = _fill(rng, rng.choice(_TITLES), _PAPER_WORDS, term=terms[0])

    # The abstract mentions the terms in order: the title's term first, then each new term
    # alone or, now and then, two in one sentence; a repeated mention may follow, and filler
    # sentences (no terms) go anywhere after the first.
    sentences = [_fill(rng, rng.choice(_TERM_SENTENCES), _PAPER_WORDS, term=terms[0])]
    rest = terms[1:]
    while rest:
        if len(rest) >= 2 and rng.random() < 0.3:
            sentences.append(_PAIR_SENTENCE.format(term=rest[0], term2=rest[1]))
            rest = rest[2:]
        else:
            sentences.append(_fill(rng, rng.choice(_TERM_SENTENCES), _PAPER_WORDS, term=rest[0]))
            rest = rest[1:]
    if rng.random() < 0.4:
        again = rng.choice(terms)
        sentences.append(_fill(rng, rng.choice(_TERM_SENTENCES), _PAPER_WORDS, term=again))
    while len(sentences) < 4 or rng.random() < 0.4:
        filler = _fill(rng, rng.choice(_FILLER_SENTENCES), _PAPER_WORDS)
        sentences.insert(rng.randint(1, len(sentences)), filler)

    absent = [topic.name] + ([_RELATED[terms[0]]] if terms[0] in _RELATED else [])
    return {"title": title, "abstract": " ".join(sentences), "keyphrases": terms + absent}


# --------------------------------------------------------------------------------------------
# qa: who did what; the answers are every value of the asked relation for the asked person
# --------------------------------------------------------------------------------------------

_PEOPLE = ("anna", "ben", "carlos", "diana", "elena", "farid", "grace", "hugo", "irene", "jonas",
           "kenji", "laura", "mateo", "nadia", "oscar", "priya", "quentin", "rosa", "samir",
           "tessa", "umar", "vera", "walter", "ximena", "yusuf", "zoe", "lucas", "mira",
           "tomas", "helga")
_CITIES = ("paris", "rome", "berlin", "madrid", "lisbon", "vienna", "prague", "oslo", "dublin",
           "athens", "cairo", "lagos", "nairobi", "tokyo", "seoul", "delhi", "lima", "quito",
           "toronto", "chicago", "boston", "sydney", "new york", "buenos aires", "cape town",
           "hong kong", "mexico city", "san diego", "rio de janeiro", "kyoto")
_COLOURS = ("red", "blue", "green", "black", "white", "small", "large", "wooden", "leather",
            "silver", "brown", "yellow")
_THINGS = ("bicycle", "lamp", "chair", "jacket", "camera", "watch", "backpack", "umbrella",
           "kettle", "mirror", "table", "notebook", "scarf", "helmet", "clock")
_OBJECTS = tuple(f"{colour} {thing}" for colour in _COLOURS for thing in _THINGS)
_LANGUAGES = ("french", "german", "spanish", "italian", "japanese", "korean", "arabic", "hindi",
              "russian", "portuguese", "dutch", "greek", "turkish", "swahili", "polish")
_INSTRUMENTS = ("piano", "violin", "guitar", "cello", "flute", "drums", "trumpet", "harp",
                "clarinet", "saxophone", "banjo", "accordion")
_WHEN = {"month": ("january", "march", "may", "july", "september", "november"),
         "day": ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")}


@dataclass(frozen=True)
class _Relation:
    question: str               # about {person}
    values: tuple[str, ...]     # what can fill {x}
    sentences: tuple[str, ...]  # one value {x}; the verb always follows {person} directly
    pair: str                   # two values {x} and {y} in one sentence


_RELATIONS = (
    _Relation("which cities did {person} visit ?", _CITIES,
              ("{person} visited {x} .", "in {month} , {person} visited {x} .",
               "{person} visited {x} with a friend ."),
              "{person} visited {x} and {y} ."),
    _Relation("what did {person} buy ?", _OBJECTS,
              ("{person} bought a {x} .", "{person} bought a {x} at the market .",
               "on {day} , {person} bought a {x} ."),
              "{person} bought a {x} and a {y} ."),
    _Relation("which languages does {person} speak ?", _LANGUAGES,
              ("{person} speaks {x} .", "{person} speaks {x} at work .",
               "since {month} , {person} speaks {x} ."),
              "{person} speaks {x} and {y} ."),
    _Relation("which instruments does {person} play ?", _INSTRUMENTS,
              ("{person} plays the {x} .", "{person} plays the {x} in a band .",
               "on {day} , {person} plays the {x} ."),
              "{person} plays the {x} and the {y} ."),
    _Relation("who did {person} meet ?", _PEOPLE,
              ("{person} met {x} .", "{person} met {x} at a conference .",
               "on {day} , {person} met {x} ."),
              "{person} met {x} and {y} ."),
)


def _relation_sentence(rng: random.Random, relation: _Relation, person: str,
                       values: list[str]) -> str:
    if len(values) == 2:
        return relation.pair.format(person=person, x=values[0], y=values[1])
    return _fill(rng, rng.choice(relation.sentences), _WHEN, person=person, x=values[0])


def _value(rng: random.Random, relation: _Relation, person: str) -> str:
    """A value of `relation` for `person` (nobody meets themself)."""
    return rng.choice([v for v in relation.values if v != person])


def _qa_record(rng: random.Random) -> dict:
    person = rng.choice(_PEOPLE)
    relation = rng.choice(_RELATIONS)
    answers = rng.sample([v for v in relation.values if v != person], rng.randint(2, 5))

    # Answer sentences carry one value or, sometimes, two.
    groups: list[list[str]] = []
    rest = answers
    while rest:
        take = 2 if len(rest) >= 2 and rng.random() < 0.3 else 1
        groups.append(rest[:take])
        rest = rest[take:]

    # Distractors: the same person under another relation, and another person under the same
    # relation (one of each at least), up to 4-8 sentences in all.
    others = [r for r in _RELATIONS if r is not relation]
    n_distractors = rng.randint(max(2, 4 - len(groups)), 8 - len(groups))
    plan = [(relation, person, group) for group in groups]
    for i in range(n_distractors):
        if i == 0 or (i > 1 and rng.random() < 0.5):
            other = rng.choice(others)
            plan.append((other, person, [_value(rng, other, person)]))
        else:
            stranger = rng.choice([p for p in _PEOPLE if p != person])
            plan.append((relation, stranger, [_value(rng, relation, stranger)]))
    rng.shuffle(plan)

    context = " ".join(_relation_sentence(rng, r, p, vs) for r, p, vs in plan)
    in_order = [v for r, p, vs in plan if r is relation and p == person for v in vs]
    return {"question": relation.question.format(person=person), "context": context,
            "answers": in_order}


@dataclass(frozen=True)
class QAFact:
    """One sentence of a built-in QA context, read back: its person, its relation (the index of
    the relation in the corpus, the question's when they are the same) and its values, in order."""

    person: str
    relation: int
    values: tuple[str, ...]


def _verb(relation: _Relation) -> str:
    return relation.sentences[0].split()[1]    # "{person} visited {x} .": the verb follows the person


_RELATION_OF_VERB = {_verb(relation): index for index, relation in enumerate(_RELATIONS)}


def qa_question(question: str) -> tuple[str, int]:
    """The person and the relation (its index) a built-in QA question asks about."""
    words = question.split()
    for index, relation in enumerate(_RELATIONS):
        template = relation.question.split()
        if len(template) == len(words) and all(t == w for t, w in zip(template, words)
                                               if t != "{person}"):
            return words[template.index("{person}")], index
    raise ValueError(f"not a built-in QA question: {question!r}")


def qa_facts(context: str) -> list[QAFact]:
    """The sentences of a built-in QA context, in order, each read back as a `QAFact`."""
    facts = []
    for sentence in context.removesuffix(" .").split(" . "):
        words = sentence.split()
        at = next(i for i, word in enumerate(words) if word in _RELATION_OF_VERB)
        relation = _RELATION_OF_VERB[words[at]]
        rest = f" {' '.join(words[at + 1:])} "
        found = sorted((rest.index(f" {value} "), value) for value in _RELATIONS[relation].values
                       if f" {value} " in rest)
        facts.append(QAFact(words[at - 1], relation, tuple(value for _, value in found)))
    return facts


# --------------------------------------------------------------------------------------------
# summarization: local news; the summary compresses each key fact with a fixed template
# --------------------------------------------------------------------------------------------

_NEWS_WORDS = {
    **_WHEN,
    "facility": ("bridge", "library", "hospital", "stadium", "museum", "school", "park",
                 "station", "theatre", "airport"),
    "number": ("ten", "twenty", "fifty", "eighty", "hundreds of", "thousands of"),
    "jobs": ("jobs", "homes", "classrooms", "parking spaces", "bus stops", "hospital beds"),
    "colour": _COLOURS[:6],
    "vehicle": ("car", "truck", "van", "motorbike", "bus", "tractor"),
    "place": ("harbour", "central square", "old market", "train station", "city hall",
              "river bank"),
    "company": ("northwind", "bluepeak", "redstone", "greenfield", "silverline", "oakridge",
                "brightwave", "ironclad"),
    "action": ("open a factory", "cut prices", "hire engineers", "close two stores",
               "build a warehouse", "raise wages", "move its headquarters"),
    "policy": ("ban cars downtown", "build a new park", "extend the tram line",
               "raise the parking fee", "plant more trees", "keep the pool open"),
    "discovery": ("beetle", "fossil", "moth", "orchid", "mineral", "frog"),
    "weather": ("sunny", "rainy", "cold", "windy", "warm", "foggy"),
    "event": ("concert", "street festival", "food fair", "marathon", "book fair", "parade"),
    "daypart": ("morning", "afternoon", "evening", "weekend"),
}

# (key fact, its summary sentence). Each key fact opens with "<who> in/of/for X <reporting verb>".
_KEY_FACTS = (
    ("officials in {city} announced on {day} that the new {facility} will open in {month} .",
     "new {facility} in {city} will open in {month} ."),
    ("the mayor of {city} said on {day} that {number} new {jobs} will be created .",
     "{number} new {jobs} will be created in {city} ."),
    ("police in {city} reported on {day} that a {colour} {vehicle} was stolen near the {place} .",
     "{colour} {vehicle} stolen near the {place} in {city} ."),
    ("a spokesperson for {company} confirmed on {day} that the company will {action} in {month} .",
     "{company} will {action} in {month} ."),
    ("residents of {city} voted on {day} to {policy} .",
     "{city} residents voted to {policy} ."),
    ("scientists in {city} announced on {day} that they found a new species of {discovery} .",
     "new species of {discovery} found in {city} ."),
)
# Filler: no reporting verb, so it never enters the summary.
_NEWS_FILLER = (
    "the weather in {city} was {weather} for most of the week .",
    "many families spent the {daypart} at the {place} .",
    "local shops stayed open late on {day} .",
    "traffic near the {place} was heavy in the {daypart} .",
    "a small {event} took place near the {facility} .",
    "visitors enjoyed the {event} despite the {weather} sky .",
    "the {facility} was busy all {daypart} .",
    "tickets for the {event} sold out within hours .",
)


def _summarization_record(rng: random.Random) -> dict:
    city = rng.choice(_CITIES)
    n_facts = rng.randint(2, 4)
    n_filler = rng.randint(max(2, 6 - n_facts), 9 - n_facts)

    # Distinct fact types give distinct summary sentences; each sentence draws its own slots.
    plan = rng.sample(_KEY_FACTS, n_facts) + [(t, None) for t in rng.sample(_NEWS_FILLER, n_filler)]
    rng.shuffle(plan)

    sentences, summary = [], []
    for template, summary_template in plan:
        slots = {name: rng.choice(options) for name, options in _NEWS_WORDS.items()}
        sentences.append(template.format(city=city, **slots))
        if summary_template:
            summary.append(summary_template.format(city=city, **slots))
    return {"document": " ".join(sentences), "summary": summary}


_GENERATORS = {
    "keyphrase": _keyphrase_record,
    "qa": _qa_record,
    "summarization": _summarization_record,
}
