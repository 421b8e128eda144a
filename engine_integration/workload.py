"""A multi-turn chat workload: several users, each turn appending to the user's history.

Users share a system prompt in groups (users 0, 1, 3, 4, ... share one; every third user
has a system prompt of its own), so the cache sees both kinds of reuse a chat service
has: one user's growing history, and a prefix common to many users. The text is drawn
from a fixed vocabulary with a seeded generator, so every run asks the same questions.
Torch-free.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = (
    "cache page tier memory host device storage prefix token window layer attention "
    "request batch latency throughput bandwidth eviction policy replay index radix shard "
    "copy kernel stream event pinned write read hit miss warm cold model prompt answer "
    "question history system user turn budget capacity planning cluster node daemon"
).split()


@dataclass(frozen=True)
class Conversation:
    user: int
    system_prompt: str
    messages: tuple[str, ...]  # one user message per turn


def _text(rng: random.Random, num_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(num_words)]
    sentences, i = [], 0
    while i < len(words):
        size = rng.randint(6, 14)
        sentences.append(" ".join(words[i : i + size]).capitalize() + ".")
        i += size
    return " ".join(sentences)


def make_conversations(
    num_users: int,
    num_turns: int,
    seed: int = 0,
    *,
    system_words: int = 100,
    message_words: int = 16,
) -> list[Conversation]:
    rng = random.Random(seed)
    shared = "You are a helpful assistant for a KV cache team. " + _text(rng, system_words)
    conversations = []
    for user in range(num_users):
        own = f"You are user {user}'s research assistant. " + _text(rng, system_words)
        system = own if user % 3 == 2 else shared
        messages = tuple(_text(rng, message_words) for _ in range(num_turns))
        conversations.append(Conversation(user, system, messages))
    return conversations


def turn_text(conversation: Conversation, turn: int) -> str:
    """The text a turn appends to the history (before the model's answer)."""
    head = f"System: {conversation.system_prompt}\n" if turn == 0 else ""
    return f"{head}\nUser: {conversation.messages[turn]}\nAssistant:"
