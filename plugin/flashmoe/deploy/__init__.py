"""Launchers that bring up a serving engine with the flashmoe backend across nodes.

``python -m flashmoe.deploy.ray serve ...`` places vLLM (DP + EP, ``--moe-backend flashmoe``) on the
nodes of a running Ray cluster. Kubernetes manifests and the container image live in ``deploy/``.
"""
