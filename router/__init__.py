"""The kvpilot router: an OpenAI-compatible front that sends each request to one engine replica.

``kvpilot router --endpoint URL ...`` (``cli.py``) serves ``app.py``; each request is forwarded
unbuffered by ``proxy.py`` to the replica that ``scoring.choose_replica`` picks from prefix
affinity (``prompt_hashes.py``: the engine's own block hashes, looked up in each replica's
``prefix_index.PrefixIndex``) and load (in-flight requests, bounded by ``--load-factor``); without
a tokenizer, consistent hashing on the prompt's prefix (``consistent_hash.py``). Replicas and their
health: ``replicas.py``; the router's Prometheus metrics: ``metrics.py``.

The pure modules (``scoring``, ``consistent_hash``, ``prefix_index``) import nothing with side
effects.
"""
