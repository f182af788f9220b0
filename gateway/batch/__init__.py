"""Batch jobs: OpenAI's Files and Batches API, run at the lowest priority on idle engine slots (docs/batch.md).

- ``config``: the ``batch:`` block;
- ``api``: the ``/v1/files`` and ``/v1/batches`` routes, in OpenAI's shapes;
- ``jsonl``: the checks an upload passes, and reading its lines back;
- ``files``: files on disk, by id;
- ``store``: the job store (SQLite, on one thread per process);
- ``runner``: batches through their states, lines through the pipeline (in-process, ``line_request``)
  where ``headroom`` finds free slots;
- ``metrics``: the runner's Prometheus metrics;
- ``service``: the API of every worker and the runner of the one holding the directory's lock.
"""
