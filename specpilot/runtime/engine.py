"""The engine for compiled builds: loads ``build/model.so`` with the TVM runtime alone (no
compiler) and drives its step functions with the same interface as the reference model, so
the decoding loops in `runtime.decoding` run unchanged on either.

Device state: one KV-cache pool per model with deployment.max_batch sequence rows (written in
place by the step functions); each sequence holds a row while it lives.  For Gated DeltaNet
layers each sequence also has its conv / recurrent states (values: each call returns new ones).
A verify pass returns the conv states after every token and the recurrence's per-token
records; ``truncate`` / ``accept_path`` keep the accepted prefix or path, and the build's
``commit`` function rebuilds the recurrent state along the kept token's root path when the
state is next read -- for a batch's sequences in one call (`CompiledModel.settle`).
``forward_batch`` runs several sequences, each at its own length, in one call of the step
functions (padded to the longest; padding writes nothing).  A batch's states are rows of the
call's (B, ...) outputs, not copies of them, so the next call of the same batch in the same
order passes those outputs on as they are (at 27B-class shapes a request's recurrent state is
151 MB: stacking and splitting a batch of 16 copied 4.8 GB a step).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specpilot.core import cpu_level
from specpilot.core import feature_drafter as fd
from specpilot.core.config import ModelConfig, cache_shapes
from specpilot.core.errors import SpecPilotError
from specpilot.core.manifest import read_manifest
from specpilot.core.weights import file_digest
from specpilot.runtime import cuda_errors, heap
from specpilot.runtime.features import FeaturePool
from specpilot.runtime.threads import claim_cores_for_tvm
from specpilot.runtime.uploads import upload

def import_tvm_runtime(gpu: bool):
    """tvm without needing its compiler; on GPUs also load the CUDA runtime library."""
    import tvm

    if gpu and not tvm.cuda(0).exist:
        try:
            import tvm_ffi
            tvm_ffi.libinfo.load_lib_ctypes("tvm", "tvm_runtime_cuda", "RTLD_LOCAL",
                                            extra_lib_paths=tvm.libinfo.package_lib_paths())
        except Exception as e:  # the loader raises whatever dlopen reports
            raise SpecPilotError(f"cannot load TVM's CUDA runtime ({e})") from None
        if not tvm.cuda(0).exist:
            raise SpecPilotError("this build is for CUDA but no CUDA device is visible")
    return tvm


def pack_inputs(arrays) -> tuple[np.ndarray, list]:
    """Arrays as one byte buffer, each at a 64-byte aligned offset (TVM's alignment for tensors
    it takes by DLPack), and for each a function giving its view (dtype, shape) of a torch copy of
    that buffer."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += (a.nbytes + 63) // 64 * 64
    host = np.zeros(max(total, 64), np.uint8)
    views = []
    for a, o in zip(arrays, offsets):
        host[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
        dtype = torch.from_numpy(a[:0].reshape(-1)).dtype
        views.append(lambda buf, o=o, n=a.nbytes, dtype=dtype, shape=a.shape: buf[o:o + n].view(dtype).view(shape))
    return host, views


# TVM's pooled allocator keeps every freed block for a later request of its exact size, so steps of many
# shapes (a continuous batch: each batch size times tokens a pass) would hoard the card; below this share
# of the card free, the unused blocks go back to the driver
HEADROOM = 0.12
# and so on a GPU a packed verification's real rows are rounded up to a multiple of this: its logits (N, vocab),
# about 1 MB a row on a 248k vocabulary, then take a few sizes instead of one a row count (the rows added cost
# little beside the hundred-odd a batch of 16 verifies; a GEMM may pick another tiling for the row count, so a
# real row's logits round as its kernel does -- forcing holds them to stock's, as between packed and padded)
PACKED_ROWS_STEP = 16


def release_pooled_memory() -> None:
    """TVM's unused pooled blocks back to the driver (freeing synchronises)."""
    import tvm
    tvm.get_global_func("vm.builtin.memory_manager.clear")()


def release_device_memory() -> None:
    """TVM's unused pooled blocks and torch's cached ones back to the driver (freeing synchronises)."""
    release_pooled_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def host_array(x):
    """A step's host-side input: torch tensors (tokens a GPU's logits chose, say) and placed tokens
    (read to the host) as numpy arrays."""
    if isinstance(x, PlacedTokens):
        x = x.rows[x.row, :x.length]
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x


@dataclass(frozen=True)
class PlacedTokens:
    """A sequence's tokens left where they were computed: the first ``length`` of row ``row`` of the
    (B, W) int tensor ``rows`` (a batched drafter's verification tokens, say), so that a step over
    the batch takes them without a copy to the host and the wait it would cost."""
    rows: torch.Tensor
    row: int
    length: int

    def __len__(self) -> int:
        return self.length


def _host_tokens(items) -> list:
    """Each item's tokens on the host, `PlacedTokens` rows read with one copy of their tensor (a batch
    mixing them with host lists: prompt chunks riding a chain pass)."""
    read: dict[int, np.ndarray] = {}
    out = []
    for it in items:
        t = it[0]
        if isinstance(t, PlacedTokens):
            if id(t.rows) not in read:
                read[id(t.rows)] = host_array(t.rows)
            t = read[id(t.rows)][t.row, :t.length]
        out.append(host_array(t))
    return out


def _tokens_in_place(items) -> tuple[torch.Tensor, list[int]] | None:
    """The items' tokens as one (B, W) torch tensor where they are and each item's length (W at
    least the longest; a row's tail past its length is padding): when every item gives them as a
    torch tensor of the same length, or as `PlacedTokens` rows 0..B-1 of one tensor; else None."""
    tokens = [it[0] for it in items]
    if tokens and all(isinstance(t, PlacedTokens) for t in tokens):
        rows = tokens[0].rows
        if all(t.rows is rows for t in tokens) and [t.row for t in tokens] == list(range(rows.shape[0])):
            return rows, [t.length for t in tokens]
        return None
    if not tokens or not all(isinstance(t, torch.Tensor) for t in tokens):
        return None
    flat = [t.reshape(-1) for t in tokens]
    if len({t.shape[0] for t in flat}) != 1 or len({t.device for t in flat}) != 1 or flat[0].shape[0] == 0:
        return None
    return torch.stack(flat), [flat[0].shape[0]] * len(flat)


_LOADED: dict[str, str] = {}    # model.so paths this process has loaded -> the content digest loaded there
_COPIES: list[Path] = []        # this process's own folder of library copies (made on first need)


def loadable_library(path: Path, digest: str) -> str:
    """Where to load the library at ``path`` (content ``digest``) from: ``path`` itself, or -- when
    this process already loaded other bytes from that path (a build compiled again into its folder)
    -- a copy named by the digest, since the loader hands back the library first loaded under a name
    and the process would run the old code (and miss functions the new manifest lists).  The copies
    live in a folder only this process writes (never one others could put a library in)."""
    key = str(path.resolve())
    if _LOADED.setdefault(key, digest) == digest:
        return key
    if not _COPIES:
        _COPIES.append(Path(tempfile.mkdtemp(prefix="specpilot-modules-")))    # mode 0700
        atexit.register(shutil.rmtree, _COPIES[0], True)
    copy = _COPIES[0] / f"{digest}.so"
    if not copy.is_file():
        shutil.copyfile(path, copy)
    return str(copy)


class CompiledModule:
    """One loaded build: the VM, the parameters on the device, the function table."""

    def __init__(self, build_dir: Path, verify_hashes: bool = True):
        self.dir = Path(build_dir)
        self.manifest = read_manifest(self.dir)
        gpu = self.manifest.target_kind == "cuda"
        tvm = import_tvm_runtime(gpu)
        self.tvm = tvm
        self.device = tvm.cuda(0) if gpu else tvm.cpu(0)
        if verify_hashes:
            self._check_hashes()
        cpu_level.require(self.manifest.cpu, str(self.dir))
        if not gpu:
            claim_cores_for_tvm()
        so = self.dir / "model.so"
        try:
            digest = self.manifest.hashes["model.so"] if verify_hashes else file_digest(so)
            lib = tvm.runtime.load_module(loadable_library(so, digest))
        except Exception as e:  # TVM raises its own error types for unloadable libraries
            raise SpecPilotError(f"{self.dir / 'model.so'}: cannot load ({str(e).splitlines()[0]})") from None
        self.vm = lib["vm_load_executable"]()
        dev_type, dev_id = self.device.dlpack_device_type(), self.device.index
        cpu = tvm.cpu(0)
        self.vm["vm_initialization"](dev_type, dev_id, 2, cpu.dlpack_device_type(), cpu.index, 2)
        self.releases = 0         # the times `keep_headroom` handed pooled memory back (benchmarks report it)
        self._drafter = None      # a block / feature drafter's (config, tensors, directory), read once
        self._retrained = None    # (SPECPILOT_DRAFTER, its (config, tensors, directory))
        self._stored, self._aliases = self._read_params()
        if self.conditioned_spec() is not None and os.environ.get("SPECPILOT_DRAFTER"):
            self._swap_drafter()
        self._references: dict[str, dict[str, torch.Tensor]] = {}
        self.params = self._load_params()
        self.functions = {name: self.vm[name] for name in self.manifest.functions}
        last = cuda_errors.last_error() if gpu else None
        if last is not None:        # a recovered allocation's error must not reach torch's next launch check
            self.functions = {name: last.wrap(name, fn) for name, fn in self.functions.items()}
        self._models: dict[str, CompiledModel] = {}

    def stored_parameters(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(the parameters as the build stores them -- each shared tensor once --, aliases)."""
        return self._stored, self._aliases

    def _check_hashes(self) -> None:
        for rel, digest in self.manifest.hashes.items():
            path = self.dir / rel
            if not path.is_file():
                raise SpecPilotError(f"{path}: missing from the build")
            if file_digest(path) != digest:
                raise SpecPilotError(f"{path}: content hash differs from manifest.json (corrupt or modified build)")

    def _read_params(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(stored values by name, aliases): from params/, or made again -- redrawn from the manifest's
        seeds, or read from the checkpoint the manifest references -- with the passes' rewrites redone."""
        m = self.manifest
        if m.params_source == "file":
            from safetensors.torch import load_file
            return load_file(str(self.dir / "params" / "params.safetensors")), m.aliases
        from types import SimpleNamespace

        from specpilot.core.weights import dedupe, params_digest, random_weights, rewritten_parameters
        cfgs = {which: ModelConfig.from_dict(d) for which, d in m.models.items()}
        on_gpu = self.device.dlpack_device_type() == 2
        where = {"device": "cuda" if on_gpu else None, "dtype": getattr(torch, m.dtype)}   # device draws
        seeds = {which: {**s, **where} for which, s in m.seeds.items() if s}
        if m.params_source == "load":
            target = self._referenced_target(cfgs["target"])
        else:
            target = SimpleNamespace(cfg=cfgs["target"], weights=random_weights(cfgs["target"], **seeds["target"]))
        drafter = None
        if "drafter" in cfgs:
            if m.drafter.kind == "early-exit" and (self.dir / "adapter.safetensors").is_file():
                from specpilot.core.loader import early_exit
                n = int(m.spec["drafter"]["layers"])
                weights = early_exit(target, n, self.dir / "adapter.safetensors").weights
            elif m.drafter.kind == "early-exit":   # the target's own first layers
                n = cfgs["drafter"].num_hidden_layers
                weights = {k: v for k, v in target.weights.items()
                           if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
            else:
                weights = random_weights(cfgs["drafter"], **seeds["drafter"])
            drafter = SimpleNamespace(cfg=cfgs["drafter"], weights=weights)
        if self.conditioned_spec() is not None:   # the build's own network (a retrained one swapped in after)
            drafter = fd.packing_view(*self._own_drafter()[:2], target.weights)   # the build's: its digest
        values = rewritten_parameters(m, target, drafter, device="cuda" if on_gpu else None, consume=True)
        if on_gpu:    # the conversion's freed temporaries back to the driver, where TVM allocates its workspace
            torch.cuda.empty_cache()
        if list(values) != m.params:
            raise SpecPilotError(f"{self.dir}: redoing the passes' parameter rewrites does not give the "
                                 "parameters manifest.json lists")
        if m.params_source == "load" and params_digest(values) != m.weights["params_sha256"]:
            raise SpecPilotError(f"{self.dir}: the parameters made from {m.weights['path']} differ from the "
                                 "ones the build was made with")
        return dedupe(values)

    def _referenced_target(self, cfg: ModelConfig):
        """A ``--params load`` build's target: its checkpoint from SPECPILOT_WEIGHTS or the recorded path."""
        import os

        from specpilot.core.loader import load_referenced
        loaded = load_referenced(self.manifest.weights, os.environ.get("SPECPILOT_WEIGHTS") or None)
        if loaded.cfg.to_dict() != cfg.to_dict():
            raise SpecPilotError(f"{loaded.description}: its config differs from the one this build was made for")
        return loaded

    def _load_params(self):
        aliases = self._aliases
        on_device = {}
        for name, tensor in self._stored.items():
            if tensor.is_cuda:      # drawn or converted on the device: shared with torch, not copied
                on_device[name] = self.tvm.runtime.from_dlpack(tensor.contiguous())
                continue
            host = self.tvm.runtime.from_dlpack(tensor.clone())   # safetensors data may be unaligned
            on_device[name] = host if self.device.dlpack_device_type() == 1 else host.copyto(self.device)
        try:
            return [on_device[aliases.get(name, name)] for name in self.manifest.params]
        except KeyError as e:
            raise SpecPilotError(f"{self.dir}: parameter {e} listed in manifest.json is missing") from None

    def keep_headroom(self) -> bool:
        """On a GPU with less than HEADROOM of its memory free, TVM's unused pooled blocks back to the
        driver, and torch's cached ones too where that leaves too little free (torch reuses its blocks for
        any size, so emptying its cache mostly costs the allocations that follow); whether it released."""
        if self.device.dlpack_device_type() != 2 or not self._low_on_memory():
            return False
        release_pooled_memory()
        if self._low_on_memory():
            torch.cuda.empty_cache()
        self.releases += 1
        return True

    def _low_on_memory(self) -> bool:
        free, total = torch.cuda.mem_get_info(self.device.index)
        return free < HEADROOM * total

    @property
    def torch_device(self) -> torch.device:
        """Where the build runs, as torch names it."""
        return torch.device("cpu") if self.device.dlpack_device_type() == 1 else torch.device("cuda", self.device.index)

    def zeros(self, shape, dtype: str):
        """Zeros where the build runs; on a GPU filled there in torch's caching allocator (a TVM copy
        from the host would cost a host-to-device copy of every byte and a synchronising free)."""
        return self.tvm.runtime.from_dlpack(torch.zeros(shape, dtype=getattr(torch, dtype), device=self.torch_device))

    def tensor(self, array: np.ndarray):
        return self.tvm.runtime.tensor(array, self.device)

    def tensors(self, *arrays: np.ndarray) -> list:
        """A step's small host inputs on the device.  On a GPU in one host-to-device copy into
        torch's caching allocator (64-byte aligned pieces of one buffer, as TVM wants): a tensor of
        its own each would cost a device allocation, a copy and a (synchronizing) free apiece:
        0.2-0.28 ms of the 8B-shape decode step on the H200 (docs/bench-log.md).  The pieces
        are views TVM holds through DLPack; TVM and torch launch on the same (default) stream, so
        the buffer goes back to torch's pool only behind the kernels that read it."""
        if self.device.dlpack_device_type() == 1:
            return [self.tensor(a) for a in arrays]
        host, views = pack_inputs(arrays)
        dev = upload(host, self.torch_device)
        return [self.tvm.runtime.from_dlpack(view(dev)) for view in views]

    def sample_scores(self, logits: torch.Tensor, keys: np.ndarray, controls: torch.Tensor) -> torch.Tensor:
        """The build's ``sample_scores`` (`runtime.sampling`'s contract) on rows of float32 logits
        where the build runs: the sampling scores as a torch tensor there."""
        fn = self.functions.get("sample_scores")
        if fn is None:
            raise SpecPilotError(f"{self.dir}: this build has no sample_scores function (made by an older "
                                 "SpecPilot); compile it again to sample")
        cpu = self.device.dlpack_device_type() == 1
        if cpu:
            args = [self.tensor(np.ascontiguousarray(a.cpu().numpy() if isinstance(a, torch.Tensor) else a))
                    for a in (logits.float(), keys, controls.float())]
        else:
            args = [self.tvm.runtime.from_dlpack(logits.float().contiguous()), *self.tensors(keys),
                    self.tvm.runtime.from_dlpack(controls.float().contiguous())]
        out = fn(*args)     # a fresh output: the VM hands it over, nothing writes it again
        return torch.from_numpy(out.numpy()) if cpu else torch.from_dlpack(out)

    def model(self, which: str) -> "CompiledModel":
        """The model's engine (one per build and model: it owns the model's KV-cache pool)."""
        if which not in self.manifest.models:
            raise SpecPilotError(f"{self.dir}: the build has no {which} model")
        if which not in self._models:
            self._models[which] = CompiledModel(self, which)
        return self._models[which]

    def feature_drafter(self):
        """A block / feature drafter's (DraftNetConfig, tensors, directory): the build's drafter/, or the
        one SPECPILOT_DRAFTER names -- a retrained drafter for the same target of the configuration the
        build lowered (its weights replace the build's drafter parameters at load)."""
        override = os.environ.get("SPECPILOT_DRAFTER")
        if not override:
            return self._own_drafter()
        if self._retrained is None or self._retrained[0] != override:   # read and checked once per directory
            self._retrained = override, self._load_retrained(override)
        return self._retrained[1]

    def _load_retrained(self, override: str):
        import dataclasses
        import json

        target = ModelConfig.from_dict(self.manifest.models["target"])
        own = self.dir / "drafter"
        digest = json.loads((own / "config.json").read_text()).get("specpilot_target_digest")
        cfg, tensors = fd.load(Path(override), target, digest)
        kind = self.conditioned_spec()["kind"]
        if list(cfg.target_layers) != list(self.manifest.features or []) or cfg.kind != kind:
            raise SpecPilotError(f"SPECPILOT_DRAFTER={override}: a {cfg.kind} drafter reading target layers "
                                 f"{list(cfg.target_layers)}; this build's target returns layers "
                                 f"{self.manifest.features} for a {kind} drafter")
        lowered = fd.read_config(own, target)
        differ = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(lowered, f.name)]
        if differ:
            raise SpecPilotError(f"SPECPILOT_DRAFTER={override}: its {differ[0]} is {getattr(cfg, differ[0])}; this "
                                 f"build lowered a drafter with {getattr(lowered, differ[0])}")
        if fd.sliced_head(cfg) and not torch.equal(fd.vocab_ids(tensors["d2t"].cpu()),
                                                   fd.vocab_ids(self._own_drafter()[1]["d2t"].cpu())):
            raise SpecPilotError(f"SPECPILOT_DRAFTER={override}: its draft vocabulary differs from the one this build's "
                                 "head rows were taken for")
        return cfg, tensors, Path(override)

    def _own_drafter(self):
        """The build's own drafter (config, tensors, directory), read once: the one its parameters were
        made with (a seeded build's drawn again from the spec's seed)."""
        if self._drafter is None:
            target = ModelConfig.from_dict(self.manifest.models["target"])
            own = self.dir / "drafter"
            if (own / "model.safetensors").is_file() or self.manifest.params_source != "seeded":
                self._drafter = (*fd.load(own, target), own)
            else:
                cfg = fd.read_config(own, target)
                self._drafter = cfg, fd.random_init(cfg, int(self.conditioned_spec()["init"]["seed"])), own
        return self._drafter

    def conditioned_spec(self) -> dict | None:
        """The spec's options of the network reading the target's hidden states that the build lowered:
        a block / feature drafter's own, a replay drafter's block cost (`core.spec.conditioned_source`),
        or None."""
        drafter = self.manifest.spec["drafter"]
        if drafter["kind"] in fd.KINDS:
            return drafter
        cost = drafter.get("cost") or {}
        return cost if drafter["kind"] == "replay" and cost.get("kind", "model") == "block" else None

    def _swap_drafter(self) -> None:
        """The retrained drafter's tensors in the stored parameters' places (`feature_drafter` checked
        its configuration against the build's)."""
        tensors = self.feature_drafter()[1]
        dtype = getattr(torch, self.manifest.dtype)
        fused = self.manifest.fused or {}
        for name in self.manifest.params:
            if not name.startswith("drafter.") or name in self._aliases:
                continue
            members = [m.partition(".")[2] for m in fused.get(name, [name])]   # fuse-projections' stacks
            if all(m in tensors for m in members):
                value = torch.cat([tensors[m] for m in members]) if len(members) > 1 else tensors[members[0]]
                self._stored[name] = value.to(device=self._stored[name].device, dtype=dtype)

    def draft_net(self):
        """The block / feature drafter lowered into this build (`runtime.compiled_draft_nets`)."""
        from specpilot.runtime.compiled_draft_nets import compiled_draft_net

        cfg, tensors, _ = self.feature_drafter()
        return compiled_draft_net(self, cfg, tensors)

    def reference_weights(self, which: str) -> dict[str, torch.Tensor]:
        """The build's own weights under Hugging Face names, for the stock reference (decoded
        once per model: the bf16 and the float32 reference both ask)."""
        if which not in self._references:
            self._references[which] = self._reference_weights(which)
        return self._references[which]

    def _reference_weights(self, which: str) -> dict[str, torch.Tensor]:
        stored, aliases = self._stored, self._aliases
        value = lambda name: stored[aliases.get(name, name)]  # noqa: E731
        names = self.manifest.params
        fused = self.manifest.fused or {}
        prefix = which + "."
        if fused:
            from specpilot.core.weights import parameter_shapes
            shapes = parameter_shapes(ModelConfig.from_dict(self.manifest.models[which]))
        out = {}
        for name in names:
            if not name.startswith(prefix) or name.endswith("rope_inv_freq") or ".w12_" in name:
                continue
            if f"{name}.w12_lo" in names:   # stored in the W12 layout: decode the exact weights back
                from specpilot.core import w12
                planes = w12.W12Kernel(value(name), *(value(f"{name}.{s}") for s in w12.PLANES))
                if (self.manifest.w12 or {}).get("layout", "cpu") == "gpu":
                    planes = w12.cpu_layout(planes)
                weight = w12.decode_kernel_layout(planes).to(getattr(torch, self.manifest.dtype))
            else:
                weight = value(name)
            if name in fused:               # stacked projections: back to one tensor each
                rows = [shapes[member[len(prefix):]][0] for member in fused[name]]
                for member, part in zip(fused[name], torch.split(weight, rows, dim=0)):
                    out[member[len(prefix):]] = part
            else:
                out[name[len(prefix):]] = weight
        return out


@dataclass
class _Batch:
    """One recorded call's per-token outputs and the recurrent states it started from, every sequence's."""
    conv_states: object       # (B, T, G, C, K-1) on the device
    rec_records: object       # (B, T, G, H, dk + dv + 2)
    rec_before: object        # (B, G, H, dk, dv)
    size: int


@dataclass
class _Pass:
    start: int
    length: int
    conv_states: object       # (1, T, G, C, K-1) on the device; None: row ``index`` of ``batch``'s
    rec_records: object       # (1, T, G, H, dk + dv + 2): each token's k, v, g, beta; None: as conv_states
    before: tuple             # the sequence's states before the pass, as `CompiledState.states` gives them
    parents: np.ndarray       # (T,) on the host: each token's parent in the pass (-1: before it)
    batch: _Batch | None = None   # the call the pass was row ``index`` of
    index: int = 0

    def path(self, index: int) -> np.ndarray:
        """Token ``index``'s root path in the pass, root first."""
        out = []
        while index >= 0:
            out.append(index)
            index = int(self.parents[index])
        return np.array([out[::-1]], "int32")


class CompiledState:
    """One sequence: its row of the model's KV pool and its recurrent states (1, G, ...).

    After a recorded verification the states are those after one of its tokens (the last, until
    `CompiledModel.accept_path` / `truncate` pick another), rebuilt by ``commit`` only when first
    read (`CompiledModel.settle`), as are the keys / values of an accepted tree path
    (``kv_moves``).  ``stacked``: (conv, rec, b) where the states are row b of a call's (B, ...)
    outputs; their (1, ...) views are made when first read (a batch passing its states on as the
    call's outputs reads none: a view a sequence and tensor a pass is host time on every pass)."""

    def __init__(self, model: "CompiledModel", row: int, capacity: int):
        self.model, self.row, self.capacity, self.length = model, row, capacity, 0
        self.features = None    # a `runtime.features.FeatureStore` when the target returns feature layers
        module, shapes = model.module, model.shapes
        placeholder = module.zeros((1,), "float32")
        self._pending: tuple[_Pass, int] | None = None
        self.stacked: tuple | None = None
        self.kv_moves: list[tuple[int, int]] = []    # (from, to) cache positions an accepted tree path still moves
        self.set_states(module.zeros((1, *shapes["conv"][0]), shapes["conv"][1]) if "conv" in shapes else placeholder,
                        module.zeros((1, *shapes["rec"][0]), "float32") if "rec" in shapes else placeholder)
        self.history: list[_Pass] = []
        self._release = weakref.finalize(self, model.free_rows.append, row)

    def set_states(self, conv, rec, stacked: tuple | None = None) -> None:
        """The states (1, ...) ``conv`` and ``rec``; both None: row b of ``stacked`` = (conv, rec, b)."""
        if conv is None and (rec is not None or stacked is None):
            raise ValueError("states without their arrays need the call outputs they are a row of")
        self._conv, self._rec, self._pending, self.stacked = conv, rec, None, stacked

    @property
    def states(self) -> tuple:
        """The states as `set_states` takes them (committed first), without making row views."""
        self._settle()
        return self._conv, self._rec, self.stacked

    def set_after(self, p: "_Pass", index: int | None = None) -> None:
        """The states after token ``index`` (default: the last) of recorded pass ``p``, committed
        when first read."""
        self._pending, self.stacked = (p, p.length - 1 if index is None else index), None

    @property
    def pending(self) -> tuple["_Pass", int] | None:
        """(recorded pass, token index) whose states are still to be committed, or None."""
        return self._pending

    def _settle(self) -> None:
        if self._pending is not None:
            p, index = self._pending
            self.set_states(*self.model._commit_at(p, index))

    @property
    def conv(self):
        self._settle()
        self._materialize()
        return self._conv

    @property
    def rec(self):
        self._settle()
        self._materialize()
        return self._rec

    def _materialize(self) -> None:
        if self._conv is None:
            conv, rec, b = self.stacked
            self._conv, self._rec = self.model.row(conv, b), self.model.row(rec, b)

    def close(self) -> None:
        """Give the cache row back now (otherwise when the state is garbage)."""
        self._release()

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.capacity:
            raise SpecPilotError(f"sequence of {self.length + n_new} tokens exceeds deployment.max_seq_len="
                                 f"{self.capacity}; raise it in the spec or ask for fewer tokens")

    def snapshot(self):
        return (self.length, *self.states)

    def restore(self, snap, keep_history: bool = False) -> None:
        """Back to ``snap``; ``keep_history``: keep the passes recorded before it (see the reference state)."""
        self.length = snap[0]
        self.set_states(*snap[1:])
        self.history = [p for p in self.history if keep_history and p.start + p.length <= self.length]

    def drop_history(self) -> None:
        self.history.clear()

    def truncate(self, length: int) -> None:
        self.model.truncate(self, length)


PREFILL_CHUNK = 2048   # prompt tokens one GPU prefill pass takes at most (`CompiledModel.forward`)


def packed_rows(toks: list, T: int, step: int = 1) -> tuple[np.ndarray, np.ndarray] | None:
    """``target_verify_packed``'s ``pack`` (N,): the flat indices in (B*T) of a batch's real tokens
    (``toks``: each sequence's, padded to T), then as many copies of the last as round N up to a multiple
    of ``step`` (at most B*T rows; no position reads them: their logits are dropped), and ``unpack``
    (B, T): each position's row among them (a padding position: its sequence's first row); None where
    nothing pads."""
    lengths = np.array([len(t) for t in toks])
    if lengths.sum() == len(toks) * T:
        return None
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    within = np.arange(T)[None, :]
    real = within < lengths[:, None]
    pack = np.flatnonzero(real).astype("int32")
    rows = min(-(-len(pack) // step) * step, len(toks) * T)
    pack = np.concatenate([pack, np.full(rows - len(pack), pack[-1], "int32")]) if len(pack) else pack
    unpack = (starts[:, None] + np.where(real, within, 0)).astype("int32")
    return pack, unpack


def step_rows(toks: list[np.ndarray], items: list, T: int):
    """A step's (B, T) tokens, rotary positions, cache slots, (B, T, L) mask and parents for ``items``
    (tokens ``toks``; the rest as `CompiledModel.forward_batch` takes them), built for the batch at once:
    each sequence's tokens at its next slots, causal rows unless it gives positions / a mask / parents.
    Padding rows write nowhere (slot -1) and attend to slot 0 only (their outputs are dropped)."""
    B = len(items)
    lengths = np.fromiter((len(t) for t in toks), np.int64, B)
    starts = np.fromiter((it[1].length for it in items), np.int64, B)
    for (_, st, *_), n in zip(items, lengths):
        st.check_room(int(n))
    L = int((starts + lengths).max())
    at = starts[:, None] + np.arange(T)                        # each row's slot, were it real
    real = np.arange(T)[None, :] < lengths[:, None]
    tokens = np.zeros((B, T), "int32")
    if lengths.sum():
        tokens[real] = np.concatenate(toks)
    slots = np.where(real, at, -1).astype("int32")
    positions = np.where(real, at, 0).astype("int32")
    mask = (np.arange(L)[None, None, :] <= at[:, :, None]) & real[:, :, None]
    mask[:, :, 0] = True
    parents = np.tile(np.arange(-1, T - 1, dtype="int32"), (B, 1))   # a chain unless a tree is given
    for b, (_, _, pos, attn, par) in enumerate(items):
        n, start = int(lengths[b]), int(starts[b])
        if pos is not None:
            positions[b, :n] = np.asarray(pos, dtype="int32")
        if attn is not None:
            mask[b, :n, :start + n] = np.asarray(attn, dtype=bool)
        if par is not None:
            parents[b, :n] = np.asarray(par, dtype="int32")
    return tokens, positions, slots, mask, parents


class CompiledModel:
    """`ReferenceModel`'s interface over a build's ``<which>_*`` functions."""

    REC_ARG = -2     # a step call's arguments end kv, conv, rec, params (`_step_inputs`)

    def __init__(self, module: CompiledModule, which: str):
        self.module, self.which = module, which
        self.cfg = ModelConfig.from_dict(module.manifest.models[which])
        self.dtype = module.manifest.dtype
        self.capacity = module.manifest.capacity
        self.max_batch = module.manifest.max_batch
        self.has_gdn = self.cfg.is_hybrid
        # the target's steps of a build for a feature drafter also return these layers' outputs (last)
        features = module.manifest.features if which == "target" else None
        self.feature_layers = tuple(features) if features else None
        self._tuple = self.has_gdn or bool(self.feature_layers)    # a step returns a tuple
        fns = module.functions
        self._prefill, self._decode, self._verify = (fns[f"{which}_{k}"] for k in ("prefill", "decode", "verify"))
        self._decode_batch = fns.get(f"{which}_decode_batch", self._decode)   # GPU builds: decode is batch 1
        self._commit = fns.get(f"{which}_commit")
        self._compact_kv = fns.get(f"{which}_compact_kv")   # added by the tree-verify pass
        # tree-verify{fixed=true}: one sequence's verification at a fixed token count, padded up to it
        self._verify_fixed = fns.get(f"{which}_verify_tree")
        tree = module.manifest.tree
        self.fixed_verify_tokens = tree.fixed_tokens if tree and self._verify_fixed is not None else None
        # tree-verify{packed=true}: a padded batch's verification over its real tokens' rows
        self._verify_packed = fns.get(f"{which}_verify_packed")
        self.pack_verify = self._verify_packed is not None      # off: every verification padded (benchmarks)
        # the tokens a sequence the packed function's memory is planned for: longer rows verify padded
        self.packed_tokens = module.manifest.memory_bounds.get(f"{which}_verify_packed", {}).get("n")
        self.path_recompute = module.manifest.gdn_verify is not None   # every GDN verify kernel, drafter too
        # tokens a recording (verify) pass may take: the chunked GDN tree form holds a fixed number
        limit = (module.manifest.gdn_verify.max_tokens if module.manifest.gdn_verify else None) if self.has_gdn else None
        self.max_verify_tokens = int(limit) if limit else None
        self.shapes = cache_shapes(self.cfg, self.capacity, self.max_batch, self.dtype)
        self.kv = module.zeros(*self.shapes["kv"]) if "kv" in self.shapes else module.zeros((1,), "float32")
        self.free_rows = list(range(self.max_batch))[::-1]
        self.feature_pool: FeaturePool | None = None    # made with the first sequence of a target with feature layers
        # a pass's workspace grows with its tokens (a 4096-token prefill of a 27B-class hybrid asks the card
        # for ~58 GB beside the weights): GPU builds prefill a long prompt in passes of PREFILL_CHUNK tokens
        self.prefill_chunk = PREFILL_CHUNK if module.device.dlpack_device_type() == 2 else None
        self.packed_rows_step = PACKED_ROWS_STEP if module.device.dlpack_device_type() == 2 else 1

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def packs_verification(self) -> bool:
        """Whether a padded batched verification runs packed: the build has ``target_verify_packed`` and
        ``pack_verify`` (a benchmark's switch) is on."""
        return self.pack_verify and self._verify_packed is not None

    @property
    def keeps_tree_paths(self) -> bool:
        """Whether `accept_path` can keep a path other than a prefix of the pass (tree-verify builds)."""
        return self._compact_kv is not None

    def new_state(self, capacity: int) -> CompiledState:
        if capacity > self.capacity:
            raise SpecPilotError(f"capacity {capacity} exceeds the build's max_seq_len {self.capacity}")
        if not self.free_rows:
            heap.collect()   # states dropped inside reference cycles give their rows back here
        if not self.free_rows:
            raise SpecPilotError(f"all {self.max_batch} KV-cache rows of the {self.which} are in use; raise "
                                 "deployment.max_batch in the spec or close finished sequences")
        state = CompiledState(self, self.free_rows.pop(), self.capacity)
        if self.feature_layers:
            state.features = self._feature_pool().store(state.row)
        return state

    def _feature_pool(self) -> FeaturePool:
        if self.feature_pool is None:
            gpu = self.module.device.dlpack_device_type() == 2
            self.feature_pool = FeaturePool(self.max_batch, self.capacity, len(self.feature_layers) * self.cfg.hidden_size,
                                            getattr(torch, self.dtype), "cuda" if gpu else "cpu")
        return self.feature_pool

    def forward(self, tokens, state: CompiledState, positions=None, attn_mask=None, record: bool = False,
                parents=None):
        """One sequence's step (see `forward_batch`): logits (T, vocab).  ``parents`` (tree
        verification) matter only to Gated DeltaNet layers, which need gdn-path-recompute."""
        if parents is not None and self.has_gdn and not self.path_recompute and \
                any(p != i - 1 for i, p in enumerate(parents)):
            raise SpecPilotError(f"{self.module.dir}: tree verification of a hybrid (Gated DeltaNet) target needs "
                                 "a build with the gdn-path-recompute pass")
        chunk = self.prefill_chunk
        if chunk and len(tokens) > chunk and not record and positions is None and attn_mask is None and parents is None:
            return torch.cat([self.forward_batch([(tokens[i:i + chunk], state)])[0]
                              for i in range(0, len(tokens), chunk)])
        return self.forward_batch([(tokens, state, positions, attn_mask, parents)], record)[0]

    def forward_view(self, tokens, state: CompiledState, positions, attn_mask, parents):
        """The nested 8-bit view's verification (``<which>_verify_view``) of new tokens after
        ``state``: logits only.  The state does not move (keys/values written past its length
        are dead and rewritten by the next exact pass)."""
        fn = self.module.functions.get(f"{self.which}_verify_view")
        if fn is None:
            raise SpecPilotError(f"{self.module.dir}: no {self.which}_verify_view; build with nested-int8-view")
        tokens, positions, attn_mask, parents = (host_array(x) for x in (tokens, positions, attn_mask, parents))
        tokens = np.asarray(tokens, dtype="int32").reshape(1, -1)
        self.settle([state])
        n, start = tokens.shape[1], state.length
        state.check_room(n)
        m = self.module
        mask = np.asarray(attn_mask, dtype=bool)[None]
        out = fn(*m.tensors(tokens, np.asarray(positions, "int32")[None], np.arange(start, start + n, dtype="int32")[None],
                            mask, np.array([state.row], "int32"), np.asarray(parents, "int32")[None]),
                 self.kv, state.conv, state.rec, m.params)
        return self._logits(out[0] if self._tuple else out)[0]

    def accept_path(self, state: CompiledState, base: int, rows: list[int]) -> None:
        """After a tree verification from ``base``: keep new tokens ``rows`` (an ascending root
        path) at base, base+1, ... by moving their keys/values inside the pool (target_compact_kv)."""
        if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and (rows[0] < 0 or base + rows[-1] >= state.length)):
            raise SpecPilotError(f"accept_path: rows {rows} are not an ascending path inside the last pass")
        moves = [(base + r, base + i) for i, r in enumerate(rows) if r != i]
        if moves and self.cfg.layer_types.count("full_attention"):
            if self._compact_kv is None:
                raise SpecPilotError(f"{self.module.dir}: this build cannot keep a tree path (no {self.which}_compact_kv); "
                                     "build it with the tree-verify pass")
            state.kv_moves = moves        # made by `settle`, a batch's in one call
        if self.has_gdn and rows:   # the tree pass's records: the state after the path's last token
            p = state.history[-1] if state.history else None
            if p is None or p.start != base:
                raise SpecPilotError("accept_path: the last pass was not a recorded verification starting at base")
            state.set_after(p, rows[-1])
        if state.features is not None:
            state.features.accept(base, rows)
        state.length = base + len(rows)
        state.history.clear()

    def step_on_device(self, token, state: CompiledState) -> torch.Tensor:
        """One decode step of one sequence whose new token is a tensor where the build runs
        (int32, one element: the previous step's argmax, say): its logits (vocab,) as a torch
        tensor there, read before the next step (a CUDA graph's output is reused).  Nothing
        waits for the device -- the other inputs follow from the state's length, and on a GPU
        they go up from pinned memory without a sync -- so a loop of these enqueues step after
        step while the device runs (`decoding.autoregressive`'s unforced loop)."""
        start = state.length
        state.check_room(1)
        self.settle([state])
        m = self.module
        slot = np.array([[start]], "int32")
        head = m.tensors(np.zeros((1, 1), "int32"), slot, slot, np.ones((1, 1, start + 1), bool),
                         np.array([state.row], "int32"))
        head[0] = m.tvm.runtime.from_dlpack(token.reshape(1, 1).to(torch.int32))
        out = self._decode(*head, self.kv, state.conv, state.rec, m.params)
        if self.has_gdn:
            state.set_states(self.row(out[1], 0), self.row(out[2], 0))
        if self.feature_layers:
            state.features.write(start, self._host_or_device(out[-1])[0])
        state.length = start + 1
        return torch.from_dlpack(out[0] if self._tuple else out).reshape(-1)

    def step_call(self, items, record: bool = False):
        """The step function and its arguments for `forward_batch`'s items, without calling it
        or moving any state past its pending commits (`settle` runs first): (function, arguments,
        tokens per item, states).  Calling it again with the same arguments recomputes the same step
        (benchmarks time it this way)."""
        return self._step_inputs(items, record)[:4]

    def _step_inputs(self, items, record: bool):
        """`step_call`'s tuple and the host copy of the parents it passed.  Tokens given as torch
        tensors of one length or as `PlacedTokens` rows of one tensor (a drafter's own choices, where
        they were computed) stay where they are: the step reads them there, without a copy to the
        host and the wait it would cost."""
        placed = _tokens_in_place(items)
        kept = None if placed is None else placed[0]
        on_host = [None] * len(items) if kept is not None else _host_tokens(items)
        items = [(t,) + tuple(host_array(x) for x in it[1:]) + (None,) * (5 - len(it)) for t, it in zip(on_host, items)]
        if len({id(it[1]) for it in items}) != len(items):
            raise SpecPilotError("a sequence appears twice in one batch")
        toks = [np.asarray(it[0], dtype="int32").reshape(-1) for it in items] if kept is None else \
            [np.zeros(n, "int32") for n in placed[1]]
        B, T = len(items), max(len(t) for t in toks)
        fixed = record and B == 1 and self.fixed_verify_tokens is not None and T <= self.fixed_verify_tokens
        if fixed:        # padding tokens: written nowhere, attending to slot 0, their rows dropped
            T = self.fixed_verify_tokens
        tokens, positions, slots, mask, parents = step_rows(toks, items, T)
        states = [it[1] for it in items]
        self.settle(states)
        m = self.module
        rows = np.array([st.row for st in states], "int32")
        if self.has_gdn:
            conv, rec = self._stacked_states(states)
        else:   # the placeholder arguments of a model without recurrent layers
            conv, rec = states[0].conv, states[0].rec
        packing = record and not fixed and self.packs_verification and T <= (self.packed_tokens or T) \
            and packed_rows(toks, T, self.packed_rows_step)
        if packing:
            head = m.tensors(tokens, positions, slots, mask, rows, parents, *packing)
        elif record:
            head = m.tensors(tokens, positions, slots, mask, rows, parents)
        else:
            head = m.tensors(tokens, positions, slots, mask, rows)
        if kept is not None:
            kept = kept.to(device=m.torch_device, dtype=torch.int32)
            if T > kept.shape[1]:        # a fixed-size verification's padding
                kept = torch.nn.functional.pad(kept, (0, T - kept.shape[1]))
            kept = kept[:, :T]
            head[0] = m.tvm.runtime.from_dlpack(kept.contiguous())
        if record:
            name = "verify_tree" if fixed else "verify_packed" if packing else "verify"
        else:
            name = "prefill" if T > 1 else "decode" if B == 1 or self._decode_batch is self._decode else "decode_batch"
        self._within_bounds(name, batch=B, n=T, kv_len=mask.shape[2], real=len(packing[0]) if packing else 0)
        fn = {"verify_tree": self._verify_fixed, "verify_packed": self._verify_packed, "verify": self._verify,
              "prefill": self._prefill, "decode": self._decode, "decode_batch": self._decode_batch}[name]
        return fn, [*head, self.kv, conv, rec, m.params], toks, states, parents

    def _within_bounds(self, name: str, **dims: int) -> None:
        """Refuse a call of ``<which>_<name>`` past the bounds its memory is planned at (the manifest's
        ``memory_bounds``): TVM would write past the blocks it planned.  The runtime keeps its calls inside
        them; this guards the contract."""
        for dim, limit in self.module.manifest.memory_bounds.get(f"{self.which}_{name}", {}).items():
            if dims.get(dim, 0) > limit:
                raise SpecPilotError(f"{self.module.dir}: a {self.which}_{name} call with {dim} {dims[dim]}, past the "
                                     f"{limit} its memory is planned for (the manifest's memory_bounds)")

    def forward_batch(self, items, record: bool = False) -> list[torch.Tensor]:
        """items: (tokens, state[, positions[, attn_mask[, parents]]]) per sequence, each sequence
        at its own length and with its own number of new tokens; one call of the step function
        for all.  Returns each sequence's float32 logits (T_b, vocab) and advances each state."""
        longest = max(len(it[0]) for it in items)
        if record and self.max_verify_tokens and longest > self.max_verify_tokens:
            raise SpecPilotError(f"{self.module.dir}: a verification of {longest} tokens; this build's Gated "
                                 f"DeltaNet tree kernel takes at most {self.max_verify_tokens} "
                                 "(gdn-path-recompute{form=sequential} has no limit)")
        self.module.keep_headroom()
        fn, args, toks, states, parents = self._step_inputs(items, record)
        out = fn(*args)
        # the host's work a sequence first, while the device runs the pass
        starts = [st.length for st in states]
        if self.has_gdn:     # each read of a result's field makes another handle: read once, compare by identity
            self._pass_states(out[1], out[2], args[self.REC_ARG], toks, states, parents if record else None)
        for t, st in zip(toks, states):
            st.length += len(t)
        logits = self._logits(out[0] if self._tuple else out, sum(len(t) for t in toks))
        if self.feature_layers:
            self.feature_pool.write([(st.features, start, len(t)) for t, st, start in zip(toks, states, starts)],
                                    self._host_or_device(out[-1]))
        if logits.dim() == 2:      # a packed pass's: the real tokens' rows, a sequence's after the one before's
            return list(logits.split([len(t) for t in toks]))
        return [logits[b, :len(t)] for b, t in enumerate(toks)]

    def _pass_states(self, conv_out, rec_out, rec_in, toks, states, parents) -> None:
        """Each sequence's states after a pass: a row of its outputs (made when read), or with ``parents``
        (a recorded verification) those after its last token, committed when read (`settle`).  A
        CUDA-graph build's outputs may be a replay's buffers: its rows are copies made now, and nothing
        passes its outputs on."""
        shared = not self.module.manifest.cuda_graph
        batch = _Batch(conv_out, rec_out, rec_in, len(states)) if parents is not None and shared else None
        for b, (t, st) in enumerate(zip(toks, states)):
            n = len(t)
            if parents is None:
                st.set_states(*((None, None, (conv_out, rec_out, b)) if shared else
                                (self.row(conv_out, b), self.row(rec_out, b))))
                continue
            rows = (None, None) if shared else (self.row(conv_out, b, n), self.row(rec_out, b, n))
            p = _Pass(st.length, n, *rows, st.states, parents[b, :n].copy(), batch, b)
            st.history.append(p)
            st.set_after(p)

    def _host_or_device(self, array) -> torch.Tensor:
        """A step output as a torch view where the build ran (read before the next call)."""
        if self.module.device.dlpack_device_type() == 1:
            return torch.from_numpy(array.numpy())
        return torch.from_dlpack(array)

    def _logits(self, array, real: int | None = None) -> torch.Tensor:
        """A step's logits as a torch tensor where the build ran: on a GPU the call's output itself (it
        holds its block until torch lets it go), a copy where the build replays CUDA graphs (a later
        replay writes the same buffer); on the CPU a copy.  A packed pass's (N, vocab): its first ``real``
        rows (those after are `packed_rows`' rounding)."""
        if self.module.device.dlpack_device_type() == 1:
            logits, replayed = torch.from_numpy(array.numpy()), False
        else:
            logits, replayed = torch.from_dlpack(array), self.module.manifest.cuda_graph
        logits = logits[:real] if logits.dim() == 2 and real else logits
        return logits.clone() if replayed else logits

    def _commit_at(self, p: _Pass, index: int):
        """The conv / recurrent states after token ``index`` of recorded pass ``p``."""
        m = self.module
        conv, rec = (p.conv_states, p.rec_records) if p.conv_states is not None else \
            (self.row(p.batch.conv_states, p.index, p.length), self.row(p.batch.rec_records, p.index, p.length))
        before = p.before[1] if p.before[1] is not None else self.row(p.before[2][1], p.before[2][2])
        return self._commit(conv, rec, before, *m.tensors(p.path(index), np.array([index], "int32")))

    def settle(self, states: list[CompiledState]) -> None:
        """Move the accepted tree paths' keys / values of ``states`` in the pool (one ``compact_kv`` call)
        and commit their pending recurrent states (`CompiledState.pending`): those from one recorded
        call in one ``commit`` call over that call's batch (rows no state asks for take an empty path),
        each state then a row of its (B, ...) outputs; the rest one at a time."""
        self._move_kv([st for st in states if st.kv_moves])
        if self.feature_pool is not None:
            self.feature_pool.settle([st.features for st in states if st.features is not None])
        groups: dict[int, list[CompiledState]] = {}
        for st in states:
            if st.pending is not None:
                p = st.pending[0]
                groups.setdefault(id(p.batch) if p.batch is not None and p.batch.size > 1 else id(st), []).append(st)
        for group in groups.values():
            batch = group[0].pending[0].batch     # the group's call (its key), or one state alone
            if len(group) < 2:
                for st in group:
                    st._settle()
                continue
            paths = {st.pending[0].index: st.pending[0].path(st.pending[1])[0] for st in group}
            path = np.full((batch.size, max(len(q) for q in paths.values())), -1, "int32")
            index = np.zeros(batch.size, "int32")
            for b, q in paths.items():
                path[b, :len(q)] = q
                index[b] = q[-1]
            conv, rec = self._commit(batch.conv_states, batch.rec_records, batch.rec_before,
                                     *self.module.tensors(path, index))
            for st in group:
                st.set_states(None, None, (conv, rec, st.pending[0].index))

    def _move_kv(self, states: list[CompiledState]) -> None:
        if not states:
            return
        src = np.full((len(states), max(len(st.kv_moves) for st in states)), -1, "int32")   # < 0: padding
        dst = np.zeros_like(src)
        for i, st in enumerate(states):
            src[i, :len(st.kv_moves)], dst[i, :len(st.kv_moves)] = zip(*st.kv_moves)
            st.kv_moves = []
        rows = np.array([st.row for st in states], "int32")
        self._compact_kv(self.kv, *self.module.tensors(rows, src, dst))

    def _stacked_states(self, states: list[CompiledState]):
        """The sequences' (B, ...) conv and recurrent states: the last call's outputs themselves when
        ``states`` are its rows in order, its rows picked in one copy (or a view of consecutive ones) when
        they are some of its rows (requests left the batch), else their rows stacked (``states`` settled)."""
        first = states[0].stacked
        if first is not None and all(st.stacked is not None and st.stacked[0] is first[0] for st in states):
            picks = [st.stacked[2] for st in states]
            if picks == list(range(first[0].shape[0])):
                return first[0], first[1]
            return self._pick(first[0], picks), self._pick(first[1], picks)
        return self._stack([st.conv for st in states]), self._stack([st.rec for st in states])

    def _pick(self, array, picks: list[int]):
        """Rows ``picks`` of a (B, ...) array as one (len(picks), ...) array on the device: a view of it
        where they are consecutive and the view 64-byte aligned (TVM takes no other), else one gather."""
        whole = torch.from_dlpack(array)
        lo = picks[0]
        rows = whole[lo:lo + len(picks)]
        if picks != list(range(lo, lo + len(picks))) or rows.data_ptr() % 64:
            rows = whole.index_select(0, upload(np.array(picks, "int64"), whole.device))
        return self.module.tvm.runtime.from_dlpack(rows)

    def _stack(self, arrays):
        """(1, ...) arrays of the sequences -> one (B, ...) array on the device."""
        if len(arrays) == 1:
            return arrays[0]
        return self.module.tvm.runtime.from_dlpack(torch.cat([torch.from_dlpack(a) for a in arrays]))

    def row(self, array, b: int, n: int | None = None):
        """Batch entry b of a (B, ...) result (its first n tokens for per-token results), as (1, ...):
        a view of it, or a copy where the view would not be 64-byte aligned (TVM takes no other) or
        the build replays CUDA graphs (whose buffers a later replay may write)."""
        if array.shape[0] == 1 and (n is None or array.shape[1] == n):
            return array
        view = torch.from_dlpack(array)[b:b + 1]
        view = view if n is None else view[:, :n]
        if view.data_ptr() % 64 or self.module.manifest.cuda_graph:
            view = view.clone()
        return self.module.tvm.runtime.from_dlpack(view)

    def truncate(self, state: CompiledState, length: int) -> None:
        if length == state.length:
            return
        if not 0 <= length < state.length:
            raise SpecPilotError(f"cannot truncate a state of length {state.length} to {length}")
        if self.has_gdn:
            for p in state.history:
                if length == p.start:
                    state.set_states(*p.before)
                    break
                if p.start < length <= p.start + p.length:
                    state.set_after(p, length - p.start - 1)
                    break
            else:
                raise SpecPilotError(f"recurrent state at length {length} was not recorded; "
                                     "run the pass with record=True or restore a snapshot")
            state.history = [p for p in state.history if p.start < length]
        state.length = length
