"""Prompts for the end-to-end benchmarks, shared by prefixkv's benchmarks and the peer drivers.

Pure Python on purpose (no third-party imports, no prefixkv import): the peer drivers in
bench/peers/ put bench/ on sys.path and `import scenarios` from inside another engine's virtual
environment, so every engine sees byte-identical prompts. The seed document is also the one
`make demo` shows (prefixkv/demo.py keeps its own copy; tests/test_readme.py checks they match).

Scenarios (all greedy, temperature 0):

* ``seed`` - the vLLM documentation's automatic-prefix-caching example: one long prompt (a
  30-row markdown table, 1,514 SmolLM2 tokens) followed by two questions. The second question
  should reuse the cached table.
* ``shared_prefix`` - 32 prompts sharing one ~1,600-token document (the seed prompt with its
  table extended by 2 deterministic rows: 1,615 SmolLM2 tokens), each with its own short
  question about a different person (~20 tokens), submitted as one batch.
"""

from __future__ import annotations

import random
import statistics

# --- seed: the vLLM docs' automatic-prefix-caching example (LONG_PROMPT), verbatim ------------

SEED_INSTRUCTION = (
    "You are a helpful assistant in recognizes the content of tables in markdown format. "
    "Here is a table as follows.\n# Table\n"
)

SEED_TABLE_HEADER = (
    "\n| ID | Name | Age | Occupation | Country | Email | Phone Number | Address |\n"
    "| --- | ------------- | --- | ---------- | ----------- | ---------------------- | ------------ "
    "| ------------------------------- |\n"
)

SEED_TABLE_ROWS = """\
| 1 | John Doe | 29 | Engineer | USA | john.doe@example.com | 555-1234 | 123 Elm St, Springfield, IL |
| 2 | Jane Smith | 34 | Doctor | Canada | jane.smith@example.com | 555-5678 | 456 Oak St, Toronto, ON |
| 3 | Alice Johnson | 27 | Teacher | UK | alice.j@example.com | 555-8765 | 789 Pine St, London, UK |
| 4 | Bob Brown | 45 | Artist | Australia | bob.b@example.com | 555-4321 | 321 Maple St, Sydney, NSW |
| 5 | Carol White | 31 | Scientist | New Zealand | carol.w@example.com | 555-6789 | 654 Birch St, Wellington, NZ |
| 6 | Dave Green | 28 | Lawyer | Ireland | dave.g@example.com | 555-3456 | 987 Cedar St, Dublin, IE |
| 7 | Emma Black | 40 | Musician | USA | emma.b@example.com | 555-1111 | 246 Ash St, New York, NY |
| 8 | Frank Blue | 37 | Chef | Canada | frank.b@example.com | 555-2222 | 135 Spruce St, Vancouver, BC |
| 9 | Grace Yellow | 50 | Engineer | UK | grace.y@example.com | 555-3333 | 864 Fir St, Manchester, UK |
| 10 | Henry Violet | 32 | Artist | Australia | henry.v@example.com | 555-4444 | 753 Willow St, Melbourne, VIC |
| 11 | Irene Orange | 26 | Scientist | New Zealand | irene.o@example.com | 555-5555 | 912 Poplar St, Auckland, NZ |
| 12 | Jack Indigo | 38 | Teacher | Ireland | jack.i@example.com | 555-6666 | 159 Elm St, Cork, IE |
| 13 | Karen Red | 41 | Lawyer | USA | karen.r@example.com | 555-7777 | 357 Cedar St, Boston, MA |
| 14 | Leo Brown | 30 | Chef | Canada | leo.b@example.com | 555-8888 | 246 Oak St, Calgary, AB |
| 15 | Mia Green | 33 | Musician | UK | mia.g@example.com | 555-9999 | 975 Pine St, Edinburgh, UK |
| 16 | Noah Yellow | 29 | Doctor | Australia | noah.y@example.com | 555-0000 | 864 Birch St, Brisbane, QLD |
| 17 | Olivia Blue | 35 | Engineer | New Zealand | olivia.b@example.com | 555-1212 | 753 Maple St, Hamilton, NZ |
| 18 | Peter Black | 42 | Artist | Ireland | peter.b@example.com | 555-3434 | 912 Fir St, Limerick, IE |
| 19 | Quinn White | 28 | Scientist | USA | quinn.w@example.com | 555-5656 | 159 Willow St, Seattle, WA |
| 20 | Rachel Red | 31 | Teacher | Canada | rachel.r@example.com | 555-7878 | 357 Poplar St, Ottawa, ON |
| 21 | Steve Green | 44 | Lawyer | UK | steve.g@example.com | 555-9090 | 753 Elm St, Birmingham, UK |
| 22 | Tina Blue | 36 | Musician | Australia | tina.b@example.com | 555-1213 | 864 Cedar St, Perth, WA |
| 23 | Umar Black | 39 | Chef | New Zealand | umar.b@example.com | 555-3435 | 975 Spruce St, Christchurch, NZ |
| 24 | Victor Yellow | 43 | Engineer | Ireland | victor.y@example.com | 555-5657 | 246 Willow St, Galway, IE |
| 25 | Wendy Orange | 27 | Artist | USA | wendy.o@example.com | 555-7879 | 135 Elm St, Denver, CO |
| 26 | Xavier Green | 34 | Scientist | Canada | xavier.g@example.com | 555-9091 | 357 Oak St, Montreal, QC |
| 27 | Yara Red | 41 | Teacher | UK | yara.r@example.com | 555-1214 | 975 Pine St, Leeds, UK |
| 28 | Zack Blue | 30 | Lawyer | Australia | zack.b@example.com | 555-3436 | 135 Birch St, Adelaide, SA |
| 29 | Amy White | 33 | Musician | New Zealand | amy.w@example.com | 555-5658 | 159 Maple St, Wellington, NZ |
| 30 | Ben Black | 38 | Chef | Ireland | ben.b@example.com | 555-7870 | 246 Fir St, Waterford, IE |
"""

#: The docs' LONG_PROMPT, byte for byte (instruction + "\n| ID | ..." table ending in "\n").
LONG_PROMPT = SEED_INSTRUCTION + SEED_TABLE_HEADER + SEED_TABLE_ROWS

SEED_MAX_TOKENS = 100  # as in the docs; also report 32 (SEED_MAX_TOKENS_SHORT)
SEED_MAX_TOKENS_SHORT = 32


def age_question(name: str) -> str:
    return f"Question: what is the age of {name}? Your answer: The age of {name} is "


SEED_QUESTIONS = ["John Doe", "Zack Blue"]


def summarize_seed_runs(runs: list[list[dict]]) -> list[dict]:
    """Medians per question over repeats. Each run is one dict per question with ttft_s, total_s,
    prompt_tokens, cached_tokens, output_tokens and text; every engine's driver reports this way."""

    def median(xs):
        return round(statistics.median(xs), 6) if xs else None

    summary = []
    for qi in range(len(SEED_QUESTIONS)):
        per = [run[qi] for run in runs]
        summary.append(
            {
                "question": SEED_QUESTIONS[qi],
                "ttft_s_median": median([p["ttft_s"] for p in per]),
                "total_s_median": median([p["total_s"] for p in per]),
                "decode_tok_per_s_median": median(
                    [
                        (p["output_tokens"] - 1) / (p["total_s"] - p["ttft_s"])
                        for p in per
                        if p["output_tokens"] > 1 and p["total_s"] > p["ttft_s"]
                    ]
                ),
                "prompt_tokens": per[0]["prompt_tokens"],
                "cached_tokens": [p["cached_tokens"] for p in per],
                "output_tokens": per[0]["output_tokens"],
                "text": per[0]["text"],
                "texts_identical_across_repeats": len({p["text"] for p in per}) == 1,
                "ttft_s": [round(p["ttft_s"], 6) for p in per],
                "total_s": [round(p["total_s"], 6) for p in per],
            }
        )
    return summary


def seed_prompts() -> list[str]:
    """The docs' two queries: John Doe (cold, computes the table) then Zack Blue (table cached)."""
    return [LONG_PROMPT + age_question("John Doe"), LONG_PROMPT + age_question("Zack Blue")]


# --- shared_prefix: one ~1,600-token document, 32 short questions ------------------------------

SHARED_NUM_PROMPTS = 32
SHARED_MAX_TOKENS = 16
SHARED_EXTRA_ROWS = 2  # 30 seed rows + 2 generated = 1,615 SmolLM2 tokens (see shared_document)

_FIRST = [
    "Aaron",
    "Bella",
    "Caleb",
    "Diana",
    "Ethan",
    "Fiona",
    "Gavin",
    "Hazel",
    "Isaac",
    "Julia",
    "Kevin",
    "Laura",
    "Mason",
    "Nina",
    "Oscar",
    "Paula",
    "Quentin",
    "Rosa",
    "Simon",
    "Tara",
]
_LAST = ["Silver", "Gold", "Amber", "Coral", "Ivory", "Olive", "Pearl", "Ruby", "Scarlet", "Teal"]
_JOBS = ["Engineer", "Doctor", "Teacher", "Artist", "Scientist", "Lawyer", "Musician", "Chef"]
_PLACES = [
    ("USA", "Austin, TX"),
    ("Canada", "Halifax, NS"),
    ("UK", "Bristol, UK"),
    ("Australia", "Hobart, TAS"),
    ("New Zealand", "Dunedin, NZ"),
    ("Ireland", "Sligo, IE"),
]
_STREETS = ["Elm", "Oak", "Pine", "Maple", "Birch", "Cedar", "Ash", "Spruce", "Fir", "Willow"]


def _extra_rows(n: int, seed: int = 2024) -> list[tuple[int, str, int, str, str, str, str, str]]:
    rng = random.Random(seed)  # deterministic across Python versions (randrange/choice only)
    rows, used = [], set()
    for i in range(n):
        while True:
            name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
            if name not in used:
                used.add(name)
                break
        first, last = name.split()
        country, city = rng.choice(_PLACES)
        rows.append(
            (
                31 + i,
                name,
                rng.randrange(22, 66),
                rng.choice(_JOBS),
                country,
                f"{first.lower()}.{last[0].lower()}@example.com",
                f"555-{rng.randrange(10000):04d}",
                f"{rng.randrange(100, 1000)} {rng.choice(_STREETS)} St, {city}",
            )
        )
    return rows


def shared_rows(extra_rows: int = SHARED_EXTRA_ROWS):
    """All rows of the shared document as tuples (id, name, age, job, country, email, phone, address)."""
    seed_rows = []
    for line in SEED_TABLE_ROWS.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        seed_rows.append((int(cells[0]), cells[1], int(cells[2]), *cells[3:]))
    return seed_rows + _extra_rows(extra_rows)


def shared_document(extra_rows: int = SHARED_EXTRA_ROWS) -> str:
    """The seed prompt with its table extended by deterministic rows (~1,600 tokens by default)."""
    lines = [
        f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]} | {r[7]} |" for r in shared_rows(extra_rows)
    ]
    return SEED_INSTRUCTION + SEED_TABLE_HEADER + "\n".join(lines) + "\n"


_QUESTIONS = [
    ("age", "Question: what is the age of {name}? Your answer: The age of {name} is "),
    ("job", "Question: what is the occupation of {name}? Your answer: {name} works as a "),
    ("country", "Question: which country does {name} live in? Your answer: {name} lives in "),
    ("phone", "Question: what is the phone number of {name}? Your answer: The phone number of {name} is "),
]


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def shared_prefix_prompts(n: int = SHARED_NUM_PROMPTS, extra_rows: int = SHARED_EXTRA_ROWS) -> list[str]:
    """n prompts = the shared document + one short question each (distinct people, cycling over
    four question kinds). Identical for every engine."""
    doc = shared_document(extra_rows)
    rows = shared_rows(extra_rows)
    step = 7  # spread the picks over the table; coprime with len(rows) so names are distinct
    while _gcd(step, len(rows)) != 1:
        step += 1
    prompts = []
    for i in range(n):
        name = rows[(i * step) % len(rows)][1]
        prompts.append(doc + _QUESTIONS[i % len(_QUESTIONS)][1].format(name=name))
    return prompts


SCENARIOS = {"seed": seed_prompts, "shared_prefix": shared_prefix_prompts}
