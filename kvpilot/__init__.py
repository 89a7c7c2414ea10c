"""kvpilot: serve large language models on Kubernetes.

Two halves in one distribution: the engine (``kvpilot.engine``: paged KV cache, continuous
batching, an OpenAI-compatible server) and the operator (``kvpilot.operator``: a kopf controller
that sizes and scales ``LLMDeployment`` resources).
"""

__version__ = "0.2.0"
