"""The router role: one OpenAI endpoint in front of several engine groups (replicas of a model,
and several models), choosing a replica by model and prefix-cache affinity, resuming streams
of a replica that dies, limiting each API key, and loading models on demand.

`core` (pure: affinity, limits, model slots) -> `service` (proxying, loading) -> `process`.
"""
