"""Secrets stay out of what other local users can read (issue 38): a child's command line and
environment, logs, /metrics. The config reaches each role in a 0600 file, API keys in a 0600
file, and a replica behind the router answers only requests carrying the router's secret."""
from __future__ import annotations

import os
import stat

import httpx
import psutil
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pagedserve import envs
from pagedserve.lifecycle import start_role
from pagedserve.pipeline.cli_args import build_arg_parser, config_from_args
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.ingress.replica_secret import REPLICA_SECRET_HEADER, ReplicaSecretCheck
from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.pipeline.router.config import config_from_argv, read_api_key_file
from pagedserve.pipeline.router.ratelimit import KeyLimit
from pagedserve.private_files import PrivateFileError, write_private
from pagedserve.workers.testing import make_tiny_llama

KEY = "sk-issue38-launcher-key"
ENV_KEY = "sk-issue38-environment-key"


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_config_file_is_0600_and_one_others_may_read_is_refused(tmp_path, capsys):
    cfg = EngineConfig.from_kwargs(api_key=KEY, ipc_dir=str(tmp_path / "ipc"))
    cfg.ipc.fill_defaults()
    path = cfg.ipc.config_file("worker0", 1)
    cfg.to_file(path)
    assert _mode(path) == 0o600 and os.stat(path).st_uid == os.getuid()
    assert EngineConfig.from_file(path).server.api_key == KEY
    with pytest.raises(FileExistsError):  # O_EXCL: never written into what is there
        cfg.to_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(PrivateFileError, match=r"open to other users \(mode 0644\)"):
        EngineConfig.from_file(path)
    with pytest.raises(SystemExit) as stopped:  # a role refuses it before anything else
        start_role("worker", "test", ["--config-file", path, "--rank", "0"])
    assert stopped.value.code == 2
    assert "open to other users (mode 0644)" in capsys.readouterr().err


def test_an_engine_reads_its_key_and_replica_secret_from_private_files(tmp_path):
    key_file, secret_file = str(tmp_path / "key"), str(tmp_path / "secret")
    write_private(key_file, KEY + "\n")
    write_private(secret_file, "replica-s3cret")

    def parsed(*flags):
        ns = build_arg_parser().parse_args([*flags, "--ipc-dir", str(tmp_path / "ipc")])
        return config_from_args(ns, env=envs.Environment()).server
    server = parsed("--api-key-file", key_file, "--replica-secret-file", secret_file)
    assert (server.api_key, server.replica_secret) == (KEY, "replica-s3cret")
    with pytest.raises(ValueError, match="not both"):
        parsed("--api-key-file", key_file, "--api-key", "other")
    os.chmod(secret_file, 0o604)
    with pytest.raises(ValueError, match=r"--replica-secret-file .* \(mode 0604\)"):
        parsed("--replica-secret-file", secret_file)


def test_a_childs_environment_has_no_secret():
    environ = envs.child_environ({"PAGEDSERVE_API_KEY": KEY, "HOME": "/h"}, PAGEDSERVE_ROLE="x")
    assert environ == {"HOME": "/h", "PAGEDSERVE_ROLE": "x", "PYTHONSAFEPATH": "1"}


def test_router_keys_come_from_a_private_file_and_errors_never_show_a_key(tmp_path):
    path = tmp_path / "keys"
    write_private(str(path), "# team a\nk-one:60:20000\n\nk-two\n")
    assert read_api_key_file(str(path)) == {"k-one": KeyLimit(60.0, 20000.0),
                                            "k-two": KeyLimit(None, None)}
    cfg, _ = config_from_argv(["--model", "/m", "--data-parallel-size", "2",
                               "--api-key-file", str(path), "--api-key", "k-three:5"])
    assert cfg.api_keys == {"k-one": KeyLimit(60.0, 20000.0), "k-two": KeyLimit(None, None),
                            "k-three": KeyLimit(5.0, None)}
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match=r"--api-key-file .* open to other users \(mode 0640\)"):
        read_api_key_file(str(path))
    bad = tmp_path / "bad"
    write_private(str(bad), "k-secret-one:many\n")
    with pytest.raises(ValueError) as refused:
        read_api_key_file(str(bad))
    assert "line 1" in str(refused.value) and "k-secret-one" not in str(refused.value)


def test_replica_secret_guards_every_route_but_health():
    async def ok(_request):
        return PlainTextResponse("ok")
    app = Starlette(routes=[Route(p, ok) for p in ("/health", "/v1/models", "/metrics")])
    client = TestClient(ReplicaSecretCheck(app, "s3cret"))
    assert client.get("/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/nowhere"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={REPLICA_SECRET_HEADER: "wrong"}).status_code == 401
    refused = client.get("/metrics")
    assert refused.json()["error"]["code"] == "invalid_replica_secret"
    assert client.get("/v1/models", headers={REPLICA_SECRET_HEADER: "s3cret"}).text == "ok"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", vocab_size=259)
    make_tiny_tokenizer().save_pretrained(model_dir)
    return model_dir


def _reveals(proc: psutil.Process, secrets: tuple[str, ...]) -> list[str]:
    """Where `proc` shows any of `secrets` to a reader of /proc: its cmdline or environ."""
    found = []
    cmdline = "\0".join(proc.cmdline())
    environ = "\0".join(f"{k}={v}" for k, v in proc.environ().items())
    for secret in secrets:
        found += [f"{where} of pid {proc.pid}" for where, text in
                  (("cmdline", cmdline), ("environ", environ)) if secret in text]
    return found


@pytest.mark.slow
def test_a_launched_groups_roles_show_no_key_in_cmdline_or_environ(tiny_model, monkeypatch):
    from faults.conftest import Group
    monkeypatch.setenv("PAGEDSERVE_API_KEY", ENV_KEY)
    group = Group(tiny_model, http=True, extra=("--api-key", KEY))
    try:
        roles = psutil.Process(group.proc.pid).children()
        assert len(roles) == 4  # scheduler, worker0, detokenizer, ingress
        launcher = psutil.Process(group.proc.pid)  # the user's process: given both, shows both
        assert len(_reveals(launcher, (KEY, ENV_KEY))) == 2
        every = launcher.children(recursive=True)
        assert [where for p in every for where in _reveals(p, (KEY, ENV_KEY))] == []
        config_files = [p.cmdline()[p.cmdline().index("--config-file") + 1] for p in roles]
        assert all(os.path.dirname(f) == group.ipc_dir and _mode(f) == 0o600
                   for f in config_files)
        models = f"http://127.0.0.1:{group.port}/v1/models"
        assert httpx.get(models, timeout=30).status_code == 401
        assert httpx.get(models, timeout=30,
                         headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        assert group.close() == 0
    assert group.leftovers() == []  # the config files went with the ipc folder


@pytest.mark.slow
def test_a_replica_answers_only_its_routers_requests(tiny_model, tmp_path):
    from e2e.router_group import Router
    keys = tmp_path / "keys"
    write_private(str(keys), f"{KEY}:600\n")
    router = Router("--model", f"tiny={tiny_model}", "--data-parallel-size", "1",
                    "--api-key-file", str(keys))
    try:
        (url, headers), = router.replicas().values()
        secret = headers[REPLICA_SECRET_HEADER]
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # liveness stays open
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=30).status_code == 401
            assert httpx.get(f"{url}{path}", headers=headers, timeout=30).status_code == 200
        answer = httpx.post(f"{router.base}/v1/completions", timeout=120,
                            headers={"Authorization": f"Bearer {KEY}"},
                            json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        exposed = httpx.get(f"{router.base}/metrics", timeout=30).text
        assert url.split("//")[1] not in exposed and KEY not in exposed
        assert 'replica="tiny/0"' in exposed
        group = [p for launcher in router.launchers()
                 for p in (launcher, *launcher.children(recursive=True))]
        assert [where for p in group for where in _reveals(p, (KEY, secret))] == []
        secret_file = group[0].cmdline()[group[0].cmdline().index("--replica-secret-file") + 1]
        assert _mode(secret_file) == 0o600
    finally:
        assert router.close() == 0
    assert router.leftovers() == []
