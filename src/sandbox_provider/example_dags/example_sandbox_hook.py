"""
Example: drive a sandbox backend directly from a ``@task``.

When a task needs finer control than ``SandboxOperator`` gives (several commands, decisions
between them, bytes in and out), use the hook itself: create a sandbox, write files, run
commands, read files, and destroy it in a ``finally`` so nothing is left behind.
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import DAG, task

POEM = """\
The sandbox keeps its secrets close,
no network and no home;
it reads the files we hand it
and it leaves the host alone.
"""

with DAG(
    dag_id="example_sandbox_hook",
    schedule=None,
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    tags=["example", "sandbox"],
    doc_md=__doc__,
) as dag:

    @task
    def count_words() -> dict:
        from sandbox_provider.hooks.local import LocalSandboxHook
        from sandbox_provider.sandbox import SandboxSpec

        hook = LocalSandboxHook()
        handle = hook.create(spec=SandboxSpec(env={"LC_ALL": "C.UTF-8"}))
        try:
            hook.write_file(handle, "poem.txt", POEM.encode())
            result = hook.run_command(
                handle,
                "wc -l < poem.txt > lines.txt && wc -w < poem.txt > words.txt && tr -s ' ' '\\n' < poem.txt | "
                "sort | uniq -c | sort -rn | head -3",
                timeout=60,
                max_output_bytes=64 * 1024,
            )
            if not result.ok:
                raise RuntimeError(f"The count failed with status {result.exit_code}: {result.stderr.strip()}")
            words = int(hook.read_file(handle, "words.txt", max_bytes=64))
            lines = int(hook.read_file(handle, "lines.txt", max_bytes=64))
        finally:
            hook.destroy(handle)
        print(f"{lines} lines, {words} words; most frequent:\n{result.stdout}")
        return {"lines": lines, "words": words}

    count_words()


if __name__ == "__main__":
    dag.test()
