"""The ctypes tables of kernels/native/features.py against the C definitions they call.

The sources go through the preprocessor first (most entry points are stamped out by macros:
DEFINE_FORMAT, DEFINE_RMS, DEFINE_PANEL_PACK ...); the definitions that come from
kernels/native, outside any brace, are parsed for their return and parameter types. A ctypes
declaration that disagrees with its definition passes garbage silently at run time, so each one
must match exactly, and every function a feature's sources export must be declared.
"""
from __future__ import annotations

import ctypes
import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pagedserve.kernels import native
from pagedserve.kernels.native import build
from pagedserve.kernels.native.features import FEATURES, LINEAR, TASK_POOL

# C type, qualifiers dropped -> ctypes; any pointer -> c_void_p
C_TYPES = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32,
           "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double,
           "int8_t": ctypes.c_int8, "uint8_t": ctypes.c_uint8, "uint16_t": ctypes.c_uint16,
           "uint32_t": ctypes.c_uint32, "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t}
_QUALIFIERS = {"const", "volatile", "restrict", "__restrict", "__restrict__", "register"}
_SPECIFIERS = {"extern", "inline", "__inline", "__inline__"}
_MARKER = re.compile(r'# \d+ "([^"]+)"')
_HIDDEN = re.compile(r'visibility\s*\(\s*"hidden"\s*\)\s*\)\s*\)[^;{(]*?\b(\w+)\s*\(')
_HEAD = re.compile(r"\s*(?P<spec>[\w\s*]*?)\s*\b(?P<name>\w+)\s*\((?P<params>[^()]*)\)\s*")


@pytest.fixture(scope="module")
def compiler():
    found = build.find_compiler()
    if found is None or shutil.which(found) is None:
        pytest.skip("no C compiler to preprocess the sources with")
    return found


@functools.cache
def _preprocessed(source: str, compiler: str) -> str:
    """The source after the preprocessor, only the lines that come from kernels/native (system
    headers define functions of their own)."""
    path = (build.SOURCE_DIR / source).resolve()
    text = subprocess.run([compiler, *build.BASE_FLAGS, "-E", str(path)], capture_output=True,
                          text=True, check=True, timeout=120).stdout
    kept, ours = [], False
    for line in text.splitlines():
        marker = _MARKER.match(line)
        if marker:
            ours = Path(marker.group(1)).resolve().parent == path.parent
        elif ours and not line.lstrip().startswith("#"):   # pragmas
            kept.append(line)
    return "\n".join(kept)


def _strip_attributes(text: str) -> str:
    while (start := text.find("__attribute__")) >= 0:
        depth, end = 0, text.index("(", start)
        for end in range(end, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        text = text[:start] + text[end + 1:]
    return text


def _ctype(declaration: str, named: bool):
    """ctypes type of a C parameter (`named`: ends in its name) or return type."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = [w for w in re.findall(r"\w+", declaration) if w not in _QUALIFIERS | _SPECIFIERS]
    name = " ".join(words[:-1] if named and len(words) > 1 else words)
    if name not in C_TYPES:
        raise AssertionError(f"C type {name!r} ({declaration!r}) has no entry in C_TYPES")
    return C_TYPES[name]


def exported_functions(source: str, compiler: str) -> dict[str, tuple]:
    """name -> (restype, argtypes) of every function `source` defines with external, visible
    linkage."""
    text = _preprocessed(source, compiler)
    hidden = set(_HIDDEN.findall(text))
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    found, depth, start = {}, 0, 0
    for index, char in enumerate(text):
        if char == "{":
            if depth == 0:
                head = _HEAD.fullmatch(_strip_attributes(text[start:index]))
                if head and "static" not in head["spec"].split() and head["name"] not in hidden:
                    params = head["params"].strip()
                    found[head["name"]] = (_ctype(head["spec"], named=False), tuple(
                        _ctype(p, named=True) for p in params.split(","))
                        if params not in ("", "void") else ())
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                start = index + 1
        elif char == ";" and depth == 0:
            start = index + 1
    return found


def _name(ctype) -> str:
    return "void" if ctype is None else ctype.__name__


def mismatches(declared: dict[str, tuple], defined: dict[str, tuple]) -> list[str]:
    """How the ctypes declarations differ from the C definitions (empty: they agree)."""
    problems = [f"{name}: exported by the C sources, not declared"
                for name in sorted(defined.keys() - declared.keys())]
    problems += [f"{name}: declared, not defined by the C sources"
                 for name in sorted(declared.keys() - defined.keys())]
    for name in sorted(declared.keys() & defined.keys()):
        (restype, argtypes), (c_restype, c_argtypes) = declared[name], defined[name]
        if restype is not c_restype:
            problems.append(f"{name}: returns {_name(c_restype)}, declared {_name(restype)}")
        if len(argtypes) != len(c_argtypes):
            problems.append(f"{name}: takes {len(c_argtypes)} parameters, declared "
                            f"{len(argtypes)}")
            continue
        problems += [f"{name}: parameter {i} is {_name(c)}, declared {_name(py)}"
                     for i, (py, c) in enumerate(zip(argtypes, c_argtypes), 1) if py is not c]
    return problems


@pytest.mark.parametrize("feature", FEATURES.values(), ids=list(FEATURES))
def test_declarations_match_the_c_definitions(feature, compiler):
    defined = {}
    for source in feature.sources:
        defined.update(exported_functions(source, compiler))
    assert defined, f"no exported function parsed from {feature.sources}"
    assert mismatches(feature.signatures, defined) == []


def test_the_task_pool_exports_nothing(compiler):
    # linked into every feature's library: hidden, so each calls its own copy
    assert exported_functions(TASK_POOL, compiler) == {}


def test_a_wrong_declaration_is_caught(compiler):
    defined = exported_functions("linear_f32.c", compiler) | exported_functions("linear_bf16.c",
                                                                                 compiler)
    wrong = dict(LINEAR.signatures)
    restype, argtypes = wrong["linear_f32"]
    wrong["linear_f32"] = (restype, argtypes[:-1] + (ctypes.c_int64,))   # num_threads is an int
    wrong["linear_bf16"] = (restype, argtypes)                           # one parameter short
    wrong["linear_pack_f32"] = (ctypes.c_int, wrong["linear_pack_f32"][1])   # returns void
    del wrong["linear_pack_bf16"]
    assert mismatches(wrong, defined) == [
        "linear_pack_bf16: exported by the C sources, not declared",
        "linear_bf16: takes 10 parameters, declared 9",
        "linear_f32: parameter 9 is c_int, declared c_long",
        "linear_pack_f32: returns void, declared c_int"]


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm to list a library's symbols")
@pytest.mark.usefixtures("native_variant")
@pytest.mark.parametrize("name", list(FEATURES))
def test_each_library_exports_exactly_its_declared_functions(name):
    if native.library(name) is None:
        pytest.skip(native.unavailable_reason(name))
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(native.library_path(name))],
                             capture_output=True, text=True, check=True).stdout
    functions = {line.split()[-1] for line in symbols.splitlines() if line.split()[1] == "T"}
    assert functions == set(FEATURES[name].signatures)


# replay.c's function pointer types -> the kernels each calls (kernels/native_replay.py)
_REPLAY_TYPEDEFS = {"norm_fn": ("rms_norm_f32",), "silu_fn": ("silu_mul_f32",),
                    "gguf_fn": ("gguf_linear",), "gguf_packed_fn": ("gguf_packed_linear",),
                    "linear_f32_fn": ("linear_f32",), "linear_q8_fn": ("linear_q8",),
                    "rope_store_fn": ("rope_store",),
                    "decode_fn": ("paged_decode_f32", "paged_decode_bf16", "paged_decode_e4m3",
                                  "paged_decode_e5m2")}
_TYPEDEF = re.compile(r"typedef\s+(?P<ret>[\w\s]+?)\s*\(\s*\*\s*(?P<name>\w+)\s*\)\s*"
                      r"\((?P<params>[^()]*)\)\s*;")


def test_the_replay_calls_each_kernel_with_its_declared_prototype(compiler):
    from pagedserve.kernels import native_replay
    declared = {name: sig for feature in FEATURES.values()
                for name, sig in feature.signatures.items()}
    typedefs = {m["name"]: (_ctype(m["ret"], named=False),
                            tuple(_ctype(p, named=False) for p in m["params"].split(",")))
                for m in _TYPEDEF.finditer(_preprocessed("replay.c", compiler))}
    assert set(typedefs) == set(_REPLAY_TYPEDEFS)
    for typedef, kernels in _REPLAY_TYPEDEFS.items():
        for kernel in kernels:
            assert typedefs[typedef] == declared[kernel], (typedef, kernel)
    for kind, (feature, kernel) in native_replay.KERNELS.items():
        assert native_replay.ARITY[kind] == len(FEATURES[feature].signatures[kernel][1]), kernel
    assert native_replay.ARITY[native_replay.DECODE] == len(declared["paged_decode_f32"][1])
