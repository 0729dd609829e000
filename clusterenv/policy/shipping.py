"""Shipping a torch policy to workers and running it there.

A policy is a ``torch.nn.Module`` mapping a batch of observations ``(B, *obs_shape)`` to
one output per action ``(B, A)`` (logits, or Q-values). For a ``Dict`` or ``Tuple``
observation space the batch is a dict (keys in space order) or tuple of such tensors,
nested as the space is. It travels in two parts:

* the *architecture*, once: the module cloudpickled with every tensor replaced by an
  empty placeholder of the same shape and dtype, so no weight bytes hide in the pickle;
* the *weights*, on every shipment or pull: each parameter and buffer (persistent or not)
  as one raw array frame, in a fixed name order that both ends derive from the module.

Workers run the module on CPU, in eval mode, under ``torch.inference_mode()``, with one
intra-op thread (workers already are the parallelism). Floating observations are
passed as float32; integer observations (images, Discrete indices) unchanged, for the
module to scale or embed.

The learner's module may live on a GPU (CUDA or MPS): both parts still travel as CPU data,
so a worker never needs the learner's device. The architecture's placeholders are CPU
tensors whatever the device, and a weight snapshot packs every tensor into one byte buffer
on the device, copied to the host at once (one device-to-host transfer per snapshot). The
learner's own copy (for the KL probes) runs on the module's device (:meth:`LocalPolicy.to`).

This module imports torch; the rest of clusterenv imports it lazily, so workers that
never receive a policy never pay for it.
"""

from __future__ import annotations

import io
import logging
from typing import Any

import cloudpickle
import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector.utils import create_empty_array
from torch import nn

from clusterenv.errors import PolicyError
from clusterenv.policy.heads import Head
from clusterenv.wire.leaves import is_array_tree

__all__ = [
    "LocalPolicy",
    "build_module",
    "load_weights",
    "module_device",
    "pack_architecture",
    "policy_tensors",
    "resolve_device",
    "snapshot_weights",
    "validate_policy",
]

logger = logging.getLogger(__name__)

_PROBE_BATCH = 2
# Each tensor starts on a cache line of the snapshot buffer, so its numpy view is aligned for any dtype.
_ALIGN = 64


def _placeholder(shape: tuple[int, ...], dtype: str, requires_grad: bool, is_parameter: bool) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
    return nn.Parameter(tensor, requires_grad=requires_grad) if is_parameter else tensor


class _ArchitecturePickler(cloudpickle.Pickler):
    """cloudpickle, with tensors reduced to placeholders: the weights travel as array frames."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            dtype = str(obj.dtype).removeprefix("torch.")
            return _placeholder, (tuple(obj.shape), dtype, obj.requires_grad, isinstance(obj, nn.Parameter))
        return super().reducer_override(obj)


def pack_architecture(module: nn.Module) -> bytes:
    """The module's pickled architecture (no weight bytes); :class:`PolicyError` if it cannot be pickled."""
    buffer = io.BytesIO()
    try:
        _ArchitecturePickler(buffer).dump(module)
    except Exception as exc:
        raise PolicyError(
            f"The policy {type(module).__name__} cannot be pickled with cloudpickle, so it cannot be sent to "
            f"workers: {type(exc).__name__}: {exc}. Keep locks, files, sockets and generators out of the module."
        ) from exc
    return buffer.getvalue()


def build_module(architecture: bytes) -> nn.Module:
    """Unpickle an architecture from :func:`pack_architecture`; its tensors are uninitialised until loaded."""
    module = cloudpickle.loads(architecture)
    if not isinstance(module, nn.Module):
        raise PolicyError(f"The shipped policy is a {type(module).__name__}, not a torch.nn.Module.")
    return module.eval()


def policy_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, tied tensors once: what a weight shipment carries."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def module_device(module: nn.Module) -> torch.device:
    """The one device that holds all of the module's parameters and buffers (CPU if it has none).

    Raises:
        PolicyError: the tensors are spread over several devices, or are on the ``meta`` device.
    """
    devices = {tensor.device for tensor in policy_tensors(module).values()}
    if len(devices) > 1:
        raise PolicyError(
            f"The policy's tensors are on several devices ({', '.join(sorted(map(str, devices)))}); "
            "move the whole module to one with `policy.to(device)`."
        )
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "meta":
        raise PolicyError(
            "The policy's tensors are on the `meta` device, which holds no values to ship; "
            "materialise the module (e.g. `policy.to_empty(device='cpu')` and load its weights) first."
        )
    return device


def _device_reachable(device: torch.device) -> str | None:
    """Why this process cannot run tensors on ``device``, or None if it can."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"this torch {torch.__version__} has no usable CUDA (`torch.cuda.is_available()` is False)"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"only {torch.cuda.device_count()} CUDA device(s) are visible"
    elif device.type == "mps" and not torch.backends.mps.is_available():
        return f"this torch {torch.__version__} has no usable MPS (`torch.backends.mps.is_available()` is False)"
    elif device.type == "meta":
        return "the `meta` device holds no values"
    return None


def resolve_device(module: nn.Module, device: str | torch.device | None) -> torch.device:
    """Where the learner runs its copy of ``module``: where the module lives, checked against ``device``.

    ``device=None`` takes the module's device. An explicit ``device`` must be reachable from
    this process and name the module's device; ``"cuda"`` without an index matches any CUDA device.

    Raises:
        TypeError: ``device`` is not a str or ``torch.device``.
        PolicyError: ``device`` is not a device, cannot be reached, or is not where the module lives.
    """
    actual = module_device(module)
    if device is None:
        return actual
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"`device` must be a str or torch.device such as 'cuda' or 'cpu', got {type(device).__name__} {device!r}."
        )
    try:
        wanted = torch.device(device)
    except RuntimeError as exc:
        raise PolicyError(f"`device={device!r}` is not a torch device: {exc}") from None
    why = _device_reachable(wanted)
    if why is not None:
        raise PolicyError(
            f"`device={str(wanted)!r}` cannot be used by this learner: {why}. The policy lives on {actual}; "
            f"pass `device={str(actual)!r}` (or leave `device` unset) to keep it there."
        )
    if wanted.type != actual.type or (None not in (wanted.index, actual.index) and wanted.index != actual.index):
        raise PolicyError(
            f"`device={str(wanted)!r}`, but the policy lives on {actual}: move it first with "
            f"`policy.to({str(wanted)!r})`, or pass `device={str(actual)!r}`."
        )
    return actual


def snapshot_weights(module: nn.Module) -> tuple[list[str], list[np.ndarray]]:
    """Names and private numpy copies of the module's tensors (later training does not change them).

    The tensors are packed into one byte buffer on their device, which is copied to the host
    at once: one device-to-host transfer (and one synchronisation) however many tensors the
    module has. The arrays are aligned views of that host buffer.
    """
    tensors = policy_tensors(module)
    device = module_device(module)
    layout: list[tuple[np.dtype, tuple[int, ...], int, int]] = []  # dtype, shape, offset, bytes
    size = 0
    for name, tensor in tensors.items():
        try:
            dtype = torch.empty(0, dtype=tensor.dtype).numpy().dtype
        except (TypeError, RuntimeError) as exc:  # bfloat16, complex32, quantized dtypes
            raise PolicyError(
                f"Policy tensor `{name}` has dtype {tensor.dtype}, which has no numpy equivalent to travel as "
                "raw bytes; cast the policy to float32 (or float16) before handing it over."
            ) from exc
        nbytes = tensor.numel() * tensor.element_size()
        layout.append((dtype, tuple(tensor.shape), size, nbytes))
        size += -(-nbytes // _ALIGN) * _ALIGN
    packed = torch.empty(size, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for tensor, (_, _, offset, nbytes) in zip(tensors.values(), layout, strict=True):
            packed[offset : offset + nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))
    host = packed.cpu().numpy()  # the one device-to-host copy (a no-op for a CPU module: `packed` is already private)
    arrays = [host[offset : offset + nbytes].view(dtype).reshape(shape) for dtype, shape, offset, nbytes in layout]
    return list(tensors), arrays


def load_weights(module: nn.Module, names: list[str], arrays: list[np.ndarray]) -> None:
    """Copy shipped arrays into the module's tensors, checking names and shapes."""
    tensors = policy_tensors(module)
    if list(tensors) != list(names):
        raise PolicyError(
            f"Weights name the tensors {list(names)[:6]}..., but the policy has {list(tensors)[:6]}...: "
            "publish a module with the architecture that was shipped."
        )
    with torch.no_grad():
        for name, array in zip(names, arrays, strict=True):
            target = tensors[name]
            if tuple(target.shape) != array.shape:
                raise PolicyError(
                    f"Weights for `{name}` have shape {array.shape}, "
                    f"but the shipped policy expects {tuple(target.shape)}."
                )
            # Received frames are read-only; torch wants writable memory to wrap.
            target.copy_(torch.from_numpy(np.array(array)))


def _as_input(obs: np.ndarray) -> torch.Tensor:
    if obs.dtype.kind == "f" and obs.dtype != np.float32:
        obs = obs.astype(np.float32)
    elif not obs.flags.writeable:
        obs = obs.copy()
    return torch.from_numpy(obs)


def _as_inputs(obs: Any, device: torch.device) -> Any:
    """A batch of observations as the module takes it: one tensor per leaf, in the value's dict/tuple structure."""
    if isinstance(obs, np.ndarray):  # the common case first: one array space, no tree to walk
        return _as_input(obs).to(device)
    if isinstance(obs, dict):
        return {key: _as_inputs(value, device) for key, value in obs.items()}
    return tuple(_as_inputs(value, device) for value in obs)


def _describe(inputs: Any) -> str:
    """``{'image': (2, 6, 5, 3) uint8, ...}``: the structure, shapes and dtypes of the module's input."""
    if isinstance(inputs, torch.Tensor):
        return f"{tuple(inputs.shape)} {str(inputs.dtype).removeprefix('torch.')}"
    if isinstance(inputs, dict):
        return "{" + ", ".join(f"{key!r}: {_describe(value)}" for key, value in inputs.items()) + "}"
    parts = [_describe(value) for value in inputs]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


class LocalPolicy:
    """A shipped module plus its version: numpy observations in, float32 outputs ``(B, A)`` out.

    Observations are one array, or for ``Dict``/``Tuple`` spaces a dict/tuple of arrays
    (nested as the space is), batched along the first axis of every leaf.

    It is built on CPU (a worker's copy stays there); the learner moves its own copy to the
    policy's device with :meth:`to`, and outputs still come back as host numpy arrays.
    """

    def __init__(self, architecture: bytes, names: list[str], arrays: list[np.ndarray], version: int) -> None:
        self.module = build_module(architecture)
        self.names = list(names)
        self.device = torch.device("cpu")
        self.load(arrays, version)

    def load(self, arrays: list[np.ndarray], version: int) -> None:
        """Replace the weights; ``version`` is the learner version they came from."""
        load_weights(self.module, self.names, arrays)
        self.version = version

    def arrays(self) -> list[np.ndarray]:
        """The weights held, as numpy views of the (CPU) module's tensors, in :attr:`names` order."""
        tensors = policy_tensors(self.module)
        return [tensors[name].detach().numpy() for name in self.names]

    def to(self, device: torch.device) -> None:
        """Run the module on ``device`` from now on."""
        self.module.to(device)
        self.device = device

    def copy_from(self, module: nn.Module, version: int) -> None:
        """Take ``module``'s current weights tensor by tensor, device to device, with no host round trip."""
        tensors, sources = policy_tensors(self.module), policy_tensors(module)
        if list(sources) != self.names:
            raise PolicyError(
                f"The module has tensors {list(sources)[:6]}..., but this policy has {self.names[:6]}...: "
                "publish a module with the architecture that was shipped."
            )
        with torch.no_grad():
            for name, source in sources.items():
                tensors[name].copy_(source)
        self.version = version

    def outputs(self, obs: Any) -> np.ndarray:
        """The module's outputs on a batch of observations (an array, or a dict/tuple tree), on :attr:`device`."""
        with torch.inference_mode():
            out = self.module(_as_inputs(obs, self.device))
        return out.detach().to(torch.float32).cpu().numpy()


def validate_policy(module: nn.Module, observation_space: spaces.Space, action_space: spaces.Space, head: Head) -> None:
    """Raise :class:`PolicyError` unless ``module`` maps batched observations to the outputs ``head`` needs.

    The sample batch has the structure the workers will pass: one tensor for an array
    space, a dict/tuple of tensors (nested) for a ``Dict``/``Tuple`` space. Run it on a
    CPU copy (:func:`build_module` plus :func:`load_weights`): it calls the module.
    """
    width = head.output_width(action_space)  # raises if the head cannot act in this space
    if not is_array_tree(observation_space):
        raise PolicyError(
            "Local policies take observations of array spaces (Box, Discrete, MultiDiscrete, MultiBinary, and "
            f"Dict/Tuple of them, nested), but the envs have observation space {observation_space}."
        )
    sample = create_empty_array(observation_space, n=_PROBE_BATCH, fn=np.zeros)
    inputs = _as_inputs(sample, torch.device("cpu"))
    try:
        with torch.inference_mode():
            out = module(inputs)
    except Exception as exc:
        if isinstance(inputs, torch.Tensor):
            given = f"of shape {tuple(inputs.shape)} and dtype {np.asarray(sample).dtype}"
        else:
            kind = "dict" if isinstance(inputs, dict) else "tuple"
            given = (
                f"of space {observation_space}, passed as a {kind} of tensors {_describe(inputs)} (wrap the env in "
                "gymnasium.wrappers.FlattenObservation for one flat vector instead)"
            )
        raise PolicyError(f"The policy raised {type(exc).__name__} on a batch of observations {given}: {exc}") from exc
    if (
        not isinstance(out, torch.Tensor)
        or out.ndim != 2
        or out.shape[0] != _PROBE_BATCH
        or not out.is_floating_point()
    ):
        got = f"shape {tuple(out.shape)} and dtype {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise PolicyError(
            f"The policy must map a batch of {_PROBE_BATCH} observations to floating outputs of shape "
            f"({_PROBE_BATCH}, {width}) for the {type(head).__name__} head on {action_space}, got {got}."
        )
    head.check_width(action_space, int(out.shape[1]))
