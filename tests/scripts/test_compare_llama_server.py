"""scripts/compare_llama_server.py and llama_server_build.py without building llama.cpp: the
arguments both servers get, the summary and ratios, the sdist check, the build cache and its AMX
verdict, start/stop of a server."""
import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import compare_llama_server as compare  # noqa: E402
import llama_server_build as build  # noqa: E402


def args(*argv):
    return compare.build_parser().parse_args(list(argv))


def test_default_and_single_stream_bench_arguments():
    bench = compare.bench_arguments(args())
    assert bench[:6] == ["--num-prompts", "64", "--max-concurrency", "64",
                         "--max-output-tokens", "256"]
    assert bench[bench.index("--request-rate") + 1] == "inf"
    single = compare.bench_arguments(args("--single-stream"))
    assert single[:4] == ["--num-prompts", "6", "--max-concurrency", "1"]


def test_server_commands(tmp_path):
    llama, ours = compare.servers(args("--our-args=-q int8"), Path("/bin/llama-server"),
                                  Path("/m.gguf"), tmp_path)
    assert llama.cmd[:7] == ["/bin/llama-server", "-m", "/m.gguf", "-np", "64", "-c",
                             str(64 * (1024 + 256 + 128))]
    assert llama.cmd[7:12] == ["-t", "2", "-tb", "2", "-cb"]
    assert ours.cmd[1:5] == ["-m", "pagedserve.pipeline.launch", "--model",
                             "Qwen2.5-Coder-0.5B-Instruct"]   # the default model
    assert ours.cmd[-2:] == ["-q", "int8"] and llama.port != ours.port
    _, ours = compare.servers(args("--gguf", "/x.gguf"), Path("b"), Path("/x.gguf"), tmp_path)
    assert ours.cmd[ours.cmd.index("--model") + 1] == "/x.gguf"
    _, ours = compare.servers(args("--model", "SmolLM2-135M-Instruct"), Path("b"), Path("/s"),
                              tmp_path)
    assert ours.cmd[ours.cmd.index("--model") + 1] == "SmolLM2-135M-Instruct"


def run(tok_s, ttft, tpot):
    return {"output_tok_s": tok_s, "ttft_ms_p50": ttft, "ttft_ms_p99": ttft, "tpot_ms_p50": tpot,
            "itl_ms_p50": tpot, "e2e_ms_p50": 1.0, "completed": 4, "failed": 0}


def test_summary_medians_and_ratios():
    summary = compare.summarize({"pagedserve": [run(300, 10, 50), run(260, 12, 60)],
                                 "llama_server": [run(100, 40, 100), run(80, 50, 120)]})
    assert summary["median"]["pagedserve"]["output_tok_s"] == 280
    assert summary["ratios"]["output_tok_s"] == pytest.approx(280 / 90, abs=1e-3)
    assert summary["ratios"]["output_tok_s_per_pair"] == [3.0, 3.25]
    assert summary["ratios"]["ttft_ms_p50"] == pytest.approx(11 / 45, abs=1e-3)


def test_sdist_must_vendor_llama_cpp(tmp_path):
    with pytest.raises(SystemExit, match="vendors no llama.cpp"):
        build.vendored_source(tmp_path)
    tree = tmp_path / "llama.cpp"
    (tree / "tools" / "server").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("")
    assert build.vendored_source(tmp_path) == tree


def test_cached_binary_is_reused_on_the_cpu_it_was_built_for(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "cache_root", lambda: tmp_path)
    folder = tmp_path / "llama.cpp" / "1.0"
    folder.mkdir(parents=True)
    assert build.cached_server("1.0") is None
    (folder / "llama-server").write_text("")
    (folder / "build_info.json").write_text(json.dumps({"machine": build.build_machine()}))
    assert build.cached_server("1.0") is None       # built before llama-perplexity was a target
    (folder / "llama-perplexity").write_text("")
    assert build.cached_server("1.0") == folder / "llama-server"
    other = {**build.build_machine(), "cpu_flags": ["avx"]}
    (folder / "build_info.json").write_text(json.dumps({"machine": other}))
    assert build.cached_server("1.0") is None


FAKE_SERVER = textwrap.dedent("""
    import http.server, signal, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
    signal.signal(signal.SIGINT, lambda *a: sys.exit(0))
    server.serve_forever()
""")


def test_server_starts_when_healthy_and_stops_on_sigint(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SERVER)
    server = compare.Server("fake", [sys.executable, str(script), str(port)], port,
                            tmp_path / "fake.log")
    server.start(timeout=30)
    pid = server.proc.pid
    assert server.stop() == "SIGINT, exit 0"
    with pytest.raises(ProcessLookupError):
        import os
        os.kill(pid, 0)


def test_server_that_dies_while_starting_shows_its_log(tmp_path):
    server = compare.Server("broken", [sys.executable, "-c",
                                       "print('no such model'); raise SystemExit(3)"], 1,
                            tmp_path / "broken.log")
    with pytest.raises(SystemExit, match="(?s)exited with 3 while starting; the end of "
                                         ".*broken.log:\nno such model"):
        server.start(timeout=30)


def test_server_that_had_exited_stops_without_signals(tmp_path):
    import subprocess
    server = compare.Server("gone", [], 1, tmp_path / "gone.log")
    server.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    server.proc.wait()
    assert server.stop() == "had exited with 3"


@pytest.mark.parametrize("usable, flagged", [(False, True), (True, False), (None, False)])
def test_amx_kernels_are_left_out_where_tiles_do_not_run(monkeypatch, usable, flagged):
    """GGML_NATIVE compiles ggml's AMX kernels wherever the CPU lists AMX; where the system does
    not let a process use the tiles, llama-server died of SIGILL at its first matmul."""
    monkeypatch.setattr(build, "build_machine", lambda: {"amx_usable": usable})
    flags = build.cmake_flags()
    assert "-DGGML_NATIVE=ON" in flags
    assert ("-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in flags) is flagged


def test_an_avx2_build_is_cached_apart_and_ours_runs_its_avx2_kernels(tmp_path, monkeypatch):
    """--isa avx2: llama-server without GGML_NATIVE (AVX2, FMA, F16C; no AVX-512) in a folder of
    its own, and our server started with PAGEDSERVE_NATIVE_VARIANT=avx2."""
    flags = build.cmake_flags("avx2")
    assert "-DGGML_NATIVE=ON" not in flags and "-DGGML_NATIVE=OFF" in flags
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF"} <= set(flags)
    monkeypatch.setattr(build, "cache_root", lambda: tmp_path)
    assert build.cache_folder("1.0", "avx2") == tmp_path / "llama.cpp" / "1.0-avx2"
    assert build.cache_folder("1.0") == tmp_path / "llama.cpp" / "1.0"
    args = compare.build_parser().parse_args(["--isa", "avx2"])
    llama, ours = compare.servers(args, Path("/bin/llama-server"), Path("m.gguf"), tmp_path)
    assert ours.env == {"PAGEDSERVE_NATIVE_VARIANT": "avx2"} and llama.env == {}


def test_bench_large_gguf_builds_both_commands_through_compare(tmp_path):
    """bench_large_gguf reuses compare's server commands for one stream: every field compare
    reads must be there (a missing one broke the script), and --isa avx2 reaches ours."""
    import bench_large_gguf as large
    for isa, env in (("native", {}), ("avx2", {"PAGEDSERVE_NATIVE_VARIANT": "avx2"})):
        a = large.build_parser().parse_args(["Qwen2.5-Coder-1.5B-Instruct", "--isa", isa])
        servers = large.make_servers(a, Path("/bin/llama-server"), "Qwen2.5-Coder-1.5B-Instruct",
                                     Path("/q.gguf"), tmp_path)
        llama, ours = servers["llama"], servers["ours"]
        assert llama.cmd[:6] == ["/bin/llama-server", "-m", "/q.gguf", "-np", "1", "-c"]
        assert ours.cmd[ours.cmd.index("--max-num-seqs") + 1] == "1"
        assert ours.env == env
