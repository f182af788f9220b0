"""Tenants: who is calling (API keys → users) and how much they may use (RPM, TPM, concurrency,
per-model RPS), with counters in memory (one replica) or in Redis (a fleet of replicas).

``service.Tenancy`` is what the pipeline calls; ``directory`` holds keys and users; ``memory`` and
``redis_state`` are the two state backends behind one interface; ``limits`` turns a counter
snapshot into OpenAI-style ``x-ratelimit-*`` headers and 429 answers.
"""

from gateway.tenants.service import TICKET, Tenancy, Ticket, build_tenancy

__all__ = ["TICKET", "Tenancy", "Ticket", "build_tenancy"]
