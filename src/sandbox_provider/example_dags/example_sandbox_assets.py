"""
Example: a producer whose sandbox exports are Airflow Assets, and a consumer scheduled on them.

``example_sandbox_assets_producer`` counts the words of a text in a sandbox on the local backend and
exports two Assets: ``word_counts.json`` (a file) and ``by_letter/`` (a directory, one file per first
letter). When the export succeeded, Airflow records an event for each Asset, whose ``extra`` says what
was exported (bytes, files, the backend and the sandbox's handle), and queues
``example_sandbox_assets_consumer``, which is scheduled on both. A failed run emits no event and
queues nothing.

The consumer stages the same Assets into a sandbox of its own (an Asset input is read from its URI)
and checks that the directory and the file agree.

Where the Assets live: ``<SANDBOX_DEMO_OUTPUT>/assets/`` (default ``file:///tmp/airflow-sandbox-demo``;
see ``_output.py``), read when the file is parsed, since Airflow schedules on Assets it knows then.
Each run overwrites them.
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import DAG, Asset

from sandbox_provider.example_dags._output import output_base
from sandbox_provider.operators.sandbox import SandboxOperator

BASE = f"{output_base()}/assets"
WORD_COUNTS = Asset(f"{BASE}/word_counts.json")
BY_LETTER = Asset(f"{BASE}/by_letter")

TEXT = """\
Airflow schedules the consumer when the producer's exports land.
A sandbox runs the job with no network and nothing of the worker.
Every export is copied out all or nothing, then the Asset event is recorded.
"""

# Runs inside the sandbox, on its own python3; standard library only.
COUNT_WORDS = """\
import collections, json, os, re
words = re.findall(r"[a-z']+", open("text.txt").read().lower())
counts = collections.Counter(words)
json.dump(dict(sorted(counts.items())), open("word_counts.json", "w"), indent=1)
os.makedirs("by_letter", exist_ok=True)
for letter in sorted({w[0] for w in counts}):
    with open(f"by_letter/{letter}.txt", "w") as out:
        out.writelines(f"{w} {n}\\n" for w, n in sorted(counts.items()) if w[0] == letter)
print(f"{len(words)} words, {len(counts)} distinct")
"""

CHECK = """\
import json, os
counts = json.load(open("word_counts.json"))
listed = {}
for name in sorted(os.listdir("by_letter")):
    for line in open(os.path.join("by_letter", name)):
        word, n = line.split()
        listed[word] = int(n)
assert listed == counts, "the directory and the file disagree"
print(json.dumps({"distinct": len(counts), "total": sum(counts.values()), "letters": len(os.listdir("by_letter"))}))
"""

with DAG(
    dag_id="example_sandbox_assets_producer",
    schedule=None,
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    tags=["example", "sandbox", "assets"],
    doc_md=__doc__,
) as producer:
    SandboxOperator(
        task_id="count_words",
        files={"count_words.py": COUNT_WORDS, "text.txt": TEXT},
        command="python3 count_words.py",
        # Each destination is an Asset: the task's outlets, with an event once the export succeeded.
        # "by_letter/" ends in '/': the Asset is a directory, every file below it is exported.
        exports={"word_counts.json": WORD_COUNTS, "by_letter/": BY_LETTER},
        timeout=300,
    )

with DAG(
    dag_id="example_sandbox_assets_consumer",
    schedule=[WORD_COUNTS, BY_LETTER],  # queued when both have a new event
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    tags=["example", "sandbox", "assets"],
    doc_md=__doc__,
) as consumer:
    SandboxOperator(
        task_id="check_counts",
        files={"check.py": CHECK},
        inputs={"word_counts.json": WORD_COUNTS, "by_letter/": BY_LETTER},  # read from the Assets' URIs
        command="python3 check.py",
        timeout=300,
    )


if __name__ == "__main__":
    producer.test()
