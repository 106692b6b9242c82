#!/usr/bin/env bash
# Extracts the natural-text corpus of the bundled tiny model from Debian packages.
#
# Packages and extraction:
#   bible-kjv   (KJV text, via its `bible` reader: `bible -f Gen1:1-Rev22:21`), verse labels
#               stripped, one chapter per line.
#   fortunes    (/usr/share/games/fortunes/*, '%'-separated), one fortune per line, whitespace
#               collapsed; ascii-art and art are left out (pictures, not text).
#   wamerican   (/usr/share/dict/american-english), lower-case alphabetic words of 5-9 letters,
#               every 20th one: the keys of the synthetic tasks.
# Split: the four Gospels (Matthew-John) and the fortune files literature, wisdom and science
# are held out as the accuracy suite's filler (bench/accuracy/data/filler.txt, committed);
# everything else is training text (.cache/corpus/train.txt, carried to the GPU machine).
#
# Usage: tools/train_tiny/extract_corpus.sh   (installs the packages if missing; needs root)
set -euo pipefail
cd "$(dirname "$0")/../.."

need=()
for pkg in bible-kjv fortunes wamerican; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

out=.cache/corpus
mkdir -p "$out" bench/accuracy/data
bible -f "Gen1:1-Rev22:21" </dev/null >"$out/kjv.raw" 2>/dev/null

python3 - "$out" <<'PY'
import glob, os, re, sys
out = sys.argv[1]

# KJV: "Ge1:1 In the beginning..." -> chapters, one per line, labels dropped.
chapters, order, current = {}, [], None
for line in open(os.path.join(out, "kjv.raw"), encoding="utf-8", errors="replace"):
    m = re.match(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$", line.rstrip("\n"))
    if not m:
        continue
    book, chapter, text = m.group(1), int(m.group(2)), m.group(4).strip()
    key = (book, chapter)
    if key not in chapters:
        chapters[key] = []
        order.append(key)
    chapters[key].append(text)
gospels = {"Mat", "Mark", "Luke", "John"}
kjv_train, kjv_eval = [], []
for key in order:
    text = " ".join(chapters[key])
    (kjv_eval if key[0] in gospels else kjv_train).append(text)

# Fortunes: '%'-separated entries, whitespace collapsed, one per line.
held_out = {"literature", "wisdom", "science"}
skip = {"art", "ascii-art"}
fort_train, fort_eval = [], []
for path in sorted(glob.glob("/usr/share/games/fortunes/*")):
    name = os.path.basename(path)
    if "." in name or name in skip or os.path.islink(path):
        continue
    raw = open(path, encoding="utf-8", errors="replace").read()
    for entry in raw.split("\n%\n"):
        text = " ".join(entry.split())
        if len(text) >= 20 and text.isprintable():
            (fort_eval if name in held_out else fort_train).append(text)

with open(os.path.join(out, "train.txt"), "w") as f:
    f.write("\n".join(kjv_train + fort_train) + "\n")
with open("bench/accuracy/data/filler.txt", "w") as f:
    f.write("\n".join(kjv_eval + fort_eval) + "\n")

words = [w.strip() for w in open("/usr/share/dict/american-english", encoding="utf-8")]
words = [w for w in words if re.fullmatch(r"[a-z]{5,9}", w)][::20]
with open("bench/accuracy/data/words.txt", "w") as f:
    f.write("\n".join(words) + "\n")
print(f"train: {len(kjv_train)} chapters + {len(fort_train)} fortunes; "
      f"eval filler: {len(kjv_eval)} chapters + {len(fort_eval)} fortunes; {len(words)} key words")
PY
rm -f "$out/kjv.raw"
ls -l "$out/train.txt" bench/accuracy/data/filler.txt bench/accuracy/data/words.txt
