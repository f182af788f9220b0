"""Admission control: per-endpoint saturation, a per-model priority queue with fair tenants, and
shedding with a computed ``Retry-After`` (issue 15 §2).

- ``config``: the ``admission:`` block and the priority classes;
- ``saturation``: how many more requests an endpoint can take, from its scraped signals and the
  gateway's own in-flight count (pure);
- ``queue``: the per-model queue (classes, round-robin across users, positions) and the drain-rate
  estimate (pure);
- ``service``: ``Admission``, which the pipeline awaits before routing, and its metrics.
"""
