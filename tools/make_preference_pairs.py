#!/usr/bin/python3
"""Preference pairs for stories260K (a TinyStories model), to see DPO and ORPO learn.

Each pair's prompt opens a small story: a child's name and what the child has. The chosen
completion continues it with the same child and thing; the rejected one is the same sentence
about another child and another thing, so preferring it takes reading the prompt. Half the names
and things of the held-out pairs never occur together in the training pairs.

    tools/make_preference_pairs.py OUT_DIR [--pairs N] [--seed S]

writes OUT_DIR/train.jsonl and OUT_DIR/val.jsonl ({"prompt", "chosen", "rejected"} a line, as
`cputrain finetune --method dpo|orpo --data ... --val ...` reads them).
"""
import argparse
import json
import os
import random

NAMES = ["Lily", "Tom", "Sue", "Ben", "Mia", "Max", "Anna", "Sam", "Tim", "Lucy"]
THINGS = ["ball", "cat", "dog", "cake", "kite", "toy", "hat", "book", "box", "bird"]
PLACES = ["park", "garden", "house", "school", "forest", "beach"]
FEELINGS = ["happy", "sad", "glad", "excited", "scared"]


def pair(rng, name, thing):
    other_name = rng.choice([n for n in NAMES if n != name])
    other_thing = rng.choice([t for t in THINGS if t != thing])
    place, feeling = rng.choice(PLACES), rng.choice(FEELINGS)
    prompt = f"Once upon a time, there was a child named {name}. {name} had a {thing}."
    story = " One day, {} went to the {} with the {}. {} was very {}."
    return {"prompt": prompt,
            "chosen": story.format(name, place, thing, name, feeling),
            "rejected": story.format(other_name, place, other_thing, other_name, feeling)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    combos = [(n, t) for n in NAMES for t in THINGS]
    rng.shuffle(combos)
    held = combos[: len(combos) // 5]  # never in the training pairs
    seen = combos[len(combos) // 5:]
    os.makedirs(args.out, exist_ok=True)
    for name, count in (("train", args.pairs), ("val", max(1, args.pairs // 5))):
        with open(os.path.join(args.out, name + ".jsonl"), "w") as f:
            for i in range(count):
                pool = seen if name == "train" or i % 2 else held
                f.write(json.dumps(pair(rng, *rng.choice(pool))) + "\n")
    print(f"wrote {args.out}/train.jsonl ({args.pairs} pairs) and {args.out}/val.jsonl")


if __name__ == "__main__":
    main()
