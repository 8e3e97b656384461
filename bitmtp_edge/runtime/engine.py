"""The on-device Python API: load an artifact, generate, stream, score.

    from bitmtp_edge import Engine
    eng = Engine.load("OUT/", backend="reference", device="cpu")
    res = eng.generate("def add(a, b):", max_new_tokens=128, policy="hybrid")
    res.text, res.token_ids, res.stats
"""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from ..backends.fast_model import HEADS, FastModel
from ..backends.fp8_head import fp8_supported
from ..backends.graph import GraphBackend, RuntimeOptions
from ..backends.ops import kernel_ops, kernel_ops_available
from ..backends.reference import ReferenceBackend
from ..format.manifest import WEIGHTS, ArtifactError, Manifest, load_tensors, read_manifest, verify_files
from ..format.validate import artifact_file, check_finite, check_kv_fits, check_weights_header
from .calibration import ConfidenceCalibration
from .candidates import CandidateChooser
from .decoding import DecodeOptions, DecodeStats, DecodingError, check_prompt_fits, decode
from .chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from .detokenize import TextStream
from .load import build_model
from .sampling import SamplingParams

BACKENDS = ("auto", "reference", "ampere", "server")


def embedded_artifact_path() -> Path:
    """The artifact shipped inside the package (the default model)."""
    return Path(__file__).resolve().parent.parent / "embedded" / "model"


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: DecodeStats


def startup_split(backend, total_s: float, load_parts: dict | None = None) -> dict:
    """Where a load's seconds went: reading and building the model (``load_s``), the kernel
    precompile pass (``precompile_s``), capturing the graphs (``capture_s``); ``load_parts``
    splits ``load_s`` (``Engine.load``); ``step_costs_s``: timing the fused states at load."""
    precompile_s, capture_s = getattr(backend, "precompile_s", 0.0), getattr(backend, "capture_s", 0.0)
    costs_s = getattr(backend, "step_costs_s", 0.0)
    report = getattr(backend, "precompile_report", None)
    return {"total_s": total_s, "load_s": max(total_s - precompile_s - capture_s - costs_s, 0.0),
            "precompile_s": precompile_s, "capture_s": capture_s,
            "step_costs_s": costs_s,  # timing the fused states for the choice of c (``runtime/candidates.py``)
            "kernels_precompiled": report.compiled if report is not None else 0,
            # waiting for compiles, inside precompile_s, or inside capture_s when capture overlaps them
            "compile_wait_s": getattr(backend, "compile_wait_s", 0.0), "load_parts": dict(load_parts or {})}


def _chooser_for(backend, manifest: Manifest) -> CandidateChooser | None:
    costs = getattr(backend, "step_costs", None)
    if not costs or manifest.mtp is None:
        return None
    return CandidateChooser(costs["fused"], costs["draft"])


def _timed(fn, *args) -> float:
    """``fn(*args)`` -> the seconds it took."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):  # "tpu", "", "CPU": torch's error lists 20 device types
        raise ValueError(f"device={device!r} is not a device; use 'auto', 'cpu' or 'cuda[:N]'") from None
    # Only devices that hold data and that this torch build runs: anything else would fail
    # later, as a model that "cannot be built" (mps) or a traceback from torch (xpu, meta).
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device={device!r}: BitMTP runs on 'cpu' or 'cuda[:N]' (or 'mps'); "
                         "use one of those or 'auto'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s) "
                         f"(cuda:0..cuda:{torch.cuda.device_count() - 1}); use one of those or 'auto'")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r} but this torch build cannot use MPS here; use device='cpu' or 'auto'")
    return dev


class Engine:
    def __init__(self, path: Path, manifest: Manifest, backend, tokenizer, device: torch.device):
        self.path, self.manifest, self.backend, self.tokenizer, self.device = path, manifest, backend, tokenizer, device
        self._chat_template: ChatTemplate | None | bool = False  # False: not read yet
        self.startup: dict = {}  # ``startup_split`` of ``Engine.load``
        self._kv_owner: object | None = None  # the generation whose tokens the backend's KV holds
        # Policy fused without a fixed c: picks c per pass from the step costs the backend timed
        # at load and what each c committed so far (``runtime/candidates.py``); None where nothing
        # was timed (the reference backend, eager or lazily captured graphs): c = DEFAULT_CANDIDATES.
        self.candidate_chooser = _chooser_for(backend, manifest)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, backend: str = "auto", device: str = "auto",
             dtype: torch.dtype | None = None, runtime: str | RuntimeOptions = "full",
             progress=None, head: str = "16bit", draft_head: str = "auto") -> "Engine":
        """Load an artifact folder (default: the embedded model), verifying every checksum.

        ``backend``: ``reference`` (PyTorch oracle, any device), ``ampere`` (Triton kernels,
        no FP8, CUDA graphs; sm_80+), ``server`` (ampere + FP8 draft head; sm_89+), or
        ``auto`` (the fastest the device supports). ``runtime``: the ablation configuration
        of the fast backends (``generic``, ``m1``, ``m1+m2``, ``full``) or ``RuntimeOptions``.
        ``progress``: ``progress(done, total)`` while CUDA graphs are captured at load (the
        CLI passes a progress bar); the capture time is ``engine.backend.capture_s``.
        ``head``: the verify role's head, ``16bit`` (the checkpoint's: exact) or ``int8`` (the
        artifact's int8 draft head in every role: half the head's bytes per step and the 16-bit
        head not loaded on the device; the greedy text differs from the 16-bit head's at
        near-ties, about once per hundred tokens on the embedded models; docs/runtime.md), or
        ``certified`` (the 16-bit head's tokens exactly, which the greedy AR, verify and fused
        steps read from the int8 head wherever a bound proves them, the fused step's next drafts
        then the int8 head's: ``kernels_ampere/certified_head.py``).
        ``draft_head``: the draft role's head, ``int8`` (the artifact's), ``int4`` (quantised per
        row from the 16-bit head at load: half the int8 head's bytes per draft step, drafts that
        differ from the int8 head's at near-ties; docs/runtime.md, "The int4 draft head"), or
        ``auto`` (``server``: FP8; else int8). Drafts never change what speculative or fused
        decoding commits, only how much of it is accepted; hybrid commits confident drafts.
        """
        t0 = time.perf_counter()
        folder = Path(path) if path is not None else embedded_artifact_path()
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if head not in HEADS:
            raise ValueError(f"unknown head {head!r}; choose one of {', '.join(HEADS)}")
        if draft_head not in DRAFT_HEAD_CHOICES:
            raise ValueError(f"unknown draft head {draft_head!r}; choose one of {', '.join(DRAFT_HEAD_CHOICES)}")
        dev = _resolve_device(device)
        chosen = choose_backend(backend, dev)
        opts = runtime if isinstance(runtime, RuntimeOptions) else RuntimeOptions.preset(runtime)
        # Untrusted input: every size is checked (manifest, then against the safetensors
        # header) before anything is allocated from it; see format/validate.py.
        manifest = read_manifest(folder)
        # The checksums (sha256 of every file: about a second per GB) run in a thread beside
        # reading the weights and building the model (hashing releases the GIL). The load
        # waits for them before it builds a backend, and a mismatch is the error a corrupt or
        # modified file gets, as when they ran first.
        with ThreadPoolExecutor(1, thread_name_prefix="bitmtp-checksums") as pool:
            checksums = pool.submit(_timed, verify_files, folder, manifest)
            try:
                t1 = time.perf_counter()
                check_weights_header(manifest, artifact_file(folder, WEIGHTS))
                if chosen == "reference" and dtype is None:
                    dtype = torch.float64 if dev.type == "cpu" else torch.float32
                kv_dtype = dtype if chosen == "reference" else opts.kv_dtype
                check_kv_fits(manifest, torch.empty(0, dtype=kv_dtype).element_size(), dev)
                tensors = load_tensors(folder)
                check_finite(tensors)
                tokenizer = _load_tokenizer(folder)
                t2 = time.perf_counter()
                if chosen == "reference":
                    threads = choose_cpu_threads() if dev.type == "cpu" else None
                    if threads is not None:
                        torch.set_num_threads(threads)
                    try:
                        model = build_model(manifest, tensors, dtype, dev)
                    except (ValueError, RuntimeError) as e:  # e.g. a code the packing never writes
                        raise ArtifactError(f"{folder / WEIGHTS}: cannot build the model ({e}); "
                                            "re-export the artifact") from None
                    if draft_head == "int4":
                        model.attach_int4_draft_head()
                    if head == "int8":
                        model.use_int8_verify_head()
                else:
                    fast = FastModel(manifest, tensors, kernel_ops(specialize_widths=opts.specialize), dev,
                                     draft_head=_draft_head_for(draft_head, chosen), verify_head=head)
            except BaseException:
                checksums.result()  # raises the mismatch first
                raise
            t3 = time.perf_counter()
            parts = {"read_s": t2 - t1, "build_s": t3 - t2, "checksums_s": checksums.result(),
                     "checksums_wait_s": time.perf_counter() - t3}  # the checksums beside read + build
        del tensors  # the backend holds what it needs (on the GPU: a copy)
        mask_id = manifest.mtp.mask_token_id if manifest.mtp else None
        calibration = ConfidenceCalibration.for_model(manifest.mtp, dev)
        if chosen == "reference":
            runtime_backend = ReferenceBackend(model, manifest.kv, mask_id, dtype, dev, calibration=calibration)
        else:
            runtime_backend = GraphBackend(fast, manifest.kv, mask_id, manifest.mtp.block_size if manifest.mtp else None,
                                           opts, name=chosen, progress=progress, calibration=calibration)
        engine = cls(folder, manifest, runtime_backend, tokenizer, dev)
        engine.startup = startup_split(runtime_backend, time.perf_counter() - t0, parts)
        return engine

    # -- properties ------------------------------------------------------------------------
    @property
    def head(self) -> str:
        """The verify role's head, as the backend holds it: ``16bit``, ``int8`` or ``certified``
        (``Engine.load(head=...)``; the reference backend, the oracle, reads its 16-bit head for
        ``certified``, whose tokens are the 16-bit head's by construction)."""
        fast = getattr(self.backend, "fast", None)
        if fast is not None:
            return fast.verify_head_kind
        return "int8" if getattr(getattr(self.backend, "model", None), "int8_verify", False) else "16bit"

    @property
    def draft_head(self) -> str:
        """The draft role's head as the backend holds it: ``int8``, ``int4`` or ``fp8``."""
        fast = getattr(self.backend, "fast", None)
        if fast is not None:
            return fast.draft_head_kind
        return getattr(getattr(self.backend, "model", None), "draft_head_kind", "int8")

    @property
    def block_size(self) -> int | None:
        return self.manifest.mtp.block_size if self.manifest.mtp else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.manifest.model.eos_token_ids)

    # -- generation ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes text (str), got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates, e.g. from non-UTF-8 argv bytes
            raise DecodingError(f"the prompt is not valid Unicode text (character {e.start}: {text[e.start]!r} "
                                "is a lone surrogate, often from non-UTF-8 input); pass UTF-8 text") from None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode_ids(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The artifact's chat template (None: a completion model)."""
        if self._chat_template is False:
            self._chat_template = load_chat_template(self.path)
        return self._chat_template

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Messages [{"role", "content"}] -> prompt text, through the model's chat template."""
        template = self.chat_template
        if template is None:
            raise ChatTemplateError(f"{self.path} has no chat template (no chat_template.jinja, no chat_template in "
                                    "tokenizer_config.json): it is a completion model; send a plain prompt instead")
        return template.render(list(messages), add_generation_prompt=add_generation_prompt)

    def check_request(self, prompt_ids: Sequence[int], max_new_tokens: int = 128, policy: str = "hybrid",
                      tau: float | None = None, min_prefix: int | None = None,
                      sampling: SamplingParams | None = None) -> DecodeOptions:
        """Everything a generation would refuse, checked up front (a server answers 400
        before queueing): policy, τ, m, max_new_tokens, token ids, prompt length."""
        opts = self.decode_options(policy, max_new_tokens, None, tau, min_prefix, sampling=sampling)
        ids = self._prompt_ids(list(prompt_ids))
        check_prompt_fits(len(ids), opts, self.backend.max_context)
        return opts

    def decode_options(self, policy, max_new_tokens, block_size=None, tau=None, min_prefix=None, should_stop=None,
                 candidates=None, sampling=None) -> DecodeOptions:
        """The ``DecodeOptions`` a generation with these arguments would run with (the model's
        τ, m and D where not given), or the ``DecodingError`` it would raise: for callers that
        check a setting before any work (a chat's /policy, a benchmark's routes)."""
        mtp = self.manifest.mtp
        if policy != "ar" and mtp is None:
            raise DecodingError(f"policy {policy!r} needs an MTP-trained model; {self.path} is AR-only, use policy='ar'")
        if block_size is not None and mtp is not None and block_size != mtp.block_size:
            raise DecodingError(f"block_size={block_size}: this model was trained for D={mtp.block_size}; "
                                f"use block_size={mtp.block_size} or None")
        if block_size is not None and mtp is None and policy == "ar":
            raise DecodingError(f"block_size={block_size}: {self.path} is AR-only and has no MTP block")
        return DecodeOptions.for_model(mtp, policy, max_new_tokens, tau=tau, min_prefix=min_prefix,
                                       stop_token_ids=self.eos_token_ids, should_stop=should_stop,
                                       candidates=candidates, sampling=_near_zero_is_greedy(sampling),
                                       chooser=self.candidate_chooser)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError("the prompt is bytes; pass text (decode it: prompt.decode('utf-8')) or a list of token ids")
        if isinstance(prompt, str):
            if not prompt:
                raise DecodingError("the prompt is empty; give some text or token ids")
            ids = self.encode(prompt)
            if not ids:
                raise DecodingError("the prompt encodes to no tokens; give some text the tokenizer knows")
        else:
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.view(-1).tolist()
            try:
                ids = list(prompt)
            except TypeError:
                raise TypeError(f"the prompt must be text or a sequence of token ids, got {type(prompt).__name__}") from None
            if not all(type(t) is int for t in ids):  # plain ints (the common case) need no more checks
                bad_type = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
                if bad_type:
                    raise TypeError(f"token ids must be integers, got {bad_type[0]!r} ({type(bad_type[0]).__name__})")
                ids = [int(t) for t in ids]
            if not ids:
                raise DecodingError("the prompt is empty; give some text or token ids")
        # Also for text: a tokenizer larger than the model's vocabulary would index past the embedding.
        vocab = self.manifest.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise DecodingError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def stream_ids(self, prompt, *, max_new_tokens=128, policy="hybrid", block_size=None, tau=None,
                   min_prefix=None, stats: DecodeStats | None = None,
                   should_stop: Callable[[], bool] | None = None, candidates: int | None = None,
                   sampling: SamplingParams | None = None, **sampling_kw) -> Iterator[list[int]]:
        """Yield each iteration's committed token ids. Arguments are checked when this is
        called, before anything runs. ``should_stop()`` is polled once per iteration; True
        ends the generation (``finish_reason`` "cancelled"). ``candidates``: draft blocks per
        fused pass (policy ``fused``; default: chosen per pass from the step costs timed at load,
        ``engine.candidate_chooser``, else ``format.config.DEFAULT_CANDIDATES``).

        Sampling: ``sampling=SamplingParams(...)`` or its fields as keywords
        (``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``frequency_penalty``,
        ``presence_penalty``, ``seed``); temperature 0 (the default) is greedy."""
        opts = self.decode_options(policy, max_new_tokens, block_size, tau, min_prefix, should_stop, candidates,
                             sampling=_sampling(sampling, sampling_kw))
        ids = self._prompt_ids(prompt)
        stats = stats if stats is not None else DecodeStats()
        return self._owning_kv(self.count_head_calls(decode(self.backend, ids, opts, stats), stats))

    def count_head_calls(self, chunks: Iterator[list[int]], stats: DecodeStats) -> Iterator[list[int]]:
        """``chunks`` (a ``decode`` of this engine's backend), and with the certified head the
        greedy head calls they made (and those the int8 rows answered alone) in ``stats`` when
        they end: the device counters read before and after (two syncs, outside the steps)."""
        fast = getattr(self.backend, "fast", None)
        if fast is None or fast.certified_head is None:
            yield from chunks
            return
        before = fast.certified_counts()
        try:
            yield from chunks
        finally:
            calls, int8 = (a - b for a, b in zip(fast.certified_counts(), before))
            stats.certified_head_calls, stats.certified_head_int8 = calls, int8

    def _owning_kv(self, chunks: Iterator[list[int]]) -> Iterator[list[int]]:
        """``chunks`` as long as no other generation (or ``logits``) has used the backend since
        this one started: the engine holds one KV cache, and a second generation resets it.
        Without this an abandoned or interleaved stream resumed on the other's cache, and its
        next tokens were silently conditioned on the wrong text."""
        token = object()
        self._kv_owner = token  # at the first next(): decode() resets the backend right after
        try:
            for chunk in chunks:
                yield chunk
                if self._kv_owner is not token:  # checked before decode() steps on the other's cache
                    raise DecodingError("this stream cannot continue: another generation (or logits()) used the "
                                        "engine after it started, and an Engine holds one KV cache; finish or "
                                        "close() a stream before the next one, or load a second Engine")
        finally:
            chunks.close()  # decode() records its timings

    def stream(self, prompt, *, max_new_tokens=128, policy="hybrid", block_size=None, tau=None,
               min_prefix=None, stop: Sequence[str] | None = None,
               stats: DecodeStats | None = None, **kw) -> Iterator[str]:
        """Yield text pieces as tokens are committed: decoded incrementally (O(1) per token,
        never a partial character), stop strings honoured (held back until they cannot
        start one). Joined, the pieces equal ``generate(...).text``. ``kw``: ``should_stop``
        and sampling (see ``stream_ids``)."""
        stop = _check_stop(stop)
        stats = stats if stats is not None else DecodeStats()
        chunks = self.stream_ids(prompt, max_new_tokens=max_new_tokens, policy=policy, block_size=block_size,
                                 tau=tau, min_prefix=min_prefix, stats=stats, **kw)
        return self._stream_text(chunks, stop, stats)

    def _stream_text(self, chunks, stop, stats) -> Iterator[str]:
        text = TextStream(self.tokenizer, stop)
        ids: list[int] = []
        for chunk in chunks:
            piece = text.push(chunk)
            if piece:
                yield piece
            if text.stopped:
                chunks.close()  # ends decode() here: its finally records the timings
                self._end_at_stop(ids, chunk, stop, stats)
                return
            ids.extend(chunk)
        tail = text.finish()
        if tail:
            yield tail

    def _end_at_stop(self, before: list[int], chunk: list[int], stop: list[str], stats: DecodeStats) -> int:
        """A stop string showed in ``chunk`` (after the ids ``before``): how many of its tokens
        AR decoding would have produced, up to the one that completes the stop. A multi-token
        step commits a whole block, and the tokens past the stop are not the request's: the
        counts (``stats.new_tokens``, the server's usage) are AR's for the same text."""
        text = TextStream(self.tokenizer, stop)
        text.push(before)
        kept = 0
        while kept < len(chunk) and not text.stopped:
            text.push(chunk[kept:kept + 1])
            kept += 1
        stats.new_tokens -= len(chunk) - kept
        stats.finish_reason = "stop"
        return kept

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, policy: str = "hybrid",
                 block_size: int | None = None, tau: float | None = None, min_prefix: int | None = None,
                 stop: Sequence[str] | None = None, **kw) -> GenerationResult:
        """Generate after ``prompt``; ``kw``: ``should_stop`` and sampling (see ``stream_ids``)."""
        stop = _check_stop(stop)
        stats = DecodeStats()
        ids: list[int] = []
        text = TextStream(self.tokenizer, stop)
        chunks = self.stream_ids(prompt, max_new_tokens=max_new_tokens, policy=policy, block_size=block_size,
                                 tau=tau, min_prefix=min_prefix, stats=stats, **kw)
        for chunk in chunks:
            if stop:
                text.push(chunk)
                if text.stopped:
                    chunks.close()
                    ids.extend(chunk[:self._end_at_stop(ids, chunk, stop, stats)])
                    return GenerationResult(text=text.text, token_ids=ids, stats=stats)
            ids.extend(chunk)
        return GenerationResult(text=self.decode_ids(ids) if not stop else text.text + text.finish(),
                                token_ids=ids, stats=stats)

    def chat(self, messages: Sequence[dict], max_new_tokens: int = 128, policy: str = "hybrid",
             add_generation_prompt: bool = True, **kw) -> GenerationResult:
        """Answer a conversation [{"role": "system"|"user"|"assistant", "content": ...}] with the
        model's chat template (a ChatTemplateError for a model without one); ``kw`` as generate."""
        return self.generate(self.render_chat(messages, add_generation_prompt), max_new_tokens=max_new_tokens,
                             policy=policy, **kw)

    @torch.no_grad()
    def logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, V] float32 verify-role logits (for scoring)."""
        ids = torch.as_tensor(self._prompt_ids(token_ids), dtype=torch.long).view(-1)
        if ids.numel() > self.backend.max_context:  # attention memory grows with T²
            raise DecodingError(f"logits() got {ids.numel()} token ids but the largest KV segment holds "
                                f"{self.backend.max_context}; score at most that many (a sliding window)")
        self._kv_owner = None  # the graph backend scores in the KV buffer: a live stream cannot go on
        return self.backend.logits(ids).cpu()


def _check_stop(stop) -> list[str] | None:
    """``stop`` as a list: a generator or other one-pass iterable would be used up by this
    check, and the stop strings then silently ignored."""
    if stop is None:
        return None
    if isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable):
        raise TypeError(f"stop must be a list of strings, got {stop!r}")
    stop = list(stop)
    if not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a list of strings, got {stop!r}")
    return stop


def choose_cpu_threads() -> int | None:
    """Torch threads for the reference backend on the CPU (set by ``Engine.load``), or None
    to leave torch's choice. See ``cpu_threads_rule`` for the rule and why."""
    return cpu_threads_rule()[0]


def cpu_threads_rule() -> tuple[int | None, str]:
    """(threads, why). ``BITMTP_CPU_THREADS`` wins; ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``
    mean the user chose (torch follows them); otherwise one thread per usable core up to
    ``CPU_THREADS_MAX``, and one when the host is already busy (1-minute load ≥ cores): a
    decode step is a chain of small ops, and a thread waiting for a core stalls every op's
    barrier (measured on a loaded 2-core host: tools/results/cpu_threads.md)."""
    if os.environ.get("BITMTP_CPU_THREADS"):
        try:
            n = max(1, int(os.environ["BITMTP_CPU_THREADS"]))
        except ValueError:
            raise ValueError(f"BITMTP_CPU_THREADS={os.environ['BITMTP_CPU_THREADS']!r}: not a number of threads; "
                             "set it to a whole number (e.g. 2) or unset it") from None
        return n, "BITMTP_CPU_THREADS"
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(var):
            return None, f"{var}={os.environ[var]} (torch's choice)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    if cores > 1 and load >= cores:
        return 1, f"host busy (load {load:.1f} on {cores} cores)"
    n = max(1, min(cores, CPU_THREADS_MAX))
    return n, f"{cores} core(s) free, at most {CPU_THREADS_MAX}"


CPU_THREADS_MAX = 4  # small decode steps stop scaling beyond a few threads


def _sampling(sampling: SamplingParams | None, fields: dict) -> SamplingParams | None:
    if not fields:
        return sampling
    if sampling is not None:
        raise TypeError(f"give sampling=SamplingParams(...) or its fields ({', '.join(fields)}), not both")
    known = set(SamplingParams.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"unknown argument(s) {', '.join(unknown)}; sampling fields are {', '.join(sorted(known))}")
    return SamplingParams(**{name: _sampling_field(name, value) for name, value in fields.items()})


def _sampling_field(name: str, value):
    """One sampling keyword, type-checked with its name (SamplingParams' range checks would
    fail on "0.5" with an error naming no argument, and take seed=True to the first step)."""
    if name == "seed" and value is None:
        return value
    whole = name in ("top_k", "seed")
    kind = numbers.Integral if whole else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "an integer" if whole else "a number"
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    return int(value) if whole else float(value)  # numpy scalars too


# Below this a temperature is greedy decoding: softmax(logits / T) is the argmax's one-hot for
# any logit gap above 1e-3 (e^-100), and dividing by a tiny T overflows float32 (T ≲ 1e-37:
# the sampler then drew the last token id every step, or a step was flagged NaN). vLLM
# uses the same cut-off.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _near_zero_is_greedy(sampling: SamplingParams | None) -> SamplingParams | None:
    if sampling is None or not 0.0 < sampling.temperature < GREEDY_BELOW_TEMPERATURE:
        return sampling
    return replace(sampling, temperature=0.0)  # penalties still apply, as at temperature 0


DRAFT_HEAD_CHOICES = ("auto", "int8", "int4")


def _draft_head_for(draft_head: str, backend: str) -> str:
    """``Engine.load``'s draft head for a fast backend: ``auto`` is the server's FP8 head, else int8."""
    if draft_head == "auto":
        return "fp8" if backend == "server" else "int8"
    return draft_head


def choose_backend(backend: str, device: torch.device) -> str:
    """Resolve ``auto`` by device capability; check that a named backend can run here."""
    if backend == "reference":
        return backend
    fast_ok = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0) \
        and kernel_ops_available(device)
    if backend == "auto":
        if not fast_ok:
            return "reference"
        return "server" if fp8_supported(device) else "ampere"
    if not fast_ok:
        raise ValueError(f"backend {backend!r} needs a CUDA GPU of compute capability 8.0+ with Triton; "
                         f"this is {device}. Use backend='reference' (or 'auto')")
    if backend == "server" and not fp8_supported(device):
        raise ValueError("backend 'server' needs FP8 tensor cores (sm_89 / sm_90+); use backend='ampere'")
    return backend


def _load_tokenizer(folder: Path):
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; the artifact needs its tokenizer, re-export it")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise ArtifactError(f"{path}: cannot be read as a tokenizer ({e}); re-export the artifact") from None
