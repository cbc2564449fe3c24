"""Adaptive speculation: how many draft nodes to verify this step, down to none.

A step over ``B`` rows that verifies ``n`` draft nodes per row costs (on this machine)::

    cost(B, n) = draft(B, n) [0 when n = 0]  +  verify(B, width(n) + 1)  +  overhead(B)

and commits ``B * (1 + acc(n))`` tokens, where ``acc(n)`` is the expected number of accepted draft
tokens per row when the tree is cut to its first ``n`` nodes, and ``width(n) <= n`` the expected
number of draft nodes the verify forward then carries per row: ``n`` for a drafter that always
fills its budget (DART, EAGLE, Medusa, a draft model), less for one that proposes only what it
finds (prompt lookup proposes nothing in a dry spell, and a step with nothing proposed costs a
plain forward plus the lookup). The controller picks the ``n`` (from a
ladder 0, 1, 2, 3, 4, 6, 8, 12, ... up to the configured budget) that maximises
``B * (1 + acc(n)) / cost(B, n)``. ``n = 0`` is a plain autoregressive step: the drafter is not even
asked, so the choice can never be slower than plain decoding by more than the estimates' error.
(Where a one-node step's expected rate is at most ``learn_margin`` below a plain one's, it replaces
the plain step: it keeps learning, at a bounded price.)
This generalises vLLM's "disable speculation above a batch size" and SGLang's adaptive speculation:
the batch size, the machine (:mod:`dart_ray.engine.cost`) and the workload all enter.

**Where acc(n) comes from (per workload, i.e. per engine).** Every drafter emits its tree in
*priority order* (best node first, parents before children: the beam search's effective score,
EAGLE's cumulative score, the chain's depth), so "the tree with budget n" is exactly "the first n
nodes". After a step that verified ``n_used`` nodes, the accepted path's node indices tell, for
every ladder size ``m <= n_used``, what a tree cut to ``m`` nodes would have accepted: the path's
prefix of indices ``<= m`` (exact under greedy decoding, where the accepted path is the unique
argmax chain). So one observed step updates the estimate of every smaller tree at once; estimates
are exponential moving averages, so they follow a workload that changes.

The same steps teach ``width``: a step that verified ``W`` draft nodes per row with budget
``n_used`` would have verified ``min(W, m)`` with budget ``m <= n_used`` (nodes in priority order,
the cut drops the columns no row uses). A size never verified is priced at its full width.

**Exploration.** Sizes above the chosen one are only learned by trying them: every
``explore_every`` steps the controller verifies the next ladder size up (one rung, so a probe costs
little even where big trees are dear); a probe that does not change the choice doubles the interval
(up to ``max_explore_every``) once the size has ``probe_until_seen`` row-steps since the choice
was last at or above it (a probing episode, whose first probe discounts the size's stale
estimate), one that does resets it. The first
steps (``warmup_steps``) use the largest tree whose verify costs at most ``warmup_cost_ratio`` plain
steps, to learn acceptance at every smaller size.

**Sizes above the current choice are estimated from paired increments.** Their absolute
acceptance was last seen at a probe, often many steps (and requests) ago, while the sizes at or
below the choice are refreshed every step; comparing a fresh level with a stale one makes the choice
follow whichever prompt the last probe happened to see. So the controller also keeps, per ladder
size ``m``, the moving average of ``acc(m) - acc(m')`` (``m'`` the ladder size below ``m``) over the
steps that verified ``m`` or more nodes: both terms from the same steps, so the increment holds
whatever the workload's level. A size above the largest one verified at the last speculative step is
priced as that size's fresh estimate plus the increments above it.

Drafting and tree search are measured online per batch size and budget, the per-step overhead
(acceptance, commit, emission) per batch size; the verify cost comes from the measured cost model,
refined by every step.

**Contexts.** :class:`ContextualController` keeps one such controller per drafting context (what
the drafter can tell about a step before drafting it, :meth:`Drafter.context
<dart_ray.drafters.base.Drafter.context>`: prompt lookup's suffix match length), so a step that
continues a copy and one that drafts from nothing are priced from their own estimates.

**Hindsight.** Where the drafter's tree is prefix-exact beyond the cut (prompt lookup's trie),
:mod:`dart_ray.engine.hindsight` follows the accepted path past it through the next steps' tokens,
and :meth:`SpeculationController.learn` takes every budget up to where the tree is exact: bigger
trees are learned without verifying them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from dart_ray.engine.cost import CostModel

LADDER: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Tree sizes (draft nodes) the controller chooses among; the configured budget is always added."""


@dataclass
class ControllerConfig:
    """Knobs of the adaptive controller (defaults are what the benchmarks ran)."""

    alpha: float = 0.05
    """Weight of one row-step in the acceptance moving averages (per row; a batch weighs more)."""
    timing_alpha: float = 0.1
    """Weight of one step in the drafting/overhead time moving averages."""
    explore_every: int = 16
    """Verify one ladder rung above the current choice after this many decode steps; the interval
    doubles after a probe that did not change the choice once the size probed is established
    (``probe_until_seen``; up to ``max_explore_every``) and starts again from here when one did."""
    max_explore_every: int = 512
    """Longest interval between probes (a workload that never rewards speculation pays ~nothing)."""
    probe_until_seen: int = 20
    """The interval doubles only after a probe of a size seen this many row-steps in the current
    *probing episode*: the probes of that size since the choice was last at or above it. Its first
    probe weighs the size's stale estimate as (and counts it towards this as) ``probe_until_seen //
    4`` row-steps against the fresh probes; once established, the interval doubles as before, so a
    workload that never rewards the size still probes it ever more rarely. Without it, a
    streak of zeros (acceptance comes in bursts) that made the choice fall below a size froze that
    size's estimate there, while the probes that could correct it (each moving it 5 %) grew
    exponentially rare. 0 = double after every probe. (Replayed on the chat set with the Zen 5's
    prices over 12 prompt orders, `dart_ray/bench/replay.py`: 1.35x plain on average, 1.13x at
    worst, against 1.40x / 1.29x with episodes; docs/BENCHMARKS.md.)"""
    warmup_steps: int = 4
    """Decode steps at the start (and after a knob change) that verify the warm-up tree."""
    warmup_cost_ratio: float = 2.0
    """The warm-up tree is the largest whose verify costs at most this many plain decode steps."""
    min_gain: float = 0.05
    """Speculate only when the best tree's expected rate beats a plain step's by this fraction: the
    estimates are noisy, and a wrong "speculate" costs more than a missed small gain."""
    learn_margin: float = 0.1
    """When the choice is a plain step but a one-node step's expected rate (its acceptance
    credited) is at most this fraction below a plain step's, verify one node instead: a plain step
    learns nothing, and an estimate that noise pushed just under the bar (or acceptance that comes
    in bursts, as prompt-lookup matches do) would otherwise wait for the next, ever rarer, probe.
    With nothing accepted this is "a one-node step costs at most 1/(1 - margin) of a plain one".
    0 disables. (On the Zen 4 in bf16, `ngram` on chat: 50.6 tok/s with plain steps allowed, and
    766 of 2,353 steps plain when the bar compared costs alone; see BENCHMARKS.)"""

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0 or not 0.0 < self.timing_alpha <= 1.0:
            raise ValueError("alpha and timing_alpha must be in (0, 1]")
        if (self.explore_every < 1 or self.max_explore_every < self.explore_every
                or self.probe_until_seen < 0
                or self.warmup_steps < 0 or self.warmup_cost_ratio < 1.0 or self.min_gain < 0
                or not 0.0 <= self.learn_margin < 1.0):
            raise ValueError("explore_every >= 1, probe_until_seen >= 0, warmup_steps >= 0, "
                             "warmup_cost_ratio >= 1, min_gain >= 0 and 0 <= learn_margin < 1 "
                             "required")


def ladder_upto(max_nodes: int) -> list[int]:
    """The ladder sizes <= ``max_nodes``, with ``max_nodes`` itself last."""
    sizes = [n for n in LADDER if n < max_nodes]
    return sizes + [max_nodes] if max_nodes > 0 else [0]


def accepted_within(path_nodes: list[int], m: int) -> int:
    """Accepted draft tokens had the tree been cut to its first ``m`` nodes: the prefix of the
    accepted path (node indices, root excluded, increasing) that lies within nodes ``1..m``."""
    k = 0
    for node in path_nodes:
        if node > m:
            break
        k += 1
    return k


@dataclass
class SpeculationController:
    """Chooses the number of draft nodes per step; learns acceptance and timings online."""

    cost: CostModel
    config: ControllerConfig = field(default_factory=ControllerConfig)
    acc: dict[int, float] = field(default_factory=dict)
    """Ladder size n -> expected accepted draft tokens per row with the tree cut to n nodes."""
    gain: dict[int, float] = field(default_factory=dict)
    """Ladder size m -> expected ``acc(m) - acc(m')`` (``m'`` the ladder size below m), from steps
    that verified both: the paired increment that prices sizes above the fresh ones."""
    width: dict[int, float] = field(default_factory=dict)
    """Ladder size n -> expected draft nodes per row the verify forward carries when the budget is
    n (n for drafters that fill their budget; less for lookup drafters in a dry spell)."""
    fresh: int = 0
    """The largest size whose ``acc`` the last speculative step refreshed (0: none yet)."""
    seen: dict[int, int] = field(default_factory=dict)
    """Ladder size m -> row-steps that observed it (early estimates are plain means)."""
    draft_s: dict[tuple[int, int], float] = field(default_factory=dict)
    """(batch size, budget) -> seconds of drafting + tree search per step (moving average). Per
    budget: DART skips its forward where the lookup paths fill the budget (~0.5 ms against ~5 ms
    on the Zen 4), and searches deeper for bigger budgets."""
    overhead_s: dict[tuple[int, bool], float] = field(default_factory=dict)
    """(batch size, speculated?) -> seconds of acceptance + commit + emission per step."""
    timed: dict[tuple[str, tuple], int] = field(default_factory=dict)
    """("draft_s" or "overhead_s", key) -> observations behind that entry (:func:`_timing_ema`)."""
    steps: int = 0
    """Decode steps planned since the last reset."""
    last_choice: int = 0
    """The size chosen at the last step (reported in stats)."""
    _interval: int = 0
    _next_probe: int = 0
    _probed_from: int | None = None
    _episode: int | None = None
    _last_used: int = -1

    def reset_acceptance(self) -> None:
        """Forget acceptance (the decoding knobs changed, so the trees did too) and warm up
        again."""
        self.acc.clear()
        self.gain.clear()
        self.width.clear()
        self.seen.clear()
        self.fresh = 0
        self.steps = 0
        self._interval = 0
        self._episode = None

    # ---- the decision ----------------------------------------------------------------------------
    def expected_accepted(self, n: int) -> float:
        """acc(n). Up to the freshly observed size: observed, else the largest observed smaller
        size's (a lower bound: acceptance never falls when a tree grows). Above it: the fresh
        size's estimate plus the paired increments of the ladder sizes up to n (an increment not
        seen yet counts 0, again a lower bound)."""
        if n <= 0:
            return 0.0
        if self.fresh and n > self.fresh:
            base = self.acc[self.fresh]
            return min(base + sum(self.gain.get(m, 0.0) for m in ladder_upto(n) if m > self.fresh),
                       float(n))
        if n in self.acc:
            return self.acc[n]
        below = [m for m in self.acc if m < n]
        return self.acc[max(below)] if below else 0.0

    def expected_width(self, n: int) -> float:
        """width(n): draft nodes per row a budget-``n`` step is expected to verify; ``n`` until a
        step with budget ``n`` or more has been seen (the pessimistic price)."""
        return self.width.get(n, float(n))

    def step_seconds(self, B: int, n: int, verify_s: float | None = None) -> float:
        """Seconds of a step over ``B`` rows with budget ``n`` nodes (``verify_s``: the cost
        model's ``verify_s(B, width(n) + 1)``, when the caller has it already)."""
        if verify_s is None:
            verify_s = self.cost.verify_s(B, self.expected_width(n) + 1)
        draft = self.drafting_seconds(B, n) if n > 0 else 0.0
        key = (B, n > 0)
        over = self.overhead_s[key] if key in self.overhead_s else self._nearest_over(B, n > 0)
        return draft + verify_s + over

    def drafting_seconds(self, B: int, n: int) -> float:
        """Drafting + search time of a budget-``n`` step over ``B`` rows: observed, else the
        nearest budget observed at this batch size (the smaller one on a tie), else the nearest
        batch size's, scaled by rows (0 before any observation: biased toward speculating,
        which then gets measured)."""
        if (B, n) in self.draft_s:
            return self.draft_s[(B, n)]
        same = [m for b, m in self.draft_s if b == B]
        if same:
            return self.draft_s[(B, min(same, key=lambda m: (abs(m - n), m)))]
        # per batch size its nearest budget's time (farthest first, so the nearest is kept)
        cells = sorted(self.draft_s.items(), key=lambda kv: -abs(kv[0][1] - n))
        return self._nearest({b: s for (b, _), s in cells}, B, 0.0)

    def rate(self, B: int, n: int, verify_s: float | None = None) -> float:
        """Expected committed tokens per second of a step over ``B`` rows verifying ``n`` nodes."""
        return B * (1.0 + self.expected_accepted(n)) / self.step_seconds(B, n, verify_s)

    def rates(self, B: int, max_nodes: int) -> dict[int, float]:
        """:meth:`rate` of every ladder size up to ``max_nodes`` (0, plain, first), the grid read
        once."""
        sizes = ladder_upto(max_nodes)
        verify = self.cost.verify_many(B, [self.expected_width(n) + 1 for n in sizes])
        return {n: self.rate(B, n, v) for n, v in zip(sizes, verify, strict=True)}

    def best(self, B: int, max_nodes: int, rates: dict[int, float] | None = None) -> int:
        """The size with the highest expected rate (``rates``: :meth:`rates`, when the caller has
        them), or 0 where it beats a plain step by less than ``min_gain``."""
        rate = self.rates(B, max_nodes) if rates is None else rates
        n = max(rate, key=lambda n: (rate[n], -n))
        if n and rate[n] < (1.0 + self.config.min_gain) * rate[0]:
            return 0
        return n

    def plan(self, B: int, max_nodes: int) -> int:
        """Draft nodes to verify this step for ``B`` rows (0 = plain decoding, skip the drafter)."""
        self.steps += 1
        if max_nodes <= 0:
            n = 0
        elif self.steps <= self.config.warmup_steps or not self.acc:
            n = self._warmup_size(B, max_nodes)
        else:
            rate = self.rates(B, max_nodes)
            n = self.best(B, max_nodes, rate)
            if n == 0 and self._learns(rate):
                n = 1
            if self._probed_from is not None:
                if n != self._probed_from:
                    self._interval = self.config.explore_every    # the last probe paid: probe often
                self._probed_from = None
            if self._episode is not None and n >= self._episode:
                self._episode = None      # chosen now: refreshed every step, stale again if left
            if self._interval == 0:
                self._interval = self.config.explore_every
                self._next_probe = self.steps + self._interval
            if self.steps >= self._next_probe and n < max_nodes:
                self._probed_from = n
                sizes = ladder_upto(max_nodes)
                n = sizes[sizes.index(n) + 1]
                if self.config.probe_until_seen and n != self._episode:
                    # the first probe of this size since the choice was at or above it: its
                    # estimate is stale (last refreshed before the choice fell below it, often by
                    # the very streak that made it fall), so it counts as a quarter of an episode's
                    # probes against the fresh ones; the episode lasts until the choice reaches it
                    self._episode = n
                    self.seen[n] = min(self.seen.get(n, 0), self.config.probe_until_seen // 4)
                if self.seen.get(n, 0) >= self.config.probe_until_seen:
                    self._interval = min(2 * self._interval, self.config.max_explore_every)
                else:                                  # its estimate is not established yet
                    self._interval = self.config.explore_every
                self._next_probe = self.steps + self._interval
        self.last_choice = n
        return n

    def _learns(self, rate: dict[int, float]) -> bool:
        """A one-node step's expected rate is at most ``learn_margin`` below a plain one's (see the
        knob); ``rate``: :meth:`rates` (sizes 0 and 1 are always on the ladder)."""
        return (self.config.learn_margin > 0
                and rate[1] >= (1.0 - self.config.learn_margin) * rate[0])

    def _warmup_size(self, B: int, max_nodes: int) -> int:
        sizes = [n for n in ladder_upto(max_nodes) if n > 0]
        plain, *verify = self.cost.verify_many(B, [1] + [n + 1 for n in sizes])
        limit = self.config.warmup_cost_ratio * plain
        fits = [n for n, v in zip(sizes, verify, strict=True) if v <= limit]
        return max(fits) if fits else 1

    # ---- learning --------------------------------------------------------------------------------
    def record(self, B: int, n_used: int, accepted_paths: list[list[int]] | None, draft_s: float,
               verify_s: float, tokens_per_row: int, overhead_s: float,
               after_plain: bool | None = None, known: int | None = None,
               full_width: int | None = None) -> None:
        """One decode step: ``accepted_paths[b]`` = accepted node indices of row b (root excluded);
        ``n_used`` nodes were allowed; the forward covered ``tokens_per_row`` tokens per row (the
        root and the draft nodes the drafter proposed within the budget). ``after_plain``: the
        engine's previous step was plain (its drafting then included a catch-up); None = this
        controller's previous step was.

        Hindsight (:mod:`dart_ray.engine.hindsight`): ``known`` (>= ``n_used``) is the largest
        budget whose tree is the first nodes of this step's uncut tree, ``full_width`` that tree's
        draft nodes (the widest row); ``accepted_paths`` None = the acceptance comes later through
        :meth:`learn`, once the text after the step has shown how far the paths went."""
        self.cost.observe(B, tokens_per_row, verify_s)
        self._time("overhead_s", (B, n_used > 0), overhead_s)
        caught_up = self._last_used == 0 if after_plain is None else after_plain
        self._last_used = n_used
        if n_used <= 0 or accepted_paths == []:
            return
        # after plain steps the drafter also caught up on them: not a drafting cost
        if not caught_up:
            self._time("draft_s", (B, n_used), draft_s)
        known = n_used if known is None else known
        # a budget-m step verifies min(full, m) draft nodes per row (the cut drops the columns no
        # row uses), for every budget the uncut tree is exact for
        full = max(tokens_per_row - 1, 0) if full_width is None else full_width
        w = self._weight(B, ladder_upto(known))
        for m in ladder_upto(known):
            if m:
                self.width[m] = _ema(self.width.get(m), float(min(full, m)), w[m])
        if accepted_paths is not None:
            self.learn(accepted_paths, known)

    def learn(self, accepted_paths: list[list[int]], known: int) -> None:
        """Acceptance of one speculative step: ``accepted_paths[b]`` = the node indices row b's
        tree accepted (root excluded), exact for every budget up to ``known`` nodes."""
        rows = len(accepted_paths)
        if rows == 0:
            return
        sizes = ladder_upto(known)
        w = self._weight(rows, sizes)
        below = 0.0                                            # this step's acc at the size below
        for m in sizes:
            if m == 0:
                continue
            mean = sum(accepted_within(p, m) for p in accepted_paths) / rows
            self.seen[m] = self.seen.get(m, 0) + rows
            self.acc[m] = _ema(self.acc.get(m), mean, w[m])
            self.gain[m] = _ema(self.gain.get(m), mean - below, w[m])
            below = mean
        self.fresh = known

    def _weight(self, rows: int, sizes: list[int]) -> dict[int, float]:
        """Moving-average weight of a ``rows``-row observation of each size: a batch step weighs
        ``rows`` row-steps, and a size seen fewer than 1/alpha row-steps takes a plain mean (its
        first observation, often a single probe, must not stand in for its average)."""
        w = 1.0 - (1.0 - self.config.alpha) ** rows
        return {m: max(w, rows / (self.seen.get(m, 0) + rows)) for m in sizes}

    # ---- helpers ---------------------------------------------------------------------------------
    def _time(self, name: str, key: tuple, seconds: float) -> None:
        """Fold one observation into ``self.<name>[key]`` (``draft_s`` or ``overhead_s``)."""
        table = getattr(self, name)
        seen = self.timed.get((name, key), 0)
        table[key] = _timing_ema(table.get(key), seconds, self.config.timing_alpha, seen)
        self.timed[(name, key)] = seen + 1

    @staticmethod
    def _nearest(d: dict[int, float], B: int, default: float) -> float:
        if not d:
            return default
        b = min(d, key=lambda x: abs(x - B))
        return d[b] * max(B, 1) / max(b, 1) if b < B else d[b]

    def _nearest_over(self, B: int, spec: bool) -> float:
        same = {b: s for (b, sp), s in self.overhead_s.items() if sp == spec}
        if same:
            return self._nearest(same, B, 0.0)
        # a plain step's overhead not seen yet: 0, a lower bound (the bias is toward plain decoding,
        # which then gets measured); a speculative step's: the plain one's
        other = {b: s for (b, _), s in self.overhead_s.items()} if spec else {}
        return self._nearest(other, B, 0.0)

    def snapshot(self) -> dict:
        """What the controller believes now (stats, logs, tests)."""
        return {"last_choice": self.last_choice,
                "acceptance": {n: self.expected_accepted(n) for n in sorted(self.acc)},
                "width": {n: self.expected_width(n) for n in sorted(self.width)},
                "draft_ms": {f"{b}:{n}": 1000 * s for (b, n), s in sorted(self.draft_s.items())},
                "overhead_ms": {f"{b}{'s' if sp else 'a'}": 1000 * s
                                for (b, sp), s in sorted(self.overhead_s.items())}}


@dataclass
class ContextualController:
    """One :class:`SpeculationController` per drafting context (:meth:`Drafter.context
    <dart_ray.drafters.base.Drafter.context>`), all pricing verify forwards with the same measured
    cost model. Each context learns its own acceptance, widths and drafting time and plans its own
    steps; a drafter without contexts has one (0), which is exactly a SpeculationController.

    Why: prompt lookup's acceptance is bimodal. On HumanEval (Zen 4, bf16, DART with lookup paths)
    55 % of steps continued a suffix match and the rest drafted from the model alone; one average
    priced both at 2-3 nodes, cutting the 10-token lookup paths to 3."""

    cost: CostModel
    config: ControllerConfig = field(default_factory=ControllerConfig)
    by_context: dict[Hashable, SpeculationController] = field(default_factory=dict)
    """Context -> its controller (created on first use). The engine's contexts are
    ``(Drafter.context(view), running)``: ``running`` when every row's previous path went on past
    its cut (:meth:`Hindsight.running <dart_ray.engine.hindsight.Hindsight.running>`)."""
    last_context: Hashable = 0
    """The context of the last planned step."""
    _last_used: int = -1

    def __getitem__(self, context: Hashable) -> SpeculationController:
        if context not in self.by_context:
            self.by_context[context] = SpeculationController(self.cost, self.config)
        return self.by_context[context]

    @property
    def last_choice(self) -> int:
        """The size chosen at the last step."""
        return self[self.last_context].last_choice

    def plan(self, B: int, max_nodes: int, context: Hashable = 0) -> int:
        """Draft nodes to verify this step (0 = plain), planned by ``context``'s controller."""
        self.last_context = context
        return self[context].plan(B, max_nodes)

    def record(self, B: int, n_used: int, accepted_paths: list[list[int]] | None, draft_s: float,
               verify_s: float, tokens_per_row: int, overhead_s: float,
               context: Hashable = 0, known: int | None = None,
               full_width: int | None = None, catch_up: bool = False) -> None:
        """:meth:`SpeculationController.record` for the step planned in ``context``.
        ``catch_up``: the drafting also took a newly admitted row's prompt
        (:attr:`Drafter.caught_up <dart_ray.drafters.base.Drafter.caught_up>`); like a step after
        plain ones, its drafting time is not learned."""
        self[context].record(B, n_used, accepted_paths, draft_s, verify_s, tokens_per_row,
                             overhead_s, after_plain=self._last_used == 0 or catch_up,
                             known=known, full_width=full_width)
        self._last_used = n_used

    def learn(self, context: Hashable, accepted_paths: list[list[int]], known: int) -> None:
        """:meth:`SpeculationController.learn` for a step planned in ``context``."""
        self[context].learn(accepted_paths, known)

    def reset_acceptance(self) -> None:
        """Forget every context's acceptance (the decoding knobs changed)."""
        for c in self.by_context.values():
            c.reset_acceptance()

    def snapshot(self) -> dict:
        """Each context's :meth:`SpeculationController.snapshot` (stats, logs, tests)."""
        return {c: ctl.snapshot() for c, ctl in sorted(self.by_context.items(), key=str)}


def _ema(old: float | None, new: float, a: float) -> float:
    return new if old is None else (1.0 - a) * old + a * new


def _timing_ema(old: float | None, new: float, a: float, seen: int) -> float:
    """A time's moving average that an outlier cannot hold up: on a CPU, noise only adds time (a
    page fault, the first use of a memory-mapped N-gram model, preemption). While an estimate rests
    on fewer than ``1/a`` observations, one above twice a fresh observation was an outlier and the
    observation replaces it (a 150 ms first lookup once priced every tree out and kept `ngram` plain
    for 2,342 of 2,348 HumanEval steps: speculative steps alone refresh drafting time, and a plain
    choice stops them). After that an observation counts at most 10x the estimate, so the average
    of a time that is bimodal by nature (lookup-only steps and drafter forwards) stays its mean
    instead of following the fast mode down."""
    if old is None or (seen < 1.0 / a and new < 0.5 * old):
        return new
    return (1.0 - a) * old + a * min(new, 10.0 * old)
