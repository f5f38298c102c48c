import json

import pytest

from pagedserve.workers.loader import TEST_MODEL, resolve_model


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model(TEST_MODEL)


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    """A tiny random Llama with the byte-level ChatML tokenizer whose EOS is <|im_end|> (a
    special token, so it is not in the text): random logits leave all the work to the masks."""
    from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
    from pagedserve.workers.testing import make_tiny_llama
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny-chat"), seed=7, vocab_size=259)
    tokenizer = make_tiny_tokenizer()
    tokenizer.save_pretrained(path)
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.exists():
            config = json.loads(file.read_text())
            config["eos_token_id"] = tokenizer.eos_token_id
            file.write_text(json.dumps(config))
    return path
