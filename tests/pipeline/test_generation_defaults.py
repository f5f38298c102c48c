"""The model's sampling defaults (--generation-config): unset request fields take them at the
scheduler's admission, explicit fields always win, `vllm` turns them off, a directory overrides."""
from __future__ import annotations

import json

import pytest

from pagedserve.pipeline.cli_args import build_arg_parser, config_from_args
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.generation_defaults import (GenerationConfigError, describe,
                                                     read_generation_defaults)
from pagedserve.pipeline.ingress.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.pipeline.sampling_params import NEUTRAL_VALUES, SamplingParams
from pagedserve.pipeline.scheduler.admission import admit_request
from pagedserve.pipeline.scheduler.config import SchedulerConfig
from pagedserve.pipeline.scheduler.sequence import Request

QWEN = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def _model_dir(tmp_path, values: dict, name: str = "model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, **values}))
    return folder


def test_unset_fields_take_the_model_defaults_and_explicit_fields_win():
    unset = SamplingParams()
    assert all(getattr(unset, name) is None for name in NEUTRAL_VALUES)
    filled = unset.with_defaults(QWEN)
    assert (filled.temperature, filled.top_p, filled.top_k, filled.min_p,
            filled.repetition_penalty) == (0.7, 0.8, 20, 0.0, 1.05)
    explicit = SamplingParams(temperature=0.0, top_k=-1, repetition_penalty=1.0).with_defaults(QWEN)
    assert (explicit.temperature, explicit.top_k, explicit.repetition_penalty) == (0.0, -1, 1.0)
    assert explicit.top_p == 0.8 and explicit.greedy
    assert SamplingParams().with_defaults({}) == SamplingParams(**NEUTRAL_VALUES)
    done = SamplingParams(**NEUTRAL_VALUES)
    assert done.with_defaults(QWEN) is done  # nothing unset: the same object, no copy


def test_validation_accepts_unset_and_checks_the_filled_values():
    SamplingParams().validate()
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0).validate()
    assert not SamplingParams().greedy and not SamplingParams().uses_penalties


def test_http_requests_leave_what_the_client_did_not_send_unset():
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.0})
    params = chat.sampling_params(max_tokens=5, logprobs=None)
    assert params.temperature == 0.0 and params.top_p is None and params.top_k is None
    completion = CompletionRequest.model_validate({"prompt": "x", "top_k": 5})
    assert completion.sampling_params(max_tokens=5, logprobs=None).temperature is None


def _admit(params: SamplingParams, defaults: dict):
    config = SchedulerConfig(max_model_len=64, generation_defaults=defaults)
    state = admit_request(Request("r", [1, 2, 3], params), config, num_gpu_blocks=64,
                          num_watermark_blocks=0, eos_token_ids=frozenset(), num_queued=0)
    return state.sampling


def test_the_scheduler_admission_is_where_defaults_apply():
    assert _admit(SamplingParams(), QWEN) == SamplingParams(min_p=0.0, **QWEN)
    assert _admit(SamplingParams(temperature=1.5), QWEN).temperature == 1.5
    assert _admit(SamplingParams(), {}) == SamplingParams(**NEUTRAL_VALUES)


def test_generation_config_modes(tmp_path):
    model = _model_dir(tmp_path, QWEN)
    defaults, source = read_generation_defaults("auto", model)
    assert defaults == QWEN and source.endswith("generation_config.json")
    assert read_generation_defaults("vllm", model)[0] == {}
    other = _model_dir(tmp_path, {"temperature": 0.2, "top_k": 0}, "other")
    assert read_generation_defaults(str(other), model)[0] == {"temperature": 0.2, "top_k": -1}
    assert read_generation_defaults("auto", tmp_path)[0] == {}  # no file: no defaults
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        read_generation_defaults(str(tmp_path / "missing"), model)
    bad = _model_dir(tmp_path, {"temperature": 5.0}, "bad")
    with pytest.raises(GenerationConfigError, match="temperature must be in"):
        read_generation_defaults("auto", bad)
    line = describe(QWEN, source)
    assert "temperature=0.7 top_p=0.8 top_k=20 repetition_penalty=1.05" in line
    assert describe({}, "--generation-config vllm").startswith(
        "generation defaults: none (--generation-config vllm)")


def test_flags_reach_the_config_and_survive_the_hand_off():
    ns = build_arg_parser().parse_args(["--generation-config", "vllm",
                                        "--chat-template", "{{ messages }}"])
    cfg = config_from_args(ns)
    assert (cfg.model.generation_config, cfg.model.chat_template) == ("vllm", "{{ messages }}")
    cfg.model_info.generation_defaults = dict(QWEN)
    again = EngineConfig.from_json(cfg.to_json())
    assert again.model_info.generation_defaults == QWEN
    assert SchedulerConfig.from_engine(_resolved(again)).generation_defaults == QWEN


def _resolved(cfg: EngineConfig) -> EngineConfig:
    cfg.model_info.model_dir, cfg.model_info.max_position_embeddings = "/m", 128
    return cfg
