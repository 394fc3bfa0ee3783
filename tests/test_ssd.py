"""Speculative speculative decoding: a draft worker process over gloo, the speculation cache,
the draft tree, and what happens when the worker fails. Outputs must equal AR's exactly."""
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import transformers

from ssd import LLM, SamplingParams
import ssd.engine.llm_engine
from ssd.errors import SSDError
from ssd.exactness import pooled_p_value
from ssd.models.loader import load_model
from ssd.request.sampler import probs_from_logits
from ssd.runner.kv_cache import PagedKVCache
from ssd.runner.model_runner import Chunk, ModelRunner
from ssd.speculative.draft.draft_engine import DraftEngine
from ssd.speculative.draft.fanout import FanOut
from ssd.speculative.draft.ssd_draft import SSDDraft
from ssd.speculative.link.protocol import SpecRequest
from chance import fits
from tiny_pair import NEW, PROMPT, V, exact_joint

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
GREEDY = SamplingParams.greedy(max_tokens=32, ignore_eos=True)


def children_alive(llm: LLM) -> bool:
    proc = llm.engine.source.proc
    return proc is not None and proc.poll() is None


@pytest.mark.parametrize("k, fan_out, fan_out_miss, backup, batch", [
    (3, 2, None, "jit", 4),
    (5, [3, 2, 1, 1, 1, 2], [4, 1, 0, 0, 0, 1], "fast", 2),
    (2, "auto", None, "jit", 1),
])
def test_ssd_greedy_equals_ar(smollm_dir, truncated_draft, ar_outputs, k, fan_out, fan_out_miss, backup, batch):
    prompts = PROMPTS[:batch]
    with LLM(smollm_dir, draft=truncated_draft, mode="ssd", speculate_k=k, fan_out=fan_out,
             fan_out_miss=fan_out_miss, backup=backup) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs(prompts, GREEDY)
        for o in outs:
            m = o.metrics
            # The first round is a miss; a last round with one token left drafts nothing.
            assert m.rounds - 1 <= m.hits + m.misses <= m.rounds and m.misses >= 1
            assert 0 < m.acceptance_rate < 1 and m.draft_failures == 0
            assert m.tree_s > 0 and m.tokens_on_hit + m.tokens_on_miss <= m.rounds + m.accepted
        assert any(o.metrics.hits for o in outs), "a truncated draft should guess some outcomes"
        assert children_alive(llm)
    assert not children_alive(llm), "closing the engine ends the worker"


def test_a_worker_thread_gives_ar_outputs_and_ends_with_the_engine(smollm_dir, truncated_draft, ar_outputs):
    """draft_thread: the worker as a thread of this process (one GPU's case, where it gets a
    CUDA stream of its own), over queues instead of gloo: the same rounds, the same outputs."""
    with LLM(smollm_dir, draft=truncated_draft, mode="ssd", speculate_k=3, fan_out=2, draft_thread=True) as llm:
        spec = llm.engine.source
        assert spec.proc is None and spec.thread.is_alive()
        outs = llm.generate(PROMPTS[:2], GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs(PROMPTS[:2], GREEDY)
        assert all(o.metrics.hits + o.metrics.misses >= o.metrics.rounds - 1 for o in outs)
        assert any(o.metrics.hits for o in outs) and not any(o.metrics.draft_failures for o in outs)
        thread = spec.thread
    assert not thread.is_alive(), "closing the engine ends the worker's thread"


def test_a_worker_thread_that_dies_fails_over_to_sd(smollm_dir, truncated_draft, ar_outputs, monkeypatch, caplog):
    steps = []
    real = SSDDraft.step

    def breaks(self, requests):
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("out of memory (planted)")
        return real(self, requests)
    monkeypatch.setattr(SSDDraft, "step", breaks)
    monkeypatch.setattr("threading.excepthook", lambda args: None)  # the thread's traceback, expected
    with caplog.at_level(logging.WARNING, logger="ssd"), \
            LLM(smollm_dir, draft=truncated_draft, mode="ssd", speculate_k=3, draft_thread=True) as llm:
        outs = llm.generate(PROMPTS[:1], GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs(PROMPTS[:1], GREEDY)
        assert llm.draft_failures == 1
    assert "draft worker died" in caplog.text


def test_self_draft_hits_every_round_after_the_first(smollm_dir, ar_outputs):
    """Greedy, the model as its own draft: every draft token is accepted, the outcome is
    always (K, the bonus token), and the glue decode's top token at depth K is that bonus."""
    with LLM(smollm_dir, draft=smollm_dir, mode="ssd", speculate_k=4, fan_out=1, draft_quantization="gguf") as llm:
        outs = llm.generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in outs] == ar_outputs(PROMPTS[:3], GREEDY)
    for o in outs:
        m = o.metrics
        assert m.acceptance_rate == 1.0
        assert m.misses == 1 and m.hits >= m.rounds - 2 and m.hits > 3  # a last 0-draft round counts neither
        assert m.tokens_per_round_hit == 5.0


def _alone(model, context: list[int], n: int) -> torch.Tensor:
    """Logits of the last n positions of `context`, decoded on a fresh cache in one pass."""
    cache = PagedKVCache(model.config, len(context) + 16, 16, torch.device("cpu"), torch.float32)
    cache.reserve(0, len(context))
    return ModelRunner(model, cache, torch.device("cpu")).forward([Chunk(0, context, 0, n)])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="SSD splits the cores: needs two")
def test_prompts_run_on_the_idle_workers_cores_too(smollm_dir, truncated_draft, ar_outputs, monkeypatch):
    """The target is pinned to its half of the cores while the worker drafts; a step of
    prompts alone also takes the worker's (idle) cores, and the output stays AR's."""
    with LLM(smollm_dir, draft=truncated_draft, mode="ssd", speculate_k=3, fan_out=2) as llm:
        prompts, rounds = [], []
        llm_forward = llm.engine._forward

        def spy(calls: list, fn):
            return lambda *a: calls.append((os.sched_getaffinity(0), torch.get_num_threads())) or fn(*a)
        forward = spy(prompts, llm_forward)
        # Only the steps of prompt chunks (a round that drafts nothing also runs _forward).
        monkeypatch.setattr(llm.engine, "_forward", lambda work: (forward if work[0].num_new > 1 else llm_forward)(work))
        monkeypatch.setattr(ssd.engine.llm_engine, "speculative_round", spy(rounds, ssd.engine.llm_engine.speculative_round))
        outs = llm.generate(PROMPTS[:2], GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs(PROMPTS[:2], GREEDY)
        target, draft = set(llm.engine.source.target.cores), set(llm.engine.source.draft.cores)
    assert prompts and all(c == target | draft and n == len(c) for c, n in prompts), prompts
    assert rounds and all(c == target and n == len(c) for c, n in rounds), rounds


def _branches(draft: SSDDraft) -> int:
    """The speculation cache's entries, over all sequences."""
    return sum(len(s.speculations) for s in draft.engine.seqs.values())


def test_tree_branches_equal_decoding_each_branch_alone(truncated_draft):
    """Every branch of the tree, decoded among all others with the tree mask, gives the same
    logits (hence tokens and q) as decoding its context alone."""
    model = load_model(truncated_draft, torch.device("cpu"), torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(truncated_draft)
    k, sizes = 3, [2, 1, 2, 3]
    draft = SSDDraft(DraftEngine(model, torch.device("cpu"), k_max=k, cache_tokens=4096, seed=0), FanOut(k, sizes))
    prompts = [tok(p).input_ids for p in PROMPTS[:2]]
    params = [SamplingParams.greedy(), SamplingParams(temperature=0.9, top_k=50)]
    replies = draft.step([SpecRequest(i, 0, ids, k, p) for i, (ids, p) in enumerate(zip(prompts, params))])
    shares = draft.build()
    assert _branches(draft) == 2 * sum(sizes) and set(shares) == {0, 1}
    for seq_id, (ids, p, reply) in enumerate(zip(prompts, params, replies)):
        entries = draft.engine.seqs[seq_id].speculations.entries
        per_depth = [sum(1 for j, _ in entries if j == d) for d in range(k + 1)]
        assert per_depth == sizes
        for (j, t), branch in entries.items():
            assert j == k or t != reply.tokens[j], "a rejected draft token cannot be the recovery token"
            logits = _alone(model, ids + reply.tokens[:j] + [t] + branch.tokens[:-1], k)
            if p.greedy_decoding:
                assert branch.tokens == logits.argmax(-1).tolist() and branch.q is None
            else:
                assert torch.equal(branch.q, probs_from_logits(logits, p))


def test_a_late_build_makes_the_next_tree_smaller(truncated_draft):
    """The worker reports how long the draft waited for the target's next request; a build
    the request had to wait for caps the next tree (fanout.py), whose branches are still
    the draft's own continuations."""
    model = load_model(truncated_draft, torch.device("cpu"), torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(truncated_draft)
    k = 2
    draft = SSDDraft(DraftEngine(model, torch.device("cpu"), k_max=k, cache_tokens=4096, seed=0), FanOut(k, 3))
    ids = tok(PROMPTS[0]).input_ids
    draft.step([SpecRequest(0, 0, ids, k, SamplingParams.greedy())])
    draft.build()
    assert _branches(draft) == 9
    draft.fit_tree_to(0.0)
    assert draft.fan_out.cap == 7
    # The target accepted the whole speculation and then the draft's likeliest bonus token.
    bonus = max(draft.engine.seqs[0].speculations.entries.items(), key=lambda e: e[0][0])[0][1]
    reply = draft.step([SpecRequest(0, len(ids) + k, [bonus], k, None)])[0]
    assert reply.hit
    draft.build()
    entries = dict(draft.engine.seqs[0].speculations.entries)
    assert len(entries) == 7
    context = draft.engine.seqs[0].tokens  # the prompt, the first speculation, the bonus, this one
    for (j, t), branch in entries.items():
        logits = _alone(model, context[:len(context) - k + j] + [t] + branch.tokens[:-1], k)
        assert branch.tokens == logits.argmax(-1).tolist()
    draft.fit_tree = False  # fit_tree=False: late or not, the fan-out stays as given
    draft.fit_tree_to(0.0)
    assert draft.fan_out.cap == 7


# ---- sampling exactness through the real cache path ------------------------------------
@pytest.mark.parametrize("options", [
    dict(backup="jit", fan_out=2),
    pytest.param(dict(backup="fast", fan_out=2, fan_out_miss=[3, 0, 1]), marks=pytest.mark.long),
    pytest.param(dict(backup="jit", fan_out=2, saguaro_c=0.3), marks=pytest.mark.long),
    pytest.param(dict(backup="jit", fan_out="auto", tree_budget=4), marks=pytest.mark.long),
], ids=["jit", "fast", "saguaro", "auto"])
def test_ssd_sampling_follows_the_target(tiny_pair, options):
    target, draft = tiny_pair
    n, temperature = 4000, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=NEW, ignore_eos=True)
    # The whole fan-out every round (fit_tree off): the trees of 500 sequences on one core are
    # late, and capped ones would leave the cache path too few hits to test.
    with LLM(target, draft=draft, mode="ssd", speculate_k=2, max_num_seqs=500, seed=1, fit_tree=False,
             **options) as llm:
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    tokens = torch.tensor([o.token_ids for o in outs])
    m = [o.metrics for o in outs]
    hits, misses = sum(x.hits for x in m), sum(x.misses for x in m)
    accepted, drafted = sum(x.accepted for x in m), sum(x.drafted for x in m)
    # The cache path is really taken (half the rounds are first rounds, always misses).
    assert hits > 0.1 * (hits + misses) and 0.05 < accepted / drafted < 0.95, (hits, misses, accepted, drafted)
    joint = exact_joint(target, prompt_ids, temperature)
    for i in range(NEW):  # every position's marginal, then the last two tokens jointly
        marginal = joint.sum(dim=[d for d in range(NEW) if d != i])
        assert fits(pooled_p_value(tokens[:, i].bincount(minlength=V).double(), marginal)), i
    last_two = joint.sum(dim=list(range(NEW - 2))).flatten()
    counts = (tokens[:, -2] * V + tokens[:, -1]).bincount(minlength=V * V).double()
    assert fits(pooled_p_value(counts, last_two))


# ---- failures of the draft worker -----------------------------------------------------
def _stream_with(llm: LLM, action, after_chunks: int = 2):
    """Stream a greedy generation, doing `action` after a few chunks; return the tokens,
    the final metrics and the seconds until the chunk after the action."""
    ids, gap, acted = [], None, 0.0
    for i, chunk in enumerate(llm.stream(PROMPTS[0], SamplingParams.greedy(max_tokens=48, ignore_eos=True))):
        ids += chunk.token_ids
        if i == after_chunks + 1:
            gap = time.monotonic() - acted
        if i == after_chunks:
            action()
            acted = time.monotonic()
    return ids, chunk.metrics, gap


def test_killing_the_worker_mid_generation(smollm_dir, truncated_draft, ar_outputs, caplog):
    want = ar_outputs(PROMPTS[:1], SamplingParams.greedy(max_tokens=48, ignore_eos=True))[0]
    with caplog.at_level(logging.WARNING, logger="ssd"), \
            LLM(smollm_dir, draft=truncated_draft, mode="ssd", speculate_k=3) as llm:
        proc = llm.engine.source.proc
        ids, metrics, _ = _stream_with(llm, proc.kill)
        assert ids == want and metrics.draft_failures == 1
        assert proc.poll() is not None
        again = llm.generate(PROMPTS[:2], GREEDY)  # later requests: SD in this process
        assert [o.token_ids for o in again] == ar_outputs(PROMPTS[:2], GREEDY)
        assert llm.draft_failures == 1
    assert "draft worker died" in caplog.text


def test_a_hung_worker_times_out(smollm_dir, truncated_draft, ar_outputs):
    want = ar_outputs(PROMPTS[:1], SamplingParams.greedy(max_tokens=48, ignore_eos=True))[0]
    with LLM(smollm_dir, draft=truncated_draft, mode="ssd", speculate_k=3, draft_timeout=2.0) as llm:
        proc = llm.engine.source.proc
        ids, metrics, gap = _stream_with(llm, lambda: os.kill(proc.pid, signal.SIGSTOP))
        assert ids == want and metrics.draft_failures == 1
        assert gap < 30, "the round after the hang: the 2 s timeout, loading the draft here, one SD round"
        assert proc.poll() is not None, "the stopped worker was killed, not left behind"


def test_a_worker_that_cannot_start(smollm_dir, truncated_draft, tmp_path, ar_outputs, caplog):
    """The draft's weights are unreadable: the worker cannot load them, nor can this process,
    so generation goes on as plain AR, and says so."""
    broken = tmp_path / "broken-draft"
    broken.mkdir()
    for f in truncated_draft.iterdir():
        (broken / f.name).write_bytes(b"not a GGUF file" if f.name == "model.gguf" else f.read_bytes())
    with caplog.at_level(logging.WARNING, logger="ssd"), \
            LLM(smollm_dir, draft=broken, mode="ssd") as llm:
        outs = llm.generate(PROMPTS[:2], GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs(PROMPTS[:2], GREEDY)
        assert llm.draft_failures == 1 and llm.engine.source.proc.poll() is not None
    assert "could not start" in caplog.text and "plain decoding" in caplog.text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_started_by_hand_on_another_address(smollm_dir, truncated_draft, ar_outputs, monkeypatch):
    monkeypatch.setenv("SSD_DRAFT_SECRET", "a secret both sides were given")
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "ssd.cli", "worker", "--connect", f"127.0.0.1:{port}"])
    try:
        with LLM(smollm_dir, draft=truncated_draft, mode="ssd", draft_address=f"127.0.0.1:{port}") as llm:
            outs = llm.generate(PROMPTS[:2], GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs(PROMPTS[:2], GREEDY)
        assert sum(o.metrics.hits for o in outs) > 0
        assert worker.wait(timeout=30) == 0, "the worker exits when the target closes"
    finally:
        worker.kill()
        worker.wait()


# A worker started by hand whose third reply announces ~4 TiB of floats (none follow).
OVERSIZED_REPLY = """
import itertools, sys, torch
from ssd.cli import main
from ssd.speculative.link import protocol
send, replies = protocol.Channel.send, itertools.count(1)
def oversized(self, msg, floats=None):
    if msg["type"] == "reply" and next(replies) == 3:
        return self.wait(self.pg.send([torch.tensor([16, 2**40])], self.peer, 0))
    send(self, msg, floats)
protocol.Channel.send = oversized
sys.exit(main(["worker", *sys.argv[1:]]))
"""


def test_an_oversized_reply_fails_over_to_sd(smollm_dir, truncated_draft, ar_outputs, monkeypatch, caplog):
    monkeypatch.setenv("SSD_DRAFT_SECRET", "a secret both sides were given")
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-c", OVERSIZED_REPLY, "--connect", f"127.0.0.1:{port}"])
    try:
        with caplog.at_level(logging.WARNING, logger="ssd"), \
                LLM(smollm_dir, draft=truncated_draft, mode="ssd", draft_address=f"127.0.0.1:{port}") as llm:
            outs = llm.generate(PROMPTS[:2], GREEDY)
            assert llm.draft_failures == 1
        assert [o.token_ids for o in outs] == ar_outputs(PROMPTS[:2], GREEDY)
        # Two rounds from the worker, then SD in this process.
        assert all(o.metrics.draft_failures == 1 and o.metrics.hits + o.metrics.misses == 2 for o in outs)
        assert "beyond what this link allows" in caplog.text
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.parametrize("kwargs, match", [
    (dict(fan_out=[1, 2]), "list of K\\+1"),
    (dict(fan_out="wide"), "fan_out must be"),
    (dict(fan_out=0), "fan_out must be >= 1"),
    (dict(backup="slow"), "backup must be"),
    (dict(saguaro_c=1.5), "saguaro_c"),
    (dict(draft_device="gpu:0"), "bad device"),
    (dict(draft_device="cpu:64"), "not available"),
    (dict(draft_address="nowhere"), "HOST:PORT"),
    (dict(draft_timeout=0), "draft_timeout"),
    (dict(fan_out="auto", fan_out_miss=2), "auto"),
    (dict(fit_tree="yes"), "fit_tree must be"),
    (dict(draft_thread="yes"), "draft_thread must be"),
    (dict(draft_thread=True, draft_address="127.0.0.1:5"), "draft_thread runs the worker in this process"),
])
def test_bad_ssd_options(smollm_dir, kwargs, match):
    with pytest.raises(SSDError, match=match):
        LLM(smollm_dir, draft=smollm_dir, mode="ssd", speculate_k=4, **kwargs)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the draft takes every core but the first")
def test_a_cpu_draft_beside_a_gpu_target(smollm_dir):
    """draft_device="cpu" beside a CUDA target: the worker gets every host core but the first
    (the target's host thread keeps it) and computes as the CPU does, fp32 activations over
    int8 or GGUF blocks, whatever the target's dtype; the draft's numerics change only the
    acceptance rate. A CPU target keeps the whole machine's split as before."""
    from ssd.distributed.placement import available_cores
    from ssd.speculative.options import SpecOptions
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    beside = SpecOptions(draft_device="cpu")
    assert beside.draft_placement(gpu).cores == tuple(available_cores()[1:])
    assert beside.draft_on(gpu) == cpu
    assert beside.draft_dtype(gpu, torch.bfloat16) == torch.float32
    assert beside.draft_weights(smollm_dir, gpu) == "q4_0"  # the GGUF file's blocks, requantised
    assert beside.draft_placement(cpu).cores is None  # on a CPU target "cpu" is every core, as named
    named = SpecOptions(draft_device="cpu:1")
    assert named.draft_placement(gpu).cores == (1,)
    on_gpu = SpecOptions()
    assert on_gpu.draft_on(gpu) == gpu and on_gpu.draft_dtype(gpu, torch.bfloat16) == torch.bfloat16


def test_ssd_options_need_ssd_mode(smollm_dir):
    with pytest.raises(SSDError, match="backup applies to mode 'ssd' only"):
        LLM(smollm_dir, draft=smollm_dir, mode="sd", backup="fast")


def _workers_of(pid: int) -> list[int]:
    """Draft worker processes started by process `pid` that are still alive."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if cmd[1:4] == [b"-m", b"ssd.cli", b"worker"] and str(pid).encode() in cmd:
                found.append(int(entry))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("runs", [pytest.param(6, marks=pytest.mark.long), pytest.param(30, marks=pytest.mark.stress)])
def test_ctrl_c_ends_generation_and_the_worker(smollm_dir, truncated_draft, runs):
    """Ctrl-C in a terminal reaches the whole process group: the CLI stops with one line and
    exit code 130, and its draft worker is gone with it; `runs` times, at moments spread over
    1.7 s of rounds, so that no order of the link's teardown aborts the process (a C++ thread
    still inside gloo at exit does: "terminate called without an active exception")."""
    for i in range(runs):
        proc = subprocess.Popen([sys.executable, "-m", "ssd.cli", "generate", "--model", str(smollm_dir),
                                 "--draft", str(truncated_draft), "--mode", "ssd", "--prompt", "Count to a thousand:",
                                 "--max-tokens", "2000", "--ignore-eos", "--temperature", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                # As a terminal's shell starts it: a shell without job control starts
                                # background jobs (a CI run under `cmd &`) with SIGINT ignored, and a
                                # Python started so keeps ignoring it, as it should.
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            assert proc.stdout.read(20), "no text streamed"
            assert _workers_of(proc.pid), "the SSD worker should be running"
            time.sleep(1.7 * i / (runs - 1))
            os.killpg(proc.pid, signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 130 and b"interrupted" in err, (i, proc.returncode, err)
        assert b"Traceback" not in err and b"terminate called" not in err, (i, err)
        deadline = time.monotonic() + 10
        while _workers_of(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _workers_of(proc.pid), i


# ---- the same through the GGUF-block kernels ---------------------------------------------
@pytest.fixture(scope="module")
def tiny_gguf_pair(tiny_pair, tmp_path_factory):
    """The tiny pair's weights quantised (Q8_0 target, Q4_0 draft) into GGUF files: the
    engine runs them on their blocks, with 8-bit activations."""
    from gguf import GGMLQuantizationType as GGML
    from gguf_models import quantized_copy
    return [quantized_copy(f, tmp_path_factory.mktemp(f"gguf-{f.name}"), q)
            for f, q in zip(tiny_pair, (GGML.Q8_0, GGML.Q4_0))]


def exact_joint_ours(folder, prompt_ids: list[int], temperature: float, new: int) -> torch.Tensor:
    """P(t_1..t_new) [V]*new under the engine's own model of `folder` (its GGUF blocks), from
    all V^(new-1) continuations scored together: batch invariance makes each row's logits the
    ones generation computes."""
    model = load_model(folder, torch.device("cpu"), torch.float32)
    assert any("Quant" in type(m).__name__ for m in model.modules())
    conts = list(itertools.product(range(V), repeat=new - 1))
    n = len(prompt_ids) + new - 1
    cache = PagedKVCache(model.config, len(conts) * (n + 16), 16, torch.device("cpu"), torch.float32)
    for i in range(len(conts)):
        cache.reserve(i, n)
    runner = ModelRunner(model, cache, torch.device("cpu"))
    logits = runner.forward([Chunk(i, prompt_ids + list(c), 0, new) for i, c in enumerate(conts)])
    logp = (logits.double().view(len(conts), new, V) / temperature).log_softmax(-1)
    conts_t = torch.tensor(conts).view(len(conts), new - 1)
    joint = logp[:, -1]
    for i in range(new - 1):
        joint = joint + logp[:, i].gather(1, conts_t[:, i:i + 1])
    return joint.exp().view(*[V] * new)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sampling_follows_the_target_on_gguf_blocks(tiny_gguf_pair, mode):
    target, draft = tiny_gguf_pair
    n, new, temperature = 4000, 4, 1.0
    params = SamplingParams(temperature=temperature, max_tokens=new, ignore_eos=True)
    extra = dict(fan_out=2) if mode == "ssd" else {}
    with LLM(target, draft=draft, mode=mode, speculate_k=2, max_num_seqs=500, seed=2, **extra) as llm:
        assert llm.config.weights == "gguf"
        outs = llm.generate([PROMPT] * n, params)
        prompt_ids = llm.encode(PROMPT)
    tokens = torch.tensor([o.token_ids for o in outs])
    accepted, drafted = sum(o.metrics.accepted for o in outs), sum(o.metrics.drafted for o in outs)
    assert 0.05 < accepted / drafted < 0.95, (accepted, drafted)
    joint = exact_joint_ours(target, prompt_ids, temperature, new)
    for i in range(new):
        marginal = joint.sum(dim=[d for d in range(new) if d != i])
        assert fits(pooled_p_value(tokens[:, i].bincount(minlength=V).double(), marginal)), i
    last_two = joint.sum(dim=list(range(new - 2))).flatten()
    counts = (tokens[:, -2] * V + tokens[:, -1]).bincount(minlength=V * V).double()
    assert fits(pooled_p_value(counts, last_two))

