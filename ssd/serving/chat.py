"""`ssd chat`: a multi-turn conversation in the terminal, streamed, with a metrics line after
each reply. Ctrl-C stops the reply being generated (between engine steps, so an SSD
exchange is never cut in the middle) and the conversation goes on; Ctrl-D or /exit leaves.
"""
import dataclasses
import signal
import sys
from typing import TextIO

from ssd.errors import SSDError
from ssd.llm import LLM
from ssd.outputs import RequestMetrics
from ssd.sampling_params import SamplingParams
from ssd.speculative.options import parse_k

HELP = """commands:
  /reset          forget the conversation (the system message stays)
  /system TEXT    set the system message and start over (/system alone: remove it)
  /mode [ar|MODE] show the mode; 'ar' decodes plainly, the started mode (sd/ssd) speculates again
  /k N|auto       draft tokens per round (sd/ssd; at most the K the chat was started with)
  /temp X         sampling temperature (0: greedy)
  /metrics        totals of this conversation
  /help           this list
  /exit           leave (Ctrl-D too). Ctrl-C stops a reply."""
GREEN, RESET = "\033[32m", "\033[0m"


class Chat:
    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None, show_draft: bool = False,
                 out: TextIO = sys.stdout, err: TextIO = sys.stderr):
        self.llm, self.params, self.show_draft, self.out, self.err = llm, params, show_draft, out, err
        self.system = system
        self.turns: list[dict] = []  # user and assistant messages, oldest first
        self.k: int | str = llm.speculate_k  # the K to return to after /mode ar
        self.totals = RequestMetrics()
        self.replies = 0
        self._stop = False
        self.colour = show_draft and out.isatty()

    # ---- the conversation ---------------------------------------------------------------
    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def fit(self) -> SamplingParams | None:
        """Drop the oldest turns until the conversation and max_tokens fit in the context;
        with only the newest message left, shorten max_tokens. None: it cannot fit."""
        dropped = 0
        while True:
            n = len(self.llm.encode(self.messages()))
            room = self.llm.config.max_model_len - n
            if room >= self.params.max_tokens or len(self.turns) == 1:
                break
            self.turns = self.turns[2:] if self.turns[0]["role"] == "user" and len(self.turns) > 2 else self.turns[1:]
            dropped += 1
        if dropped:
            self.note(f"[the context is full: dropped the {dropped} oldest message(s)]")
        if room < 1:
            self.note(f"[the message is too long: {n} tokens, the context holds {self.llm.config.max_model_len}]")
            return None
        return self.params if room >= self.params.max_tokens else dataclasses.replace(self.params, max_tokens=room)

    def say(self, text: str) -> None:
        """One user message and the model's reply, streamed."""
        self.turns.append({"role": "user", "content": text})
        params = self.fit()
        if params is None:
            self.turns.pop()
            return
        reply, ids, flags, ends = [], [], [], []
        last = None
        self._stop = False
        previous = signal.signal(signal.SIGINT, self._interrupt)
        stream = self.llm.stream(self.messages(), params)
        try:
            for chunk in stream:
                ids += chunk.token_ids
                flags += chunk.from_draft
                self.out.write(self._marked(chunk.text, ids, flags, ends, len("".join(reply))) if self.colour
                               else chunk.text)
                self.out.flush()
                reply.append(chunk.text)
                last = chunk
                if self._stop:
                    break
        finally:
            stream.close()  # frees the request at once when the reply was stopped
            signal.signal(signal.SIGINT, previous)
        self.out.write("\n")
        self.turns.append({"role": "assistant", "content": "".join(reply)})
        if last is None or last.metrics is None:
            self.note("[stopped]")
            return
        self.replies += 1
        self._add(last.metrics)
        self.note(self.metrics_line(last.metrics))

    def _interrupt(self, signum, frame) -> None:
        self._stop = True

    def _marked(self, text: str, ids: list[int], flags: list[bool], ends: list[int], start: int) -> str:
        """text (the characters start.. of the reply) with the accepted draft tokens in green;
        ends[i]: the length of the reply's first i+1 tokens decoded (extended here)."""
        out, colour = [], False
        for i in range(len(ends), len(ids)):
            ends.append(len(self.llm.tokenizer.decode(ids[:i + 1], skip_special_tokens=True)))
        token = 0
        for j, ch in enumerate(text):
            while token < len(ends) - 1 and ends[token] <= start + j:
                token += 1
            want = flags[token]
            if want != colour:
                out.append(GREEN if want else RESET)
                colour = want
            out.append(ch)
        return "".join(out) + (RESET if colour else "")

    def metrics_line(self, m: RequestMetrics) -> str:
        line = f"[{m.output_tokens} tokens, {m.tokens_per_second:.1f} tok/s, TTFT {m.ttft_s:.2f} s"
        if m.cached_tokens:  # the conversation so far, read from the prefix cache
            line += f", {m.cached_tokens} of {m.prompt_tokens} prompt tokens cached"
        if m.drafted:
            line += (f", acceptance {m.acceptance_rate:.0%}, mean accepted length {m.mean_accepted_length:.2f}"
                     + (f", K {m.mean_k:.1f}" if m.mean_k else ""))
        if m.hits + m.misses:
            line += f", cache hit rate {m.cache_hit_rate:.0%}"
        return line + "]"

    def _add(self, m: RequestMetrics) -> None:
        t = self.totals
        for f in ("prompt_tokens", "cached_tokens", "output_tokens", "ttft_s", "decode_s", "rounds", "drafted", "accepted", "hits",
                  "misses"):
            setattr(t, f, getattr(t, f) + getattr(m, f))
        t.k_hist = [a + b for a, b in zip(t.k_hist + [0] * len(m.k_hist), m.k_hist + [0] * len(t.k_hist))]

    def note(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    # ---- commands -------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; False: leave."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.note(HELP)
        elif name == "/reset":
            self.turns = []
            self.note("[conversation reset]")
        elif name == "/system":
            self.system, self.turns = arg or None, []
            self.note(f"[system message {'set' if arg else 'removed'}; conversation reset]")
        elif name == "/mode":
            self.mode(arg)
        elif name == "/k":
            self.set_k(arg)
        elif name == "/temp":
            try:
                self.params = dataclasses.replace(self.params, temperature=float(arg))
                self.note(f"[temperature {self.params.temperature:g}]")
            except (ValueError, SSDError) as e:
                self.note(f"[/temp needs a number >= 0: {e}]")
        elif name == "/metrics":
            t = self.totals
            self.note(f"[{self.replies} replies, {t.prompt_tokens} prompt tokens ({t.cached_tokens} cached), "
                      f"{t.output_tokens} output tokens, "
                      f"{(t.output_tokens - self.replies) / t.decode_s if t.decode_s else 0:.1f} tok/s, mean TTFT "
                      f"{t.ttft_s / max(self.replies, 1):.2f} s"
                      + (f", acceptance {t.acceptance_rate:.0%}, mean accepted length {t.mean_accepted_length:.2f}"
                         if t.drafted else "")
                      + (f", cache hit rate {t.cache_hit_rate:.0%}" if t.hits + t.misses else "") + "]")
        else:
            self.note(f"[unknown command {name}; /help lists them]")
        return True

    def mode(self, arg: str) -> None:
        started = self.llm.config.mode
        plain = started != "ar" and self.llm.speculate_k == 0
        if not arg:
            k = "" if started == "ar" else f", K {self.llm.speculate_k}"
            self.note(f"[mode {'ar' if plain else started} (started as {started}){k}]")
        elif arg == "ar" and started != "ar":
            self.llm.set_speculate_k(0)
            self.note("[mode ar: plain decoding, the draft idle]")
        elif arg == started:
            if plain:
                self.llm.set_speculate_k(self.k or 1)
            self.note(f"[mode {started}, K {self.llm.speculate_k}]")
        else:
            self.note(f"[this chat was started in mode {started}; it can switch between ar and {started} only. "
                      f"Start `ssd chat --mode {arg}` for {arg}]" if arg in ("ar", "sd", "ssd")
                      else f"[unknown mode {arg!r}: ar, sd or ssd]")

    def set_k(self, arg: str) -> None:
        try:
            k = parse_k(arg)
            self.llm.set_speculate_k(k)
        except SSDError as e:
            self.note(f"[{e}]")
            return
        if k != 0:
            self.k = k
        self.note(f"[K {k}" + (": plain decoding" if k == 0 else "") + "]")


def chat(llm: LLM, params: SamplingParams, system: str | None = None, show_draft: bool = False) -> None:
    """The read-reply loop on stdin/stdout; returns on Ctrl-D or /exit."""
    session = Chat(llm, params, system, show_draft)
    session.note(f"ssd chat: {llm.config.model.name} ({llm.config.mode}). /help lists the commands; Ctrl-C stops a reply, "
                 "Ctrl-D or /exit leaves.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:
            session.note("\n[Ctrl-D or /exit leaves]")
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            if not session.command(line):
                return
            continue
        try:
            session.say(line)
        except SSDError as e:
            session.note(f"[{e}]")
        except KeyboardInterrupt:  # before the reply's own Ctrl-C handler was in place
            if session.turns and session.turns[-1]["role"] == "user":
                session.turns.pop()
            session.note("\n[stopped]")
