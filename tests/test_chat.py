"""`ssd chat` in a real terminal (pexpect), on SmolLM2."""
import re
import sys

import pexpect
import pytest

from ssd import SamplingParams

PROMPT = "> "


def spawn(*args: str) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "ssd.cli", "chat", "--model", "smollm2-135m-instruct",
                                           "--temperature", "0", *args], encoding="utf-8", timeout=120,
                          dimensions=(40, 200))
    child.expect("/help lists the commands")
    child.expect_exact(PROMPT)
    return child


def ask(child: pexpect.spawn, line: str) -> str:
    """Send a line; return what came back before the next prompt."""
    child.sendline(line)
    child.expect_exact(PROMPT)
    return child.before


def reply_text(output: str, line: str) -> str:
    """The streamed reply in an exchange's output: after the echoed line, before the metrics line."""
    body = output.split(line, 1)[1]
    return re.sub(r"\r?\n\[\d+ tokens.*$", "", body, flags=re.S).strip()


def test_a_conversation_with_commands(smollm):
    child = spawn("--max-tokens", "24")
    first = ask(child, "What is the capital of France?")
    expected = smollm.generate([{"role": "user", "content": "What is the capital of France?"}],
                               SamplingParams.greedy(max_tokens=24))[0]
    assert reply_text(first, "France?") == expected.text.strip()
    assert re.search(r"\[\d+ tokens, [\d.]+ tok/s, TTFT [\d.]+ s\]", first)
    # The second turn sees the first: its prompt is the whole conversation.
    second = ask(child, "And of Italy?")
    history = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": expected.text}, {"role": "user", "content": "And of Italy?"}]
    assert reply_text(second, "Italy?") == smollm.generate(history, SamplingParams.greedy(max_tokens=24))[0].text.strip()
    # ... and reads the first turn from the prefix cache: all its full blocks.
    cached, prompt = map(int, re.search(r"(\d+) of (\d+) prompt tokens cached", second).groups())
    assert cached >= (prompt - 16) // 16 * 16 - 16
    assert "unknown command /bogus" in ask(child, "/bogus")
    assert "/reset" in ask(child, "/help")
    assert "temperature 0.5" in ask(child, "/temp 0.5")
    assert "needs a number" in ask(child, "/temp hot")
    assert "no draft model" in ask(child, "/k 3")
    assert "2 replies" in ask(child, "/metrics")
    assert "conversation reset" in ask(child, "/reset")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on():
    child = spawn("--max-tokens", "3000", "--ignore-eos")
    child.sendline("Write a very long story about a dragon.")
    child.expect_exact("dragon.\r\n")  # the echo of the line
    child.expect(r"\S{5}")  # the reply has started streaming
    child.sendintr()
    child.expect_exact("[stopped]")
    child.expect_exact(PROMPT)
    assert "2 tokens" not in ask(child, "/metrics")  # the stopped reply is not counted as a finished one
    out = ask(child, "/reset")
    assert "conversation reset" in out
    child.sendeof()  # Ctrl-D leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_the_oldest_turns_are_dropped_when_the_context_is_full():
    child = spawn("--max-model-len", "160", "--max-tokens", "40")
    for i in range(4):
        out = ask(child, f"Tell me fact number {i} about the sea.")
    assert "dropped the" in out
    child.sendline("/exit")
    child.expect(pexpect.EOF)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_speculative_chat_shows_draft_tokens(mode, smollm_dir):
    # The target as its own draft costs a target pass a token: auto-K would (rightly) never draft.
    fixed = ("--k", "8") if mode == "sd" else ()
    child = spawn("--mode", mode, "--draft", str(smollm_dir), *fixed, "--max-tokens", "24", "--show-draft")
    out = ask(child, "What is the capital of France?")
    assert "\x1b[32m" in out  # accepted draft tokens in green
    assert re.search(r"acceptance \d+%, mean accepted length [\d.]+", out)
    if mode == "ssd":
        assert "cache hit rate" in out
    assert "mode sd" in ask(child, "/mode") if mode == "sd" else "mode ssd" in ask(child, "/mode")
    assert "plain decoding" in ask(child, "/mode ar")
    out = ask(child, "Hello!")
    assert "acceptance" not in out and "\x1b[32m" not in out
    assert "K 2" in ask(child, "/k 2")
    # The most K may be: the K it was started with (8), SSD's default K (4) there.
    assert ("0..8" if mode == "sd" else "0..4") in ask(child, "/k 9")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
