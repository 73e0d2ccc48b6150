#!/usr/bin/python3
"""JSON Lines of texts of common words for the fine-tuning benchmarks: 64 texts of 560 words, each
longer than a row of 512 tokens, so every row is one example and every position a target.

Usage: bench_data.py OUT.jsonl
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
with open(sys.argv[1], "w") as f:
    for _ in range(64):
        f.write(json.dumps({"text": " ".join(random.choice(WORDS) for _ in range(560))}) + "\n")
