"""Tensor parallelism: one model's layers split across N processes (ranks) over torch.distributed
(gloo, on the CPU so far), cut as Megatron-LM cuts them:

- attention: each rank holds whole kv heads (a contiguous run, as even as their count allows:
  SmolLM2's 3 at TP = 2 go 2 + 1) with the query heads of their groups: its share of qkv_proj's
  rows and of o_proj's columns, and its heads' K/V in a KV cache of its own;
- the MLP: a contiguous run of the intermediate features (rows of gate_up, columns of down);
- the embedding and the output layer: a contiguous run of the vocabulary each;
- norms: whole on every rank.

Partial sums (o_proj's and down_proj's outputs, the embedding's looked-up rows) meet in a
fixed order: every rank gathers all ranks' parts and adds them rank by rank. A row's bits so
depend neither on the rows beside it (batch invariance: a verify pass scores a token as a
decode step does, so greedy SD equals AR at any TP) nor on the rank; they differ from TP = 1's
single product, which adds in another order (an embedding row is the same: one rank's row plus
zeros). A pass starts on rank 0 (the engine's ModelRunner), which broadcasts its inputs
(send_pass); the other ranks run the same pass on their shards (serve).

Ranks 1..N-1 are processes of their own (ssd/distributed/rank.py), started by the engine (Ranks) on
this machine, in sessions of their own, linked over the loopback with this run's secret
(ssd/distributed/link.py), and ended with it; or started by hand on other hosts
(`ssd rank --connect HOST:PORT`, the engine's `tensor_parallel_address`). Rank 0 tells them
how to hold the model (Settings); each loads it, checks it is rank 0's, and keeps its share. A
rank that dies or breaks the link ends the pass in flight with a RankError, and every later
one: the model is gone with it.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.distributed_c10d import AllgatherOptions, BroadcastOptions

from ssd.distributed.link import TARGET, LinkError, Watcher, connect, listen_socket, new_secret, parse_address
from ssd.errors import RankError, UnsupportedModelError
from ssd.layers.attention import AttentionBatch
from ssd.layers.linear import Linear
from ssd.models.config import ModelConfig
from ssd.models.decoder import DecoderLM
from ssd.models.loader import load_gguf_shard, load_model, weight_files
from ssd.models.shard import Cut, plan, spans

RANK_SECRET_ENV = "SSD_RANK_SECRET"  # the secret of ranks started by hand (the same value on every host)


@dataclass
class Group:
    """This rank's place in the tensor-parallel process group."""

    pg: dist.ProcessGroup
    rank: int
    world: int
    timeout: float | None = None  # seconds an operation may wait for the other ranks; None: for good
    broken: str | None = None  # why the group can no longer run a pass

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x (one shape) added in rank order, on every rank (not all_reduce, whose
        order of additions follows the buffer's size and the rank)."""
        parts = self.all_gather(x.contiguous())
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def concat(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """The ranks' x side by side in the last dimension; rank r's is widths[r] wide."""
        parts = self.all_gather(F.pad(x, (0, max(widths) - x.shape[-1])).contiguous())
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], dim=-1)

    def send_pass(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                  logits_index: torch.Tensor | None, head: bool) -> None:
        """Rank 0: a pass's inputs to the other ranks (recv_pass), in two broadcasts: a header
        of sizes, then every input in one tensor."""
        r, s = batch.rows.shape
        n = -1 if logits_index is None else len(logits_index)
        self.broadcast(torch.tensor([len(input_ids), r, s, n, int(head)]))
        parts = (input_ids, positions, batch.slot_mapping, batch.rows.reshape(-1), batch.q_row, batch.q_len,
                 logits_index)
        self.broadcast(torch.cat([t.long() for t in parts if t is not None]))

    def stop(self) -> None:
        """Rank 0: the other ranks' serve() returns."""
        self.broadcast(torch.tensor([-1, 0, 0, 0, 0]))

    def recv_pass(self) -> tuple | None:
        """The other ranks: the next pass's inputs, None when rank 0 stops."""
        t, r, s, n, head = self.broadcast(torch.empty(5, dtype=torch.long)).tolist()
        if t < 0:
            return None
        body = self.broadcast(torch.empty(5 * t + r * s + max(n, 0), dtype=torch.long))
        ids, pos, slots, rows, q_row, q_len, index = body.split([t, t, t, r * s, t, t, max(n, 0)])
        batch = AttentionBatch(slots, rows.view(r, s), q_row, q_len)
        return ids, pos, batch, index if n >= 0 else None, bool(head)

    # The group is made by ssd/engine/link.connect, outside torch.distributed's registry of
    # groups: its own methods, not dist.broadcast(group=...); each operation with its timeout.
    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's t, into t on every rank."""
        opts = self._options(BroadcastOptions)
        opts.rootRank = 0
        self._wait(lambda: self.pg.broadcast([t], opts))
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's t (one shape), by rank."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self._wait(lambda: self.pg.allgather([parts], [t], self._options(AllgatherOptions)))
        return parts

    def _options(self, kind):
        opts = kind()
        if self.timeout is not None:
            opts.timeout = datetime.timedelta(seconds=self.timeout)
        return opts

    def _wait(self, op) -> None:
        """gloo raises at once when a peer's connection closes (a rank that died), and when a
        peer keeps this rank waiting past `timeout` (a rank that hangs)."""
        if self.broken:
            raise RankError(self.broken)
        try:
            op().wait()
        except RuntimeError as e:
            self.broken = f"a tensor-parallel rank stopped: {str(e).strip().splitlines()[0]}"
            raise RankError(self.broken) from e


class RowParallel(nn.Module):
    """A linear layer on this rank's share of the input features; the ranks' partial outputs
    added in rank order."""

    def __init__(self, inner: nn.Module, group: Group):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.sum(self.inner(x))


class VocabEmbedding(nn.Module):
    """This rank's rows [lo, lo + n) of the embedding (`inner`, an embedding of n rows): its own
    tokens' rows, zeros for the others', summed over the ranks."""

    def __init__(self, inner: nn.Module, lo: int, n: int, group: Group):
        super().__init__()
        self.inner, self.lo, self.n, self.group = inner, lo, n, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        mine = (local >= 0) & (local < self.n)
        rows = self.inner(local.clamp(0, self.n - 1))
        return self.group.sum(torch.where(mine[..., None], rows, torch.zeros((), dtype=rows.dtype)))


class VocabHead(nn.Module):
    """The output layer on this rank's run of the vocabulary; the ranks' logits side by side."""

    def __init__(self, inner: nn.Module, group: Group, vocab: int):
        super().__init__()
        self.inner, self.group = inner, group
        self.widths = [hi - lo for lo, hi in spans(vocab, group.world)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.concat(self.inner(hidden), self.widths)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return layer


@torch.no_grad()
def shard(model: DecoderLM, group: Group) -> DecoderLM:
    """Cut a whole model in memory (unquantized weights) to this rank's share, in place, and
    link it (wrap); returns it."""
    cut = plan(model.config, group.rank, group.world)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if any(type(m) is not Linear or m.quantized for m in linears) or not isinstance(model.embed_tokens, nn.Embedding):
        raise UnsupportedModelError("tensor parallelism cuts unquantized weights in memory, or a GGUF file's "
                                    "blocks as it reads them (weights='dequantized' or 'gguf')")
    rows = cut.stacked_qkv_rows()
    q_lo, q_hi = cut.q
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        bias = a.qkv_proj.bias
        a.qkv_proj = _linear(a.qkv_proj.weight[rows], None if bias is None else bias[rows])
        a.o_proj = _linear(a.o_proj.weight[:, q_lo:q_hi])
        m.gate_up_proj = _linear(m.gate_up_proj.weight[cut.gate_up_rows()])
        m.down_proj = _linear(m.down_proj.weight[:, cut.inter_lo:cut.inter_hi])
    head = model.lm_head.weight
    embed = model.embed_tokens.weight[cut.vocab_lo:cut.vocab_hi].contiguous()
    model.embed_tokens = nn.Embedding.from_pretrained(embed)
    model.lm_head = _linear(embed if model.config.tie_word_embeddings else head[cut.vocab_lo:cut.vocab_hi])
    return wrap(model, group, cut)


def wrap(model: DecoderLM, group: Group, cut: Cut) -> DecoderLM:
    """Link a model whose matrices hold this rank's cut (shard(), or loaded so from a GGUF
    file): its heads counted as this rank's, its partial sums and the vocabulary's runs met
    across the ranks."""
    for layer in model.layers:
        a = layer.self_attn
        a.num_heads, a.num_kv_heads = (cut.kv_hi - cut.kv_lo) * cut.per_kv, cut.kv_hi - cut.kv_lo
        a.q_size, a.kv_size = a.num_heads * cut.head_dim, a.num_kv_heads * cut.head_dim
        a.o_proj = RowParallel(a.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    model.embed_tokens = VocabEmbedding(model.embed_tokens, cut.vocab_lo, cut.vocab_hi - cut.vocab_lo, group)
    model.lm_head = VocabHead(model.lm_head, group, model.config.vocab_size)
    model.fused_layers = False  # the one-op CPU layers have no collectives in them
    model.tp_group = group
    return model


def load(folder: Path, device: torch.device, dtype: torch.dtype, weights: str, group: Group) -> DecoderLM:
    """This rank's share of a model folder's weights, linked: a GGUF file's blocks read for
    this rank's cut alone (weights='gguf'), or the whole model loaded and cut (else)."""
    if weights == "gguf":
        model, cut = load_gguf_shard(folder, group.rank, group.world)
        return wrap(model, group, cut)
    return shard(load_model(folder, device, dtype, weights), group)


def local_config(model: DecoderLM) -> ModelConfig:
    """The model's config as this rank's KV cache sees it: its own kv heads."""
    group = model.tp_group
    if group is None:
        return model.config
    cut = plan(model.config, group.rank, group.world)
    return replace(model.config, num_kv_heads=cut.kv_hi - cut.kv_lo)


def fingerprint(folder: Path) -> str:
    """What makes two ranks' copies of a model the same: its config and its weight files' sizes."""
    digest = hashlib.sha256((Path(folder) / "config.json").read_bytes())
    for f in weight_files(folder):
        digest.update(f"{f.name}:{f.stat().st_size};".encode())
    return digest.hexdigest()


@dataclass
class Settings:
    """What rank 0 tells the other ranks once linked: the model they must hold, and how."""

    fingerprint: str
    dtype: str
    weights: str
    kv_tokens: int
    block_size: int

    def send(self, group: Group) -> None:
        body = torch.frombuffer(bytearray(json.dumps(asdict(self)).encode()), dtype=torch.uint8)
        group.broadcast(torch.tensor([body.numel()]))
        group.broadcast(body)

    @classmethod
    def recv(cls, group: Group) -> "Settings":
        size = int(group.broadcast(torch.empty(1, dtype=torch.long)))
        return cls(**json.loads(bytes(group.broadcast(torch.empty(size, dtype=torch.uint8)).numpy())))


def report(group: Group, problem: str, width: int = 1024) -> list[str]:
    """Every rank's problem after loading ("" for none), by rank."""
    mine = torch.zeros(width, dtype=torch.uint8)
    text = problem.encode()[:width]
    mine[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else mine[:0]
    return [bytes(p.numpy()).rstrip(b"\0").decode(errors="replace") for p in group.all_gather(mine)]


class Ranks:
    """Rank 0's side of ranks 1..N-1: started on this machine, or started by hand (`ssd rank
    --connect HOST:PORT`, on any host, with RANK_SECRET_ENV's secret) when `address` is given;
    linked, told the run's Settings, checked (ready) and ended by close()."""

    def __init__(self, world: int, model: Path, settings: Settings, threads: int, address: str | None = None,
                 secret: str | None = None, timeout: float = 60.0, startup_timeout: float = 600.0):
        """timeout: seconds another rank may keep rank 0 waiting in a pass before it counts as
        hung (the other ranks wait for rank 0 for good, as long as the engine idles); until
        ready(), while the ranks load, startup_timeout."""
        self.procs: list[subprocess.Popen] = []
        if address is None:
            listener, secret = listen_socket("127.0.0.1"), new_secret()
            host, port = "127.0.0.1", listener.getsockname()[1]
            self.procs = [subprocess.Popen(
                [sys.executable, "-m", "ssd.cli", "rank", "--connect", f"{host}:{port}", "--rank", str(r),
                 "--world", str(world), "--model", str(model), "--threads", str(threads),
                 "--parent-pid", str(os.getpid())],
                stdin=subprocess.DEVNULL, start_new_session=True, env={**os.environ, RANK_SECRET_ENV: secret})
                for r in range(1, world)]
            weakref.finalize(self, _kill, self.procs)
        else:
            host, port = parse_address(address)
            listener = listen_socket(host, port)
        self.watcher = Watcher(lambda: all(p.poll() is None for p in self.procs), startup_timeout,
                               "a tensor-parallel rank")
        try:
            pg = self.watcher(lambda: connect(host, port, TARGET, startup_timeout, secret, listener=listener,
                                              world=world, peers="a tensor-parallel rank"))
        except LinkError as e:
            self.close()
            raise RankError(f"the tensor-parallel ranks did not start: {e}") from e
        self.group = Group(pg, 0, world, startup_timeout)  # the ranks load their models meanwhile
        self.pass_timeout = timeout
        settings.send(self.group)

    def ready(self) -> None:
        """After rank 0 loaded its share: every other rank loaded the same model, or RankError."""
        problems = [p for p in report(self.group, "")[1:] if p]
        if problems:
            self.close()
            raise RankError("; ".join(problems))
        self.group.timeout = self.pass_timeout

    def close(self) -> None:
        """Stop the ranks (they return from serve) and reap the ones started here; kill what does
        not end."""
        group = getattr(self, "group", None)
        if group is not None and group.broken is None:
            try:
                group.stop()
            except RankError:
                pass
            group.broken = "the tensor-parallel ranks were stopped"
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.watcher.join(5)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


@torch.inference_mode()
def serve(model: DecoderLM, kv: torch.Tensor, group: Group) -> None:
    """A rank other than 0: run rank 0's passes on this rank's shards until it stops."""
    while (args := group.recv_pass()) is not None:
        ids, pos, batch, logits_index, head = args
        dev = kv.device
        batch = AttentionBatch(*(t.to(dev) for t in (batch.slot_mapping, batch.rows, batch.q_row, batch.q_len)))
        model(ids.to(dev), pos.to(dev), batch, kv, None if logits_index is None else logits_index.to(dev), head)

