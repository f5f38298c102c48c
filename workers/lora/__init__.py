"""LoRA adapters on a worker rank: loading (adapter.py), the per-linear weight slots and their
segmented products (stack.py), and the host cache, slot assignment and step mapping
(manager.py)."""
