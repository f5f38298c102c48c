"""vLLM's vllm:lora_requests_info gauge from the scheduler's stats (--enable-lora): its labels
name the adapters of running and of waiting requests (comma-separated) and --max-loras; its
value is the time of the reading, as vLLM's is."""
from __future__ import annotations

import time
from typing import Any

from prometheus_client.core import GaugeMetricFamily


def lora_requests_info(stats: dict[str, Any]) -> GaugeMetricFamily:
    fam = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    fam.add_metric([str(stats.get("max_lora", 0)), ",".join(stats.get("lora_running") or ()),
                    ",".join(stats.get("lora_waiting") or ())], time.time())
    return fam
