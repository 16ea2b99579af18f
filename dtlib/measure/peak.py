"""The most bytes a rank's tensors hold at once, and what held them at that moment: a tracker of storages
that, unlike torch's memory trackers, takes any number of forwards per step (a pipeline's micro-batches).

Every storage an op creates is followed until it is freed; FSDP's resizing of a storage to 0 and back is
read as it happens. At each new peak the tracker notes each live storage's category:

- ``weights``: the parameters as the model holds them between steps (FSDP's shards), there when it starts;
- ``activations``: what autograd saved for backward (``saved_tensors_hooks``), parameters left out;
- ``optimizer``: what the optimizer's step created (Adam's moments);
- ``gradients``: what a parameter's ``.grad`` holds once backward is done (read back at the end), and, between
  the micro-batches of a step that reduces only in the last one (``set_requires_gradient_sync(False)``: a
  pipeline, gradient accumulation), FSDP2's unsharded gradients accumulated so far, read at each new peak;
- ``gathered and temporary``: the rest: FSDP's all-gathered weights and communication buffers, the outputs
  and intermediates of ops not saved for backward.

Bytes are the storages' sizes, without the CUDA caching allocator's rounding and fragmentation (the CPU and
fake tensors have none), so a GPU's ``max_memory_allocated`` reads a few percent more.

A storage is freed in whichever thread drops its last reference. On live gloo ranks that is sometimes gloo's own
worker thread, which can hold a finished collective's tensors a moment after the rank's code let go of them:
:meth:`PeakTracker.freed_elsewhere` names the bytes at the peak that another thread freed, 0 when the peak is
exactly what the block's own code held.

Example (inside a rank; the optimizer is optional)::

    with PeakTracker(model, optimizer) as peak:
        step()
    peak.categories()    # {"weights": ..., "activations": ..., ...}, at the peak
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves

from dtlib import compat

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "gathered and temporary")
STEP_MOMENT = "optimizer step"  # the moment of the optimizer's step, among those a tracker notes


def _storages(tensor: Any) -> list[Any]:
    """The storages behind a tensor: a DTensor's local shard's, a plain tensor's own."""
    if not isinstance(tensor, torch.Tensor):
        return []
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    if is_traceable_wrapper_subclass(tensor):  # another wrapper subclass: its inner tensors
        names, _ = tensor.__tensor_flatten__()
        return [s for name in names for s in _storages(getattr(tensor, name))]
    return [tensor.untyped_storage()]


#: (grad mode, the DTensor's ``_is_param``, its local tensor's) -> whether ``to_local()`` returns a new view of the
#: local tensor (dispatched) rather than the local tensor itself: torch's rule, read once per process.
_VIEWS: dict[tuple[bool, bool, bool], bool] = {}


def _to_local_views(tensor: Any, local: torch.Tensor) -> bool:
    """Whether ``tensor.to_local()`` dispatches a view of ``local`` (its ``_local_tensor``) here and now."""
    key = (torch.is_grad_enabled(), bool(getattr(tensor, "_is_param", False)), bool(getattr(local, "_is_param", False)))
    if key not in _VIEWS:
        with _disable_current_modes():  # asked of torch without a mode seeing it
            _VIEWS[key] = tensor.to_local() is not local
    return _VIEWS[key]


def _storages_held(tensor: Any) -> list[Any]:
    """:func:`_storages`, a DTensor's read from its local tensor without dispatching ``to_local()`` (which, with
    autograd on, makes a view): the same storages, for a tracker that only looks at them."""
    local = getattr(tensor, "_local_tensor", None) if hasattr(tensor, "to_local") else None
    if isinstance(local, torch.Tensor) and not is_traceable_wrapper_subclass(local):
        return [local.untyped_storage()]
    return _storages(tensor)


#: The trackers inside their blocks, each told of every storage resized in place (:func:`_watch_resizes`).
_RESIZE_WATCHERS: list[PeakTracker] = []
#: ``UntypedStorage.resize_`` as found, while the watchers' is installed: (the method, whether the class had it).
_UNWATCHED: list[tuple[Any, bool]] = []


def _watch_resizes(tracker: PeakTracker) -> None:
    """Tell ``tracker`` of every ``UntypedStorage.resize_`` until :func:`_unwatch_resizes`. FSDP frees a gathered
    weight with ``storage.resize_(0)`` and fills it again with ``resize_(size)``: calls on the storage itself,
    which no dispatch mode sees, and the only way a storage changes size without an op a mode sees."""
    if not _RESIZE_WATCHERS:
        found = torch.UntypedStorage.resize_

        def resize_(storage: Any, size: Any) -> Any:
            resized = found(storage, size)
            for watcher in list(_RESIZE_WATCHERS):
                watcher._remeasure(storage)
            return resized

        _UNWATCHED.append((found, "resize_" in vars(torch.UntypedStorage)))
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    _RESIZE_WATCHERS.append(tracker)


def _unwatch_resizes(tracker: PeakTracker) -> None:
    """Stop telling ``tracker``; the last tracker out puts ``UntypedStorage.resize_`` back as it was."""
    if tracker in _RESIZE_WATCHERS:
        _RESIZE_WATCHERS.remove(tracker)
    if not _RESIZE_WATCHERS and _UNWATCHED:
        found, owned = _UNWATCHED.pop()
        if owned:
            torch.UntypedStorage.resize_ = found  # type: ignore[method-assign]
        else:
            del torch.UntypedStorage.resize_


#: op -> whether it may write into its arguments: the ops after which the storages of the arguments are measured
#: again, as one may have resized them without returning them.
_WRITES: dict[Any, bool] = {}


def _writes(func: Any) -> bool:
    """Whether ``func`` may write into an argument: its schema says it does (``aten.resize_``, an ``out=`` op), or
    it returns nothing, an op run for what it does to its arguments (``inductor.resize_storage_bytes_``, whose
    schema marks no argument written)."""
    writes = _WRITES.get(func)
    if writes is None:
        schema = getattr(func, "_schema", None)
        writes = schema is None or schema.is_mutable or not schema.returns  # no schema (an odd op): measure again
        _WRITES[func] = writes
    return writes


class PeakTracker(TorchDispatchMode):
    """Follow every storage created inside the block; :attr:`peak` is the most bytes live at once (the
    parameters' included), :meth:`categories` what held them then."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 moment: Callable[[], Hashable] | None = None) -> None:
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self._refs: dict[int, tuple[weakref.ref, str]] = {}
        # the bytes of each storage followed, as last measured, and their sum: live() inside the block, kept up to
        # date as storages are followed, freed and resized, instead of summing every storage at every op
        self._sizes: dict[int, int] = {}
        self._live = 0
        # storages freed, as their weak references report them, not yet taken off the total: a reference's
        # callback runs in whichever thread drops the storage's last reference, gloo's own worker threads
        # included, so it only notes the free, and the tracker's own code takes it off (_settle)
        self._freed: deque[tuple[int, weakref.ref]] = deque()
        # the references of the storages that a thread other than the block's own freed (freed_elsewhere())
        self._thread: int | None = None
        self._elsewhere: list[weakref.ref] = []
        self._symbolic = False  # a storage of symbolic size (a ShapeEnv's fake tensor) seen: live() sums them all
        self._watching = False  # inside the block, where every resize is seen (_watch_resizes)
        self.peak = 0
        self._at_peak: list[tuple[weakref.ref, str, int]] = []
        # ``moment``: where the step is (a block's forward, say): the most bytes at each moment, and what held them
        self._moment = moment
        self._moments: dict[Hashable, tuple[int, list[tuple[weakref.ref, str, int]]]] = {}
        self._stepping = False
        self._hooks: list[Any] = []
        self._gradients: set[int] = set()
        self._fsdp_params: list[Any] = []  # FSDP2's per-parameter states, whose accumulated gradients are read
        self._shape_only = 0  # inside DTensor's propagation of an output's shape (see _shapes_only)
        self._propagating: Any = None  # ShardingPropagator's own method, while the tracker replaces it

    # -- following storages -------------------------------------------------------------------------------

    def _follow(self, storage: Any, category: str) -> None:
        key = id(storage)
        known = self._refs.get(key)
        if known is not None and known[0]() is storage:
            if category != "gathered and temporary" and known[1] == "gathered and temporary":
                self._refs[key] = (known[0], category)  # a temporary saved for backward, say
            self._measure(key, storage)  # an op's output: the op may have resized it (resize_, an out= op)
            return
        if known is not None:  # the entry of a storage gone, whose id this one now has
            self._forget(key, known[0])
        self._refs[key] = (weakref.ref(storage, lambda ref, key=key: self._note_free(key, ref)), category)
        self._measure(key, storage)

    def _note_free(self, key: int, ref: weakref.ref) -> None:
        """A followed storage's weak reference reports it freed, in the thread that dropped its last reference:
        note the free (:meth:`_settle` takes it off), and whether that thread is another than the block's own."""
        self._freed.append((key, ref))
        if threading.get_ident() != self._thread:
            self._elsewhere.append(ref)

    def _measure(self, key: int, storage: Any) -> None:
        """Note the bytes ``storage`` (followed, under ``key``) holds now, and the live total with them."""
        try:  # an untyped storage's len() is its nbytes(), read without making a SymInt
            size = len(storage)
        except RuntimeError:  # a storage of symbolic size (a ShapeEnv's fake tensor) has no len()
            self._symbolic = True
            return
        self._live += size - self._sizes.get(key, 0)
        self._sizes[key] = size

    def _remeasure(self, storage: Any) -> None:
        """``storage`` was resized in place: measure it again if it is one followed."""
        key = id(storage)
        known = self._refs.get(key)
        if known is not None and known[0]() is storage:
            self._measure(key, storage)

    def _forget(self, key: int, ref: weakref.ref) -> None:
        """The storage ``ref`` followed is gone (or its id taken by another): its bytes are no longer live."""
        known = self._refs.get(key)
        if known is not None and known[0] is ref:
            del self._refs[key]
            self._live -= self._sizes.pop(key, 0)

    def _settle(self) -> None:
        """Take the storages freed since the last call off the total. Only the tracker's code changes the total:
        a free noted by another thread (a gloo worker dropping a finished collective's tensors) while this one
        was between reading the total and writing it back was lost, and every peak after it was off."""
        while self._freed:
            self._forget(*self._freed.popleft())

    def live(self) -> int:
        """Bytes live now in the storages followed: the model's, and those created inside the block, C++'s
        included (DDP's gradient buckets, say)."""
        self._settle()
        if self._watching and not self._symbolic:  # every follow, free and resize counted as it happened
            return self._live
        return self._summed()

    def _summed(self) -> int:
        """:meth:`live`, every storage followed measured now: what the running total must equal."""
        storages = [storage for ref, _ in list(self._refs.values()) if (storage := ref()) is not None]
        try:  # an untyped storage's len() is its nbytes(), read without making a SymInt
            return sum(map(len, storages))
        except RuntimeError:  # a storage of symbolic size (a ShapeEnv's fake tensor) has no len()
            return sum(storage.nbytes() for storage in storages)

    def _check_peak(self, read: Callable[[Any], list[Any]] = _storages) -> None:
        """Note what is live if it is the most yet, or the most yet at this moment. ``read``: how the storages of
        FSDP's accumulated gradients are read (:meth:`_accumulated_gradients`)."""
        total = self.live()
        key: Hashable = None
        if self._moment is not None:
            key = STEP_MOMENT if self._stepping else self._moment()
        highest = total > self.peak
        highest_here = self._moment is not None and total > self._moments.get(key, (-1, []))[0]
        if highest or highest_here:
            accumulated = self._accumulated_gradients(read)
            noted = [(ref, "gradients" if id(storage) in accumulated else category, storage.nbytes())
                     for ref, category in list(self._refs.values()) if (storage := ref()) is not None]
            if highest:
                self.peak, self._at_peak = total, noted
            if highest_here:
                self._moments[key] = (total, noted)

    def _accumulated_gradients(self, read: Callable[[Any], list[Any]] = _storages) -> set[int]:
        """Ids of the storages that hold FSDP2's unsharded gradients accumulated over the micro-batches of a step
        that reduce-scatters only in its last (in the reduce dtype). A block's gradient just computed, on its way
        to its reduce-scatter, stays a temporary, as the gathered weights do. ``read``: :func:`_storages`, or, in
        this mode's own dispatch, where the views a DTensor's ``to_local()`` makes go past it, the same storages read
        without them (:func:`_storages_held`)."""
        ids: set[int] = set()
        for fsdp_param in self._fsdp_params:
            ids.update(id(storage) for storage in read(getattr(fsdp_param, "unsharded_accumulated_grad", None)))
        return ids

    # -- the dispatch mode and the hooks ---------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _writes(func):  # it may have resized an argument it does not return (resize_storage_bytes_)
            for tensor in tree_leaves((args, kwargs)):
                for storage in _storages_held(tensor):
                    self._remeasure(storage)
        if self._shape_only:  # DTensor running an op on fake tensors to learn its output's shape: no memory
            return out
        category = "optimizer" if self._stepping else "gathered and temporary"
        for tensor in tree_leaves(out):
            for storage in _storages_held(tensor):  # to_local()'s view here is dispatched past this mode: not seen
                self._follow(storage, category)
        self._check_peak(_storages_held)
        return out

    def _weight_storages(self) -> set[int]:
        """Ids of the storages the parameters hold now (FSDP swaps the sharded ones for the gathered ones).

        What ``_storages`` of each parameter returns and does, without its dispatches: a DTensor parameter's
        ``to_local()`` dispatches a view of its local tensor (and a ``prim.device``), which this mode follows
        and checks the peak after. The same follows are made here and the peak checked once after them: nothing
        is freed in between and a follow only adds bytes, so the last check finds the same peak with the same
        bytes in each category. (Dispatched, the views of every parameter at every saved tensor made the
        tracker several times slower than the step it measures.) Other parameters go through ``_storages``."""
        ids: set[int] = set()
        followed = False
        tracking = any(mode is self for mode in _get_current_dispatch_mode_stack())  # where the views would go
        category = "optimizer" if self._stepping else "gathered and temporary"
        for parameter in self.model.parameters():
            local = getattr(parameter, "_local_tensor", None) if hasattr(parameter, "to_local") else None
            if not isinstance(local, torch.Tensor) or is_traceable_wrapper_subclass(local):
                ids.update(id(s) for s in _storages(parameter))
                continue
            storage = local.untyped_storage()
            ids.add(id(storage))
            if tracking and _to_local_views(parameter, local):
                self._follow(storage, category)
                followed = True
        if followed:
            self._check_peak()
        return ids

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        weights = self._weight_storages()
        for storage in _storages(tensor):
            if id(storage) not in weights:
                self._follow(storage, "activations")
        return tensor

    def __enter__(self) -> PeakTracker:
        self._thread = threading.get_ident()
        self._fsdp_params = compat.fsdp_params(self.model)
        for parameter in self.model.parameters():
            for storage in _storages(parameter):
                self._follow(storage, "weights")
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for value in state.values():
                    for storage in _storages(value):
                        self._follow(storage, "optimizer")
            self._hooks += [self.optimizer.register_step_pre_hook(lambda *_: self._begin_step()),
                            self.optimizer.register_step_post_hook(lambda *_: setattr(self, "_stepping", False))]
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._saved.__enter__()
        self._shapes_only()
        self._check_peak()
        _watch_resizes(self)  # from here every resize is seen, and live() is the running total
        self._watching = True
        try:
            return super().__enter__()
        except BaseException:  # the block never ran: nothing of the tracker's is left installed
            self._undo(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._undo(*exc)

    def _undo(self, *exc: Any) -> None:
        """Take out all that ``__enter__`` put in: the resize watch, the saved-tensor hooks, the optimizer's hooks
        and DTensor's shape propagation."""
        self._watching = False  # live() outside the block measures every storage: resizes are no longer seen
        _unwatch_resizes(self)
        self._saved.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        if self._propagating is not None:
            ShardingPropagator._propagate_tensor_meta_non_cached = self._propagating
            self._propagating = None

    def _shapes_only(self) -> None:
        """Leave out what DTensor allocates to learn an op's output shape: it runs the op on fake tensors of the
        whole (global) shape, in the fake mode it finds. Live ranks run it in a fake mode of their own, which this
        tracker never sees; fake ranks run it in theirs, which it would, and loss parallelism's log-softmax asks
        on every call: a whole fp32 logits tensor that no rank ever holds."""
        original = self._propagating = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
        if original is None:  # a torch that propagates otherwise: nothing to leave out
            return

        def propagated(propagator: Any, *args: Any, **kwargs: Any) -> Any:
            self._shape_only += 1
            try:
                return original(propagator, *args, **kwargs)
            finally:
                self._shape_only -= 1
        ShardingPropagator._propagate_tensor_meta_non_cached = propagated

    def _begin_step(self) -> None:
        self.note_gradients()  # backward is done: the .grad s are there
        self._stepping = True

    def note_gradients(self) -> None:
        """Call once backward is done and before ``zero_grad``: marks the storages the ``.grad`` s hold, now
        and in the peak already noted (``zero_grad`` frees them before :meth:`categories` can look)."""
        held = {id(s): s for p in self.model.parameters() if p.grad is not None for s in _storages(p.grad)}
        self._gradients |= set(held)
        for key, storage in held.items():
            known = self._refs.get(key)
            if known is not None and known[0]() is storage:
                self._refs[key] = (known[0], "gradients")
        def regraded(noted: list[tuple[weakref.ref, str, int]]) -> list[tuple[weakref.ref, str, int]]:
            return [(ref, "gradients" if id(ref()) in held and ref() is held[id(ref())] else category, nbytes)
                    for ref, category, nbytes in noted]

        self._at_peak = regraded(self._at_peak)
        self._moments = {key: (total, regraded(noted)) for key, (total, noted) in self._moments.items()}

    # -- the report ----------------------------------------------------------------------------------------

    def categories(self) -> dict[str, int]:
        """Bytes by category at the peak (they add up to :attr:`peak`). A storage still alive that now
        holds a gradient or optimizer state is counted as such, whatever it was when it was created."""
        self.note_gradients()
        return self._totals(self._at_peak)

    def freed_elsewhere(self) -> int:
        """Bytes counted at the peak whose storages a thread other than the block's own freed, so far (the tracker
        keeps listening after its block). The thread that drops a storage's last reference frees it. On live gloo
        ranks that is sometimes gloo's own worker thread, still holding a finished collective's tensors a moment
        after the rank's code let go of them, and a peak noted in that moment counts bytes the code no longer held.
        0 means that every byte counted at the peak was freed by the block's own thread, or is still held: the peak
        is what the block's code held, whatever the timing (a lag only adds bytes, so the peak's moment is then
        the code's own fullest). More than 0: the peak may be off by up to that much (the worker may also simply
        have been the last to let go of a tensor the code held at the peak); measure the step again."""
        elsewhere = {id(ref) for ref in list(self._elsewhere)}
        return sum(nbytes for ref, _, nbytes in self._at_peak if id(ref) in elsewhere)

    def moments(self) -> dict[Hashable, dict[str, int]]:
        """With ``moment``: for each moment it named (and :data:`STEP_MOMENT`), the bytes by category when the
        most were held then. The peak is the largest of them. A simulation that scales a model's depth scales
        each moment and takes the largest (:func:`dtlib.sim.step.simulate`): the moment of the peak can move as a
        model deepens (from the loss to the optimizer's step, say)."""
        self.note_gradients()
        return {key: self._totals(noted) for key, (_, noted) in self._moments.items()}

    def _totals(self, noted: list[tuple[weakref.ref, str, int]]) -> dict[str, int]:
        grads = self._gradients
        state = set()
        if self.optimizer is not None:
            state = {id(s) for st in self.optimizer.state.values() for v in st.values() for s in _storages(v)}
        totals = dict.fromkeys(CATEGORIES, 0)
        for ref, category, nbytes in noted:
            storage = ref()
            if storage is not None and id(storage) in grads:
                category = "gradients"
            elif storage is not None and id(storage) in state:
                category = "optimizer"
            totals[category] += nbytes
        return totals
