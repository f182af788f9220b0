"""The routing view shared by the workers of a gateway and by its replicas (``RoutingView``).

* ``service``: the view of one process: what it publishes, what it applies;
* ``wire``: the messages (MessagePack);
* ``bus``: the local bus between the workers (Unix datagram sockets);
* ``replicas``: the Redis stream between replicas;
* ``config``: the ``view:`` block; ``metrics``: its metrics.
"""
