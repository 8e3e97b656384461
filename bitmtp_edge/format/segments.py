"""KV capacity segments Σ: which history capacities an artifact precomputes.

Capacities grow geometrically (256, 512, 1024, …) up to the context limit, so that
O(log ℓmax) segments cover ℓmax. Segment σ spans ``capacity`` history slots plus
``workspace`` slots (the widest step, M_max) where a step writes its draft block. At run
time the segments are nested views of one buffer (``bitmtp_edge/runtime/kv.py``): moving to
the next segment copies nothing, and a short history keeps attention short.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .config import ConfigError, ModelConfig

MIB = 1 << 20
SMALLEST_CAPACITY = 256

# KV memory budgets (MiB) per target board (``bitmtp-export --board``), chosen to leave room
# for weights, activations and the OS: an Orin Nano 8GB shares its 8 GB between CPU and GPU,
# so the KV gets a small slice; the 4 GB Nano (about 3.3 GiB visible) gets half of that.
DEVICE_KV_BUDGET_MIB = {
    "orin-nano-4gb": 256,
    "orin-nano-8gb": 512,
    "orin-nx-8gb": 512,
    "orin-nx-16gb": 2048,
    "agx-orin": 8192,
    "rtx3090": 4096,
    "h20": 16384,
    "h200": 32768,
}

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class CapacitySegment:
    capacity: int  # history slots
    workspace: int  # step slots after the history
    bytes: int  # K and V, all layers

    @property
    def slots(self) -> int:
        return self.capacity + self.workspace

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KVPlan:
    dtype: str
    bytes_per_slot: int
    workspace: int
    max_context: int
    budget_bytes: int | None
    segments: tuple[CapacitySegment, ...]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["segments"] = [s.to_dict() for s in self.segments]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KVPlan":
        try:
            segs = tuple(CapacitySegment(**s) for s in d["segments"])
            plan = cls(dtype=d["dtype"], bytes_per_slot=int(d["bytes_per_slot"]), workspace=int(d["workspace"]),
                       max_context=int(d["max_context"]), budget_bytes=d.get("budget_bytes"), segments=segs)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"kv section of the manifest is malformed: {e}") from None
        if not plan.segments or any(a.capacity >= b.capacity for a, b in zip(plan.segments, plan.segments[1:])):
            raise ConfigError("kv segments must be a non-empty list of increasing capacities")
        return plan

    def segment_for(self, needed_history: int) -> int:
        """Index of the smallest segment whose history capacity holds ``needed_history`` slots."""
        for i, seg in enumerate(self.segments):
            if seg.capacity >= needed_history:
                return i
        raise ValueError(
            f"{needed_history} tokens of context exceed the largest KV segment "
            f"({self.segments[-1].capacity}); re-export with a larger --max-context"
        )


def kv_bytes_per_slot(cfg: ModelConfig, dtype: str) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


def min_context(block_size: int | None) -> int:
    """The smallest max context in which every decoding policy of a model can run: a
    one-token prompt plus the slots ``check_prompt_fits`` (runtime/decoding.py) keeps free
    for decoding, 2*D for draft blocks and 1 for AR (``block_size`` None). Below it an
    artifact would load but refuse every MTP policy: the exporter and manifest validation
    refuse it instead."""
    return 1 + (2 * block_size if block_size is not None else 1)


def plan_segments(cfg: ModelConfig, max_context: int, workspace: int, dtype: str = "float16",
                  budget_bytes: int | None = None) -> KVPlan:
    """Geometric capacities up to ``max_context``, trimmed so the largest fits the budget.

    The budget must hold the two largest segments together. That rule dates from when
    growing copied the history into a new buffer; the runtime now views every segment in
    one buffer of the largest size, so it is a margin, kept so that a given budget still
    yields the same plan (changing it changes every exported artifact).
    """
    if max_context < 2:
        raise ConfigError(f"--max-context must be at least 2, got {max_context}")
    per_slot = kv_bytes_per_slot(cfg, dtype)
    caps = []
    c = min(SMALLEST_CAPACITY, max_context)
    while c < max_context:
        caps.append(c)
        c *= 2
    caps.append(max_context)
    segs = [CapacitySegment(cap, workspace, (cap + workspace) * per_slot) for cap in caps]
    if budget_bytes is not None:
        def fits(i):
            return segs[i].bytes + (segs[i - 1].bytes if i else 0) <= budget_bytes
        kept = [s for i, s in enumerate(segs) if fits(i)]
        if not kept:
            raise ConfigError(
                f"a KV budget of {budget_bytes / MIB:.1f} MiB cannot hold even the smallest segment "
                f"({segs[0].bytes / MIB:.1f} MiB at {dtype}); "
                # --device was renamed --board (bitmtp-export refuses --device): name the option that exists.
                "raise --kv-budget-mib or pick a --board with more memory"
            )
        segs = kept
    return KVPlan(dtype=dtype, bytes_per_slot=per_slot, workspace=workspace,
                  max_context=segs[-1].capacity, budget_bytes=budget_bytes, segments=tuple(segs))
