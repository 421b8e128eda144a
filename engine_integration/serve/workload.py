"""The demo's multi-turn chat: users with real questions, some sharing a system prompt.

Users 0, 1, 3, 4, ... share one system prompt (a chat service's common instructions); every
third user has its own. Each asks a few questions on one topic, each turn's question
following the model's previous answer, so the cache sees both kinds of reuse a chat service
has: one user's growing history, and a prefix common to many users.

`ChatHistory` keeps one user's conversation as the token ids the model saw and produced:
the next prompt is those ids plus the tokens of what the chat template adds for the new
turn, never a re-tokenization of the whole text (which could tokenize the model's answer
differently and so miss the cache). Models without a chat template (the built-in random one)
get a plain "User: ... / Assistant:" format. A base model (Gemma 3 in the demo) reads the
help desk's `REFERENCE_NOTES` after its system prompt: a transcript it can continue, and
prompts long enough to pass a 512-token sliding window from the first turn. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SHARED_SYSTEM = (
    "You are a friendly and knowledgeable assistant at a public library's help desk. "
    "Visitors of every age come to you with questions about science, history, geography, "
    "technology, cooking and everyday life. Answer in clear, plain English, in two or three "
    "short sentences, so that a curious twelve-year-old could follow. Start with the direct "
    "answer, then add one helpful detail or example. Prefer well-established facts; when "
    "something is uncertain, debated or depends on the situation, say so plainly instead of "
    "guessing. Never invent names, dates, numbers or quotations. Do not use lists, tables or "
    "headings unless the visitor asks for them, and keep a warm, patient and encouraging "
    "tone. If a question is unclear, answer its most likely meaning and say which meaning "
    "you chose. If a visitor asks a follow-up question, answer it in the context of the "
    "conversation so far, without repeating what you already said. If a question is about "
    "health, law or money, give general information only and suggest asking a qualified "
    "professional. Be respectful of every culture and opinion, and when you do not know "
    "something, say so and suggest where in the library the visitor could look it up."
)
OWN_SYSTEM = (
    "You are a patient cooking teacher who helps beginners in their first kitchen. "
    "Give practical, safe advice with concrete times and temperatures, in a few sentences."
)
TOPICS = (
    ("What is the capital of France?", "What is it famous for?",
     "Name one museum there worth visiting.", "How tall is the Eiffel Tower?"),
    ("Why is the sky blue?", "Then why are sunsets red?",
     "Is the sky blue on Mars too?", "Can you say all that in one sentence?"),
    ("How do I boil an egg?", "How long for a soft yolk?",
     "Can I do it in a microwave instead?", "Any tip for peeling it easily?"),
    ("What does a computer's memory cache do?", "Why is it faster than main memory?",
     "What is a cache hit?", "Give me an everyday analogy for it."),
    ("Who was Marie Curie?", "What did she discover?",
     "Why was her work dangerous?", "What can we learn from her life?"),
    ("How do plants make food?", "Why are leaves green?",
     "What happens to plants at night?", "Why do leaves change colour in autumn?"),
)  # fmt: skip
# The help desk's notes on the demo's topics, for a base model to answer from (~600 tokens).
REFERENCE_NOTES = (
    "Paris is the capital and largest city of France, on the river Seine. It is famous for "
    "its art, food, fashion and architecture, and for landmarks such as the Eiffel Tower, "
    "the cathedral of Notre-Dame and the Arc de Triomphe. The Louvre, once a royal palace, "
    "is the most visited art museum in the world and holds the Mona Lisa; the Musee d'Orsay "
    "shows Impressionist paintings in a former railway station. The Eiffel Tower was built "
    "for the world's fair of 1889 and is about 330 metres tall with its antennas.\n"
    "The sky looks blue because air molecules scatter short, blue wavelengths of sunlight "
    "far more than long, red ones (Rayleigh scattering). At sunrise and sunset the light "
    "crosses much more air, most of the blue is scattered away before it reaches us, and the "
    "reds and oranges remain. On Mars the thin, dusty air makes the daytime sky look "
    "butterscotch, while its sunsets look blue.\n"
    "To boil an egg, lower it into water that is already simmering. About six minutes gives "
    "a soft, runny yolk, and nine to twelve minutes a firm one. Cooling the egg in cold water "
    "straight away stops the cooking and makes it easier to peel; older eggs peel more "
    "easily than very fresh ones. Never microwave an egg in its shell: steam builds up inside "
    "and it can burst.\n"
    "A computer's memory cache is a small, very fast memory close to the processor that "
    "keeps copies of recently used data. When the processor finds what it needs there, that "
    "is a cache hit, and it avoids a slow trip to main memory; when it does not, it is a "
    "miss. A cache is like keeping the books you use most on your desk instead of walking to "
    "the library shelves each time.\n"
    "Marie Curie (1867-1934) was a Polish-born physicist and chemist who worked in Paris. "
    "With her husband Pierre she discovered the elements polonium and radium, and she coined "
    "the word radioactivity. She was the first woman to win a Nobel Prize and the only "
    "person to win Nobel Prizes in two sciences, physics and chemistry. Her work was "
    "dangerous because nobody yet knew that radiation damages living cells; she carried "
    "radioactive samples in her pockets, and her notebooks are still radioactive today.\n"
    "Plants make their food by photosynthesis: in their leaves, the green pigment "
    "chlorophyll captures sunlight and uses its energy to turn water and carbon dioxide into "
    "sugar, releasing oxygen. Leaves look green because chlorophyll reflects green light. At "
    "night there is no light for photosynthesis, so plants only respire, using some of the "
    "sugar they made by day. In autumn many trees stop making chlorophyll, and the yellow and "
    "orange pigments that were hidden underneath show through."
)
FOLLOW_UPS = ("Can you explain that more simply?", "Tell me one more interesting fact about it.")


@dataclass(frozen=True)
class Conversation:
    user: int
    system_prompt: str
    questions: tuple[str, ...]  # one per turn


def make_conversations(
    num_users: int, num_turns: int, *, notes: str | None = None
) -> list[Conversation]:
    """`notes`: text every system prompt ends with (`REFERENCE_NOTES` for a base model)."""
    conversations = []
    for user in range(num_users):
        system = OWN_SYSTEM if user % 3 == 2 else SHARED_SYSTEM
        if notes:
            system = f"{system}\n\nReference notes:\n{notes}"
        topic = TOPICS[2] if user % 3 == 2 else TOPICS[[0, 1, 3, 4, 5][(user - user // 3) % 5]]
        questions = [*topic, *FOLLOW_UPS]
        turns = tuple(questions[t % len(questions)] for t in range(num_turns))
        conversations.append(Conversation(user, system, turns))
    return conversations


@dataclass
class ChatHistory:
    """One user's conversation so far, as token ids (see the module docstring).
    `tokenizer`: encode / decode, eos_id and, if it has one, apply_chat_template."""

    tokenizer: object
    system_prompt: str
    messages: list[dict[str, str]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    @property
    def _templated(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_for(self, question: str) -> list[int]:
        """The prompt of the next turn: the history's ids and the new turn's."""
        if not self.messages:
            self.messages.append({"role": "system", "content": self.system_prompt})
        before = self._render(add_generation_prompt=False) if len(self.messages) > 1 else None
        self.messages.append({"role": "user", "content": question})
        after = self._render(add_generation_prompt=True)
        if before is None:
            return self.token_ids + self.tokenizer.encode(after)
        if not after.startswith(before):
            raise ValueError(
                "the chat template does not render a conversation as a prefix of its continuation"
            )
        added = self._after_answer(before) + after[len(before) :]
        return self.token_ids + self.tokenizer.encode(added, continuation=True)

    def add_answer(self, prompt: list[int], output: list[int]) -> str:
        """Record the model's answer (its tokens, as generated); returns its text."""
        eos = self.tokenizer.eos_id
        ended = bool(output) and output[-1] == eos
        answer_ids = output[:-1] if ended else output
        text = self.tokenizer.decode(answer_ids)
        self.messages.append({"role": "assistant", "content": text})
        closing = [eos] if (self._templated and eos is not None) else []
        self.token_ids = prompt + answer_ids + closing
        return text

    def _render(self, *, add_generation_prompt: bool) -> str:
        return render_chat(
            self.tokenizer, self.messages, add_generation_prompt=add_generation_prompt
        )

    def _after_answer(self, rendered: str) -> str:
        """What the template puts after the last answer, less the end-of-turn token the
        history already holds (the model generated it, or add_answer closed the turn)."""
        answer = self.messages[-2]["content"] if self.messages[-1]["role"] == "user" else ""
        found = rendered.rfind(answer) if answer else -1
        end = found + len(answer) if found >= 0 else len(rendered)
        tail = rendered[end:]
        eos_text = getattr(self.tokenizer, "eos_text", None)
        if self._templated and eos_text and tail.startswith(eos_text):
            tail = tail[len(eos_text) :]
        return tail


def render_chat(tokenizer, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
    """The text of a conversation: the tokenizer's chat template if it has one, else a
    plain "System: / User: / Assistant:" format."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    parts = []
    for message in messages:
        if message["role"] == "system":
            parts.append(f"System: {message['content']}\n")
        elif message["role"] == "user":
            parts.append(f"\nUser: {message['content']}\nAssistant:")
        else:
            parts.append(f" {message['content']}")
    return "".join(parts)
