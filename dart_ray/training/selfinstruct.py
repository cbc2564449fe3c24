"""Diverse chat prompts made offline by the target itself (self-instruct), cleaned and deduplicated.

``dart-ray gen-prompts`` asks the target to continue a numbered list of user requests: a few-shot
meta-prompt names a seed category and one of its sub-topics and lists three example requests of
the category; the target writes item 4 (sampled, one line). Small instruct models follow this
list-continuation form far better than an instruction to "write a request" through the chat
template (measured on SmolLM2-135M: list items are requests; chat replies mostly answer the
examples instead).

Every generated line goes through, in order:

1. :func:`clean_request`: strip list markers and quotes, one line, 4-60 words and 16-360
   characters, must look like a request (a question, or an imperative / "can you" / "I need"
   opening), no meta-talk about the list, no URLs or markup, no degenerate repetition;
2. :class:`~dart_ray.training.neardup.EvalFilter`: dropped if a near-duplicate of any evaluation
   prompt the project ships (HumanEval, ``dart_ray/bench/data/*``);
3. :class:`~dart_ray.training.neardup.NearDupIndex`: dropped if a near-duplicate (word-bigram
   Jaccard >= 0.7) of a prompt kept earlier or of a few-shot example.

**Style ``pre-query``** (Magpie, Xu et al. 2024) asks for nothing: the target samples from its own
chat template cut just before the user's text (``<|im_start|>system ... <|im_start|>user\\n``), so
it writes the kind of request its instruction tuning saw, from its own prior over users instead of
from ten hand-made categories. On SmolLM2-135M-Instruct at temperature 1 these are everyday requests
("I'm planning a solo camping trip to the mountains ... Can you help me plan it?"); the ones cut by
the token limit or spread over several lines are dropped, the rest go through the same filters.
Neither style's held-out split predicts serving: a drafter trained on list-style answers scored
0.63 level-1 top-1 on their held-out split and 0.46 on the target's answers to requests written
apart from every generator (``gen-data --eval-prompts``), where the target itself is less sure
(mean top-1 probability 0.585 on those answers vs 0.688 on its answers to its own pre-query
requests; issue 17, thirteenth sitting).

A fraction of the kept prompts is marked ``multi_turn``: ``gen-data`` answers them, then the target
writes a follow-up user turn that refers back to its own answer (:func:`followup_meta_prompt`,
same cleaning), then answers that; the training row is the whole two-turn conversation.

Output: ``DIR/prompts-NNNNN.jsonl`` shards, each written atomically (temp file + rename), rows
``{"prompt", "category", "subtopic", "multi_turn", "source": "chat"}``, and ``DIR/stats.json``.
Shard i's plan (categories, sub-topics, examples, seeds) depends only on ``seed`` and i, and
requests are sampled with per-request seeds on a fixed tree schedule, so a restarted run rebuilds
the filters from the shards on disk and continues with the first missing shard, producing what
an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dart_ray.training.neardup import DEFAULT_THRESHOLD, EvalFilter, NearDupIndex


@dataclass(frozen=True)
class Category:
    name: str
    description: str
    """How the meta-prompt names the category."""
    subtopics: tuple[str, ...]
    examples: tuple[str, ...]
    """Hand-written requests of the category (three are shown per meta-prompt)."""


CATEGORIES: tuple[Category, ...] = (
    Category("writing", "creative and practical writing", (
        "a poem about the sea", "a short story opening", "a speech for a school event",
        "a product announcement", "a blog post introduction", "a cover letter", "a formal apology",
        "song lyrics", "a fable with a moral", "a newsletter for neighbours",
        "a travel diary entry", "a slogan for a charity run"), (
        "Write a short poem about an old train station at night.",
        "Write the opening paragraph of a mystery novel set on a fishing boat.",
        "Compose a four-line verse about autumn leaves falling in a park.",
        "Write a two-minute speech welcoming new students to a robotics club.",
        "Draft an announcement for a community garden opening next Saturday.",
        "Write a fable about a tortoise who wants to learn to fly.")),
    Category("roleplay", "role-play and pretend conversations", (
        "a job interviewer", "a tour guide in ancient Rome", "a medieval shopkeeper",
        "a ship captain", "a patient language tutor", "a detective questioning a witness",
        "a museum curator", "a fitness coach", "a customer support agent",
        "a famous scientist from history", "a dungeon master", "a radio host"), (
        "Pretend you are a pirate captain and describe your ship to a new crew member.",
        "Act as a Spanish tutor and ask me three simple questions about my day.",
        "You are a museum guide. Introduce the dinosaur hall to a group of children.",
        "Play the role of a strict chess coach reviewing my opening moves.",
        "Imagine you are Marie Curie and explain what excites you about your research.",
        "Be a game master and start a short fantasy adventure for me.")),
    Category("reasoning", "logic and common-sense reasoning", (
        "a logic puzzle", "cause and effect", "comparing two options",
        "spotting a flaw in an argument", "ordering events", "a riddle", "scheduling constraints",
        "probability intuition", "analogies", "planning under limits", "who-owns-what puzzles",
        "estimation questions"), (
        "If all bloops are razzies and some razzies are lazzies, must some bloops be lazzies? "
        "Explain.",
        "Three friends sit in a row. Ana is not at the end and Ben is left of Ana. Who sits where?",
        "Which is heavier, a kilogram of feathers or a kilogram of iron, and why do people get it "
        "wrong?",
        "Find the flaw in this argument: every time I carry an umbrella it rains, so umbrellas "
        "cause rain.",
        "Roughly how many piano tuners work in a city of one million people? Walk through your "
        "estimate.",
        "I can visit the bank, the post office and the bakery, but the bank closes first. Plan my "
        "route.")),
    Category("math", "math word problems and calculations", (
        "percentages", "fractions", "unit conversion", "simple interest", "geometry of circles",
        "averages", "linear equations", "ratios in recipes", "speed and distance",
        "counting combinations", "area of a room", "time zones arithmetic"), (
        "A jacket costs $60 after a 25% discount. What was the original price?",
        "Solve 4x - 9 = 15 and show each step.",
        "What is the probability of getting exactly two heads in three coin flips?",
        "A train travels 180 km in 2.5 hours. What is its average speed in km/h?",
        "How many different three-letter codes can be made from the letters A to E without "
        "repeats?",
        "A recipe for 4 people uses 300 g of rice. How much rice do I need for 7 people?")),
    Category("coding", "programming help", (
        "Python lists", "string processing", "SQL queries", "JavaScript arrays",
        "debugging an error", "reading files", "regular expressions", "recursion",
        "classes and objects", "unit tests", "shell commands", "sorting data"), (
        "Write a Python function that merges two sorted lists into one sorted list.",
        "Why does my JavaScript loop print the same number five times?",
        "How do I read a CSV file and compute the average of one column in Python?",
        "Write a SQL query that lists customers who placed more than three orders.",
        "Explain what a KeyError means in Python and how to avoid it.",
        "Write a bash command that counts the lines in every .txt file in a folder.")),
    Category("extraction", "extracting and reformatting information from a given text", (
        "names and dates", "a meeting note", "a product review", "an address", "a recipe",
        "a job posting", "a news paragraph", "an email thread", "a table of prices", "a timetable",
        "contact details", "key points of a paragraph"), (
        "Extract all the dates from this text: 'The fair opens on 3 May and closes on 12 May, with "
        "a parade on 8 May.'",
        "List the ingredients mentioned here: 'Mix flour, two eggs and milk, then add a pinch of "
        "salt.'",
        "Turn this note into a bulleted to-do list: 'call the plumber, buy stamps, send the report "
        "by Friday'.",
        "From this review, what did the customer like and dislike? 'Great battery, but the screen "
        "scratches easily.'",
        "Convert this sentence into JSON with name and age fields: 'Maria is 34 and Tom is 29.'",
        "Summarize the main request in this email: 'Hi, could you send me the slides before the "
        "call? Thanks.'")),
    Category("stem", "science, technology and medicine explained", (
        "photosynthesis", "black holes", "how batteries work", "the human heart", "earthquakes",
        "DNA", "magnets", "how the internet routes data", "chemical reactions in cooking",
        "ocean tides", "antibiotics", "renewable energy"), (
        "How does a refrigerator keep food cold?",
        "Explain why the Moon has phases.",
        "What is the difference between a virus and a bacterium?",
        "How do airplanes stay in the air?",
        "Why does salt melt ice on roads in winter?",
        "What does a transistor do in a computer?")),
    Category("humanities", "history, literature, philosophy, art and society", (
        "the printing press", "ancient Egypt", "a famous painting", "a philosophical question",
        "world religions", "the industrial revolution", "a classic novel", "democracy in Athens",
        "the history of jazz", "languages and dialects", "the Silk Road", "a famous speech"), (
        "Why was the invention of the printing press so important?",
        "What is the main idea of Plato's allegory of the cave?",
        "Describe the causes of the French Revolution in a few sentences.",
        "What makes the Mona Lisa so famous?",
        "How did the Silk Road change trade between Europe and Asia?",
        "What themes appear in George Orwell's novel 1984?")),
    Category("everyday advice", "practical advice for daily life", (
        "saving money", "cooking on a budget", "sleeping better", "studying for exams",
        "travelling cheaply", "cleaning the home", "dealing with stress", "caring for a pet",
        "buying a used car", "keeping a garden", "talking to a difficult neighbour",
        "organizing a schedule"), (
        "How can I stop buying snacks every time I go grocery shopping?",
        "What is a simple way to keep track of monthly bills?",
        "My neighbour plays loud music late at night. How should I bring it up?",
        "What are some cheap and healthy lunches I can take to work?",
        "How do I get my cat used to a new carrier before a trip?",
        "What should I check before buying a second-hand bicycle?")),
    Category("multi-step instructions", "tasks with several explicit steps or constraints", (
        "a study plan", "a workout routine", "a trip itinerary", "a recipe adaptation",
        "a presentation outline", "a cleaning schedule", "a project plan", "a lesson plan",
        "a comparison table", "a checklist", "a step-by-step tutorial", "an event plan"), (
        "Make a five-day study plan for a chemistry exam, with one topic per day and a short "
        "review each evening.",
        "Create a 20-minute workout with no equipment, listing each exercise, its duration and the "
        "rest time.",
        "Outline a ten-minute presentation on recycling: title, three main points and a closing "
        "question.",
        "Give me a checklist for setting up a new laptop, in order, with one line per step.",
        "Plan a two-day trip to a mountain town with a morning and an afternoon activity each day.",
        "Rewrite this recipe for a vegan diet and list every substitution you made: pancakes with "
        "eggs and milk.")),
)

META_PROMPT = """The following are requests that people sent to a helpful AI assistant.
Category: {category}. Every request is about {subtopic}.

1. {e1}
2. {e2}
3. {e3}
4."""
"""Few-shot list continuation: the target writes item 4 (one line)."""

FOLLOWUP_EXAMPLES = (
    ("How do I boil an egg?",
     "Put the egg in boiling water for about 9 minutes for a firm yolk, then cool it in cold "
     "water.",
     "What if I want the yolk a little runny? How long then?"),
    ("Write a Python function that reverses a string.",
     "def reverse(s):\n    return s[::-1]",
     "Can you change it so it also removes spaces before reversing?"),
)

FOLLOWUP_PROMPT = ("Conversations between a user and a helpful AI assistant. In each one, the "
                   "user's second message is a follow-up that refers to the assistant's "
                   "answer." + """

{examples}

User: {u1}
Assistant: {a1}
User (follow-up):""")
"""Few-shot conversations, then the real one: the target writes the user's follow-up (one line)."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def followup_meta_prompt(user: str, answer: str, max_answer_words: int = 80) -> str:
    """Meta-prompt asking the target for a follow-up to (user, answer); the answer is shortened to
    its first ``max_answer_words`` words (enough to refer back to)."""
    words = _one_line(answer).split()
    a1 = " ".join(words[:max_answer_words]) + (" ..." if len(words) > max_answer_words else "")
    ex = "\n\n".join(f"User: {u}\nAssistant: {_one_line(a)}\nUser (follow-up): {f}"
                     for u, a, f in FOLLOWUP_EXAMPLES)
    return FOLLOWUP_PROMPT.format(examples=ex, u1=_one_line(user), a1=a1)


_REFERS = frozenset(("it", "this", "these", "those", "them", "your", "again", "instead", "answer",
                     "shorter", "longer", "more", "example", "another", "else", "also"))
_STOP = frozenset(("what", "which", "when", "where", "with", "that", "this", "have", "from", "your",
                   "about", "would", "could", "should", "there", "their", "they", "will", "make",
                   "more", "some", "into", "than", "then", "them", "also", "does", "like", "just",
                   "very", "much", "many", "each", "other"))


def refers_back(followup: str, user: str, answer: str) -> bool:
    """Whether a follow-up turn plausibly continues the conversation: it refers to it ("it", "your
    answer", "another example", ...) or shares a content word (4+ letters) with the first turn or
    the answer. Drops follow-ups that start an unrelated request."""
    words = re.findall(r"[a-z]+", followup.lower())
    if _REFERS.intersection(words):
        return True
    seen = set(re.findall(r"[a-z]{4,}", (user + " " + answer).lower())) - _STOP
    return any(w in seen for w in words if len(w) >= 4 and w not in _STOP)


# ---------------------------------------------------------------------------------------------
# cleaning
# ---------------------------------------------------------------------------------------------
_OPENERS = frozenset((
    "write", "draft", "compose", "create", "make", "give", "list", "explain", "describe",
    "summarize", "summarise", "tell", "suggest", "recommend", "compare", "rewrite", "translate",
    "convert", "extract", "find", "plan", "outline", "design", "help", "show", "teach", "solve",
    "calculate", "compute", "prove", "estimate", "imagine", "pretend", "act", "play", "be", "you",
    "if", "what", "why", "how", "when", "where", "which", "who", "whom", "whose", "is", "are",
    "can", "could", "would", "should", "will", "do", "does", "did", "i", "my", "we", "our",
    "please", "turn", "generate", "name", "identify", "classify", "sort", "rank", "edit", "fix",
    "correct", "improve", "review", "analyze", "analyse", "evaluate", "discuss", "argue", "define",
    "build", "implement", "debug", "propose", "brainstorm", "prepare", "organize", "organise",
    "set", "count", "predict", "choose", "decide", "let",
))
"""First words of a request (imperatives, question words, "can you", "I need", ...)."""
_META = re.compile(r"\b(above|previous (request|question)s?|these (requests|questions)|the list|"
                   r"question number|item \d|request \d|category|"
                   r"the following (requests|questions))\b",
                   re.IGNORECASE)
_BAD = re.compile(r"https?://|www\.|<[a-z/]|\[\d+\]|@\w", re.IGNORECASE)
_MARKER = re.compile(r"^\s*(?:\d+[.)]|[-*•])\s*")


def clean_request(text: str, min_words: int = 4, max_words: int = 60, min_chars: int = 16,
                  max_chars: int = 360) -> str | None:
    """The request in a generated line, or None when it does not look like a usable user request."""
    t = text.strip().split("\n", 1)[0].strip()
    t = _MARKER.sub("", t).strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "\"'":
        t = t[1:-1].strip()
    t = _one_line(t)
    words = t.split()
    if not (min_words <= len(words) <= max_words and min_chars <= len(t) <= max_chars):
        return None
    if not (t[0].isupper() or t[0].isdigit()) or t[-1] not in ".?!:)'\"":
        return None
    if _META.search(t) or _BAD.search(t):
        return None
    if sum(c.isascii() for c in t) < 0.95 * len(t):
        return None
    low = [w.strip(".,!?;:'\"()").lower() for w in words]
    if len(set(low)) < 0.6 * len(low):                        # "very very very ..." loops
        return None
    if not ("?" in t or low[0] in _OPENERS):
        return None
    if low[0] in ("sure", "here", "yes", "no", "okay", "ok", "as", "the", "this", "answer"):
        return None
    return t


# ---------------------------------------------------------------------------------------------
# the generation plan and the run
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """One meta-prompt to send: what it asks for and the seed of its sample."""

    category: str
    subtopic: str
    prompt: str
    seed: int
    multi_turn: bool


def _seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "little")


STYLES = ("list", "pre-query")
"""How a request is asked for: ``list`` (a few-shot list of one category's requests, item 4 left
to the target) or ``pre-query`` (the chat template up to the user's text: the target's own
prior)."""

PRE_QUERY = "pre-query"
"""The ``category`` of a pre-query request (it has no category or sub-topic)."""


def pre_query_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the user's text begins (system turn included,
    as :func:`dart_ray.encode_prompt` renders it). Raises if the template does not put the user's
    text after a fixed prefix."""
    sentinel = "QQSENTINELQQ"
    full = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}],
                                         add_generation_prompt=True, tokenize=False)
    if full.count(sentinel) != 1:
        raise ValueError("the chat template does not render the user's text once")
    prefix = full[:full.index(sentinel)]
    ids = list(tokenizer.encode(prefix, add_special_tokens=False))
    whole = list(tokenizer.apply_chat_template([{"role": "user", "content": sentinel}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
    if not ids or whole[:len(ids)] != ids:
        raise ValueError("the chat template's pre-query prefix does not tokenise as a prefix of a "
                         "rendered conversation (a template that joins the user's text to the "
                         "token before it, e.g. a space after [INST]); use --style list")
    return ids


def shard_plan(shard: int, size: int, seed: int = 0, multi_turn_frac: float = 0.2,
               categories: tuple[Category, ...] = CATEGORIES, style: str = "list") -> list[Slot]:
    """The meta-prompts of shard ``shard``: categories in rotation, a random sub-topic and three
    random examples each (``style="list"``), or one sample of the pre-query prefix each
    (``"pre-query"``: ``prompt`` is empty, the caller sends the prefix); a function of
    (seed, shard, style) only."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, not {style!r}")
    rng = random.Random(_seed_of("plan", seed, shard))
    if style == PRE_QUERY:
        return [Slot(PRE_QUERY, "", "", _seed_of("pre-query", seed, shard, k),
                     rng.random() < multi_turn_frac) for k in range(size)]
    out = []
    for k in range(size):
        cat = categories[(shard * size + k) % len(categories)]
        sub = rng.choice(cat.subtopics)
        e1, e2, e3 = rng.sample(cat.examples, 3)
        out.append(Slot(cat.name, sub, META_PROMPT.format(category=cat.description, subtopic=sub,
                                                          e1=e1, e2=e2, e3=e3),
                        _seed_of("sample", seed, shard, k), rng.random() < multi_turn_frac))
    return out


@dataclass
class PromptFilters:
    """The evaluation filter and the near-duplicate index, with counts of what each dropped."""

    eval_filter: EvalFilter
    dedup: NearDupIndex
    counts: dict

    @classmethod
    def create(cls, threshold: float = DEFAULT_THRESHOLD, eval_prompts: list[str] | None = None,
               categories: tuple[Category, ...] = CATEGORIES) -> PromptFilters:
        dedup = NearDupIndex(threshold)
        for c in categories:  # copies of a few-shot example are not new prompts
            for e in c.examples:
                dedup.add(e)
        return cls(EvalFilter(eval_prompts, threshold), dedup,
                   {"generated": 0, "unclean": 0, "evaluation": 0, "duplicate": 0, "kept": 0})

    def admit(self, raw: str, complete: bool = True, one_line: bool = False) -> str | None:
        """The cleaned request if it passes every filter (and is then remembered), else None.
        ``complete``: False when generation hit its token limit (the line may be cut: dropped).
        ``one_line``: drop text spread over several lines (a whole generated user turn, whose first
        line alone may be half a request) instead of keeping its first line."""
        self.counts["generated"] += 1
        text = clean_request(raw) if complete and not (one_line and "\n" in raw.strip()) else None
        if text is None:
            self.counts["unclean"] += 1
            return None
        if text in self.eval_filter:
            self.counts["evaluation"] += 1
            return None
        if not self.dedup.add(text):
            self.counts["duplicate"] += 1
            return None
        self.counts["kept"] += 1
        return text


def write_text_atomic(text: str, dst: Path) -> None:
    """Write ``dst`` whole or not at all (temp file in the same directory, fsync, rename)."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dst)


GENERATION_FILE = "generation.json"
"""What made a generated directory's rows (the target, its dtype, the sampling): a resumed run must
make the rest the same way."""


def check_generation(out: Path, settings: dict, has_rows: bool) -> None:
    """Refuse to add rows to ``out`` made with other ``settings`` than its own (the target's model
    id and resolved dtype, the sampling knobs), which would mix two generators' text in one
    dataset; record them on a first run. A directory with rows but no record (made before the
    record existed) is continued with a warning."""
    f = out / GENERATION_FILE
    if f.is_file() and has_rows:       # without rows (a run stopped early) it is just replaced
        have = json.loads(f.read_text())
        changed = {k: (have[k], v) for k, v in settings.items() if k in have and have[k] != v}
        if changed:
            raise ValueError(f"{out} holds rows generated with other settings (was, now: "
                             f"{changed}); use a new --out, or the settings of the run that "
                             "made them")
        settings = {**have, **settings}
    elif has_rows:
        print(f"warning: {out} has rows but no {GENERATION_FILE} (made before it existed); "
              "cannot check that they were generated the same way")
    write_text_atomic(json.dumps(settings, indent=2, sort_keys=True), f)


def engine_generation(engine) -> dict:
    """The generator's identity in :func:`check_generation`: target model id and resolved dtype."""
    fp = engine.fingerprint
    return {"model": fp.model, "dtype": fp.dtype}


def _write_jsonl_atomic(rows: list[dict], dst: Path) -> None:
    write_text_atomic("".join(json.dumps(r) + "\n" for r in rows), dst)


def load_prompt_rows(prompts_dir: str | Path, limit: int | None = None) -> list[dict]:
    """The rows of every ``prompts-*.jsonl`` shard in ``prompts_dir`` (in shard order)."""
    files = sorted(Path(prompts_dir).glob("prompts-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no prompts-*.jsonl in {prompts_dir}; run `dart-ray gen-prompts` "
                                "first")
    rows = []
    for f in files:
        with open(f) as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    return rows[:limit] if limit is not None else rows


MAX_BARREN_SHARDS = 8
"""Shards in a row without a kept prompt after which :func:`generate_prompts` gives up."""


class GenerationStalledError(RuntimeError):
    """Generation goes on without keeping anything new (it would run forever)."""


def generate_prompts(out_dir: str | Path, n: int = 4000, model: str | None = None,
                     dtype: str = "auto", temperature: float = 0.9, top_p: float = 0.95,
                     max_new_tokens: int = 64, batch_size: int = 16, shard_size: int = 128,
                     seed: int = 0, multi_turn_frac: float = 0.2,
                     threshold: float = DEFAULT_THRESHOLD, threads: int | None = None,
                     max_shards: int | None = None, eval_prompts: list[str] | None = None,
                     progress: bool = True, engine=None, device: str = "cpu",
                     style: str = "list") -> Path:
    """Generate until ``n`` prompts are kept (or ``max_shards`` shards exist); resumable.
    ``style``: how requests are asked for (:data:`STYLES`; ``pre-query`` samples the chat template's
    user turn, stopping at its end-of-turn token).

    ``engine``: an :class:`~dart_ray.Engine` to use (default: one for ``model`` with plain
    decoding on a fixed schedule, so seeded samples are reproducible). ``eval_prompts``: the
    evaluation prompts to keep out (default: every one the project ships).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = {"n": n, "seed": seed, "temperature": temperature, "top_p": top_p,
              "shard_size": shard_size, "multi_turn_frac": multi_turn_frac, "threshold": threshold,
              "max_new_tokens": max_new_tokens, "style": style}
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, not {style!r}")
    if style == PRE_QUERY and temperature <= 0:
        raise ValueError("pre-query sampling needs temperature > 0: every slot asks the same "
                         "prefix, so greedy decoding writes one request over and over")
    plan_file = out / "plan.json"
    done = sorted(out.glob("prompts-*.jsonl"))
    if plan_file.is_file() and done:                  # no shard yet: nothing to mix
        old = json.loads(plan_file.read_text())
        old.setdefault("style", "list")   # plans written before styles existed
        changed = {k: (old.get(k), v) for k, v in params.items() if k != "n" and old.get(k) != v}
        if changed:
            raise ValueError(f"{out} holds prompts generated with other settings {changed}; use a "
                             "new --out")
    write_text_atomic(json.dumps(params, indent=2), plan_file)
    filters = PromptFilters.create(threshold, eval_prompts)
    if any(f.name != f"prompts-{i:05d}.jsonl" for i, f in enumerate(done)):
        raise ValueError(f"{out}: prompt shards are not numbered 0..{len(done) - 1}; use a new "
                         "--out")
    # rebuild the filters from what is on disk: a restart continues where it stopped
    earlier = load_prompt_rows(out) if done else []
    for r in earlier:
        filters.dedup.add(r["prompt"])
    kept = len(earlier)
    by_category = Counter(r["category"] for r in earlier)
    shard = len(done)
    if kept >= n or (max_shards is not None and shard >= max_shards):
        return out
    from dart_ray import SamplingParams

    if engine is None:
        from dart_ray import Engine, EngineConfig

        engine = Engine.from_config(EngineConfig(model=model, method="none", dtype=dtype,
                                                 device=device, max_batch_size=batch_size,
                                                 num_threads=threads, adaptive=False))
    check_generation(out, engine_generation(engine), has_rows=bool(done))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n, initial=kept, desc="gen-prompts", unit="prompt")
    prefix = pre_query_prefix(engine.tokenizer) if style == PRE_QUERY else None
    # a list item ends at its line; a pre-query user turn at the end-of-turn token (eos)
    stop = () if prefix is not None else ("\n",)
    barren = 0                       # shards in a row that kept nothing
    while kept < n and (max_shards is None or shard < max_shards):
        if barren >= MAX_BARREN_SHARDS:
            raise GenerationStalledError(
                f"{barren} shards in a row kept no new prompt ({kept} of {n} kept; this run: "
                f"{filters.counts}): the generator repeats itself or writes nothing clean. "
                f"Raise --temperature, lower --n, or use another --seed/--style")
        slots = shard_plan(shard, shard_size, seed, multi_turn_frac, style=style)
        sp = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             seed=s.seed, stop=stop) for s in slots]
        asks = [prefix if prefix is not None else s.prompt for s in slots]
        rows = []
        for s, c in zip(slots, engine.generate(asks, sp), strict=True):
            text = filters.admit(c.text, complete=c.finish_reason == "stop",
                                 one_line=prefix is not None)
            if text is not None:
                rows.append({"prompt": text, "category": s.category, "subtopic": s.subtopic,
                             "multi_turn": s.multi_turn, "source": "chat"})
        _write_jsonl_atomic(rows, out / f"prompts-{shard:05d}.jsonl")
        kept += len(rows)
        barren = 0 if rows else barren + 1
        by_category.update(r["category"] for r in rows)
        shard += 1
        # after every shard: a run stopped by a signal or a time box still leaves its stats
        stats = {"kept": kept, "shards": shard, "this_run": filters.counts,
                 "evaluation_prompts": len(filters.eval_filter),
                 "by_category": dict(by_category)}
        write_text_atomic(json.dumps(stats, indent=2), out / "stats.json")
        if bar is not None:
            bar.update(len(rows))
            bar.set_postfix(shards=shard,
                            **{k: v for k, v in filters.counts.items() if k != "kept"})
    if bar is not None:
        bar.close()
    return out

