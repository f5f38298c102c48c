"""Tools without a flag: the tool-call parser is chosen from the chat template when
--tool-call-parser is absent (the flag still overrides), so `tool_choice: auto` works on a
tool-aware template; a template without tools keeps its 400."""
import asyncio
import logging
from types import SimpleNamespace

import httpx
import pytest

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.context import IngressContext
from pagedserve.pipeline.ingress.testing import CHATML_TEMPLATE, make_test_context
from pagedserve.pipeline.lora_config import LoRAArgs
from pagedserve.pipeline.ingress.tool_parsers import parser_for_template
from pagedserve.pipeline.ingress.tools import resolve_tool_parser

HERMES = CHATML_TEMPLATE.replace(
    "{% for message in messages %}",
    "{% if tools %}{{ '<|im_start|>system\\nCalls go in <tool_call></tool_call> tags: ' }}"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}", 1)
LLAMA3 = ("{% if tools %}{{ '<|start_header_id|>user<|end_header_id|>Respond as "
          "{\"name\": function name, \"parameters\": arguments}' }}{% endif %}"
          "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] }}{% endfor %}")
MISTRAL = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}[TOOL_CALLS]"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("template, parser", [
    (HERMES, "hermes"), (LLAMA3, "llama3_json"), (MISTRAL, None), (CHATML_TEMPLATE, None),
    (None, None), ("", None)])
def test_parser_from_the_templates_markers(template, parser):
    assert parser_for_template(template) == parser


def test_the_flag_overrides_and_the_choice_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.ingress"):
        assert resolve_tool_parser("llama3_json", HERMES) == "llama3_json"
        assert resolve_tool_parser(None, HERMES) == "hermes"
        assert resolve_tool_parser(None, MISTRAL) is None
    assert "the hermes parser, chosen from the chat template" in caplog.text
    assert "no parser here reads" in caplog.text


def test_ingress_context_from_config_chooses_the_parser():
    tokenizer = SimpleNamespace(chat_template=HERMES)
    cfg = SimpleNamespace(
        served_model_name="m", max_model_len=64, model_info=SimpleNamespace(
            vocab_size=300, hidden_size=16, is_encoder=False, model_dir="m"),
        scheduling=SimpleNamespace(max_queued_requests=8, max_num_seqs=4),
        model=SimpleNamespace(model="m"),
        server=SimpleNamespace(api_key=None, max_request_bytes=1 << 16, tool_call_parser=None,
                               reasoning_parser=None),
        lora=LoRAArgs(), ipc=SimpleNamespace(ipc_dir=""))
    assert IngressContext.from_config(cfg, engine=None, tokenizer=tokenizer).tool_call_parser \
        == "hermes"
    cfg.server.tool_call_parser = "llama3_json"
    assert IngressContext.from_config(cfg, engine=None, tokenizer=tokenizer).tool_call_parser \
        == "llama3_json"


def test_tool_choice_auto_works_without_the_flag_on_a_tool_aware_template():
    from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
    tok = make_tiny_tokenizer.__wrapped__()
    tok.chat_template = HERMES

    async def main():
        ctx, engine = make_test_context(tok, max_model_len=512)
        ctx.tool_call_parser = resolve_tool_parser(None, tok.chat_template)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "1+2?"}], "tools": TOOLS,
                "tool_choice": "auto", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert '"name": "add"' in tok.decode(engine.submitted[-1].prompt_token_ids)
            ctx.tool_call_parser = resolve_tool_parser(None, CHATML_TEMPLATE)
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "1+2?"}], "tools": TOOLS})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
            assert "--tool-call-parser" in r.json()["error"]["message"]
    asyncio.run(main())


@pytest.mark.slow
def test_the_default_models_template_gets_the_hermes_parser():
    from pagedserve.pipeline.tokenizer import load_tokenizer
    from pagedserve.workers.loader import DEFAULT_MODEL, TEST_MODEL, resolve_model
    try:
        qwen = load_tokenizer(resolve_model(DEFAULT_MODEL))
    except Exception as exc:
        pytest.skip(f"{DEFAULT_MODEL} is not available: {exc}")
    assert resolve_tool_parser(None, qwen.chat_template) == "hermes"
    smol = load_tokenizer(resolve_model(TEST_MODEL))
    assert resolve_tool_parser(None, smol.chat_template) is None  # renders no tools
