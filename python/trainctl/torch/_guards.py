"""What keeps a training loop exact around ``Elastic``: the optimizer is stepped by the job
alone (once every rank agreed the step is whole) and no other optimizer steps while it trains,
the LR scheduler (and an ``AveragedModel`` given as ``state=``) steps only after an update the
job made, a GradScaler is the job's, and a step whose gradients were not all-reduced is
refused, naming why. Each guard refuses, at once and saying what to do, the use that would
otherwise train a wrong model without a word.

The guards change nothing the objects save: the optimizer gets a step pre-hook (PyTorch's own
extension point); the scheduler and the scaler get a subclass of their own class made here
(``state_dict`` and ``load_state_dict`` are the class's, so their checkpoints are plain).
"""

from __future__ import annotations

import importlib
import weakref
from typing import Any, Callable, Protocol, TypeVar

import torch

from ._errors import UsageError


class Live(Protocol):
    """The job training in this process, as the process-wide guards see it."""

    optimizer: torch.optim.Optimizer
    scaler: Any



# How the job each guarded scaler belongs to says it steps it (kept out of the scaler's own
# ``__dict__``).
_STEPPING: weakref.WeakKeyDictionary[Any, Callable[[], bool]] = weakref.WeakKeyDictionary()
# The job of this process while it trains (one at a time).
_LIVE: list[weakref.ReferenceType[Live]] = []


def live_job() -> Live | None:
    return _LIVE[0]() if _LIVE else None


def set_live(job: Live | None) -> None:
    _LIVE.clear()
    if job is not None:
        _LIVE.append(weakref.ref(job))


# --- the optimizer ------------------------------------------------------------------------


def guard_optimizer(stepping: Callable[[], bool], optimizer: torch.optim.Optimizer) -> Any:
    """Refuses every ``optimizer.step()`` but the job's (``stepping()`` says when the job steps
    it; ``scaler.step(optimizer)`` included), before it changes anything. Returns the hook's
    handle."""

    def pre_hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if not stepping():
            raise UsageError(
                "optimizer.step() was called by the training loop: with trainctl.torch the job "
                "steps the optimizer at the end of each `with job.step():`, once every rank agreed "
                "the step is whole (a second step would apply the update twice). Remove your "
                "optimizer.step() (and scaler.step()/scaler.update(): give the GradScaler to "
                "Elastic as scaler=...)"
            )

    return optimizer.register_step_pre_hook(pre_hook)


def refuse_stray_scheduler(optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """An LR scheduler that steps this optimizer but was not given to Elastic would not travel
    to a joining node, nor into the checkpoint: the ranks' learning rates would part."""
    if scheduler is None and getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        raise UsageError(
            "an LR scheduler was made for this optimizer but not given to Elastic: pass it as "
            "Elastic(..., scheduler=scheduler) (it then travels to joining nodes and into the "
            "checkpoint, and steps only after an update the job made); with several, give the "
            "one you step (a SequentialLR or ChainedScheduler of them)"
        )


def refuse_foreign_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer given to Elastic updates the model given to it, nothing else: other
    parameters would not be all-reduced, and would part among the ranks."""
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise UsageError(
            f"the optimizer given to Elastic updates {foreign} parameter(s) that are not the "
            "model's: the job all-reduces the gradients of the model it is given (through DDP), "
            "so those would part among the ranks. Give Elastic the module that holds them all "
            "(an nn.ModuleDict of your parts, say), or an optimizer over the model's parameters"
        )


def refuse_other_optimizers() -> None:
    """While a job trains, an optimizer other than its own is refused at its first step,
    before it changes anything: its parameters are not all-reduced by the job, its state does
    not travel or go into the checkpoint, and its steps would be applied on the side (a GAN's
    second optimizer). Installed once per process (PyTorch's global step pre-hook)."""
    if _OTHERS_HOOKED:
        return
    # The module, not torch.optim's attribute of that name (which torch removes).
    register = getattr(importlib.import_module("torch.optim.optimizer"), "register_optimizer_step_pre_hook", None)
    if register is None:
        return

    def pre_hook(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        job = live_job()
        if job is None or optimizer is job.optimizer:
            return
        n = sum(len(g["params"]) for g in optimizer.param_groups)
        raise UsageError(
            f"a second optimizer ({type(optimizer).__name__} over {n} parameter tensors) was stepped "
            "by the training loop: trainctl.torch trains the model given to Elastic with the one "
            "optimizer given to it, which the job steps once every rank agreed a step is whole. "
            "Another optimizer's gradients are not all-reduced by the job, its state does not "
            "travel to a joining rank or into the checkpoint, and its steps would be applied on "
            "the side, so the model would be wrong after a regroup. Several optimizers stepped at "
            "different points of an iteration (a GAN's generator and discriminator) are not "
            "supported: use one optimizer over one model (its param groups can differ in "
            "settings), or run this program with plain DDP under torchrun"
        )

    _OTHERS_HOOKED.append(register(pre_hook))


_OTHERS_HOOKED: list[Any] = []


def refuse_unreduced(module: torch.nn.Module, hook_ran: bool, ddp_options: dict[str, Any]) -> None:
    """Called when a step's flags did not ride its gradients' all-reduce: refuses the step
    when its gradients were not all-reduced, naming the cause, the parameters that received
    no gradient (DDP waits for them unless ``find_unused_parameters``) before ``no_sync()``."""
    params = list(module.named_parameters())
    if not any(p.grad is not None for _, p in params):
        return
    unused = [name for name, p in params if p.requires_grad and p.grad is None]
    if unused and not ddp_options.get("find_unused_parameters"):
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        raise UsageError(
            f"this step's gradients were not all-reduced: {len(unused)} parameter(s) received no "
            f"gradient ({shown}), and DDP waits for every parameter's gradient before it "
            "all-reduces. Give Elastic ddp={'find_unused_parameters': True} (as you would give "
            "DistributedDataParallel), or leave those parameters out of the model"
        )
    if not hook_ran:
        raise UsageError(
            "this step's gradients were not all-reduced: its backward ran under no_sync(), "
            "or through the model itself instead of job.model, and the ranks would part. "
            "For gradient accumulation give Elastic accumulate=K (one `with job.step():` "
            "per micro-batch; the job all-reduces on the last) and drop no_sync()"
        )


# --- the scheduler and the scaler ---------------------------------------------------------

_SUBCLASSES: dict[tuple[type, str], type] = {}


def _subclass(base: type, kind: str, methods: dict[str, Callable[..., Any]]) -> type:
    """``base`` with ``methods``: named as ``base``, and pickled as a plain ``base`` (a copy
    outside the job is the user's own object again)."""
    key = (base, kind)
    if key not in _SUBCLASSES:

        def __reduce_ex__(self: Any, protocol: Any) -> Any:
            state = self.__getstate__() if hasattr(self, "__getstate__") else dict(self.__dict__)
            return (_plain, (base, state))

        body: dict[str, Any] = {"__module__": base.__module__, "__reduce_ex__": __reduce_ex__, **methods}
        _SUBCLASSES[key] = type(base.__name__, (base,), body)
    return _SUBCLASSES[key]


_T = TypeVar("_T")


def _plain(cls: type[_T], state: Any) -> _T:
    """An unpickled guarded object: ``cls`` itself, with its state."""
    obj = cls.__new__(cls)
    if hasattr(obj, "__setstate__"):
        obj.__setstate__(state)
    else:
        obj.__dict__.update(state)
    return obj


def _unguarded(obj: Any) -> type[Any]:
    """The user's class of ``obj``, whether or not a guard subclassed it already."""
    cls = type(obj)
    return cls.__mro__[1] if cls in set(_SUBCLASSES.values()) else cls


# The gate of each gated object (see gate_method), kept out of its own ``__dict__``.
_GATES: weakref.WeakKeyDictionary[Any, Callable[[], bool]] = weakref.WeakKeyDictionary()


def gate_method(obj: Any, name: str, may_run: Callable[[], bool]) -> None:
    """``obj.name(...)`` runs only when ``may_run()`` says so, and does nothing (returns None)
    otherwise; ``obj`` keeps its class's name, state and pickling."""
    base = _unguarded(obj)
    own = getattr(base, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        gate = _GATES.get(self)
        if gate is not None and not gate():
            return None
        return own(self, *args, **kwargs)

    obj.__class__ = _subclass(base, f"gate {name}", {name: method})
    _GATES[obj] = may_run


def gate_scheduler(may_run: Callable[[str], bool], scheduler: Any) -> None:
    """``scheduler.step()`` steps it only when the job applied an update since its last step:
    after a dropped step (a peer lost) or a micro-batch of an accumulation, it does nothing.
    Wherever the loop steps it after ``with job.step()``, per step or per epoch, every rank's
    schedule then follows the updates the job applied, a joiner's too."""
    gate_method(scheduler, "step", lambda: may_run("scheduler.step()"))


def guard_scaler(stepping: Callable[[], bool], scaler: Any) -> None:
    """The job steps the optimizer through ``scaler`` and updates it; the loop's own
    ``scaler.step()``/``scaler.update()`` are refused (scaling, ``unscale_`` for clipping and
    ``get_scale`` are the loop's)."""
    base = _unguarded(scaler)

    def refuse(name: str) -> Callable[..., Any]:
        own = getattr(base, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            job_steps = _STEPPING.get(self)
            if job_steps is not None and not job_steps():
                raise UsageError(
                    f"scaler.{name}() was called by the training loop: the GradScaler given to "
                    "Elastic is stepped and updated by the job at the end of each `with "
                    "job.step():`, once every rank agreed the step is whole. Remove your "
                    "scaler.step(optimizer) and scaler.update(); keep scaler.scale(loss).backward()"
                )
            return own(self, *args, **kwargs)

        return method

    scaler.__class__ = _subclass(base, "scaler", {"step": refuse("step"), "update": refuse("update")})
    _STEPPING[scaler] = stepping


def _grad_scaler_class() -> type[Any] | None:
    amp = getattr(torch, "amp", None)
    return getattr(amp, "GradScaler", None)


_SCALE_PATCHED: list[Callable[..., Any]] = []


def refuse_stray_scalers() -> None:
    """A GradScaler not given to Elastic scales the loss, and the job would step the optimizer
    on gradients thousands of times too large: its ``scale()`` is refused while a job trains."""
    cls = _grad_scaler_class()
    if cls is None or _SCALE_PATCHED:
        return
    original = cls.scale
    _SCALE_PATCHED.append(original)

    def scale(self: Any, outputs: Any) -> Any:
        job = live_job()
        if job is not None and job.scaler is not self and getattr(self, "_enabled", True):
            raise UsageError(
                "a GradScaler that was not given to Elastic scales the loss: the job steps the "
                "optimizer, and would step it on scaled gradients. Pass it as "
                "Elastic(..., scaler=scaler) and remove your scaler.step(optimizer) and "
                "scaler.update()"
            )
        return original(self, outputs)

    cls.scale = scale


def refuse_at_start(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """What ``Elastic(...)`` refuses before anything starts."""
    # Before the group check: the other job's group is the one initialized.
    if live_job() is not None:
        raise UsageError(
            "a second Elastic was made in this process while the first one trains: one job per "
            "process (give the first one everything, or call job.finish() on it first)"
        )
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise UsageError(
            "Elastic was given a DistributedDataParallel model: give it the model itself; "
            "job.model is the model wrapped in DDP, wrapped again after each regroup"
        )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise UsageError(
            "a process group is already initialized: Elastic starts (and restarts) the group "
            "itself; remove your dist.init_process_group(...)"
        )
    refuse_foreign_parameters(model, optimizer)
    refuse_stray_scheduler(optimizer, scheduler)


def guard_all(stepping: Callable[[], bool], may_run: Callable[[str], bool], state: Any, job: Live) -> Any:
    """Every guard around a job's objects (``state``: its ``TrainingState``), and ``job`` the
    process's live one. Returns the optimizer hook's handle."""
    hook = guard_optimizer(stepping, state.optimizer)
    if state.scheduler is not None:
        gate_scheduler(may_run, state.scheduler)
    if state.scaler is not None:
        guard_scaler(stepping, state.scaler)
    state.kept.gate(may_run)
    refuse_stray_scalers()
    refuse_other_optimizers()
    set_live(job)
    return hook
