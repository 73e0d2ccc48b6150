#!/usr/bin/python3
"""JSON Lines of texts of common words for the fine-tuning benchmarks: 64 texts of 560 words, each
longer than a row of 512 tokens, so every row is one example and every position a target. With
--prompt-half, 64 prompt/completion pairs of 256 words each: every row is one example, and about
half of its positions are prompt, which carries no target. With --pairs, 64 preference pairs of a
prompt of 100 words and two completions of 150 ({prompt, chosen, rejected}: each row one pair of
about 500 tokens); with --pairs-as-sft the same pairs as two prompt/completion examples each, the
rows and targets a fine-tune of the same lengths takes.

Usage: bench_data.py [--prompt-half | --pairs | --pairs-as-sft] OUT.jsonl
"""
import json
import random
import sys

random.seed(2)
WORDS = ("the of and to in is was for on that with as by at from it an be this which or are were "
         "his her they their had not but have one all has been when who will more no if out so "
         "said what up its about into than them can only other new some could time these two may "
         "then do first any my now such like our over man me even most made after also did many "
         "before must through back years where much your way well down should because each just "
         "those people").split()


def words(n):
    return " ".join(random.choice(WORDS) for _ in range(n))


kind = sys.argv[1] if len(sys.argv) > 2 else "--text"
with open(sys.argv[-1], "w") as f:
    for _ in range(64):
        if kind == "--prompt-half":
            examples = [{"prompt": words(256), "completion": " " + words(256)}]
        elif kind in ("--pairs", "--pairs-as-sft"):
            prompt, chosen, rejected = words(100), " " + words(150), " " + words(150)
            examples = [{"prompt": prompt, "chosen": chosen, "rejected": rejected}]
            if kind == "--pairs-as-sft":
                examples = [{"prompt": prompt, "completion": c} for c in (chosen, rejected)]
        else:
            examples = [{"text": words(560)}]
        for example in examples:
            f.write(json.dumps(example) + "\n")
