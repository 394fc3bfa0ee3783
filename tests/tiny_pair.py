"""A target and draft small enough to enumerate the target's distribution exactly: random weights
over an 8-token vocabulary, for the sampling-statistics tests."""
import itertools

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ssd.exactness import pooled_p_value
from ssd.speculative.sources.beside import Beside


V, NEW = 8, 6  # a vocabulary small enough to enumerate the target's distribution exactly
PROMPT = "w2 w5 w3"
CHARS_PROMPT = "cfd"  # the same token ids in the `chars` pair's tokenizer


def make_tiny_pair(tmp_path_factory, tied: bool = False, chars: bool = False):
    """A random target over an 8-token vocabulary and a noisy copy of it as the draft
    (tied: the output layer is the input embedding, as in Qwen2.5's small models). chars: the
    tokens are the letters a..h (token i is chr(97 + i), b the end token) in a byte-level
    tokenizer that constraints can read (llguidance cannot read a word-level one)."""
    if chars:
        tok = Tokenizer(models.BPE({c: i for i, c in enumerate("abcdefgh")}, merges=[]))
        tok.decoder = decoders.ByteLevel()
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="b")
    else:
        tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1")
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        # Peaked, varied next-token distributions (tied, the input embedding scales too, and
        # a larger factor makes every sequence repeat its last token).
        target.lm_head.weight.mul_(2 if tied else 40)
    folders = []
    for name, noise in (("target", 0.0), ("draft", 0.6)):
        folder = tmp_path_factory.mktemp(name)
        state = {n: w + noise * w.std() * torch.randn_like(w) if w.dim() > 1 else w.clone()
                 for n, w in target.state_dict().items() if not (tied and n == "lm_head.weight")}
        target.config.save_pretrained(folder)
        save_file(state, folder / "model.safetensors")
        fast.save_pretrained(folder)
        folders.append(folder)
    return folders


def exact_joint(folder, prompt_ids: list[int], temperature: float, adjust=None) -> torch.Tensor:
    """P(t_1..t_NEW) [V]*NEW under the target, from all V^(NEW-1) continuations at once.
    adjust(logits [N, NEW, V], ids [N, P + NEW - 1]) -> logits: a request's changes to the
    logits (penalties, bias, a mask), applied before the temperature."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    conts = torch.tensor(list(itertools.product(range(V), repeat=NEW - 1)))
    ids = torch.cat([torch.tensor(prompt_ids).expand(len(conts), -1), conts], 1)
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt_ids) - 1:]
        if adjust is not None:
            logits = adjust(logits, ids)
        logp = (logits / temperature).log_softmax(-1)  # [N, NEW, V]
    joint = logp[:, -1]  # log P(t_NEW | t_1..t_{NEW-1}) for each continuation
    for i in range(NEW - 1):
        joint = joint + logp[:, i].gather(1, conts[:, i:i + 1])
    return joint.exp().view(*[V] * NEW)


def marginal_p_values(tokens: torch.Tensor, joint: torch.Tensor) -> list[float]:
    """Per output position, the p-value of the tokens drawn there ([n, NEW]) against the
    target's exact marginal (from exact_joint)."""
    return [pooled_p_value(tokens[:, i].bincount(minlength=V).double(),
                           joint.sum(dim=[d for d in range(NEW) if d != i])) for i in range(NEW)]


def drafter(llm):
    """The engine's draft itself (a draft model's DraftModel, a head's FeatureHead), whether or
    not prompt lookup is beside it (ssd/speculative/sources/beside.py)."""
    source = llm.engine.source
    return source.draft if isinstance(source, Beside) else source
