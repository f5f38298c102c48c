"""Engine configuration: one dataclass per concern, parsed from the CLI once at start-up.

The launcher parses the command line (pipeline/cli_args.py) into an `EngineConfig`, reads the
environment once (`env`, pagedserve/envs.py), resolves the model once (`model_info`), serializes
it all as JSON and hands it to every child process in a 0600 file of its private ipc folder
(`--config-file`: the config holds the API key, which a command line would show to every local
user), so all roles agree on one configuration and none reads the environment or the model files for
settings of its own.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import tempfile
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pagedserve import envs
from pagedserve.envs import Environment
from pagedserve.pipeline.lora_config import LoRAArgs
from pagedserve.pipeline.pooling import PoolerConfig
from pagedserve.pipeline.speculative_config import SpeculativeConfig
from pagedserve.private_files import read_private, write_private

QUANTIZATIONS = ("auto", "none", "int8", "gguf", "awq", "gptq")

# --kv-cache-dtype names (kernels/kv_format.py maps them to torch dtypes; kept here torch-free)
KV_CACHE_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """'2GiB', '512MiB', '1.5G', '1073741824' -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (examples: 2GiB, 512MiB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


@dataclass(slots=True)
class ModelArgs:
    model: str = "Qwen2.5-Coder-0.5B-Instruct"
    served_model_name: str | None = None
    # auto: bfloat16 where the device has native bf16 matmuls, else float32 (CPU) / float16
    # (CUDA); see workers/build.py resolve_dtype. float32 for exact reference checks.
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    # auto: a quantized checkpoint's own format kept as stored (gguf, awq, gptq: kernels/
    # native_linear_gguf.py on CPU, triton_quant_linear.py on CUDA), else none; none: weights
    # dequantized at load; int8: weights and activations in int8 blocks of 32 (llama.cpp's Q8_0
    # scheme) on CPU workers in fp32 (kernels/native/linear_q8.c)
    quantization: str = "auto"
    generation_config: str = "auto"   # --generation-config: auto, vllm or a directory
    chat_template: str | None = None  # --chat-template: a file or an inline Jinja template
    # --pooler-config: how embedding requests pool, vLLM's JSON ({"pooling_type": "MEAN",
    # "normalize": true}); None: the model's sentence-transformers files, else its kind's
    pooler_config: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"--dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.quantization == "int8" and self.dtype not in ("auto", "float32"):
            raise ValueError(f"--quantization int8 computes in float32 on CPU workers; it does not "
                             f"combine with --dtype {self.dtype}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be positive, got {self.max_model_len}")
        if self.pooler_config is not None:
            try:
                PoolerConfig.parse(self.pooler_config, PoolerConfig())
            except ValueError as exc:
                raise ValueError(f"--pooler-config {self.pooler_config!r}: {exc}") from None


@dataclass(slots=True)
class CacheArgs:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes per worker rank; None -> device default
    gpu_memory_utilization: float = 0.9
    swap_space: float = 1.0  # GiB of host swap pool
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # kernels/kv_format.py: auto, bfloat16, fp8 (e4m3), fp8_e5m2 ...
    # KV tiers below the device pool (kvmanager/tiers.py): host-memory bytes per worker rank
    # (0: none), and a directory of block files sized in bytes (None: no disk tier).
    kv_offload_memory: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_size: int = 8 << 30

    def __post_init__(self) -> None:
        self.kv_offload_memory = parse_bytes(self.kv_offload_memory)
        self.kv_offload_disk_size = parse_bytes(self.kv_offload_disk_size)
        if self.kv_offload_memory < 0 or self.kv_offload_disk_size < 0:
            raise ValueError(f"--kv-offload-memory and --kv-offload-disk-size must be >= 0 bytes, "
                             f"got {self.kv_offload_memory} and {self.kv_offload_disk_size}")
        if (self.kv_offload_memory or self.kv_offload_dir) and not self.enable_prefix_caching:
            raise ValueError("--kv-offload-memory and --kv-offload-dir keep prefix-cached blocks: "
                             "they need --enable-prefix-caching")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0 GiB, got {self.swap_space}")


@dataclass(slots=True)
class ParallelArgs:
    tensor_parallel_size: int = 1
    device: str = "auto"  # auto: cuda when available, else cpu
    # Compute threads per CPU worker rank; None: the usable cores split between the ranks, at
    # least 1, for torch ops and the native decode attention alike. Decode-sized steps used to
    # leave a core to the scheduler, detokenizer and HTTP ingress; since those cost a few ms per
    # step and the linears run packed on oneDNN (workers/models/layers.py), all cores serve more
    # (2-core AVX2 EPYC, 64 ShareGPT streams: 143.0 / 149.2 against 119.0 / 115.9 output tok/s,
    # TPOT p50 287-295 against 366-375 ms).
    cpu_threads: int | None = None
    # CUDA only: never replay decode steps from captured CUDA graphs (workers/cuda_graphs.py).
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")

    def threads_per_rank(self, ranks_on_host: int | None = None) -> int:
        """torch and native decode attention threads for one CPU worker rank (see cpu_threads);
        `ranks_on_host`: the ranks sharing this host's cores (default: all of them)."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        return max(1, _usable_cores() // (ranks_on_host or self.tensor_parallel_size))


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(slots=True)
class ClusterArgs:
    """Tensor parallelism across hosts (torchrun's names; pagedserve/cluster_net.py): node 0
    runs the whole group, node r > 0 only its worker ranks r*L .. r*L+L-1 (L = tp / nnodes)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 29500
    cluster_secret_file: str = ""   # authenticates the tcp sockets (pagedserve/cluster_auth.py)

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes) and --nnodes >= 1, got "
                             f"node rank {self.node_rank} of {self.nnodes}")
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError("--nnodes > 1 needs --master-addr (node 0's address)")

    def local_ranks(self, tensor_parallel_size: int) -> range:
        """The tensor-parallel ranks whose workers run on this node."""
        if tensor_parallel_size % self.nnodes:
            raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} does not split "
                             f"evenly over --nnodes {self.nnodes}")
        per_node = tensor_parallel_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


@dataclass(slots=True)
class SchedulingArgs:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_queued_requests: int = 4096
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    scheduling_policy: str = "fcfs"
    step_timeout: float = 120.0  # a step running longer means a hung worker group
    # Wall time one grammar compile may take (its process is killed past it, the request 400s).
    grammar_compile_timeout: float = 30.0
    # Plan a step of steady decodes while the workers compute the one before (one rank only:
    # Scheduler.schedule_ahead).
    async_scheduling: bool = True
    # --speculative-config as a dict (pipeline/scheduler/speculative.py); None: off.
    speculative_config: dict | None = None

    def __post_init__(self) -> None:
        SpeculativeConfig.parse(self.speculative_config)  # refused here, before any process
        if self.step_timeout <= 0:
            raise ValueError(f"--step-timeout must be positive seconds, got {self.step_timeout}")
        if self.grammar_compile_timeout <= 0:
            raise ValueError("--grammar-compile-timeout must be positive seconds, got "
                             f"{self.grammar_compile_timeout}")
        if self.preemption_mode not in ("swap", "recompute", "auto"):
            raise ValueError(f"--preemption-mode must be swap, recompute or auto, got {self.preemption_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")


@dataclass(slots=True)
class ServerArgs:
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    # The router's secret for this replica (--replica-secret-file): every route but /health
    # needs it in REPLICA_SECRET_HEADER (pipeline/ingress/replica_secret.py); None: not behind
    # our router.
    replica_secret: str | None = None
    http: bool = True  # start the HTTP ingress
    max_request_bytes: int = 1 << 20
    # Chat: how tool calls are read from the output (pipeline/ingress/tool_parsers.py) and
    # where the model's thinking ends (pipeline/ingress/reasoning.py); None: not parsed (the
    # tool-call parser: the ingress picks the one the chat template calls for, if any).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


REPLICA_SECRET_HEADER = "X-Pagedserve-Replica-Secret"


@dataclass(slots=True)
class SupervisorArgs:
    """Restart policy: more than `max_restarts` restarts of one role within `restart_window`
    seconds is a crash loop, and the group gives up."""

    max_restarts: int = 3
    restart_window: float = 60.0
    heartbeat_timeout: float = 10.0  # a scheduler/detokenizer silent this long is hung

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.restart_window <= 0 or self.heartbeat_timeout <= 0:
            raise ValueError("--restart-window and --heartbeat-timeout must be positive seconds")


@dataclass(slots=True)
class IpcArgs:
    """Socket addresses; ipc:// under `ipc_dir` on one host, tcp:// across hosts."""

    ipc_dir: str = ""
    frontend_addr: str = ""   # scheduler ROUTER: AddRequest / Abort / utility calls
    output_addr: str = ""     # detokenizer ROUTER: TextDelta to the owning client
    plan_addr: str = ""       # scheduler ROUTER <-> worker DEALERs: StepPlan, Reset / results
    events_addr: str = ""     # scheduler PULL <- detokenizer and launcher: StopMatched, RoleDown
    detok_addr: str = ""      # detokenizer PULL <- scheduler TokenBatch
    control_addr: str = ""    # launcher PULL <- every child's Ready / Fatal
    # torch.distributed rendezvous: a file:// store in the ipc folder on one host (only its
    # owner can open it); the launcher names a fresh one for every start of the worker group
    dist_init_addr: str = ""
    owns_dir: bool = False    # the launcher created ipc_dir, so it removes it at the end
    # Drawn once by the launcher and part of every shared-memory name, so that no other local
    # user can derive a name and plant a segment for a worker to attach to.
    shm_nonce: str = field(default_factory=lambda: secrets.token_hex(16))

    def fill_defaults(self) -> None:
        if not self.ipc_dir:
            self.ipc_dir = tempfile.mkdtemp(prefix="pagedserve-")  # mode 0700
            self.owns_dir = True
        else:
            self.owns_dir = prepare_ipc_dir(self.ipc_dir)
        for name in SOCKET_NAMES:
            attr = f"{name}_addr"
            if not getattr(self, attr):
                setattr(self, attr, f"ipc://{self.socket_path(name)}")

    def socket_path(self, name: str) -> str:
        return os.path.join(self.ipc_dir, f"{name}.sock")

    @property
    def tag(self) -> str:
        """This group's prefix for what it creates outside the ipc folder (shared-memory
        segments): the folder's name and a hash of its path, so two groups never share one."""
        path = os.path.abspath(self.ipc_dir)
        return f"{os.path.basename(path)}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"

    def config_file(self, role: str, incarnation: int) -> str:
        """The config a role's `incarnation`-th start reads (`--config-file`)."""
        return os.path.join(self.ipc_dir, f"config-{role}-{incarnation}.json")

    def breadcrumb_file(self, role: str) -> str:
        """Which request `role` is working on, for the launcher to read if it dies
        (pagedserve/breadcrumb.py)."""
        return os.path.join(self.ipc_dir, f"{role}.breadcrumb")

    def quarantine_file(self, role: str) -> str:
        """The requests that ended `role` before, which its next start refuses."""
        return os.path.join(self.ipc_dir, f"{role}.quarantine")

    def shm_segments(self, tensor_parallel_size: int) -> list[str]:
        """Every shared-memory segment the group creates: the scheduler's block tables and each
        rank's host swap pool."""
        return [self.block_tables_segment] + [self.swap_segment(r)
                                              for r in range(tensor_parallel_size)]

    @property
    def block_tables_segment(self) -> str:
        return f"{self.tag}_{self.shm_nonce}_bt"

    def swap_segment(self, rank: int) -> str:
        return f"{self.tag}_{self.shm_nonce}_swap{rank}"

    def rendezvous(self, start: int) -> str:
        """The file:// store of the worker group's `start`-th start."""
        return f"file://{os.path.join(self.ipc_dir, f'rendezvous-{start}')}"


SOCKET_NAMES = ("frontend", "output", "plan", "events", "detok", "control")


def prepare_ipc_dir(path: str) -> bool:
    """A folder only this user can enter, for the group's sockets and rendezvous: created with
    mode 0700 when missing (then True: the group owns it), else checked. A folder others may
    enter would let them connect to the sockets and submit plans or read tokens."""
    try:
        os.makedirs(path, mode=0o700)
        return True
    except FileExistsError:
        pass
    info = os.stat(path)
    if not os.path.isdir(path):
        raise ValueError(f"--ipc-dir {path} is not a directory")
    if info.st_uid != os.getuid():
        raise ValueError(f"--ipc-dir {path} belongs to uid {info.st_uid}, not to this user "
                         f"({os.getuid()}): its owner could replace the engine's sockets")
    if info.st_mode & 0o077:
        raise ValueError(f"--ipc-dir {path} is open to other users (mode "
                         f"{info.st_mode & 0o777:04o}): they could connect to the engine's "
                         f"sockets; use a folder with mode 0700 (chmod 700 {path})")
    return False


@dataclass(slots=True)
class ModelInfo:
    """What the launcher learns about the model once (workers/loader.py) for every role: the
    scheduler, detokenizer and ingress read it here and never open the model files for it."""

    model_dir: str = ""           # a loadable Hugging Face directory; "" until resolved
    tokenizer_dir: str = ""
    architecture: str = ""
    vocab_size: int = 0
    max_position_embeddings: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    generation_defaults: dict = field(default_factory=dict)  # in force (--generation-config)
    chat_template: str | None = None  # --chat-template's text; None: the tokenizer's own
    # Positions every layer attends back (Mistral's sliding window); 0: none, or only some
    # layers windowed (Gemma 3). The scheduler then frees blocks that slid out of it.
    sliding_window: int = 0
    hidden_size: int = 0  # an embedding's full length (`dimensions` may ask for fewer)
    is_encoder: bool = False  # bidirectional (BERT): embeddings only
    # pipeline/pooling.py's PoolerConfig in force, as a dict; empty: the default (LAST)
    pooling: dict = field(default_factory=dict)

    @property
    def resolved(self) -> bool:
        return bool(self.model_dir)

    def pooler(self) -> PoolerConfig:
        return PoolerConfig(**self.pooling) if self.pooling else PoolerConfig()


@dataclass(slots=True)
class EngineConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    cache: CacheArgs = field(default_factory=CacheArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    cluster: ClusterArgs = field(default_factory=ClusterArgs)
    scheduling: SchedulingArgs = field(default_factory=SchedulingArgs)
    server: ServerArgs = field(default_factory=ServerArgs)
    supervisor: SupervisorArgs = field(default_factory=SupervisorArgs)
    ipc: IpcArgs = field(default_factory=IpcArgs)
    lora: LoRAArgs = field(default_factory=LoRAArgs)
    env: Environment = field(default_factory=envs.current)
    model_info: ModelInfo = field(default_factory=ModelInfo)

    @property
    def max_model_len(self) -> int:
        """--max-model-len, else the model's own limit (needs model_info resolved)."""
        if self.model.max_model_len:
            return self.model.max_model_len
        if not self.model_info.resolved:
            raise ValueError("the model is not resolved yet: no max_model_len to derive")
        return self.model_info.max_position_embeddings

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name or os.path.basename(self.model.model.rstrip("/"))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "EngineConfig":
        raw = json.loads(text)
        return cls(**{f.name: _SECTIONS[f.name](**raw[f.name]) for f in fields(cls)})

    def to_file(self, path: str) -> None:
        """Write a new file, mode 0600, that only this user can read (it holds the API key)."""
        write_private(path, self.to_json())

    @classmethod
    def from_file(cls, path: str) -> "EngineConfig":
        """PrivateFileError unless the file is ours and private."""
        return cls.from_json(read_private(path, "--config-file"))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Flat vLLM-style keyword arguments (max_num_seqs=..., block_size=...) -> config."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in FIELD_OWNER.values()}
        for key, value in kwargs.items():
            owner = FIELD_OWNER.get(key)
            if owner is None:
                raise TypeError(f"unknown engine argument {key!r}")
            sections[owner][key] = value
        if "kv_cache_memory" in sections["cache"] and sections["cache"]["kv_cache_memory"] is not None:
            sections["cache"]["kv_cache_memory"] = parse_bytes(sections["cache"]["kv_cache_memory"])
        return cls(**{name: _SECTIONS[name](**vals) for name, vals in sections.items()})


_SECTIONS = {"model": ModelArgs, "cache": CacheArgs, "parallel": ParallelArgs,
             "cluster": ClusterArgs,
             "scheduling": SchedulingArgs, "server": ServerArgs, "supervisor": SupervisorArgs,
             "ipc": IpcArgs, "lora": LoRAArgs, "env": Environment, "model_info": ModelInfo}
# Flat keyword arguments name the user's settings; env and model_info are filled at start.
FIELD_OWNER = {f.name: sec for sec, cls in _SECTIONS.items() if sec not in ("env", "model_info")
                for f in fields(cls)}
