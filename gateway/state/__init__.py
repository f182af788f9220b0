"""The state shared by gateway replicas and workers, in Redis: how ``state.redis_url`` is read
(``urls``: a standalone server, a Sentinel-managed primary or a Cluster) and the one client
factory every Redis user of the gateway goes through (``redis``).

What is kept there belongs to its users: tenants' counters and key directory
(gateway/tenants/redis_state.py), the Responses API's records (gateway/apis/responses_state.py).
"""
