"""How many of its proposed drafts each request gets in a step, from what this machine measures:
the time of a step of decodes by its rows (a request's last token and each of its drafts is a
row), and each request's share of drafts kept.

A step of B decodes makes B tokens; a draft row adds the chance that it is kept. A request's first
draft is kept with the request's own rate (a moving average of its verifications); the j-th, with
that times the rates at which a draft at positions 2..j was kept after the one before it was, over
every request (kept drafts come in runs: on the question of bench/spec_decode.py vLLM kept 22, 18,
15 and 14 drafts at positions 1-4 of 31 - a first-position rate of 0.7, then 0.8, 0.8, 0.9 -
where a rate per draft, 0.56, would put the fourth at 0.1). A request gets the drafts that raise
the step's expected tokens per second:
on a 2-vCPU AMD EPYC Zen 4 (default model, float32) a step of 5 decode rows took 1.09x one of 1,
a step of 20 rows (past the one-call decode kernel's 16) far more, so 4 drafts each paid at batch
1 and lost at batch 4 on a question about a document (0.71x).

Step times are kept per row count as a moving average of the steps run. A row count not run in the
last STALE_AFTER steps timed (the machine's speed drifts: on the 2-vCPU Zen 4 a one-row step took
21 ms, then 16, within a minute) is taken as costing what the largest fresh count below it costs:
drafts are tried there, and the time they take is what decides next. A request's share starts at
one half; one that was given no draft for PROBE_AFTER proposals in a row gets one, so a share that
fell does not stay fallen where the text turns repetitive. The rates after the first start at
FIRST_SHARE too."""

from __future__ import annotations

MAX_ROWS = 512  # row counts timed (steps beyond are taken as costing the largest timed)
STEP_WEIGHT = 0.2  # a step's weight in its row count's moving average
STALE_AFTER = 64  # steps timed since a row count's last, after which its time is not trusted
SHARE_WEIGHT = 0.3  # a verification's weight in its request's share of drafts kept
FIRST_SHARE = 0.5  # a request's share before any of its drafts was verified
PROBE_AFTER = 8  # proposals refused in a row after which a request gets one draft


class DraftBudget:
    def __init__(self) -> None:
        self._seconds = [0.0] * (MAX_ROWS + 1)  # 0.0: not timed
        self._timed_at = [0] * (MAX_ROWS + 1)  # the count of steps timed when each was last
        self._steps_timed = 0
        self._share: dict[str, float] = {}  # each request's rate of keeping its first draft
        self._after: list[float] = []  # [m]: the rate of keeping draft m + 2 where draft m + 1 was
        self._refused: dict[str, int] = {}  # proposals refused in a row, by request
        # the step being scheduled: its rows so far and the tokens it is expected to make
        self._rows = 0
        self._tokens = 0.0

    # -- what the engine measured ----------------------------------------------------------------
    def record_step(self, rows: int, seconds: float) -> None:
        """A step of `rows` decode rows (drafts included, no prompt chunk) took `seconds`."""
        rows = min(rows, MAX_ROWS)
        self._steps_timed += 1
        old = self._seconds[rows]
        if old == 0.0 or self._steps_timed - self._timed_at[rows] > STALE_AFTER:
            self._seconds[rows] = seconds
        else:
            self._seconds[rows] = old + STEP_WEIGHT * (seconds - old)
        self._timed_at[rows] = self._steps_timed

    def record_verified(self, request_id: str, drafted: int, kept: int) -> None:
        old = self._share.get(request_id, FIRST_SHARE)
        self._share[request_id] = old + SHARE_WEIGHT * ((1.0 if kept else 0.0) - old)
        after = self._after
        while len(after) < drafted - 1:
            after.append(FIRST_SHARE)
        for m in range(min(kept + 1, drafted) - 1):  # drafts 2.. whose draft before was kept
            after[m] += SHARE_WEIGHT * ((1.0 if kept >= m + 2 else 0.0) - after[m])

    def forget(self, request_id: str) -> None:
        self._share.pop(request_id, None)
        self._refused.pop(request_id, None)

    # -- the step being scheduled ----------------------------------------------------------------
    def start_step(self, num_decodes: int) -> None:
        """A step of about `num_decodes` decodes is being scheduled (its drafts come next)."""
        self._rows = self._tokens = max(num_decodes, 1)

    def length(self, request_id: str, proposed: int) -> int:
        """How many of the `proposed` drafts the request gets (0..proposed): the count whose
        expected tokens per second of the step is highest, where the step's time is known."""
        if proposed <= 0:
            return 0
        chances = self._kept_chances(request_id, proposed)
        now = self._cost(self._rows)
        if now is None:  # nothing timed yet at or below this many rows: try them
            best = proposed
        else:
            best, best_rate = 0, self._tokens / now
            gain = 0.0
            for j in range(1, proposed + 1):
                gain += chances[j - 1]
                cost = self._cost(self._rows + j)
                rate = (self._tokens + gain) / (cost if cost is not None else now)
                if rate > best_rate:
                    best, best_rate = j, rate
        if best == 0:
            refused = self._refused.get(request_id, 0) + 1
            self._refused[request_id] = 0 if refused >= PROBE_AFTER else refused
            if refused >= PROBE_AFTER:
                best = 1
        elif request_id in self._refused:
            del self._refused[request_id]
        self._rows += best
        self._tokens += sum(chances[:best])
        return best

    def _kept_chances(self, request_id: str, n: int) -> list[float]:
        """The chance that each of a request's first `n` drafts is kept (every one before it too)."""
        chance = self._share.get(request_id, FIRST_SHARE)
        after = self._after
        out = [chance]
        for m in range(n - 1):
            chance *= after[m] if m < len(after) else FIRST_SHARE
            out.append(chance)
        return out

    def _cost(self, rows: int) -> float | None:
        """A step's seconds at `rows` rows: timed lately, else the largest count below it timed
        lately; None where none is."""
        seconds, timed_at, fresh_from = self._seconds, self._timed_at, self._steps_timed - STALE_AFTER
        for r in range(min(rows, MAX_ROWS), 0, -1):
            if seconds[r] and timed_at[r] >= fresh_from:
                return seconds[r]
        return None
