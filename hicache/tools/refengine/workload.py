"""A multi-turn agentic workload and the closed loop that drives it through an engine.

Each conversation starts with a long first prompt (a system prompt plus a task); every later turn's
prompt is the previous prompt + the previous answer + a new message (a tool result or a user
reply). Conversations run concurrently, each submitting its next turn as soon as its previous one
finished, as agents do (`drive`); or turn by turn, every conversation's turn at once, through
several engines in turn (`drive_interleaved`, which ``hicache replay`` compares engines with).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache.tools.refengine.engine import Engine, Request


@dataclass(frozen=True)
class Conversation:
    """The token ids a conversation adds: a first prompt, then one message per later turn."""

    cid: int
    first: list[int]
    messages: list[list[int]]
    answer_tokens: int

    @property
    def turns(self) -> int:
        return 1 + len(self.messages)


def make_workload(
    conversations: int,
    turns: int,
    first_tokens: int,
    message_tokens: int,
    answer_tokens: int,
    vocab_size: int,
    seed: int = 0,
) -> list[Conversation]:
    """Random token ids (seeded); message lengths vary by up to ±25% around `message_tokens`."""
    for name, value in (
        ("conversations", conversations),
        ("turns", turns),
        ("first_tokens", first_tokens),
        ("answer_tokens", answer_tokens),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if message_tokens < 1 and turns > 1:
        raise ValueError("message_tokens must be at least 1 when there is more than one turn")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    out = []
    for cid in range(conversations):
        msgs = []
        for _ in range(turns - 1):
            spread = max(1, message_tokens // 4)
            msgs.append(tokens(max(1, message_tokens + rng.randint(-spread, spread))))
        out.append(Conversation(cid, tokens(first_tokens), msgs, answer_tokens))
    return out


def drive(
    engine: Engine, convs: list[Conversation], on_finish: Callable[[Request], None] | None = None
) -> list[list[Request]]:
    """Run every conversation to its last turn; return each conversation's requests by turn."""
    done: list[list[Request]] = [[] for _ in convs]

    def submit(conv: Conversation, prompt: list[int]) -> None:
        turn = len(done[conv.cid])
        engine.add(Request(f"c{conv.cid}t{turn}", prompt, conv.answer_tokens))

    by_rid: dict[str, Conversation] = {}
    for conv in convs:
        by_rid[f"c{conv.cid}t0"] = conv
        submit(conv, list(conv.first))
    while engine.busy:
        for req in engine.step():
            conv = by_rid.pop(req.rid)
            done[conv.cid].append(req)
            if on_finish is not None:
                on_finish(req)
            turn = len(done[conv.cid])
            if turn < conv.turns:
                nxt = req.prompt + req.output + conv.messages[turn - 1]
                by_rid[f"c{conv.cid}t{turn}"] = conv
                submit(conv, nxt)
    return done


def drive_interleaved(
    engines: list[Engine],
    convs: list[Conversation],
    on_finish: Callable[[Request], None] | None = None,
) -> tuple[list[list[list[Request]]], list[float]]:
    """Run the conversations through every engine, interleaved turn by turn, so that other work
    on the machine falls on every engine alike: turn t of every conversation is submitted to
    one engine at once and run until it is idle, then to the next; the order rotates by one
    each turn. Each engine's prompts are built from its own answers. Returns, per engine, each
    conversation's requests by turn, and the seconds the engine ran."""
    done: list[list[list[Request]]] = [[[] for _ in convs] for _ in engines]
    elapsed = [0.0] * len(engines)
    turns = max(c.turns for c in convs)
    for turn in range(turns):
        order = list(range(len(engines)))
        order = order[turn % len(order) :] + order[: turn % len(order)]
        for e in order:
            engine, mine = engines[e], done[e]
            for conv in convs:
                if turn < conv.turns:
                    prompt = list(conv.first)
                    if turn:
                        last = mine[conv.cid][-1]
                        prompt = last.prompt + last.output + conv.messages[turn - 1]
                    engine.add(Request(f"c{conv.cid}t{turn}", prompt, conv.answer_tokens))
            started = time.perf_counter()
            while engine.busy:
                for req in engine.step():
                    mine[int(req.rid[1:].split("t")[0])].append(req)
                    if on_finish is not None:
                        on_finish(req)
            elapsed[e] += time.perf_counter() - started
    return done, elapsed
