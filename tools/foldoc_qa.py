#!/usr/bin/python3
"""Question-and-answer pairs for fine-tuning, from the Free On-line Dictionary of Computing.

Reads Debian's dict-foldoc (/usr/share/dictd/foldoc.index and foldoc.dict.dz; `apt-get install
dict-foldoc`) and writes JSON Lines for `cputrain finetune`, one entry an example:

    {"instruction": "What is a UART?", "output": "A UART is ..."}      (default: Alpaca's shape)
    {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}  (--chat)

The answer is the entry's first sentence, its cross-reference braces removed, up to --max-chars.
Entries are chosen by a seeded shuffle; headwords that are symbols or numbers are left out.

    /usr/bin/python3 tools/foldoc_qa.py --out foldoc.jsonl [--count 2000] [--seed 1] [--chat]
"""
import argparse
import gzip
import json
import random
import re

INDEX = "/usr/share/dictd/foldoc.index"
DICT = "/usr/share/dictd/foldoc.dict.dz"
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def b64(text):
    value = 0
    for c in text:
        value = value * 64 + B64.index(c)
    return value


def entries():
    data = gzip.open(DICT).read()
    with open(INDEX, encoding="utf-8") as f:
        for line in f:
            head, offset, length = line.rstrip("\n").split("\t")
            yield head, data[b64(offset):b64(offset) + b64(length)].decode("utf-8", "replace")


def first_sentence(body, max_chars):
    """The definition's first paragraph after the headword lines, to its first full stop."""
    paragraphs = [p for p in re.split(r"\n\s*\n", body) if p.startswith("   ")]
    if not paragraphs:
        return None
    text = " ".join(paragraphs[0].split())
    text = re.sub(r"^1\.\s+", "", text)                # the first of numbered senses
    text = re.sub(r"^<[^>]*>\s*", "", text)          # the category tag
    text = re.sub(r"\{([^}]*)\}", r"\1", text)        # cross-references
    if text.startswith(("(", "[")) or len(text) < 20:
        return None
    end = re.search(r"(?<![A-Z])\.(\s|$)", text)
    sentence = text[:end.start() + 1] if end else text
    return sentence if 20 <= len(sentence) <= max_chars else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-chars", type=int, default=240)
    ap.add_argument("--chat", action="store_true", help="chat messages instead of Alpaca's shape")
    args = ap.parse_args()
    pairs = []
    for head, body in entries():
        if not re.match(r"^[A-Za-z][A-Za-z0-9 +.#-]*$", head) or head.startswith("00"):
            continue
        answer = first_sentence(body, args.max_chars)
        if answer:
            pairs.append((head, answer))
    random.Random(args.seed).shuffle(pairs)
    with open(args.out, "w", encoding="utf-8") as f:
        for head, answer in pairs[:args.count]:
            question = f"What is {head}?"
            if args.chat:
                example = {"messages": [{"role": "user", "content": question},
                                        {"role": "assistant", "content": answer}]}
            else:
                example = {"instruction": question, "output": answer}
            f.write(json.dumps(example, ensure_ascii=False) + "\n")
    print(f"wrote {min(args.count, len(pairs))} of {len(pairs)} pairs to {args.out}")


if __name__ == "__main__":
    main()
