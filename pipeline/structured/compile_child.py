"""A grammar compile process: compiles one spec at a time inside CPU and memory limits.

Started by compile_pool.py with pipes as stdin and stdout (framed msgpack): a `Hello` (the
vocabulary, the limits), then a `Job` per spec, each answered with a `Done` carrying xgrammar's
serialized CompiledGrammar or the error for the client. A compile past the CPU limit ends this
process (SIGXCPU); one past the memory limit fails to allocate (an error, then this process
exits: its heap is not to be trusted). The parent kills it past the wall-clock limit. It dies
with its parent (PR_SET_PDEATHSIG, and stdin's end).
"""
from __future__ import annotations

import ctypes
import math
import os
import resource
import signal
import sys
import time
from multiprocessing.connection import Connection

import msgspec

from pagedserve.pipeline.structured.spec import StructuredOutputs, parse_grammar, xgrammar_message


class Hello(msgspec.Struct, frozen=True):
    tokenizer_dir: str
    vocab_size: int
    eos_token_ids: list[int]
    cache_root: str
    memory_mb: int          # address space a compile may add to the started process
    max_grammar_mb: int     # the serialized compiled grammar


class Job(msgspec.Struct, frozen=True):
    spec: StructuredOutputs
    cpu_s: int


class Done(msgspec.Struct, frozen=True):
    grammar: str | None = None  # CompiledGrammar.serialize_json()
    error: str | None = None    # for the client
    seconds: float = 0.0
    pid: int = 0
    fatal: bool = False         # this process exits after the reply


def _die_with_parent() -> None:
    # lifecycle.die_with_parent would import the engine's config and scheduler: not here.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(0)


def _limit_memory(extra_mb: int) -> None:
    """Cap the address space at what the started process maps plus `extra_mb`."""
    try:
        with open("/proc/self/status") as status:
            vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    except (OSError, StopIteration, ValueError):
        return
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra_mb * 2**20, resource.RLIM_INFINITY))


def _limit_cpu(seconds: int) -> None:
    """The next compile may use `seconds` more of CPU time; past it the kernel sends SIGXCPU."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = math.ceil(usage.ru_utime + usage.ru_stime)
    resource.setrlimit(resource.RLIMIT_CPU, (used + seconds, resource.RLIM_INFINITY))


def compile_one(compiler, spec: StructuredOutputs, hello: Hello) -> Done:
    started = time.perf_counter()
    try:
        compiled = compiler.compile_grammar(parse_grammar(spec))
        text = compiled.serialize_json()
    except (RuntimeError, MemoryError) as exc:
        if isinstance(exc, MemoryError) or "bad_alloc" in str(exc):
            return Done(error=f"grammar compilation exceeded its memory limit of "
                              f"{hello.memory_mb} MiB", fatal=True)
        return Done(error=f"structured output {spec.kind} does not compile: "
                          f"{xgrammar_message(exc)}")
    except ValueError as exc:
        return Done(error=str(exc))
    if len(text) > hello.max_grammar_mb * 2**20:
        return Done(error=f"structured output {spec.kind} compiles to a grammar of "
                          f"{len(text) / 2**20:.0f} MiB but at most {hello.max_grammar_mb} MiB "
                          "are allowed")
    return Done(grammar=text, seconds=time.perf_counter() - started)


def serve(inbox: Connection, outbox: Connection) -> None:
    hello = msgspec.msgpack.decode(inbox.recv_bytes(), type=Hello)
    import xgrammar as xgr

    from pagedserve.pipeline.structured.vocab_cache import tokenizer_info
    from pathlib import Path
    info = tokenizer_info(hello.tokenizer_dir, hello.vocab_size, hello.eos_token_ids,
                          Path(hello.cache_root))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _limit_memory(hello.memory_mb)
    outbox.send_bytes(msgspec.msgpack.encode(Done(pid=os.getpid())))  # ready
    while True:
        try:
            job = msgspec.msgpack.decode(inbox.recv_bytes(), type=Job)
        except EOFError:  # the parent closed the pipe, or is gone
            return
        _limit_cpu(job.cpu_s)
        done = compile_one(compiler, job.spec, hello)
        outbox.send_bytes(msgspec.msgpack.encode(done))
        if done.fatal:
            return


def main() -> None:
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would dump core
    outbox = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # what a library prints goes to stderr, not into the replies
    serve(Connection(os.dup(0), writable=False), outbox)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown (torch's takes seconds)


if __name__ == "__main__":
    main()
