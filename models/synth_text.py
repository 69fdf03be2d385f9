"""Text side of the synthetic task: sampled strings and identifiers, query templates, filler text.

Kept apart from :mod:`models.synth` (which decides *what* is asked) so the wording can vary without
touching the ground truth. Every function takes the caller's ``random.Random``: same seed, same text.
"""

from __future__ import annotations

import random
import re
from typing import Any

VERBS = ("get", "find", "compute", "calculate", "fetch", "search", "create", "update", "list",
         "check", "convert", "estimate", "predict", "analyze", "book", "send", "lookup", "plan",
         "track", "validate", "generate", "measure", "schedule", "record", "compare", "resolve")
NOUNS = ("account", "album", "area", "balance", "battery", "book", "budget", "building", "car",
         "cell", "city", "climate", "coin", "company", "concert", "course", "crop", "currency",
         "dataset", "device", "disease", "distance", "dog", "engine", "event", "field", "film",
         "flight", "forest", "game", "garden", "gene", "hotel", "invoice", "island", "lake",
         "league", "loan", "market", "match", "menu", "metal", "mountain", "movie", "museum",
         "network", "order", "orbit", "painting", "patient", "planet", "player", "policy",
         "portfolio", "price", "protein", "recipe", "region", "report", "restaurant", "river",
         "route", "salary", "sensor", "server", "ship", "signal", "song", "species", "stock",
         "store", "team", "ticket", "tower", "train", "tree", "user", "vehicle", "village",
         "volume", "weather", "wine", "word", "zone")
ADJECTIVES = ("active", "ancient", "blue", "bright", "central", "cold", "daily", "dark", "early",
              "fast", "final", "golden", "green", "heavy", "hidden", "local", "major", "minor",
              "modern", "northern", "quiet", "rapid", "red", "silver", "small", "southern",
              "strong", "total", "urban", "warm", "wild", "yellow")
CITIES = ("London", "Paris", "Tokyo", "New York", "San Francisco", "Berlin", "Madrid", "Rome",
          "Toronto", "Sydney", "Chicago", "Boston", "Seattle", "Austin", "Denver", "Miami",
          "Mumbai", "Delhi", "Beijing", "Shanghai", "Seoul", "Cairo", "Lagos", "Nairobi", "Lima",
          "Bogota", "Santiago", "Buenos Aires", "Mexico City", "Vancouver", "Dublin", "Oslo",
          "Stockholm", "Helsinki", "Warsaw", "Prague", "Vienna", "Zurich", "Lisbon", "Athens",
          "Istanbul", "Dubai", "Singapore", "Bangkok", "Jakarta", "Manila", "Hanoi", "Osaka",
          "Los Angeles", "Las Vegas", "Houston", "Phoenix", "Atlanta", "Portland", "Dallas")
FIRST_NAMES = ("Alice", "Bob", "Carlos", "Diana", "Elena", "Farid", "Grace", "Hiro", "Ines",
               "James", "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa",
               "Sven", "Tara", "Umar", "Vera", "Wei", "Xavier", "Yuki", "Zara")
LAST_NAMES = ("Smith", "Garcia", "Chen", "Okafor", "Muller", "Rossi", "Tanaka", "Kowalski",
              "Silva", "Novak", "Patel", "Jensen", "Moreau", "Ivanova", "Haddad", "Larsen")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
_SYLLABLES = ("ka", "lo", "mi", "ren", "tor", "va", "zu", "bel", "dra", "fen", "gal", "hu", "ix",
              "jor", "ke", "lum", "nor", "pa", "qui", "ro", "sil", "tan", "ul", "vor", "wen", "ya")


def pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))


def word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.35:
        return rng.choice(NOUNS)
    if r < 0.5:
        return rng.choice(ADJECTIVES)
    if r < 0.6:
        return rng.choice(VERBS)
    return pseudo_word(rng)


def identifier(rng: random.Random, num_words: int) -> str:
    words = [word(rng) for _ in range(num_words)]
    if rng.random() < 0.25:
        return words[0] + "".join(w.capitalize() for w in words[1:])
    return "_".join(words)


def function_name(rng: random.Random) -> str:
    """A sampled function name in one of BFCL's naming styles."""
    base = rng.choice(VERBS) + "_" + identifier(rng, rng.randint(1, 2))
    style = rng.random()
    if style < 0.3:
        return word(rng) + "." + base
    if style < 0.4:
        parts = base.split("_")
        return parts[0] + "".join(p.capitalize() for p in parts[1:])
    return base


def string_value(rng: random.Random, hint: str) -> str:
    """A string argument value; ``hint`` (parameter name and description) picks a plausible kind."""
    hint = hint.lower()
    if re.search(r"city|location|place|destination|origin|town", hint) and rng.random() < 0.7:
        return rng.choice(CITIES)
    if re.search(r"date|day", hint) and rng.random() < 0.7:
        y, m, d = rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28)
        return f"{y}-{m:02d}-{d:02d}" if rng.random() < 0.6 else f"{MONTHS[m - 1]} {d}, {y}"
    if re.search(r"\btime\b", hint) and rng.random() < 0.7:
        return f"{rng.randint(0, 23):02d}:{rng.choice(['00', '15', '30', '45'])}"
    if re.search(r"name|author|artist|player|person|user", hint) and rng.random() < 0.6:
        return rng.choice(FIRST_NAMES) + (" " + rng.choice(LAST_NAMES) if rng.random() < 0.6 else "")
    if re.search(r"email", hint):
        return f"{pseudo_word(rng)}@{pseudo_word(rng)}.com"
    if re.search(r"\bid\b|_id|code|number", hint) and rng.random() < 0.6:
        return rng.choice("ABCDEFGHKMNPRSTX") + str(rng.randint(100, 99999))
    words = [word(rng) for _ in range(rng.choice([1, 1, 2, 2, 3]))]
    text = " ".join(words)
    return text.title() if rng.random() < 0.3 else text


# ----------------------------------------------------------------------------- rendering

def humanize(name: str) -> str:
    """``lower_limit`` / ``lowerLimit`` / ``math.hypot`` -> ``lower limit`` / ``math hypot``."""
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    return re.sub(r"[_.\-]+", " ", name).strip().lower()


def format_value(rng: random.Random, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and rng.random() < 0.5 else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return f"'{value}'" if rng.random() < 0.2 else value
    if isinstance(value, list):
        items = [format_value(rng, v) for v in value]
        if rng.random() < 0.3:
            return "[" + ", ".join(items) + "]"
        return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)
    if isinstance(value, dict):
        return "(" + ", ".join(f"{humanize(k)} {format_value(rng, v)}" for k, v in value.items()) + ")"
    return str(value)


_ARG_TEMPLATES = ("{p} {v}", "{p} of {v}", "{p} = {v}", "{p}: {v}", "{p} set to {v}", "{p} {v}")


def render_args(rng: random.Random, arguments: dict[str, Any]) -> str:
    phrases = []
    for name, value in arguments.items():
        p = name if rng.random() < 0.3 else humanize(name)
        phrases.append(rng.choice(_ARG_TEMPLATES).format(p=p, v=format_value(rng, value)))
    if len(phrases) <= 1:
        return "".join(phrases)
    if rng.random() < 0.3:
        return "; ".join(phrases)
    return ", ".join(phrases[:-1]) + " and " + phrases[-1]


_NOT_IMPERATIVE = re.compile(r"^(this|the|a|an|it|returns?|given|used|function|api|tool|method)\b",
                             re.I)


def intent(rng: random.Random, tool: dict[str, Any]) -> tuple[str, bool]:
    """A phrase for what the user wants done, and whether it reads as an imperative."""
    fn = tool["function"]
    first = re.split(r"(?<=[.!?])\s", fn.get("description", "").strip())[0].rstrip(" .!?")
    if not first or rng.random() < 0.25:
        return "use " + humanize(fn["name"]), True
    imperative = not _NOT_IMPERATIVE.match(first) and not first.split()[0].lower().endswith("s")
    return (first[0].lower() + first[1:]) if imperative else first, imperative


def _sentence(rng: random.Random, tool: dict[str, Any], arguments: dict[str, Any]) -> str:
    what, imperative = intent(rng, tool)
    args = render_args(rng, arguments)
    if not imperative:
        what = what[0].upper() + what[1:]
        return f"{what}. " + (f"Do it with {args}." if args else "Do that for me.")
    if not args:
        return rng.choice(["{W}.", "Please {w}.", "Could you {w}?"]).format(W=what[0].upper() + what[1:], w=what)
    template = rng.choice(["{W} with {a}.", "Please {w} using {a}.", "Could you {w}? Use {a}.",
                           "I need to {w}: {a}.", "Can you {w} for {a}?", "{W}, {a}."])
    return template.format(W=what[0].upper() + what[1:], w=what, a=args)


def _parallel(rng: random.Random, calls: list) -> str:
    what, imperative = intent(rng, calls[0].tool)
    sets = [render_args(rng, c.arguments) or "the defaults" for c in calls]
    listed = "; ".join(sets[:-1]) + "; and " + sets[-1]
    if not imperative:
        return f"{what[0].upper() + what[1:]}. Do it {len(calls)} times: with {listed}."
    template = rng.choice(["{W} for each of these: {l}.", "Please {w} {n} times, with {l}.",
                           "I need to {w} in {n} cases: {l}."])
    return template.format(W=what[0].upper() + what[1:], w=what, l=listed, n=len(calls))


def render_query(rng: random.Random, plan: list[tuple]) -> str:
    """Render a query plan (from :class:`models.synth.Generator`) as the user's message."""
    parts = []
    for item in plan:
        kind = item[0]
        if kind == "single":
            parts.append(_sentence(rng, item[1].tool, item[1].arguments))
        elif kind == "parallel":
            parts.append(_parallel(rng, item[1]))
        elif kind == "haystack":
            request = _sentence(rng, item[1].tool, item[1].arguments)
            return haystack(rng, request, item[2], item[3])
    joiners = [" Also, ", " Then ", " In addition, ", " "]
    text = parts[0]
    for part in parts[1:]:
        j = rng.choice(joiners)
        text += j + (part[0].lower() + part[1:] if j.strip() else part)
    return text


def filler_sentence(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        return (f"The {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} near {rng.choice(CITIES)} was "
                f"{rng.choice(ADJECTIVES)} in {rng.choice(MONTHS)}.")
    if r < 0.55:
        return (f"{rng.choice(FIRST_NAMES)} wrote about the {rng.choice(NOUNS)} and the "
                f"{rng.choice(NOUNS)} of {pseudo_word(rng).capitalize()}.")
    if r < 0.8:
        return (f"In {rng.randint(1900, 2024)}, the {rng.choice(NOUNS)} had {rng.randint(2, 900)} "
                f"{rng.choice(NOUNS)}s and a {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}.")
    return f"Nobody expected the {rng.choice(NOUNS)} to be so {rng.choice(ADJECTIVES)}."


def haystack(rng: random.Random, request: str, num_chars: int, depth: float) -> str:
    """Filler paragraphs of about ``num_chars`` characters with ``request`` as its own paragraph at
    relative ``depth`` in [0, 1] (0 = first), followed by a closing instruction."""
    paragraphs, size = [], 0
    while size < num_chars:
        para = " ".join(filler_sentence(rng) for _ in range(rng.randint(3, 6)))
        paragraphs.append(para)
        size += len(para) + 2
    paragraphs.insert(round(depth * len(paragraphs)), "Request: " + request)
    return "\n\n".join(paragraphs) + "\n\nPlease act on the request in the notes above."
