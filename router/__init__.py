"""The kvpilot router: an OpenAI-compatible front that sends each request to one engine replica.

``kvpilot router --endpoint URL ...`` (``cli.py``) serves ``app.py``; each request is forwarded
unbuffered by ``proxy.py`` to the replica that ``scoring.choose_replica`` picks from prefix
affinity (``prompt_hashes.py``: the engine's own block hashes, looked up in each replica's
``prefix_index`` indexes) and load (in-flight requests and the engine's own gauges, bounded by
``--load-factor``); without tokens, consistent hashing on the prompt's prefix
(``consistent_hash.py``). Replicas, their models and health: ``replicas.py`` (``ReplicaSet
.set_urls`` for discovery); waking a model scaled to zero: ``wake.py``; the router's Prometheus
metrics: ``metrics.py``.

The pure modules (``scoring``, ``consistent_hash``, ``prefix_index``) import nothing with side
effects.
"""
