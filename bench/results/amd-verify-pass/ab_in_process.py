import time, torch, statistics, sys
from ssd.kernels import quant_cpu as qc
names = sys.argv[1].split(",")
for n in names: torch.ops.load_library(f'/tmp/qb/b{n}/ssd_quant_{n}.so')
torch.set_num_threads(2)
mats = [(n, qc.QuantStack([qc.repack(raw, qc.GGML(ty), rows, cols)])) for n, ty, rows, cols, raw in torch.load('/tmp/qb/full.pt')]
ops = {n: getattr(torch.ops, f"ssd_quant_{n}").qlinear for n in names}
for n, m in mats[:6]:
    x = torch.randn(9, m.cols)
    ref = ops[names[0]](x, m.packed, m.types, m.part_rows, m.cols, None, False)
    for k in names[1:]: assert torch.equal(ref, ops[k](x, m.packed, m.types, m.part_rows, m.cols, None, False)), (n, k)
Ms = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 3, 5, 9]
times = {}
for rep in range(12):
    for M in Ms:
        xs = {m.cols: torch.randn(M, m.cols) for _, m in mats}
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            op = ops[name]
            t0 = time.perf_counter()
            for _, m in mats: op(xs[m.cols], m.packed, m.types, m.part_rows, m.cols, None, False)
            times.setdefault((name, M), []).append(time.perf_counter() - t0)
for M in Ms:
    base = statistics.median(times[(names[0], M)])
    print(f"M={M}: " + " | ".join(f"{n} min {min(times[(n, M)])*1e3:.1f} med {statistics.median(times[(n, M)])*1e3:.1f} ({statistics.median(times[(n, M)])/base:.3f})" for n in names))
