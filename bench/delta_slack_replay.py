#!/usr/bin/env python3
"""Replays logged oracle_topk selections through a compact pool larger than the selection
(docs/disaggregated.md "Delta replies": pool slack): rows that leave the selection stay in the
pool, least recently left evicted first, and a row re-entering from the pool costs no bytes.
Prints, per pool size, the rows entering per decode step after the first (full) reply, as a
share of the selected rows. Input: one line per CompactSlotMap::Update call, "<map id>
<position> <position> ...", in call order (a logging patch of two statements in
transport/compact_delta.cc, not in the tree; docs/disaggregated.md gives it).

  python3 bench/delta_slack_replay.py selections.txt
"""
import sys
from collections import OrderedDict, defaultdict

seqs = defaultdict(list)
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) > 1: seqs[parts[0]].append([int(x) for x in parts[1:]])
def simulate(slack):
    sel = ent = 0
    for ss in seqs.values():
        pool = set(ss[0]); lru = OrderedDict()
        for s in ss[1:]:
            S = set(s); ent += len(S - pool); sel += len(S)
            active = pool - set(lru)
            for p in sorted(active - S): lru[p] = True
            for p in S: lru.pop(p, None)
            while len(lru) > int(slack * len(S)): lru.popitem(last=False)
            pool = S | set(lru)
    return ent / sel
print("maps", len(seqs), "steps per map", len(next(iter(seqs.values()))))
for slack in (0, 0.25, 0.5, 1.0, 2.0):
    print(f"pool {1+slack:.2f}x the selection: rows entering per decode step after the first = {simulate(slack):.3f}")
