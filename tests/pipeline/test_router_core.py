"""The router's pure parts: affinity on the hash ring with a load bound, replica choice, token
buckets with fake time, model slots (LRU), prompt keys and the command line."""
import pytest

from pagedserve.pipeline.router.affinity import HashRing, choose, load_bound, prefix_key
from pagedserve.pipeline.router.config import config_from_argv, parse_api_key, wants_router
from pagedserve.pipeline.router.core import NoReplica, Replica, RouterCore, RoutingPolicy
from pagedserve.pipeline.router.model_slots import ModelSlots, ModelState
from pagedserve.pipeline.router.prompts import affinity_prompt, estimate_tokens
from pagedserve.pipeline.router.ratelimit import KeyLimit, RateLimiter, TokenBucket


def keys(n):
    return [prefix_key(f"conversation {i} " * 8, block_size=16, num_blocks=4) for i in range(n)]


def test_ring_moves_only_the_keys_of_a_removed_replica():
    ring = HashRing(["a", "b", "c"])
    before = {k: ring.owner(k) for k in keys(300)}
    assert set(before.values()) == {"a", "b", "c"}  # 64 points each spread the keys
    ring.remove("b")
    for k, owner in before.items():
        assert ring.owner(k) == owner if owner != "b" else ring.owner(k) in ("a", "c")
    ring.add("b")
    assert {k: ring.owner(k) for k in before} == before  # back exactly


def test_prefix_key_is_the_first_blocks():
    head = "x" * (16 * 4 * 4)  # 4 blocks of 16 tokens at 4 characters each
    assert prefix_key(head + "one", block_size=16, num_blocks=4) == \
        prefix_key(head + "two", block_size=16, num_blocks=4)
    assert prefix_key("short a", block_size=16, num_blocks=4) != \
        prefix_key("short b", block_size=16, num_blocks=4)
    ids = list(range(64))
    assert prefix_key(ids + [1], block_size=16, num_blocks=4) == \
        prefix_key(ids + [2], block_size=16, num_blocks=4)


def test_choose_keeps_affinity_within_the_bound_and_spills_above_it():
    ring = HashRing(["a", "b"])
    key = next(k for k in keys(50) if ring.owner(k) == "a")
    assert choose(ring, key, {"a": 0, "b": 0}, 100, floor=1000).replica_id == "a"
    # a holds 5000 of 5100 outstanding: over 1.25 x the mean (3250 after the request)
    spilled = choose(ring, key, {"a": 5000, "b": 0}, 100, factor=1.25, floor=1000)
    assert (spilled.replica_id, spilled.affinity) == ("b", False)
    # under the floor nothing spills, however uneven
    assert choose(ring, key, {"a": 800, "b": 0}, 100, floor=1000).replica_id == "a"
    assert load_bound({"a": 5000, "b": 0}, 100, 1.25, 1000) == 3188
    with pytest.raises(LookupError):
        choose(ring, key, {}, 1)


def test_core_routes_around_unhealthy_replicas_and_counts_load():
    core = RouterCore(RoutingPolicy(load_floor=10))
    for rid in ("m/0", "m/1"):
        core.add(Replica(rid, "m", f"http://{rid}", healthy=True))
    key = keys(1)[0]
    first = core.pick("m", key, 5).replica_id
    assert core.pick("m", key, 5).replica_id == first  # same key, same replica
    core.set_healthy(first, False)
    other = core.pick("m", key, 5).replica_id
    assert other != first
    core.begin(other, 5)
    assert core.replicas[other].outstanding_tokens == 5
    core.end(other, 5)
    assert core.replicas[other].outstanding_requests == 0
    with pytest.raises(NoReplica):
        core.pick("m", key, 5, exclude=[other])
    with pytest.raises(NoReplica):
        core.pick("other-model", key, 5)


def test_round_robin_alternates():
    core = RouterCore(RoutingPolicy(affinity=False))
    for rid in ("m/0", "m/1"):
        core.add(Replica(rid, "m", "u", healthy=True))
    key = keys(1)[0]
    assert [core.pick("m", key, 1).replica_id for _ in range(4)] == ["m/0", "m/1"] * 2


def test_token_bucket_with_fake_time():
    bucket = TokenBucket(60, burst_seconds=2, now=0.0)  # 1 per second, 2 at once
    assert bucket.wait_for(1, 0.0) == 0
    bucket.take(1, 0.0)
    bucket.take(1, 0.0)
    assert bucket.wait_for(1, 0.0) == pytest.approx(1.0)
    assert bucket.wait_for(1, 0.5) == pytest.approx(0.5)
    assert bucket.wait_for(1, 1.0) == 0
    assert bucket.wait_for(100, 10.0) == 0  # more than the capacity asks for the capacity


def test_rate_limiter_requests_tokens_and_settling():
    limiter = RateLimiter({"k": KeyLimit(requests_per_minute=60, tokens_per_minute=600)},
                          burst_seconds=2)
    assert limiter.admit("free", 10**9, 0.0) == 0  # keys without limits
    assert limiter.admit("k", 10, 0.0) == 0
    assert limiter.admit("k", 10, 0.0) == 0
    assert limiter.admit("k", 10, 0.0) == pytest.approx(1.0)  # out of requests
    assert limiter.admit("k", 10, 1.0) == 0
    # tokens: 20 per 2 s; 30 charged so far. Settling a smaller real count gives some back
    limiter.settle("k", 10, 2, 1.0)
    assert limiter.admit("k", 20, 3.0) == 0
    assert limiter.admit("k", 20, 3.0) > 0


def test_model_slots_load_lazily_and_evict_the_least_recently_used_idle_model():
    slots = ModelSlots(["a", "b", "c"], max_loaded=2)
    assert slots.plan("a").load == "a"
    slots.loading("a")
    assert slots.plan("a").wait
    slots.loaded("a", now=1.0)
    assert slots.plan("a").ready
    slots.loading("b")
    slots.loaded("b", now=2.0)
    slots.begin("a", now=3.0)  # a is busy and now the most recent
    slots.end("a", now=3.0)
    plan = slots.plan("c")
    assert (plan.load, plan.evict) == ("c", "b")  # b is the least recently used
    slots.begin("a", now=4.0)
    slots.begin("b", now=4.0)
    assert slots.plan("c").wait  # both busy: nothing to evict
    slots.end("b", now=5.0)
    assert slots.plan("c").evict == "b"
    slots.unloading("b")
    assert slots.state("b") is ModelState.UNLOADING and slots.plan("b").wait
    with pytest.raises(KeyError, match="not served"):
        slots.plan("zzz")
    with pytest.raises(ValueError):
        ModelSlots(["a"], max_loaded=0)


def test_chat_turns_share_their_affinity_prompt():
    turn1 = {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Name a fruit."}]}
    turn2 = {"messages": turn1["messages"] + [{"role": "assistant", "content": "Apple."},
                                              {"role": "user", "content": "Another?"}]}
    assert affinity_prompt("chat", turn1) == affinity_prompt("chat", turn2)
    assert affinity_prompt("completion", {"prompt": [[1, 2], [3]]}) == [1, 2]
    assert estimate_tokens("completion", {"prompt": "x" * 40, "max_tokens": 5}) == 15


def test_command_line():
    assert wants_router(["--model", "a", "--model", "b"])
    assert wants_router(["--data-parallel-size=2"])
    assert not wants_router(["--model", "a", "--port", "1"])
    assert parse_api_key("k:60:") == ("k", KeyLimit(60.0, None))
    assert parse_api_key("k:::-5") == ("k", KeyLimit(None, None, priority_floor=-5))
    for bad in ("k:x", ":1", "k:1:2:3:4", "k:-1", "k:1:2:high", "k:1:2:1.5"):
        with pytest.raises(ValueError, match="--api-key"):
            parse_api_key(bad)
    cfg, _ = config_from_argv(["--model", "a=/m", "--model", "b=/m", "--max-loaded-models", "1",
                               "--dtype", "float32", "--block-size", "32"])
    assert list(cfg.models) == ["a", "b"] and cfg.block_size == 32
    assert cfg.models["a"].engine_args == ("--dtype", "float32", "--block-size", "32")
    with pytest.raises(ValueError, match="given twice"):
        config_from_argv(["--model", "/m", "--model", "/m"])
    with pytest.raises(ValueError, match="--preload"):
        config_from_argv(["--model", "a=/m", "--preload", "b"])


def test_no_model_named_serves_the_launchers_default_model():
    from pagedserve.pipeline.cli_args import build_arg_parser
    default = build_arg_parser().parse_args([]).model  # what a plain scripts/launch.sh serves
    cfg, _ = config_from_argv(["--data-parallel-size", "2", "--dtype", "float32"])
    assert list(cfg.models) == [default] and cfg.data_parallel_size == 2
    assert cfg.models[default].source == default
    assert cfg.models[default].engine_args == ("--dtype", "float32")
    cfg, _ = config_from_argv(["--engine-url", "http://e:8000"])
    assert cfg.models == {} and cfg.engine_urls == ["http://e:8000"]


def test_models_file(tmp_path):
    path = tmp_path / "models.json"
    path.write_text('[{"name": "small", "model": "/m/SmolLM2", "args": ["--max-num-seqs", "8"]},'
                    ' {"model": "/m/gemma-3-270m"}]')
    cfg, _ = config_from_argv(["--models-file", str(path), "--max-loaded-models", "1",
                               "--dtype", "float32"])
    assert list(cfg.models) == ["small", "gemma-3-270m"]
    assert cfg.models["small"].engine_args == ("--dtype", "float32", "--max-num-seqs", "8")
    path.write_text('{"model": "x"}')
    with pytest.raises(ValueError, match="JSON list"):
        config_from_argv(["--models-file", str(path)])
    with pytest.raises(ValueError, match="not both"):
        config_from_argv(["--model", "/m", "--engine-url", "http://e:8000"])
