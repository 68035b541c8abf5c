"""`make demo`: the prefix cache at work on the embedded SmolLM2-135M-Instruct.

A ~1,500-token markdown table (the vLLM documentation's automatic-prefix-caching example), then
two questions about it. The first question computes the table's KV blocks; the second finds them
in the prefix cache and computes only its own tokens, so its time to first token is a few percent
of the first's. `bench/seed_scenario.py` times the same prompts over repeats (docs/benchmarks.md).
The design: docs/design.md.
"""

from __future__ import annotations

import time

from . import LLM, SamplingParams
from .progress import show_info_logs

# The demo's document. bench/scenarios.py (the benchmarks' prompts, outside the package) holds the
# same text as its LONG_PROMPT; tests/test_readme.py checks that the two stay equal.
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

DOCUMENT = SEED_INSTRUCTION + SEED_TABLE_HEADER + SEED_TABLE_ROWS
MAX_TOKENS = 100


def question(name: str) -> str:
    return f"Question: what is the age of {name}? Your answer: The age of {name} is "


def main() -> None:
    print(
        "What this shows: the prefix cache at work - the second question reuses the document's KV "
        "blocks (see the time to first token and the cached tokens). The answers come from a 135M-parameter "
        "model and are not the point.\n"
    )
    show_info_logs()  # a first start builds the kernels and dequantizes the weights: it says so
    t0 = time.perf_counter()
    llm = LLM(enable_prefix_caching=True)
    print(f"loaded the embedded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f} s")
    tok = llm.llm_engine.tokenizer  # the engine's own (get_tokenizer() builds transformers' one)
    print(f"document: {len(tok.encode(DOCUMENT))} tokens\n")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ttfts = []
    for name in ("John Doe", "Zack Blue"):
        start = time.perf_counter()
        out = llm.generate(DOCUMENT + question(name), params, use_tqdm=False)[0]
        total = time.perf_counter() - start
        ttft = out.metrics.time_to_first_token
        ttfts.append(ttft)
        print(f"Q: what is the age of {name}?")
        print(f"A: {out.outputs[0].text.strip()!r}")
        print(
            f"   time to first token {ttft:.3f} s, total {total:.2f} s, "
            f"{len(out.outputs[0].token_ids)} tokens, {out.num_cached_tokens} of "
            f"{len(out.prompt_token_ids)} prompt tokens from the cache\n"
        )
    stats = llm.get_prefix_cache_stats()
    print(f"prefix cache: {stats.hits} of {stats.queries} queried tokens hit ({stats.hit_rate:.1%})")
    print(f"second question's time to first token = {ttfts[1] / ttfts[0]:.1%} of the first's")


if __name__ == "__main__":
    main()
