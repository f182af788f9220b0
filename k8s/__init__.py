"""Kubernetes discovery: watch engine pods (kubernetes-asyncio) and map them onto pool endpoints.

``selector`` parses label selectors, ``pods`` maps one pod to an endpoint description (pure),
``discovery`` runs list + watch + periodic relist and keeps the ``EndpointPool`` in step,
``metrics`` says how its requests to the API server end, when it last heard from it, and its pods.
"""
