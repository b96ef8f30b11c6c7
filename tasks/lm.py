"""The ``lm`` task: next-character language modelling on a generated corpus, with small GPTs.

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

The models. :class:`GPT` is a small decoder-only transformer: token and learned position
embeddings, pre-LayerNorm blocks of causal self-attention (plain matmuls and a mask, no fused
attention kernel, so ``torch.func.vmap``/``functional_call`` and the simulator's vectorised
training run it) and a GELU MLP, a final LayerNorm and an untied output head (the vectorised
executor and the zeroth-order trainer both refuse tied weights). It takes ``x`` of shape
``(B, T)`` (float or integer ids) and returns logits of shape ``(B, V, T)``, so
``torch.nn.functional.cross_entropy(logits, y)``, the trainers' default loss, is the mean
per-token cross-entropy. Named sizes (``--model``), parameter counts with the default corpus's
vocabulary (V = 79: 78 characters and the unknown id) and context 64:

=========  =======  ======  =====  ============
name       d_model  layers  heads  parameters
=========  =======  ======  =====  ============
gpt1m      128      5       4      1,020,032
gpt10m     384      6       6      10,732,800
gpt100m    768      14      12     99,402,240
=========  =======  ======  =====  ============

In general ``2*V*d + T*d + L*(12*d*d + 13*d) + 2*d`` (embeddings and head, positions, blocks,
final LayerNorm; the head has no bias).

Evaluation (:func:`evaluate_lm`) reports per-token ``loss`` (mean cross-entropy, nats),
``perplexity`` (its exponential) and next-token ``accuracy``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from murmura.tasks.data import ArrayDataset
from murmura.tasks.registry import Task, TaskConfig

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


@dataclass(frozen=True)
class GPTConfig:
    """A decoder's shape. ``context`` is the longest input (position embeddings)."""

    vocab_size: int
    context: int = CONTEXT
    d_model: int = 128
    n_layers: int = 5
    n_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.context, self.d_model, self.n_layers, self.n_heads,
               self.mlp_ratio) < 1:
            raise ValueError(f"every GPTConfig size must be >= 1: {self}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads "
                             f"{self.n_heads}")

    def num_parameters(self) -> int:
        v, t, d, n, f = (self.vocab_size, self.context, self.d_model, self.n_layers,
                         self.mlp_ratio)
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (f * d * d + f * d) + (f * d * d + d)
        return 2 * v * d + t * d + n * block + 2 * d


#: Named sizes: (d_model, n_layers, n_heads).
GPT_SIZES: dict[str, tuple[int, int, int]] = {
    "gpt1m": (128, 5, 4),
    "gpt10m": (384, 6, 6),
    "gpt100m": (768, 14, 12),
}


def gpt_config(name: str, vocab_size: int, context: int = CONTEXT) -> GPTConfig:
    if name not in GPT_SIZES:
        raise ValueError(f"unknown GPT size {name!r}; available: {', '.join(GPT_SIZES)}")
    d, n, h = GPT_SIZES[name]
    return GPTConfig(vocab_size, context, d, n, h)


class CausalSelfAttention(nn.Module):
    """Multi-head attention over earlier positions only, with plain matmuls (vmap-safe)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        heads, hd = self.n_heads, d // self.n_heads
        q, k, v = (z.reshape(b, t, heads, hd).transpose(1, 2)
                   for z in self.qkv(h).split(d, dim=-1))                 # (b, heads, t, hd)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        future = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class Block(nn.Module):
    """Pre-LayerNorm: ``h + attn(ln(h))``, then ``h + mlp(ln(h))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, cfg.n_heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.out(nn.functional.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):
    """A decoder-only transformer: ``(B, T)`` token ids in, ``(B, V, T)`` logits out."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's: N(0, 0.02) weights, zero biases, residual outputs scaled by 1/sqrt(2 L)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.modules():
            if isinstance(block, Block):
                for linear in (block.attn.proj, block.out):
                    nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2 * self.config.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x.long()  # float32 ids from an ArrayDataset are exact integers
        t = ids.shape[-1]
        if t > self.config.context:
            raise ValueError(f"input of {t} tokens is longer than the context "
                             f"{self.config.context}")
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h)).transpose(-2, -1)  # (B, V, T): cross_entropy's layout


def gpt(name: str, vocab_size: int, context: int = CONTEXT) -> GPT:
    """The named size (:data:`GPT_SIZES`) for a vocabulary and context."""
    return GPT(gpt_config(name, vocab_size, context))


# -- evaluation and the task --------------------------------------------------------------------


@torch.no_grad()
def evaluate_lm(model: nn.Module, data: ArrayDataset, *, batch_size: int = 256
                ) -> dict[str, float]:
    """Per-token mean cross-entropy (``loss``), ``perplexity`` = exp(loss) and next-token
    ``accuracy`` of ``model`` on windows ``data``."""
    model.eval()
    device = next(model.parameters()).device
    loss_sum, correct, tokens = 0.0, 0, 0
    for start in range(0, len(data), batch_size):
        x = torch.from_numpy(data.x[start:start + batch_size]).to(device)
        y = torch.from_numpy(data.y[start:start + batch_size]).to(device)
        logits = model(x).float()
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
        tokens += y.numel()
    loss = loss_sum / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "accuracy": correct / max(tokens, 1)}


@dataclass
class LMTask(Task):
    """The ``lm`` task: shares are drawn over the windows' sources (see the module doc)."""

    data: LMData | None = field(default=None, repr=False)

    def _lm(self) -> LMData:
        assert self.data is not None
        return self.data

    def partition_labels(self) -> npt.NDArray[np.int64]:
        return self._lm().train_source

    def client_test_data(self, index: int, num_clients: int) -> ArrayDataset | None:
        """Held-out windows in the proportions of sources of the client's training share
        (about one test window per nine training ones), sampled with the data seed."""
        lm = self._lm()
        share = self.shares(num_clients)[index]
        counts = np.bincount(lm.train_source[share], minlength=len(lm.sources))
        want = max(1, round(len(share) * TEST_FRACTION / (1 - TEST_FRACTION)))
        quota = np.floor(counts / max(counts.sum(), 1) * want).astype(np.int64)
        rest = counts / max(counts.sum(), 1) * want - quota
        quota[np.argsort(-rest, kind="stable")[:want - int(quota.sum())]] += 1
        rng = np.random.default_rng([self.config.data_seed, index, num_clients])
        picked = []
        for s, k in enumerate(quota.tolist()):
            pool = np.flatnonzero(lm.test_source == s)
            if k and len(pool):
                picked.append(rng.choice(pool, size=min(k, len(pool)), replace=False))
        if not picked:
            return None
        return self.test.subset(np.sort(np.concatenate(picked)))

    def evaluate(self, model: nn.Module, data: ArrayDataset) -> dict[str, float]:
        return evaluate_lm(model, data)


def load_lm_task(cfg: TaskConfig, *, chars_per_source: int = CHARS_PER_SOURCE,
                 context: int = CONTEXT) -> LMTask:
    """The ``lm`` task for ``cfg`` (its ``model`` one of :data:`GPT_SIZES`)."""
    lm = load_lm_data(seed=cfg.data_seed, chars_per_source=chars_per_source, context=context)
    factory = partial(gpt, cfg.model, lm.tokenizer.vocab_size, context)
    return LMTask(cfg, lm.train, lm.test, factory, data=lm)


__all__ = ["CHARS_PER_SOURCE", "CONTEXT", "GPT", "GPT_SIZES", "SOURCES", "TEST_FRACTION",
           "CharTokenizer", "GPTConfig", "LMData", "LMTask", "evaluate_lm", "generate_corpus",
           "gpt", "gpt_config", "load_lm_data", "load_lm_task", "windows"]
