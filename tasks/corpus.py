"""The ``lm`` task's text: a generated corpus, its character tokenizer and its windows.

The corpus. No file is downloaded or shipped: the text is **generated** here, deterministically
from ``data_seed``, by small seeded template grammars, one per *source*, each with a style and a
vocabulary of its own (see :data:`SOURCES`): weather reports, recipes, sports results, railway
announcements and timetables, shop inventories, short fables, service log lines and letters.
Names, places, numbers, word choices and sentence orders vary from document to document, so a
model has something to learn and its perplexity falls as it trains. The generated text, like
the grammars, is part of Murmura and under the project's own licence, Apache-2.0. By default
there are 40,000 characters per source (320 KB in all), produced in a fraction of a second;
the same seed gives the same text on every machine (``random.Random`` with explicit integer
seeds, no ``hash()``-dependent order).

Tokens and examples. A character-level :class:`CharTokenizer` is fitted on the training text
(its vocabulary: an unknown id, 0, then the sorted set of the training characters). Each
source's token stream is split into a training head and a held-out tail (``test_fraction``,
10%, of every source), and each part is cut into non-overlapping windows of ``context`` (64)
tokens: ``x = tokens[i:i+T]`` and ``y = tokens[i+1:i+T+1]``. They are stored in an
:class:`~murmura.tasks.ArrayDataset` as ``x`` float32 token ids of shape ``(N, T)`` (exact:
ids are far below 2**24; the model casts them back to integers) and ``y`` int64 ``(N, T)``.
Every window remembers its source, and the task's partition (any of the usual schemes) is
drawn over the windows' **source ids**, not their tokens: the default ``dirichlet`` scheme
gives each client a Dirichlet(alpha) mix of sources, so clients hold different styles of text
(non-IID); ``shards`` gives each client one or two sources, ``iid`` mixes everything.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from murmura.tasks.data import ArrayDataset

#: Characters of generated text per source by default (eight sources: 320 KB).
CHARS_PER_SOURCE = 40_000
#: Tokens per example window by default.
CONTEXT = 64
#: Share of every source's text held out for evaluation.
TEST_FRACTION = 0.1

# -- the corpus ---------------------------------------------------------------------------------

_FIRST = ("Anna", "Ben", "Clara", "David", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas",
          "Kira", "Leo", "Maya", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sami", "Tara",
          "Umar", "Vera", "Wim", "Yara", "Zoe")
_LAST = ("Abbott", "Brandt", "Castillo", "Dubois", "Eriksen", "Fischer", "Garcia", "Holm",
         "Ivanova", "Jansen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov",
         "Quist", "Rossi", "Silva", "Tanaka", "Ulrich", "Varga", "Weber", "Young")
_TOWNS = ("Ashford", "Bramley", "Carrow", "Dunmere", "Elmstead", "Fenwick", "Glenholt",
          "Harrowgate", "Ivybridge", "Kelso", "Larkhill", "Millbrook", "Northam", "Oakridge",
          "Penrith", "Queensferry", "Redcliffe", "Stanwick", "Thornbury", "Upwell", "Westmoor")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")


def _weather(r: random.Random) -> str:
    town, day = r.choice(_TOWNS), r.choice(_DAYS)
    lo = r.randint(-8, 18)
    hi = lo + r.randint(2, 12)
    sky = r.choice(("clear skies", "scattered clouds", "low cloud", "light rain", "heavy showers",
                    "patchy fog", "bright sunshine", "sleet", "thunderstorms", "drizzle"))
    later = r.choice(("clearing from the west", "turning wetter", "with sunny spells",
                      "becoming windy", "staying dry", "with a risk of hail",
                      "brightening later"))
    wind = r.choice(("north", "north-east", "east", "south-east", "south", "south-west",
                     "west", "north-west"))
    speed = r.randint(5, 60)
    parts = [f"{r.choice(('Morning', 'Early', 'Overnight'))} {sky}, {later}.",
             f"Temperatures between {lo} and {hi} degrees.",
             f"Wind {wind} at {speed} km/h"
             + (f", gusting {speed + r.randint(10, 40)} km/h." if r.random() < 0.4 else "."),
             f"Humidity {r.randint(35, 99)} percent, pressure {r.randint(985, 1035)} hPa."]
    r.shuffle(parts)
    outlook = r.choice(("Outlook: settled.", "Outlook: unsettled, with rain at times.",
                        "Outlook: colder, frost likely.", "Outlook: milder and brighter.",
                        "Outlook: a warning for strong winds is in force."))
    return (f"WEATHER FOR {town.upper()}, {day} {r.randint(1, 28)} {r.choice(_MONTHS)}.\n"
            + " ".join(parts) + f" {outlook}\n\n")


_DISHES = ("soup", "stew", "pie", "salad", "risotto", "curry", "tart", "bread", "pancakes",
           "omelette", "pasta bake", "gratin")
_DISH_ADJ = ("Spiced", "Creamy", "Rustic", "Smoky", "Lemon", "Garlic", "Herbed", "Sweet",
             "Roasted", "Golden")
_INGREDIENTS = ("onions", "carrots", "potatoes", "lentils", "rice", "flour", "butter", "eggs",
                "milk", "tomatoes", "spinach", "mushrooms", "leeks", "cheese", "garlic",
                "chickpeas", "apples", "sugar", "olive oil", "stock", "peppers", "beans")
_UNITS = ("g", "ml", "tbsp", "tsp", "cups", "pinches")
_VERBS = ("Chop", "Slice", "Fry", "Simmer", "Whisk", "Stir", "Bake", "Roast", "Fold", "Season",
          "Boil", "Grate")
_MANNER = ("gently", "until soft", "for ten minutes", "over a low heat", "until golden",
           "with a pinch of salt", "in a large pan", "until thick", "briskly",
           "for twenty minutes")


def _recipe(r: random.Random) -> str:
    dish = f"{r.choice(_DISH_ADJ)} {r.choice(_INGREDIENTS)} {r.choice(_DISHES)}"
    items = r.sample(_INGREDIENTS, r.randint(3, 6))
    lines = [f"RECIPE: {dish}", f"Serves {r.randint(2, 8)}. Ready in {r.randint(2, 18) * 5} "
             f"minutes.", "Ingredients:"]
    for item in items:
        unit = r.choice(_UNITS)
        amount = r.randint(1, 10) * (50 if unit in ("g", "ml") else 1)
        lines.append(f"- {amount} {unit} {item}")
    lines.append("Method:")
    for k, item in enumerate(r.sample(items, len(items)), 1):
        lines.append(f"{k}. {r.choice(_VERBS)} the {item} {r.choice(_MANNER)}.")
    lines.append(r.choice(("Serve warm.", "Serve at once.", "Keeps for two days.",
                           "Garnish and serve.", "Best eaten cold.")))
    return "\n".join(lines) + "\n\n"


_TEAMS = ("Ashford Rovers", "Bramley United", "Carrow City", "Dunmere Athletic", "Elmstead Town",
          "Fenwick Wanderers", "Glenholt Rangers", "Kelso Harriers", "Larkhill Albion",
          "Northam Vale", "Oakridge Celtic", "Penrith Forest")
_LEAGUES = ("Premier Division", "First Division", "County Cup", "Northern League")


def _sports(r: random.Random) -> str:
    league = r.choice(_LEAGUES)
    lines = [f"{league.upper()}, ROUND {r.randint(1, 38)}"]
    for _ in range(r.randint(2, 5)):
        home, away = r.sample(_TEAMS, 2)
        a, b = r.choices((0, 0, 1, 1, 1, 2, 2, 3, 4), k=2)
        line = f"{home} {a} - {b} {away}"
        if a + b:
            scorer = f"{r.choice(_FIRST)} {r.choice(_LAST)}"
            line += f" ({scorer} {r.randint(1, 90)}')"
        line += f". Attendance {r.randint(2, 45)},{r.randint(0, 999):03d}."
        lines.append(line)
    team = r.choice(_TEAMS)
    place = r.choice(("first", "second", "third", "fourth", "fifth", "tenth", "last"))
    lines.append(r.choice((f"{team} move up to {place} place.",
                           f"{team} stay {place} after the draw.",
                           f"{team} drop to {place} in the table.")))
    return "\n".join(lines) + "\n\n"


_OPERATORS = ("Northern Rail", "Coastline", "Midland Express", "Valley Lines")


def _clock(r: random.Random) -> tuple[int, int]:
    return r.randint(5, 22), r.choice(range(0, 60, 3))


def _trains(r: random.Random) -> str:
    if r.random() < 0.5:
        h, m = _clock(r)
        stops = r.sample(_TOWNS, r.randint(2, 5))
        dest = stops.pop()
        calling = ", ".join(stops[:-1]) + (" and " if len(stops) > 1 else "") + stops[-1]
        status = r.choice(("This train is on time.",
                           f"This train is delayed by about {r.randint(2, 45)} minutes.",
                           "This train has been cancelled. We apologise for the disruption.",
                           f"This train will now depart from platform {r.randint(1, 12)}."))
        extra = r.choice(("Please stand clear of the doors.", "Mind the gap.",
                          "First class is at the front of the train.",
                          f"This train has {r.randint(3, 12)} coaches.", ""))
        text = (f"Platform {r.randint(1, 12)}: the {h:02d}:{m:02d} {r.choice(_OPERATORS)} "
                f"service to {dest}, calling at {calling}. {status} {extra}").rstrip()
        return text + "\n\n"
    route = r.sample(_TOWNS, r.randint(3, 6))
    h, m = _clock(r)
    lines = [f"TIMETABLE {route[0].upper()} - {route[-1].upper()} ({r.choice(_OPERATORS)})"]
    for k, town in enumerate(route):
        lines.append(f"{h:02d}:{m:02d} {town} {'dep' if k < len(route) - 1 else 'arr'}")
        m += r.randint(4, 25)
        h, m = (h + m // 60) % 24, m % 60
    return "\n".join(lines) + "\n\n"


_GOODS = ("hammer", "screwdriver", "paint roller", "light bulb", "extension lead", "garden hose",
          "padlock", "tape measure", "wood glue", "sandpaper", "door hinge", "kettle", "teapot",
          "notebook", "pencil case", "umbrella", "torch", "batteries (4 pack)", "wool socks")


def _shop(r: random.Random) -> str:
    name = f"{r.choice(_LAST)} & {r.choice(('Sons', 'Daughters', 'Partners', 'Co'))}"
    lines = [f"INVENTORY {name.upper()} #{r.randint(100, 999)}"]
    total = 0
    for item in r.sample(_GOODS, r.randint(3, 7)):
        qty = r.randint(0, 120)
        total += qty
        code = f"{r.choice('ABCDEFGHK')}{r.choice('LMNPRST')}-{r.randint(1000, 9999)}"
        lines.append(f"SKU {code} | {item} | qty {qty} | {r.randint(1, 80)}.{r.randint(0, 99):02d}"
                     " EUR" + (" | reorder" if qty < 10 else ""))
    lines.append(f"TOTAL UNITS {total}")
    return "\n".join(lines) + "\n\n"


_ANIMALS = ("fox", "hare", "crow", "tortoise", "lion", "mouse", "owl", "goat", "wolf", "heron",
            "badger", "ant")
_ANIMAL_ADJ = ("clever", "proud", "lazy", "patient", "greedy", "kind", "boastful", "humble",
               "hungry", "wise")
_MORALS = ("slow and steady wins the race", "pride comes before a fall",
           "a friend in need is a friend indeed", "greed loses all it has",
           "kindness is never wasted", "look before you leap",
           "it is better to be content than to envy others")


def _fable(r: random.Random) -> str:
    a, b = r.sample(_ANIMALS, 2)
    adj_a, adj_b = r.sample(_ANIMAL_ADJ, 2)
    where = r.choice(("in a deep forest", "by a quiet river", "on a windy hill",
                      "at the edge of a field", "among the old stones of a ruined barn"))
    when = r.choice(("morning", "evening", "winter day", "summer afternoon", "stormy night"))
    want = r.choice(("a basket of ripe figs", "a warm place to sleep", "the last of the grain",
                     "a shiny pebble", "the respect of the others"))
    middle = [f"The {b} asked the {a} to share {want}.",
              f"The {a} laughed and said that no {b} would ever have {want}.",
              f"The {b} said nothing and went on its way."]
    if r.random() < 0.5:
        middle[1], middle[2] = middle[2], middle[1]
    return (f"Once upon a time, a {adj_a} {a} lived {where}. One {when}, the {a} met a {adj_b} "
            f"{b}. " + " ".join(middle) + f" Before long the {a} saw its mistake. And so the "
            f"{a} learned that {r.choice(_MORALS)}.\n\n")


_SERVICES = ("auth", "billing", "gateway", "scheduler", "storage", "search", "mailer")


def _logs(r: random.Random) -> str:
    lines = []
    month, day = r.randint(1, 12), r.randint(1, 28)
    h, m, s = r.randint(0, 23), r.randint(0, 59), r.randint(0, 59)
    for _ in range(r.randint(3, 8)):
        s += r.randint(0, 40)
        m, s = m + s // 60, s % 60
        h, m = (h + m // 60) % 24, m % 60
        service = r.choice(_SERVICES)
        level = r.choices(("INFO", "DEBUG", "WARN", "ERROR"), weights=(6, 3, 2, 1))[0]
        msg = {
            "INFO": r.choice((f"request GET /api/v{r.randint(1, 3)}/items/{r.randint(1, 9999)} "
                              f"200 in {r.randint(1, 900)} ms",
                              f"user {r.randint(1000, 99999)} logged in",
                              f"job {r.randint(1, 500)} finished, {r.randint(0, 5000)} rows")),
            "DEBUG": r.choice((f"cache hit ratio {r.randint(40, 99)}%",
                               f"pool size {r.randint(1, 64)}, idle {r.randint(0, 16)}")),
            "WARN": r.choice((f"slow query took {r.randint(1, 30)} s",
                              f"retrying connection to port {r.randint(1024, 65535)}")),
            "ERROR": r.choice((f"timeout after {r.randint(5, 60)} s",
                               f"disk usage at {r.randint(90, 100)}%, write refused")),
        }[level]
        lines.append(f"2024-{month:02d}-{day:02d}T{h:02d}:{m:02d}:{s:02d}Z {level:5} "
                     f"[{service}] {msg}")
    return "\n".join(lines) + "\n\n"


def _letter(r: random.Random) -> str:
    to, sender = r.choice(_FIRST), f"{r.choice(_FIRST)} {r.choice(_LAST)}"
    town = r.choice(_TOWNS)
    body = [r.choice((f"The garden in {town} is full of roses this year.",
                      f"Work at the library in {town} keeps me busy.",
                      f"The weather in {town} has been {r.choice(('kind', 'dreadful'))}.")),
            r.choice(("I think of our walks by the sea often.",
                      "Mother sends her love and a jar of plum jam.",
                      "The children have grown so tall you would not know them.",
                      "I have finally finished the book you lent me.")),
            r.choice((f"Will you come to visit in {r.choice(_MONTHS)}?",
                      "Do write soon and tell me all your news.",
                      f"I shall be in {r.choice(_TOWNS)} for a week in the spring."))]
    r.shuffle(body)
    opening = r.choice(("I hope this letter finds you well.",
                        "Thank you for your kind letter.",
                        "It has been far too long since I last wrote."))
    close = r.choice(("With love", "Yours sincerely", "Warm regards", "Ever yours"))
    return f"Dear {to},\n{opening} " + " ".join(body) + f"\n{close},\n{sender}\n\n"


_GRAMMARS: dict[str, Callable[[random.Random], str]] = {
    "weather": _weather, "recipes": _recipe, "sports": _sports, "trains": _trains,
    "shop": _shop, "fables": _fable, "logs": _logs, "letters": _letter,
}
#: The corpus's sources, in source-id order.
SOURCES: tuple[str, ...] = tuple(_GRAMMARS)


def generate_corpus(*, seed: int = 0, chars_per_source: int = CHARS_PER_SOURCE
                    ) -> dict[str, str]:
    """Generated text per source (exactly ``chars_per_source`` characters each), in
    :data:`SOURCES` order. Deterministic: the same seed gives the same text everywhere."""
    if chars_per_source < 1:
        raise ValueError(f"chars_per_source must be >= 1, got {chars_per_source}")
    out: dict[str, str] = {}
    for s, (name, grammar) in enumerate(_GRAMMARS.items()):
        r = random.Random(int(seed) * 1_000_003 + s)  # an int seed: the same on every machine
        docs: list[str] = []
        length = 0
        while length < chars_per_source:
            docs.append(grammar(r))
            length += len(docs[-1])
        out[name] = "".join(docs)[:chars_per_source]
    return out


# -- the tokenizer ------------------------------------------------------------------------------


class CharTokenizer:
    """Character-level: id 0 is the unknown character, then one id per known character in
    sorted order."""

    UNK = 0
    UNK_TEXT = "\ufffd"

    def __init__(self, chars: str) -> None:
        self.chars = "".join(sorted(set(chars)))
        codes = np.array([ord(c) for c in self.chars], dtype=np.int64)
        self._table = np.zeros(int(codes.max()) + 1 if len(codes) else 1, dtype=np.int64)
        self._table[codes] = np.arange(1, len(codes) + 1)

    @classmethod
    def fit(cls, text: str) -> CharTokenizer:
        return cls(text)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> npt.NDArray[np.int64]:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        known = codes < len(self._table)
        return np.where(known, self._table[np.where(known, codes, 0)], self.UNK)

    def decode(self, ids: Sequence[int] | npt.NDArray[np.integer]) -> str:
        chars = self.UNK_TEXT + self.chars
        return "".join(chars[i] if 0 < i < len(chars) else self.UNK_TEXT
                       for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist())


# -- examples -----------------------------------------------------------------------------------


def windows(tokens: npt.NDArray[np.int64], context: int
            ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Non-overlapping windows: ``x[k] = tokens[i:i+T]``, ``y[k] = tokens[i+1:i+T+1]`` with
    ``i = k*T``; x as float32 ids, y as int64."""
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    n = max((len(tokens) - 1) // context, 0)
    x = tokens[:n * context].reshape(n, context)
    y = tokens[1:n * context + 1].reshape(n, context)
    return x.astype(np.float32), y.astype(np.int64)


@dataclass(frozen=True)
class LMData:
    """Train and test windows, each window's source id, and the tokenizer."""

    train: ArrayDataset
    test: ArrayDataset
    train_source: npt.NDArray[np.int64]
    test_source: npt.NDArray[np.int64]
    tokenizer: CharTokenizer
    sources: tuple[str, ...] = SOURCES


def load_lm_data(*, seed: int = 0, chars_per_source: int = CHARS_PER_SOURCE,
                 context: int = CONTEXT, test_fraction: float = TEST_FRACTION) -> LMData:
    """The generated corpus as windows: the last ``test_fraction`` of every source's text is
    held out, the tokenizer is fitted on the rest."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    corpus = generate_corpus(seed=seed, chars_per_source=chars_per_source)
    cut = {name: len(text) - max(1, round(test_fraction * len(text)))
           for name, text in corpus.items()}
    tokenizer = CharTokenizer.fit("".join(text[:cut[name]] for name, text in corpus.items()))
    parts: dict[str, list] = {"xtr": [], "ytr": [], "str": [], "xte": [], "yte": [], "ste": []}
    for s, (name, text) in enumerate(corpus.items()):
        for key, piece in (("tr", text[:cut[name]]), ("te", text[cut[name]:])):
            x, y = windows(tokenizer.encode(piece), context)
            parts["x" + key].append(x)
            parts["y" + key].append(y)
            parts["s" + key].append(np.full(len(y), s, dtype=np.int64))
    train = ArrayDataset(np.concatenate(parts["xtr"]), np.concatenate(parts["ytr"]))
    test = ArrayDataset(np.concatenate(parts["xte"]), np.concatenate(parts["yte"]))
    if len(test) == 0:
        raise ValueError(f"chars_per_source={chars_per_source} leaves no test window of "
                         f"{context} tokens; use more text or a shorter context")
    return LMData(train, test, np.concatenate(parts["str"]), np.concatenate(parts["ste"]),
                  tokenizer, tuple(corpus))


# -- the model ----------------------------------------------------------------------------------


__all__ = ["CHARS_PER_SOURCE", "CONTEXT", "SOURCES", "TEST_FRACTION", "CharTokenizer", "LMData",
           "generate_corpus", "load_lm_data", "windows"]
