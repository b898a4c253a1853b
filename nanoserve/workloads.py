"""The copy workload of speculative decoding's benchmarks (`nanoserve bench --workload
copy`, sim/bench/speculative.py): prompts whose answers copy from the prompt, as agents'
do, and open ones where nothing can be copied. Plain completion prompts, so that a base
model (Gemma 3 270M) and an instruct one (SmolLM2) continue them alike, with the same text
on every run: the workload is this code.

Three kinds, 12 each: rewrite a JSON object with one field changed, quote the sentence of
a paragraph that says something, and apply a small edit to a block of code.
"""

from __future__ import annotations

_NAMES = ["atlas", "borealis", "cobalt", "dune", "ember", "fjord", "granite", "harbor",
          "iris", "juniper", "kestrel", "lumen"]
_CITIES = ["Lisbon", "Oslo", "Kyoto", "Lima", "Nairobi", "Quebec", "Tallinn", "Hobart",
           "Cusco", "Bergen", "Porto", "Sapporo"]
_FACTS = [
    ("the bridge", "The bridge over the river was finished in the spring of 1932."),
    ("the library", "The old library keeps more than forty thousand maps in its basement."),
    ("the harbour", "Fishing boats leave the harbour before dawn and return by noon."),
    ("the festival", "Every August the town holds a festival of lanterns on the water."),
    ("the railway", "The railway reached the valley only after the second tunnel opened."),
    ("the market", "On Saturdays the market square fills with cheese and bread stalls."),
]
_FILLER = [
    "The streets are narrow and most of them climb steeply from the shore.",
    "Visitors often remark on the colour of the roofs, a deep and even red.",
    "Winters are mild, though the wind from the sea can be sharp in January.",
    "Many families have lived in the same houses for several generations.",
]


def _json(i: int) -> str:
    name, city = _NAMES[i], _CITIES[i]
    src = (f'{{"id": {1000 + 37 * i}, "name": "{name}", "city": "{city}", "active": true, '
           f'"tags": ["{name[:3]}", "service", "v{i % 4 + 1}"], "owner": {{"team": "platform", '
           f'"email": "{name}@example.com"}}, "replicas": {i % 5 + 2}, "version": "1.{i}.0"}}')
    field, old, new = [("replicas", f'"replicas": {i % 5 + 2}', f'"replicas": {i % 5 + 3}'),
                       ("active", '"active": true', '"active": false'),
                       ("version", f'"version": "1.{i}.0"', f'"version": "1.{i}.1"')][i % 3]
    return (f"Here is a JSON object:\n{src}\n\nThe same JSON object, unchanged except that "
            f"{new.split(':')[0]} is now{new.split(':', 1)[1]}:\n")


def _quote(i: int) -> str:
    topic, fact = _FACTS[i % len(_FACTS)]
    city = _CITIES[(i * 5) % len(_CITIES)]
    sentences = [*_FILLER[: 1 + i % 3], fact, *_FILLER[1 + i % 3:]]
    paragraph = f"A note on {city}. " + " ".join(sentences)
    return (f"Read the paragraph and quote, word for word, the sentence about {topic}.\n\n"
            f"Paragraph: {paragraph}\n\nThe sentence about {topic}, quoted exactly: \"")


def _code(i: int) -> str:
    name = _NAMES[i]
    src = (f"def {name}_total(items, rate):\n"
           f"    total = 0\n"
           f"    for item in items:\n"
           f"        if item.price > 0:\n"
           f"            total += item.price * item.quantity\n"
           f"    total = total * (1 + rate)\n"
           f"    return round(total, 2)\n")
    edits = [(f"the function renamed to {name}_sum", f"{name}_total", f"{name}_sum"),
             ("the rounding to 3 places", "round(total, 2)", "round(total, 3)"),
             ("the price test changed to >= 0", "item.price > 0", "item.price >= 0")]
    what, _, _ = edits[i % 3]
    return (f"Here is a Python function:\n```python\n{src}```\n\nThe same function with "
            f"{what}, and nothing else changed:\n```python\n")


def copy_prompts() -> list[str]:
    """36 prompts whose answers copy from the prompt."""
    return [f(i) for f in (_json, _quote, _code) for i in range(12)]


def open_prompts() -> list[str]:
    """16 prompts with nothing in them to copy: the answer is new text."""
    topics = ["why the sky is blue", "how bread rises", "what a glacier is",
              "how a bicycle stays upright", "why leaves change colour", "how tides work",
              "what makes a good cup of tea", "how bees make honey",
              "why we need sleep", "how a compass works", "what causes thunder",
              "how a rainbow forms", "why cats purr", "how rivers shape valleys",
              "what a black hole is", "how vaccines train the body"]
    return [f"Question: Explain in a few sentences {t}.\nAnswer:" for t in topics]
