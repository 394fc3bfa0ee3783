"""One decoder-only transformer covering Llama (3.x, SmolLM2), Mistral, Qwen2, Qwen3, Phi-3,
Gemma 2 and Gemma 3, and the mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral (layers/moe.py).

They differ in q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3, Gemma 3), RoPE scaling
(Llama 3, Phi-3's LongRoPE) and partial rotary (Phi), sliding-window layers (Mistral, Phi-3,
Gemma), and Gemma's block (models/config.py, GEMMA); ModelConfig carries those as flags.
"""
import torch
from torch import nn

from ssd.errors import SSDError
from ssd.kernels.decoder_cpu import LayerStack
from ssd.layers.attention import Attention, AttentionBatch
from ssd.layers.linear import Linear, QuantLinear
from ssd.layers.mlp import MLP
from ssd.layers.moe import QuantExperts, SparseMoE
from ssd.layers.norm import RMSNorm
from ssd.layers.rotary import RotaryEmbedding
from ssd.models.config import ModelConfig


class DecoderLayer(nn.Module):
    """Pre-norm residual block. Names follow Hugging Face's: in Llama/Qwen the norm before the
    MLP is `post_attention_layernorm`; Gemma names that one `pre_feedforward_layernorm`, and
    its `post_attention_layernorm` / `post_feedforward_layernorm` normalise each branch's
    output before it joins the residual."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int):
        super().__init__()
        norm = lambda n: RMSNorm(n, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm = norm(cfg.hidden_size)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   rotary, cfg.qkv_bias, cfg.qk_norm, cfg.rms_norm_eps,
                                   scale=cfg.query_scale, softcap=cfg.attn_softcap,
                                   window=cfg.sliding_window if cfg.sliding(layer) else None)
        self.post_attention_layernorm = norm(cfg.hidden_size)
        if cfg.gemma_norms:
            self.pre_feedforward_layernorm = norm(cfg.hidden_size)
            self.post_feedforward_layernorm = norm(cfg.hidden_size)
        self.gemma = cfg.gemma_norms
        if cfg.moe(layer):
            shared = cfg.shared_expert_intermediate_size
            self.mlp = SparseMoE(cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts,
                                 cfg.experts_per_token, cfg.normalize_expert_weights, cfg.hidden_act,
                                 MLP(cfg.hidden_size, shared, cfg.hidden_act) if shared else None)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, branch: torch.Tensor | None, positions: torch.Tensor, batch: AttentionBatch,
                kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; branch: the previous layer's last output, not yet added to it
        (None before the first layer), so that each add and the norm after it run as one kernel
        on CUDA. Returns the stream and this layer's last output."""
        x, h = self.input_layernorm.add_forward(x, branch)
        h = self.self_attn(h, positions, batch, kv)
        if not self.gemma:
            x, h = self.post_attention_layernorm.add_forward(x, h)
            return x, self.mlp(h)
        x, h = self.pre_feedforward_layernorm.add_forward(x, self.post_attention_layernorm(h))
        return x, self.post_feedforward_layernorm(self.mlp(h))


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)
        local = self.rotary
        if cfg.local_rope_theta is not None:  # Gemma 3's sliding layers: a RoPE base of their own, unscaled
            local = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings,
                                    cfg.local_rope_theta, {})
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, local if cfg.sliding(i) else self.rotary, i)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.full_head: nn.Module | None = None  # a reduced head's rows of any token (loader.py)
        self.fused_layers = True  # run the layers as one CPU op where it applies (LayerStack)
        self._stack: LayerStack | None | bool = False  # built on first use; None: not applicable
        self.tp_group = None  # this rank's tensor_parallel.Group once sharded (engine/tensor_parallel.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv: torch.Tensor, logits_index: torch.Tensor | None = None, head: bool = True,
                taps: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids/positions: [T] flat new tokens; kv: [layers, 2, slots, kv_heads, head_dim].

        Returns logits for the rows in logits_index (all rows if None); with head=False their
        final hidden states instead (a draft applies its own head, ssd/speculative/draft/vocab.py).
        taps: ascending layer ids in 0..layers whose entering residual stream (layers: the
        stream after the last layer) is returned too, for every input row (not only those of
        logits_index), [len(taps), T, hidden]: the features an EAGLE-3 head reads
        (ssd/speculative/draft/eagle.py); the same bits on either path."""
        if taps and not (list(taps) == sorted(set(taps)) and 0 <= taps[0] and taps[-1] <= len(self.layers)):
            raise SSDError(f"taps must be ascending layer ids in 0..{len(self.layers)}, got {list(taps)}")
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        stack = self.layer_stack() if self.fused_layers else None
        y = None if stack is None else stack.run(x, positions, batch, kv, taps)
        branch, tapped = None, []
        if y is not None:
            x, tapped = y
        else:
            for i, (layer, layer_kv) in enumerate(zip(self.layers, kv)):
                if i in taps:  # the stream entering the layer: its pending add done here (the same bits)
                    x, branch = x if branch is None else x + branch, None
                    tapped.append(x)
                x, branch = layer(x, branch, positions, batch, layer_kv)
            if len(self.layers) in taps:
                tapped.append(x if branch is None else x + branch)
        if logits_index is not None:
            x, branch = x[logits_index], None if branch is None else branch[logits_index]
        _, x = self.norm.add_forward(x, branch)
        out = self.logits(x) if head else x
        if not taps:
            return out
        return out, torch.stack(tapped)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer on final (normed) hidden states, soft-capped where the model says."""
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        if cap is None:
            return logits
        # Row by row: an elementwise op over many rows splits them among threads at points
        # that move with the row count, and tanh's vector and scalar code differ in the last bit.
        return torch.stack([torch.tanh(row / cap) * cap for row in logits])

    def layer_stack(self) -> LayerStack | None:
        """The layers' weights for the one-op CPU path (ssd/kernels/decoder_cpu.py): a model
        whose every matrix is on GGUF blocks (a mixture's experts too, its routers fp32, no
        shared expert); None for any other."""
        if self._stack is False:
            self._stack = None
            cfg = self.config
            moes = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
            if not all(isinstance(m.experts, QuantExperts) and m.shared_expert is None and type(m.gate) is Linear
                       and m.gate.weight.dtype is torch.float32 for m in moes):
                return None
            linears = [[layer.self_attn.qkv_proj, layer.self_attn.o_proj]
                       + ([] if isinstance(layer.mlp, SparseMoE) else [layer.mlp.gate_up_proj, layer.mlp.down_proj])
                       for layer in self.layers]
            if all(isinstance(m, QuantLinear) for ms in linears for m in ms):
                stacks = [m.stack for ms in linears for m in ms]
                biases = [ms[0].bias for ms in linears]
                norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm")[:4 if cfg.gemma_norms else 2]
                attn = self.layers[0].self_attn
                local = next((layer.self_attn.rotary for i, layer in enumerate(self.layers) if cfg.sliding(i)),
                             self.rotary)
                if all(b is None for b in biases) or all(b is not None for b in biases):
                    self._stack = LayerStack(
                        norms=[getattr(layer, n).weight for layer in self.layers for n in norms],
                        parts=[t for st in stacks for t in st.packed],
                        types=[t for st in stacks for t in st.types],
                        part_rows=[r for st in stacks for r in st.part_rows],
                        nparts=[n for ms in linears for n in [len(m.stack.packed) for m in ms] + [0] * (4 - len(ms))],
                        qkv_bias=[b for b in biases if b is not None],
                        qk_norms=[n.weight for layer in self.layers if cfg.qk_norm
                                  for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)],
                        dims=[cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, len(norms),
                              int(cfg.hidden_act == "gelu_tanh"), cfg.experts_per_token,
                              int(cfg.normalize_expert_weights), cfg.expert_intermediate_size],
                        eps=cfg.rms_norm_eps, scale=attn.scale, cos=self.rotary.cos, sin=self.rotary.sin,
                        sliding=[int(cfg.sliding(i)) for i in range(cfg.num_layers)], window=cfg.sliding_window,
                        cos_w=local.cos, sin_w=local.sin, softcap=cfg.attn_softcap or 0.0,
                        moe=[int(isinstance(layer.mlp, SparseMoE)) for layer in self.layers],
                        routers=[m.gate.weight for m in moes],
                        expert_gate_up=[p for m in moes for p in m.experts.op_args[0]],
                        expert_gate_up_types=[t for m in moes for t in m.experts.op_args[1]],
                        expert_down=[p for m in moes for p in m.experts.op_args[2]],
                        expert_down_types=[t for m in moes for t in m.experts.op_args[3]])
        return self._stack
