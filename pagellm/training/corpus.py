"""A small synthetic corpus in TinyStories style, made from templates with a seeded RNG (the real dataset cannot
be downloaded here). Enough regular structure for a tiny model to learn visibly in a few hundred steps."""

from __future__ import annotations

import json
import random
from pathlib import Path

from pagellm.training.data import EOT

NAMES = ["Lily", "Tom", "Mia", "Ben", "Sara", "Max", "Anna", "Leo", "Zoe", "Sam", "Lucy", "Jack"]
ANIMALS = ["cat", "dog", "bird", "bunny", "frog", "duck", "puppy", "kitten", "bear", "fox"]
PLACES = ["park", "garden", "forest", "beach", "school", "farm", "river", "hill", "house", "zoo"]
THINGS = ["ball", "kite", "box", "hat", "book", "toy car", "cake", "flower", "red balloon", "shiny stone"]
FEELINGS = ["happy", "sad", "scared", "excited", "angry", "tired", "curious", "proud"]
ADJECTIVES = ["big", "little", "kind", "funny", "brave", "shy", "silly", "gentle"]
TEMPLATES = [
    "Once upon a time, there was a {adj} {animal} named {name}. {name} lived near the {place}. One day, {name} "
    "found a {thing}. {name} was very {feeling}. {name} showed the {thing} to a friend, and they played all day. "
    "At the end of the day, {name} went home and slept well.",
    "One day, {name} went to the {place} with mom. {name} saw a {adj} {animal}. The {animal} had a {thing}. "
    '"Can I play with your {thing}?" asked {name}. The {animal} said yes. {name} felt {feeling}. They became '
    "good friends.",
    "{name} had a {thing}. {name} loved the {thing} very much. But one day, the {thing} was lost at the {place}. "
    "{name} was {feeling}. A {adj} {animal} helped {name} look for it. They found the {thing} under a tree. "
    '{name} said, "Thank you!"',
    "There was a {adj} girl named {name}. She liked to go to the {place}. At the {place}, she met a {animal}. "
    "The {animal} was {feeling} because it lost its {thing}. {name} helped the {animal}. The {animal} was happy "
    "again.",
]


def generate_stories(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        rng.choice(TEMPLATES).format(
            name=rng.choice(NAMES),
            animal=rng.choice(ANIMALS),
            place=rng.choice(PLACES),
            thing=rng.choice(THINGS),
            feeling=rng.choice(FEELINGS),
            adj=rng.choice(ADJECTIVES),
        )
        for _ in range(count)
    ]


def write_corpus(path: str | Path, stories: list[str]) -> Path:
    """Write stories in the layout the suffix names: .txt, .json, .jsonl or .parquet."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".txt":
        path.write_text("".join(f"{s}\n{EOT}\n" for s in stories), encoding="utf-8")
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": s}) + "\n" for s in stories), encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps([{"story": s, "instruction": {}} for s in stories]), encoding="utf-8")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": stories}), path, row_group_size=64)
    else:
        raise ValueError(f"path={str(path)!r}: suffix must be .txt, .json, .jsonl or .parquet")
    return path
