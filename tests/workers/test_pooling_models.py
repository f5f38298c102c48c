"""Pooled embeddings from the model runner against transformers: a tiny random BERT (mean
pooling, bidirectional attention over each input of a batch) and a tiny random Llama's final
hidden states (last-token pooling across prefill chunks, mean pooling), with a sampling
sequence in the same step whose logits stay what they are alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve.pipeline.pooling import PoolerConfig
from pagedserve.workers.loader import load_config
from pagedserve.workers.model_runner import ModelRunner, SeqStep
from pagedserve.workers.testing import make_tiny_llama

BLOCK = 16


def make_tiny_bert(path, seed=0):
    from transformers import BertConfig, BertModel
    config = BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=64, type_vocab_size=2)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = BertModel(config).float()
        for name, param in model.named_parameters():
            param.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.2 if "LayerNorm" in name
                          else 0.3)
    model.save_pretrained(path)
    return path


def runner_for(model_dir, pooler, num_blocks=64):
    return ModelRunner(load_config(model_dir), model_dir, torch.float32, "cpu", BLOCK, num_blocks,
                       pooler=pooler)


def cosine(a, b):
    return F.cosine_similarity(torch.as_tensor(a).float(), torch.as_tensor(b).float(), dim=-1)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def test_bert_mean_pooling_matches_transformers(tiny_bert):
    from transformers import BertModel
    reference = BertModel.from_pretrained(tiny_bert, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    inputs = [rng.integers(1, 300, n).tolist() for n in (7, 1, 33, 20)]
    runner = runner_for(tiny_bert, PoolerConfig("MEAN", True))
    tables = [[2 * i, 2 * i + 1, 2 * i + 8, 2 * i + 9] for i in range(len(inputs))]
    out = runner.run([SeqStep(ids, 0, table, False, pool=True)
                      for ids, table in zip(inputs, tables)])
    assert out.logits.shape[0] == 0 and out.pooled.shape == (4, 64)
    for ids, got in zip(inputs, out.pooled):
        with torch.no_grad():
            hidden = reference(torch.tensor([ids])).last_hidden_state[0]
        want = F.normalize(hidden.mean(0), dim=-1)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        assert cosine(got, want) >= 0.9999
        assert abs(float(got.norm()) - 1.0) < 1e-5


def test_bert_cls_pooling_unnormalized(tiny_bert):
    from transformers import BertModel
    reference = BertModel.from_pretrained(tiny_bert, dtype=torch.float32).eval()
    ids = list(range(5, 17))
    runner = runner_for(tiny_bert, PoolerConfig("CLS", False))
    out = runner.run([SeqStep(ids, 0, [0], False, pool=True)])
    with torch.no_grad():
        want = reference(torch.tensor([ids])).last_hidden_state[0, 0]
    assert torch.allclose(out.pooled[0], want, atol=1e-5)


def test_bert_refuses_a_partial_input(tiny_bert):
    runner = runner_for(tiny_bert, PoolerConfig("MEAN", True))
    with pytest.raises(ValueError, match="whole prompt in one step"):
        runner.run([SeqStep([5, 6, 7], 3, [0], False, pool=True)])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-pool"), seed=1)


def llama_hidden(model_dir, ids):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


def test_decoder_last_pooling_across_chunks(tiny_llama):
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 512, 40).tolist()
    other = rng.integers(3, 512, 9).tolist()
    runner = runner_for(tiny_llama, PoolerConfig("LAST", True))
    table = [5, 9, 2]
    # chunk 1 computes nothing that is returned; chunk 2 ends the prompt and is pooled, in one
    # step with a sampling sequence
    first = runner.run([SeqStep(ids[:25], 0, table, False)])
    assert first.pooled is None and first.logits.shape[0] == 0
    mixed = runner.run([SeqStep(other, 0, [7], True),
                        SeqStep(ids[25:], 25, table, False, pool=True)])
    want = F.normalize(llama_hidden(tiny_llama, ids)[-1], dim=-1)
    assert cosine(mixed.pooled[0], want) >= 0.9999
    assert torch.allclose(mixed.pooled[0], want, atol=1e-4)
    alone = runner_for(tiny_llama, PoolerConfig("LAST", True)).run([SeqStep(other, 0, [7], True)])
    assert torch.equal(mixed.logits, alone.logits)


def test_decoder_mean_pooling(tiny_llama):
    ids = list(range(3, 30))
    out = runner_for(tiny_llama, PoolerConfig("MEAN", False)).run(
        [SeqStep([4], 0, [1], False, pool=True), SeqStep(ids, 0, [2, 3], False, pool=True)])
    hidden = llama_hidden(tiny_llama, ids)
    assert torch.allclose(out.pooled[1], hidden.mean(0), atol=1e-4)
    assert torch.allclose(out.pooled[0], llama_hidden(tiny_llama, [4])[0], atol=1e-4)


@pytest.mark.parametrize("lengths", [[5, 5, 5], [40, 38, 3, 1, 1, 17, 16, 16], [1], [64] * 70])
def test_grouped_encoder_attention_is_the_per_input_attention(lengths):
    from pagedserve.workers.models.encoder_attention import attend, plan_groups
    torch.manual_seed(0)
    total, heads, dim = sum(lengths), 3, 8
    q, k, v = (torch.randn(total, heads, dim) for _ in range(3))
    spans = np.cumsum([0, *lengths])
    spans = list(zip(spans[:-1].tolist(), spans[1:].tolist()))
    got = attend(torch.stack([q, k, v], 1), plan_groups(spans, "cpu"))
    for a, b in spans:
        want = F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)))
        assert torch.allclose(got[a:b], want.transpose(0, 1), atol=1e-6)
