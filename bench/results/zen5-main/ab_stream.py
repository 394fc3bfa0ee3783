"""In-process A/B of quant.cpp builds differing only in stream-tuning flags, on the draft's
and the target's real packed matrices, alternating call by call (this host is noisy)."""
import collections, statistics, sys, time, torch
from torch.utils import cpp_extension
from ssd.kernels import quant_cpu
from ssd.kernels.build import _ISA_FLAGS
from ssd.layers.linear import QuantLinear
from ssd.models.loader import load_model
from ssd.store import resolve_model

VARIANTS = {  # name -> tuning flags
    "l2_8k_s1": ["-DSSD_PF_BYTES=8192", "-DSSD_PF_L2=1", "-DSSD_M1_STREAMS=1"],  # today's AMD
    "l1_8k_s1": ["-DSSD_PF_BYTES=8192", "-DSSD_PF_L2=0", "-DSSD_M1_STREAMS=1"],
    "l1_4k_s1": ["-DSSD_PF_BYTES=4096", "-DSSD_PF_L2=0", "-DSSD_M1_STREAMS=1"],
    "l1_2k_s4": ["-DSSD_PF_BYTES=2048", "-DSSD_PF_L2=0", "-DSSD_M1_STREAMS=4"],  # today's Intel
    "l2_16k_s1": ["-DSSD_PF_BYTES=16384", "-DSSD_PF_L2=1", "-DSSD_M1_STREAMS=1"],
    "l1_8k_s2": ["-DSSD_PF_BYTES=8192", "-DSSD_PF_L2=0", "-DSSD_M1_STREAMS=2"],
}
names = sys.argv[1].split(",")
Ms = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 5]
k = quant_cpu._KERNEL
src = k.sources
ops = {}
for n in names:
    ns = f"ssd_quant_ab_{n}"
    d = f"/tmp/tune/b_{n}"
    import os, pathlib
    pathlib.Path(d).mkdir(exist_ok=True)
    for path, text in src.items():
        pathlib.Path(d, path).write_text(text)
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", f"-DSSD_NS={ns}", *VARIANTS[n], *_ISA_FLAGS["avx512"],
             *k.requires["avx512"][1]]
    cpp_extension.load(name=ns, sources=[f"{d}/quant.cpp"], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                       build_directory=d, is_python_module=False, verbose=False)
    ops[n] = getattr(torch.ops, ns).qlinear
torch.set_num_threads(2)
models = {"draft": load_model(resolve_model("qwen2.5-coder-0.5b-instruct"), torch.device("cpu"), torch.float32, "q4_0"),
          "target": load_model(resolve_model("qwen2.5-coder-1.5b-instruct"), torch.device("cpu"), torch.float32, "auto")}
mats = {key: [m.stack for _, m in mod.named_modules() if isinstance(m, QuantLinear)] for key, mod in models.items()}
for key, ms in mats.items():  # same bits
    x = torch.randn(3, ms[0].cols)
    ref = ops[names[0]](x, ms[0].packed, ms[0].types, ms[0].part_rows, ms[0].cols, None, False)
    for n in names[1:]:
        assert torch.equal(ref, ops[n](x, ms[0].packed, ms[0].types, ms[0].part_rows, ms[0].cols, None, False))
times = collections.defaultdict(list)
for rep in range(15):
    for key, ms in mats.items():
        for M in Ms:
            xs = {s.cols: torch.randn(M, s.cols) for s in ms}
            order = names[rep % len(names):] + names[:rep % len(names)]
            for n in order:
                op = ops[n]
                t0 = time.perf_counter()
                for s in ms:
                    op(xs[s.cols], s.packed, s.types, s.part_rows, s.cols, None, False)
                times[(key, M, n)].append(time.perf_counter() - t0)
for key in mats:
    for M in Ms:
        base = statistics.median(times[(key, M, names[0])])
        print(f"{key} M={M}: " + " | ".join(f"{n} med {statistics.median(times[(key, M, n)])*1e3:.2f} min {min(times[(key, M, n)])*1e3:.2f} ({statistics.median(times[(key, M, n)])/base:.3f})" for n in names))
