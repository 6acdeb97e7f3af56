"""Adds up a tools/kernel_trace.c trace per kernel over the last N decode steps, or the last prompt.

    python3 tools/kernel_trace.py trace.txt [N [T]]     T: tokens a step feeds (1; K + 1 with --mtp K)
    python3 tools/kernel_trace.py trace.txt prefill     (plain decoding)

A step runs from one embedding of T tokens (embed_kernel with gridY T) to the next; the prompt from
its embedding (gridY: its tokens) to the next embedding. Kernels overlap
(programmatic dependent launch), so each record is charged what it added to the step's timeline: its
end minus the latest end before it (0 if it ended under an earlier one); idle time, such as the host's
turn between steps, goes to the record after it. The charges of a step add up to its length.
Products (gemv_kernel) are told apart by their grid and the kernel before them."""
import collections, re, sys


def base(name):
    m = re.match(r"_Z(\d+)", name)
    if not m:
        return name
    n = int(m.group(1))
    s = name[m.end():m.end() + n]
    t = re.search(r"ILi(\d+)ELi(\d+)E", name)   # gemv_kernel<BF, EPI>
    return s + ("<%s,%s>" % t.groups() if t and s == "gemv_kernel" else "")


recs = []
for line in open(sys.argv[1]):
    f = line.split()
    if f[0] == "K":
        recs.append((int(f[1]), int(f[2]), base(f[6]), int(f[3]), int(f[4])))
    elif f[0] == "C":
        recs.append((int(f[1]), int(f[2]), "memcpy " + {"1": "HtoD", "2": "DtoH", "8": "DtoD"}.get(f[3], f[3]), 0, 0))
recs.sort()
per = int(sys.argv[3]) if len(sys.argv) > 3 else 1
embeds = [i for i, r in enumerate(recs) if r[2] == "embed_kernel" and r[4] == per]
arg = sys.argv[2] if len(sys.argv) > 2 else "64"
if arg == "prefill":
    a = [i for i, r in enumerate(recs) if r[2] == "embed_kernel" and r[4] > 1][-1]
    steps = [(a, next(i for i in range(a + 1, len(recs)) if recs[i][2] == "embed_kernel"))]
else:
    steps = list(zip(embeds, embeds[1:]))[-int(arg):]
charge, count, busy = collections.defaultdict(float), collections.defaultdict(int), collections.defaultdict(float)
total = 0.0
for a, b in steps:
    last = recs[a - 1][1]
    start = last
    for i in range(a, b):
        s, e, name, gx, _ = recs[i]
        key = name if not name.startswith("gemv") else "%s grid %d after %s" % (name, gx, recs[i - 1][2].split("<")[0])
        charge[key] += max(0, e - last)
        count[key] += 1
        busy[key] += e - s
        last = max(last, e)
    total += last - start
k = len(steps)
print("%d steps, %.1f us a step" % (k, total / k / 1e3))
# a step: its runs and charged us (what they added to the step's timeline); us a run: start to end,
# overlapping the kernel before (programmatic dependent launch)
print("%-62s %6s %12s %8s %10s" % ("record", "runs", "charged us", "share", "us a run"))
for key in sorted(charge, key=lambda x: -charge[x]):
    print("%-62s %6.1f %12.1f %7.1f%% %10.2f" % (key[:62], count[key] / k, charge[key] / k / 1e3, 100 * charge[key] / total,
                                                 busy[key] / count[key] / 1e3))
